"""Promised starts: the wait a P3 job is told at admission is one the dispatcher keeps, as far as the tiers allow.

A job's wait estimate counts the higher-tier jobs expected to arrive and overtake it (gateway/estimate.py),
but arrivals come in clumps: a P3 admitted as a burst of P2s begins is passed by every job of the burst and
waits many times its estimate, however well the arrival rates are known (BENCHMARKS.md, issue 12: a forecast
of rates, even a perfect one, left a quarter of P3 waits outside 2x of their estimates). So each P3 job is
also given a promised start: admission + ``promise_factor`` x its estimate - ``promise_lead_s``. If it is still
queued then, promote.lua moves it to the P2 queue with its enqueue score, as if it had aged early: from then
on no P2 admitted after it goes first. The P2s the estimate foresaw still do (it made room for them); only
those beyond the forecast wait, and their own estimates count the promises already made (the replay knows
every queued job's promise).

What it does not change: P0 and P1 jobs still go first (they preempt P3 work, and are in higher queues),
a promoted job still preempts and is preempted as a P3, and it ages on from P2 like any P2.
What it costs: P2s wait for the P3s whose promises fell due before them; under sustained load that is most
P3s, which without promises would wait until they aged (BENCHMARKS.md: at load 0.86 the P2s' mean wait went
from 2.9 s to 22.6 s, the P3s' hardly moved). ``promise_factor = 0`` keeps P2 strictly first. The lead makes a
promise fall due a little before the slot the estimate foresaw frees, so that the promotion (each gateway's
maintenance pass) is in place when it does.

P2 promises (``promise_tiers`` has P2 by default): the same for a P2 against the P1s, into the P1 queue.
What overtakes a P2 is P1s in the queue and P0s; a place in the P1 queue stops the P1s admitted after the
promise's job (they do not preempt P2 work), not the P0s. The costs (BENCHMARKS.md, issue 12, fourteenth
session): P1s wait for the P2s whose promises fell due before them; and a P3 promised into P2 is passed by
every P2 whose promise falls due while it waits (``["P3"]`` keeps it whole). Two rules that kept the
P3's place were tried offline and dropped: a promoted P2 taking the P2 queue ahead of it along to P1, with
their own places there, made a P1's wait depend on P2 promises made after it (P1 within 2x fell from 81 % to
45 % on the code trace, a figure a wait-model bug fixed in the eighteenth session made worse: it had a P1 preempt
a P3 in the P1 queue ahead of it at once, past the older P1s; BENCHMARKS.md); moving a P2 only once it is first in
the P2 queue took most of P2's gain away. P0
and P1 jobs are never given a promise: what overtakes them is P0, which preempts, and a place in a queue
would not stop it.
"""

from __future__ import annotations

import math
from collections.abc import Collection

from common.tiers import Tier
from gateway.estimate import PROMOTED_TO


def tiers(names: Collection[str]) -> frozenset[Tier]:
    """The tiers of a ``promise_tiers`` setting; ValueError for one that cannot be promised (P0, P1, unknown)."""
    out = set()
    for name in names:
        try:
            tier = Tier(name)
        except ValueError:
            tier = None
        if tier not in PROMOTED_TO:
            raise ValueError(f"promise_tiers: {name!r} cannot be promised; expected some of "
                             f"{sorted(t.value for t in PROMOTED_TO)}")
        out.add(tier)
    return frozenset(out)


def check(factor: float, lead_s: float) -> None:
    """Raise ValueError for a configuration that cannot make promises (0 turns them off)."""
    if not (math.isfinite(factor) and factor >= 0 and math.isfinite(lead_s) and lead_s >= 0):
        raise ValueError(f"promise_factor and promise_lead_s must be finite and >= 0, got {factor}, {lead_s}")


def promise_s(tier: Tier, estimate_s: float | None, factor: float, lead_s: float,
              tiers: Collection[Tier]) -> float | None:
    """Seconds from admission until the job's promised start falls due; None: no promise (not of ``tiers``,
    promises off, or no estimate to promise on, as before any worker reported)."""
    if (tier not in tiers or tier not in PROMOTED_TO or factor <= 0 or estimate_s is None
            or not math.isfinite(estimate_s)):
        return None
    return max(0.0, factor * estimate_s - lead_s)
