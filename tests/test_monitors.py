"""common/monitors: a monitor's reader is closed exactly when libzmq has let go of it, never before (a reader closed
under a live monitor froze every ZeroMQ socket of the process: tests/test_monitor_flood.py), and not left open
after either. Real sockets on a private context."""

from __future__ import annotations

import gc
import os
import time
import weakref

import pytest
import zmq

from common.monitors import close_monitor, monitor_events, monitor_socket
from tests.cluster_helpers import wait_for


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _connected_pair(ctx):
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    return router, dealer, f"tcp://127.0.0.1:{port}"


def test_events_arrive_and_the_stop_is_not_one_of_them(ctx):
    router, dealer, endpoint = _connected_pair(ctx)
    reader = monitor_socket(dealer, zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    dealer.connect(endpoint)
    events: list[int] = []
    wait_for(lambda: events.extend(monitor_events(reader)) or zmq.EVENT_HANDSHAKE_SUCCEEDED in events, 10,
             "the handshake event")
    router.close(linger=0)  # the peer goes: a drop
    wait_for(lambda: events.extend(monitor_events(reader)) or zmq.EVENT_DISCONNECTED in events, 10,
             "the disconnection event")
    close_monitor(dealer, reader)
    assert zmq.EVENT_MONITOR_STOPPED not in events
    assert set(events) <= {zmq.EVENT_HANDSHAKE_SUCCEEDED, zmq.EVENT_DISCONNECTED}, events
    dealer.close(linger=0)


def test_a_monitor_stopped_on_an_open_socket_closes_its_reader_at_once(ctx):
    router, dealer, endpoint = _connected_pair(ctx)
    reader = monitor_socket(dealer, zmq.EVENT_DISCONNECTED)
    dealer.connect(endpoint)
    close_monitor(dealer, reader)
    assert reader.closed
    close_monitor(dealer, reader)  # again: harmless
    dealer.close(linger=0)
    router.close(linger=0)


def _probe(ctx) -> None:
    """Open and close another monitor: each looks at the retired readers again."""
    probe = ctx.socket(zmq.DEALER)
    close_monitor(probe, monitor_socket(probe, zmq.EVENT_DISCONNECTED))
    probe.close(linger=0)


@pytest.mark.parametrize("how", ["closed", "collected"])
def test_a_reader_outlives_its_lingering_socket_and_is_closed_after_it(ctx, how):
    """The socket still holds a frame it cannot deliver (no peer), so libzmq keeps it, and its monitor, for its
    linger after Python let go: the reader stays open all that time, then closes."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 3000)
    reader = monitor_socket(sock, zmq.EVENT_DISCONNECTED)
    sock.connect("tcp://127.0.0.1:9")  # nothing listens: the frame waits
    sock.send(b"x")
    # Timed from before the close: a collection in a large process takes a good part of a second.
    lingered_until = time.monotonic() + 1.5
    if how == "closed":
        sock.close()
        close_monitor(sock, reader)
    else:
        ref = weakref.ref(sock)
        del sock
        gc.collect()
        assert ref() is None
    while time.monotonic() < lingered_until:  # libzmq still holds the socket: the reader must stay
        _probe(ctx)
        assert not reader.closed, "the reader was closed while libzmq still monitored its socket"
        time.sleep(0.1)
    wait_for(lambda: _probe(ctx) or reader.closed, 10, "the reader to be closed once libzmq destroyed its socket")


def test_a_forked_child_leaves_its_parents_monitors_alone(ctx):
    sock = ctx.socket(zmq.DEALER)
    reader = monitor_socket(sock, zmq.EVENT_DISCONNECTED)
    pid = os.fork()
    if pid == 0:
        try:
            close_monitor(sock, reader)  # the parent's: must neither hang nor touch it
            _probe(zmq.Context())
        finally:
            os._exit(0 if not reader.closed else 1)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    if done == (0, 0):
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the child hung closing its parent's monitor")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert not reader.closed
    close_monitor(sock, reader)
    assert reader.closed
    sock.close(linger=0)
