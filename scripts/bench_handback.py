"""A worker stopped mid-stream, seen by the client: the longest pause in its stream, and the stream's length.

Starts a local cluster (scripts/up.py of TREE: this checkout, or an older worktree with its own .venv, so that
versions can be compared side by side), streams a 900-token HTTP completion through the official openai client,
sends SIGTERM to the worker running it after 30 chunks, and prints one JSON line: chunks, the longest pause after
the signal, the stream's total seconds, and the attempt that finished the job. Every process it starts is stopped.

    .venv/bin/python scripts/bench_handback.py . --drain-s 4      # extra arguments go to up.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from openai import OpenAI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tree", type=Path, help="the checkout whose scripts/up.py and .venv to run")
    args, extra = ap.parse_known_args(argv)
    tree = str(args.tree.resolve())
    tmp = Path(tempfile.mkdtemp(prefix="ts-handback-"))
    state = tmp / "state.json"
    up = subprocess.Popen([f"{tree}/.venv/bin/python", "scripts/up.py", "--http", "--workers", "2", "--model", "bench",
                           "--max-running", "2", "--state-file", str(state), "--logs-dir", str(tmp / "logs"), *extra],
                          cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for _ in range(120):
            if state.exists():
                break
            time.sleep(0.5)
        s = json.loads(state.read_text())
        cli = OpenAI(base_url=s["http"] + "/v1", api_key=s["tenants"]["lab-co"]["api_key"], max_retries=0, timeout=180)
        r = redis.Redis.from_url(s["redis"])
        t0 = time.time(); arrivals = []; n = 0; sig = None
        for ch in cli.completions.create(model=cli.models.list().data[0].id, prompt="hello there", max_tokens=900,
                                         stream=True, temperature=0.7, seed=5, extra_body={"ignore_eos": True}):
            n += 1
            arrivals.append(time.time() - t0)
            if sig is None and n == 30:
                wid = next(r.hget(k, "worker") for k in r.scan_iter(match="ts:*:job:*")
                           if r.hget(k, "state") == b"dispatched")
                os.kill(next(w["pid"] for w in s["workers"] if w["id"] == wid.decode()), signal.SIGTERM)
                sig = time.time() - t0
        after = [a for a in arrivals if a >= sig]
        gaps = [b - a for a, b in zip(after, after[1:])]
        job = next(r.hgetall(k) for k in r.scan_iter(match="ts:*:job:*"))
        print(json.dumps({"chunks": n, "max_pause_s": round(max(gaps), 2), "total_s": round(arrivals[-1], 2),
                          "after_signal_s": round(arrivals[-1] - sig, 2), "attempt": int(job[b"attempt"])}))
    finally:
        os.killpg(up.pid, signal.SIGTERM)
        up.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
