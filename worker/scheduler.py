"""Continuous batching: which requests run in the next forward step, and how many tokens each.

Pure Python (no torch) so it can be tested, simulated and fuzzed without a
model. Each ``schedule()`` call packs one step under two limits: at most
``max_num_seqs`` running sequences and ``max_num_batched_tokens`` tokens.
Running requests go first (decodes, then the rest of chunked prefills), then
waiting requests in policy order. When a running request needs a KV block
and none is free, the running request last in policy order is preempted by
recompute (its blocks freed, its tokens re-prefilled later) so the ones
ahead of it always make progress: the scheduler cannot deadlock on memory.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from worker.block_manager import BlockManager
from worker.config import SchedulerConfig
from worker.policy import FifoPolicy, SchedulingPolicy
from worker.request import FinishReason, Request, RequestOutput, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first position computed in this step (the request's num_computed_tokens)
    num_tokens: int  # positions [start, start + num_tokens) are computed this step
    sample: bool  # the chunk reaches the last known token, so a new token is sampled after it


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]  # batch order; the model runner packs them in this order
    preempted: list[Request] = field(default_factory=list)  # sent back to waiting this step (recompute)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager,
                 policy: SchedulingPolicy | None = None) -> None:
        config.validate()
        self.config = config
        self.blocks = blocks
        self.policy = policy or FifoPolicy()
        # Both lists stay sorted by policy key: waiting[0] is next to start,
        # running[-1] is the first to give way.
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        # Running requests pushed back to waiting for lack of KV blocks, since start.
        self.num_recompute_preemptions = 0

    # -- membership ---------------------------------------------------------

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=self.policy.key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request, reason: FinishReason) -> None:
        """End ``request`` (finished or aborted) and free its blocks."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.blocks.free(request.request_id)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    # -- one step -----------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._tokens_this_step(req, budget)
            if n == 0:
                i += 1
                continue
            while self.blocks.allocate(req.request_id, req.num_computed_tokens + n) is None:
                victim = self.running[-1]
                self._preempt_recompute(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                chunks.append(self._chunk(req, n))
                budget -= n
                i += 1

        # New work only when nothing had to give way: otherwise the request just
        # preempted would be re-admitted at once and thrash.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            n = self._tokens_this_step(req, budget)
            if n == 0 or self.blocks.allocate(req.request_id, req.num_computed_tokens + n) is None:
                break  # strict policy order: later requests do not overtake the head
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=self.policy.key)
            chunks.append(self._chunk(req, n))
            budget -= n

        return SchedulerOutput(chunks, preempted)

    def _tokens_this_step(self, req: Request, budget: int) -> int:
        n = min(req.num_uncomputed_tokens, budget)
        if n < req.num_uncomputed_tokens and not self.config.enable_chunked_prefill:
            return 0  # the whole remainder must fit in one step
        return n

    @staticmethod
    def _chunk(req: Request, n: int) -> ScheduledChunk:
        return ScheduledChunk(req, req.num_computed_tokens, n, req.num_computed_tokens + n == req.num_tokens)

    def _preempt_recompute(self, req: Request) -> None:
        self.num_recompute_preemptions += 1
        self.running.remove(req)
        self.blocks.free(req.request_id)
        req.num_computed_tokens = 0
        self.add(req)

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
                                         len(req.output_token_ids)))
        return results

    def _finish_reason(self, req: Request, token: int) -> FinishReason | None:
        params = req.params
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.config.eos_token_ids):
            return FinishReason.STOP
        if len(req.output_token_ids) >= params.max_tokens or req.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None
