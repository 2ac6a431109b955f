"""What SDK tests share: the SDK's warnings, and a stream that runs beside the calls a test makes on one client."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from gateway.sdk import AsyncGatewayClient, AsyncJob


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
async def stream_beside(client: AsyncGatewayClient, n: int, settle_s: float = 0.2):
    """A job of ``n`` tokens streamed on ``client``'s connection while the block makes other calls on it. Leaving
    the block waits for the stream to end (its error, if it failed) and fills in the job's result."""
    beside = Beside(await client.submit(prompt_token_ids=[5, 6, 7], max_tokens=n, ignore_eos=True, seed=3))
    task = asyncio.create_task(beside._read())
    await asyncio.sleep(settle_s)
    try:
        yield beside
    except BaseException:
        task.cancel()
        raise
    await asyncio.wait_for(task, 60)
    beside.result = (await beside.job.result()).token_ids
