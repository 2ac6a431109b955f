"""What SDK tests share: the SDK's warnings, a stream that runs beside the calls a test makes on one client, and a
gateway frozen in place."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import pytest

from common.errors import InvalidRequest

from gateway.sdk import AsyncGatewayClient, AsyncJob, GatewayClient
from tests.cluster_helpers import wait_for


class SdkWarnings(logging.Handler):
    """The SDK's warnings (a silent gateway, a failover)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> SdkWarnings:
        logging.getLogger("gateway.sdk").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("gateway.sdk").removeHandler(self)


@dataclass
class Beside:
    job: AsyncJob
    streamed: list[int] = field(default_factory=list)  # what its stream delivered
    result: list[int] | None = None  # the job's tokens, once the block is left

    async def _read(self) -> None:
        async for chunk in self.job.stream():
            self.streamed.extend(chunk.token_ids)


@contextlib.asynccontextmanager
async def stream_beside(client: AsyncGatewayClient, n: int, worker_pid: int):
    """A job of ``n`` tokens streamed on ``client``'s connection while the block makes other calls on it. Once it
    streams, the worker (``worker_pid``) stands still until the block is left: the tiny model ran a short job
    through before the block's first call, and a test of calls beside a stream passed beside none. Leaving the block
    checks the stream was still live, waits for it to end (its error, if it failed) and fills in the job's result."""
    beside = Beside(await client.submit(prompt_token_ids=[5, 6, 7], max_tokens=n, ignore_eos=True, seed=3))
    task = asyncio.create_task(beside._read())
    deadline = time.monotonic() + 60
    while not beside.streamed:
        assert not task.done() and time.monotonic() < deadline, "the job beside never streamed"
        await asyncio.sleep(0.005)
    os.kill(worker_pid, signal.SIGSTOP)
    try:
        assert len(beside.streamed) < n, f"the job beside streamed all {n} tokens before the worker stood still"
        yield beside
        live = not task.done()
    except BaseException:
        task.cancel()
        raise
    finally:
        os.kill(worker_pid, signal.SIGCONT)
    assert live, "the stream beside ended before the block's calls did: nothing ran beside it"
    await asyncio.wait_for(task, 60)
    beside.result = (await beside.job.result()).token_ids


async def refused_beside(client: AsyncGatewayClient, n: int, too_big: list[dict], odd: Callable[[], Awaitable],
                         then: Callable[[], Awaitable], worker_pid: int):
    """Each of ``too_big`` submitted, then ``odd()``, each refused with InvalidRequest, while a stream of ``n``
    tokens goes on beside them on the same client (its worker ``worker_pid`` held still meanwhile); then
    ``then()``. Returns ([(field, message, seconds to the refusal)], what ``then()`` gave, the Beside)."""
    refusals = []
    async with stream_beside(client, n, worker_pid) as beside:
        for kwargs in too_big:
            started = time.monotonic()
            with pytest.raises(InvalidRequest) as e:
                await client.submit(max_tokens=4, **kwargs)
            refusals.append((e.value.field, str(e.value), time.monotonic() - started))
        with pytest.raises(InvalidRequest) as e:
            await odd()
        refusals.append((e.value.field, str(e.value), 0.0))
        after = await then()
    return refusals, after, beside


def refused_blocking(endpoint: str, api_key: str, too_big: list[dict], limit: int) -> None:
    """The blocking client: each of ``too_big`` refused at once with the gateway's ``limit`` named, and a small
    submission still served."""
    with GatewayClient(endpoint, api_key, timeout_s=3, retries=1) as client:
        for kwargs in too_big:
            started = time.monotonic()
            with pytest.raises(InvalidRequest) as e:
                client.submit(max_tokens=4, **kwargs)
            assert str(limit) in str(e.value) and time.monotonic() - started < 2
        assert client.submit(prompt_token_ids=[1, 2], max_tokens=2).result(timeout=60).token_ids


def freeze(pid: int) -> None:
    """SIGSTOP ``pid``, and wait until every thread of it has stopped: from then on what reaches it stays unread."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        try:
            states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                      for task in Path(f"/proc/{pid}/task").iterdir()]
        except FileNotFoundError:  # a thread that ended meanwhile: look again
            return False
        return all(state in ("T", "t") for state in states)
    wait_for(stopped, 10, f"process {pid} to stop", interval=0.01)


def unread_bytes(endpoint: str) -> int:
    """Bytes the kernel holds for the listener at ``endpoint`` (tcp://host:port) on its connections, unread by it."""
    port = urlparse(endpoint.replace("tcp://", "http://")).port
    total = 0
    for table in (Path("/proc/net/tcp"), Path("/proc/net/tcp6")):
        for line in table.read_text().splitlines()[1:] if table.exists() else []:
            fields = line.split()
            local, state, queues = fields[1], fields[3], fields[4]
            if int(local.rsplit(":", 1)[1], 16) == port and state == "01":  # ESTABLISHED, the gateway's side
                total += int(queues.split(":")[1], 16)
    return total


def close_under_waiters(client: GatewayClient, calls, settle_s: float = 0.5, join_s: float = 40.0
                        ) -> tuple[list[type], float]:
    """Start each of ``calls`` in a thread of its own, let them reach their waits (``settle_s``), close ``client``
    from this thread: (the error types the calls ended with, in the order they ended; seconds from the close until
    every call had ended)."""
    import threading

    outcome: list[type] = []

    def wait(call) -> None:
        try:
            call()
        except Exception as e:  # noqa: BLE001 - the caller compares it
            outcome.append(type(e))

    waiters = [threading.Thread(target=wait, args=(call,), daemon=True) for call in calls]
    for w in waiters:
        w.start()
    time.sleep(settle_s)
    closed = time.monotonic()
    client.close()
    for w in waiters:
        w.join(join_s)
    return outcome, time.monotonic() - closed
