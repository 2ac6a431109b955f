"""A stream whose gateway's connection drops resubscribes at once, from the next token it has not delivered, rather
than wait out its silence timeout (timeout_s) for frames that can no longer come: the gateway sends a stream's
frames on the connection its subscription came on, and a reconnected client is a new one to it.

Before, both clients took a killed gateway for silent only after timeout_s without a frame, and a gateway restarted
on the same port (ZeroMQ reconnects to it out of sight, with no subscription there) the same.

Real processes (tests/durable_cluster.py: redis-server, two gateways, one worker with the tiny model); the stream's
gateway is frozen (SIGSTOP) until what the worker sends it sits unread, then killed (SIGKILL), and in the second case
started again on the same port.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

import pytest

from gateway.sdk import AsyncGatewayClient, GatewayClient
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.sdk_helpers import SdkWarnings, freeze, unread_bytes

pytestmark = pytest.mark.faults

TIMEOUT_S = 20.0  # the clients' silence timeout: what a stream waited out before
RESUME_S = 5.0
N = 400
KINDS = ["blocking", "asyncio"]


class TimedWarnings(SdkWarnings):
    """The SDK's warnings, with when each came (time.monotonic())."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        self.times.append(time.monotonic())


@dataclass
class Run:
    chunks: list[tuple[int, list[int], float]] = field(default_factory=list)  # (index, tokens, when it came)
    killed: float = 0.0
    back: float | None = None  # when gw-0, started again, first answered (restart only)
    result: list[int] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)

    @property
    def streamed(self) -> list[int]:
        return [t for _, ids, _ in self.chunks for t in ids]


def kill_mid_stream(c: DurableCluster, run: Run, restart: bool) -> None:
    """Once the stream delivered a chunk (it is reading gw-0): freeze gw-0 until the worker's frames to it sit
    unread, kill -9 it, and start it again on the same port if ``restart``."""
    wait_for(lambda: run.chunks or run.errors, 120, "the stream's first chunk", interval=0.01)
    freeze(c.procs["gw-0"].pid)
    wait_for(lambda: unread_bytes(c.gateways["gw-0"][1]) > 0, 10, "frames from the worker to reach gw-0",
             interval=0.01)
    run.killed = time.monotonic()  # before: the stream may see the drop before kill() has reaped the process
    c.kill("gw-0")
    if restart:
        c.restart("gw-0")
        run.back = answering(c, "gw-0")


def answering(c: DurableCluster, gw: str) -> float:
    """When ``gw`` first answered a call, polled from now on."""
    with GatewayClient(c.endpoint(gw), c.key("lab-co"), timeout_s=1.0, retries=0) as probe:
        def answers() -> bool:
            try:
                probe.info()
            except TimeoutError:
                return False
            return True
        wait_for(answers, 60, f"{gw} to answer again", interval=0.05)
    return time.monotonic()


def stream_through_a_kill(kind: str, c: DurableCluster, gateways: list[str], restart: bool) -> Run:
    endpoints = [c.endpoint(g) for g in gateways]
    run = Run()
    if kind == "blocking":
        with GatewayClient(endpoints, c.key("lab-co"), timeout_s=TIMEOUT_S, retries=2) as client:
            job = client.submit(prompt_token_ids=[3, 1, 4], max_tokens=N, ignore_eos=True, seed=7)

            def read() -> None:
                try:
                    for chunk in job.stream():
                        run.chunks.append((chunk.index, chunk.token_ids, time.monotonic()))
                except BaseException as e:  # noqa: BLE001 - checked in the test's thread
                    run.errors.append(e)

            t = threading.Thread(target=read)
            t.start()
            kill_mid_stream(c, run, restart)
            t.join(120)
            assert not t.is_alive(), "the stream never ended"
            run.result = job.result(timeout=60).token_ids
        return run

    async def main() -> Run:
        client = AsyncGatewayClient(endpoints, c.key("lab-co"), timeout_s=TIMEOUT_S, retries=2)
        try:
            job = await client.submit(prompt_token_ids=[3, 1, 4], max_tokens=N, ignore_eos=True, seed=7)

            async def read() -> None:
                try:
                    async for chunk in job.stream():
                        run.chunks.append((chunk.index, chunk.token_ids, time.monotonic()))
                except BaseException as e:  # noqa: BLE001 - checked in the test's thread
                    run.errors.append(e)

            task = asyncio.create_task(read())
            killing = asyncio.create_task(asyncio.to_thread(kill_mid_stream, c, run, restart))
            done, _ = await asyncio.wait([task], timeout=120)
            await killing
            assert done, "the stream never ended"
            run.result = (await job.result(timeout=60)).token_ids
            return run
        finally:
            client.close()

    return asyncio.run(main())


def check(run: Run, warnings: TimedWarnings, resumed_on: str) -> None:
    assert run.errors == [], run.errors
    assert len(run.result) == N
    assert run.streamed == run.result  # nothing lost, nothing repeated
    assert [i for i, _, _ in run.chunks] == [sum(len(ids) for _, ids, _ in run.chunks[:k])
                                             for k in range(len(run.chunks))]
    # The kill landed mid-stream: the stream had to resubscribe for the rest.
    assert warnings.messages, "the stream never resubscribed"
    assert warnings.messages[0].endswith(f"trying {resumed_on}"), warnings.messages
    resumed = warnings.times[0] - run.killed
    assert 0 <= resumed < RESUME_S, (resumed, warnings.messages)
    # Tokens came at once from where it resubscribed (a gateway started again: once it answers).
    after = [when for _, _, when in run.chunks if when > warnings.times[0]]
    assert after, "no token came after the resubscription"
    assert after[0] - (run.killed if run.back is None else run.back) < RESUME_S, (after[0], run.killed, run.back)


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_whose_gateway_is_killed_resumes_on_the_next_at_once(tmp_path, tiny_model_dir, kind):
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=1) as c, TimedWarnings() as warnings:
        run = stream_through_a_kill(kind, c, ["gw-0", "gw-1"], restart=False)
        other = c.endpoint("gw-1")
    check(run, warnings, other)
    assert len(warnings.messages) == 1, warnings.messages


@pytest.mark.parametrize("kind", KINDS)
def test_a_stream_whose_gateway_restarts_on_its_port_resumes_there_losing_and_repeating_nothing(tmp_path,
                                                                                                  tiny_model_dir, kind):
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=1) as c, TimedWarnings() as warnings:
        run = stream_through_a_kill(kind, c, ["gw-0"], restart=True)
    check(run, warnings, "it again")
    # Resubscribed on the drop; perhaps once more, on a second drop: the new connection can reach the killed
    # gateway's listening socket before its exit closes it (the kernel takes the connection, then resets it).
    # Never on silence.
    assert 1 <= len(warnings.messages) <= 2, warnings.messages
    assert all("dropped the connection of the stream" in m and t - run.killed < RESUME_S
               for m, t in zip(warnings.messages, warnings.times)), warnings.messages
