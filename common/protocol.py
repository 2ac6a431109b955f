"""Every message that crosses a process boundary, and the one codec for them.

Frames are msgpack maps ``{"v": SCHEMA_VERSION, "k": kind, "b": body}``. Bodies
are frozen dataclasses of plain types. ``decode`` never trusts its input: a
frame that is not msgpack, has the wrong version, an unknown kind, a missing
or extra field, or a field of the wrong type raises ``ProtocolError``; the
receiving loop answers with an ``ErrorReply`` and counts it. No pickle.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

SCHEMA_VERSION = 1
# Bounded so a hostile or buggy peer cannot make a process allocate without limit.
MAX_MESSAGE_BYTES = 8 * 2**20
MAX_LIST_LEN = 2**20  # elements in any one list (token ids: longer than any context this serves)
MAX_MAP_LEN = 64  # entries in any one map (bodies, trace context)
MAX_API_KEY_CHARS = 512
_READ_SIZE = 64 * 1024


class ProtocolError(ValueError):
    """A frame that cannot be decoded into a known message."""

    code = "protocol"  # the ErrorReply code that answers it


class Unauthenticated(ProtocolError):
    """A client message whose API key is missing, misplaced or unknown (checked before the rest is read)."""

    code = "unauthorized"


# -- client <-> gateway ---------------------------------------------------------------------------------------------
# Every request may carry a ``request_id`` (chosen by the client, at most MAX_REQUEST_ID_LEN characters); the
# gateway copies it onto every frame it sends for that request, so one connection can carry many calls and
# streams at once. While a stream waits on a job that sends nothing (queued, or running before its first
# token), the gateway sends a StatusReply with the stream's request id every few seconds: a keepalive that
# tells the client its gateway is alive.

MAX_REQUEST_ID_LEN = 64


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


@dataclass(frozen=True)
class InfoReply:
    gateway_id: str
    workers: list[str]
    queue_depths: dict[str, int]
    request_id: str | None = None


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


# -- gateway <-> worker ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerHello:
    worker_id: str
    model: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    num_kv_blocks: int
    # Largest prompt + max_tokens per tier ("P0".."P3") this worker accepts (its tier's share of the KV
    # cache); None from workers that do not say.
    tier_max_tokens: dict[str, int] | None = None


@dataclass(frozen=True)
class GatewayWelcome:
    """Reply to WorkerHello: tells the worker which gateway is on the other end of this socket."""

    gateway_id: str


@dataclass(frozen=True)
class WorkerLoad:
    """Heartbeat: extends the leases of ``job_ids`` and reports capacity."""

    worker_id: str
    free_slots: int
    free_kv_blocks: int
    running: dict[str, int]  # per tier
    waiting: dict[str, int]  # per tier
    job_ids: list[str]  # jobs this worker holds (running, waiting or suspended)
    # Cheapest preemption here for a P0/P1 job, in estimated seconds (0: a slot is free or keep will do).
    preemption_cost_s: float
    # Per tier: running jobs a new job of that tier may preempt here (the worker's preemption matrix).
    victims: dict[str, int] = field(default_factory=dict)
    # Measured tokens/s per sequence (worker/calibration.py); 0: not reported (an older worker).
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    # job id -> [tier rank, status 0 running / 1 suspended / 2 waiting, tokens left to prefill, generated,
    # max_tokens, bit mask of tiers that may preempt it, tokens it still generates before its preemption guards
    # let it be preempted (absent from older workers: none)]: the work ahead of new jobs, for wait estimates.
    work: dict[str, list[int]] = field(default_factory=dict)
    # Seconds from building this report to sending it (the heartbeat thread sends the latest one, up to a
    # heartbeat old): with the time since it came, how far the running work has got past what ``work`` says.
    age_s: float = 0.0


@dataclass(frozen=True)
class DispatchJob:
    job_id: str
    attempt: int
    tier: str  # the tier the job was admitted at: what it preempts by (aging changes queue order only)
    tenant: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int | None
    seed: int  # fixed at admission, so a re-dispatch reproduces the same tokens
    reply_to: str  # gateway that dispatched this attempt: it receives the tokens and writes them to Redis
    trace_context: dict[str, str] = field(default_factory=dict)
    ignore_eos: bool = False


@dataclass(frozen=True)
class CancelJob:
    job_id: str
    # Cancel only this attempt or an earlier one (None: whatever runs): a late CancelJob for a
    # requeued lease must not stop the job's next attempt on the same worker.
    attempt: int | None = None


@dataclass(frozen=True)
class JobTokens:
    job_id: str
    attempt: int
    index: int  # index of token_ids[0] in the job's output
    token_ids: list[int]
    # On the first frame: seconds from the dispatch's arrival to the job's first prefill chunk (its wait there).
    prefill_start_s: float | None = None
    # On the first frame: seconds from the job's first prefill chunk starting to this frame being sent, on the
    # worker's clock. The gateway puts the start at this long before the frame reached it: that counts the time
    # the dispatch sat unread while a step ran, which prefill_start_s (from when the worker read it) cannot.
    prefill_start_age_s: float | None = None


@dataclass(frozen=True)
class JobFinished:
    job_id: str
    attempt: int
    state: str  # done | failed
    finish_reason: str | None
    num_tokens: int
    ttft_s: float | None
    run_s: float
    preemptions: int
    reason: str | None = None
    # Every output token, in order (len == num_tokens): the result stays whole even when a JobTokens
    # frame was dropped or went to a gateway that has since restarted.
    token_ids: list[int] | None = None
    prefill_start_s: float | None = None  # as in JobTokens: the end of the job's wait, on this worker's clock
    prefill_start_age_s: float | None = None  # as in JobTokens


MESSAGES: dict[str, type] = {cls.__name__: cls for cls in (
    SubmitRequest, SubmitReply, StreamRequest, TokenChunk, JobDone, StatusRequest, StatusReply, CancelRequest,
    CancelReply, InfoRequest, InfoReply, ErrorReply, WorkerHello, GatewayWelcome, WorkerLoad, DispatchJob, CancelJob, JobTokens, JobFinished)}


def encode(msg: Any) -> bytes:
    kind = type(msg).__name__
    if MESSAGES.get(kind) is not type(msg):
        raise TypeError(f"not a protocol message: {type(msg)!r}")
    return msgpack.packb({"v": SCHEMA_VERSION, "k": kind, "b": dataclasses.asdict(msg)}, use_bin_type=True)


def decode(frame: bytes, *, authorize: Callable[[str], object] | None = None) -> Any:
    """The message in ``frame``; ``ProtocolError`` (or ``Unauthenticated``) if there is none.

    Cost is bounded before it is spent: the frame's size, every container's length and the map sizes
    are capped by the unpacker itself, and with ``authorize`` (the gateway's client socket) a message
    that carries an ``api_key`` must name it first in its body: the key is checked before anything
    else of the body is unpacked, so a stranger's frame costs a hash, not a parse of its contents.
    """
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError("frame is not bytes")
    if len(frame) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_MESSAGE_BYTES}")
    # Read through a file view in small pieces: a frame refused at its API key is never copied whole.
    u = msgpack.Unpacker(io.BytesIO(frame), read_size=_READ_SIZE, raw=False, strict_map_key=True,
                         max_buffer_size=MAX_MESSAGE_BYTES, max_array_len=MAX_LIST_LEN, max_map_len=MAX_MAP_LEN,
                         max_bin_len=0, max_ext_len=0)
    try:
        if u.read_map_header() != 3 or u.unpack() != "v":
            raise ProtocolError("frame must be a map with keys v, k, b (in that order)")
        version = u.unpack()
        if version != SCHEMA_VERSION:
            raise ProtocolError(f"schema version {version!r} not supported (this side speaks {SCHEMA_VERSION})")
        if u.unpack() != "k":
            raise ProtocolError("frame must be a map with keys v, k, b (in that order)")
        kind = u.unpack()
        cls = MESSAGES.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise ProtocolError(f"unknown message kind {kind!r}")
        if u.unpack() != "b":
            raise ProtocolError("frame must be a map with keys v, k, b (in that order)")
        body = _read_body(u, cls, authorize)
        if u.tell() != len(frame):
            raise ProtocolError("extra bytes after the message")
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for bad or over-long input
        raise ProtocolError(f"not a valid msgpack frame: {type(e).__name__}: {str(e)[:100]}") from None
    return _build(cls, body)


def _read_body(u: msgpack.Unpacker, cls: type, authorize: Callable[[str], object] | None) -> dict:
    try:
        n = u.read_map_header()
    except msgpack.UnpackValueError:
        raise ProtocolError(f"{cls.__name__}: body must be a map") from None
    body: dict = {}
    if authorize is not None and "api_key" in _schema(cls)[1]:
        key = u.unpack() if n else None
        value = u.unpack() if key == "api_key" else None
        if not isinstance(value, str) or not 0 < len(value) <= MAX_API_KEY_CHARS or not authorize(value):
            raise Unauthenticated("unknown API key" if key == "api_key" else
                                  f"{cls.__name__}: api_key must come first in the body")
        body["api_key"] = value
        n -= 1
    for _ in range(n):
        key = u.unpack()
        if not isinstance(key, str) or key in body:
            raise ProtocolError(f"{cls.__name__}: body keys must be distinct strings")
        body[key] = u.unpack()
    return body


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Any], dict[str, dataclasses.Field]]:
    return typing.get_type_hints(cls), {f.name: f for f in dataclasses.fields(cls)}


def _build(cls: type, body: dict) -> Any:
    hints, fields = _schema(cls)
    unknown = set(body) - set(fields)
    if unknown:
        raise ProtocolError(f"{cls.__name__}: unknown fields {sorted(map(str, unknown))}")
    kwargs = {}
    for name, f in fields.items():
        if name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{cls.__name__}: missing field {name!r}")
            continue
        if not _matches(body[name], hints[name]):
            raise ProtocolError(f"{cls.__name__}.{name}: wrong type {type(body[name]).__name__}")
        kwargs[name] = body[name]
    return cls(**kwargs)


# Exact element types a list[X] field accepts (bool is not an int here; an int is a float).
_PLAIN_TYPES = {int: {int}, str: {str}, float: {int, float}, bool: {bool}}


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            return False
        if item in _PLAIN_TYPES:  # one pass in C over the element types, not an isinstance call per element
            return set(map(type, value)) <= _PLAIN_TYPES[item]
        return all(_matches(v, item) for v in value)
    if origin is dict:
        k, v = typing.get_args(hint)
        return isinstance(value, dict) and all(_matches(a, k) and _matches(b, v) for a, b in value.items())
    raise TypeError(f"unsupported field type {hint!r}")  # a bug in this module, not bad input
