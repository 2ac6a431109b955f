"""A call whose gateway's connection drops after its request went ends that attempt at once, and retries (on the next
gateway, if there is one), rather than wait out its timeout for an answer that can no longer come: the gateway
answers the connection a request came on, and a reconnected client is a new one to it.

The blocking client did so only for frames over 1 KiB (dropped, as a rule, for being over a gateway's size limit);
the asyncio client never did: a call on a gateway killed after the send waited its whole timeout_s. Now both do,
for every call, with the same error ("... dropped the connection that took this request").

Real processes (tests/durable_cluster.py: redis-server, gateways); the gateway is frozen (SIGSTOP) so the request
sits unread in its socket, then killed (SIGKILL).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from common.errors import NotFound
from gateway.sdk import AsyncGatewayClient, GatewayClient
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.sdk_helpers import freeze, unread_bytes

pytestmark = pytest.mark.faults

TIMEOUT_S = 10.0
KINDS = ["blocking", "asyncio"]


def kill_after_send(c: DurableCluster, gw: str) -> float:
    """Once the request reached the frozen ``gw``'s socket: kill -9 it; the time it died."""
    wait_for(lambda: unread_bytes(c.endpoint(gw)) > 0, 10, f"the request to reach {gw}", interval=0.01)
    c.kill(gw)
    return time.monotonic()


def call_and_kill(kind: str, c: DurableCluster, gateways: list[str], retries: int):
    """A cancel of a job nobody has, on a client of ``gateways``, whose first gateway is frozen and then killed after
    the request reached it: (what the call raised, seconds from the kill to its end)."""
    endpoints = [c.endpoint(g) for g in gateways]
    pid = c.procs[gateways[0]].pid
    if kind == "blocking":
        with GatewayClient(endpoints, c.key("lab-co"), timeout_s=TIMEOUT_S, retries=retries) as client:
            client.info()  # connected: what reaches the gateway from now on is the request
            out: list[BaseException] = []

            def call() -> None:
                try:
                    client.cancel("no-such-job")
                except BaseException as e:  # noqa: BLE001 - checked in the test's thread
                    out.append(e)

            freeze(pid)
            t = threading.Thread(target=call)
            t.start()
            died = kill_after_send(c, gateways[0])
            t.join(3 * TIMEOUT_S)
            assert not t.is_alive()
            return out, time.monotonic() - died

    async def main():
        client = AsyncGatewayClient(endpoints, c.key("lab-co"), timeout_s=TIMEOUT_S, retries=retries)
        try:
            await client.info()
            freeze(pid)
            task = asyncio.create_task(client.cancel("no-such-job"))
            died = await asyncio.to_thread(kill_after_send, c, gateways[0])
            done, _ = await asyncio.wait([task], timeout=3 * TIMEOUT_S)
            return [t.exception() for t in done], time.monotonic() - died
        finally:
            client.close()

    return asyncio.run(main())


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_whose_gateway_dies_after_the_send_fails_over_at_once(tmp_path, tiny_model_dir, kind):
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=0) as c:
        out, took = call_and_kill(kind, c, ["gw-0", "gw-1"], retries=2)
    assert [type(e) for e in out] == [NotFound], out  # answered by gw-1
    assert took < TIMEOUT_S / 4, took


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_whose_only_gateway_dies_after_the_send_ends_at_once(tmp_path, tiny_model_dir, kind):
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0) as c:
        out, took = call_and_kill(kind, c, ["gw-0"], retries=0)
        endpoint = c.endpoint("gw-0")
    assert [type(e) for e in out] == [TimeoutError], out
    assert str(out[0]) == f"gateway {endpoint} dropped the connection that took this request", out
    assert took < TIMEOUT_S / 4, took
