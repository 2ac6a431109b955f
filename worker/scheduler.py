"""Continuous batching with priority preemption at step boundaries.

Pure Python (no torch) so it can be tested, simulated and fuzzed without a
model. Each ``schedule()`` packs one step under two limits: at most
``max_num_seqs`` running sequences and ``max_num_batched_tokens`` tokens.

A step has three phases:
  0. (priority policy) waiting requests that outrank running ones and cannot
     start get room by preempting victims chosen by ``PreemptionPolicy``;
  1. running requests, in policy order, get their next tokens; one that needs
     a KV block when none is free takes it from lower-priority work (or gives
     way itself), so the scheduler never deadlocks on memory;
  2. waiting and suspended requests start or resume in policy order.
Invariants: a tier no other tier may preempt is never a victim, and it
reserves its whole footprint (prompt + max_tokens) when it starts, so it
never needs to take blocks later; blocks are conserved (BlockManager).
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from common.tiers import ALL_TIERS, Tier
from worker.block_manager import BlockManager
from worker.config import SchedulerConfig
from worker.policy import FifoPolicy, SchedulingPolicy
from worker.preemption import (DeclineReason, PreemptionConfig, PreemptionDecision, PreemptionPolicy,
                               PreemptMode, Trigger)
from worker.request import FinishReason, Request, RequestOutput, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first position computed in this step (the request's num_computed_tokens)
    num_tokens: int  # positions [start, start + num_tokens) are computed this step
    sample: bool  # the chunk reaches the last known token, so a new token is sampled after it


@dataclass(frozen=True)
class BlockCopy:
    """Copy KV blocks between the device pool and the host pool, before the step's forward pass."""

    to_host: bool  # True: device -> host (swap out); False: host -> device (swap in)
    device_block_ids: tuple[int, ...]
    host_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # batch order; the model runner packs them in this order
    preempted: list[Request] = field(default_factory=list)  # running requests that gave way this step
    copies: list[BlockCopy] = field(default_factory=list)  # must run in order, before the forward pass
    decisions: list[PreemptionDecision] = field(default_factory=list)  # taken and declined, for tracing

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.copies


@dataclass
class SchedulerStats:
    # (victim tier, mode) -> events; a keep-suspended request that later gives up its blocks counts again.
    preemptions: Counter = field(default_factory=Counter)
    wasted_tokens: int = 0  # computed KV discarded by recompute preemptions
    recomputed_tokens: int = 0  # tokens prefilled again after a recompute preemption
    bytes_swapped: int = 0  # both directions
    suspended_s: float = 0.0  # summed over resumed requests
    demotions: int = 0  # keep-suspended requests that later had to give up their blocks too
    declined: int = 0

    @property
    def num_recompute(self) -> int:
        return sum(n for (_, mode), n in self.preemptions.items() if mode is PreemptMode.RECOMPUTE)

    def by_mode(self) -> dict[str, int]:
        out = {m.value: 0 for m in PreemptMode}
        for (_, mode), n in self.preemptions.items():
            out[mode.value] += n
        return out


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, policy: SchedulingPolicy | None = None,
                 preemption: PreemptionConfig | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        config.validate()
        self.config = config
        self.blocks = blocks
        self.policy = policy or FifoPolicy()
        self.preemption = PreemptionPolicy(preemption or PreemptionConfig())
        pc = self.preemption.config
        self.host_blocks = BlockManager(pc.swap_space_blocks, blocks.block_size) if pc.swap_space_blocks else None
        self.clock = clock
        # Both lists stay sorted by policy key: waiting[0] is next to start, running[-1] the first to give way.
        # Suspended requests wait in `waiting` too.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self.step_index = 0
        self._decisions = 0
        # Declined decisions already recorded, per waiting request: one span per request and reason.
        self._declined_once: dict[str, set[DeclineReason]] = {}
        # Filled during one schedule() (or by a manual suspend between steps), handed out with its output.
        self._copies: list[BlockCopy] = []
        self._new_decisions: list[PreemptionDecision] = []
        self._preempted: list[Request] = []

    @property
    def num_recompute_preemptions(self) -> int:
        return self.stats.num_recompute

    # -- membership ---------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=self.policy.key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request, reason: FinishReason) -> None:
        """End ``request`` (finished or aborted) and free its blocks, on the device and the host."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.SUSPENDED):
            self.waiting.remove(request)
        self.blocks.free(request.request_id)
        if self.host_blocks is not None:
            self.host_blocks.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._declined_once.pop(request.request_id, None)

    def suspend(self, request: Request, mode: PreemptMode) -> None:
        """Preempt a running request by hand (between steps); it resumes as usual."""
        if request.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {request.request_id!r} is {request.status.value}, not running")
        if mode is PreemptMode.SWAP and not self._host_fits(request):
            raise ValueError("swap needs a host pool with room (PreemptionConfig.swap_space_blocks)")
        before = self._snapshot()
        freed, moved = self._give_way(request, mode)
        self._decide(request, Trigger.MANUAL, request, mode, freed=freed, moved=moved, state=before)

    # -- one step -----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.step_index += 1
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        if self.policy.preempts:
            self._make_room_for_waiting()
        # A new P0 at the head that can start now gets a step to itself (running work waits one step).
        urgent_only = (self.config.isolate_p0_prefill and self.waiting and self.waiting[0].tier is Tier.P0
                       and not self.waiting[0].started and len(self.running) < self.config.max_num_seqs
                       and self._missing(self.waiting[0], 1) <= self._usable_free(self.waiting[0]))

        i = 0
        while not urgent_only and i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._tokens_this_step(req, budget)
            if n and (self._allocate(req, n) or self._reclaim_for_growth(req, n)):
                chunks.append(self._chunk(req, n))
                budget -= n
            if i < len(self.running) and self.running[i] is req:  # else it gave way itself
                i += 1

        while (self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            if urgent_only and (req.tier is not Tier.P0 or req.started):
                break
            if any(req is p for p in self._preempted):
                # It gave way this step; resuming it at once would undo the decision and thrash.
                # Strict order keeps everything behind it waiting too.
                break
            n = self._tokens_this_step(req, budget)
            if n == 0 or not (self._allocate(req, n) or self._reclaim_from_suspended(req, n)):
                break  # strict policy order: later requests do not overtake the head
            self._start(req)
            chunks.append(self._chunk(req, n))
            budget -= n

        out = SchedulerOutput(chunks, self._preempted, self._copies, self._new_decisions)
        self._preempted, self._copies, self._new_decisions = [], [], []
        return out

    def _tokens_this_step(self, req: Request, budget: int) -> int:
        n = min(req.num_uncomputed_tokens, budget)
        if n < req.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
            return 0  # the whole remainder must fit in one step
        return n

    @staticmethod
    def _chunk(req: Request, n: int) -> ScheduledChunk:
        return ScheduledChunk(req, req.num_computed_tokens, n, req.num_computed_tokens + n == req.num_tokens)

    # -- KV accounting with the priority-inversion guards ---------------------

    def _target_tokens(self, req: Request, n: int) -> int:
        target = req.num_computed_tokens + n
        if not self.preemption.config.preemptible(req.tier):
            # Never preempted, so it must never need a block later: reserve the whole footprint now.
            target = max(target, min(req.num_prompt_tokens + req.params.max_tokens, self.config.max_model_len))
        return target

    def _usable_free(self, req: Request) -> int:
        """Free blocks ``req`` may take: less the P0 reserve, and within the low-tier share."""
        pc = self.preemption.config
        free = self.blocks.num_free
        if req.tier is not Tier.P0:
            free -= pc.p0_reserve_blocks
        if req.tier in (Tier.P2, Tier.P3) and pc.low_tier_kv_share < 1.0:
            cap = int(pc.low_tier_kv_share * self.blocks.num_blocks)
            free = min(free, cap - self._blocks_held(lambda r: r.tier in (Tier.P2, Tier.P3)))
        return free

    def _blocks_held(self, which: Callable[[Request], bool]) -> int:
        held = [r for r in self.running if which(r)]
        held += [r for r in self.waiting if r.preempt_mode == PreemptMode.KEEP.value and which(r)]
        return sum(len(self.blocks.block_table(r.request_id)) for r in held)

    def _missing(self, req: Request, n: int) -> int:
        return self.blocks.num_missing(req.request_id, self._target_tokens(req, n))

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

    # -- giving way -----------------------------------------------------------

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
            moved = k * self.preemption.config.bytes_per_block
            self.stats.bytes_swapped += moved
            freed = self.blocks.free(req.request_id)
        elif mode is PreemptMode.RECOMPUTE:
            self.stats.wasted_tokens += req.num_computed_tokens
            req.discarded_tokens += req.num_computed_tokens
            req.num_computed_tokens = 0
            freed = self.blocks.free(req.request_id)
        req.preempt_mode = mode.value
        req.status = RequestStatus.SUSPENDED
        bisect.insort(self.waiting, req, key=self.policy.key)
        return freed, moved

    def _start(self, req: Request) -> None:
        self.waiting.pop(0)
        if req.status is RequestStatus.SUSPENDED:
            req.last_resume_step = self.step_index
            if req.suspended_since is not None:
                gap = self.clock() - req.suspended_since
                req.suspended_total_s += gap
                self.stats.suspended_s += gap
                req.suspended_since = None
            self.stats.recomputed_tokens += req.discarded_tokens
            req.discarded_tokens = 0
        req.preempt_mode = None
        req.started = True
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=self.policy.key)

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
        """Phase 0: preempt for waiting requests that outrank running ones and cannot start."""
        slots = self.config.max_num_seqs - len(self.running)
        spare = 0  # blocks already promised to earlier waiting requests in this pass
        for w in list(self.waiting):
            if w.status is not RequestStatus.WAITING and w.status is not RequestStatus.SUSPENDED:
                continue
            missing = self._missing(w, self._tokens_this_step(w, self.config.max_num_batched_tokens) or 1)
            usable = self._usable_free(w) - spare
            if slots >= 1 and missing <= usable:
                slots -= 1
                spare += missing
                continue
            if not any(self.preemption.config.may_preempt(w.tier, r.tier) for r in self.running):
                if any(r.tier.rank > w.tier.rank for r in self.running):
                    self._decide(w, Trigger.SLOT if slots < 1 else Trigger.KV_MEMORY, None, None,
                                 DeclineReason.NO_LOWER_TIER)
                return
            trigger = (Trigger.SLOT if slots < 1 else
                       Trigger.RESERVE if missing <= self.blocks.num_free - spare else Trigger.KV_MEMORY)
            victims, why = self.preemption.candidates(w, self.running, self.step_index)
            lacking = max(0, missing - usable)
            donors = [d for d in self._keep_donors(w) if self.preemption.config.may_preempt(w.tier, d.tier)
                      ] if lacking else []
            can_free = sum(len(self.blocks.block_table(r.request_id)) for r in donors + victims)
            if not victims and slots < 1 or lacking > can_free:
                self._decide(w, trigger, None, None, why or DeclineReason.INSUFFICIENT)
                return
            for d in donors:
                if lacking <= 0:
                    break
                lacking -= self._preempt(d, w, trigger, blocks_needed=True)
            for v in victims:
                if slots >= 1 and lacking <= 0:
                    break
                slots += 1
                lacking -= self._preempt(v, w, trigger, blocks_needed=lacking > 0)
            slots -= 1
            spare += missing

    def _keep_donors(self, beneficiary: Request) -> list[Request]:
        """Suspended requests still holding blocks, which ``beneficiary`` outranks: cheapest to take from."""
        key = self.policy.key(beneficiary)
        return [r for r in reversed(self.waiting) if r.preempt_mode == PreemptMode.KEEP.value
                and self.policy.key(r) > key and self.blocks.has_blocks(r.request_id)]

    def _reclaim_from_suspended(self, req: Request, n: int) -> bool:
        """Take blocks from suspended requests queued behind ``req``; True if ``req`` then fits."""
        for d in self._keep_donors(req):
            self._preempt(d, req, Trigger.KV_MEMORY, blocks_needed=True)
            if self._allocate(req, n):
                return True
        return False

    def _reclaim_for_growth(self, req: Request, n: int) -> bool:
        """A running request needs blocks: take them from lower-priority work, else give way itself."""
        if self._reclaim_from_suspended(req, n):
            return True
        key = self.policy.key(req)
        while True:
            victims = [r for r in self.running if r is not req and self.policy.key(r) > key
                       and self.preemption.config.preemptible(r.tier)
                       and self.preemption.guard(r, self.step_index) is not DeclineReason.RESIDENCY]
            if not victims:
                break
            self._preempt(victims[-1], req, Trigger.KV_MEMORY, blocks_needed=True)
            if self._allocate(req, n):
                return True
        if self.preemption.config.preemptible(req.tier) and self.preemption.guard(
                req, self.step_index) is not DeclineReason.RESIDENCY:
            self._preempt(req, req, Trigger.KV_MEMORY, blocks_needed=True)
        return False

    # -- after the forward step ----------------------------------------------

    def postprocess(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[RequestOutput]:
        """Advance each scheduled request and append its sampled token; end the ones that are done.

        ``sampled`` maps request id to the token drawn for every chunk with ``sample`` set.
        """
        results: list[RequestOutput] = []
        for chunk in output.chunks:
            req = chunk.request
            req.num_computed_tokens = chunk.start + chunk.num_tokens
            if not chunk.sample:
                continue
            token = sampled[req.request_id]
            req.output_token_ids.append(token)
            reason = self._finish_reason(req, token)
            if reason is not None:
                self.remove(req, reason)
            results.append(RequestOutput(req.request_id, [token], reason is not None, reason,
                                         len(req.output_token_ids), req.num_preemptions))
        return results

    def _finish_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.config.eos_token_ids):
            return FinishReason.STOP
        if len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None


def _per_tier(requests: list[Request]) -> dict[str, int]:
    counts = {t.value: 0 for t in ALL_TIERS}
    for r in requests:
        counts[r.tier.value] += 1
    return counts
