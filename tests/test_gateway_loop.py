"""The gateway's one loop: a burst of client frames does not keep freed slots idle.

An admission costs milliseconds (its wait estimate reads the queues and replays them), and the loop once
handled every client frame waiting in its socket before it dispatched: a burst of a hundred submits kept a
slot that had just freed idle for the whole burst. Real parts: a redis-server, the gateway built as
`python -m gateway` builds it, its real client socket, frames from a ZeroMQ DEALER; the handler is the real
one, made slower (as under a deep queue) by a wrapper that calls through."""

from __future__ import annotations

import time

import pytest
import zmq

from common import protocol as P
from gateway.server import CLIENT_DRAIN_BUDGET_S
from tests.gateway_helpers import built_gateway

FRAMES = 40
HANDLER_S = 0.004  # what one admission costs under a deep queue (scripts/bench_backlog.py: 4-17 ms)


@pytest.fixture
def gateway(tmp_path):
    with built_gateway(tmp_path, "loop") as (gw, tenants, _):
        yield gw, tenants


def _burst(gw, api_key: str) -> zmq.Socket:
    """FRAMES status requests, all waiting in the gateway's client socket before it reads one."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(gw.clients.getsockopt_string(zmq.LAST_ENDPOINT))
    for i in range(FRAMES):
        dealer.send_multipart([P.encode(P.StatusRequest(api_key, f"job-{i}", request_id=f"r{i}"))])
    deadline = time.monotonic() + 10
    while not gw.clients.poll(0) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # all of them arrived
    return dealer


@pytest.mark.parametrize("pending", [True, False])
def test_client_frames_yield_to_a_pending_dispatch_within_the_budget(gateway, pending):
    gw, tenants = gateway
    handled = []

    def slow_status(to, msg):
        time.sleep(HANDLER_S)
        handled.append(msg)
        gw._client_handlers[P.StatusRequest](to, msg)  # the real handler: it answers "not found"

    dealer = _burst(gw, tenants["lab-co"]["api_key"])
    try:
        gw._dirty = pending
        started = time.monotonic()
        gw._drain(gw.clients, {P.StatusRequest: slow_status})
        took = time.monotonic() - started
        if pending:  # a dispatch waits: the loop comes back to the frames after it
            assert 1 <= len(handled) < FRAMES
            assert took < CLIENT_DRAIN_BUDGET_S + 3 * HANDLER_S + 0.05, took
            gw._dirty = False
            gw._drain(gw.clients, {P.StatusRequest: slow_status})
        assert len(handled) == FRAMES  # none lost: the rest waited in the socket
        replies = [P.decode(dealer.recv_multipart()[-1]) for _ in range(FRAMES)]
        assert {r.request_id for r in replies} == {f"r{i}" for i in range(FRAMES)}  # each answered once
    finally:
        dealer.close(linger=0)
