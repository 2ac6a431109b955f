"""A socket monitor nobody reads must not freeze the process's ZeroMQ.

libzmq sends each monitor event from the context's I/O thread and blocks that thread once the monitor's queue is
full: every socket of the context then stops. A blocking SDK client (gateway/sdk) reads its DropWatch only during a
call, so one left idle while its gateway's address accepted and dropped connections (a port reused by another
server, a load balancer with no backend, a CURVE key mismatch) froze, after some 2,000 drops, every ZeroMQ socket of
the process that shares pyzmq's global context: other clients, an in-process gateway. In the test suite this took
down every later in-process ZeroMQ exchange (tests passing alone failed in sequence).

Each scenario runs in a child process, so a frozen context cannot take the test process's with it. The peer is a
plain TCP listener that accepts and closes at once; reconnects every millisecond bring the thousands of drops in
seconds. Each child checks a fresh ROUTER/DEALER pair on the same context every 0.5 s, and at the end counts the
events the monitor queued (enough, or the scenario tested nothing)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.cluster_helpers import ROOT

PRELUDE = textwrap.dedent("""
    import socket, threading, time
    import zmq

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(512)
    port = listener.getsockname()[1]

    def accept_and_close():
        while True:
            conn, _ = listener.accept()
            conn.close()

    threading.Thread(target=accept_and_close, daemon=True).start()
    ctx = zmq.Context.instance()

    def flapping(sock):
        sock.setsockopt(zmq.RECONNECT_IVL, 1)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1)
        sock.connect(f"tcp://127.0.0.1:{port}")

    def fresh_pair_talks():
        router = ctx.socket(zmq.ROUTER)
        dealer = ctx.socket(zmq.DEALER)
        try:
            p = router.bind_to_random_port("tcp://127.0.0.1")
            dealer.connect(f"tcp://127.0.0.1:{p}")
            dealer.send(b"hi")
            return bool(router.poll(3000))
        finally:
            router.close(0)
            dealer.close(0)

    def watch_for(seconds):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(0.5)
            if not fresh_pair_talks():
                print("FROZEN", flush=True)
                raise SystemExit(3)

    def drain(mon):
        n = 0
        while mon.poll(0):
            mon.recv_multipart()
            n += 1
        return n
""")

SDK_DROPWATCH = PRELUDE + textwrap.dedent("""
    from gateway.sdk._drops import DropWatch

    sock = ctx.socket(zmq.DEALER)
    watch = DropWatch(sock)
    flapping(sock)
    watch_for(8)
    events = drain(watch.events)
    # The first read tells the drop (the events it drained were the drops).
    print("OK", events, flush=True)
    watch.close()
    sock.close(0)
""")

WORKER_ROUTES = PRELUDE + textwrap.dedent("""
    from worker.routes import GatewayRoutes

    sock = ctx.socket(zmq.DEALER)
    routes = GatewayRoutes([sock])
    flapping(sock)
    watch_for(8)  # a step this long with the monitor unread (the worker reads it between steps)
    events = sum(drain(mon) for mon in routes.monitors)
    print("OK", events, flush=True)
    routes.close()
    sock.close(0)
""")


# The reader let go of (collected, so pyzmq closed it) while its socket is open and monitored: the socket's next drop
# blocked libzmq's I/O thread for good. A process whose clients were collected in the wrong order froze so.
READER_COLLECTED = PRELUDE + textwrap.dedent("""
    import gc
    from common.monitors import monitor_socket

    router = ctx.socket(zmq.ROUTER)
    p = router.bind_to_random_port("tcp://127.0.0.1")
    sock = ctx.socket(zmq.DEALER)
    reader = monitor_socket(sock, zmq.EVENT_DISCONNECTED)
    sock.connect(f"tcp://127.0.0.1:{p}")
    sock.send(b"x")
    assert router.poll(5000)
    del reader
    gc.collect()
    router.close(0)  # the peer drops: a disconnection for the monitor
    watch_for(2)
    print("OK 0", flush=True)
    sock.close(0)
""")


# A socket lives on in libzmq after Python closes it (its linger, here with a frame it still tries to deliver),
# reconnecting and reporting each drop to its monitor: a reader closed then (by the client's close(), which closed
# sockets before readers, or by a collection) blocked the I/O thread at the next drop. The reader must stay open
# until libzmq says the monitor stopped, and be closed then (checked: no reader is left behind).
SOCKET_CLOSED_FIRST = PRELUDE + textwrap.dedent("""
    from gateway.sdk._drops import DropWatch

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1500)
    watch = DropWatch(sock)
    flapping(sock)
    sock.send(b"x")  # never delivered: the closed socket lingers, reconnecting
    reader = watch.events
    sock.close()
    watch.close()
    watch_for(3)
    DropWatch(ctx.socket(zmq.DEALER)).close()  # any later monitor looks at the retired readers again
    assert reader.closed, "the reader was never closed once its socket was gone"
    print("OK 0", flush=True)
""")

SOCKET_COLLECTED = PRELUDE + textwrap.dedent("""
    import gc, weakref
    from gateway.sdk._drops import DropWatch

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1500)
    watch = DropWatch(sock)
    flapping(sock)
    sock.send(b"x")
    reader = weakref.ref(watch.events)
    del watch, sock  # a client dropped unclosed: pyzmq closes the socket as it collects it
    gc.collect()
    watch_for(3)
    DropWatch(ctx.socket(zmq.DEALER)).close()
    left = reader()
    assert left is None or left.closed, "the reader was never closed once its socket was collected"
    print("OK 0", flush=True)
""")


@pytest.mark.parametrize("script, floods", [(SDK_DROPWATCH, True), (WORKER_ROUTES, True), (READER_COLLECTED, False),
                                            (SOCKET_CLOSED_FIRST, False), (SOCKET_COLLECTED, False)],
                         ids=["sdk-dropwatch", "worker-routes", "reader-collected", "socket-closed-first",
                              "socket-collected"])
def test_an_unread_monitor_does_not_freeze_the_process_zeromq(script, floods):
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    out = proc.stdout + proc.stderr
    assert "FROZEN" not in out, "a fresh socket pair on the context exchanged nothing: the monitor froze it"
    assert proc.returncode == 0, out[-2000:]
    events = int(out.split("OK", 1)[1].split()[0])
    if not floods:
        return
    # Past the 2,000 a default monitor queue holds (its send and receive high-water marks), or nothing was tested.
    assert events > 2000, f"only {events} drops in 8 s: the scenario never filled a default queue"
