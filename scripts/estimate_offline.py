"""Judge the wait model offline, in seconds: trace segments through a reference dispatch simulation.

bench_estimate.py judges the real cluster, one 500-job replay in about six minutes. This runs the
same arrivals (the same tiers, tokens and --load pacing) through a small reference simulation of
dispatch (scripts/offline_dispatch.py: slots, Redis order: tier then age, aging every
--aging-interval; P0/P1 preempting running P2/P3 work, unless --no-preempt, where the worker's
guards let them (a resumed job's residency, a job a few tokens from its end; --no-guards: any
victim at once, as before the eighteenth session); job durations from the given per-sequence
rates, and a --handoff between a job's dispatch and its start; --rates-from RUN.json takes both
from a real run, the only way the code trace's bursts wait here as long as on the cluster:
BENCHMARKS.md, issue 12, twenty-fifth session) and
asks gateway/estimate.py's wait_s, at every arrival, with the state the simulation had then and
a forecast of the arrivals to come:

  rates   the gateway's own (gateway/arrival_forecast.py): each tier's short decayed rate (--tau)
          settling over --settle seconds to its long-run rate (--long-tau); --settle 0: the short
          rate for good (--tau 30 --settle 0: one 30 s rate carried forward, the forecast
          before arrival_forecast.py)
  exact   the arrivals that really came: checks the model's replay against the simulation (0 error)
  oracle  each tier's real rate over the next --window seconds: a perfect rate forecast, which no
          gateway has, so the best a forecast of rates could do
  none    no arrivals to come

The --tail rows after each segment arrive too, unjudged: traffic does not stop when a segment
ends, and jobs near its end would otherwise be judged against a future no deployment sees.

By default each estimate is the one the gateway tells (gateway/estimate_futures.py: for a job a few
dispatches from a slot, the evenly spaced one hedged with the likeliest of --futures drawn futures;
--futures 0: the evenly spaced one).
--samples N asks wait_s N times per job with drawn (Poisson) futures instead of evenly spaced
arrivals, and takes the --pick of them: their median, or the estimate with the most of them
within 2x. That tells what a forecast of the spread, not just the rate, would be worth.

It prints, per segment and over all segments, the median relative error and the share within
2x for the jobs that waited at least --min-wait, as bench_estimate.py does. Many segments of
one trace, not one: a forecast tuned to one stretch of arrivals is fitted to the file; and more
than one trace: data/azure-2023 also has the code trace (--trace
data/azure-2023/AzureLLMInferenceTrace_code.csv, 9 segments), whose arrivals come in bursts
several times the cluster's capacity, seconds long, between quiet spells.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.tiers import Tier  # noqa: E402
from gateway import promises  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.estimate import Arrivals, Held, Queued, Rates, Work, WorkerView, wait_s  # noqa: E402
from gateway.estimate_futures import FUTURES, likeliest, told_wait_s  # noqa: E402
from gateway.arrival_forecast import LONG_TAU_S, SETTLE_S, SHORT_TAU_S, ArrivalForecast  # noqa: E402
from scripts.bench_estimate import offered_load, plan, slot_seconds, trace_rows  # noqa: E402
from scripts.offline_dispatch import simulate  # noqa: E402
from worker.preemption import PreemptionConfig  # noqa: E402

SECONDS = Rates(prefill_tps=math.inf, decode_tps=1.0)  # Work(decode=s) holds a slot for s seconds
FORECASTS = ("rates", "exact", "oracle", "none")


def run(jobs: list[dict], a, dur) -> list[tuple[str, float, float]]:
    """(tier, estimate, wait) of every judged job: the reference simulation, the estimate from wait_s at each
    arrival with the chosen forecast, and (--promise-factor) the promise made from it kept."""
    estimates: dict[int, float] = {}
    on_arrival = estimator(jobs, a, dur, estimates)
    waits = simulate(jobs, a.slots, a.aging_interval, dur, on_arrival, a.noise, a.seed, a.preempt,
                     guards=worker_guards(a) if a.guards else None, handoff=a.handoff)
    return [(j["tier"], estimates[j["i"]], waits[j["i"]]) for j in jobs if j.get("judged", True)]


def worker_guards(a):
    """The worker's preemption guards in a job's seconds at --decode-tps: its residency after resuming, and the
    tokens left below which it is protected to its end (worker/preemption.PreemptionConfig's defaults)."""
    token_s, pc = 1.0 / a.decode_tps, PreemptionConfig()
    return lambda job: (pc.min_residency_steps * token_s, pc.guard_remaining_tokens * token_s)


def estimator(jobs: list[dict], a, dur, out: dict[int, float]):
    """The on_arrival hook of simulate(): each job's estimate into ``out``; returns its promise's due time."""
    rates = ArrivalForecast(jobs[0]["at"], a.tau, a.settle, a.long_tau)
    promised = promises.tiers(a.promise_tiers)

    def on_arrival(job: dict, held: list[Held], queued: list[dict]) -> float:
        tier, now = Tier(job["tier"]), job["at"]
        view = WorkerView(a.slots, SECONDS, held, a.handoff, a.handoff)  # the hand-off as the gateway learns it
        line = [Queued(Work(Tier(q["tier"]), 0, dur(q)), q["at"] - now, q["promise"] - now) for q in queued]
        arrivals: list[Arrivals] = []
        if a.forecast == "rates":
            arrivals = rates.arrivals(Tier, now, [view])
        elif a.forecast == "exact":  # future jobs as queued jobs admitted later (wait_s waits for them)
            line += [Queued(Work(Tier(f["tier"]), 0, dur(f)), f["at"] - now) for f in jobs if f["at"] > now]
        elif a.forecast == "oracle":
            for t in Tier:
                came = [f for f in jobs if now < f["at"] <= now + a.window and f["tier"] == t.value]
                if came:
                    arrivals.append(Arrivals(Work(t, 0, statistics.fmean(map(dur, came))), len(came) / a.window))
        rates.add(tier, 0, dur(job), now)

        def ask(rng=None):
            if rng is None:  # the wait the gateway tells (gateway/estimate_futures.py)
                return told_wait_s(tier, [view], line, arrivals=arrivals, aging_interval_s=a.aging_interval,
                                   futures=0 if a.forecast == "exact" else a.futures)
            return wait_s(tier, [view], line, arrivals=arrivals, aging_interval_s=a.aging_interval, rng=rng)

        sampled = a.samples and arrivals and a.forecast != "exact" and job.get("judged", True)
        est = out[job["i"]] = pick([ask(random.Random(s)) for s in range(a.samples)], a.pick) if sampled else ask()
        promise = promises.promise_s(tier, est, a.promise_factor, a.promise_lead, promised)
        return math.inf if promise is None else now + promise

    return on_arrival


def pick(waits: list[float], how: str) -> float:
    """One estimate from sampled waits: their median, or the estimate with most of them within 2x of it
    (gateway/estimate_futures.likeliest, as the gateway tells it)."""
    return sorted(waits)[len(waits) // 2] if how == "median" else likeliest(waits)


def judge(rows: list[tuple[str, float, float]], min_wait: float) -> dict[str, tuple[float, float, int] | None]:
    def stats(rs):
        rs = [(e, w) for _, e, w in rs if w >= min_wait]
        if not rs:
            return None
        return (statistics.median(abs(e - w) / w for e, w in rs), sum(w / 2 <= e <= 2 * w for e, w in rs) / len(rs),
                len(rs))

    return {"all": stats(rows), **{t: stats([r for r in rows if r[0] == t]) for t in ("P1", "P2", "P3")}}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, default=ROOT / "data/azure-2023/AzureLLMInferenceTrace_conv.csv")
    ap.add_argument("--arrivals", type=int, default=500, help="rows per segment")
    ap.add_argument("--segments", type=int, default=19, help="segments, --arrivals * 2 rows apart")
    ap.add_argument("--load", type=float, default=0.8, help="pace each segment so its work keeps this share busy")
    ap.add_argument("--forecast", choices=FORECASTS, default="rates")
    ap.add_argument("--tau", type=float, default=SHORT_TAU_S,
                    help="decay time of the arrival rates now (s), as the gateway's")
    ap.add_argument("--settle", type=float, default=SETTLE_S,
                    help="time constant (s) over which the rates now are expected to settle to the long-run ones")
    ap.add_argument("--long-tau", type=float, default=LONG_TAU_S, help="decay time of the long-run rates (s)")
    ap.add_argument("--window", type=float, default=60.0, help="the oracle's look ahead (s)")
    ap.add_argument("--tail", type=int, default=500,
                    help="rows after each segment that arrive too, unjudged (as bench_estimate.py --tail)")
    ap.add_argument("--handoff", type=float, default=0.0,
                    help="seconds from a job's dispatch to its start, its slot idle (the cluster's "
                         "ts_dispatch_handoff_seconds: 0.02-0.03 s a job on the conversation trace, 0.08-0.13 s on "
                         "the code trace); the model is told it, as the gateway learns it (0: none)")
    ap.add_argument("--samples", type=int, default=0, help="drawn futures per job (0: the gateway's evenly spaced)")
    ap.add_argument("--futures", type=int, default=FUTURES,
                    help="drawn futures whose likeliest wait the estimate of a job near a slot is hedged with, as the "
                         "gateway's wait_futures (0: the evenly spaced future only)")
    ap.add_argument("--pick", choices=("median", "within-2x"), default="median",
                    help="of the --samples waits, the median or the estimate with most of them within 2x")
    ap.add_argument("--rates-from", type=Path, default=None, metavar="RUN.json",
                    help="the slots, per-sequence rates and hand-off of a bench_estimate.py --json run (its paced "
                         "rates, which its load is counted in, and the gateway's mean hand-off), instead of --slots, "
                         "--prefill-tps, --decode-tps and --handoff: a trace's jobs run at other rates than another's, "
                         "and the share of a burst's work in its long prompts decides its waits")
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--prefill-tps", type=float, default=1300.0,
                    help="per sequence (the bench paced the bench model at 385-585 here in the twenty-fifth session: "
                         "prefer --rates-from)")
    ap.add_argument("--decode-tps", type=float, default=37.5, help="per sequence (paced: 40-62; see --rates-from)")
    ap.add_argument("--aging-interval", type=float, default=60.0)
    ap.add_argument("--token-scale", type=float, default=0.25)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--mix", default="10,20,30,40")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--min-wait", type=float, default=0.5)
    defaults = GatewayConfig()
    ap.add_argument("--promise-factor", type=float, default=defaults.promise_factor,
                    help="P3 promises as the gateway makes them (gateway/promises.py); 0: none")
    ap.add_argument("--promise-lead", type=float, default=defaults.promise_lead_s)
    ap.add_argument("--promise-tiers", type=lambda v: tuple(v.split(",")), default=defaults.promise_tiers,
                    help="the tiers given promises, comma-separated (promise_tiers: P3, or P2,P3)")
    ap.add_argument("--preempt", action=argparse.BooleanOptionalAction, default=True,
                    help="P0/P1 preempt running P2/P3 work as on the cluster (scripts/offline_dispatch.py); "
                         "--no-preempt: they wait for a free slot like the rest")
    ap.add_argument("--guards", action=argparse.BooleanOptionalAction, default=True,
                    help="the worker's preemption guards in the simulation (a resumed job's residency, a job near its "
                         "end); --no-guards: any victim may be preempted at once, as before the eighteenth session")
    ap.add_argument("--spread-ties", action=argparse.BooleanOptionalAction, default=True,
                    help="arrivals sharing a timestamp in a coarse record (BurstGPT: whole seconds) each at a random "
                         "moment within it, as bench_estimate.py replays them; --no-spread-ties: together")
    ap.add_argument("--noise", type=float, default=0.0,
                    help="sigma of a lognormal spread of each job's time in its slot around the rates' prediction")
    return ap


def segment(a, start: int) -> list[dict]:
    """Rows start.. of the trace as bench_estimate.py plans them, paced so the --arrivals judged rows offer --load
    at the given rates, then the --tail rows (unjudged) at the same pace."""
    a.speedup = None  # plan() reads it: the trace's own pace, then paced here
    a.start = start
    jobs = plan(trace_rows(a, say=start == 0), a)  # said once a run, not once a segment
    speedup = a.load / offered_load(jobs[:a.arrivals], [(a.prefill_tps, a.decode_tps, a.slots)])
    for job in jobs:
        job["at"] /= speedup
        job["judged"] = job["i"] < a.arrivals
    return jobs


def measured(run: Path) -> tuple[int, float, float, float]:
    """(slots, prefill tokens/s, decode tokens/s, hand-off s) of a bench_estimate.py --json run: its workers' paced
    per-sequence rates (slot-weighted means) and the gateway's mean hand-off (0 where it measured none)."""
    try:
        data = json.loads(Path(run).read_text())
        rates = [(float(p), float(d), int(n)) for p, d, n in data["paced_rates"]]
        handoff = float(data.get("handoff_mean_s") or 0.0)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"estimate_offline: {run} is not a bench_estimate.py --json run with paced rates: {e}")
    slots = sum(n for _, _, n in rates)
    if not rates or slots <= 0 or not all(p > 0 and d > 0 and n >= 0 for p, d, n in rates) or handoff < 0:
        raise SystemExit(f"estimate_offline: {run} has no slots, or rates or a hand-off out of range: {rates}, "
                         f"{handoff}")
    return (slots, sum(p * n for p, _, n in rates) / slots, sum(d * n for _, d, n in rates) / slots, handoff)


def durations(a):
    """Seconds a job holds a slot at the given per-sequence rates (as bench_estimate paces it)."""
    return slot_seconds([(a.prefill_tps, a.decode_tps, a.slots)])


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.rates_from is not None:
        a.slots, a.prefill_tps, a.decode_tps, a.handoff = measured(a.rates_from)
    if not 0 <= a.handoff < math.inf:
        ap.error(f"--handoff must be finite and >= 0, got {a.handoff}")
    dur = durations(a)
    per_segment = []
    for k in range(a.segments):
        try:
            jobs = segment(a, 2 * k * a.arrivals)
        except SystemExit:
            break  # the trace ended
        result = judge(run(jobs, a, dur), a.min_wait)
        per_segment.append(result)
        print(f"rows {2 * k * a.arrivals:>6}: " + "  ".join(
            f"{t} {100 * s[0]:5.1f} % / {100 * s[1]:5.1f} % ({s[2]})" for t, s in result.items() if s), flush=True)
    how = (f", {a.samples} drawn futures, their {a.pick}" if a.samples
           else f", told from {a.futures} futures near a slot")
    how += (f", promises ({'/'.join(a.promise_tiers)}) {a.promise_factor} x estimate - {a.promise_lead} s"
            if a.promise_factor and a.promise_tiers else ", no promises")
    how += f", noise {a.noise}" if a.noise else ""
    print(f"\n{len(per_segment)} segments, forecast {a.forecast}{how}: mean (worst) median error / within 2x")
    for t in ("all", "P1", "P2", "P3"):
        xs = [r[t] for r in per_segment if r[t]]
        if xs:
            print(f"  {t:<4} {100 * statistics.fmean(x[0] for x in xs):5.1f} % ({100 * max(x[0] for x in xs):5.1f} %)"
                  f"  {100 * statistics.fmean(x[1] for x in xs):5.1f} % ({100 * min(x[1] for x in xs):5.1f} %)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
