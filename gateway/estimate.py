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
  for a slot that frees, as the dispatcher has them; where one of them the job may preempt takes
  such a slot, the first P0 or P1 in line preempts it there: the job, or an older one queued;
- then, each time a slot frees, the queues hand it to their first job, as Redis would: the
  highest tier, then the oldest (on workers of different sizes, the first that fits that worker:
  dispatch reads past the others, Queued.fits). Queued jobs and the jobs still to come of the tiers above
  the job's (evenly spaced mean jobs at a rate that settles from the one now to the long-run
  one: gateway/arrival_forecast.py) both take slots; the job's wait ends at the first slot it
  is first in line for;
- aging moves a P2 or P3 job up a tier each aging interval with its enqueue time, so from then
  on it is ahead of every newer job of its new tier, and an older P3 that ages into a P2
  job's tier goes ahead of it; a P3 whose promised start falls due (gateway/promises.py)
  moves to P2 then, as if it had aged early, and every queued job's promise is replayed;
- the work a worker holds runs out as its engine steps do (gateway/estimate_steps.py), step
  by step in the worker's order at the step cost it measured (worker/step_cost.py, in every
  heartbeat), from its report on: so the model also knows when the step in progress ends. A
  job the replay starts there holds its slot for prompt / prefill rate + expected output /
  decode rate, the per-sequence rates the worker measured on its jobs (worker/calibration.py),
  and its prefill lengthens the work held there by its tokens' cost. Where a worker reports no
  step cost, its held work is timed at those rates too.
- a job's prefill starts a hand-off after its slot is free, and the job holds the slot from then
  on: a worker reads its dispatches between engine steps, so on a worker that is running other
  work this is mostly the rest of the step in progress, and on an idle one next to nothing. Each
  worker's two are learned from its jobs (gateway/wait_learning.HandOffs); the job's own counts
  too, so a job with a free slot next to running work waits for the step. Where the worker's next
  step may prefill a prompt it holds (work just sent or waiting there, or a prefill under way),
  that step is as long as the longest such prefill, up to the tokens the worker prefills in one
  step (its max_num_batched_tokens, in its hello), and a job sent during it starts
  after it: on long prompts a P0 that preempts at once still waits a second, where the learned
  hand-off says a tenth.

A deep queue costs an estimate no more than a shallow one: the replay takes its first
MAX_EXACT_DISPATCHES dispatches one by one, then spreads the work still ahead of the job (and the
arrivals that overtake it, phase by phase as it ages) over all the slots at their mean rates; and
the estimator reads only the oldest jobs of each queue, counting the rest (gateway/wait_estimator.py).
Past a few hundred dispatches the two agree within a few per cent (tests/test_estimate.py).

This is one future, with the arrivals evenly spaced; what a job is told, where a few arrivals decide its
wait, is the likeliest of several drawn ones (gateway/estimate_futures.py).

Pure functions here, with the data in ``gateway/estimate_types.py`` and the line replayed in
``gateway/estimate_line.py``; what is learned (expected output lengths, arrival rates) is in
``gateway/wait_learning.py``; ``gateway/wait_estimator.py`` feeds both from Redis and the
worker registry.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterable, Mapping, Sequence

from common.tiers import PREEMPTING_TIERS, Tier
from gateway.estimate_line import Line, fluid_tail
from gateway.estimate_types import (MAX_RHO, PREEMPTED_BY, PROMOTED_TO, RUNNING, SUSPENDED, WAITING,
                                    Arrivals, Held, Queued, Rates, Work, WorkerView, promised, rank_at)

__all__ = ["MAX_EXACT_DISPATCHES", "MAX_RHO", "PREEMPTED_BY", "PROMOTED_TO", "RUNNING", "SUSPENDED",
           "WAITING", "Arrivals", "Held", "Queued", "Rates", "Work", "WorkerView", "promised", "rank_at", "replay",
           "wait_s"]

# Dispatches replayed one by one per estimate; past them, the rest of the wait is the work still ahead spread over
# every slot (estimate_line.fluid_tail). A bound on an estimate's cost: a deep queue must not make each admission
# slower.
MAX_EXACT_DISPATCHES = 500


def wait_s(tier: Tier, workers: Sequence[WorkerView], queued: Iterable[Queued] = (), **kw) -> float:
    """Seconds until a job of ``tier`` gets a slot: replay()'s estimate, with the same arguments."""
    return replay(tier, workers, queued, **kw)[0]


def replay(tier: Tier, workers: Sequence[WorkerView], queued: Iterable[Queued] = (), *, enqueued_s: float = 0.0,
           arrivals: Iterable[Arrivals] = (), aging_interval_s: float = math.inf,
           rng: random.Random | None = None, unread: Mapping[Tier, tuple[int, Work]] | None = None,
           promoted_s: float = math.inf, max_exact: int = MAX_EXACT_DISPATCHES,
           dispatches: list[tuple[float, int, Work]] | None = None,
           fits: frozenset[int] | None = None) -> tuple[float, int | None]:
    """Seconds until a job of ``tier`` admitted at ``enqueued_s`` gets a slot (see the module docstring), and the
    dispatches replayed one by one to get there, the job's own included (None: past ``max_exact`` of them, the
    rest of the work ahead was spread over the slots).

    ``queued``: the other jobs in the queues, in any order; only those that may go before it matter.
    ``arrivals``: the jobs still to come per tier; only tiers above the job's can overtake it.
    ``rng``: draw the arrivals to come as Poisson streams (exponential gaps) instead of evenly spaced: one
    possible future (gateway/estimate_futures.py, scripts/estimate_offline.py).
    ``unread``: per queue, how many more jobs it holds than ``queued`` has of it (a bounded read takes the
    oldest of each), and their mean work: newer than those read, they count past the replay only.
    ``promoted_s``: when the job's own promise falls due (a queued P3's; a new job's promise is made from this
    estimate, so it plays no part in it).
    ``max_exact``: dispatches replayed one by one before the rest is spread over the slots.
    ``dispatches``: where given, each replayed dispatch before the job's is appended to it, as (slot free at,
    worker index, work): what the model expects to go first (scripts/estimate_replay.py --explain).
    ``fits``: the workers (indexes) the job itself may go to, on workers of different sizes; None: any. The others
    still serve the jobs ahead that fit them, as dispatch sends those there, and so leave the job's workers to it.
    """
    if not workers:
        return math.inf, None
    if fits is not None and not fits:
        fits = None  # a job no worker fits is sent on to any (it fails there with the reason)
    # Every slot: when it frees, its worker, and whether only a job that may preempt there can take it then. The
    # heap holds (free at, urgent, -credit, slot, version): a prefill started beside a slot's work moves its time
    # on, and the entry pushed before that is stale.
    free_at: list[float] = []
    worker_of: list[int] = []
    urgent_at: list[bool] = []
    # Per urgent slot, how long the victim resuming there is guarded once it resumes again elsewhere (_moved);
    # None: no victim resumes after the job that takes it (its work ended).
    guard_of: list[float | None] = []
    stepped: list[bool] = []  # the slot's work is running now (not work the replay starts there)
    stepping = [0.0] * len(workers)  # until when each worker runs something (then a job sent there waits a step)
    # Until when a job sent to each worker now waits to be read into a step: the step in progress (or, without a
    # step cost, the next step's prefill of a prompt held there).
    prefilling = [0.0] * len(workers)
    for i, w in enumerate(workers):
        held = w.next_step()
        times, prefill_step_s = w.run_out()
        # Work waiting there for a slot counts too: by the time a job sent now arrives, a slot may have freed for it
        # (the better fit on the dumped states of six code-trace runs: 43 of their 48 judged P0 waits within 2x,
        # against 25 with the learned hand-off alone; BENCHMARKS.md, issue 12, sixteenth session).
        # A long prompt is prefilled a chunk of the worker's step budget at a time: the job joins the step after
        # the chunk in progress (on seven code-trace runs' dumped states, P0's median error fell on five).
        prefilling[i] = prefill_step_s
        stepping[i] = max((x[0] for x in times if x is not None), default=0.0)
        # Work the job may not preempt frees its slot as it ends.
        blocked = sorted((times[k][0] for k, h in enumerate(held) if h.blocks(tier)), reverse=True)[:w.slots]
        # Work the job may preempt but its guards protect to its end: the worker reports it as a victim all the
        # same, so the dispatcher sends the job there, where it takes the slot as that work ends, before the jobs
        # aged or promised ahead of it in line, which wait for a free slot.
        ending = sorted(times[k][0] for k, h in enumerate(held) if h.status == RUNNING and not h.blocks(tier)
                        and h.guarded_to_end())[:w.slots - len(blocked)]
        busy = blocked + ending
        # Running work the job may preempt: its slot is the job's once the worker's guards let it (at once, unless
        # it resumed lately), but not a job's aged up to its tier (that one waits for a free slot, as the tier it
        # was admitted at, however far ahead in line).
        # With each one's guard, which holds it again where it resumes after the job preempted it (_moved).
        victims = sorted((times[k][1], w.rates.seconds(0.0, h.guard)) for k, h in enumerate(held)
                         if h.status == RUNNING and not h.blocks(tier) and not h.guarded_to_end())[:w.slots - len(busy)]
        # Each slot: (free at, urgent, guard_of's entry).
        slots: list[tuple[float, bool, float | None]] = (
            [(t, False, 0.0) for t in blocked] + [(t, True, None) for t in ending] + [(g, True, s) for g, s in victims]
            + [(0.0, False, 0.0)] * (w.slots - len(busy) - len(victims)))
        # Held work that starts before the job runs here, in tier order (suspended first within a tier).
        for h in sorted((h for h in held if h.goes_before(tier)), key=lambda h: (h.work.tier.rank, h.status)):
            j = min(range(len(slots)), key=lambda j: slots[j][0])
            slots[j] = (slots[j][0] + w.rates.seconds(h.work.prefill, h.work.decode), *slots[j][1:])
            stepping[i] = max(stepping[i], slots[j][0])
        # Held work the job may preempt resumes in the first slots that free after that (it holds their credit):
        # there the job preempts it once it has re-read its prompt and passed its residency, but a job aged up
        # ahead of it in line, which preempts as what it was admitted (not at all), waits for a slot that frees.
        resuming = sorted((h for h in held if h.status != RUNNING and h.yields_to(tier)),
                          key=lambda h: (h.work.tier.rank, h.status))
        first_free = sorted((j for j, (_, urgent, _) in enumerate(slots) if not urgent), key=lambda j: slots[j][0])
        for j, h in zip(first_free, resuming):
            guard_s = w.rates.seconds(0.0, h.guard)
            slots[j] = ((slots[j][0] + w.rates.seconds(h.work.prefill, h.work.decode), False, guard_s)
                        if h.guarded_to_end() else (slots[j][0] + h.guarded_s(w.rates), True, guard_s))
        for j, (t, urgent, guard_s) in enumerate(slots):
            free_at.append(t)
            worker_of.append(i)
            urgent_at.append(urgent)
            guard_of.append(guard_s)
            stepped.append(j < len(busy) + len(victims))  # running work, its steps replayed
    version = [0] * len(free_at)
    # Slots free at once go as the dispatcher hands them out: a free slot before a preemption (it preempts only
    # where every worker is full), and the worker with the most free slots first.
    credit = [0] * len(workers)
    for k, t in enumerate(free_at):
        credit[worker_of[k]] += t <= 0 and not urgent_at[k]
    heap = [(t, urgent_at[k], -credit[worker_of[k]], k, 0) for k, t in enumerate(free_at)]
    heapq.heapify(heap)

    def push(k: int) -> None:
        version[k] += 1
        heapq.heappush(heap, (free_at[k], urgent_at[k], -credit[worker_of[k]], k, version[k]))
    line = Line(tier, enqueued_s, queued, arrivals, workers, aging_interval_s, rng, promoted_s)

    def handoff(t: float, i: int) -> float:  # every job's, the waiting one's too
        step = workers[i].handoff_s if stepping[i] > t else workers[i].idle_handoff_s
        return max(step, prefilling[i] - max(t, 0.0))  # a job sent mid-prefill starts in the step after it

    def start(k: int, t: float, work: Work) -> None:
        """``work`` starts in slot ``k`` at ``t`` (after its hand-off): it holds the slot to its end (at the token
        rates, measured on jobs that ran beside others' prefills), and its prefill lengthens the work running there
        now, whose steps are replayed alone."""
        i = worker_of[k]
        begins = t + handoff(t, i)
        later = workers[i].interference_s(work)
        if later > 0:
            for other in range(len(free_at)):
                if other != k and stepped[other] and worker_of[other] == i and free_at[other] > begins:
                    free_at[other] += later
                    stepping[i] = max(stepping[i], free_at[other])
                    push(other)
        free_at[k] = begins + workers[i].rates.seconds(work.prefill, work.decode)
        stepped[k] = False
        stepping[i] = max(stepping[i], free_at[k])
        push(k)

    def _moved(k: int, t: float) -> None:
        """The victim a job preempted in slot ``k`` at ``t`` is suspended again, and resumes in the first slot of its
        worker that frees (it holds that worker's credit), before the preempting job ends: that slot, not ``k``,
        is then one only preemption frees. Left in ``k``, the slot that freed first went to a job aged or promised
        ahead, which the worker never gets while the victim waits there (a P1 told 2.5 s that waited 1.2 s)."""
        i = worker_of[k]
        if guard_of[k] is None:
            urgent_at[k], guard_of[k] = False, 0.0
            push(k)
            return
        m = min((m for m in range(len(free_at)) if worker_of[m] == i and m != k and not urgent_at[m]),
                key=lambda m: free_at[m], default=None)
        if m is None or free_at[m] >= free_at[k]:
            return
        free_at[m] = max(free_at[m], t) + guard_of[k]
        urgent_at[m], guard_of[m] = True, guard_of[k]
        urgent_at[k], guard_of[k] = False, 0.0
        push(m)
        push(k)

    n = 0
    while n < max_exact:
        t, _, _, k, v = heapq.heappop(heap)
        if v != version[k]:
            continue  # moved on since
        n += 1
        i, urgent = worker_of[k], urgent_at[k]
        mine = fits is None or i in fits
        work = line.first_before_the_job(t, preempting=urgent, worker=i, own=mine)
        if work is None and not mine:
            # Nobody in line fits this worker now: its slot idles until a job to come may take it (idle from ``t``
            # on, past the replay, where none comes).
            at = line.next_arrival_at(t, preempting=urgent)
            free_at[k] = at if math.isfinite(at) else t
            if math.isfinite(at):
                push(k)
            continue
        if mine and work is not None and tier in PREEMPTING_TIERS and (PREEMPTED_BY[work.tier] >> tier.rank) & 1:
            # A job aged or promised ahead, still preemptible as what it was admitted as, starts there; the first in
            # line that may preempt it takes the slot from it: the job, unless an older P0 or P1 is still queued (the
            # dispatcher sends preempting jobs in queue order).
            if dispatches is not None:
                dispatches.append((t, i, work))
            work, urgent = line.first_before_the_job(t, preempting=True, worker=i), True
            urgent_at[k] = True
        if work is None:  # the job's slot, or one it preempts at once
            return max(0.0, t) + handoff(t, i), n
        if dispatches is not None:
            dispatches.append((t, i, work))
        start(k, t, work)
        if urgent:  # the victim resumes in the first slot its worker frees (there, if none frees before the job ends)
            _moved(k, t)
    handoff_s = sum(w.handoff_s * w.slots for w in workers) / len(free_at)  # every worker is busy by then
    return max(0.0, fluid_tail(line, free_at, unread or {}, worker_of, fits)) + handoff_s, None

