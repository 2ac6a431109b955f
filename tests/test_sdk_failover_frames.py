"""What a gateway said of frame sizes is recorded for that gateway, not for the one the client moved to meanwhile.

A call over 16 KiB asks its gateway first whether it takes the frame (gateway/sdk/_frames.py). The answer was
recorded under the client's current gateway as it was when the answer came, read after the wait (the asyncio
client) or beside other threads (the blocking client): when another call failed the client over meanwhile, a "yes"
from the gateway taking 8 MiB was recorded for the next one, which takes 4 KiB. The call then sent that one its frame
unasked; its ZeroMQ dropped the connection (ZMQ_MAXMSGSIZE), and the call ended wherever its retries took it, not
with the InvalidRequest naming the limit of the gateway it was on. And the blocking client's threads that saw the
same gateway fall silent each moved the client on, two of them back to the silent one.

Real processes (tests/durable_cluster.py: redis-server, two gateways); gw-0 is frozen (SIGSTOP) so that the calls
on it time out in a known order, then let go once the client has moved to gw-1.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from common.errors import InvalidRequest, NotFound
from gateway.sdk import AsyncGatewayClient, GatewayClient
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.sdk_helpers import freeze

pytestmark = pytest.mark.faults

SMALL = 4096  # gw-1's client_max_message_bytes
TIMEOUT_S = 3.0
# Two calls see gw-0 fall silent (the blocking client moved on once for each, back to gw-0); three large ones ask it.
QUIET, LARGE = 2, 3


def large_id(i: int) -> str:
    return f"{i}" + "j" * 20_000  # 20 kB: asked about first (over 16 KiB); over gw-1's limit


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    env = {"gw-1": {"TS_GATEWAY_CLIENT_MAX_MESSAGE_BYTES": str(SMALL)}}
    with DurableCluster(tmp_path_factory.mktemp("sdk-fo"), tiny_model_dir, gateways=2, workers=0,
                        process_env=env) as c:
        yield c


def check(c: DurableCluster, quiet: list, large: list, took: float, endpoint: str) -> None:
    """The quiet calls answered by gw-1 after one failover; each large call refused by gw-1's size at once."""
    gw1 = c.endpoint("gw-1")
    assert [type(r) for r in quiet] == [NotFound] * QUIET, quiet
    assert [type(r) for r in large] == [InvalidRequest] * LARGE, large
    assert all(r.field == "job_id" and str(SMALL) in str(r) and gw1 in str(r) for r in large), large
    assert took < TIMEOUT_S, took  # nobody waited out a silence after gw-0 woke
    assert endpoint == gw1


def test_an_async_answer_counts_for_the_gateway_that_gave_it(cluster):
    c = cluster
    gw0 = c.procs["gw-0"].pid

    async def main():
        client = AsyncGatewayClient([c.endpoint("gw-0"), c.endpoint("gw-1")], c.key("lab-co"), timeout_s=TIMEOUT_S)
        try:
            await client.info()
            freeze(gw0)
            try:
                quiet = [asyncio.create_task(client.cancel(f"quiet-{i}")) for i in range(QUIET)]
                await asyncio.sleep(TIMEOUT_S / 2)  # the questions go later: their wait ends after the failover
                large = [asyncio.create_task(client.cancel(large_id(i))) for i in range(LARGE)]
                deadline = time.monotonic() + 2 * TIMEOUT_S
                while client.endpoint != c.endpoint("gw-1"):
                    assert time.monotonic() < deadline, "the client never moved to gw-1"
                    await asyncio.sleep(0.01)
            finally:
                os.kill(gw0, signal.SIGCONT)
            woke = time.monotonic()
            large_out = await asyncio.wait_for(asyncio.gather(*large, return_exceptions=True), 30)
            took = time.monotonic() - woke
            quiet_out = await asyncio.wait_for(asyncio.gather(*quiet, return_exceptions=True), 30)
            return quiet_out, large_out, took, client.endpoint
        finally:
            client.close()

    check(c, *asyncio.run(main()))


def test_a_blocking_answer_counts_for_the_gateway_that_gave_it(cluster):
    c = cluster
    gw0 = c.procs["gw-0"].pid
    with GatewayClient([c.endpoint("gw-0"), c.endpoint("gw-1")], c.key("lab-co"), timeout_s=TIMEOUT_S) as client:
        client.info()
        quiet: dict[int, BaseException] = {}
        large: dict[int, BaseException] = {}

        def call(out: dict, i: int, job_id: str) -> None:
            try:
                client.cancel(job_id)
            except BaseException as e:  # noqa: BLE001 - checked in the test's thread
                out[i] = e

        freeze(gw0)
        try:
            threads = [threading.Thread(target=call, args=(quiet, i, f"quiet-{i}")) for i in range(QUIET)]
            for t in threads:
                t.start()
            time.sleep(TIMEOUT_S / 2)  # the questions go later: their wait ends after the failover
            asking = [threading.Thread(target=call, args=(large, i, large_id(i))) for i in range(LARGE)]
            for t in asking:
                t.start()
            wait_for(lambda: client.endpoint == c.endpoint("gw-1"), 2 * TIMEOUT_S, "the client to move to gw-1",
                     interval=0.01)
        finally:
            os.kill(gw0, signal.SIGCONT)
        woke = time.monotonic()
        for t in asking:
            t.join(30)
        took = time.monotonic() - woke
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads + asking)
        check(c, [quiet.get(i) for i in range(QUIET)], [large.get(i) for i in range(LARGE)], took, client.endpoint)
