"""The wait model's data (gateway/estimate.py): the work workers hold, the queued jobs, the arrivals to come,
and the queue a job is in as it ages or its promise falls due."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from common.tiers import PREEMPTING_TIERS, Tier
from gateway.estimate_steps import StepCost, chunk_pairs, interference_s, run_out

RUNNING, SUSPENDED, WAITING = 0, 1, 2  # status codes of WorkerLoad.work
# Who may preempt a job of each tier (a bit mask of tier ranks), by the default preemption matrix: for jobs not yet
# on a worker, whose reports give the mask of the jobs they hold.
PREEMPTED_BY = {Tier.P0: 0, Tier.P1: 0, Tier.P2: 0b01, Tier.P3: 0b11}
# Arrivals that overtake a job for good (P0's, or any tier's without aging) are capped at this share of the
# slots: beyond it the wait has no finite expectation.
MAX_RHO = 0.8
# The queue a job's promise moves it to when it falls due (gateway/promises.py): one tier up, as if it had aged early,
# by its enqueue time. A P3 ages on from P2; a P2 is then in P1, where aging stops anyway.
PROMOTED_TO = {Tier.P2: 1, Tier.P3: 2}


@dataclass(frozen=True)
class Rates:
    prefill_tps: float  # per sequence
    decode_tps: float  # per sequence

    def seconds(self, prefill_tokens: float, decode_tokens: float) -> float:
        return prefill_tokens / self.prefill_tps + decode_tokens / self.decode_tps


@dataclass(frozen=True)
class Work:
    """One job's work still to do, in tokens."""

    tier: Tier  # the tier it was admitted at: it preempts and ages from there
    prefill: float
    decode: float  # expected tokens still to generate


@dataclass(frozen=True)
class Held:
    """Work a worker holds (WorkerLoad.work)."""

    work: Work
    status: int  # RUNNING, SUSPENDED or WAITING
    preemptible_by: int  # bit mask of tier ranks that may preempt it
    # Tokens it still generates (after the prompt it has left) before the worker's preemption guards let a job
    # that may preempt it do so: a resumed job's residency, or to its end near completion.
    guard: float = 0.0
    # Tokens it has in the worker's KV cache: its next chunk or token attends to them (0: none, or not reported).
    context: float = 0.0

    def guarded_s(self, rates: Rates) -> float:
        """How long until a job that may preempt it can: its prefill left and its guarded tokens."""
        return rates.seconds(self.work.prefill, self.guard) if self.guard > 0 else 0.0

    def guarded_to_end(self) -> bool:
        return self.guard > 0 and self.guard >= self.work.decode

    def yields_to(self, tier: Tier) -> bool:
        """May a job of ``tier`` preempt this work?"""
        return tier in PREEMPTING_TIERS and bool((self.preemptible_by >> tier.rank) & 1)

    def blocks(self, tier: Tier) -> bool:
        """Does this running work keep ``tier`` out of its slot until it ends?"""
        return self.status == RUNNING and not self.yields_to(tier)

    def goes_before(self, tier: Tier) -> bool:
        """Held but not running, and will start first: it holds its slot's credit, so it resumes in the first
        slot that frees there, unless the job may preempt it (a P1 waits behind a suspended P2 that resumes;
        a suspended P3 it would preempt at once, so it goes first in effect; a suspended job resumes before new
        work of its tier)."""
        return self.status != RUNNING and not self.yields_to(tier)


@dataclass
class WorkerView:
    slots: int
    rates: Rates
    held: list[Held] = field(default_factory=list)
    # A job sent here starts this long after its slot freed (gateway/wait_learning.HandOffs): while the worker
    # runs other work (it reads the job after the step in progress), and while it runs nothing.
    handoff_s: float = 0.0
    idle_handoff_s: float = 0.0
    # Most prompt tokens one engine step prefills (the worker's max_num_batched_tokens; a longer prompt is
    # prefilled in chunks of it); inf: not reported (a worker from before it said), one step per prompt.
    step_tokens: float = math.inf
    # What an engine step costs here (gateway/estimate_steps.py); None: not reported, the token rates time jobs.
    step: StepCost | None = None
    # With ``step``: how long ago the worker reported ``held`` as it is (the steps since are replayed; without
    # ``step``, the estimator advanced the running work by this age at the token rates, and it is 0 here).
    age_s: float = 0.0

    def next_step(self) -> list[Held]:
        """The held work as the worker's next step leaves it: waiting work starts where a slot is free
        (by tier, suspended first, as the scheduler takes it)."""
        free = self.slots - sum(h.status == RUNNING for h in self.held)
        if free <= 0:
            return self.held
        queued = sorted((h for h in self.held if h.status != RUNNING), key=lambda h: (h.work.tier.rank, h.status))
        return ([h for h in self.held if h.status == RUNNING] + [replace(h, status=RUNNING) for h in queued[:free]]
                + queued[free:])

    def run_out(self) -> tuple[list[tuple[float, float] | None], float]:
        """How the work held here runs out if nothing else comes: per job of ``next_step()``, for running work,
        seconds until it ends and until its guard lets a job that may preempt it do so (None for the rest); and how
        long until a job sent now is read into a step. The worker's steps replayed where it reports their cost
        (gateway/estimate_steps.py): the step in progress, or the next one where a prompt held here is waiting to
        start. Else each job at the token rates, and a job sent now waits where the next step prefills a prompt
        held here (work just sent or waiting there, or a prefill under way), up to the tokens the worker
        prefills in one step."""
        held = self.next_step()
        running = [k for k, h in enumerate(held) if h.status == RUNNING]
        times: list[tuple[float, float] | None] = [None] * len(held)
        if self.step is None:
            for k in running:
                times[k] = (self.rates.seconds(held[k].work.prefill, held[k].work.decode),
                            held[k].guarded_s(self.rates))
            return times, max((self.rates.seconds(min(h.work.prefill, self.step_tokens), 0) for h in self.held
                               if h.status in (RUNNING, WAITING) and h.work.prefill > 0), default=0.0)
        budget = max(1.0, self.step_tokens)
        ran = run_out([(held[k].work.prefill, held[k].work.decode, held[k].guard, held[k].context) for k in running],
                      self.step, budget, self.age_s)
        for k, end, guard in zip(running, ran.ends, ran.guards):
            times[k] = (end, guard)
        # A prompt waiting here without a free slot (a P0 or P1 sent to preempt) starts in the step after the one in
        # progress, and a job sent now joins the step after its first chunk.
        chunk = max((self.step.step_s(n, chunk_pairs(n, h.context)) for h in held
                     if h.status == WAITING and (n := min(h.work.prefill, budget)) > 0), default=0.0)
        return times, ran.step_left_s + chunk

    def interference_s(self, work: Work) -> float:
        """How much longer the work running here now takes while ``work``'s prompt is prefilled beside it."""
        return 0.0 if self.step is None else interference_s(self.step, work.prefill)


@dataclass(frozen=True)
class Queued:
    """A job in the Redis queues."""

    work: Work
    enqueued_s: float  # when it was admitted, relative to now (<= 0): its place in line, kept by aging
    # When its promise falls due, relative to now (a P3's): from then on it is in the P2 queue, by its enqueue time.
    promoted_s: float = math.inf
    # The workers (indexes of the views replayed) it may go to, on workers of different sizes: dispatch sends it only
    # where it fits, so another worker's free slot goes to the next job in line that fits there. None: any.
    fits: frozenset[int] | None = None


@dataclass(frozen=True)
class Arrivals:
    """Jobs of one tier still to come, each a mean ``work``: ``per_s`` a second now, settling to ``settles_to`` a
    second with time constant ``settle_s`` (a surge dies away, a lull fills in: gateway/arrival_forecast.py);
    ``settles_to`` None: ``per_s`` for good."""

    work: Work
    per_s: float
    settles_to: float | None = None
    settle_s: float = 0.0

    def steady(self) -> bool:
        """Does it arrive at ``per_s`` for good (nothing to settle to)?"""
        return self.settles_to is None or self.settle_s <= 0

    def comes(self) -> bool:
        """Is any to come at all?"""
        return self.per_s > 0 or self.long_run() > 0

    def long_run(self) -> float:
        """The rate it settles to."""
        return self.per_s if self.steady() else self.settles_to

    def rate_at(self, t: float) -> float:
        """The rate ``t`` seconds from now."""
        if self.steady():
            return self.per_s
        return self.settles_to + (self.per_s - self.settles_to) * math.exp(-t / self.settle_s)

    def count(self, t: float) -> float:
        """How many are expected by ``t`` seconds from now."""
        if t <= 0:
            return 0.0
        if self.steady():
            return self.per_s * t
        tau = self.settle_s
        return self.settles_to * t + (self.per_s - self.settles_to) * tau * -math.expm1(-t / tau)

    def surge_after(self, t: float) -> float:
        """How many more than the long-run rate brings are expected after ``t`` (fewer than none in a lull)."""
        if self.steady():
            return 0.0
        return (self.per_s - self.settles_to) * self.settle_s * math.exp(-t / self.settle_s)

    def time_of(self, k: float, after: float = 0.0) -> float:
        """When ``count`` reaches ``k`` (inf: never, a surge that dies away to nothing); ``after``: a time known
        to be no later (a warm start)."""
        if k <= 0:
            return 0.0
        if self.steady():
            return k / self.per_s if self.per_s > 0 else math.inf
        if self.settles_to <= 0 and k >= self.per_s * self.settle_s:
            return math.inf
        # Newton from below: count is increasing, and concave or convex; clamped into the bracket each step.
        lo, hi = max(0.0, after), math.inf
        t = lo
        for _ in range(60):
            c = self.count(t) - k
            if abs(c) <= 1e-9 * max(1.0, k):
                return t
            if c < 0:
                lo = t
            else:
                hi = t
            rate = self.rate_at(t)
            step = t - c / rate if rate > 0 else math.inf
            t = step if lo < step < hi else (lo + hi) / 2 if math.isfinite(hi) else max(2 * lo, lo + self.settle_s)
        return t

    def scaled(self, scale: float) -> Arrivals:
        """These arrivals with their long-run rate times ``scale`` (a surge still dies away as it would)."""
        if scale == 1.0:
            return self
        if self.steady():
            return replace(self, per_s=self.per_s * scale)
        return replace(self, settles_to=self.settles_to * scale)


def mean_rates(workers: Sequence[WorkerView]) -> Rates:
    """The per-sequence rates of ``workers``' slots on average (each worker's weighted by its slots)."""
    slots = sum(w.slots for w in workers)
    return Rates(sum(w.rates.prefill_tps * w.slots for w in workers) / slots,
                 sum(w.rates.decode_tps * w.slots for w in workers) / slots)


def rank_at(tier: Tier, enqueued_s: float, t: float, aging_interval_s: float, promoted_s: float = math.inf) -> int:
    """The queue a job admitted at ``tier`` is in at time ``t``: P2 and P3 move up one tier per aging
    interval waited, up to P1, keeping their enqueue time (their place in line); a P2 or P3 whose promise falls due
    (``promoted_s``) first moves up one tier then, as if it had aged early, and ages on from there."""
    if tier.rank < 2:
        return tier.rank
    if promised(tier, enqueued_s, aging_interval_s, promoted_s):
        if t < promoted_s:
            return tier.rank
        return max(1, PROMOTED_TO[tier] - int((t - promoted_s) // aging_interval_s))
    if not math.isfinite(aging_interval_s):
        return tier.rank
    return max(1, tier.rank - int((t - enqueued_s) // aging_interval_s))


def promised(tier: Tier, enqueued_s: float, aging_interval_s: float, promoted_s: float) -> bool:
    """Does the job's promise move it (a P2's or P3's, falling due before aging would move it anyway)?"""
    return tier in PROMOTED_TO and promoted_s < enqueued_s + aging_interval_s

