"""Replay an arrival trace through a real local cluster and judge the gateway's wait estimates.

Starts a real redis-server, one gateway and N workers (scripts/up.py) and submits the trace's
arrivals on their schedule, compressed so that their work keeps --load (default 0.8) of the batch
slots busy, so that the replay loads the cluster alike on any machine; or by a fixed --speedup. The
work is counted at the rates the workers measured at start-up (the rates the gateway first
estimates with), scaled by how much longer --warmup jobs of the trace's own sizes, run first and
unjudged, really held their slots: the calibration's short prompts can be off by 2x for a trace's
jobs. Each job has the trace's context tokens as its prompt and its generated tokens as max_tokens
(both times --token-scale), at a tier drawn with the --mix shares (seeded). For every admitted job
it compares the estimate the gateway returned at admission with the job's real wait
(JobResult.queued_s: admission until its first prefill started on a worker), and prints per tier,
over the jobs that waited at least --min-wait seconds: the median relative error |estimate - wait|
/ wait and the share of estimates within 2x of the wait. Refusals (overloaded, quota) are counted.
--png draws estimate against wait; --json writes every job and the summary.

The --tail rows after the judged ones keep arriving, on the same schedule and unjudged, until
every judged job has its result: traffic does not stop in a deployment, and without them the
last minute's jobs would be judged against a future with no arrivals, which the gateway rightly
does not foresee (--tail 0: the replay stops with the judged rows).

The trace is an Azure LLM inference trace (CSV: TIMESTAMP, ContextTokens, GeneratedTokens; 2023, 2024
and multimodal; data/azure-2023/, CC-BY-4.0, Patel et al., "Splitwise", ISCA 2024), a BurstGPT CSV
(Timestamp, Request tokens, Response tokens), a Mooncake JSONL (timestamp in ms, input_length,
output_length), or any CSV/JSONL with a time in seconds and prompt and output token columns under
common names (common/arrival_traces.py). A trace that records time coarsely, with arrivals sharing a
timestamp (BurstGPT: whole seconds), has each arrival replayed at a random moment (seeded) within its
recorded unit, not in a clump at its start (--no-spread-ties: as recorded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.errors import Overloaded, QuotaExceeded, ServingError  # noqa: E402
from gateway.sdk import AsyncGatewayClient  # noqa: E402
from scripts.estimate_report import (TIERS, draw, mean_handoff, promotions, slipped_promises, summarize,  # noqa: E402
                                     table)
from common.arrival_traces import load_trace, spread_ties, ties_rng  # noqa: E402
from common import settings  # noqa: E402
from common.redis_keys import KeySpace  # noqa: E402
from common.redis_server import redis_client  # noqa: E402
from gateway.config import ENV_PREFIX, GatewayConfig  # noqa: E402
from gateway.queue_records import JobRecord  # noqa: E402

DEFAULT_LOAD = 0.8
CALIBRATED = re.compile(r"calibrated: prefill ([\d.]+) tokens/s, decode ([\d.]+) tokens/s per sequence, (\d+) slots")
TENANT_OF = {"P0": "chat-co", "P1": "api-co", "P2": "batch-co", "P3": "lab-co"}  # scripts/up.py's dev tenants
WARMUP_IDS = 10_000_000  # warm-up jobs' numbers (their seeds): apart from any trace row's


def plan(trace, args) -> list[dict]:
    rng = random.Random(args.seed)
    weights = [float(x) for x in args.mix.split(",")]
    jobs = []
    for i, (at, ctx, gen) in enumerate(trace):
        out = max(1, min(round(gen * args.token_scale), args.max_len - 1))  # a trace's longest outputs fit too
        prompt = max(1, min(round(ctx * args.token_scale), args.max_len - out))
        tier = rng.choices(TIERS, weights)[0]
        jobs.append({"i": i, "at": at / (args.speedup or 1.0), "tier": tier, "prompt_tokens": prompt, "max_tokens": out,
                     "prompt_token_ids": [rng.randrange(3, 500) for _ in range(prompt)]})
    return jobs


def calibrated_rates(logs: Path, workers: int, timeout_s: float = 60.0) -> list[tuple[float, float, int]]:
    """(prefill, decode tokens/s per sequence, slots) of each worker: its start-up calibration, as logged and
    as told to the gateway, which estimates waits with these rates."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = []
        for i in range(workers):
            path = logs / f"worker-{i}.log"
            match = CALIBRATED.search(path.read_text()) if path.exists() else None
            if match:
                found.append((float(match[1]), float(match[2]), int(match[3])))
        if len(found) == workers:
            return found
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_estimate: no calibration line from every worker in {logs}")
        time.sleep(0.2)


def slot_seconds(rates: list[tuple[float, float, int]]) -> Callable[[dict], float]:
    """How long a job holds a slot: prompt / prefill rate + max_tokens / decode rate (the workers' mean
    per-sequence rates; ignore_eos, so every job generates all of max_tokens)."""
    prefill = statistics.fmean(r[0] for r in rates)
    decode = statistics.fmean(r[1] for r in rates)
    return lambda job: job["prompt_tokens"] / prefill + job["max_tokens"] / decode


def offered_load(jobs: list[dict], rates: list[tuple[float, float, int]]) -> float:
    """Share of the cluster's slots the jobs' work keeps busy over their arrival span (slot_seconds)."""
    work = sum(map(slot_seconds(rates), jobs))
    span = max(1e-9, jobs[-1]["at"] - jobs[0]["at"])
    return work / span / sum(r[2] for r in rates)


def warmup_jobs(jobs: list[dict], n: int, seed: int) -> list[dict]:
    """``n`` of the judged jobs' sizes (drawn with the seed), all sent at once as P3. Only higher tiers'
    arrivals enter a job's estimate, so P3 arrivals teach the gateway no forecast it would misuse."""
    picked = random.Random(seed).sample(jobs, min(n, len(jobs)))
    return [{**job, "i": WARMUP_IDS + k, "at": 0.0, "tier": "P3"} for k, job in enumerate(picked)]


def paced_rates(rates: list[tuple[float, float, int]], records: list[dict]) -> tuple[list[tuple[float, float, int]],
                                                                                     float]:
    """The calibrated rates scaled so that they give the warm-up jobs' real time in their slots (their sum),
    and that factor (> 1: the jobs took longer than the calibration says). The calibration is one batch of
    short prompts; a trace's jobs can run at half or twice its rates, and --load would not be the load."""
    factor = held_ratio(records, rates)
    if factor is None:
        raise SystemExit(f"bench_estimate: no warm-up job finished: {[r.get('error') for r in records][:3]}")
    return [(p / factor, d / factor, slots) for p, d, slots in rates], factor


def where_they_ran(state: dict, records: list[dict]) -> None:
    """Add to each admitted job's record, from its hash in Redis (kept result_ttl after it ended), the worker that
    ran it, its last dispatch (``sent_s``) and its promotion (``promoted_s``, None: none) in seconds after its
    admission, the queue it left from (``queue``) and its attempts: where a miss's explanation starts
    (scripts/estimate_replay.py --explain has the model's side). The SDK's JobResult says none of it."""
    admitted = [r for r in records if r.get("job_id")]
    if not admitted:
        return
    keys = KeySpace(prefix=state["key_prefix"])
    client = redis_client(state["redis"])
    try:
        pipe = client.pipeline(transaction=False)
        for r in admitted:
            pipe.hgetall(keys.job(r["job_id"]))
        raws = pipe.execute()
    finally:
        client.close()
    for r, raw in zip(admitted, raws):
        job = JobRecord.from_redis(raw) if raw else None  # none: its hash expired (result_ttl) before the read
        if job is None:
            r.update(worker=None, sent_s=None, promoted_s=None, queue=None, attempts=None)
            continue
        promoted = job.result.get("promoted_at_ms")
        r.update(worker=job.worker, sent_s=_seconds_after(job.enqueued_at_ms, job.dispatched_at_ms),
                 promoted_s=_seconds_after(job.enqueued_at_ms, None if promoted is None else int(promoted)),
                 queue=job.tier.value, attempts=job.attempt)


def _seconds_after(start_ms: int, ms: int | None) -> float | None:
    return None if ms is None else (ms - start_ms) / 1000


async def replay(state: dict, jobs: list[dict], timeout_s: float,
                 tail: Sequence[dict] = (), desc: str = "replay") -> tuple[list[dict], int]:
    """The judged jobs' records, and how many tail jobs were submitted before the last judged one finished."""
    clients = {t: AsyncGatewayClient(state["gateway"], state["tenants"][TENANT_OF[t]]["api_key"], timeout_s=60)
               for t in TIERS}
    bar = tqdm(total=len(jobs), desc=desc, unit="job", file=sys.stderr)
    t0 = time.monotonic()
    tail_sent = 0

    async def submit(job: dict):
        """At the job's time in the schedule. Concurrent submissions on one client: the SDK matches each reply
        to its request."""
        await asyncio.sleep(max(0.0, t0 + job["at"] - time.monotonic()))
        return await clients[job["tier"]].submit(prompt_token_ids=job["prompt_token_ids"],
                                                 max_tokens=job["max_tokens"], tier=job["tier"], ignore_eos=True,
                                                 seed=job["i"])

    async def background(job: dict) -> None:
        nonlocal tail_sent
        try:
            await submit(job)
            tail_sent += 1
        except (ServingError, TimeoutError):
            pass  # refused or unanswered: it is traffic, not judged

    async def one(job: dict) -> dict:
        rec = {k: v for k, v in job.items() if k != "prompt_token_ids"}
        try:
            handle = await submit(job)
            rec.update(outcome="admitted", job_id=handle.id, estimate_s=handle.estimated_wait_s,
                       admitted_tier=handle.tier)
            result = await handle.result(timeout=timeout_s)
            rec.update(outcome="done", wait_s=result.queued_s, total_s=result.total_s,
                       preemptions=result.preemptions)
        except Overloaded as e:
            rec.update(outcome="overloaded", estimate_s=e.estimated_wait_s)
        except QuotaExceeded:
            rec.update(outcome="quota")
        except (ServingError, TimeoutError) as e:
            rec.update(outcome="failed", error=str(e))
        bar.update(1)
        return rec

    tails = [asyncio.ensure_future(background(j)) for j in tail]
    try:
        return list(await asyncio.gather(*(one(j) for j in jobs))), tail_sent
    finally:
        for t in tails:
            t.cancel()
        await asyncio.gather(*tails, return_exceptions=True)
        bar.close()
        for c in clients.values():
            c.close()


def held_ratio(records: list[dict], rates: list[tuple[float, float, int]]) -> float | None:
    """How much longer the finished jobs really held their slots than ``rates`` say (slot_seconds): their sums,
    over jobs never preempted (a suspended job holds no slot); None if none finished. Sums, as a load is: a
    median of per-job ratios misses that a trace's long jobs run at other rates than its short ones (it put the
    code trace at 0.53 of the slots where the sums say 0.72)."""
    done = [r for r in records if r.get("outcome") == "done" and not r["preemptions"]]
    return sum(r["total_s"] - r["wait_s"] for r in done) / sum(map(slot_seconds(rates), done)) if done else None


def measured_load(records: list[dict], rates: list[tuple[float, float, int]], load: float) -> float | None:
    """The load the replay really offered: the paced --load times held_ratio."""
    ratio = held_ratio(records, rates)
    return None if ratio is None else load * ratio


def trace_rows(args, say: bool = True) -> list[tuple[float, int, int]]:
    """The rows to replay: load_trace's, with ties in a coarse record spread through their unit (--spread-ties),
    which it says on stderr (``say``)."""
    rows = load_trace(args.trace, args.start, args.arrivals + args.tail)
    if args.spread_ties:
        rows, unit = spread_ties(rows, ties_rng(args.seed))
        if unit is not None and say:
            print(f"trace: times recorded to {unit:g} s, with arrivals sharing one; each replayed at a random moment "
                  f"within its {unit:g} s (--no-spread-ties: together, as recorded)", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, required=True,
                    help="Azure LLM trace CSV, BurstGPT CSV, Mooncake JSONL, or a CSV/JSONL with a time in seconds "
                         "and prompt and output token columns (common/arrival_traces.py)")
    ap.add_argument("--arrivals", type=int, default=500, help="rows to replay")
    ap.add_argument("--start", type=int, default=0, help="first row to replay")
    ap.add_argument("--spread-ties", action=argparse.BooleanOptionalAction, default=True,
                    help="a trace that records time to the second (or tenth, hundredth, thousandth) with arrivals "
                         "sharing a timestamp: replay each at a random moment within its unit (seeded by --seed); "
                         "--no-spread-ties: at the recorded times, each unit's arrivals together")
    ap.add_argument("--tail", type=int, default=500,
                    help="rows after the judged ones that keep arriving, unjudged, until every judged job is done")
    ap.add_argument("--load", type=float, default=None,
                    help=f"compress the arrival schedule so its work keeps this share of the cluster's slots busy, "
                         f"by the rates the workers measured at start-up and the warm-up (default {DEFAULT_LOAD} "
                         f"unless --speedup is given): the same load on any machine")
    ap.add_argument("--warmup", type=int, default=48,
                    help="with --load: first run this many jobs of the trace's sizes at once (P3, unjudged) and pace "
                         "by their real time in the slots, not by the start-up calibration alone (0: by it alone)")
    ap.add_argument("--speedup", type=float, default=None,
                    help="compress the arrival schedule by this factor instead (1: the trace's own pace)")
    ap.add_argument("--token-scale", type=float, default=0.25, help="prompt and output tokens are scaled by this")
    ap.add_argument("--max-len", type=int, default=2048, help="prompt + output are capped to this (the context)")
    ap.add_argument("--mix", default="10,20,30,40", help="shares of P0,P1,P2,P3")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-running", type=int, default=2, help="batch slots per worker")
    ap.add_argument("--model", default="bench",
                    help="tiny | bench | a model directory (bench: jobs of seconds, so waits are long enough to judge)")
    ap.add_argument("--min-wait", type=float, default=0.5, help="judge jobs that waited at least this long (s)")
    ap.add_argument("--job-timeout", type=float, default=900.0, help="longest wait for one job's result (s)")
    ap.add_argument("--bias-correction", action=argparse.BooleanOptionalAction, default=None,
                    help="the gateway's per-tier correction learned from finished jobs on top of its model "
                         "(wait_bias_correction; default: the gateway's own default, off)")
    ap.add_argument("--promise-factor", type=float, default=None,
                    help="the gateway's promised starts (promise_factor; 0: off; default: the gateway's own, on)")
    ap.add_argument("--promise-tiers", default=None,
                    help="the tiers given promises, comma-separated (promise_tiers: P3, or P2,P3; default: the "
                         "gateway's own, P2,P3)")
    ap.add_argument("--wait-futures", type=int, default=None,
                    help="drawn arrival futures whose likeliest wait the gateway hedges with the evenly spaced "
                         "one for a job near a slot (wait_futures; 0: the evenly spaced one only; default: the "
                         "gateway's own, 8)")
    ap.add_argument("--step-cost", action=argparse.BooleanOptionalAction, default=None,
                    help="time the work workers hold by replaying their steps at the step cost they report "
                         "(wait_step_cost; default: the gateway's own, on)")
    ap.add_argument("--dump", type=Path,
                    help="have the gateway write what its wait model saw at each admission here (estimate_dump), "
                         "for scripts/estimate_replay.py: other models judged on this run's very states")
    ap.add_argument("--png", type=Path, help="draw estimate against actual wait here")
    ap.add_argument("--json", type=Path, help="write every job and the summary here")
    ap.add_argument("--spans", type=Path,
                    help="keep the cluster's spans here (OTLP-JSON lines, for scripts/explain.py REQUEST_ID --spans); "
                         "off by default: tracing costs the workers CPU, so the load a run offers shifts")
    args = ap.parse_args(argv)
    if len(args.mix.split(",")) != 4:
        ap.error("--mix takes four shares: P0,P1,P2,P3")
    if args.load is not None and args.speedup is not None:
        ap.error("give --load or --speedup, not both")
    if (args.load is not None and args.load <= 0) or (args.speedup is not None and args.speedup <= 0):
        ap.error("--load and --speedup must be > 0")
    if args.speedup is None and args.load is None:
        args.load = DEFAULT_LOAD
    if args.tail < 0 or args.warmup < 0:
        ap.error("--tail and --warmup must be >= 0")
    planned = plan(trace_rows(args), args)
    jobs, tail = planned[:args.arrivals], planned[args.arrivals:]

    from scripts.up import Cluster, cluster_args, exit_on_sigterm

    if args.spans is None:
        os.environ.setdefault("OTEL_TRACES_EXPORTER", "none")  # spans cost CPU the workers need here
    else:
        for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT"):  # up.py's file exporter, not these
            os.environ.pop(name, None)
    if args.bias_correction is not None:
        os.environ["TS_GATEWAY_WAIT_BIAS_CORRECTION"] = "true" if args.bias_correction else "false"
    if args.promise_factor is not None:
        os.environ["TS_GATEWAY_PROMISE_FACTOR"] = repr(args.promise_factor)
    if args.promise_tiers is not None:
        os.environ["TS_GATEWAY_PROMISE_TIERS"] = json.dumps(args.promise_tiers.split(","))
    if args.wait_futures is not None:
        os.environ["TS_GATEWAY_WAIT_FUTURES"] = str(args.wait_futures)
    if args.step_cost is not None:
        os.environ["TS_GATEWAY_WAIT_STEP_COST"] = "true" if args.step_cost else "false"
    if args.dump is not None:
        args.dump.unlink(missing_ok=True)  # the gateway appends: one run's states, not two runs' mixed
        os.environ["TS_GATEWAY_ESTIMATE_DUMP"] = str(args.dump.resolve())
    exit_on_sigterm()  # a killed run stops its cluster
    cluster = Cluster(cluster_args(workers=args.workers, model=args.model, max_running=args.max_running,
                                   ready_timeout=180.0, http=False, spans_file=args.spans))
    finished = False
    try:
        state = cluster.start()
        rates = calibrated = calibrated_rates(Path(state["logs"]), args.workers)
        factor = None
        if args.load is not None and args.warmup:
            warm, _ = asyncio.run(replay(state, warmup_jobs(jobs, args.warmup, args.seed), args.job_timeout,
                                         desc="warm-up"))
            rates, factor = paced_rates(calibrated, warm)
            print(f"warm-up: {args.warmup} of the trace's jobs held their slots {factor:.2f}x as long as the start-up "
                  f"calibration says; pacing by that", file=sys.stderr)
        if args.load is not None:
            args.speedup = args.load / offered_load(jobs, rates)  # the judged rows' load; the tail keeps their pace
            for job in planned:
                job["at"] /= args.speedup
        paced = offered_load(jobs, rates)
        print(f"cluster up: {args.workers} workers x {args.max_running} slots ({args.model}); replaying "
              f"{len(jobs)} arrivals over {jobs[-1]['at']:.0f} s (speedup {args.speedup:.2f}: offered load "
              f"{paced:.2f} of the slots), then up to {len(tail)} unjudged", file=sys.stderr)
        records, tail_sent = asyncio.run(replay(state, jobs, args.job_timeout, tail))
        where_they_ran(state, records)
        handoff = mean_handoff(state["metrics"][0])  # the gateway's: up.py starts the gateways first
        promoted = promotions(state["metrics"][0])
        finished = True
    finally:
        cluster.stop(remove_logs=finished)  # a failed run keeps what tells why
    summary = summarize(records, args.min_wait)
    print(table(summary, args.min_wait))
    print(f"tail: {tail_sent} of {len(tail)} unjudged arrivals came before the last judged job finished")
    real = measured_load(records, rates, paced)
    if real is not None:
        print(f"load: {real:.2f} of the slots, by the jobs' real time in them (paced for {paced:.2f} by the "
              f"{'warm-up' if factor else 'start-up calibration'})")
    if handoff is not None:
        print(f"hand-off: {handoff[0]:.3f} s a job on average, dispatch until its first prefill started "
              f"({handoff[1]} jobs): its slot stood idle that long")
    done = {t: sum(1 for r in records if r["tier"] == t and r.get("outcome") == "done") for t in promoted}
    print("promised starts kept (moved up a tier when due; warm-up included), by the tier left: " + ", ".join(
        f"{t} {n} ({done[t]} judged jobs done)" for t, n in sorted(promoted.items())))
    aging_s = settings.load(GatewayConfig, None, ENV_PREFIX).aging_interval_s  # the cluster's: up.py passes no file
    slipped = slipped_promises(records, args.min_wait, aging_s)
    if slipped:
        print("promises that slipped (judged jobs moved up when due that started half an aging interval or more "
              "after it; told within 2x of their wait): " + ", ".join(
                  f"{t} {v['slipped']} of {v['promoted']} ({v['slipped_within_2x']})" for t, v in slipped.items()))
    if args.png:
        draw(records, args.min_wait, args.png)
        print(f"plot: {args.png}")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
                                         "calibrated": calibrated, "warmup_factor": factor,
                                         "paced_rates": rates, "tail_sent": tail_sent, "measured_load": real,
                                         "handoff_mean_s": handoff and handoff[0], "promotions": promoted,
                                         "promises_slipped": slipped,
                                         "jobs": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
