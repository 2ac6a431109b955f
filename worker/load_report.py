"""The load report a worker sends its gateways (common.protocol.WorkerLoad), read from its engine.

Gateways dispatch on it (free slots, the victims an urgent tier may take) and estimate waits from it (what runs
and waits, the token rates and step cost measured here), so it says what the next step will do, not only what the
last one did. Built on the step loop's thread: engine state is read nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterable

from common import protocol as P
from common.tiers import ALL_TIERS, Tier
from worker.calibration import RateTracker
from worker.request import RequestStatus


def build(worker_id: str, e, rates: RateTracker, held: Iterable[str], offer: bool = True) -> P.WorkerLoad:
    """The report of worker ``worker_id`` running engine ``e``, holding the jobs ``held`` (those running or waiting
    there, and those finished whose completion is not yet sent). ``offer`` False (a worker draining): no free slot
    and no victim, so no gateway sends it work."""
    running = {t.value: 0 for t in ALL_TIERS}
    waiting = {t.value: 0 for t in ALL_TIERS}
    for r in e.scheduler.running:
        running[r.tier.value] += 1
    for r in e.scheduler.waiting:
        waiting[r.tier.value] += 1
    here = e.scheduler.running + e.scheduler.waiting
    any_free = max(0, e.config.max_num_seqs - len(here))
    # Slots any tier may take; the P0 slot reserve's free ones are offered to P0 alone, as victims are.
    free_slots = min(any_free, max(0, e.config.max_num_seqs - e.config.p0_reserve_slots
                                   - sum(r.tier is not Tier.P0 for r in here)))
    # A job just sent here is reported before the step that starts it: for that step (a second, beside a long
    # prompt's chunk) it runs, and an urgent job sent now preempts it at the next, as the wait model expects.
    # Counted only as running, an urgent job admitted then waited for the report after that step and missed
    # the next step's start.
    # Never-started, unguarded ones only: one that resumes is protected by its residency when it does.
    guarded = e.scheduler.preemption.protected_tokens
    next_up = e.scheduler.next_to_start()
    starting = [r for r in next_up
                if r.tier.rank > 1 and r.status is RequestStatus.WAITING and not guarded(r)]
    low_running = starting or any(r.tier.rank >= 2 and r.status is RequestStatus.RUNNING
                                  for r in e.scheduler.running)
    cost = 0.0 if any_free or low_running else 1e6  # keep-mode preemption of a P2/P3 costs nothing
    may_preempt = e.scheduler.preemption.config.may_preempt
    # An urgent job already here but not yet running (added since the last step) will take a victim of its
    # own: counting that victim as free would let a gateway send one more urgent job to wait behind it. One that
    # starts in a slot free now takes none (any_free already counts that slot as taken): counted as claiming one
    # too, the report offered no victim for a step where one ran, and an urgent job waited in Redis that long.
    claimed = sum(r.tier.rank <= 1 and r not in next_up for r in e.scheduler.waiting)
    victims = {t.value: max(0, sum(r.status is RequestStatus.RUNNING and may_preempt(t, r.tier)
                                   for r in e.scheduler.running)
                            + sum(may_preempt(t, r.tier) for r in starting) - claimed) for t in ALL_TIERS}
    victims[Tier.P0.value] += any_free - free_slots
    if not offer:
        free_slots, cost, victims = 0, 1e6, {t.value: 0 for t in ALL_TIERS}
    base_s, token_s, pair_s = rates.step_cost()
    return P.WorkerLoad(worker_id, free_slots, e.blocks.num_free, running, waiting, list(held), cost, victims,
                        *rates.rates(), rates.work(), step_base_s=base_s, step_token_s=token_s, step_pair_s=pair_s,
                        draining=not offer)
