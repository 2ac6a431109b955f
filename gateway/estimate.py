"""How long a job will wait: admission until its first prefill starts on a worker.

The estimate replays, in tokens, the dispatches that will happen before the job, on the slots
that exist (no job-count rates, no floors):

- every batch slot of every worker is busy for the rest of the work it holds that the job
  may not preempt (a P2 waits behind running P3 work; a P0 does not, it preempts it). Work
  waiting in a worker that has a free slot for it starts in the worker's next step: it counts
  as running;
- held work that will start before the job takes the slot that frees first. A suspended job
  holds its slot's credit, so it resumes there before any new dispatch: P2 and P3 go after all
  held work; a P0 or P1 only after held work it may not preempt (a P1 behind a P2 a P0
  suspended; held P3 work it would preempt as soon as it resumed, so it goes first in effect).
  A slot a P0 or P1 takes by preemption is not one for the jobs aged up into
  P1 ahead of it: they preempt as the tier they were admitted at (not at all), so they wait
  for a slot that frees, as the dispatcher has them;
- then, each time a slot frees, the queues hand it to their first job, as Redis would: the
  highest tier, then the oldest. Queued jobs and the jobs still to come of the tiers above
  the job's (their measured arrival rates, as evenly spaced mean jobs) both take slots; the
  job's wait ends at the first slot it is first in line for;
- aging moves a P2 or P3 job up a tier each aging interval with its enqueue time, so from then
  on it is ahead of every newer job of its new tier, and an older P3 that ages into a P2
  job's tier goes ahead of it; a P3 whose promised start falls due (gateway/promises.py)
  moves to P2 then, as if it had aged early, and every queued job's promise is replayed;
- a job holds a slot for prompt / prefill rate + expected output / decode rate, with the
  per-sequence rates each worker measured (worker/calibration.py, in every heartbeat).
- a job's prefill starts a hand-off after its slot is free, and the job holds the slot from then
  on: a worker reads its dispatches between engine steps, so on a worker that is running other
  work this is mostly the rest of the step in progress, and on an idle one next to nothing. Each
  worker's two are learned from its jobs (gateway/wait_learning.HandOffs); the job's own counts
  too, so a job with a free slot next to running work waits for the step.

A deep queue costs an estimate no more than a shallow one: the replay takes its first
MAX_EXACT_DISPATCHES dispatches one by one, then spreads the work still ahead of the job (and the
arrivals that overtake it, phase by phase as it ages) over all the slots at their mean rates; and
the estimator reads only the oldest jobs of each queue, counting the rest (gateway/wait_estimator.py).
Past a few hundred dispatches the two agree within a few per cent (tests/test_estimate.py).

Pure functions here; what is learned (expected output lengths, arrival rates) is in
``gateway/wait_learning.py``; ``gateway/wait_estimator.py`` feeds both from Redis and the
worker registry.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from common.tiers import ALL_TIERS, PREEMPTING_TIERS, Tier

RUNNING, SUSPENDED, WAITING = 0, 1, 2  # status codes of WorkerLoad.work
# Who may preempt a job of each tier (a bit mask of tier ranks), by the default preemption matrix: for jobs not yet
# on a worker, whose reports give the mask of the jobs they hold.
PREEMPTED_BY = {Tier.P0: 0, Tier.P1: 0, Tier.P2: 0b01, Tier.P3: 0b11}
# Arrivals that overtake a job for good (P0's, or any tier's without aging) are capped at this share of the
# slots: beyond it the wait has no finite expectation.
MAX_RHO = 0.8
# Dispatches replayed one by one per estimate; past them, the rest of the wait is the work still ahead spread over
# every slot (see _fluid_tail). A bound on an estimate's cost: a deep queue must not make each admission slower.
MAX_EXACT_DISPATCHES = 500
# A P3 job whose promise falls due moves to the P2 queue (gateway/promises.py): it ages early, by its enqueue time.
PROMISED_TIER, PROMISED_RANK = Tier.P3, 2


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

    def next_step(self) -> list[Held]:
        """The held work as the worker's next step leaves it: waiting work starts where a slot is free
        (by tier, suspended first, as the scheduler takes it)."""
        free = self.slots - sum(h.status == RUNNING for h in self.held)
        if free <= 0:
            return self.held
        queued = sorted((h for h in self.held if h.status != RUNNING), key=lambda h: (h.work.tier.rank, h.status))
        return ([h for h in self.held if h.status == RUNNING] + [replace(h, status=RUNNING) for h in queued[:free]]
                + queued[free:])


@dataclass(frozen=True)
class Queued:
    """A job in the Redis queues."""

    work: Work
    enqueued_s: float  # when it was admitted, relative to now (<= 0): its place in line, kept by aging
    # When its promise falls due, relative to now (a P3's): from then on it is in the P2 queue, by its enqueue time.
    promoted_s: float = math.inf


@dataclass(frozen=True)
class Arrivals:
    """Jobs of one tier still to come: ``per_s`` a second, each a mean ``work``."""

    work: Work
    per_s: float


def rank_at(tier: Tier, enqueued_s: float, t: float, aging_interval_s: float, promoted_s: float = math.inf) -> int:
    """The queue a job admitted at ``tier`` is in at time ``t``: P2 and P3 move up one tier per aging
    interval waited, up to P1, keeping their enqueue time (their place in line); a P3 whose promise falls due
    (``promoted_s``) first moves to P2 then, as if it had aged early, and ages on from there."""
    if tier.rank < 2:
        return tier.rank
    if promised(tier, enqueued_s, aging_interval_s, promoted_s):
        if t < promoted_s:
            return tier.rank
        return PROMISED_RANK if t < promoted_s + aging_interval_s else 1
    if not math.isfinite(aging_interval_s):
        return tier.rank
    return max(1, tier.rank - int((t - enqueued_s) // aging_interval_s))


def promised(tier: Tier, enqueued_s: float, aging_interval_s: float, promoted_s: float) -> bool:
    """Does the job's promise move it (a P3's, falling due before aging would move it anyway)?"""
    return tier is PROMISED_TIER and promoted_s < enqueued_s + aging_interval_s


def wait_s(tier: Tier, workers: Sequence[WorkerView], queued: Iterable[Queued] = (), *, enqueued_s: float = 0.0,
           arrivals: Iterable[Arrivals] = (), aging_interval_s: float = math.inf,
           rng: random.Random | None = None, unread: Mapping[Tier, tuple[int, Work]] | None = None,
           promoted_s: float = math.inf) -> float:
    """Seconds until a job of ``tier`` admitted at ``enqueued_s`` gets a slot (see the module docstring).

    ``queued``: the other jobs in the queues, in any order; only those that may go before it matter.
    ``arrivals``: the jobs still to come per tier; only tiers above the job's can overtake it.
    ``rng``: draw the arrivals to come as Poisson streams (exponential gaps) instead of evenly spaced: one
    possible future, for judging how widely the wait may spread (scripts/estimate_offline.py).
    ``unread``: per queue, how many more jobs it holds than ``queued`` has of it (a bounded read takes the
    oldest of each), and their mean work: newer than those read, they count past the replay only.
    ``promoted_s``: when the job's own promise falls due (a queued P3's; a new job's promise is made from this
    estimate, so it plays no part in it).
    """
    if not workers:
        return math.inf
    heap: list[tuple[float, int, bool]] = []  # (free at, worker index, only for a job that may preempt there)
    stepping = [0.0] * len(workers)  # until when each worker runs something (then a job sent there waits a step)
    for i, w in enumerate(workers):
        held = w.next_step()
        stepping[i] = max((w.rates.seconds(h.work.prefill, h.work.decode) for h in held if h.status == RUNNING),
                          default=0.0)
        busy = sorted((w.rates.seconds(h.work.prefill, h.work.decode) for h in held if h.blocks(tier)),
                      reverse=True)[:w.slots]
        # Running work the job may preempt: its slot is the job's now, but not a job's aged up to its tier
        # (that one waits for a free slot, as the tier it was admitted at, however far ahead in line).
        victims = min(w.slots - len(busy), sum(h.status == RUNNING and not h.blocks(tier) for h in held))
        slots = ([(t, False) for t in busy] + [(0.0, True)] * victims
                 + [(0.0, False)] * (w.slots - len(busy) - victims))
        # Held work that starts before the job runs here, in tier order (suspended first within a tier).
        for h in sorted((h for h in held if h.goes_before(tier)), key=lambda h: (h.work.tier.rank, h.status)):
            j = min(range(len(slots)), key=lambda j: slots[j][0])
            slots[j] = (slots[j][0] + w.rates.seconds(h.work.prefill, h.work.decode), slots[j][1])
            stepping[i] = max(stepping[i], slots[j][0])
        heap += [(t, i, urgent) for t, urgent in slots]
    heapq.heapify(heap)
    line = _Line(tier, enqueued_s, queued, arrivals, workers, aging_interval_s, rng, promoted_s)

    def handoff(t: float, i: int) -> float:  # every job's, the waiting one's too
        return workers[i].handoff_s if stepping[i] > t else workers[i].idle_handoff_s

    for _ in range(MAX_EXACT_DISPATCHES):
        t, i, urgent = heapq.heappop(heap)
        work = line.first_before_the_job(t, preempting=urgent)
        if work is None or (tier in PREEMPTING_TIERS and (PREEMPTED_BY[work.tier] >> tier.rank) & 1):
            # Its slot, or one the job preempts as soon as the job ahead of it there (aged or promised into the
            # line ahead, but still what it was admitted as) starts.
            return max(0.0, t) + handoff(t, i)
        # After a job that preempted, the victim resumes there: the slot is still one only preemption frees.
        end = t + handoff(t, i) + workers[i].rates.seconds(work.prefill, work.decode)
        stepping[i] = max(stepping[i], end)
        heapq.heappush(heap, (end, i, urgent))
    handoff_s = sum(w.handoff_s * w.slots for w in workers) / len(heap)  # every worker is busy by then
    return max(0.0, _fluid_tail(line, [t for t, _, _ in heap], unread or {})) + handoff_s


def _fluid_tail(line: _Line, free_at: list[float], unread: Mapping[Tier, tuple[int, Work]]) -> float:
    """When the job gets a slot, past the replayed dispatches: the work still ahead of it (the slots' rest, the
    queued jobs still in line, the arrivals due by now that overtake it) and the arrivals that overtake it from
    now on, at the mean rates, drained by all the slots; in phases, as aging moves the job up a tier. Queued
    jobs of other tiers all count as ahead (where they can pass it at all): with a queue this deep, the older
    ones age with the job and the newer ones of higher tiers mostly go before it ages up to them."""
    t = min(free_at)
    slots = len(free_at)
    rank = line.rank(t)
    backlog = sum(f - t for f in free_at) + line.backlog_s(t, rank, unread)
    while True:
        overtaking = line.overtaking_s(rank)  # slot-seconds of work arriving per second, ahead of the job
        ages_at = line.moves_at(t)
        drain = slots - overtaking
        done_at = t + backlog / drain if drain > 0 else math.inf
        if done_at <= ages_at:
            return done_at
        backlog -= (ages_at - t) * drain  # grows where the arrivals outpace the slots
        t, rank = ages_at, line.rank(ages_at)


class _Line:
    """Who is first in line at a given time: the queues by tier, oldest first, with aging; arrivals join
    at the back of their tier. Per tier admitted, jobs not yet promoted stay in age order (the older one has
    aged at least as far), so the first in line is one of the per-tier heads or the oldest promoted job."""

    def __init__(self, tier: Tier, enqueued_s: float, queued: Iterable[Queued], arrivals: Iterable[Arrivals],
                 workers: Sequence[WorkerView], aging_interval_s: float, rng: random.Random | None = None,
                 promoted_s: float = math.inf) -> None:
        self.tier, self.enqueued_s, self.aging = tier, enqueued_s, aging_interval_s
        self.promoted_s = promoted_s if tier is PROMISED_TIER else math.inf
        by_tier: dict[Tier, list[tuple[int, Queued]]] = {t: [] for t in ALL_TIERS}
        for key, q in enumerate(queued):  # keyed by place: a job may be given twice
            by_tier[q.work.tier].append((key, q))
        self.heads = {t: deque(sorted(qs, key=lambda e: e[1].enqueued_s)) for t, qs in by_tier.items()}
        # Promises falling due, in the order they do (those that move a job); the jobs they moved by the time asked,
        # oldest first (a heap); and the jobs taken out of line (lazily out of their tier's deque).
        self.promises = deque(sorted((q.promoted_s, key, q) for key, q in by_tier[PROMISED_TIER]
                                     if promised(PROMISED_TIER, q.enqueued_s, aging_interval_s, q.promoted_s)))
        self.promised: list[tuple[float, int, Queued]] = []
        self.taken: set[int] = set()
        # Only tiers above the job's arrive ahead of it (a newer job of its tier or below never is).
        streams = [a for a in arrivals if a.per_s > 0 and a.work.tier.rank < tier.rank]
        # The queue it ends in, aged (or promoted) as far as it goes; arrivals of the tiers above that overtake it
        # for good: capped (see MAX_RHO).
        final = self.final = (1 if tier.rank >= 2 and math.isfinite(aging_interval_s) else
                              PROMISED_RANK if math.isfinite(self.promoted_s) else tier.rank)
        slots = sum(w.slots for w in workers)
        self.mean = mean = Rates(sum(w.rates.prefill_tps * w.slots for w in workers) / slots,
                                 sum(w.rates.decode_tps * w.slots for w in workers) / slots)
        for_good = sum(a.per_s * mean.seconds(a.work.prefill, a.work.decode) for a in streams
                       if a.work.tier.rank < final)
        scale = min(1.0, MAX_RHO * slots / for_good) if for_good > 0 else 1.0
        self.streams = {a.work.tier: (a.work, a.per_s * (scale if a.work.tier.rank < final else 1.0))
                        for a in streams}
        self.arrived = dict.fromkeys(self.streams, 0)  # arrivals of each tier dispatched so far
        self.rng = rng  # drawn futures: when each tier's next one comes
        self.drawn = {t: rng.expovariate(per_s) for t, (_, per_s) in self.streams.items()} if rng else {}

    def rank(self, t: float) -> int:
        """The queue the job is in at ``t``."""
        return rank_at(self.tier, self.enqueued_s, t, self.aging, self.promoted_s)

    def moves_at(self, t: float) -> float:
        """When, after ``t``, the job next moves up a queue (by aging or its promise); inf: never."""
        rank = self.rank(t)
        if promised(self.tier, self.enqueued_s, self.aging, self.promoted_s):  # promised, then aged on
            times = [self.promoted_s, self.promoted_s + self.aging]
        else:
            times = [self.enqueued_s + (self.tier.rank - rank + 1) * self.aging] if rank > self.final else []
        return min((x for x in times if x > t), default=math.inf)

    def _due(self, t: float) -> None:
        """Promises due by ``t`` join the promoted line."""
        while self.promises and self.promises[0][0] <= t:
            _, key, q = self.promises.popleft()
            if key not in self.taken:
                heapq.heappush(self.promised, (q.enqueued_s, key, q))

    def _head(self, tier: Tier, t: float) -> tuple[float, Work, int] | None:
        heads = self.heads[tier]
        while heads and (heads[0][0] in self.taken or self._promoted(heads[0][1], t)):  # promoted: in that line
            heads.popleft()
        if heads:
            q = heads[0][1]
            if q.enqueued_s > t:
                return None  # a job not yet admitted waits its turn
            return q.enqueued_s, q.work, rank_at(tier, q.enqueued_s, t, self.aging, q.promoted_s)
        if tier in self.streams:
            work, per_s = self.streams[tier]
            # The k-th to come k gaps from now, as a Poisson stream has it on average; or one drawn future.
            at = self.drawn[tier] if self.rng else (self.arrived[tier] + 1) / per_s
            if at <= t:
                return at, work, tier.rank
        return None

    def _promoted(self, q: Queued, t: float) -> bool:
        return t >= q.promoted_s and promised(q.work.tier, q.enqueued_s, self.aging, q.promoted_s)

    def _promised_head(self, t: float) -> tuple[tuple[int, float], int, Queued] | None:
        """The first of the promoted jobs at ``t`` (the oldest: all are in P2 or, aged on, P1): (its place in
        line, key, job)."""
        while self.promised and self.promised[0][1] in self.taken:
            heapq.heappop(self.promised)
        if not self.promised:
            return None
        _, key, q = self.promised[0]
        return (rank_at(PROMISED_TIER, q.enqueued_s, t, self.aging, q.promoted_s), q.enqueued_s), key, q

    def passes(self, tier: Tier) -> bool:
        """Can a queued job admitted at ``tier``, older than the job, go before it? A lower tier's only by aging,
        and never into P0."""
        return tier.rank <= self.tier.rank or (self.tier.rank >= 1 and (math.isfinite(self.aging) or
                                                                        bool(self.promises or self.promised)))

    def backlog_s(self, t: float, rank: int, unread: Mapping[Tier, tuple[int, Work]]) -> float:
        """Slot-seconds (at the mean rates) of the queued jobs still in line that go before the job, with the
        ``unread`` ones, and of the arrivals due by ``t`` that overtake it (in queue ``rank``) and are not
        dispatched yet."""
        still = {key: q for tier, qs in self.heads.items() if self.passes(tier) for key, q in qs}
        if self.passes(PROMISED_TIER):
            still.update((key, q) for _, key, q in self.promised)  # promoted: out of their deque, maybe
        total = sum(self.mean.seconds(q.work.prefill, q.work.decode) for key, q in still.items()
                    if key not in self.taken)
        total += sum(n * self.mean.seconds(work.prefill, work.decode) for queue, (n, work) in unread.items()
                     if n > 0 and self.passes(queue))
        for tier, (work, per_s) in self.streams.items():
            if tier.rank < rank:
                due = (1 + (t - self.drawn[tier]) * per_s if self.drawn[tier] <= t else 0) if self.rng else \
                    math.floor(t * per_s) - self.arrived[tier]
                total += max(0, due) * self.mean.seconds(work.prefill, work.decode)
        return total

    def overtaking_s(self, rank: int) -> float:
        """Slot-seconds a second of the arrivals that overtake the job while it is in queue ``rank``."""
        return sum(per_s * self.mean.seconds(work.prefill, work.decode)
                   for tier, (work, per_s) in self.streams.items() if tier.rank < rank)

    def first_before_the_job(self, t: float, preempting: bool = False) -> Work | None:
        """At time ``t``, the job first in line if it is not the one waiting, taken out of line; else None.
        ``preempting``: the slot is taken by preemption, so only jobs admitted at a tier that preempts are
        in line for it."""
        self._due(t)  # before the heads: a promoted one leaves its deque for the promoted line
        best, best_key = None, (self.rank(t), self.enqueued_s)
        for tier in (PREEMPTING_TIERS if preempting else ALL_TIERS):
            head = self._head(tier, t)
            if head is not None and (key := (head[2], head[0])) <= best_key:
                best, best_key = tier, key
        if not preempting:  # a promoted job waits for a free slot, as the tier it was admitted at
            first = self._promised_head(t)
            if first is not None and first[0] <= best_key:
                self.taken.add(first[1])
                return first[2].work
        if best is None:
            return None
        if self.heads[best]:
            key, q = self.heads[best].popleft()
            self.taken.add(key)
            return q.work
        self.arrived[best] += 1
        work, per_s = self.streams[best]
        if self.rng:
            self.drawn[best] += self.rng.expovariate(per_s)
        return work
