"""Gateway benchmark: jobs per second through admission -> Redis queue -> dispatch -> completion.

Measures the gateway alone: a real redis-server and a real gateway process, but the
workers are deliberately INSTANT stand-ins (threads speaking the wire protocol that
answer every job with one token at once), so what is timed is admission, queueing,
dispatch, streaming and completion, not a model. Reports jobs/s, Redis commands per
job (from MONITOR, split by the Lua script each EVALSHA runs; heartbeats and periodic
maintenance counted apart), and the gateway's added latency (submit round trip and
submit-to-result, p50 and p99).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import protocol as P  # noqa: E402
from common.redis_keys import load_scripts  # noqa: E402
from common.redis_server import RedisServer  # noqa: E402
from common.keys import generate as generate_keys  # noqa: E402
from common.ports import free_port  # noqa: E402
from common.sockets import curve_client, make_socket  # noqa: E402

# Commands a job's lifecycle causes: admission, dispatch (peek + claim, batched), completion, and any
# job read (a stream or status request that the gateway could not answer from memory).
PER_JOB_SCRIPTS = {"admit", "peek", "claim", "complete", "HGETALL"}


class InstantWorker(threading.Thread):
    """Stand-in worker: one token per job, immediately. Only for measuring the gateway."""

    def __init__(self, worker_id: str, endpoint: str, slots: int, keys: dict) -> None:
        super().__init__(daemon=True)
        self.worker_id, self.endpoint, self.slots, self.keys = worker_id, endpoint, slots, keys
        self.stop = threading.Event()

    def run(self) -> None:
        sock = make_socket(zmq.Context.instance(), zmq.DEALER, identity=self.worker_id.encode())
        # Authenticated like a real worker (CURVE is on by default): its cost is part of what is measured.
        curve_client(sock, str(self.keys["gateway_public"]), self.keys[f"worker:{self.worker_id}"])
        sock.connect(self.endpoint)
        sock.send(P.encode(P.WorkerHello(self.worker_id, "instant", 512, 2048, self.slots, 1 << 20)))
        last = 0.0
        while not self.stop.is_set():
            if sock.poll(5):
                msg = P.decode(sock.recv())
                if isinstance(msg, P.DispatchJob):
                    sock.send(P.encode(P.JobTokens(msg.job_id, msg.attempt, 0, [7])))
                    sock.send(P.encode(P.JobFinished(msg.job_id, msg.attempt, "done", "length", 1, 0.0, 0.0, 0,
                                                      token_ids=[7])))
            now = time.monotonic()
            if now - last > 0.5:
                last = now
                sock.send(P.encode(P.WorkerLoad(self.worker_id, self.slots, 1 << 20, {}, {}, [], 0.0)))
        sock.close(linger=0)


def monitor(redis_url_port: int, out: list[str], stop: threading.Event) -> None:
    import redis

    r = redis.Redis(port=redis_url_port)
    with r.monitor() as m:
        for cmd in m.listen():
            out.append((cmd.get("client_type", ""), cmd.get("client_address", ""), cmd["command"]))
            if stop.is_set():
                break


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--clients", type=int, default=8, help="concurrent client threads")
    ap.add_argument("--workers", type=int, default=2, help="instant stand-in workers")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--redis-aof", choices=("off", "everysec", "always"), default="off",
                    help="Redis's append-only file: off (the default, as before), or on with that appendfsync "
                         "(compose runs everysec; always: no acknowledged admission lost to a host crash)")
    args = ap.parse_args(argv)
    print("NOTE: workers are instant stand-ins (1 token per job, no model): this measures the gateway alone.")

    tmp = Path(tempfile.mkdtemp(prefix="ts-bench-gw-"))
    (tmp / "tenants.toml").write_text('[[tenant]]\nname = "bench"\napi_key = "bench-key"\ntiers = ["P3"]\n')
    client_ep, worker_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    keys = generate_keys(tmp / "keys", [f"instant-{i}" for i in range(args.workers)])
    aof = {} if args.redis_aof == "off" else {"appendonly": True, "extra_args": ["--appendfsync", args.redis_aof]}
    with RedisServer(**aof) as rs:
        gw = subprocess.Popen([sys.executable, "-m", "gateway", "--client-bind", client_ep, "--worker-bind",
                               worker_ep, "--redis-url", rs.url, "--tenants-file", str(tmp / "tenants.toml"),
                               "--gateway-id", "gw-bench", "--log-level", "WARNING"], cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT),
                                       TS_GATEWAY_CURVE_SECRET_KEY_FILE=str(keys["gateway_secret"]),
                                       TS_GATEWAY_AUTHORIZED_WORKERS_DIR=str(keys["allow_list"])))
        workers = [InstantWorker(f"instant-{i}", worker_ep, 64, keys) for i in range(args.workers)]
        for w in workers:
            w.start()
        try:
            from gateway.sdk import GatewayClient

            probe = GatewayClient(client_ep, "bench-key", timeout_s=2)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    if len(probe.info().workers) == args.workers:
                        break
                except TimeoutError:
                    pass
            probe.close()
            shas = {s.sha: name for name, s in load_scripts(rs.client()).items()}
            commands: list = []
            stop_mon = threading.Event()
            mon = threading.Thread(target=monitor, args=(rs.port, commands, stop_mon), daemon=True)
            mon.start()
            submit_s: list[float] = []
            total_s: list[float] = []
            per_client = args.jobs // args.clients

            def run_client() -> None:
                c = GatewayClient(client_ep, "bench-key", timeout_s=30)
                for _ in range(per_client):
                    t0 = time.perf_counter()
                    job = c.submit(prompt_token_ids=[5, 6, 7], max_tokens=1)
                    t1 = time.perf_counter()
                    job.result(timeout=30)
                    submit_s.append(t1 - t0)
                    total_s.append(time.perf_counter() - t0)
                c.close()

            t0 = time.perf_counter()
            threads = [threading.Thread(target=run_client) for _ in range(args.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            stop_mon.set()
            rs.client().ping()  # one more command so the monitor loop wakes up and sees the stop flag
            mon.join(timeout=5)
        finally:
            for w in workers:
                w.stop.set()
            gw.terminate()
            gw.wait(timeout=10)
            shutil.rmtree(tmp, ignore_errors=True)  # the keys and tenants file: this run's only

    jobs = len(total_s)
    by_kind: Counter = Counter()
    for client_type, _, command in commands:
        if client_type == "lua" or " " not in command and not command:
            continue
        parts = command.split()
        name = parts[0].upper()
        if name == "EVALSHA":
            by_kind[f"script:{shas.get(parts[1], parts[1][:8])}"] += 1
        elif name not in ("MONITOR", "PING", "CLIENT", "INFO", "HELLO"):
            by_kind[name] += 1
    per_job = sum(n for k, n in by_kind.items() if k.removeprefix("script:") in PER_JOB_SCRIPTS) / max(1, jobs)
    other = sum(n for k, n in by_kind.items() if k.removeprefix("script:") not in PER_JOB_SCRIPTS)

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * (len(xs) - 1)))] if xs else float("nan")

    result = {
        "jobs": jobs, "wall_s": wall, "jobs_per_s": jobs / wall,
        "redis_commands_per_job": per_job, "redis_commands_other": other, "redis_commands_by_kind": dict(by_kind),
        "submit_rtt_p50_ms": pct(submit_s, 0.5) * 1e3, "submit_rtt_p99_ms": pct(submit_s, 0.99) * 1e3,
        "job_total_p50_ms": pct(total_s, 0.5) * 1e3, "job_total_p99_ms": pct(total_s, 0.99) * 1e3,
        "mean_total_ms": statistics.fmean(total_s) * 1e3 if total_s else None,
        "settings": vars(args) | {"json": str(args.json) if args.json else None},
        "note": "instant stand-in workers: gateway, Redis and ZeroMQ overhead only",
    }
    print(f"{jobs} one-token jobs from {args.clients} clients in {wall:.2f} s: {result['jobs_per_s']:.0f} jobs/s")
    print(f"Redis commands per job (admit + peek + claim + complete + job reads): {per_job:.2f}; other (heartbeats, "
          f"maintenance, status): {other}")
    print(f"submit round trip p50 {result['submit_rtt_p50_ms']:.2f} ms, p99 {result['submit_rtt_p99_ms']:.2f} ms; "
          f"submit to result p50 {result['job_total_p50_ms']:.2f} ms, p99 {result['job_total_p99_ms']:.2f} ms")
    print("by kind:", json.dumps(dict(by_kind)))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
