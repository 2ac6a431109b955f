"""Peers of different releases on one wire. Every message decoder refuses fields it does not know (a stranger's frame
costs nothing past its first unknown key: common/protocol.py), so a field a newer release added must not reach an
older peer unless the sender means it: a field left at its default is not sent. Before, every frame carried every
field, and a new SDK's StreamRequest (``unsubscribe: false``) or SubmitRequest (``idempotency_key: null``) was refused
by a gateway one release older, as was a new gateway's InfoReply by an older SDK."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import types
import typing

import msgpack
import pytest
import zmq

from common import protocol as P
from gateway.http.sizing import max_tokens_for
from gateway.sdk import AsyncGatewayClient
from tests.durable_cluster import DurableCluster


def _sample(hint):
    """A value of type ``hint`` other than any default (a field's default is None, False, 0, empty or a word)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return _sample(next(a for a in typing.get_args(hint) if a is not type(None)))
    if origin is list:
        return [_sample(typing.get_args(hint)[0])]
    if origin is dict:
        k, v = typing.get_args(hint)
        return {_sample(k): _sample(v)}
    if origin is tuple:
        return tuple(_sample(a) for a in typing.get_args(hint) if a is not Ellipsis)
    return {str: "x-7", int: 7, float: 0.7, bool: True, bytes: b"x"}[hint]


def _required(cls) -> dict:
    hints = typing.get_type_hints(cls)
    return {f.name: _sample(hints[f.name]) for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


def _older(cls, without: str) -> type:
    """``cls`` as a release before ``without`` was added had it."""
    fields = [(f.name, f.type, f) for f in dataclasses.fields(cls) if f.name != without]
    return dataclasses.make_dataclass(cls.__name__, fields, frozen=True)


MESSAGES = sorted(P.MESSAGES.values(), key=lambda c: c.__name__)
OPTIONAL = [(cls, f.name) for cls in MESSAGES for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
def test_a_message_with_its_defaults_carries_only_its_required_fields(cls):
    msg = cls(**_required(cls))
    body = msgpack.unpackb(P.encode(msg))["b"]
    assert list(body) == list(_required(cls))  # in the declared order: api_key stays first
    assert P.decode(P.encode(msg)) == msg


@pytest.mark.parametrize("cls,field", OPTIONAL, ids=lambda x: getattr(x, "__name__", x))
def test_a_peer_older_than_an_optional_field_reads_a_frame_that_leaves_it_at_its_default(cls, field, monkeypatch):
    frame = P.encode(cls(**_required(cls)))
    monkeypatch.setitem(P.MESSAGES, cls.__name__, _older(cls, field))
    assert dataclasses.asdict(P.decode(frame)) == _required(cls) | {
        f.name: getattr(cls(**_required(cls)), f.name) for f in dataclasses.fields(cls)
        if f.name not in _required(cls) and f.name != field}


def test_a_field_set_away_from_its_default_is_sent_and_an_older_peer_refuses_it(monkeypatch):
    # What the newer field asks for, an older peer cannot do: it says so (the SDK and the HTTP door fall back where
    # they can, e.g. info(limits=True)), rather than do something else silently.
    msg = P.StreamRequest("key", "job", unsubscribe=True)
    assert msgpack.unpackb(P.encode(msg))["b"]["unsubscribe"] is True
    frame = P.encode(msg)
    assert P.decode(frame) == msg
    monkeypatch.setitem(P.MESSAGES, "StreamRequest", _older(P.StreamRequest, "unsubscribe"))
    with pytest.raises(P.ProtocolError, match="unknown fields"):
        P.decode(frame)



# The gateway of the release before InfoRequest.limits: the real gateway, run with InfoRequest as it was then (the
# field unknown to its decoder, so refused as a protocol error; its handler never asks for limits).
OLDER_GATEWAY = """
import dataclasses, runpy, sys
from common import client_messages as m, protocol as P
fields = [(f.name, f.type, f) for f in dataclasses.fields(m.InfoRequest) if f.name != "limits"]
Older = dataclasses.make_dataclass("InfoRequest", fields, frozen=True, namespace={"limits": False})
m.InfoRequest = P.InfoRequest = P.MESSAGES["InfoRequest"] = Older
sys.argv = ["gateway"] + sys.argv[1:]
runpy.run_module("gateway", run_name="__main__")
"""


class _OlderGatewayCluster(DurableCluster):
    def _cmd(self, name: str) -> list[str]:
        cmd = super()._cmd(name)
        return [sys.executable, "-c", OLDER_GATEWAY, *cmd[3:]] if name in self.gateways else cmd


def test_info_with_limits_from_a_gateway_older_than_the_field_answers_without_them(tiny_model_dir, tmp_path):
    with _OlderGatewayCluster(tmp_path, tiny_model_dir, gateways=1, workers=0) as c:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        try:  # the older gateway refuses the field, as a protocol error answering the request
            sock.connect(c.endpoint())
            sock.send(P.encode(P.InfoRequest(c.key("api-co"), request_id="r1", limits=True)))
            assert sock.poll(10_000)
            reply = P.decode(sock.recv())
            assert isinstance(reply, P.ErrorReply) and reply.code == "protocol" and reply.request_id == "r1"
            assert "unknown fields" in reply.message and "limits" in reply.message
        finally:
            sock.close(linger=0)
        with c.client("api-co", timeout_s=10) as sdk:  # the SDK asks again without it
            info = sdk.info(limits=True)
            assert info.gateway_id == "gw-0" and info.tier_token_limits is None and info.max_tokens_limit is None

        async def ask():
            async with AsyncGatewayClient(c.endpoint(), c.key("api-co"), timeout_s=10) as sdk:
                return await sdk.info(limits=True)

        info = asyncio.run(ask())
        assert info.gateway_id == "gw-0" and info.tier_token_limits is None
        # What the door makes of it: the plain default, as before the limits (gateway/http/app.py).
        assert max_tokens_for(256, 1_000, None, info.tier_token_limits, info.max_tokens_limit, "messages") == 256
