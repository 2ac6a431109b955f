"""How running and suspended requests give way: the preemption half of the Scheduler.

A mixin so that ``scheduler.py`` keeps the step itself (phases 1 and 2, postprocess) and this
module keeps phase 0 (preempting for waiting requests that outrank running ones), memory
reclaim for a growing request, and the bookkeeping of every decision. It works on the
Scheduler's own state (``running``, ``waiting``, ``blocks``, ``host_blocks``, ``stats``).
"""

from __future__ import annotations

import bisect

from common.tiers import ALL_TIERS, Tier
from worker.preemption import DeclineReason, PreemptionDecision, PreemptMode, Trigger
from worker.request import Request, RequestStatus
from worker.scheduler_types import BlockCopy


class GivingWay:
    def _give_way(self, req: Request, mode: PreemptMode) -> tuple[int, int]:
        """Move ``req`` (running or keep-suspended) to suspended in ``mode``; (blocks freed, bytes moved)."""
        was_running = req.status is RequestStatus.RUNNING
        if was_running:
            self.running.remove(req)
            req.num_preemptions += 1
            req.suspended_since = self.clock()
            self._preempted.append(req)
            self.stats.preemptions[(req.tier, mode)] += 1
        else:  # a keep-suspended request giving up its blocks too: a second event, counted in its mode
            self.waiting.remove(req)
            self.stats.demotions += 1
            self.stats.preemptions[(req.tier, mode)] += 1
        freed = moved = 0
        if mode is PreemptMode.SWAP:
            k = self.blocks.blocks_for(req.num_computed_tokens)
            host = self.host_blocks.allocate(req.request_id, req.num_computed_tokens)
            dev_ids = tuple(self.blocks.block_table(req.request_id)[:k])
            self._copies.append(BlockCopy(True, dev_ids, host.block_table))
            self._swapped_out.append(req)
            moved = k * self.preemption.config.bytes_per_block
            self.stats.bytes_swapped += moved
            freed = self.blocks.free(req.request_id)
        elif mode is PreemptMode.RECOMPUTE:
            self._discard(req)
            freed = self.blocks.free(req.request_id)
        req.preempt_mode = mode.value
        req.status = RequestStatus.SUSPENDED
        bisect.insort(self.waiting, req, key=self.policy.key)
        return freed, moved

    def swap_lost(self, req: Request) -> None:
        """A swap-out whose copy failed: ``req``'s KV may not be on the host, so it resumes by recompute."""
        if self.host_blocks is not None:
            self.host_blocks.free(req.request_id)
        self._discard(req)
        req.preempt_mode = PreemptMode.RECOMPUTE.value

    def _discard(self, req: Request) -> None:
        self.stats.wasted_tokens += req.num_computed_tokens
        # A mark, not a sum: every position below it was computed before, and counts when computed again
        # (``_computed_again``). A second discard in the middle of a re-prefill keeps the first's higher mark.
        req.discarded_tokens = max(req.discarded_tokens, req.num_computed_tokens)
        req.recomputed_total += req.num_computed_tokens
        req.num_recomputes += 1
        req.num_computed_tokens = 0

    def _start(self, req: Request) -> None:
        self.waiting.pop(0)
        if req.status is RequestStatus.SUSPENDED:
            req.last_resume_step = self.step_index
            req.resume_output_tokens = len(req.output_token_ids)
            if req.suspended_since is not None:
                gap = self.clock() - req.suspended_since
                req.suspended_total_s += gap
                self.stats.suspended_s += gap
                req.suspended_since = None
        req.preempt_mode = None
        req.started = True
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=self.policy.key)

    def _computed_again(self, req: Request, start: int, n: int) -> None:
        """A chunk of ``req`` computed positions start..start+n: those a recompute preemption discarded count as
        prefilled again. Counted here, not when it resumed: one cancelled in its re-prefill (or whose step failed)
        counted tokens never prefilled again."""
        if start < req.discarded_tokens:
            self.stats.recomputed_tokens += min(start + n, req.discarded_tokens) - start
            if start + n >= req.discarded_tokens:
                req.discarded_tokens = 0  # all computed again

    def _decide(self, beneficiary: Request, trigger: Trigger, victim: Request | None,
                mode: PreemptMode | None, declined: DeclineReason | None = None,
                freed: int = 0, moved: int = 0, cost: float = 0.0, inputs: dict | None = None,
                state: tuple[float, dict[str, int], dict[str, int]] | None = None) -> None:
        if declined is not None:
            seen = self._declined_once.setdefault(beneficiary.request_id, set())
            if declined in seen:
                return  # one span per waiting request and reason, not one per step
            seen.add(declined)
            self.stats.declined += 1
        self._decisions += 1
        utilisation, running, waiting = state or self._snapshot()
        self._new_decisions.append(PreemptionDecision(
            decision_id=f"pd-{self._decisions}", step=self.step_index, time=self.clock(), trigger=trigger,
            beneficiary_id=beneficiary.request_id, beneficiary_tier=beneficiary.tier,
            beneficiary_tenant=beneficiary.tenant, mode=mode, declined_reason=declined,
            victim_id=victim.request_id if victim else None, victim_tier=victim.tier if victim else None,
            victim_tenant=victim.tenant if victim else None,
            victim_progress=(len(victim.output_token_ids) / victim.params.max_tokens) if victim else 0.0,
            blocks_freed=freed, bytes_moved=moved, estimated_cost_s=cost, cost_inputs=inputs or {},
            kv_utilisation=utilisation, running_per_tier=running, waiting_per_tier=waiting))

    def _preempt(self, victim: Request, beneficiary: Request, trigger: Trigger, blocks_needed: bool) -> int:
        host_free = self.host_blocks.num_free if self.host_blocks is not None else 0
        nblocks = self.blocks.blocks_for(victim.num_computed_tokens)
        choice = self.preemption.choose_mode(victim, blocks_needed, nblocks, host_free)
        before = self._snapshot()  # the state the decision was taken in
        freed, moved = self._give_way(victim, choice.mode)
        self._decide(beneficiary, trigger, victim, choice.mode, freed=freed, moved=moved,
                     cost=choice.estimated_cost_s, inputs=choice.inputs, state=before)
        return freed

    def _snapshot(self) -> tuple[float, dict[str, int], dict[str, int]]:
        return self.blocks.usage().utilisation, _per_tier(self.running), _per_tier(self.waiting)

    def _make_room_for_waiting(self) -> None:
        """Phase 0: preempt for waiting requests that outrank running ones and cannot start.

        The blocks each waiting request is to start on are promised to it (``_promised``) until phase 2 starts it."""
        slots = self.config.max_num_seqs - len(self.running)
        low_slots = self._low_slots_free()  # the P0 slot reserve is not theirs
        spare = 0  # blocks already promised to earlier waiting requests in this pass
        budget = self.config.max_num_batched_tokens
        # What phases 1 and 2 leave of the budget, at the most: running work takes at most what it has left to
        # compute, a promised request at most its remainder. In an isolated P0 prefill step the lower tiers take
        # none of it (None: this step will not isolate).
        tokens_left = budget - sum(r.num_uncomputed_tokens for r in self.running)
        isolated_left = (budget - sum(r.num_uncomputed_tokens for r in self.running if r.tier is Tier.P0)
                         if self._isolation_ahead() else None)
        for w in list(self.waiting):
            if w.status is not RequestStatus.WAITING and w.status is not RequestStatus.SUSPENDED:
                continue
            if any(w is p for p in self._preempted):
                return  # suspended by hand since the last step: phase 2 does not resume it now, nor what follows
            missing = self._missing(w, self._tokens_this_step(w, self.config.max_num_batched_tokens) or 1,
                                    starting=True)
            urgent = w.tier is Tier.P0
            short, victims_help = self._budget_short(w, tokens_left, isolated_left)
            isolating = isolated_left is not None and urgent and not w.started
            taken = spare + self._growth_unbound(w, isolating, missing, spare)  # free blocks not there for w
            usable = self._usable_free(w) - taken

            def free_slots() -> int:
                return slots if urgent else min(slots, low_slots)

            # With chunked prefill the budget is an upper bound (phase 1 may hold lower prompts back for the
            # head, _kept_for_head): promising takes nothing from anyone, so a chunk may still find room.
            if free_slots() >= 1 and missing <= usable and (short <= 0 or self.config.enable_chunked_prefill):
                slots -= 1
                low_slots -= not urgent
                spare += missing
                self._promised.append((w, missing))
                tokens_left -= w.num_uncomputed_tokens
                if isolated_left is not None:
                    isolated_left -= w.num_uncomputed_tokens
                continue
            if short > 0 and not victims_help:
                return  # no victim frees budget it can use this step; it waits a step (_budget_short)
            if not any(self.preemption.config.may_preempt(w.tier, r.tier) for r in self.running):
                if any(r.tier.rank > w.tier.rank for r in self.running):
                    self._decide(w, Trigger.SLOT if free_slots() < 1 else Trigger.KV_MEMORY if missing > usable
                                 else Trigger.BUDGET, None, None, DeclineReason.NO_LOWER_TIER)
                return
            trigger = (Trigger.SLOT if free_slots() < 1 else Trigger.BUDGET if missing <= usable else
                       Trigger.RESERVE if missing <= self.blocks.num_free - spare else Trigger.KV_MEMORY)
            victims, why = self.preemption.candidates(w, self.running, self.step_index)
            lacking = max(0, missing - usable)
            donors = [d for d in self._keep_donors(w) if self.preemption.config.may_preempt(w.tier, d.tier)
                      ] if lacking else []
            can_free = sum(len(self.blocks.block_table(r.request_id)) for r in donors + victims)
            if (not victims and free_slots() < 1 or lacking > can_free
                    or short > sum(v.num_uncomputed_tokens for v in victims)):
                self._decide(w, trigger, None, None, why or DeclineReason.INSUFFICIENT)
                return
            for d in donors:
                if lacking <= 0:
                    break
                lacking -= self._preempt(d, w, trigger, blocks_needed=True)
            for v in victims:
                if free_slots() >= 1 and lacking <= 0 and short <= 0:
                    break
                slots += 1
                low_slots += v.tier is not Tier.P0
                short -= v.num_uncomputed_tokens
                tokens_left += v.num_uncomputed_tokens
                lacking -= self._preempt(v, w, trigger, blocks_needed=lacking > 0)
            slots -= 1
            low_slots -= not urgent
            spare += missing
            self._promised.append((w, missing))
            tokens_left -= w.num_uncomputed_tokens
            if isolated_left is not None:
                isolated_left -= w.num_uncomputed_tokens

    def _budget_short(self, w: Request, tokens_left: int, isolated_left: int | None) -> tuple[int, bool]:
        """Tokens ``w`` lacks in this step's budget after the running work and the requests promised before it
        (> 0: it cannot start), and whether victims' tokens count towards them. Its whole remainder without
        chunked prefill, one token with it: without this check, a chunked step whose budget running work took
        preempted for a request that then did not start, and the victim gave way for nothing.

        In a step that isolates a P0's prefill (``isolated_left`` not None) only running P0s take the budget, so
        a lower victim frees none of it; and only a new P0 starts. In the step after one, a new P0 waits for the
        next, which gives it the budget without preempting anyone for it."""
        need = w.num_uncomputed_tokens if not self.config.enable_chunked_prefill else 1
        new_p0 = w.tier is Tier.P0 and not w.started
        if isolated_left is None:
            return need - tokens_left, not (new_p0 and self.config.isolate_p0_prefill)
        return (need - isolated_left, False) if new_p0 else (need, False)

    def _isolation_ahead(self) -> bool:
        """Whether this step may isolate a P0's prefill, told before phase 0 as _isolate_p0_prefill tells it after:
        the head it judges is this one (victims queue behind it), and where phase 0 lets it start, the rest holds or
        leaves no lower tier running, which runs phase 1 on the P0s all the same."""
        c = self.config
        return (c.isolate_p0_prefill and self._last_isolated_step != self.step_index - 1 and bool(self.waiting)
                and self.waiting[0].tier is Tier.P0 and not self.waiting[0].started)

    def _keep_donors(self, beneficiary: Request) -> list[Request]:
        """Suspended requests still holding blocks, which ``beneficiary`` outranks: cheapest to take from."""
        key = self.policy.key(beneficiary)
        return [r for r in reversed(self.waiting) if r.preempt_mode == PreemptMode.KEEP.value
                and self.policy.key(r) > key and self.blocks.has_blocks(r.request_id)]

    def _may_evict(self, beneficiary: Request, victim: Request) -> bool:
        """Whether running ``victim`` may give its blocks to ``beneficiary``'s growth: it is queued behind
        it, preemptible, and (tiered policy) of the same tier or one the matrix lets the beneficiary preempt.
        Within a tier the later arrival gives way, as in any continuous batcher; FIFO has no tiers."""
        pc = self.preemption.config
        if self.policy.key(victim) <= self.policy.key(beneficiary) or not pc.preemptible(victim.tier):
            return False
        return (not self.policy.preempts or victim.tier is beneficiary.tier
                or pc.may_preempt(beneficiary.tier, victim.tier))

    def _reclaim_from_suspended(self, req: Request, n: int) -> bool:
        """Take blocks from suspended requests queued behind ``req``; True if ``req`` then fits.

        Nothing is evicted unless evicting the donors makes room: a demotion that does not let ``req``
        start throws away (or moves) their KV for nothing. A donor was already preempted by a tier the
        matrix allows, so demoting it is not a new preemption across tiers, and it must be possible:
        a keep-suspended request behind the queue head cannot resume before it (strict order)."""
        donors = self._keep_donors(req)
        if self._missing(req, n, starting=True) > self._usable_free(req, donors):
            return False
        for d in donors:
            self._preempt(d, req, Trigger.KV_MEMORY, blocks_needed=True)
            if self._can_start(req, n) and self._allocate(req, n):
                return True
        return False

    def _reclaim_for_growth(self, req: Request, n: int) -> bool:
        """A running request needs blocks: take them from work it may evict, else give way itself.

        Victims are taken only when all of them together make room (else none is)."""
        donors = self._keep_donors(req)
        victims = [r for r in self.running if r is not req and self._may_evict(req, r)
                   and self.preemption.guard(r, self.step_index) is not DeclineReason.RESIDENCY]
        # All of them together must make room, under the low-tier share too: a P1 victim's blocks do not raise it.
        if self._missing(req, n) <= self._usable_free(req, donors + victims):
            for v in donors + victims[::-1]:  # suspended first (cheapest), then the last in policy order
                self._preempt(v, req, Trigger.KV_MEMORY, blocks_needed=True)
                if self._allocate(req, n):
                    return True
        if self.preemption.config.preemptible(req.tier):
            # Its residency does not hold it here: it protects progress, and a request that cannot grow
            # makes none; waiting in place would stall every request that needs what it holds.
            self._preempt(req, req, Trigger.KV_MEMORY, blocks_needed=True)
        return False


def _per_tier(requests: list[Request]) -> dict[str, int]:
    counts = {t.value: 0 for t in ALL_TIERS}
    for r in requests:
        counts[r.tier.value] += 1
    return counts
