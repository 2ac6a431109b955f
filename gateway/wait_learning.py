"""What the wait estimate learns as the gateway runs: how long outputs are (from finished jobs),
how fast each tier's jobs arrive (from admissions), and, optionally, how far its waits ran
from its estimates."""

from __future__ import annotations

import math
from collections import OrderedDict

from common.tiers import ALL_TIERS, Tier
from gateway.estimate import Arrivals, Work

MIN_HISTORY_S = 10.0  # arrival rates are averaged over at least this long
DEFAULT_OUTPUT_SHARE = 1.0  # before any job of a tier finished: assume it uses all of max_tokens


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


class HandOffs:
    """Per worker, how long a dispatch takes to start there: sent until its first prefill chunk started, a
    decayed mean over recent jobs, one for jobs sent while the worker was running other work and one for
    jobs sent to an idle worker. A worker reads its socket between engine steps, so the first is mostly the
    rest of the step in progress: on a CPU with long prompts, a good part of a second per job, paid again by
    every job that takes a slot after another. The second is next to nothing. One mean of both would put a
    job that must wait for a step at a fraction of it."""

    DECAY = 0.05
    MAX_SAMPLE_S = 10.0  # one job's hand-off counts at most this (a stalled worker is the lease's business)
    MAX_WORKERS = 1024  # workers remembered (the oldest reported dropped first: worker ids churn on restarts)

    def __init__(self) -> None:
        self._mean: OrderedDict[tuple[str, bool], float] = OrderedDict()

    def learn(self, worker: str, seconds: float, busy: bool = True) -> None:
        x = min(self.MAX_SAMPLE_S, max(0.0, seconds))
        key = (worker, busy)
        old = self._mean.pop(key, None)
        self._mean[key] = x if old is None else (1 - self.DECAY) * old + self.DECAY * x
        while len(self._mean) > 2 * self.MAX_WORKERS:
            self._mean.popitem(last=False)

    def of(self, worker: str, busy: bool = True) -> float:
        """The worker's hand-off; for one that has started no such job yet, the mean of the others' (0 at
        first)."""
        if (worker, busy) in self._mean:
            return self._mean[(worker, busy)]
        others = [v for (_, b), v in self._mean.items() if b == busy]
        return sum(others) / len(others) if others else 0.0


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
    """Decayed arrival rate of jobs per tier, with their mean work (prompt and expected output tokens)."""

    def __init__(self, tau_s: float, start: float) -> None:
        self.tau_s = tau_s
        self.start = start
        self._level = {t: [0.0, 0.0, 0.0] for t in ALL_TIERS}  # decayed sums of prefill, decode tokens, jobs
        self._at = start

    def _decay(self, now: float) -> None:
        if now > self._at:
            f = math.exp(-(now - self._at) / self.tau_s)
            for v in self._level.values():
                v[:] = [x * f for x in v]
            self._at = now

    def add(self, tier: Tier, prefill: float, decode: float, now: float) -> None:
        self._decay(now)
        level = self._level[tier]
        level[0] += prefill
        level[1] += decode
        level[2] += 1

    def arrivals(self, tier: Tier, now: float) -> Arrivals:
        self._decay(now)
        # A young gateway has seen less than tau of history: scale up, or early rates read low (but not
        # from a second's history, where one arrival would read as a flood).
        seen = 1 - math.exp(-max(MIN_HISTORY_S, now - self.start) / self.tau_s)
        p, d, n = self._level[tier]
        return Arrivals(Work(tier, p / n, d / n), n / self.tau_s / seen) if n > 0 else Arrivals(Work(tier, 0, 0), 0.0)
