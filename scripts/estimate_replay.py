"""Ask the wait model again about the cluster states a bench run saw, and judge it against the real waits.

A run of scripts/bench_estimate.py with --dump FILE has the gateway write, per admitted job, what its wait
model was given and the estimate it told (gateway/estimate_dump.py). This script reads that file and the run's
--json, replays every judged job's estimate with the model as it is now (or with --futures N), and prints, per
tier, the median relative error and the share within 2x, as the bench judges them, for the estimate the gateway
told and for the replayed one, side by side: a change to the model is compared on identical states, without
the run-to-run spread of the cluster (BENCHMARKS.md, issue 12).

With the model unchanged, every replayed estimate equals the told one; --check fails the run where one does not
(a dump that no longer reproduces the gateway is worthless for comparisons). --tau S forecasts the arrivals anew
from the dump's own admissions, at another decay time. --explain JOB (or 'misses') prints, for a job, what the
model saw, the dispatches it expected before the job, and the run's jobs that really started before it: where a
miss came from (an arrival the forecast did not foresee, a slot that freed late, a promise that fell due).

  scripts/estimate_replay.py --dump est.jsonl --bench-json run.json [--futures 0] [--check]
  scripts/estimate_replay.py --dump est.jsonl --bench-json run.json --explain misses
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tqdm import tqdm  # noqa: E402

from common.tiers import ALL_TIERS  # noqa: E402
from gateway import estimate_dump  # noqa: E402
from gateway.estimate import RUNNING, Arrivals, WorkerView, replay  # noqa: E402
from gateway.arrival_forecast import LONG_TAU_S, SETTLE_S, SHORT_TAU_S, ArrivalForecast  # noqa: E402
from gateway.estimate_futures import FUTURES, told_wait_s  # noqa: E402
from gateway.wait_estimator import advanced_held  # noqa: E402
from scripts.estimate_report import judged, summarize, table, within_2x  # noqa: E402


def replayed(dump: estimate_dump.Dumped, futures: int, arrivals: list[Arrivals] | None = None) -> float:
    args, kw = dump.args()
    if arrivals is not None:
        kw["arrivals"] = arrivals
    est = told_wait_s(*args, futures=futures, **kw)
    return est * dump.bias if math.isfinite(est) else 0.0


def rebuilt_arrivals(dumps: list[estimate_dump.Dumped], tau_s: float, settle_s: float = SETTLE_S,
                     long_tau_s: float = LONG_TAU_S) -> dict[str, list[Arrivals]]:
    """Per job, the arrival forecast an ArrivalForecast with these time scales would have made at its admission,
    fed the dump's admissions in order (every admitted job's own work is in its line; refused ones are not)."""
    ordered = sorted(dumps, key=lambda d: d.at)
    rates = ArrivalForecast(ordered[0].at, tau_s, settle_s, long_tau_s)
    out = {}
    for d in ordered:
        out[d.job_id] = rates.arrivals(ALL_TIERS[:d.tier.rank], d.at, d.workers)
        if d.work is not None:
            rates.add(d.work.tier, d.work.prefill, d.work.decode, d.at)
    return out


def explain(job: dict, d: estimate_dump.Dumped, jobs: list[dict]) -> str:
    """What the model expected to go before ``job`` (the evenly spaced future's dispatches), against what did: the
    run's jobs that started between its admission and its start."""
    seen: list = []
    args, kw = d.args()
    even, _ = replay(*args, dispatches=seen, **kw)
    out = [f"job {job['job_id']} {job['tier']} admitted at {job['at']:.2f} s: told {d.told_s:.2f} s, waited "
           f"{job['wait_s']:.2f} s (the evenly spaced future: {even:.2f} s)"]
    for i, w in enumerate(d.workers):
        held = ", ".join(f"{h.work.tier.value} {'RSW'[h.status]} {w.rates.seconds(h.work.prefill, h.work.decode):.1f}s"
                         for h in w.held)
        out.append(f"  worker {i}: {w.slots} slots, hand-off {w.handoff_s:.3f}/{w.idle_handoff_s:.3f} s; "
                   f"holds {held or 'nothing'}")
    by = {t: sum(q.work.tier is t for q in d.queued) for t in ALL_TIERS}
    out.append("  queued (read): " + ", ".join(f"{t.value} {n}" for t, n in by.items() if n)
               + "".join(f"; {t.value} +{n} unread" for t, (n, _) in d.unread.items()))
    out.append("  arrivals forecast: " + ", ".join(
        f"{a.work.tier.value} {a.per_s:.2f}/s" + (f" -> {a.long_run():.2f}/s" if a.long_run() != a.per_s else "")
        for a in d.arrivals))
    streams = {id(a.work) for a in d.arrivals}
    model = [f"{w.tier.value}{'*' if id(w) in streams else ''}@{t:.1f}" for t, _, w in seen]
    out.append(f"  the model's {len(seen)} dispatches before it (* an arrival to come, @ when its slot frees): "
               + " ".join(model))
    start = job["at"] + job["wait_s"]
    went = sorted((j for j in jobs if j is not job and j.get("outcome") == "done"
                   and job["at"] <= j["at"] + j["wait_s"] < start), key=lambda j: j["at"] + j["wait_s"])
    out.append(f"  what started before it ({len(went)}; + admitted after it; judged rows only: the unjudged tail's "
               "jobs are not in the run's JSON): " + " ".join(
        f"{j['tier']}{'+' if j['at'] > job['at'] else ''}@{j['at'] + j['wait_s'] - job['at']:.1f}" for j in went))
    return "\n".join(out)


def without_step_cost(w: WorkerView) -> WorkerView:
    """``w`` as the gateway would see it from a worker that did not report its step cost: its running work advanced
    by the report's age at the token rates (gateway/wait_estimator.py), timed at them from then on."""
    if w.step is None:
        return w
    held = [advanced_held(h, w.rates, w.age_s) if h.status == RUNNING else h for h in w.held]
    return replace(w, held=held, step=None, age_s=0.0)


def without_pair_cost(w: WorkerView) -> WorkerView:
    """``w`` with what its steps' attention pairs cost left out of its step cost (base and per token as fitted
    beside it, so not what a fit on tokens alone would give: a bound on what the term does, not the old fit)."""
    return w if w.step is None else replace(w, step=replace(w.step, pair_s=0.0))


def same(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", type=Path, required=True, help="the gateway's estimate dump (estimate_dump)")
    ap.add_argument("--bench-json", type=Path, required=True, help="scripts/bench_estimate.py --json of that run")
    ap.add_argument("--futures", type=int, default=FUTURES,
                    help="drawn futures for a job near a slot, as the gateway's wait_futures (0: evenly spaced)")
    ap.add_argument("--tau", type=float, default=None,
                    help="forecast the arrivals anew from the dump's admissions, with rates now of this decay time "
                         f"(s), instead of the forecast the gateway made (its own: {SHORT_TAU_S:g} s; --tau 30 "
                         "--settle 0: one 30 s rate carried forward, the forecast before arrival_forecast.py)")
    ap.add_argument("--settle", type=float, default=SETTLE_S,
                    help="with --tau: the time constant (s) of the rates' settling to their long-run ones (0: none)")
    ap.add_argument("--long-tau", type=float, default=LONG_TAU_S,
                    help="with --tau: the decay time of the long-run rates (s)")
    ap.add_argument("--step-tokens", type=int, default=None,
                    help="the workers' step budget (max_num_batched_tokens; the worker's default: 1024) where the "
                         "dump does not say, as in dumps from before workers sent it in their hello")
    ap.add_argument("--no-step-cost", action="store_true",
                    help="replay as if no worker had reported its step cost: jobs timed at the token rates alone "
                         "(gateway/estimate_steps.py), to compare the two on the same states")
    ap.add_argument("--no-pair-cost", action="store_true",
                    help="replay with the workers' step costs less what the attention's pairs cost (worker/step_cost.py"
                         "), to see on the same states what that term does")
    ap.add_argument("--explain", metavar="JOB", action="append", default=[],
                    help="for this job (an id or its start), what the model expected to go before it against what "
                         "did; repeatable; 'misses': every judged job not within 2x")
    ap.add_argument("--min-wait", type=float, default=None, help="judge jobs that waited this long (default: "
                                                                  "the bench run's --min-wait)")
    ap.add_argument("--check", action="store_true", help="fail where a replayed estimate differs from the told one")
    ap.add_argument("--json", type=Path, help="write the replayed summary and each judged job's estimates here")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.futures < 0 or (a.tau is not None and a.tau <= 0) or (a.step_tokens is not None and a.step_tokens < 1):
        raise SystemExit("estimate_replay: --futures must be >= 0, --tau > 0 and --step-tokens >= 1")
    try:
        bench = json.loads(a.bench_json.read_text())
        jobs = {j["job_id"]: j for j in bench["jobs"] if j.get("job_id")}
        min_wait = a.min_wait if a.min_wait is not None else float(bench["args"].get("min_wait", 0.5))
        every = list(estimate_dump.read(a.dump))
        if a.step_tokens is not None:
            for d in every:
                d.workers = [w if math.isfinite(w.step_tokens) else replace(w, step_tokens=a.step_tokens)
                             for w in d.workers]
        if a.no_step_cost:
            for d in every:
                d.workers = [without_step_cost(w) for w in d.workers]
        if a.no_pair_cost:
            for d in every:
                d.workers = [without_pair_cost(w) for w in d.workers]
        dumps = {d.job_id: d for d in every if d.job_id in jobs}
    except (OSError, ValueError, KeyError) as e:
        raise SystemExit(f"estimate_replay: {e}") from None
    missing = [i for i in jobs if i not in dumps]
    if len(missing) == len(jobs):
        raise SystemExit("estimate_replay: no job of the bench run is in the dump (another run's dump?)")
    forecast = rebuilt_arrivals(every, a.tau, a.settle, a.long_tau) if a.tau else {}
    told, now, differ = [], [], 0
    for job_id, d in tqdm(dumps.items(), desc="replaying", unit="estimate", file=sys.stderr):
        job = jobs[job_id]
        e = replayed(d, a.futures, forecast.get(job_id))
        differ += not same(e, d.told_s)
        told.append({**job, "estimate_s": d.told_s})
        now.append({**job, "estimate_s": e})
    if a.explain:
        wanted = ([j for j in judged(list(jobs.values()), min_wait) if not within_2x(j)]
                  if a.explain == ["misses"] else [j for j in jobs.values() if any(j["job_id"].startswith(x)
                                                                                 for x in a.explain)])
        if not wanted and a.explain != ["misses"]:
            raise SystemExit(f"estimate_replay: no job of the run starts with {', '.join(a.explain)}")
        for j in sorted(wanted, key=lambda j: j["at"]):
            if j["job_id"] in dumps:
                print(explain(j, dumps[j["job_id"]], list(jobs.values())), end="\n\n")
    print(f"{len(dumps)} estimates replayed ({len(missing)} of the run's jobs not in the dump); "
          f"{differ} differ from what the gateway told")
    print("as told by the gateway:")
    print(table(summarize(told, min_wait), min_wait))
    anew = f", arrivals forecast anew, tau {a.tau:g} s, settle {a.settle:g} s" if a.tau else ""
    print(f"replayed (futures {a.futures}{anew}):")
    summary = summarize(now, min_wait)
    print(table(summary, min_wait))
    if a.json:
        a.json.write_text(json.dumps({"summary": summary, "jobs": [
            {"job_id": j["job_id"], "tier": j["tier"], "wait_s": j.get("wait_s"), "told_s": t["estimate_s"],
             "replayed_s": j["estimate_s"]} for j, t in zip(now, told)]}, indent=1))
    if a.check and differ:
        print(f"estimate_replay: {differ} replayed estimates differ from the told ones", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
