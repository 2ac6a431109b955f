"""The line the wait model replays (gateway/estimate.py): who is first when a slot frees, with aging, promises and
the arrivals to come; and, past the replayed dispatches, the rest of the wait spread over all the slots."""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from common.tiers import ALL_TIERS, PREEMPTING_TIERS, Tier
from gateway.estimate_types import (MAX_RHO, PROMOTED_TO, Arrivals, Queued, Work, WorkerView, mean_rates,
                                    promised, rank_at)

Fits = frozenset[int] | None  # Queued.fits: the workers a queued job may go to (None: any)


def _serves(fits: Fits, worker: int | None) -> bool:
    """May a slot of ``worker`` (None: any worker's) go to a job that fits ``fits``?"""
    return fits is None or worker is None or worker in fits


def fluid_tail(line: Line, free_at: list[float], unread: Mapping[Tier, tuple[int, Work]],
               worker_of: Sequence[int] = (), fits: Fits = None) -> float:
    """When the job gets a slot, past the replayed dispatches: the work still ahead of it (the slots' rest, the
    queued jobs still in line, the arrivals due by now that overtake it) and the arrivals that overtake it from
    now on, at the mean rates, drained by all the slots; in phases, as aging moves the job up a tier. Queued
    jobs of other tiers all count as ahead (where they can pass it at all): with a queue this deep, the older
    ones age with the job and the newer ones of higher tiers mostly go before it ages up to them.

    ``fits``: the workers the job may go to (``worker_of``: each slot's), on workers of different sizes. The
    others' slots drain only the work that fits them: the queued jobs ahead that fit none but some of the job's
    workers and others (confined_tail) are drained by those slots alone, and the job waits for them too."""
    shared = _all_slots_tail(line, free_at, unread)
    if fits is None:
        return shared
    return max(shared, confined_tail(line, free_at, worker_of, fits))


def confined_tail(line: Line, free_at: Sequence[float], worker_of: Sequence[int], fits: frozenset[int]) -> float:
    """When the slots of each set of workers that holds the job's have drained the queued jobs ahead that fit no
    worker outside it (the latest of those): such work has no other slots, however many the others have."""
    workers = set(worker_of)
    sets = {fits} | {fits | f for f in line.fit_sets() if f is not None}
    done = -math.inf
    for places in sets:
        if places >= workers:
            continue  # every slot: the shared tail's
        mine = [f for f, i in zip(free_at, worker_of) if i in places]
        t = min(mine)
        done = max(done, t + (sum(f - t for f in mine) + line.confined_s(places)) / len(mine))
    return done


def _all_slots_tail(line: Line, free_at: list[float], unread: Mapping[Tier, tuple[int, Work]]) -> float:
    t = min(free_at)
    slots = len(free_at)
    rank = line.rank(t)
    # A surge still to come (or a lull) counts at once: past the replayed dispatches the arrivals run at their
    # long-run rates.
    backlog = max(0.0, sum(f - t for f in free_at) + line.backlog_s(t, rank, unread) + line.surge_s(t, rank))
    while True:
        overtaking = line.overtaking_s(rank)  # slot-seconds of work arriving per second, ahead of the job
        ages_at = line.moves_at(t)
        drain = slots - overtaking
        done_at = t + backlog / drain if drain > 0 else math.inf
        if done_at <= ages_at:
            return done_at
        backlog -= (ages_at - t) * drain  # grows where the arrivals outpace the slots
        t, rank = ages_at, line.rank(ages_at)


class Line:
    """Who is first in line at a given time: the queues by tier, oldest first, with aging; arrivals join
    at the back of their tier. Per tier admitted, jobs not yet promoted stay in age order (the older one has
    aged at least as far), so the first in line is one of the per-tier heads or the oldest promoted job.

    On workers of different sizes a worker's slot goes to the first job in line that fits there (Queued.fits), as
    dispatch reads past a job whose workers are full. Each tier's jobs are kept per set of workers they fit: within a
    tier those sets are nested (a job fits every worker whose limit is at least its size), so there are at most a few,
    and the first in line for a slot is still one of a few heads. Alike workers: one set, the line as it always was."""

    def __init__(self, tier: Tier, enqueued_s: float, queued: Iterable[Queued], arrivals: Iterable[Arrivals],
                 workers: Sequence[WorkerView], aging_interval_s: float, rng: random.Random | None = None,
                 promoted_s: float = math.inf) -> None:
        self.tier, self.enqueued_s, self.aging = tier, enqueued_s, aging_interval_s
        self.promoted_s = promoted_s if tier in PROMOTED_TO else math.inf
        by_tier: dict[Tier, dict[Fits, list[tuple[int, Queued]]]] = {t: {} for t in ALL_TIERS}
        for key, q in enumerate(queued):  # keyed by place: a job may be given twice
            by_tier[q.work.tier].setdefault(q.fits, []).append((key, q))
        self.heads = {t: {f: deque(sorted(qs, key=lambda e: e[1].enqueued_s)) for f, qs in fits.items()}
                      for t, fits in by_tier.items()}
        # Promises falling due, in the order they do (those that move a job); the jobs they moved by the time asked,
        # per tier admitted and workers fitted, oldest first (heaps); and the jobs taken out of line (lazily out of
        # their deque).
        self.promises = deque(sorted((q.promoted_s, key, q) for t in PROMOTED_TO for qs in by_tier[t].values()
                                     for key, q in qs if promised(t, q.enqueued_s, aging_interval_s, q.promoted_s)))
        self.promised: dict[Tier, dict[Fits, list[tuple[float, int, Queued]]]] = {t: {} for t in PROMOTED_TO}
        self.taken: set[int] = set()
        # Only tiers above the job's arrive ahead of it (a newer job of its tier or below never is).
        streams = [a for a in arrivals if a.comes() and a.work.tier.rank < tier.rank]
        # The queue it ends in, aged (or promoted) as far as it goes; arrivals of the tiers above that overtake it
        # for good: capped (see MAX_RHO).
        final = self.final = (1 if tier.rank >= 2 and math.isfinite(aging_interval_s) else
                              PROMOTED_TO[tier] if math.isfinite(self.promoted_s) else tier.rank)
        slots = sum(w.slots for w in workers)
        self.mean = mean = mean_rates(workers)
        for_good = sum(a.long_run() * mean.seconds(a.work.prefill, a.work.decode) for a in streams
                       if a.work.tier.rank < final)
        scale = min(1.0, MAX_RHO * slots / for_good) if for_good > 0 else 1.0
        self.streams = {a.work.tier: a.scaled(scale) if a.work.tier.rank < final else a for a in streams}
        self.arrived = dict.fromkeys(self.streams, 0)  # arrivals of each tier dispatched so far
        self.last_at = dict.fromkeys(self.streams, 0.0)  # when the last of them came (a warm start for the next)
        self.next_at: dict[Tier, float] = {}  # when the next one comes, once asked (a head is asked at every slot)
        self.rng = rng  # drawn futures: each tier's next one, as a count of expected arrivals (exponential gaps)
        self.drawn = {t: rng.expovariate(1.0) for t in self.streams} if rng else {}

    def rank(self, t: float) -> int:
        """The queue the job is in at ``t``."""
        return rank_at(self.tier, self.enqueued_s, t, self.aging, self.promoted_s)

    def moves_at(self, t: float) -> float:
        """When, after ``t``, the job next moves up a queue (by aging or its promise); inf: never."""
        rank = self.rank(t)
        if promised(self.tier, self.enqueued_s, self.aging, self.promoted_s):  # promised, then aged on
            times = [self.promoted_s] + ([self.promoted_s + self.aging] if PROMOTED_TO[self.tier] > 1 else [])
        else:
            times = [self.enqueued_s + (self.tier.rank - rank + 1) * self.aging] if rank > self.final else []
        return min((x for x in times if x > t), default=math.inf)

    def _due(self, t: float) -> None:
        """Promises due by ``t`` join the promoted line."""
        while self.promises and self.promises[0][0] <= t:
            _, key, q = self.promises.popleft()
            if key not in self.taken:
                heapq.heappush(self.promised[q.work.tier].setdefault(q.fits, []), (q.enqueued_s, key, q))

    def _head(self, tier: Tier, t: float, worker: int | None) -> tuple[float, Work, int, deque | None] | None:
        """The first of ``tier`` in line for a slot of ``worker`` (None: any) at ``t``: when it was admitted (or
        comes), its work, its queue, and the deque it is first of (None: one still to come)."""
        first = None
        for fits, heads in self.heads[tier].items():
            if not _serves(fits, worker):
                continue
            while heads and (heads[0][0] in self.taken or self._promoted(heads[0][1], t)):  # promoted: in that line
                heads.popleft()
            if heads and (first is None or (heads[0][1].enqueued_s, heads[0][0]) < (first[0][1].enqueued_s,
                                                                                      first[0][0])):
                first = heads
        if first is not None:
            q = first[0][1]
            if q.enqueued_s > t:
                return None  # a job not yet admitted waits its turn
            return q.enqueued_s, q.work, rank_at(tier, q.enqueued_s, t, self.aging, q.promoted_s), first
        if tier in self.streams:
            a = self.streams[tier]
            at = self.next_at.get(tier)
            if at is None:
                # The k-th to come when k are expected, as a Poisson stream has it on average; or one drawn future.
                at = self.next_at[tier] = a.time_of(self.drawn[tier] if self.rng else self.arrived[tier] + 1,
                                                    self.last_at[tier])
            if at <= t:
                return at, a.work, tier.rank, None
        return None

    def _promoted(self, q: Queued, t: float) -> bool:
        return t >= q.promoted_s and promised(q.work.tier, q.enqueued_s, self.aging, q.promoted_s)

    def _promised_head(self, t: float, worker: int | None) -> tuple[tuple[int, float], int, Queued] | None:
        """The first of the promoted jobs at ``t`` that fit ``worker`` (None: any; per tier admitted the oldest: all
        of a tier are one tier up or, aged on, in P1): (its place in line, key, job)."""
        best = None
        for tier, by_fits in self.promised.items():
            for fits, promoted in by_fits.items():
                if not _serves(fits, worker):
                    continue
                while promoted and promoted[0][1] in self.taken:
                    heapq.heappop(promoted)
                if promoted:
                    _, key, q = promoted[0]
                    head = (rank_at(tier, q.enqueued_s, t, self.aging, q.promoted_s), q.enqueued_s), key, q
                    best = head if best is None or head[0] < best[0] else best
        return best

    def next_arrival_at(self, t: float, preempting: bool = False) -> float:
        """After ``t``, when the next job still to come that may take a slot arrives (``preempting``: one of a tier
        that preempts), as the heads asked last; inf: none comes."""
        tiers = PREEMPTING_TIERS if preempting else ALL_TIERS
        return min((at for tier, at in self.next_at.items() if tier in tiers and at > t), default=math.inf)

    def passes(self, tier: Tier) -> bool:
        """Can a queued job admitted at ``tier``, older than the job, go before it? A lower tier's only by aging,
        and never into P0."""
        return tier.rank <= self.tier.rank or (self.tier.rank >= 1 and (math.isfinite(self.aging) or bool(
            self.promises or any(p for by_fits in self.promised.values() for p in by_fits.values()))))

    def backlog_s(self, t: float, rank: int, unread: Mapping[Tier, tuple[int, Work]]) -> float:
        """Slot-seconds (at the mean rates) of the queued jobs still in line that go before the job, with the
        ``unread`` ones, and of the arrivals due by ``t`` that overtake it (in queue ``rank``) and are not
        dispatched yet."""
        total = sum(self.mean.seconds(q.work.prefill, q.work.decode) for q in self._still().values())
        total += sum(n * self.mean.seconds(work.prefill, work.decode) for queue, (n, work) in unread.items()
                     if n > 0 and self.passes(queue))
        for tier, a in self.streams.items():
            if tier.rank < rank:
                expected = a.count(t)
                due = (1 + expected - self.drawn[tier] if self.drawn[tier] <= expected else 0) if self.rng else \
                    math.floor(expected) - self.arrived[tier]
                total += max(0, due) * self.mean.seconds(a.work.prefill, a.work.decode)
        return total

    def _still(self) -> dict[int, Queued]:
        """The queued jobs still in line that may go before the job, by key."""
        still = {key: q for tier, by_fits in self.heads.items() if self.passes(tier) for qs in by_fits.values()
                 for key, q in qs}
        for tier, by_fits in self.promised.items():
            if self.passes(tier):
                for promoted in by_fits.values():
                    still.update((key, q) for _, key, q in promoted)  # promoted: out of their deque, maybe
        return {key: q for key, q in still.items() if key not in self.taken}

    def fit_sets(self) -> set[Fits]:
        """The sets of workers the queued jobs fit (None: any)."""
        return {f for by_fits in self.heads.values() for f in by_fits}

    def confined_s(self, places: frozenset[int]) -> float:
        """Slot-seconds (at the mean rates) of the queued jobs still in line that go before the job and fit no
        worker outside ``places``."""
        return sum(self.mean.seconds(q.work.prefill, q.work.decode) for q in self._still().values()
                   if q.fits is not None and q.fits <= places)

    def surge_s(self, t: float, rank: int) -> float:
        """Slot-seconds of the arrivals above their long-run rate still to come after ``t`` that overtake the
        job in queue ``rank`` (fewer than none where a lull fills in)."""
        return sum(a.surge_after(t) * self.mean.seconds(a.work.prefill, a.work.decode)
                   for tier, a in self.streams.items() if tier.rank < rank)

    def overtaking_s(self, rank: int) -> float:
        """Slot-seconds a second of the arrivals that overtake the job while it is in queue ``rank``, at their
        long-run rates."""
        return sum(a.long_run() * self.mean.seconds(a.work.prefill, a.work.decode)
                   for tier, a in self.streams.items() if tier.rank < rank)

    def first_before_the_job(self, t: float, preempting: bool = False, worker: int | None = None,
                             own: bool = True) -> Work | None:
        """At time ``t``, the job first in line if it is not the one waiting, taken out of line; else None.
        ``preempting``: the slot is taken by preemption, so only jobs admitted at a tier that preempts are
        in line for it. ``worker``: the slot's (only jobs that fit it are in line for it); None: any job.
        ``own``: the waiting job fits the slot's worker (else it is in no line for it: None is then nobody)."""
        self._due(t)  # before the heads: a promoted one leaves its deque for the promoted line
        best, best_key, source = None, (self.rank(t), self.enqueued_s) if own else (math.inf, math.inf), None
        for tier in (PREEMPTING_TIERS if preempting else ALL_TIERS):
            head = self._head(tier, t, worker)
            if head is not None and (key := (head[2], head[0])) <= best_key:
                best, best_key, source = tier, key, head[3]
        if not preempting:  # a promoted job waits for a free slot, as the tier it was admitted at
            first = self._promised_head(t, worker)
            if first is not None and first[0] <= best_key:
                self.taken.add(first[1])
                return first[2].work
        if best is None:
            return None
        if source is not None:
            key, q = source.popleft()
            self.taken.add(key)
            return q.work
        self.arrived[best] += 1
        a = self.streams[best]
        self.last_at[best] = self.next_at.pop(best)  # _head asked for it just now
        if self.rng:
            self.drawn[best] += self.rng.expovariate(1.0)
        return a.work

