"""The reference dispatch simulation scripts/estimate_offline.py judges the wait model against.

One worker of ``slots`` batch slots, dispatched as the gateway and worker do it, in seconds:

- a free slot goes to the first job in the Redis order: tier, then age; a P2/P3 moves up a tier per
  aging interval waited and a P3 to P2 when its promise falls due (estimate.rank_at);
- a suspended job resumes in the first slot that frees on its worker, before any new dispatch (it holds
  its slot's credit): the highest tier first, then the first suspended;
- with no slot free, a queued job admitted at P0 or P1 (not one aged up into P1) preempts a running one
  it may (the default matrix: P0 takes P2 and P3, P1 takes P3): the lowest tier first, then the one that
  started last (least work lost), which is suspended with the rest of its time; with ``guards``, as the
  worker's (worker/preemption.py), not one resumed within its residency, nor one near its end;
- a job holds its slot for its predicted time times its own lognormal spread (``noise``): the rates
  predict only the mean;
- a job dispatched to a slot (not a suspended one resuming on its own worker) starts ``handoff`` seconds
  later, its slot idle till then: the gateway hears of the slot, claims the job, sends it, and the worker
  finishes its step (``ts_dispatch_handoff_seconds``: 0.02-0.03 s a job on the conversation trace on CPU,
  0.08-0.13 s on the code trace's long prompts).

The model is handed what the gateway sees at each arrival: the work the slots hold, running and
suspended, as predicted (without the spread), and the jobs queued.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from common.tiers import PREEMPTING_TIERS, Tier
from gateway.estimate import PREEMPTED_BY, RUNNING, SUSPENDED, Held, Work, rank_at


@dataclass
class _Slot:
    free_at: float = 0.0
    job: dict | None = None
    started: float = 0.0
    protected_until: float = 0.0  # a resumed job's residency


def no_guards(job: dict) -> tuple[float, float]:
    """(residency, near end) seconds that protect ``job`` from preemption: none."""
    return 0.0, 0.0


def residency(guard: Callable[[dict], tuple[float, float]], spread: dict[int, float], job: dict) -> float:
    """Seconds of its own time a resumed ``job`` may not be preempted for (the worker's residency guard)."""
    return guard(job)[0] * spread[job["i"]]


def near_end(guard: Callable[[dict], tuple[float, float]], spread: dict[int, float], job: dict, left: float) -> bool:
    """Is ``job``, with ``left`` seconds of its own time to go, protected to its end (the worker's near-end guard)?"""
    return left <= guard(job)[1] * spread[job["i"]]


def spreads(jobs: list[dict], noise: float, seed: int) -> dict[int, float]:
    """Each job's time in its slot over the rates' prediction: lognormal, sigma ``noise``."""
    rng = random.Random(seed)
    return {j["i"]: math.exp(rng.gauss(0.0, noise)) if noise else 1.0 for j in jobs}


def simulate(jobs: list[dict], slots: int, aging_s: float, dur: Callable[[dict], float],
             on_arrival: Callable[[dict, list[Held], list[dict]], float] | None = None, noise: float = 0.0,
             seed: int = 0, preempt: bool = True,
             on_run: Callable[[dict, float, float], None] | None = None,
             guards: Callable[[dict], tuple[float, float]] | None = None, handoff: float = 0.0) -> dict[int, float]:
    """Each job's wait, admission to its first start. ``on_arrival(job, held, queued)``, called as each job comes
    with the slots' work as the gateway would see it and the jobs queued, returns when its promise falls due
    (inf: none). ``preempt=False``: P0/P1 wait for a free slot like the rest. ``on_run(job, start, end)``: each
    stretch a job ran, until it ended or was preempted. ``guards(job)``: (residency, near end) in the job's
    predicted seconds: once resumed it may not be preempted for its residency, nor at all with its near end or less
    left (None: no guards; the cluster's worker has both, and on prompts that are nearly all of a job's work, as on
    the code trace, the near-end guard protects most jobs once their prompt is read). ``handoff``: seconds from a
    job's dispatch to its start, its slot idle (a resumed job has none)."""
    spread = spreads(jobs, noise, seed)
    ran = on_run or (lambda job, t0, t1: None)
    pool = [_Slot() for _ in range(slots)]
    suspended: list[tuple[dict, float]] = []  # (job, seconds of its own time left), in the order suspended
    queue: list[dict] = []
    waits: dict[int, float] = {}

    def order(t: float):
        return lambda j: (rank_at(Tier(j["tier"]), j["at"], t, aging_s, j["promise"]), j["at"])

    guard = guards or no_guards

    def start(slot: _Slot, job: dict, t: float, seconds: float, resumed: bool = False) -> None:
        t += 0.0 if resumed else handoff
        slot.job, slot.started, slot.free_at = job, t, t + seconds
        slot.protected_until = t + residency(guard, spread, job) if resumed else t
        waits.setdefault(job["i"], t - job["at"])  # the first start: a resumed job has its wait already

    def fill(t: float) -> None:
        """Free slots at ``t``: suspended work first, then the queue; then preemptions."""
        for slot in sorted((s for s in pool if s.free_at <= t), key=lambda s: s.free_at):
            if slot.job is not None:
                ran(slot.job, slot.started, slot.free_at)
                slot.job = None
            if suspended:  # suspended work holds its slot's credit: it resumes before any new dispatch
                job, left = min(suspended, key=lambda e: Tier(e[0]["tier"]).rank)
                suspended.remove((job, left))
                start(slot, job, t, left, resumed=True)
            elif queue:
                job = min(queue, key=order(t))
                queue.remove(job)
                start(slot, job, t, dur(job) * spread[job["i"]])
        if not preempt or any(s.job is None for s in pool):
            return
        for job in sorted((j for j in queue if Tier(j["tier"]) in PREEMPTING_TIERS), key=order(t)):
            victims = [s for s in pool if s.job is not None and (PREEMPTED_BY[Tier(s.job["tier"])]
                                                                 >> Tier(job["tier"]).rank) & 1
                       and s.protected_until <= t and not near_end(guard, spread, s.job, s.free_at - t)]
            if not victims:
                continue
            slot = max(victims, key=lambda s: (Tier(s.job["tier"]).rank, s.started))
            ran(slot.job, slot.started, t)
            suspended.append((slot.job, slot.free_at - t))
            queue.remove(job)
            start(slot, job, t, dur(job) * spread[job["i"]])

    clock = -math.inf  # the last moment filled

    def run_until(limit: float) -> None:
        nonlocal clock
        while True:  # from one slot freeing (or residency ending) to the next; all busy or nothing left to start
            events = [s.free_at for s in pool if s.job is not None]
            if any(Tier(j["tier"]) in PREEMPTING_TIERS for j in queue):  # a victim's residency ends
                events += [s.protected_until for s in pool if s.job is not None and s.protected_until > clock]
            t = min(events, default=math.inf)
            if t > limit or t == math.inf:
                return
            clock = t
            fill(t)

    for job in jobs:
        now = job["at"]
        run_until(now)
        for s in pool:
            if s.job is None:
                s.free_at = now  # an idle slot is free from now
        job["promise"] = math.inf
        if on_arrival is not None:
            job["promise"] = on_arrival(job, seen(pool, suspended, spread, now, preempt, guard), list(queue))
        queue.append(job)
        clock = now
        fill(now)
    run_until(math.inf)
    return waits


def seen(pool: list[_Slot], suspended: list[tuple[dict, float]], spread: dict[int, float], now: float,
         preempt: bool = True, guard: Callable[[dict], tuple[float, float]] = no_guards) -> list[Held]:
    """The slots' work as a worker reports it: each job's time left as the rates predict it (its own spread
    unknown), its tier, who may preempt it (nobody, where nobody does) and how long its guards protect it (a
    resumed job the rest of its residency, a suspended one a fresh one, one near its end to its end)."""
    def held(job: dict, left: float, status: int, residency: float) -> Held:
        tier, k = Tier(job["tier"]), spread[job["i"]]
        protected = left if near_end(guard, spread, job, left) else residency
        return Held(Work(tier, 0, left / k), status, PREEMPTED_BY[tier] if preempt else 0, protected / k)

    return ([held(s.job, s.free_at - now, RUNNING, max(0.0, s.protected_until - now)) for s in pool
             if s.job is not None]
            + [held(job, left, SUSPENDED, residency(guard, spread, job)) for job, left in suspended])
