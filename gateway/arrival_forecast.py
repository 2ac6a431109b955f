"""The arrivals to come that a wait estimate counts: a surge dies away, a lull fills in.

One decayed rate per tier (30 s), carried forward unchanged over the whole wait, was the forecast before. On
bursty traffic it failed both ways (BENCHMARKS.md, issue 12, sixteenth session): at a burst's start the 30 s rate
had not caught up, so a P3 admitted there was told 1-5 s and waited 35-55 s behind the burst; once a burst of
hundreds of jobs had come, the rate read several times the cluster's capacity and was carried forward for minutes,
so P3s were told 100-300 s and waited under 50 s, the burst long over.

So the forecast has two time scales. Each tier's rate now is a short decayed rate (``SHORT_TAU_S``), which sees a
burst within seconds; the estimate expects it to settle (time constant ``SETTLE_S``) to the tier's long-run rate
(decayed over ``LONG_TAU_S``). A surge therefore adds about (now - long run) x SETTLE_S jobs, however long the wait,
and the long run is what overtakes a job that waits for minutes. The long-run rates of all tiers together are
capped at MAX_RHO of the cluster's capacity (the wait model's bound for arrivals that overtake for good): a cluster
is not offered more than it serves for long, and after a burst on a young gateway the "long-run" rate is the
burst's own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from common.tiers import ALL_TIERS, Tier
from gateway.estimate_types import MAX_RHO, Arrivals, WorkerView, mean_rates
from gateway.wait_learning import ArrivalRates

SHORT_TAU_S = 15.0
SETTLE_S = 15.0
LONG_TAU_S = 600.0


class ArrivalForecast:
    """Admissions per tier, learned at two time scales; the arrivals to come as the wait model takes them."""

    def __init__(self, start: float, short_tau_s: float = SHORT_TAU_S, settle_s: float = SETTLE_S,
                 long_tau_s: float = LONG_TAU_S) -> None:
        if not (short_tau_s > 0 and settle_s >= 0 and long_tau_s > 0):
            raise ValueError(f"arrival forecast: need short_tau_s > 0, settle_s >= 0, long_tau_s > 0, got "
                             f"{short_tau_s}, {settle_s}, {long_tau_s}")
        self.short = ArrivalRates(short_tau_s, start)
        self.long = ArrivalRates(long_tau_s, start)
        self.settle_s = settle_s

    def add(self, tier: Tier, prefill: float, decode: float, now: float) -> None:
        self.short.add(tier, prefill, decode, now)
        self.long.add(tier, prefill, decode, now)

    def arrivals(self, tiers: Iterable[Tier], now: float, workers: Sequence[WorkerView]) -> list[Arrivals]:
        """Each of ``tiers``' arrivals to come, from ``now``: its short rate settling to its long-run rate, the
        long-run rates of all tiers capped at MAX_RHO of the slots of ``workers`` (at their mean rates)."""
        long = {t: self.long.arrivals(t, now) for t in ALL_TIERS}
        scale = 1.0
        slots = sum(w.slots for w in workers)
        if slots > 0:
            mean = mean_rates(workers)
            offered = sum(a.per_s * mean.seconds(a.work.prefill, a.work.decode) for a in long.values())
            if offered > MAX_RHO * slots:
                scale = MAX_RHO * slots / offered
        out = []
        for t in tiers:
            now_rate, long_run = self.short.arrivals(t, now), long[t]
            work = now_rate.work if now_rate.per_s > 0 else long_run.work
            out.append(Arrivals(work, now_rate.per_s, long_run.per_s * scale, self.settle_s))
        return out
