"""Whether a gateway's connection dropped since last asked: its gateway may have restarted (with a smaller frame
limit than it said before), or dropped a frame over its limit. ZeroMQ reconnects out of sight; only its socket
monitor tells. The monitor also tells why a connection never came up: the gateway's end refused the handshake
(CURVE settings that do not match), which no retry cures and which the caller is told by name."""

from __future__ import annotations

import zmq

from common import handshakes
from common.errors import HandshakeFailed
from common.handshakes import Advice, Handshakes
from common.monitors import close_monitor, monitor_event_values, monitor_socket

DROPPED = object()  # a wait for an answer: the connection that took the request dropped before an answer came
# How long a wait for an answer goes on after a drop that was a handshake in doubt (common/handshakes): long enough
# for a gateway that refuses to fail REFUSED_AFTER times (libzmq reconnects every 0.1-0.2 s); the request is still
# queued in the socket meanwhile, for the next handshake that succeeds.
DOUBT_S = 1.0


class DropWatch:
    """The disconnections of one socket, read without blocking, from blocking and asyncio code alike (the events
    come over a blocking PAIR socket on the same libzmq context, so an asyncio client reads them at once too, not
    when its loop gets round to a reader task). A blocking client reads them only during its calls: the queue has no
    bound (common/monitors), as a full one froze every ZeroMQ socket of the process. And its handshakes
    (common/handshakes): ``curve``, whether the socket was given the gateway's public key, decides what a refusal
    says."""

    def __init__(self, sock: zmq.Socket, curve: bool = False) -> None:
        self._sock = sock
        self._curve = curve
        self._events = monitor_socket(sock, zmq.EVENT_DISCONNECTED | handshakes.EVENTS)
        self._dropped = False
        self._handshakes = Handshakes()

    @property
    def events(self) -> zmq.Socket:
        """The socket the events arrive on (to poll beside the watched one)."""
        return self._events

    def dropped(self) -> bool:
        """Has the connection dropped since the last call? (Reads every event waiting.)"""
        self._read()
        dropped, self._dropped = self._dropped, False
        return dropped

    def refused(self, endpoint: str) -> HandshakeFailed | None:
        """The error to raise if ``endpoint`` refuses this connection's handshake (common/handshakes)."""
        self._read()
        h = self._handshakes
        return HandshakeFailed(f"gateway {endpoint} {h.reason(self._curve, _ADVICE)}") if h.refused else None

    def in_doubt(self) -> bool:
        """The last handshake failed without a reason, too few times in a row to be a refusal: a gateway that
        refuses, or one going down? (A request sent meanwhile still waits in the socket for the next good one.)"""
        self._read()
        return self._handshakes.in_doubt

    def failing(self) -> bool:
        """The last handshake failed and none has succeeded since."""
        self._read()
        return self._handshakes.failed is not None

    def blocked(self, endpoint: str) -> HandshakeFailed | None:
        """As refused, for refusals with a reason, which no reconnection cures: a request sent now would never
        reach the gateway, and the caller need not wait to be told."""
        refused = self.refused(endpoint)
        return refused if self._handshakes.refused_with_reason else None

    def _read(self) -> None:
        for event, value in monitor_event_values(self._events):
            if event == zmq.EVENT_DISCONNECTED:
                self._dropped = True
            else:
                self._handshakes.on_event(event, value)

    def close(self) -> None:
        """Stop watching, before or after the watched socket is closed: common/monitors closes the reader only once
        libzmq has let go of it (a reader closed under a live monitor froze the process's ZeroMQ)."""
        close_monitor(self._sock, self._events)


class Doubt:
    """One wait for an answer on a watched connection, told of its drops: a drop that was a handshake failed
    without a reason (DropWatch.in_doubt) is called a drop only if the handshakes still fail DOUBT_S later, or
    fail often enough meanwhile to be a refusal; if one succeeds, the request went on it and the wait goes on."""

    def __init__(self, watch: DropWatch | None) -> None:
        self.watch = watch
        self.until: float | None = None

    def on_drop(self, now: float) -> bool:
        """The connection dropped: is that the wait's end (DROPPED)?"""
        if self.watch is None or not self.watch.in_doubt():
            return True
        self.until = self.until or now + DOUBT_S
        return False

    def ended(self, now: float) -> bool:
        """Has a doubt run out with the handshakes still failing (DROPPED)? Clears one a handshake resolved."""
        if self.until is None or now < self.until:
            return False
        if self.watch.failing():
            return True
        self.until = None
        return False

    def wake(self, deadline: float) -> float:
        """When the wait must look again: its deadline, or the end of a doubt before it."""
        return deadline if self.until is None else min(deadline, self.until)


def failure(watch: DropWatch | None, endpoint: str, why: str) -> TimeoutError:
    """The error of an attempt on ``endpoint`` that got no answer (``why``): HandshakeFailed if the gateway refused
    the handshake of ``watch``'s connection, else a TimeoutError saying ``why``."""
    refused = None if watch is None else watch.refused(endpoint)
    return refused or TimeoutError(f"gateway {endpoint} {why}")


_ADVICE = Advice(
    who="client", port="a gateway's client port",
    curve_peer="encrypts its client socket (CURVE): give the client the gateway's public key as server_public_key "
               "(its gateway.key file, or the key's z85 text)",
    plain_peer="does not encrypt its client socket, and this client was given server_public_key: leave it out for "
               "this gateway",
    key_refused="",
    closed_curve="server_public_key is not this gateway's public key, or the gateway does not encrypt its client "
                 "socket (then leave server_public_key out), or this is not a gateway's client port",
    closed_plain="is this a gateway's client port, and does it need server_public_key?")
