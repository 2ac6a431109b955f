"""close() ends what is waiting on the client, and leaves nothing open, even for a call or stream that is between two
attempts (a pause after an Unavailable) when it is called.

Real processes (tests/durable_cluster.py: redis-server, a gateway, a worker); Redis is killed for the pauses.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest

from common.errors import ServingError, Unavailable
from gateway.sdk import AsyncGatewayClient, GatewayClient
from tests.durable_cluster import DurableCluster
from tests.sdk_helpers import close_under_waiters


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with DurableCluster(tmp_path_factory.mktemp("sdk-close"), tiny_model_dir, gateways=1, workers=1) as c:
        yield c


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_call_paused_between_attempts_when_the_async_client_closes_ends_and_opens_nothing(cluster):
    """A submit waiting out Redis's outage (Unavailable, retried after a pause) woke after the client's close(),
    opened a connection again and went on retrying until its budget was spent: it ended with Unavailable seconds
    later, not with the closed client's ServingError, and left a socket (and its reader task) nobody would close."""
    c = cluster

    async def main():
        warm = AsyncGatewayClient(c.endpoint(), c.key("lab-co"), timeout_s=10)
        await warm.info()  # the asyncio ZeroMQ context and its descriptors exist before the count
        warm.close()
        await asyncio.sleep(0.1)
        before = open_fds()
        client = AsyncGatewayClient(c.endpoint(), c.key("lab-co"), timeout_s=10, retries=1)
        job = await client.submit(prompt_token_ids=[1, 2], max_tokens=2)
        c.kill("redis")
        try:
            calls = [asyncio.create_task(client.submit(prompt_token_ids=[3, 4], max_tokens=2)),
                     asyncio.create_task(client.status(job.id))]
            await asyncio.sleep(1.0)  # each answered Unavailable at least once, and pausing before the next try
            assert not any(t.done() for t in calls), [t.exception() for t in calls if t.done()]
            closed_at = time.monotonic()
            client.close()
            done, _ = await asyncio.wait(calls, timeout=20)
            took = time.monotonic() - closed_at
            errors = [t.exception() for t in done]
            await asyncio.sleep(0.1)
            left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            return errors, took, len(client._conns), left, open_fds() - before
        finally:
            c.restart("redis")

    errors, took, conns, left, fds = asyncio.run(main())
    assert len(errors) == 2 and all(type(e) is ServingError and "closed" in str(e) for e in errors), errors
    assert took < 5, took
    assert conns == 0 and not left and fds == 0, (conns, left, fds)


SMALL = [1, 2]
# Over the size a gateway is asked about first (gateway/sdk/_frames.py UNASKED_BYTES): ids over 127 take 3 bytes
# each, a frame of about 1.8 KiB.
LARGE = [300 + i % 200 for i in range(600)]


@pytest.mark.parametrize("prompt", [SMALL, LARGE], ids=["small", "large"])
def test_a_call_paused_between_attempts_when_the_blocking_client_closes_ends_and_opens_nothing(cluster, prompt):
    """As for the async client: a thread's call paused after an Unavailable opened a socket again after close()
    from another thread, and kept retrying until its budget was spent. Large: every attempt asks the gateway before
    its frame goes, and close() forgets what gateways said; the call woken after close() asked again, on a socket
    opened after close() by that question's own call, and ended with Unavailable seconds later."""
    c = cluster
    client = GatewayClient(c.endpoint(), c.key("lab-co"), timeout_s=10, retries=1)
    client.submit(prompt_token_ids=prompt, max_tokens=2)  # asked about (if large), and taken, while Redis answers
    c.kill("redis")
    try:
        out: list[BaseException] = []

        def call():
            try:
                client.submit(prompt_token_ids=prompt[::-1], max_tokens=2)
            except BaseException as e:  # noqa: BLE001 - the test reads it
                out.append(e)

        t = threading.Thread(target=call, daemon=True)
        t.start()
        time.sleep(1.0)
        assert t.is_alive(), out
        closed_at = time.monotonic()
        client.close()
        t.join(20)
        took = time.monotonic() - closed_at
    finally:
        c.restart("redis")
    assert len(out) == 1 and type(out[0]) is ServingError and "closed" in str(out[0]), out
    assert took < 5, took
    assert not list(client._open), list(client._open)


def test_calls_and_streams_waiting_in_other_threads_end_soon_after_close_every_time(cluster):
    """close() from one thread ended another thread's wait only if that thread's poll happened to look at its
    sockets after they were closed; otherwise the wait ran out its whole poll (up to timeout_s) before the
    ServingError. A frozen gateway sends nothing, so nothing else wakes the waits here: each round must end
    within a second of the close."""
    import signal

    c = cluster
    with GatewayClient(c.endpoint(), c.key("lab-co"), timeout_s=30) as warm:
        job_id = warm.submit(prompt_token_ids=[3, 4, 5], max_tokens=2, ignore_eos=True).id
    gateway = c.procs["gw-0"].pid
    for _ in range(5):
        client = GatewayClient(c.endpoint(), c.key("lab-co"), timeout_s=30)
        job = client.job(job_id)  # re-attached while the gateway answers
        os.kill(gateway, signal.SIGSTOP)
        try:
            outcome, took = close_under_waiters(client, (client.info, lambda: list(job.stream())))
        finally:
            os.kill(gateway, signal.SIGCONT)
        assert outcome == [ServingError, ServingError] and took < 1.0, (outcome, took)
