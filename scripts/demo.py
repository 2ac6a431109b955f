"""The main demo: a local cluster under a mixed workload, priority against FIFO, and why the slowest P0 was slow.

Starts a real redis-server, one gateway and two workers (scripts/up.py) on the tiny model,
drives a flood of P3 batch jobs, P2 jobs and interactive P0 turns arriving during the flood
through the Python SDK, and prints a per-tier table next to the same workload under FIFO
(every job at one tier, workers without preemption). Then it explains the slowest P0
request from the cluster's own spans and draws its timeline. Every process it starts is
stopped before it exits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from argparse import Namespace
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.redis_server import redact_url  # noqa: E402
from common.errors import QuotaExceeded  # noqa: E402
from gateway.sdk import GatewayClient  # noqa: E402
from scripts.up import Cluster, cluster_args as up_cluster_args, exit_on_sigterm  # noqa: E402

# (tier, tenant, count, max_tokens, first arrival s, interval s). The P0 turns come no faster than chat-co's P0
# quota refills (scripts/up.py DEV_TENANTS: 2 per second, a burst of 4): faster, a slow machine that delays a few
# submissions and then sends them together spends the quota (tests/test_demo.py checks the fit).
WORKLOAD = [
    ("P3", "lab-co", 32, 400, 0.0, 0.0),
    ("P2", "batch-co", 8, 200, 0.2, 0.1),
    ("P0", "chat-co", 12, 24, 0.8, 0.5),
]
QUOTA_RETRIES = 20  # a refused P0 is sent again after the gateway's retry_after_s, as a client should


def submit(client: GatewayClient, refused: list[int], **kw):
    """Submit one job; a spent P0 quota waits the gateway's retry_after_s and tries again (counted in ``refused``)."""
    for _ in range(QUOTA_RETRIES):
        try:
            return client.submit(**kw)
        except QuotaExceeded as e:
            refused[0] += 1
            time.sleep(max(0.05, e.retry_after_s))
    return client.submit(**kw)


def run_workload(state: dict, fifo: bool, desc: str) -> list[dict]:
    """Submit the workload on its schedule; one thread per job waits for the result."""
    jobs = sorted(((first + i * every, tier, tenant, n) for tier, tenant, count, n, first, every in WORKLOAD
                   for i in range(count)), key=lambda j: j[0])
    results: list[dict] = []
    lock = threading.Lock()
    bar = tqdm(total=len(jobs), desc=desc, unit="job", file=sys.stderr)
    clients = {t: GatewayClient(state["gateway"], state["tenants"][t]["api_key"], timeout_s=120)
               for t in {j[2] for j in jobs}}
    threads = []
    refused = [0]

    def wait(job, tier: str, at: float) -> None:
        r = job.result(timeout=300)
        with lock:
            results.append({"id": job.id, "tier": tier, "latency_s": r.total_s, "ttft_s": r.ttft_s,
                            "preemptions": r.preemptions, "tokens": len(r.token_ids)})
            bar.update(1)

    t0 = time.monotonic()
    for i, (at, tier, tenant, n) in enumerate(jobs):
        time.sleep(max(0.0, t0 + at - time.monotonic()))  # the workload's arrival schedule
        # Under FIFO every job asks for the lowest tier: one queue, admission order, no preemption.
        job = submit(clients[tenant], refused, prompt_token_ids=[11 + i % 50, 12, 13], max_tokens=n,
                     ignore_eos=True, seed=i, tier="P3" if fifo else tier)
        # A daemon: if the run fails, the demo exits now rather than after every waiter's timeout.
        th = threading.Thread(target=wait, args=(job, tier, at), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    bar.close()
    if refused[0]:
        print(f"{desc.strip()}: {refused[0]} submissions refused over the P0 quota, sent again after retry_after_s",
              file=sys.stderr)
    if len(results) != len(jobs):
        raise RuntimeError(f"{desc.strip()}: {len(jobs) - len(results)} of {len(jobs)} jobs did not finish")
    for c in clients.values():
        c.close()
    return results


def table(runs: dict[str, list[dict]]) -> str:
    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")

    lines = [f"{'policy':<10}{'tier':<6}{'count':>6}{'done':>6}{'p50 lat s':>11}{'p99 lat s':>11}"
             f"{'p50 TTFT s':>12}{'p99 TTFT s':>12}{'preemptions':>13}"]
    for policy, res in runs.items():
        for tier in ("P0", "P2", "P3"):
            rs = [r for r in res if r["tier"] == tier]
            lat = [r["latency_s"] for r in rs]
            ttft = [r["ttft_s"] for r in rs if r["ttft_s"] is not None]
            lines.append(f"{policy:<10}{tier:<6}{len(rs):>6}{len(rs):>6}{pct(lat, .5):>11.3f}{pct(lat, .99):>11.3f}"
                         f"{pct(ttft, .5):>12.3f}{pct(ttft, .99):>12.3f}{sum(r['preemptions'] for r in rs):>13}")
    return "\n".join(lines)


def cluster_args(policy: str, spans_file: Path) -> Namespace:
    # No HTTP front door: the demo drives the cluster through the SDK.
    return up_cluster_args(workers=2, max_running=4, spans_file=spans_file, policy=policy, http=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "demo-output", help="folder for spans, PNG and JSON")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    exit_on_sigterm()  # a killed run stops its cluster
    runs: dict[str, list[dict]] = {}
    spans = {p: args.out / f"spans-{p}.jsonl" for p in ("priority", "fifo")}
    for policy in ("priority", "fifo"):
        spans[policy].unlink(missing_ok=True)
        cluster = Cluster(cluster_args(policy, spans[policy]))
        try:
            state = cluster.start()
            print(f"{policy}: cluster up (redis {redact_url(state['redis'])}, gateway {state['gateway']}, 2 workers)",
                  file=sys.stderr)
            runs[policy] = run_workload(state, fifo=policy == "fifo", desc=f"{policy:>8}")
        finally:
            # Processes flush their spans (the run's record, in --out) as they exit; a failed run keeps its logs.
            cluster.stop(remove_logs=policy in runs)
    print("\n" + table(runs))
    p0 = {p: statistics.fmean(r["latency_s"] for r in res if r["tier"] == "P0") for p, res in runs.items()}
    print(f"\nP0 mean latency: priority {p0['priority']:.3f} s, FIFO {p0['fifo']:.3f} s "
          f"({p0['priority'] / p0['fifo']:.2f}x)")
    (args.out / "results.json").write_text(json.dumps(runs, indent=2))

    slowest = max((r for r in runs["priority"] if r["tier"] == "P0"), key=lambda r: r["latency_s"])
    png = args.out / "slowest-p0-timeline.png"
    print(f"\nwhy was the slowest P0 request ({slowest['latency_s']:.3f} s) slow?\n")
    from scripts import explain

    rc = explain.main([slowest["id"], "--spans", str(spans["priority"]), "--png", str(png)])
    print(f"\ntimeline: {png}\nspans: {spans['priority']} (python scripts/explain.py REQUEST_ID --spans FILE)")
    return 0 if rc in (0, 1) else rc


if __name__ == "__main__":
    sys.exit(main())
