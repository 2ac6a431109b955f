"""How long a job will wait: admission until its first prefill starts on a worker.

The estimate replays, in tokens, the work that will run before the job on the slots that
exist (no job-count rates, no floors):

- every batch slot of every worker is busy for the rest of the work it holds that the job
  may not preempt (a P2 waits behind running P3 work; a P0 does not, it preempts it);
- held work that will start before the job and then the queued jobs ahead of it (higher
  tiers, then its own tier in queue order) each take the slot that frees first. P0 and P1
  go to a full worker and preempt there, so only held work of their tier or higher starts
  before them; P2 and P3 go only where a slot is free, after all held work (a suspended job
  holds its slot's credit);
- a job holds a slot for prompt / prefill rate + expected output / decode rate, with the
  per-sequence rates each worker measured (worker/calibration.py, in every heartbeat);
- expected output is learned per tenant and tier from finished jobs, as a share of
  max_tokens (so it never exceeds max_tokens);
- higher tiers that arrive while it waits overtake it: with ``rho`` the share of the slots
  their measured arrivals keep busy, the wait stretches to ``w / (1 - rho)``. A P2 or P3 job
  that waits an aging interval moves up a tier with its enqueue time, so from then on only the
  tiers above its new one overtake it: ``rho`` is given per aging interval waited.

The wait is the time the first slot frees. Pure functions here; ``gateway/wait_estimator.py``
feeds them from Redis and the worker registry.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from common.tiers import ALL_TIERS, Tier

RUNNING, SUSPENDED, WAITING = 0, 1, 2  # status codes of WorkerLoad.work
# Tiers the gateway dispatches to a full worker (which then preempts for them); others wait for a free slot.
PREEMPTIVE_DISPATCH = frozenset({Tier.P0, Tier.P1})
MAX_RHO = 0.8  # beyond this share of overtaking work only aging gives a finite wait: cap it there
MIN_HISTORY_S = 10.0  # arrival rates are averaged over at least this long
DEFAULT_OUTPUT_SHARE = 1.0  # before any job of a tier finished: assume it uses all of max_tokens


@dataclass(frozen=True)
class Rates:
    prefill_tps: float  # per sequence
    decode_tps: float  # per sequence

    def seconds(self, prefill_tokens: float, decode_tokens: float) -> float:
        return prefill_tokens / self.prefill_tps + decode_tokens / self.decode_tps


@dataclass(frozen=True)
class Work:
    """One job's work still to do, in tokens."""

    tier: Tier
    prefill: float
    decode: float  # expected tokens still to generate


@dataclass(frozen=True)
class Held:
    """Work a worker holds (WorkerLoad.work)."""

    work: Work
    status: int  # RUNNING, SUSPENDED or WAITING
    preemptible_by: int  # bit mask of tier ranks that may preempt it

    def blocks(self, tier: Tier) -> bool:
        """Does this running work keep ``tier`` out of its slot until it ends?"""
        return self.status == RUNNING and not (tier in PREEMPTIVE_DISPATCH and (self.preemptible_by >> tier.rank) & 1)

    def goes_before(self, tier: Tier) -> bool:
        """Held but not running, and will start first (a suspended job resumes before new work of its tier)."""
        return self.status != RUNNING and (tier not in PREEMPTIVE_DISPATCH or self.work.tier.rank <= tier.rank)


@dataclass
class WorkerView:
    slots: int
    rates: Rates
    held: list[Held] = field(default_factory=list)


def wait_s(tier: Tier, workers: Sequence[WorkerView], queued_ahead: Iterable[Work], *,
           overtaking_slot_s_per_s: float | Sequence[float] = 0.0, aging_interval_s: float = math.inf,
           handoff_s: float = 0.0) -> float:
    """Seconds until the first slot is free for a job of ``tier`` (see the module docstring).

    ``queued_ahead``: the queued jobs that will be dispatched before it, in dispatch order.
    ``overtaking_slot_s_per_s``: slot-seconds of higher-tier work arriving per second; a sequence
    gives it for each aging interval waited (the last one holds from then on).
    ``handoff_s``: a queued job's delay between a slot freeing and its prefill starting.
    """
    if not workers:
        return math.inf
    heap: list[tuple[float, int]] = []  # (free at, worker index)
    for i, w in enumerate(workers):
        free = sorted((w.rates.seconds(h.work.prefill, h.work.decode) for h in w.held if h.blocks(tier)),
                      reverse=True)[:w.slots]
        slots = free + [0.0] * (w.slots - len(free))
        # Held work that starts before the job runs here, in tier order (suspended first within a tier).
        for h in sorted((h for h in w.held if h.goes_before(tier)), key=lambda h: (h.work.tier.rank, h.status)):
            j = min(range(len(slots)), key=slots.__getitem__)
            slots[j] += w.rates.seconds(h.work.prefill, h.work.decode)
        heap += [(t, i) for t in slots]
    heapq.heapify(heap)
    for work in queued_ahead:
        t, i = heapq.heappop(heap)
        heapq.heappush(heap, (t + handoff_s + workers[i].rates.seconds(work.prefill, work.decode), i))
    first_free = heap[0][0]
    if first_free <= 0:
        return 0.0
    slots = sum(w.slots for w in workers)
    phases = [overtaking_slot_s_per_s] if isinstance(overtaking_slot_s_per_s, (int, float)) else overtaking_slot_s_per_s
    # While higher tiers keep a share rho of the slots busy, the work ahead drains at (1 - rho) per second.
    left, t = first_free, 0.0
    for k, rate in enumerate(phases):
        last = k == len(phases) - 1
        # Before its last aging a job may make no progress at all (it then waits for the aging); after it,
        # a finite estimate needs some.
        drain = 1 - min(MAX_RHO if last else 1.0, max(0.0, rate) / slots)
        span = math.inf if last else aging_interval_s
        if left <= drain * span:
            return t + left / drain
        left -= drain * span
        t += span
    return t


class BiasCorrection:
    """A per-tier factor learned from finished jobs: how far their actual waits ran from their estimates.

    What the model leaves out (dispatch hand-offs, batch effects on the rates, how bursty the
    overtaking arrivals are) shows up as a steady ratio; this learns it as a decayed mean of
    log(actual / estimate) over jobs where either side was at least ``min_s`` (tiny waits say
    nothing about a ratio), bounded to 0.5x..2x so the model, not the correction, carries the estimate.
    """

    DECAY = 0.05
    LIMIT = math.log(2.0)

    def __init__(self, min_s: float = 0.5) -> None:
        self.min_s = min_s
        self._log: dict[Tier, float] = {}

    def learn(self, tier: Tier, estimate_s: float, actual_s: float) -> None:
        if max(estimate_s, actual_s) < self.min_s:
            return
        x = math.log(max(actual_s, 0.05) / max(estimate_s, 0.05))
        old = self._log.get(tier)
        self._log[tier] = x if old is None else (1 - self.DECAY) * old + self.DECAY * x

    def factor(self, tier: Tier) -> float:
        return math.exp(min(self.LIMIT, max(-self.LIMIT, self._log.get(tier, 0.0))))


class OutputLengths:
    """Expected output length: a decayed mean share of max_tokens per (tenant, tier), then per tier."""

    DECAY = 0.1

    def __init__(self) -> None:
        self._share: dict[tuple[str | None, Tier], float] = {}

    def learn(self, tenant: str, tier: Tier, max_tokens: int, generated: int) -> None:
        if max_tokens < 1:
            return
        share = min(1.0, max(0.0, generated / max_tokens))
        for key in ((tenant, tier), (None, tier)):
            old = self._share.get(key)
            self._share[key] = share if old is None else (1 - self.DECAY) * old + self.DECAY * share

    def expected(self, tenant: str | None, tier: Tier, max_tokens: int, generated: int = 0) -> float:
        """Tokens still to generate: the learned share of max_tokens, at least one more, at most what is left."""
        share = self._share.get((tenant, tier), self._share.get((None, tier), DEFAULT_OUTPUT_SHARE))
        left = max_tokens - generated
        return float(min(left, max(1.0, share * max_tokens - generated))) if left > 0 else 0.0


class ArrivalRates:
    """Decayed arrival rate of work per tier, in tokens per second (prefill and expected decode)."""

    def __init__(self, tau_s: float, start: float) -> None:
        self.tau_s = tau_s
        self.start = start
        self._level = {t: [0.0, 0.0] for t in ALL_TIERS}  # decayed sums of prefill, decode tokens
        self._at = start

    def _decay(self, now: float) -> None:
        if now > self._at:
            f = math.exp(-(now - self._at) / self.tau_s)
            for v in self._level.values():
                v[0] *= f
                v[1] *= f
            self._at = now

    def add(self, tier: Tier, prefill: float, decode: float, now: float) -> None:
        self._decay(now)
        self._level[tier][0] += prefill
        self._level[tier][1] += decode

    def tokens_per_s(self, tier: Tier, now: float) -> tuple[float, float]:
        self._decay(now)
        # A young gateway has seen less than tau of history: scale up, or early rates read low (but not
        # from a second's history, where one arrival would read as a flood).
        seen = 1 - math.exp(-max(MIN_HISTORY_S, now - self.start) / self.tau_s)
        p, d = self._level[tier]
        return p / self.tau_s / seen, d / self.tau_s / seen
