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
Liveness: ``add`` refuses a request that could never fit its tier's share
of the pool, so every queued request fits once the work ahead of it is done,
and a step runs something whenever work is queued (checked by the simulator
after every step of every random trace).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from common.errors import TierLimitExceeded
from common.tiers import Tier
from worker.block_manager import BlockManager
from worker.config import SchedulerConfig
from worker.giving_way import GivingWay
from worker.kv_accounting import KvAccounting
from worker.policy import FifoPolicy, SchedulingPolicy
from worker.preemption import (DeclineReason, PreemptionConfig, PreemptionDecision, PreemptionPolicy,
                               PreemptMode, Trigger)
from worker.request import FinishReason, Request, RequestOutput, RequestStatus
# The step's output types live in scheduler_types; importable from here as before.
from worker.scheduler_types import BlockCopy, ScheduledChunk, SchedulerOutput, SchedulerStats  # noqa: F401


class Scheduler(GivingWay, KvAccounting):
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
        self._last_isolated_step = -1  # the last step that ran a P0's prefill without the lower tiers
        self._decisions = 0
        # Declined decisions already recorded, per waiting request: one span per request and reason.
        self._declined_once: dict[str, set[DeclineReason]] = {}
        # Filled during one schedule() (or by a manual suspend between steps), handed out with its output.
        self._copies: list[BlockCopy] = []
        self._new_decisions: list[PreemptionDecision] = []
        self._preempted: list[Request] = []
        self._swapped_out: list[Request] = []
        # Waiting requests phase 0 let in, and the blocks each is to start on: kept from lower work until phase 2.
        self._promised: list[tuple[Request, int]] = []

    @property
    def num_recompute_preemptions(self) -> int:
        return self.stats.num_recompute

    # -- membership ---------------------------------------------------------

    def tier_token_limit(self, tier: Tier) -> int:
        """Largest prompt + max_tokens a request of ``tier`` can ever hold: the context, and its tier's
        share of the pool (the P0 reserve and the low-tier share hold the rest back from it forever)."""
        blocks = self.preemption.config.tier_block_limit(tier, self.blocks.num_blocks)
        return min(blocks * self.blocks.block_size, self.config.max_model_len)

    def check_fits(self, tier: Tier, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise TierLimitExceeded for a request that could never finish in its tier's share."""
        total, limit = num_prompt_tokens + max_tokens, self.tier_token_limit(tier)
        # The context ends a request early (LENGTH), so it never holds more than max_model_len tokens.
        if min(total, self.config.max_model_len) > limit:
            raise TierLimitExceeded(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds the "
                f"{limit} tokens a {tier.value} request may hold in this worker's KV cache", tier=tier.value,
                limit_tokens=limit)

    def add(self, request: Request) -> None:
        self.check_fits(request.tier, request.num_prompt_tokens, request.params.max_tokens)
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
        self._promised = []
        if self.policy.preempts:
            self._make_room_for_waiting()
        urgent_only = self._isolate_p0_prefill()
        if urgent_only:
            self._last_isolated_step = self.step_index
        head, kept = (None, 0) if urgent_only else self._kept_for_head(budget)

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if urgent_only and req.tier is not Tier.P0:
                i += 1
                continue
            room = budget
            if head is not None and req.tier.rank > head.tier.rank and req.num_uncomputed_tokens > 1:
                room -= kept
            n = self._tokens_this_step(req, room) if room > 0 else 0
            if n and (self._allocate(req, n) or self._reclaim_for_growth(req, n)):
                chunks.append(self._chunk(req, n))
                budget -= n
            if i < len(self.running) and self.running[i] is req:  # else it gave way itself
                i += 1

        self._promised = []  # phase 2 starts them now, in policy order
        while self.waiting and budget > 0 and self._has_slot(self.waiting[0]):
            req = self.waiting[0]
            if urgent_only and (req.tier is not Tier.P0 or req.started):
                break
            if any(req is p for p in self._preempted):
                # It gave way this step; resuming it at once would undo the decision and thrash.
                # Strict order keeps everything behind it waiting too.
                break
            n = self._tokens_this_step(req, budget)
            if n == 0 or not (self._can_start(req, n) and self._allocate(req, n)
                              or self._reclaim_from_suspended(req, n)):
                break  # strict policy order: later requests do not overtake the head
            self._start(req)
            chunks.append(self._chunk(req, n))
            budget -= n

        out = SchedulerOutput(chunks, self._preempted, self._copies, self._new_decisions, self._swapped_out)
        self._preempted, self._copies, self._new_decisions, self._swapped_out = [], [], [], []
        return out

    def _low_slots_free(self) -> int:
        """Slots P1..P3 may still take: they hold at most max_num_seqs - p0_reserve_slots together."""
        held = sum(r.tier is not Tier.P0 for r in self.running)
        return self.config.max_num_seqs - self.config.p0_reserve_slots - held

    def _has_slot(self, req: Request) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        return req.tier is Tier.P0 or self._low_slots_free() > 0

    def next_to_start(self) -> list[Request]:
        """Waiting requests the next step starts or resumes where slots are the limit (KV blocks and the token
        budget aside): in policy order, a free slot each, the P0 slot reserve kept for P0, stopping at the first
        that has none, as schedule() does."""
        out: list[Request] = []
        running, low = len(self.running), sum(r.tier is not Tier.P0 for r in self.running)
        for req in self.waiting:
            if running >= self.config.max_num_seqs or (
                    req.tier is not Tier.P0 and low >= self.config.max_num_seqs - self.config.p0_reserve_slots):
                break
            out.append(req)
            running += 1
            low += req.tier is not Tier.P0
        return out

    def _isolate_p0_prefill(self) -> bool:
        """Whether this step runs a new P0's prefill with running P0s only (lower tiers wait one step).

        Only when that buys the P0 time: lower-tier work is running (else there is nothing to leave
        out) and the P0 can start now. Never two steps in a row, so a flood of P0s arriving about once
        per step cannot starve the running work: at worst it runs every other step."""
        if not self.config.isolate_p0_prefill or not self.waiting or self._last_isolated_step == self.step_index - 1:
            return False
        head = self.waiting[0]
        return (head.tier is Tier.P0 and not head.started and len(self.running) < self.config.max_num_seqs
                and any(r.tier is not Tier.P0 for r in self.running)
                and self._missing(head, 1) <= self._usable_free(head))

    def _kept_for_head(self, budget: int) -> tuple[Request | None, int]:
        """The waiting head and the tokens of this step kept for its next chunk, where it can start now: running
        work it outranks prefills with the rest. Without this, lower-tier prompts mid-prefill took the whole
        budget before the waiting list was looked at, and an urgent request with a free slot and blocks waited
        for every one of them to finish its prompt. Decodes (one token each) are not held back.

        Only where the free blocks also hold what the held-back prompts still need: else starting the head
        would take the blocks a prompt resumed after a preemption was let in for (_resume_tokens), it would
        give way again before its residency, and a stream of urgent requests would recompute it over and
        over; making room is _make_room_for_waiting's decision, with its guards."""
        if not self.policy.preempts or not self.waiting:
            return None, 0
        head = self.waiting[0]
        if not self._has_slot(head) or any(head is p for p in self._preempted):
            return None, 0
        n = self._tokens_this_step(head, budget)
        held_back = [r for r in self.running if r.tier.rank > head.tier.rank and r.num_uncomputed_tokens > 1]
        if n == 0 or not held_back:
            return None, 0
        need = self._missing(head, n, starting=True) + sum(self._missing(r, r.num_uncomputed_tokens)
                                                           for r in held_back)
        return (head, n) if need <= self._usable_free(head) else (None, 0)

    def _tokens_this_step(self, req: Request, budget: int) -> int:
        n = min(req.num_uncomputed_tokens, budget)
        if n < req.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
            return 0  # the whole remainder must fit in one step
        return n

    @staticmethod
    def _chunk(req: Request, n: int) -> ScheduledChunk:
        return ScheduledChunk(req, req.num_computed_tokens, n, req.num_computed_tokens + n == req.num_tokens)

    # -- after the forward step ----------------------------------------------

    def postprocess(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[RequestOutput]:
        """Advance each scheduled request and append its sampled token; end the ones that are done.

        ``sampled`` maps request id to the token drawn for every chunk with ``sample`` set.
        """
        results: list[RequestOutput] = []
        for chunk in output.chunks:
            req = chunk.request
            req.num_computed_tokens = chunk.start + chunk.num_tokens
            self._computed_again(req, chunk.start, chunk.num_tokens)
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


