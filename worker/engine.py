"""The engine loop: validate and admit requests, then schedule -> run -> sample -> update, one step at a time."""

from __future__ import annotations

import operator
import random
import time
from collections.abc import Sequence
from pathlib import Path

from common import tracing
from common.errors import DuplicateRequest, InvalidRequest
from common.tiers import ALL_TIERS, parse_tier
from worker.block_manager import BlockManager, BlockUsage
from worker.config import EngineConfig, SchedulerConfig
from worker.model_runner import ModelRunner, load_model
from worker.policy import make_policy
from worker.preemption import PreemptMode
from worker.scheduler import SchedulerStats
from worker.tracing import EngineTracer
from worker.request import FinishReason, Request, RequestOutput, SamplingParams
from worker.sampler import Sampler
from worker.scheduler import Scheduler
from worker.step_failure import fail_step


class Engine:
    def __init__(self, runner: ModelRunner, config: EngineConfig, tracer: EngineTracer | None = None) -> None:
        self.config = config
        self.runner = runner
        info = runner.info
        self.vocab_size = info.vocab_size
        self.max_model_len = config.served_context(info.max_position_embeddings)
        self.blocks = BlockManager(runner.num_blocks, config.block_size)
        self.last_batched_tokens = 0  # tokens the last step batched (prefill chunks, one per decoding sequence)
        self.last_attended_pairs = 0  # query-key pairs its attention computed (SchedulerOutput.num_attended_pairs)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                enable_chunked_prefill=config.enable_chunked_prefill,
                max_model_len=self.max_model_len,
                eos_token_ids=info.eos_token_ids,
                isolate_p0_prefill=config.isolate_p0_prefill,
                p0_reserve_slots=config.p0_reserve_slots,
            ),
            self.blocks,
            make_policy(config.policy),
            runner.config.preemption_config(runner.bytes_per_block),  # cost rates measured on CUDA
        )
        host = self.scheduler.host_blocks
        runner.allocate_host_pool(host.num_blocks if host is not None else 0)
        self.tracer = tracer or EngineTracer()
        self.sampler = Sampler(runner.device, info.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._arrivals = 0
        self._seeds = random.Random()  # only for requests that gave no seed

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, config: EngineConfig | None = None) -> Engine:
        config = config or EngineConfig()
        config.validate()
        return cls(ModelRunner(load_model(model_dir, config), config), config)

    # -- requests -----------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int],
                    params: SamplingParams | None = None, tier: str = "P3", tenant: str | None = None,
                    trace_context: dict[str, str] | None = None, output_token_ids: Sequence[int] = ()) -> None:
        """Queue a request; raises InvalidRequest (and changes nothing) if it can never be served.

        ``trace_context``: W3C headers of the trace this request belongs to (its spans join it).
        ``output_token_ids``: output an earlier run of this request already produced (a re-dispatched job): it is
        prefilled with the prompt and generation goes on after it. Cut before its first stop token or EOS (unless
        ignore_eos) and to max_tokens - 1, so the request always generates, and ends, here.
        """
        params = params or SamplingParams()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest("request_id must be a non-empty string", field="request_id")
        if request_id in self._requests:
            raise DuplicateRequest(request_id)
        tier_ = parse_tier(tier)
        prompt = self._validate_prompt(prompt_token_ids)
        params.validate(self.vocab_size)
        if len(prompt) >= self.max_model_len:
            raise InvalidRequest(f"prompt has {len(prompt)} tokens; the model's context is {self.max_model_len} "
                                 f"and at least one must be left to generate", field="prompt_token_ids")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds the "
                f"model's context of {self.max_model_len} tokens", field="max_tokens")
        need = self.blocks.blocks_for(total)
        if need > self.blocks.num_blocks:
            raise InvalidRequest(f"request needs {need} KV blocks but the pool holds only "
                                 f"{self.blocks.num_blocks}", field="max_tokens")
        resumed = self._validate_prompt(output_token_ids, "output_token_ids", may_be_empty=True)
        # A stop token ends a request as an EOS does: output past one was never part of the result.
        stops = params.ending_ids(self.scheduler.config.eos_token_ids)
        resumed = resumed[:next((i for i, t in enumerate(resumed) if t in stops), len(resumed))]
        resumed = resumed[:params.max_tokens - 1]
        self.scheduler.check_fits(tier_, len(prompt), params.max_tokens)
        # Read before anything is queued: a refusal must leave no request behind.
        parent = tracing.context_from(_checked_trace_context(trace_context)) if trace_context else None
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        self._arrivals += 1
        req = Request(request_id, prompt, params, tier_, self._arrivals, seed, tenant=tenant,
                      arrival_time=time.monotonic(), output_token_ids=resumed, resume_output_tokens=len(resumed),
                      added_output_tokens=len(resumed))
        self._requests[request_id] = req
        self.scheduler.add(req)
        self.tracer.request_added(req, parent)

    def _validate_prompt(self, prompt_token_ids: Sequence[int], name: str = "prompt_token_ids",
                         may_be_empty: bool = False) -> list[int]:
        try:
            if isinstance(prompt_token_ids, (str, bytes)):
                raise TypeError("text, not token ids")
            items = list(prompt_token_ids)
            if any(isinstance(t, bool) for t in items):
                raise TypeError("bool is not a token id")
            # operator.index takes ints (and numpy ints) but refuses floats and strings.
            prompt = [operator.index(t) for t in items]
        except (TypeError, ValueError):
            raise InvalidRequest(f"{name} must be a sequence of integers", field=name) from None
        if not prompt and not may_be_empty:
            raise InvalidRequest(f"{name} is empty", field=name)
        bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})", field=name)
        return prompt

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its KV blocks; False if it is unknown or already finished."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req, FinishReason.ABORT)
        req.finish_time = time.monotonic()
        self.tracer.request_finished(req)
        return True

    def suspend(self, request_id: str, mode: str | PreemptMode = PreemptMode.RECOMPUTE) -> None:
        """Preempt a running request by hand (tests, draining a worker); the scheduler resumes it as usual.

        Raises KeyError for an unknown request and ValueError if it is not running or the mode is unusable.
        """
        req = self._requests[request_id]
        self.scheduler.suspend(req, PreemptMode(mode))  # copies and the decision go out with the next step

    def stats(self) -> SchedulerStats:
        """Preemptions by tier and mode, wasted and recomputed tokens, bytes swapped, time suspended."""
        return self.scheduler.stats

    def tier_limits(self) -> dict[str, int]:
        """Largest prompt + max_tokens each tier may ask for here (what add_request accepts)."""
        return {t.value: self.scheduler.tier_token_limit(t) for t in ALL_TIERS}

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def kv_usage(self) -> BlockUsage:
        return self.blocks.usage()

    # -- the loop -----------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one forward step over the scheduled batch; one output per request that got a token.

        If the step fails (device out of memory, any exception from the model or the sampler), the
        requests in it end with FinishReason.ERROR and their blocks are freed; the engine keeps serving
        the others."""
        sched = self.scheduler.schedule()
        self.last_batched_tokens = sched.num_batched_tokens  # for the step's cost (worker/step_cost.py)
        self.last_attended_pairs = sched.num_attended_pairs
        self.tracer.step_scheduled(sched, self._requests)
        copies_done = False
        try:
            if sched.copies:
                self.runner.copy_blocks(sched.copies)
            copies_done = True
            if not sched.chunks:
                return []
            sampling = [c.request for c in sched.chunks if c.sample]
            logits = self.runner.execute(sched.chunks, self.blocks)
            tokens = self.sampler.sample(logits, sampling) if sampling else []
        except Exception as e:  # noqa: BLE001 - whatever failed, the batch's requests end and the rest go on
            return fail_step(self, sched, e, copies_done)
        outputs = self.scheduler.postprocess(sched, {r.request_id: t for r, t in zip(sampling, tokens)})
        self.tracer.step_finished(sched)
        now = time.monotonic()
        for out in outputs:
            req = self._requests[out.request_id]
            if req.first_token_time is None:
                req.first_token_time = now
            if out.finished:
                req.finish_time = now
                del self._requests[out.request_id]
                self.tracer.request_finished(req)
        return outputs


def _checked_trace_context(headers: object) -> dict[str, str]:
    """W3C headers as the propagator reads them: a mapping of strings (it raises TypeError on anything else)."""
    if not isinstance(headers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in headers.items()):
        raise InvalidRequest("trace_context must map header names to string values", field="trace_context")
    return headers
