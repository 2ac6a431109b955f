"""Does this process's ZeroMQ still work? Checked after every test (tests/conftest.py).

A socket monitor whose send blocked froze libzmq's I/O thread, and with it every socket on that context: each later
test that used ZeroMQ in the test process (an SDK client, an in-process gateway or worker) then timed out, one by
one, until the run passed CI's time limit with no failure printed. A frozen context now ends the run at once,
naming the test after which it froze, with every thread's stack."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys

import zmq
import zmq.asyncio


def _contexts() -> list[zmq.Context]:
    """The process's global contexts that exist (pyzmq's instance per class), as blocking views."""
    out = []
    for cls in (zmq.Context, zmq.asyncio.Context):
        ctx = cls.__dict__.get("_instance")
        if ctx is not None and not ctx.closed and cls.__dict__.get("_instance_pid") == os.getpid():
            out.append(zmq.Context.shadow(ctx.underlying))
    return out


def answers(ctx: zmq.Context, timeout_ms: int) -> bool:
    """A fresh ROUTER/DEALER pair over TCP (through the context's I/O thread, as every real connection) exchanges
    a frame within ``timeout_ms``. None of its calls blocks on a frozen I/O thread."""
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send(b"alive?")
        return bool(router.poll(timeout_ms))
    finally:
        router.close(linger=0)
        dealer.close(linger=0)


def frozen() -> bool:
    """Does a global context fail to answer, twice (the second time with a generous wait: a loaded machine)?"""
    return any(not answers(ctx, 5_000) and not answers(ctx, 20_000) for ctx in _contexts())


def report() -> None:
    """To stderr: the process's live ZeroMQ sockets and, where gdb is installed, every thread's native stack (a
    frozen I/O thread shows where it blocks, say a monitor's zmq_msg_send)."""
    out = sys.stderr
    socks = [o for o in gc.get_objects() if isinstance(o, zmq.Socket)]
    out.write(f"\n--- {len(socks)} ZeroMQ sockets alive in Python\n")
    for s in socks:
        try:
            if s.closed:
                out.write("  closed\n")
            else:
                out.write(f"  type={s.type} endpoint={s.getsockopt(zmq.LAST_ENDPOINT)!r} "
                          f"rcvhwm={s.getsockopt(zmq.RCVHWM)}\n")
        except zmq.ZMQError as e:
            out.write(f"  unreadable: {e}\n")
    gdb = shutil.which("gdb")
    if gdb:
        out.write("--- native stacks (gdb)\n")
        out.flush()
        subprocess.run([gdb, "-p", str(os.getpid()), "-batch", "-ex", "thread apply all bt 12"], stdout=out,
                       stderr=subprocess.STDOUT, timeout=120, check=False)
    out.flush()
