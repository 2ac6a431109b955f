"""Scheduler simulator: the real scheduler and block manager under a step-time model (no model, no torch).

Two uses:
  --traces N --seed S   statistical check of the invariants over N random traces and configurations
                        (P0 never preempted, no preemption within residency, KV blocks conserved and
                        within budget, every request finishes once arrivals stop, none lost);
                        prints the number of violations, expected 0.
  --azure CSV           replay the Azure conversation trace with a tier mix, fifo against priority,
                        and print simulated latency per tier.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from common.tiers import Tier
from worker.config import SchedulerConfig
from worker.preemption import PreemptionConfig
from worker.simulator import azure_trace, random_case, run_case, simulate

DEFAULT_AZURE = Path(__file__).resolve().parent.parent / "data" / "azure-2023" / "AzureLLMInferenceTrace_conv.csv"


def _check_one(args: tuple[int, int]) -> tuple[int, list[str], int]:
    seed, index = args
    rng = random.Random(seed * 1_000_003 + index)
    policy = "fifo" if rng.random() < 0.1 else "priority"
    res = run_case(random_case(rng, policy))
    return index, res.violations, res.steps


def check(traces: int, seed: int, workers: int) -> int:
    bad: list[tuple[int, list[str]]] = []
    steps = 0
    jobs = [(seed, i) for i in range(traces)]
    with mp.get_context("fork").Pool(workers) as pool:
        for index, violations, n in tqdm(pool.imap_unordered(_check_one, jobs, chunksize=64), total=traces,
                                         desc="traces", file=sys.stderr):
            steps += n
            if violations:
                bad.append((index, violations))
    total = sum(len(v) for _, v in bad)
    for index, violations in sorted(bad)[:10]:
        print(f"trace {index}: {violations[:3]}")
    print(f"{traces} traces, {steps} scheduler steps, seed {seed}: {total} violations in {len(bad)} traces")
    return total


def replay(path: Path, limit: int, seed: int, num_blocks: int, max_num_seqs: int, speedup: float,
           spread_ties: bool = True) -> dict:
    arrivals = [replace(a, time_s=a.time_s / speedup)
                for a in azure_trace(path, limit=limit, seed=seed, max_prompt=2048, max_new=512,
                                     spread_ties=spread_ties)]
    out = {}
    for policy in ("fifo", "priority"):
        res = simulate(arrivals, num_blocks=num_blocks, block_size=16, policy=policy,
                       sched=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048,
                                             max_model_len=4096),
                       preemption=PreemptionConfig(bytes_per_block=2**20, swap_space_blocks=num_blocks))
        tiers = {}
        for tier in Tier:
            lat = [r.finish_time - r.arrival_time for r in res.finished.values() if r.tier is tier]
            if lat:
                lat.sort()
                tiers[tier.value] = {"count": len(lat), "latency_mean_s": statistics.fmean(lat),
                                     "latency_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))]}
        stats = res.scheduler.stats
        out[policy] = {"tiers": tiers, "preemptions": stats.by_mode(), "violations": len(res.violations)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--traces", type=int, default=1000, help="random traces to check (default 1000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--azure", type=Path, nargs="?", const=DEFAULT_AZURE, default=None,
                    help="replay the Azure trace instead (default path: the copy in data/)")
    ap.add_argument("--limit", type=int, default=2000, help="rows of the Azure trace to replay")
    ap.add_argument("--speedup", type=float, default=1.0, help="divide the trace's arrival times by this (load)")
    ap.add_argument("--num-blocks", type=int, default=2048, help="KV blocks for the replay")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--spread-ties", action=argparse.BooleanOptionalAction, default=True,
                    help="a trace recorded to whole seconds (BurstGPT) or another coarse unit: replay each arrival at "
                         "a seeded random moment within its unit (default), as scripts/bench_estimate.py does; "
                         "--no-spread-ties: each unit's arrivals together, at the recorded time")
    ap.add_argument("--json", type=Path, help="write the replay results here")
    args = ap.parse_args(argv)
    if args.azure is not None:
        if not args.azure.is_file():
            ap.error(f"trace not found: {args.azure}")
        result = replay(args.azure, args.limit, args.seed, args.num_blocks, args.max_num_seqs, args.speedup,
                        args.spread_ties)
        for policy, r in result.items():
            print(f"{policy:>9}: " + "  ".join(f"{t} n={v['count']} mean={v['latency_mean_s']:.2f}s "
                                               f"p99={v['latency_p99_s']:.2f}s" for t, v in r["tiers"].items())
                  + f"  preemptions={r['preemptions']}")
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return 0 if all(r["violations"] == 0 for r in result.values()) else 1
    return 1 if check(args.traces, args.seed, args.workers) else 0


if __name__ == "__main__":
    sys.exit(main())
