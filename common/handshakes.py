"""Whether the peer of a connecting socket refuses its handshake, from the socket's monitor events.

A refusal says the two ends' settings do not match (CURVE on one end only, a key the other does not hold), which no
reconnection cures, and the side that connects is told so by name (the SDK raises HandshakeFailed, a worker logs
it). A handshake that fails with a reason (a mechanism or key refused) is a refusal at once. One that fails
without a reason (the peer closed the connection mid-handshake) may also be a peer going down: a connection its
kernel accepted for a process being killed. That is a refusal only once REFUSED_AFTER happen in a row; a peer
with the wrong key does so every ~0.1 s (libzmq reconnects at once, with no back-off between handshakes).
"""

from __future__ import annotations

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
