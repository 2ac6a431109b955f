"""The blocking client's sockets: one thread's call sockets, the wait for a call's answer on them, and a stream's
socket: the wait for its next frame or the drop of its connection, and the socket closed from under it."""

from __future__ import annotations

import math
import time

import zmq

from common import protocol as P
from common.errors import ServingError
from gateway.sdk._drops import DROPPED, Doubt, DropWatch


def closed_under(sock: zmq.Socket, use, job_id: str, watch: DropWatch | None = None):
    """``use()`` of a stream's ``sock`` (and its ``watch``); ServingError, as the async client says it, if another
    thread closed the client (and with it these sockets) meanwhile, not the ZMQError of a socket gone from under the
    call."""
    try:
        return use()
    except zmq.ZMQError:
        if not sock.closed and (watch is None or not watch.events.closed):
            raise
        raise ServingError(f"the client was closed while this stream of job {job_id} waited") from None


# The longest a wait polls before it looks whether another thread closed its sockets (GatewayClient.close()): a poll
# under way when they close wakes only if it looks at them after the close; one that looked just before slept out
# its whole timeout (up to timeout_s) before the caller heard of the close.
WAKE_S = 0.25


def _wait_ms(until: float) -> int:
    return math.ceil(1000 * min(WAKE_S, max(0.0, until - time.monotonic())))


def stream_frame(sock: zmq.Socket, watch: DropWatch, timeout_s: float):
    """The next frame on a stream's ``sock`` within ``timeout_s``; None if none came; DROPPED if its connection
    dropped, once every frame that came before is read (they are the stream's, and save it asking again)."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(watch.events, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    doubt = Doubt(watch)
    while True:
        if sock.closed or watch.events.closed:  # closed by another thread (close()): see WAKE_S
            raise zmq.ZMQError(zmq.ENOTSOCK)
        ready = dict(poller.poll(_wait_ms(doubt.wake(deadline))))
        if sock in ready:
            return sock.recv()
        now = time.monotonic()
        if watch.events in ready and watch.dropped() and doubt.on_drop(now) or doubt.ended(now):
            return DROPPED
        if now >= deadline:
            return None if doubt.until is None else DROPPED


def close_stream_socket(sock: zmq.Socket, watch: DropWatch) -> None:
    watch.close()
    sock.close(linger=0)


class ThreadSockets(dict):
    """One thread's call sockets, closed when the thread ends and its threading.local lets go of them: a server
    that starts a thread per request must not keep a connection per thread it ever ran. Each has a DropWatch
    (``watches``, by gateway): a dropped connection voids what its gateway said of frame sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.watches: dict[str, DropWatch] = {}

    def __del__(self) -> None:
        for watch in self.watches.values():
            watch.close()
        for sock in self.values():
            sock.close(linger=0)


def reply_to(socks: dict[str, zmq.Socket], request_ids: set[str], timeout_s: float, watch: DropWatch | None = None):
    """(the first frame answering one of ``request_ids`` within timeout_s, on any gateway's socket, and that
    gateway); (None, None) if none came; (DROPPED, None) if ``watch``'s connection dropped first. Frames answering
    calls that gave up earlier are dropped."""
    poller = zmq.Poller()
    gateway_of = {sock: endpoint for endpoint, sock in socks.items()}
    for sock in socks.values():
        poller.register(sock, zmq.POLLIN)
    if watch is not None:
        poller.register(watch.events, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    doubt = Doubt(watch)
    polled = [*socks.values(), *([watch.events] if watch else [])]
    while True:
        now = time.monotonic()
        if doubt.ended(now):
            return DROPPED, None
        if now >= deadline:
            return (None, None) if doubt.until is None else (DROPPED, None)
        try:
            if any(sock.closed for sock in polled):  # closed by another thread (close()): see WAKE_S
                raise zmq.ZMQError(zmq.ENOTSOCK)
            ready = poller.poll(_wait_ms(doubt.wake(deadline)))
        except zmq.ZMQError:
            if not any(sock.closed for sock in polled):
                raise
            raise ServingError("the client was closed while this call waited for its answer") from None
        dropped = False
        for sock, _ in ready:
            if watch is not None and sock is watch.events:
                dropped = watch.dropped()  # an answer beside it (read in this loop) is still an answer
                continue
            while True:
                try:
                    msg = P.decode(sock.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                # No request id: a protocol error about a frame the gateway could not read, i.e. this one.
                if msg.request_id in request_ids or msg.request_id is None:
                    return msg, gateway_of[sock]
        if dropped and doubt.on_drop(time.monotonic()):
            return DROPPED, None
