"""A gateway taking smaller frames than the one a client asked: the same endpoint restarted with a smaller
client_max_message_bytes, or the next gateway a call fails over to.

The SDK remembers, per gateway endpoint, the largest frame size the gateway said it takes (gateway/sdk/_frames.py,
FrameSizes.taken). It remembered it for the client's whole life: the restarted gateway behind the same endpoint took
less, but a frame under the remembered size went unasked; its ZeroMQ dropped the connection (ZMQ_MAXMSGSIZE) and the
call ended with a TimeoutError after every retry, not the InvalidRequest naming the limit that a new client gets at
once. And a call asked only the gateway it started on: failed over, it sent its frame to the next one unasked, with
the same end. Now a dropped connection voids what its gateway said, and every attempt asks the gateway it goes to.

Each test runs with the blocking and the asyncio client. Real processes: redis-server, gateways (restarted, frozen),
a worker; the tiny model.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from contextlib import contextmanager

import pytest

from common.errors import InvalidRequest, NotFound
from gateway.sdk import AsyncGatewayClient, GatewayClient
from tests.durable_cluster import DurableCluster

pytestmark = pytest.mark.faults

SMALL = 4096
KINDS = ["blocking", "asyncio"]


class _AsyncCalls:
    """An AsyncGatewayClient's calls made from blocking test code, all on one event loop (the client's
    connections belong to it), which runs only while a call does: what the connections saw meanwhile waits."""

    def __init__(self, endpoints: list[str], key: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = AsyncGatewayClient(endpoints, key, timeout_s=3.0)

    def cancel(self, job_id: str) -> bool:
        return self._loop.run_until_complete(self._client.cancel(job_id))

    def tokens(self, prompt_token_ids: list[int]) -> list[int]:
        async def run():
            job = await self._client.submit(prompt_token_ids=prompt_token_ids, max_tokens=2)
            return (await job.result(timeout=60)).token_ids
        return self._loop.run_until_complete(run())

    def close(self) -> None:
        self._client.close()

        async def readers_ended():  # close() cancelled each connection's reader: let them end before the loop
            await asyncio.gather(*(asyncio.all_tasks() - {asyncio.current_task()}), return_exceptions=True)
        self._loop.run_until_complete(readers_ended())
        self._loop.close()


class _BlockingCalls:
    def __init__(self, endpoints: list[str], key: str) -> None:
        self._client = GatewayClient(endpoints, key, timeout_s=3.0)
        self.cancel = self._client.cancel

    def tokens(self, prompt_token_ids: list[int]) -> list[int]:
        return self._client.submit(prompt_token_ids=prompt_token_ids, max_tokens=2).result(timeout=60).token_ids

    def close(self) -> None:
        self._client.close()


@contextmanager
def calls(kind: str, c: DurableCluster, gateways: list[str]):
    client = (_BlockingCalls if kind == "blocking" else _AsyncCalls)([c.endpoint(g) for g in gateways],
                                                                     c.key("lab-co"))
    try:
        yield client
    finally:
        client.close()


def restart_smaller_and_refuse(c: DurableCluster, lab) -> None:
    """gw-0 restarted with a SMALL limit; a frame under what the old gateway took, over what this one takes, is
    refused by size at once (within one timeout_s), not met by silence."""
    c.kill("gw-0")
    c.process_env["gw-0"] = {"TS_GATEWAY_CLIENT_MAX_MESSAGE_BYTES": str(SMALL)}
    c.restart("gw-0")
    c.wait_workers("gw-0")
    started = time.monotonic()
    with pytest.raises(InvalidRequest) as e:
        lab.cancel("j" * 8_000)
    assert str(SMALL) in str(e.value) and time.monotonic() - started < 3.0, e.value


@pytest.mark.parametrize("kind", KINDS)
def test_a_gateway_restarted_with_a_smaller_frame_limit_refuses_by_size_not_by_silence(tmp_path, tiny_model_dir,
                                                                                       kind):
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, lease_s=30.0) as c:
        with calls(kind, c, ["gw-0"]) as lab:
            # Asked about (20 kB: over 16 KiB), taken by the gateway's 8 MiB default, then found to name no job.
            with pytest.raises(NotFound):
                lab.cancel("j" * 20_000)
            restart_smaller_and_refuse(c, lab)
            # The connection (and whatever else it carries) survived the refusal.
            assert lab.tokens([1, 2])


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_failed_over_to_a_gateway_taking_smaller_frames_is_refused_by_size(tmp_path, tiny_model_dir, kind):
    """The gateway the call starts on is dead (its connection dropped): asked again, it is silent, and the question
    fails over to the next gateway, which takes less."""
    env = {"gw-1": {"TS_GATEWAY_CLIENT_MAX_MESSAGE_BYTES": str(SMALL)}}
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=1, lease_s=30.0, process_env=env) as c:
        with calls(kind, c, ["gw-0", "gw-1"]) as lab:
            with pytest.raises(NotFound):
                lab.cancel("j" * 20_000)  # gw-0 (8 MiB) was asked about 20 kB and took it
            c.kill("gw-0")
            started = time.monotonic()
            with pytest.raises(InvalidRequest) as e:
                lab.cancel("j" * 8_000)  # gw-0 silent: failed over to gw-1, which takes 4 KiB
            assert str(SMALL) in str(e.value) and time.monotonic() - started < 10.0, e.value


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_failed_over_from_a_frozen_gateway_asks_the_next_before_sending(tmp_path, tiny_model_dir, kind):
    """The gateway the call starts on is frozen, its connection up: nothing voids what it said, the frame goes to
    it unasked and meets silence. The attempt on the next gateway asks it first, and is refused by size at once,
    not after a second silence."""
    env = {"gw-1": {"TS_GATEWAY_CLIENT_MAX_MESSAGE_BYTES": str(SMALL)}}
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=1, lease_s=30.0, process_env=env) as c:
        with calls(kind, c, ["gw-0", "gw-1"]) as lab:
            with pytest.raises(NotFound):
                lab.cancel("j" * 20_000)
            os.kill(c.procs["gw-0"].pid, signal.SIGSTOP)
            try:
                started = time.monotonic()
                with pytest.raises(InvalidRequest) as e:
                    lab.cancel("j" * 8_000)  # one timeout (3 s) on gw-0, then asked of gw-1 and refused
                took = time.monotonic() - started
            finally:
                os.kill(c.procs["gw-0"].pid, signal.SIGCONT)
            assert str(SMALL) in str(e.value) and 3.0 <= took < 5.5, (took, e.value)


def test_a_thread_new_to_a_restarted_gateway_is_refused_by_size_not_by_silence(tmp_path, tiny_model_dir):
    """The blocking client's threads each have their own connection, and share what gateways said of frame sizes.
    A thread that asked and then ended saw nothing of the restart after it; a thread that connects to the restarted
    gateway sees no drop before sending, and its frame (under what the old gateway took) goes unasked. The connection
    dropped right after it voids what the old gateway said: the retry asks first and is refused by size."""
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, lease_s=30.0) as c:
        with GatewayClient(c.endpoint("gw-0"), c.key("lab-co"), timeout_s=3.0) as lab:
            asked: list[Exception] = []

            def ask_and_end() -> None:
                try:
                    lab.cancel("j" * 20_000)
                except Exception as e:  # noqa: BLE001 - checked below, in the test's thread
                    asked.append(e)

            thread = threading.Thread(target=ask_and_end)
            thread.start()
            thread.join(timeout=30)
            assert not thread.is_alive() and [type(e) for e in asked] == [NotFound], asked
            restart_smaller_and_refuse(c, lab)
            assert lab.submit(prompt_token_ids=[1, 2], max_tokens=2).result(timeout=60).token_ids
