"""The messages between SDK clients and a gateway (their codec: common/protocol.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


# Every request may carry a ``request_id`` (chosen by the client, at most MAX_REQUEST_ID_LEN characters); the
# gateway copies it onto every frame it sends for that request, so one connection can carry many calls and
# streams at once. While a stream waits on a job that sends nothing (queued, or running before its first
# token), the gateway sends a StatusReply with the stream's request id every few seconds: a keepalive that
# tells the client its gateway is alive.

MAX_REQUEST_ID_LEN = 64
MAX_IDEMPOTENCY_KEY_LEN = 200  # SubmitRequest.idempotency_key, characters
MAX_STOP_TOKEN_IDS = 128  # SubmitRequest.stop_token_ids: a chat model's end-of-turn ids are a handful
# OpenAI's presence and frequency penalties: [-2, 2]; vLLM's repetition penalty: (0, 2] (vLLM has no upper bound;
# this one keeps a logit divided or multiplied by it finite in float32). The gateway and the worker both check.
MAX_PENALTY = 2.0


@dataclass(frozen=True)
class SubmitRequest:
    api_key: str
    max_tokens: int
    prompt: str | None = None  # text, tokenized by the gateway; or prompt_token_ids
    prompt_token_ids: list[int] | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    tier: str | None = None  # None: the tenant's highest entitled tier
    idempotency_key: str | None = None
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C traceparent / tracestate
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks, tests)
    request_id: str | None = None  # echoed on every reply frame for this request
    # True: max_tokens is not the client's own but a default its front end sized for it (the HTTP door's, from the
    # room the prompt leaves by the gateway's limits of the moment). A retry under the same idempotency_key may size
    # another from the same body: the key's fingerprint leaves max_tokens out (gateway/admission.fingerprint).
    # A gateway older than the field refuses it as a protocol error (the SDK then sends the request without it).
    max_tokens_defaulted: bool = False
    # Token ids that end generation as EOS does (finish_reason "stop"; the id is the last of the output), and the
    # fewest output tokens before any of them or EOS may be sampled (vLLM's stop_token_ids and min_tokens). A
    # gateway older than the fields refuses them as a protocol error (the SDK raises it: never dropped).
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    # OpenAI's presence and frequency penalties (each in [-2, 2]: less each token already in the output, by once,
    # and by its count) and vLLM's repetition_penalty (in (0, 2]: a token of the prompt or output has its logit
    # divided by it where positive, multiplied where negative); applied before temperature, greedy too. Older
    # gateways refuse them as protocol errors, as above.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # True: the client made ``idempotency_key`` for this call's own retries (the SDK does when its caller gives
    # none): the gateway keeps it as long as the job's record (result_ttl_s), not idempotency_ttl_s (24 h), which
    # at a thousand jobs a second held tens of millions of keys nobody would ask for again. An older gateway
    # refuses the field as a protocol error (the SDK then sends the request without it).
    retry_key: bool = False


# SubmitRequest's fields a job's payload and its DispatchJob carry only when the request asks for them (not at
# their defaults), so that every other job's frames are as an older worker reads them.
SAMPLING_EXTRAS = {"stop_token_ids": [], "min_tokens": 0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                   "repetition_penalty": 1.0}


@dataclass(frozen=True)
class SubmitReply:
    job_id: str
    tier: str
    estimated_wait_s: float
    duplicate: bool  # an earlier submission with the same idempotency key
    downgraded: bool = False  # P0 quota exhausted and the tenant is configured to fall back to P1
    request_id: str | None = None


@dataclass(frozen=True)
class StreamRequest:
    """Subscribe to a job's tokens from ``from_index`` on; the gateway replies with TokenChunk... JobDone."""

    api_key: str
    job_id: str
    from_index: int = 0
    request_id: str | None = None
    # True: the client stops reading the stream that ``request_id`` opened (it gave up on it, or failed over):
    # the gateway forgets that subscription and answers nothing. Otherwise it is kept, with its keepalives and
    # a copy of every token, until the job ends.
    unsubscribe: bool = False


@dataclass(frozen=True)
class TokenChunk:
    job_id: str
    index: int  # index of token_ids[0] in the job's output; every index reaches the client once
    token_ids: list[int]
    text: str
    request_id: str | None = None


@dataclass(frozen=True)
class JobDone:
    job_id: str
    state: str  # done | failed | expired | cancelled | dead
    finish_reason: str | None
    token_ids: list[int]
    text: str
    queued_s: float
    ttft_s: float | None
    total_s: float
    preemptions: int
    reason: str | None = None  # why it failed / expired / was dead-lettered
    request_id: str | None = None


@dataclass(frozen=True)
class StatusRequest:
    api_key: str
    job_id: str
    request_id: str | None = None


@dataclass(frozen=True)
class StatusReply:
    job_id: str
    state: str
    tier: str
    attempt: int
    estimated_wait_s: float | None
    reason: str | None
    request_id: str | None = None


@dataclass(frozen=True)
class CancelRequest:
    api_key: str
    job_id: str
    request_id: str | None = None
    # The job's answer ends with its first ``stop_at`` tokens (the caller found its end there: the HTTP door's stop
    # strings): the job ends done, finish_reason "stop", with those tokens, rather than cancelled. Where its worker
    # cannot (an older worker, or the job is not running) it is cancelled as without. None: a plain cancel.
    stop_at: int | None = None
    # Cancel the job admitted under this idempotency key (``job_id`` ""), or, where none is, withdraw the key: a
    # submission under it that is still on its way (the client gave up waiting for its reply) is refused, nothing
    # stored, for as long as a retry key is kept. The SDK sends it for a submit() that ended without a reply.
    idempotency_key: str | None = None


@dataclass(frozen=True)
class CancelReply:
    job_id: str
    cancelled: bool  # False: it had already ended
    request_id: str | None = None


@dataclass(frozen=True)
class InfoRequest:
    """Cluster overview for operators and launchers; any valid API key may ask."""

    api_key: str
    request_id: str | None = None
    # True: the reply also carries the asking tenant's token limits (InfoReply.tier_token_limits,
    # max_tokens_limit). Asked for, not always sent: an older SDK refuses reply fields it does not know. A gateway
    # older than the field refuses the request as a protocol error (the SDK then asks without it).
    limits: bool = False
    # > 0: the size of a frame the caller means to send next; over this gateway's client_max_message_bytes the
    # answer is InvalidRequest (field "frame_bytes") rather than an InfoReply. Such a frame would not be refused
    # but dropped with the connection it came on, and every stream on it; the SDK asks before it sends a large one.
    frame_bytes: int = 0
    # True: the reply also carries the cluster's tokenizer digest (InfoReply.tokenizer_digest), as limits is.
    tokenizer: bool = False


@dataclass(frozen=True)
class InfoReply:
    gateway_id: str
    workers: list[str]
    queue_depths: dict[str, int]
    request_id: str | None = None
    # For the asking tenant, per tier it is entitled to: the largest prompt + max_tokens that tier admits now
    # (the model's context, the tier's share of the workers' KV cache, and for a P0 that a spent quota would
    # downgrade, P1's share too), so a client can size max_tokens to the room its prompt leaves. Only when
    # asked for (InfoRequest.limits); None from older gateways.
    tier_token_limits: dict[str, int] | None = None
    # The largest max_tokens any request may ask for (the gateway's max_tokens_limit); None from older gateways.
    max_tokens_limit: int | None = None
    # common/tokenizer_digest of the tokenizer this gateway's text prompts and workers use (its own, else its first
    # worker's); None while unknown (no tokenizer, no worker yet) or from older gateways. Only when asked for
    # (InfoRequest.tokenizer): a client that tokenizes text itself (the HTTP door) checks it has the same.
    tokenizer_digest: str | None = None


@dataclass(frozen=True)
class ErrorReply:
    code: str  # unauthorized | forbidden | invalid_request | quota_exceeded | not_found | protocol
    #            | overloaded (estimated wait over the tier's timeout, the tenant's cap, or Redis full: nothing stored)
    #            | unavailable (Redis unreachable: nothing stored, retry) | internal
    message: str
    field: str | None = None
    retry_after_s: float | None = None
    estimated_wait_s: float | None = None
    in_reply_to: str | None = None  # job id where there is one
    request_id: str | None = None
