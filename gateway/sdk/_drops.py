"""Whether a gateway's connection dropped since last asked: its gateway may have restarted (with a smaller frame
limit than it said before), or dropped a frame over its limit. ZeroMQ reconnects out of sight; only its socket
monitor tells."""

from __future__ import annotations

import zmq

from common.monitors import close_monitor, monitor_events, monitor_socket

DROPPED = object()  # a wait for an answer: the connection that took the request dropped before an answer came


class DropWatch:
    """The disconnections of one socket, read without blocking, from blocking and asyncio code alike (the events
    come over a blocking PAIR socket on the same libzmq context, so an asyncio client reads them at once too, not
    when its loop gets round to a reader task). A blocking client reads them only during its calls: the queue has no
    bound (common/monitors), as a full one froze every ZeroMQ socket of the process."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._events = monitor_socket(sock, zmq.EVENT_DISCONNECTED)

    @property
    def events(self) -> zmq.Socket:
        """The socket the events arrive on (to poll beside the watched one)."""
        return self._events

    def dropped(self) -> bool:
        """Has the connection dropped since the last call? (Reads every event waiting.)"""
        return zmq.EVENT_DISCONNECTED in monitor_events(self._events)

    def close(self) -> None:
        """Stop watching, before or after the watched socket is closed: common/monitors closes the reader only once
        libzmq has let go of it (a reader closed under a live monitor froze the process's ZeroMQ)."""
        close_monitor(self._sock, self._events)
