"""KV accounting with the priority-inversion guards: the blocks a request lacks for its next tokens, the free
blocks its tier may take, and growing its block table. A mixin of the Scheduler (like worker/giving_way.py), on
its own state (``blocks``, ``host_blocks``, ``config``, ``preemption``, ``running``, ``waiting``, ``stats``).
"""

from __future__ import annotations

from collections.abc import Callable

from common.tiers import Tier
from worker.preemption import PreemptMode
from worker.request import Request, RequestStatus
from worker.scheduler_types import BlockCopy


class KvAccounting:
    def _target_tokens(self, req: Request, n: int) -> int:
        target = req.num_computed_tokens + n
        if not self.preemption.config.preemptible(req.tier):
            # Never preempted, so it must never need a block later: reserve the whole footprint now.
            target = max(target, min(req.num_prompt_tokens + req.params.max_tokens, self.config.max_model_len))
        return target

    def _usable_free(self, req: Request, evicted: list[Request] = ()) -> int:
        """Free blocks ``req`` may take: less the P0 reserve, and within the low-tier share; ``evicted``: once those
        have freed their blocks (the share gains only what low-tier ones free)."""
        pc = self.preemption.config
        free = self.blocks.num_free + sum(len(self.blocks.block_table(r.request_id)) for r in evicted)
        if req.tier is not Tier.P0:  # (nothing preempts a P0, so nothing is promised away from one)
            to_p0, to_others = self._promised_away(req)
            free -= max(pc.p0_reserve_blocks, to_p0) + to_others  # a P0 starts on the reserve first
        if req.tier in (Tier.P2, Tier.P3) and pc.low_tier_kv_share < 1.0:
            cap = int(pc.low_tier_kv_share * self.blocks.num_blocks)
            low = self._blocks_held(lambda r: r.tier in (Tier.P2, Tier.P3))
            low -= sum(len(self.blocks.block_table(r.request_id)) for r in evicted if r.tier in (Tier.P2, Tier.P3))
            free = min(free, cap - low)
        return free

    def _promised_away(self, req: Request) -> tuple[int, int]:
        """Free blocks phase 0 promised to waiting requests that may preempt running ``req`` now, (to P0s, to the
        rest): without this, ``req`` growing in phase 1 took the blocks a victim had just given up, the urgent
        request did not start, and the next step preempted again for it. ``req`` takes blocks from work behind it,
        or gives way, instead."""
        if req.status is not RequestStatus.RUNNING or not self._promised:
            return 0, 0
        if self.preemption.guard(req, self.step_index) is not None:
            return 0, 0
        to = [(w.tier, n) for w, n in self._promised if self._promise_binds(w, req)]
        return sum(n for t, n in to if t is Tier.P0), sum(n for t, n in to if t is not Tier.P0)

    def _promise_binds(self, waiting: Request, running: Request) -> bool:
        """Whether blocks promised to ``waiting`` are kept from ``running``'s growth (its guard aside)."""
        return (self.policy.key(waiting) < self.policy.key(running)
                and self.preemption.config.may_preempt(waiting.tier, running.tier))

    def _growth_unbound(self, w: Request, isolating: bool, missing: int, spare: int) -> int:
        """Free blocks running work may take in phase 1 whatever phase 0 promises ``w``: the growth of running
        requests its promise does not bind (a guard protects them, or ``w`` may not preempt them). Without this, a
        victim gave way for blocks such a request then took, and ``w`` did not start. In an isolated step only P0s
        run, and a P0 never grows (it reserves its footprint when it starts); nothing else grows into the P0
        reserve, so a P0 that the reserve holds (beside the ``spare`` blocks promised before it) loses nothing.
        Else all of it counts: the blocks victims free widen what the others may take, up to all of it."""
        pc = self.preemption.config
        if isolating or w.tier is Tier.P0 and pc.p0_reserve_blocks - spare >= missing:
            return 0
        budget = self.config.max_num_batched_tokens
        return sum(self._missing(r, min(r.num_uncomputed_tokens, budget)) for r in self.running
                   if not self._promise_binds(w, r) or self.preemption.guard(r, self.step_index) is not None)

    def _blocks_held(self, which: Callable[[Request], bool]) -> int:
        held = [r for r in self.running if which(r)]
        held += [r for r in self.waiting if r.preempt_mode == PreemptMode.KEEP.value and which(r)]
        return sum(len(self.blocks.block_table(r.request_id)) for r in held)

    def _missing(self, req: Request, n: int, starting: bool = False) -> int:
        """Blocks ``req`` lacks for its next ``n`` tokens; ``starting``: to (re)start now (see _resume_tokens)."""
        target = self._target_tokens(req, n)
        if starting:
            target = max(target, self._resume_tokens(req))
        return self.blocks.num_missing(req.request_id, target)

    def _resume_tokens(self, req: Request) -> int:
        """Tokens a recomputed request must have room for before it resumes: its whole re-prefill and its
        residency's worth of decoding. Resuming on less would re-prefill part of it and give way again, the
        churn that wastes more than the urgent work it makes room for."""
        if req.preempt_mode != PreemptMode.RECOMPUTE.value:
            return 0
        decode = min(self.preemption.residency_tokens(req), req.params.max_tokens - len(req.output_token_ids))
        return min(req.num_tokens + decode, self.config.max_model_len)

    def _can_start(self, req: Request, n: int) -> bool:
        return self._missing(req, n, starting=True) <= self._usable_free(req)

    def _allocate(self, req: Request, n: int) -> bool:
        """Grow ``req``'s table for its next ``n`` tokens (restoring swapped blocks first)."""
        if self._missing(req, n) > self._usable_free(req):
            return False
        swapped = req.preempt_mode == PreemptMode.SWAP.value
        alloc = self.blocks.allocate(req.request_id, self._target_tokens(req, n))
        assert alloc is not None
        if swapped:
            host_ids = tuple(self.host_blocks.block_table(req.request_id))
            dev_ids = alloc.block_table[:len(host_ids)]
            self._copies.append(BlockCopy(False, dev_ids, host_ids))
            self.stats.bytes_swapped += len(host_ids) * self.preemption.config.bytes_per_block
            self.host_blocks.free(req.request_id)
            req.preempt_mode = None  # the blocks are home again; resuming is now like keep
        return True

    def _host_fits(self, req: Request) -> bool:
        need = self.blocks.blocks_for(req.num_computed_tokens)
        return self.host_blocks is not None and 0 < need <= self.host_blocks.num_free
