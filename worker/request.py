"""Per-request state: what to generate, how far it has got, and how it ended.

A request carries ``num_computed_tokens`` (tokens whose K/V are in the cache)
instead of a prefill/decode flag: a prompt is prefilled while
``num_computed_tokens < len(prompt)``, chunked prefill is just a smaller step,
and a recomputed request is one whose counter went back to zero.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from common.client_messages import MAX_PENALTY, MAX_STOP_TOKEN_IDS
from common.errors import InvalidRequest
from common.tiers import Tier


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or one of the request's stop token ids
    LENGTH = "length"  # max_tokens reached, or the model's context is full
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # its step failed (e.g. device out of memory); RequestOutput.error says why


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # not started yet
    RUNNING = "running"  # holds a batch slot
    SUSPENDED = "suspended"  # preempted; waits to resume (see Request.preempt_mode)
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None  # None: no top-k filtering
    top_p: float = 1.0
    # Fixes this request's random stream, independent of what else is batched with it.
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # No stop token (nor EOS, unless ignore_eos) is sampled before this many output tokens (vLLM's min_tokens).
    min_tokens: int = 0
    # OpenAI's presence and frequency penalties and vLLM's repetition penalty (worker/sampler.py), before
    # temperature: greedy picks see them too.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def ending_ids(self, eos_token_ids) -> set[int]:
        """The tokens that end this request: its stop ids, and EOS unless it ignores EOS."""
        return set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids))

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequest on the first field that cannot be served."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", field="max_tokens")
        if not _finite(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be finite and >= 0, got {self.temperature!r}", field="temperature")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise InvalidRequest(f"top_k must be None or an integer >= 1, got {self.top_k!r}", field="top_k")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}", field="top_p")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise InvalidRequest(f"seed must be an integer in [0, 2**63), got {self.seed!r}", field="seed")
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise InvalidRequest(f"stop_token_ids must be a sequence of token ids, got {self.stop_token_ids!r}",
                                 field="stop_token_ids")
        for tid in self.stop_token_ids:
            if not isinstance(tid, int) or isinstance(tid, bool) or not 0 <= tid < vocab_size:
                raise InvalidRequest(f"stop token id {tid!r} is outside the vocabulary (0..{vocab_size - 1})",
                                     field="stop_token_ids")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}",
                                 field="stop_token_ids")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], got "
                                 f"{self.min_tokens!r}", field="min_tokens")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidRequest(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}",
                                     field=name)
        if not _finite(self.repetition_penalty) or not 0.0 < self.repetition_penalty <= MAX_PENALTY:
            raise InvalidRequest(f"repetition_penalty must be in (0, {MAX_PENALTY:g}], got {self.repetition_penalty!r}",
                                 field="repetition_penalty")


def _finite(x: object) -> bool:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an int past float's range
        return False


@dataclass(eq=False)  # identity: list.remove and `in` must not compare token lists
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tier: Tier
    # Engine-wide admission counter: the FIFO order, and the tie-break within a tier.
    arrival_seq: int
    # Seed actually used; drawn at admission when the caller gave none, so a
    # recomputed request samples the same tokens again.
    seed: int
    tenant: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # How the request gave way while SUSPENDED: "keep", "swap" or "recompute" (a PreemptMode).
    preempt_mode: str | None = None
    # Scheduler step at which it last resumed after a preemption (the anti-ping-pong guard).
    last_resume_step: int | None = None
    # Tokens it had generated when it last resumed: its residency is counted in tokens generated since
    # (so a re-prefill, however long, is protected until the request has decoded again).
    resume_output_tokens: int = 0
    # Output it came with (a re-dispatched job goes on from earlier attempts' tokens): its first token here is
    # the one after them.
    added_output_tokens: int = 0
    num_preemptions: int = 0
    # Positions whose KV a recompute preemption threw away and the re-prefill has not yet computed again up to
    # (0 once it has): each computed again counts in SchedulerStats.recomputed_tokens.
    discarded_tokens: int = 0
    # Over its life: recompute preemptions, and the tokens they threw away (the sunk cost of choosing it).
    num_recomputes: int = 0
    recomputed_total: int = 0
    suspended_since: float | None = None
    suspended_total_s: float = 0.0
    # Set once the request first holds a batch slot; a started request resumes before new work of its tier.
    started: bool = False
    # Times in seconds from time.monotonic(); filled by the engine.
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what the KV cache must eventually hold."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Token ids at positions [start, stop) of prompt + output."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: str
    new_token_ids: list[int]  # tokens sampled in this step (empty for an abort)
    finished: bool
    finish_reason: FinishReason | None  # set exactly when finished
    num_output_tokens: int  # all tokens generated so far, including new_token_ids
    num_preemptions: int = 0  # times this request was preempted so far
    error: str | None = None  # with FinishReason.ERROR: what failed
