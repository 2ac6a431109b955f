"""Promised starts: the wait a P2/P3 job is told at admission is one the dispatcher keeps.

A job's wait estimate counts the higher-tier jobs expected to arrive and overtake it (gateway/estimate.py),
but arrivals come in clumps: a job admitted as a burst begins would be passed by every job of the burst,
and wait many times its estimate, however well the arrival rates are known (BENCHMARKS.md, issue 12: a
forecast of rates, even a perfect one, leaves 15-25 % of P3 waits outside 2x of their estimate). So each
P2/P3 job is also given a promised start: admission + ``promise_factor`` x its estimate - ``promise_lead_s``.
If it is still queued then, promote.lua moves it to the P1 queue with its enqueue score, as aging's last step
would, so that no job admitted after it goes first any more, apart from P0s (which also preempt) and the P1s
that preempt running P3 work (in the slots they free so). Jobs expected to overtake it
still do: the estimate made room for them. Only the ones beyond the forecast wait, and their own estimates
count the promises already made (queued jobs' promise times are part of the replay).

What it costs: higher-tier jobs that arrive beyond the forecast wait for the promises falling due before
them (BENCHMARKS.md measures it per tier). What it does not change: a job still preempts and is preempted
as the tier it was admitted at, nothing is lifted into P0, and jobs ahead of it when it came stay ahead.
The lead makes the promise fall due a little before the slot the estimate foresaw frees, so that a
promotion (done by each gateway's maintenance pass) is in place when it does.
"""

from __future__ import annotations

import math

from common.tiers import Tier

PROMISED_TIERS = (Tier.P2, Tier.P3)  # P0 and P1 are never promoted: nothing above them but P0


def check(factor: float, lead_s: float) -> None:
    """Raise ValueError for a configuration that cannot make promises (0 turns them off)."""
    if not (math.isfinite(factor) and factor >= 0 and math.isfinite(lead_s) and lead_s >= 0):
        raise ValueError(f"promise_factor and promise_lead_s must be finite and >= 0, got {factor}, {lead_s}")


def promise_s(tier: Tier, estimate_s: float | None, factor: float, lead_s: float) -> float | None:
    """Seconds from admission until the job's promised start falls due; None: no promise (P0/P1, promises
    off, or no estimate to promise on, as before any worker reported)."""
    if tier not in PROMISED_TIERS or factor <= 0 or estimate_s is None or not math.isfinite(estimate_s):
        return None
    return max(0.0, factor * estimate_s - lead_s)
