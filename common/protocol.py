"""Every message that crosses a process boundary, and the one codec for them. The messages are defined in
common/client_messages.py (SDK clients and gateways) and common/worker_messages.py (gateways and workers), and
importable from here.

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
from typing import Any

import msgpack

from common.client_messages import (MAX_REQUEST_ID_LEN, MAX_STOP_TOKEN_IDS, SAMPLING_EXTRAS, CancelReply,
                                    CancelRequest, ErrorReply, InfoReply, InfoRequest, JobDone, StatusReply,
                                    StatusRequest, StreamRequest, SubmitReply, SubmitRequest, TokenChunk)
from common.worker_messages import (HELLO_FIRST, CancelJob, DispatchJob, GatewayWelcome, JobFinished, JobFinishedAck,
                                    JobReleased, JobTokens, WorkerHello, WorkerLoad)

__all__ = ["HELLO_FIRST", "MAX_API_KEY_CHARS", "MAX_LIST_LEN", "MAX_MAP_LEN", "MAX_MESSAGE_BYTES", "MAX_REQUEST_ID_LEN",
           "MAX_STOP_TOKEN_IDS", "MESSAGES", "SAMPLING_EXTRAS", "SCHEMA_VERSION", "CancelJob", "CancelReply",
           "CancelRequest", "DispatchJob", "ErrorReply", "GatewayWelcome", "InfoReply", "InfoRequest", "JobDone",
           "JobFinished", "JobFinishedAck", "JobReleased", "JobTokens",
           "ProtocolError", "StatusReply", "StatusRequest", "StreamRequest", "SubmitReply", "SubmitRequest",
           "TokenChunk", "Unauthenticated", "WorkerHello", "WorkerLoad", "decode", "encode", "loads", "mistyped",
           "refused_item"]

SCHEMA_VERSION = 1
# Bounded so a hostile or buggy peer cannot make a process allocate without limit.
MAX_MESSAGE_BYTES = 8 * 2**20
MAX_LIST_LEN = 2**20  # elements in any one list (token ids: longer than any context this serves)
MAX_MAP_LEN = 64  # entries in any one map (bodies, trace context)
MAX_API_KEY_CHARS = 512
# Lists and maps in one frame, however nested: a byte may be an empty list, so 8 MiB of them was 8 million objects
# (580 MiB and seconds of a gateway's loop) before any check. Far above the most any message holds (WorkerLoad:
# a few maps of at most MAX_MAP_LEN lists).
MAX_CONTAINERS = 4096
_READ_SIZE = 64 * 1024
# msgpack's first bytes of a list or a map (fixarray, fixmap, array16/32, map16/32).
_CONTAINER_BYTES = frozenset([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])


class ProtocolError(ValueError):
    """A frame that cannot be decoded into a known message."""

    code = "protocol"  # the ErrorReply code that answers it


class Unauthenticated(ProtocolError):
    """A client message whose API key is missing, misplaced or unknown (checked before the rest is read)."""

    code = "unauthorized"

MESSAGES: dict[str, type] = {cls.__name__: cls for cls in (
    SubmitRequest, SubmitReply, StreamRequest, TokenChunk, JobDone, StatusRequest, StatusReply, CancelRequest,
    CancelReply, InfoRequest, InfoReply, ErrorReply, WorkerHello, GatewayWelcome, WorkerLoad, DispatchJob, CancelJob,
    JobTokens, JobFinished, JobFinishedAck, JobReleased)}


def encode(msg: Any) -> bytes:
    """The frame of ``msg``. A field left at its default is not sent: a peer of an older release, whose decoder
    refuses fields it does not know, reads every message that does not use what was added since (a new SDK's
    StreamRequest without ``unsubscribe``, a new gateway's InfoReply to a caller that asked for no limits)."""
    kind = type(msg).__name__
    if MESSAGES.get(kind) is not type(msg):
        raise TypeError(f"not a protocol message: {type(msg)!r}")
    body = {}
    for name, optional, default in _encoding(type(msg)):
        value = getattr(msg, name)  # plain types, no nested dataclasses: nothing to copy or convert
        # Left out only as the default's own type too (0 == False == 0.0 in Python).
        if not optional or not (value is default or (type(value) is type(default) and value == default)):
            body[name] = value
    return msgpack.packb({"v": SCHEMA_VERSION, "k": kind, "b": body}, use_bin_type=True)


@functools.cache
def _encoding(cls: type) -> tuple[tuple[str, bool, Any], ...]:
    """Per field of ``cls``, in order: (name, has a default, the default)."""
    out = []
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out.append((f.name, True, f.default))
        elif f.default_factory is not dataclasses.MISSING:
            out.append((f.name, True, f.default_factory()))
        else:
            out.append((f.name, False, None))
    return tuple(out)


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
    u = _unpacker(frame)
    scalar = functools.partial(_scalar, u, frame)
    try:
        if u.read_map_header() != 3 or scalar() != "v":
            raise ProtocolError("frame must be a map with keys v, k, b (in that order)")
        version = scalar()
        if version != SCHEMA_VERSION:
            raise ProtocolError(f"schema version {version!r} not supported (this side speaks {SCHEMA_VERSION})")
        if scalar() != "k":
            raise ProtocolError("frame must be a map with keys v, k, b (in that order)")
        kind = scalar()
        cls = MESSAGES.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise ProtocolError(f"unknown message kind {kind!r}")
        if scalar() != "b":
            raise ProtocolError("frame must be a map with keys v, k, b (in that order)")
        body = _read_body(u, cls, authorize, scalar)
        if u.tell() != len(frame):
            raise ProtocolError("extra bytes after the message")
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for bad or over-long input
        raise ProtocolError(f"not a valid msgpack frame: {type(e).__name__}: {str(e)[:100]}") from None
    return _build(cls, body)


def loads(frame: bytes, max_containers: int = MAX_CONTAINERS) -> Any:
    """The whole of ``frame`` as plain objects, under decode's caps (ProtocolError past one): for a frame decode
    refused, read again for its request id."""
    u = _unpacker(frame, max_containers)
    try:
        obj = u.unpack()
    except ProtocolError:
        raise
    except Exception as e:  # as in decode
        raise ProtocolError(f"not a valid msgpack frame: {type(e).__name__}: {str(e)[:100]}") from None
    if u.tell() != len(frame):
        raise ProtocolError("extra bytes after the message")
    return obj


def _unpacker(frame, max_containers: int = MAX_CONTAINERS) -> msgpack.Unpacker:
    """An unpacker of ``frame`` that caps its size, every list's and map's length, and how many of them it builds
    (``max_containers``, counted by the hooks as each is built), and refuses binary and extension types."""
    left = [max_containers]

    def counted(container):
        left[0] -= 1
        if left[0] < 0:
            raise ProtocolError(f"more than {max_containers} lists and maps in one frame")
        return container

    return msgpack.Unpacker(io.BytesIO(frame), read_size=_READ_SIZE, raw=False, strict_map_key=True,
                            max_buffer_size=MAX_MESSAGE_BYTES, max_array_len=MAX_LIST_LEN, max_map_len=MAX_MAP_LEN,
                            max_bin_len=0, max_ext_len=0, list_hook=counted, object_hook=counted)


def _scalar(u: msgpack.Unpacker, frame) -> Any:
    """The next object where only a scalar belongs (a header item, a body key, an API key): a list or a map there
    is refused before it is built."""
    pos = u.tell()
    if pos < len(frame) and frame[pos] in _CONTAINER_BYTES:
        raise ProtocolError("a list or a map where a scalar belongs")
    return u.unpack()


def _read_body(u: msgpack.Unpacker, cls: type, authorize: Callable[[str], object] | None,
               scalar: Callable[[], Any]) -> dict:
    fields = _schema(cls)[1]
    if authorize is not None and "api_key" not in fields:
        # A reply's or a worker's kind on the client socket: nothing in it can say who sent it.
        raise Unauthenticated(f"{cls.__name__} carries no API key: not accepted from a client")
    try:
        n = u.read_map_header()
    except msgpack.UnpackValueError:
        raise ProtocolError(f"{cls.__name__}: body must be a map") from None
    body: dict = {}
    if authorize is not None:
        key = scalar() if n else None
        value = scalar() if key == "api_key" else None
        if not isinstance(value, str) or not 0 < len(value) <= MAX_API_KEY_CHARS or not authorize(value):
            raise Unauthenticated("unknown API key" if key == "api_key" else
                                  f"{cls.__name__}: api_key must come first in the body")
        body["api_key"] = value
        n -= 1
    for _ in range(n):
        key = scalar()
        if not isinstance(key, str) or key in body:
            raise ProtocolError(f"{cls.__name__}: body keys must be distinct strings")
        if key not in fields:  # refused before its value is read
            raise ProtocolError(f"{cls.__name__}: unknown fields [{key!r}]")
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


def mistyped(cls: type, body: dict) -> str | None:
    """The first of ``body``'s fields of message ``cls`` whose value decode() would refuse for its type, or None:
    for a sender to name a wrong argument before it sends (the SDK), by the receiver's own rules."""
    hints, _ = _schema(cls)
    return next((name for name, value in body.items() if not _matches(value, hints[name])), None)


def refused_item(cls: type, name: str, value: Any) -> tuple[int, str] | None:
    """Where mistyped() named ``name`` and ``value`` is a list for a list field of ``cls``: the index of its first
    item decode() would refuse and the item type the field takes (a wrong item says more than 'list'); else None."""
    hints, _ = _schema(cls)
    hint = hints[name]
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    lists = [typing.get_args(h)[0] for h in members if typing.get_origin(h) is list]
    if not isinstance(value, list) or len(lists) != 1:
        return None
    bad = next((i for i, v in enumerate(value) if not _matches(v, lists[0])), None)
    return None if bad is None else (bad, getattr(lists[0], "__name__", str(lists[0])))


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
