"""What a deep queue costs each admission: submit round trips against the number of jobs queued.

Every admission (and every status of a queued job) estimates the job's wait from the jobs before it
(gateway/estimate.py). This starts a real cluster (scripts/up.py: redis-server, one gateway, one worker
with the tiny model and one batch slot, so the queue only grows), submits --jobs P3 jobs, one at a
time as fast as the gateway answers, from each of the dev tenants in turn (a tenant may hold 10,000),
and prints, per --every jobs queued, the mean submit round trip and one status round trip of the
newest job. A gateway answers every client from one loop, so what an admission costs is what every
other client waits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.sdk import GatewayClient  # noqa: E402
from scripts.up import Cluster, cluster_args, exit_on_sigterm  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=8000)
    ap.add_argument("--every", type=int, default=1000, help="report per this many jobs queued")
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    if args.jobs < 1 or args.every < 1:
        ap.error("--jobs and --every must be >= 1")
    exit_on_sigterm()  # a killed run stops its cluster
    cluster = Cluster(cluster_args(workers=1, max_running=1, model="tiny", http=False))
    rows, finished = [], False
    try:
        state = cluster.start()
        # Every dev tenant in turn (each may hold at most tenant_max_jobs unfinished jobs), all at P3.
        clients = [GatewayClient(state["gateway"], t["api_key"], timeout_s=120) for t in state["tenants"].values()]
        try:
            took: list[float] = []
            for n in tqdm(range(1, args.jobs + 1), desc="submitting", unit="job"):
                client = clients[n % len(clients)]
                t0 = time.perf_counter()
                job = client.submit(prompt_token_ids=[5] * args.prompt_tokens, max_tokens=args.max_tokens,
                                    tier="P3", ignore_eos=True)
                took.append(time.perf_counter() - t0)
                if n % args.every == 0:
                    t0 = time.perf_counter()
                    status = client.status(job.id)
                    rows.append({"queued": n, "submit_ms": 1e3 * statistics.fmean(took),
                                 "status_ms": 1e3 * (time.perf_counter() - t0),
                                 "estimate_s": status.estimated_wait_s})
                    took = []
        finally:
            for client in clients:
                client.close()
        finished = True
    finally:
        cluster.stop(remove_logs=finished)  # a failed run keeps what tells why
    print(f"{'queued':>7} {'submit ms (mean)':>17} {'status ms':>10} {'estimate s':>11}")
    for r in rows:
        print(f"{r['queued']:>7} {r['submit_ms']:>17.2f} {r['status_ms']:>10.2f} {r['estimate_s']:>11.0f}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
