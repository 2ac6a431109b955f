"""The wait a job is told: where the next few arrivals decide it, a hedge between the evenly spaced future and
the likeliest of several drawn ones.

gateway/estimate.py replays one future: the higher tiers' jobs still to come arrive evenly spaced at their
measured rates. Where a job is only a few dispatches from a slot, that future misleads: a P2 whose slot
frees in 2 s waits 2 s if no P0/P1 arrives first and 6 s or more if one does, and at one such arrival every
2 s on average that is a coin toss the evenly spaced future calls one way every time. So for such a job
the model also replays ``FUTURES`` drawn futures (the same rates, Poisson arrivals: exponential gaps, from
fixed seeds, so one state always gives one estimate) and finds the wait that most of them are within 2x of
(of those, the one nearest their median).

The job is told the geometric mean of the two. Each leans one way on its own: the evenly spaced future never
lets an arrival come early, so it tells too little where one is likely; the likeliest of eight drawn futures
tells too much (offline, on 19 segments of the conversation trace, P3s' estimates ran 1.11x their waits at
the median). Where the two differ by less than 4x, their geometric mean is within 2x of both outcomes of the
coin toss. Against the likeliest alone, on the conversation trace: P2's median error 21.9 -> 17.8 % and P3's
28.7 -> 24.2 %, within 2x P2 90.6 -> 92.6 % and P3 87.0 -> 89.5 %, P1 unchanged (offline); on the dumped
states of every real conversation-trace run since, P2's and P3's median error 4-10 points lower at the same or
a higher share within 2x (BENCHMARKS.md, issue 12, fifteenth session). On the code trace's bursts it changes
less than a point.

A job further back than ``FUTURE_DISPATCHES`` dispatches keeps the evenly spaced estimate: there many
arrivals average out, and the bound keeps an estimate's cost within a few replays of a shallow queue's
(the deep replay is the expensive one, and it runs once).
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Iterable, Sequence

from common.tiers import Tier
from gateway.estimate import Arrivals, Queued, WorkerView, replay

FUTURES = 8
FUTURE_DISPATCHES = 64


def likeliest(waits: Sequence[float]) -> float:
    """The estimate with the most of ``waits`` within 2x of it (of those, the nearest their median); waits
    of 0 are within 2x of nothing but 0, so where most are 0, so is the estimate."""
    ws = sorted(waits)
    median = ws[len(ws) // 2]
    best = (sum(w <= 0 for w in ws), -math.inf if median > 0 else 0.0, 0.0)
    for i, lo in enumerate(ws):  # every estimate in [ws[j] / 2, 2 * lo] has ws[i..j] within 2x
        if lo <= 0:
            continue
        j = bisect.bisect_right(ws, 4 * lo) - 1
        e = min(max(median, ws[j] / 2), 2 * lo)
        best = max(best, (j - i + 1, -abs(math.log(e / median)) if median > 0 else 0.0, e))
    return best[2]


def told_wait_s(tier: Tier, workers: Sequence[WorkerView], queued: Iterable[Queued] = (), *,
                arrivals: Iterable[Arrivals] = (), futures: int = FUTURES, **kw) -> float:
    """The wait to tell a job of ``tier``: wait_s's, or, for a job near a slot with higher-tier arrivals to
    come, that hedged with the likeliest over ``futures`` drawn ones (module docstring). ``kw``: wait_s's other
    arguments."""
    queued, arrivals = list(queued), list(arrivals)
    even, dispatches = replay(tier, workers, queued, arrivals=arrivals, **kw)
    overtaking = any(a.comes() and a.work.tier.rank < tier.rank for a in arrivals)
    if futures <= 0 or not overtaking or dispatches is None or dispatches > FUTURE_DISPATCHES:
        return even
    drawn = []
    for seed in range(futures):
        wait, reached = replay(tier, workers, queued, arrivals=arrivals, rng=random.Random(seed),
                               max_exact=FUTURE_DISPATCHES, **kw)
        if reached is None:
            return even  # a drawn future may reach further than the evenly spaced one: too far to judge
        drawn.append(wait)
    return hedged(even, likeliest(drawn))


def hedged(even: float, likeliest_s: float) -> float:
    """The wait told from the evenly spaced future's and the likeliest drawn one's: their geometric mean (module
    docstring); where either starts the job at once, the drawn futures' word."""
    if even <= 0 or likeliest_s <= 0 or not math.isfinite(even) or not math.isfinite(likeliest_s):
        return likeliest_s
    return math.sqrt(even * likeliest_s)
