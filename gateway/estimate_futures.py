"""The wait a job is told: the likeliest of several possible futures, where the next few arrivals decide it.

gateway/estimate.py replays one future: the higher tiers' jobs still to come arrive evenly spaced at their
measured rates. Where a job is only a few dispatches from a slot, that future misleads: a P2 whose slot
frees in 2 s waits 2 s if no P0/P1 arrives first and 6 s or more if one does, and at one such arrival every
2 s on average that is a coin toss the evenly spaced future calls one way every time. So for such a job
the model also replays ``FUTURES`` drawn futures (the same rates, Poisson arrivals: exponential gaps, from
fixed seeds, so one state always gives one estimate) and tells the wait that most of them are within 2x of
(of those, the one nearest their median): the point estimate the judged goal asks for (BENCHMARKS.md,
issue 12).

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
    come, the likeliest over ``futures`` drawn ones (module docstring). ``kw``: wait_s's other arguments."""
    queued, arrivals = list(queued), list(arrivals)
    even, dispatches = replay(tier, workers, queued, arrivals=arrivals, **kw)
    overtaking = any(a.per_s > 0 and a.work.tier.rank < tier.rank for a in arrivals)
    if futures <= 0 or not overtaking or dispatches is None or dispatches > FUTURE_DISPATCHES:
        return even
    drawn = []
    for seed in range(futures):
        wait, reached = replay(tier, workers, queued, arrivals=arrivals, rng=random.Random(seed),
                               max_exact=FUTURE_DISPATCHES, **kw)
        if reached is None:
            return even  # a drawn future may reach further than the evenly spaced one: too far to judge
        drawn.append(wait)
    return likeliest(drawn)
