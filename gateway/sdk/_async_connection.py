"""The asyncio client's connection to one gateway: one DEALER socket that carries every call and stream of the
client, and one reader task that hands each incoming frame to the inbox (a queue) registered under the frame's
request id. A frame nobody waits for (the answer to a call that gave up) is dropped. A drop of the connection ends
the calls waiting on it at once: the gateway answers the connection a request came on, and that one is gone."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from common import protocol as P
from common.errors import ServingError
from common.sockets import curve_client, make_socket
from gateway.sdk._drops import DROPPED, Doubt, DropWatch

log = logging.getLogger("gateway.sdk")
CLOSED = object()  # put in every inbox of a connection the client closes: its waiters end rather than time out


class _Connection:
    """One socket to one gateway, and the task that routes what it receives."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, server_public_key: str | bytes | None = None,
                 on_drop: Callable[[str], None] = lambda endpoint: None) -> None:
        """``on_drop(endpoint)``: told of each drop of the connection (it voids what the gateway said of frame
        sizes)."""
        self.endpoint = endpoint
        self.sock = make_socket(ctx, zmq.DEALER)
        if server_public_key is not None:  # CURVE: the API key and prompts cross the network encrypted
            curve_client(self.sock, server_public_key)
        self.watch = DropWatch(self.sock, curve=server_public_key is not None)
        self.sock.connect(endpoint)
        self.inboxes: dict[str, asyncio.Queue] = {}
        self.dropped = 0  # frames for no waiting request (late answers) or unreadable
        self.drops = 0  # drops of the connection seen so far
        self._on_drop = on_drop
        self._drop_waiters: set[asyncio.Future] = set()
        self.loop = asyncio.get_running_loop()  # its reader runs there, and ends with it
        self._reader = self.loop.create_task(self._read())
        # The events come on a blocking socket (DropWatch): the loop reads them as they come, not on a timer.
        self._events_fd = self.watch.events.FD
        self.loop.add_reader(self._events_fd, self.seen_drops)

    def seen_drops(self) -> int:
        """The drops of the connection seen so far, counting any waiting to be read now: a caller about to send
        learns of a drop at once, not when the loop gets round to reading it. Each new one ends the waits for an
        answer on the connection (its gateway answers the connection a request came on, which is gone)."""
        if self.watch.dropped():
            self.drops += 1
            self._on_drop(self.endpoint)
            for waiter in self._drop_waiters:
                if not waiter.done():
                    waiter.set_result(None)
        return self.drops

    async def next_frame(self, inbox: asyncio.Queue, timeout_s: float, drops: int):
        """The next frame in ``inbox``; DROPPED if the connection dropped after ``drops`` drops (seen_drops, read
        before the request went), unless an answer came first (a drop in doubt, a handshake failed without a reason,
        only if it is still failing a moment later: Doubt); None after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        doubt = Doubt(self.watch)
        while True:
            try:
                return inbox.get_nowait()
            except asyncio.QueueEmpty:
                pass
            now = time.monotonic()
            if (seen := self.seen_drops()) > drops:
                drops = seen
                if doubt.on_drop(now):
                    return DROPPED
            if doubt.ended(now):
                return DROPPED
            if now >= deadline:
                return None if doubt.until is None else DROPPED
            frame = asyncio.ensure_future(inbox.get())
            dropped = self.loop.create_future()
            self._drop_waiters.add(dropped)
            try:
                await asyncio.wait([frame, dropped], timeout=doubt.wake(deadline) - now,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._drop_waiters.discard(dropped)
                if not frame.done():
                    frame.cancel()  # a frame it did not take stays in the inbox, for the call's next attempt
            if frame.done() and not frame.cancelled():
                return frame.result()

    async def _read(self) -> None:
        while True:
            frame = await self.sock.recv()
            try:
                msg = P.decode(frame)
            except P.ProtocolError as e:
                self.dropped += 1
                log.warning("gateway %s sent an unreadable frame: %s", self.endpoint, e)
                continue
            if msg.request_id is None and isinstance(msg, P.ErrorReply):
                # The gateway could not read one of our frames far enough to find its request id. An unknown
                # API key (refused before the rest is decoded) concerns every call here, which all share the
                # key: each gets the answer rather than waiting out its timeout. Any other such error belongs
                # to one call that cannot be told apart: handed to all, it failed every stream beside it.
                if msg.code == "unauthorized":
                    for waiting in list(self.inboxes.values()):
                        waiting.put_nowait(msg)
                else:
                    self.dropped += 1
                    log.warning("gateway %s refused a frame it could not attribute: %s", self.endpoint, msg.message)
                continue
            inbox = self.inboxes.get(msg.request_id)
            if inbox is None:
                self.dropped += 1
                continue
            inbox.put_nowait(msg)

    async def send(self, msg) -> None:
        try:
            await self.sock.send(P.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            # No pipe to queue on (a gateway that refused our handshake) or a full one: never block the caller;
            # the wait for the answer times out and the call retries or fails over like on a silent gateway.
            self.dropped += 1

    def send_nowait(self, msg) -> None:
        """As send, from code that may not await: a stream's ``finally`` while its task is being cancelled."""
        try:
            self.sock.send(P.encode(msg), zmq.NOBLOCK).add_done_callback(_retrieved)
        except Exception:  # noqa: BLE001 - its socket or loop already closed: nobody is left to tell
            self.dropped += 1

    def close(self) -> None:
        if self.loop.is_closed():
            self.watch.close()
        else:
            self._reader.cancel()
            # Its waiters heard nothing more: each took the gateway for dead after timeout_s, failed the client over
            # and opened a connection again, behind the back of the caller that had closed it.
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is self.loop:
                self._wake()
            else:
                self.loop.call_soon_threadsafe(self._wake)
            if running is self.loop or not self.loop.is_running():
                self._unwatch()
            else:
                self.loop.call_soon_threadsafe(self._unwatch)
        self.sock.close(linger=0)

    def _wake(self) -> None:
        for inbox in list(self.inboxes.values()):
            inbox.put_nowait(CLOSED)

    def _unwatch(self) -> None:
        """Stop reading the drop events, then close their socket: the loop must not watch a closed descriptor
        (whose number the system may give to another)."""
        self.loop.remove_reader(self._events_fd)
        self.watch.close()


def _check_open(frame) -> None:
    if frame is CLOSED:
        raise ServingError("the client was closed while this call waited for its answer")


def _retrieved(sent: asyncio.Future) -> None:
    if not sent.cancelled():
        sent.exception()  # a full or missing pipe: the unsubscription is lost, which costs only its keepalives
