"""A cancel's end-of-wait time read (ClientApi._cancelled_at_ns) while Redis stands still (SIGSTOP).

After cancel.lua, the gateway reads the job's finished_at_ms for its queue-wait span. It caught a Redis error there
and went on, but tried Redis even in the gateway's back-off and never started one: each cancel handled while Redis
stood still waited out the 2 s socket timeout, and so did the next client frame after it (answered 'unavailable'
only once a second timeout had passed), while no client was answered. Now it skips Redis in the back-off and starts
the back-off when Redis fails it, as the other sites that go on without Redis do. The gateway is built as
`python -m gateway` builds it, on a real redis-server.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.gateway_helpers import built_gateway

pytestmark = pytest.mark.faults
REDIS_TIMEOUT_S = 2.0  # the gateway's Redis socket timeout (gateway/__main__.build)


@pytest.fixture
def gateway(tmp_path):
    with built_gateway(tmp_path, "cancel") as (gw, _, server):
        yield gw, server


def test_the_time_is_redis_s_while_it_answers(gateway):
    gw, _ = gateway
    gw.queue.client.hset(gw.queue.keys.job("job-a"), "finished_at_ms", 1_700_000_000_123)
    assert gw._cancelled_at_ns("job-a") == 1_700_000_000_123 * 1_000_000
    assert not gw._redis_down()


def test_a_frozen_redis_starts_the_back_off(gateway):
    gw, server = gateway
    os.kill(server.pid, signal.SIGSTOP)
    try:
        before = time.time_ns()
        at = gw._cancelled_at_ns("job-a")
        in_backoff = gw._redis_down()
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert before <= at <= time.time_ns()  # this gateway's clock: Redis did not say
    assert in_backoff, "a Redis that did not answer a cancel's read started no back-off"
    assert gw.counters["redis_errors"] == 1


def test_in_the_back_off_redis_is_not_tried(gateway):
    import redis

    gw, server = gateway
    gw._redis_failed(redis.ConnectionError("a read before timed out"))
    os.kill(server.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        before = time.time_ns()
        at = gw._cancelled_at_ns("job-a")
        took = time.monotonic() - started
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert before <= at <= time.time_ns()
    assert took < REDIS_TIMEOUT_S / 2, f"the read waited {took:.2f} s on a Redis known to be down"
    assert gw.counters["redis_errors"] == 1  # nothing tried, nothing failed again
