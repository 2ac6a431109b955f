"""The one ZeroMQ socket factory: every socket gets finite high-water marks, a linger
bound and a maximum message size, so a slow or hostile peer meets back-pressure and
an explicit "full" instead of unbounded memory."""

from __future__ import annotations

import socket
from dataclasses import dataclass

import zmq

from common.protocol import MAX_MESSAGE_BYTES


@dataclass(frozen=True)
class SocketLimits:
    send_hwm: int = 10_000  # messages queued per peer before sends block or fail
    recv_hwm: int = 10_000
    linger_ms: int = 500  # how long close() may wait to flush
    max_message_bytes: int = MAX_MESSAGE_BYTES


def make_socket(ctx: zmq.Context, kind: int, limits: SocketLimits = SocketLimits(),
                identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, limits.send_hwm)
    sock.setsockopt(zmq.RCVHWM, limits.recv_hwm)
    sock.setsockopt(zmq.LINGER, limits.linger_ms)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        # An unroutable reply (peer gone) raises instead of vanishing silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host`` (for tests and the local launcher)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
