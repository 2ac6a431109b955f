"""A worker connected to two gateways: a job's tokens go back to the gateway that dispatched it, whatever the other
one says (a welcome naming the first one's id: a buggy gateway, or two started with the same id).

A real WorkerService (bench model, real ZeroMQ) facing two gateway sockets the test drives (tests/test_worker_drain).
"""

from __future__ import annotations

import time

import pytest

from common import protocol as P
from tests.test_worker_drain import FakeGateway, is_, serving_worker


@pytest.fixture
def two_gateways(bench_model_dir):
    a, b = FakeGateway(), FakeGateway()
    with serving_worker(bench_model_dir, [a, b], worker_id="wk-two") as (service, _):
        yield service, a, b


def test_a_welcome_naming_another_gateways_id_does_not_take_its_jobs_tokens(two_gateways):
    """The worker sent a job's tokens to whichever socket last welcomed it under the dispatch's reply_to: after B's
    welcome named A's id ("gw", FakeGateway.dispatch's reply_to), every token of the jobs A dispatched went to B,
    which holds no lease of them, and A's clients saw none until the completion."""
    service, a, b = two_gateways
    for g in (a, b):  # B's welcome the last word; a hello asked for after each: it was read
        g.sock.send_multipart([g.ident, P.encode(P.GatewayWelcome("gw"))])
        g.sock.send_multipart([g.ident, P.encode(P.ErrorReply(P.HELLO_FIRST, "who are you?"))])
        g.receive(is_(P.WorkerHello))
    a.dispatch("j", 20)
    done = a.receive(is_(P.JobFinished, "j"), timeout_s=60)
    assert done.state == "done" and done.num_tokens == 20
    streamed = [t for _, m in a.seen if is_(P.JobTokens, "j")(m) for t in m.token_ids]
    assert streamed == done.token_ids
    time.sleep(0.3)
    while b.sock.poll(100):
        b.seen.append((time.monotonic(), P.decode(b.sock.recv_multipart()[1])))
    assert not [m for _, m in b.seen if is_(P.JobTokens)(m)]
