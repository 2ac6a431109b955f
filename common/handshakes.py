"""Whether the peer of a connecting socket refuses its handshake, from the socket's monitor events.

A refusal says the two ends' settings do not match (CURVE on one end only, a key the other does not hold), which no
reconnection cures, and the side that connects is told so by name (the SDK raises HandshakeFailed, a worker logs
it). A handshake that fails with a reason (a mechanism or key refused) is a refusal at once. One that fails
without a reason (the peer closed the connection mid-handshake) may also be a peer going down: a connection its
kernel accepted for a process being killed. That is a refusal only once REFUSED_AFTER happen in a row; a peer
with the wrong key does so every ~0.1 s (libzmq reconnects at once, with no back-off between handshakes).
"""

from __future__ import annotations

from dataclasses import dataclass

import zmq

REFUSED_AFTER = 3
EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
          | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class Handshakes:
    """The handshakes of one socket: the last failure since the last success, and how many in a row."""

    def __init__(self) -> None:
        self.failed: tuple[int, int] | None = None  # (event, value) of the last failure, until one succeeds
        self.failures = 0

    def on_event(self, event: int, value: int) -> None:
        """Take one monitor event (others than EVENTS are ignored)."""
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.failed, self.failures = None, 0
        elif event & EVENTS:
            self.failed, self.failures = (event, value), self.failures + 1

    @property
    def in_doubt(self) -> bool:
        """The last failed without a reason, fewer than REFUSED_AFTER times in a row: refused, or a peer going down?"""
        return self.failed is not None and self.failed[0] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL \
            and self.failures < REFUSED_AFTER

    @property
    def refused(self) -> bool:
        return self.failed is not None and not self.in_doubt

    @property
    def refused_with_reason(self) -> bool:
        """Refused with a reason (mechanism, key): no reconnection cures it, nothing sent would reach the peer."""
        return self.refused and self.failed[0] != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL

    @property
    def mechanism_mismatch(self) -> bool:
        """CURVE on one end only."""
        return self.failed == (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)

    def reason(self, curve: bool, advice: Advice) -> str:
        """Why the peer refuses, in the words of ``advice`` for the side that connects (``curve``: it was given the
        peer's public key)."""
        event, value = self.failed
        if self.mechanism_mismatch:
            return advice.plain_peer if curve else advice.curve_peer
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return f"refused this {advice.who}'s CURVE key (ZAP status {value}){advice.key_refused}"
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            return f"broke off the ZeroMQ handshake (protocol error {value:#x}): is this {advice.port}?"
        return (f"closed the connection during the {'CURVE' if curve else 'ZeroMQ'} handshake {self.failures} times "
                f"in a row: {advice.closed_curve if curve else advice.closed_plain}")


@dataclass(frozen=True)
class Advice:
    """What the side that connects is told to fix, in its own settings' names."""

    who: str  # "client", "worker"
    port: str  # "a gateway's client port"
    curve_peer: str  # the peer wants CURVE; this side was not given its key
    plain_peer: str  # this side was given a key; the peer does not use CURVE
    key_refused: str  # after "refused this <who>'s CURVE key (ZAP status N)"
    closed_curve: str  # closed mid-handshake, this side given a key
    closed_plain: str  # closed mid-handshake, no key
