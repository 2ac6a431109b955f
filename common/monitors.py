"""ZeroMQ socket monitors that cannot freeze the process.

libzmq sends each monitor event from the context's I/O thread with a blocking send on an inproc PAIR, and that
thread serves every socket of the context. Two ways that send never returns, and the process's ZeroMQ stops:
- the reader's queue is full (2,000 events unread by default): readers here have no receive bound;
- the reader is closed while libzmq still monitors its socket: a socket closed in Python lives on in libzmq (its
  linger, its reaper) and still reports, say, a peer that drops during its linger. So a reader is closed only once
  libzmq has let go of it: at once after ``disable_monitor()`` (libzmq closes its end before returning), or, for a
  socket closed or collected first, once libzmq has destroyed the socket and said so (EVENT_MONITOR_STOPPED).
  Until then the reader is kept, and each later monitor opened or closed in the process looks again.
"""

from __future__ import annotations

import collections
import os
import struct
import sys
import threading
import uuid
import weakref

import zmq

_lock = threading.Lock()
# Readers their owners let go of; libzmq may still send. A deque: a collection may retire one (a finalizer) in the
# middle of a reap, on the reaping thread; its append needs no lock.
_retiring: collections.deque[zmq.Socket] = collections.deque()
_stopped: weakref.WeakSet[zmq.Socket] = weakref.WeakSet()  # readers that have read EVENT_MONITOR_STOPPED
# Each reader's process: in a forked child, the parent's sockets are never touched (libzmq's threads did not follow;
# a read there spun for ever). pyzmq leaves them alone there too.
_pids: weakref.WeakKeyDictionary[zmq.Socket, int] = weakref.WeakKeyDictionary()


def monitor_socket(sock: zmq.Socket, events: int) -> zmq.Socket:
    """The socket ``sock``'s ``events`` arrive on: a blocking PAIR (as pyzmq's get_monitor_socket, which for an
    asyncio socket gives one only its loop reads) whose queue has no bound, so an unread event costs memory (about
    a hundred bytes), never the process's ZeroMQ. Read it with ``monitor_events``; end it with ``close_monitor``
    (never ``close()``): a socket collected unclosed ends its monitor itself."""
    _reap()
    address = f"inproc://ts-monitor-{uuid.uuid4().hex}"
    sock.monitor(address, events | zmq.EVENT_MONITOR_STOPPED)
    reader = zmq.Context.shadow(sock.context.underlying).socket(zmq.PAIR)
    reader.setsockopt(zmq.RCVHWM, 0)  # before connecting: the inproc pipe's bound is fixed as it is made
    reader.setsockopt(zmq.LINGER, 0)
    reader.connect(address)
    _pids[reader] = os.getpid()
    # The finalizer holds the reader until then, so the reader is never collected (closed) before its socket.
    weakref.finalize(sock, _retire, reader).atexit = False
    return reader


def monitor_events(reader: zmq.Socket) -> list[int]:
    """The events waiting on ``reader``, oldest first, read without blocking (none once it is closed)."""
    return [event for event, _ in monitor_event_values(reader)]


def monitor_event_values(reader: zmq.Socket) -> list[tuple[int, int]]:
    """As monitor_events, each with its value (a handshake failure's error code or ZAP status, a descriptor...)."""
    out = []
    while True:
        try:
            frames = reader.recv_multipart(zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            return out
        event, value = struct.unpack_from("=HI", frames[0])
        if event == zmq.EVENT_MONITOR_STOPPED:
            _stopped.add(reader)
        else:
            out.append((event, value))


def close_monitor(sock: zmq.Socket, reader: zmq.Socket) -> None:
    """Stop monitoring ``sock`` and close ``reader`` (at once if ``sock`` is still open; otherwise once libzmq has
    let go of the monitor). Call it before or after closing ``sock``, from its owner; calling it again is harmless.
    In a forked child it leaves the parent's monitor alone."""
    if _pids.get(reader) != os.getpid():
        return
    if not sock.closed:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass  # the socket was closed meanwhile: libzmq stops its monitor when it destroys it
        else:
            # libzmq closed its end before returning: nothing more can come, so the reader goes at once, unread (a
            # thread may be polling it still, as a stream does while its client is closed; two readers abort libzmq).
            reader.close(linger=0)
            _reap()
            return
    _retire(reader)


def _retire(reader: zmq.Socket) -> None:
    if sys.is_finalizing():
        return  # the process is ending (and pyzmq's errors can no longer even be imported)
    _retiring.append(reader)
    _reap()


def _reap() -> None:
    """Close the retired readers libzmq has let go of; keep the others for a later look. A reap already under way
    (another thread's, or this one's, interrupted by a collection) will see what was retired meanwhile, or the
    next will."""
    if not _lock.acquire(blocking=False):
        return
    try:
        keep = []
        while _retiring:
            reader = _retiring.popleft()
            if _pids.get(reader) != os.getpid() or reader.closed:
                continue  # a parent's, in a forked child, is never touched (pyzmq does not close it there either)
            monitor_events(reader)
            if reader in _stopped:
                reader.close(linger=0)
            else:
                keep.append(reader)
        _retiring.extend(keep)
    finally:
        _lock.release()


def _forget_parents() -> None:
    """In a forked child: the parent's retired readers are not this process's to close, and a parent's thread may
    have held the lock at the fork (it would never be let go)."""
    global _lock
    _lock = threading.Lock()
    _retiring.clear()


os.register_at_fork(after_in_child=_forget_parents)
