"""The asyncio client's job handle and its stream iterator (gateway.sdk._async.AsyncGatewayClient makes them)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator

from common.errors import JobExpired, JobFailed
from gateway.sdk._common import JobBase
from gateway.sdk._requests import wait_limit
from gateway.sdk._results import Chunk, JobResult, JobStatus, to_result


class AsyncJob(JobBase):

    def stream(self, from_index: int = 0, timeout: float | None = None) -> AsyncIterator[Chunk]:
        """As Job.stream, with ``async for``."""
        return _Chunks(self, from_index, timeout)

    async def result(self, timeout: float | None = None) -> JobResult:
        """As Job.result."""
        if self._done is None:
            deadline = None if wait_limit(timeout) is None else asyncio.get_running_loop().time() + timeout
            async for _ in self._client._stream(self, 0, deadline=deadline):
                pass
        return to_result(self._done)

    async def status(self) -> JobStatus:
        return await self._client.status(self.id)

    async def cancel(self, *, stop_at: int | None = None) -> bool:
        """As GatewayClient.cancel of this job."""
        return await self._client.cancel(self.id, stop_at=stop_at)


class _Chunks:
    """AsyncJob.stream's iterator. A wait for its next chunk that ends in an exception (asyncio.wait_for(anext(it),
    T) timing out, a stream(timeout=T) with no chunk in time) does not end it: the next wait subscribes again from
    the next index not delivered. An async generator ended for good there, and the same loop's next anext() ended
    the stream quietly, short of its tokens."""

    def __init__(self, job: AsyncJob, from_index: int, timeout: float | None) -> None:
        self._job, self._next, self._timeout = job, from_index, timeout
        self._chunks: AsyncGenerator[Chunk, None] | None = None
        self._ended = False

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> Chunk:
        if self._ended:
            raise StopAsyncIteration
        if self._chunks is None:
            self._chunks = self._job._client._stream(self._job, self._next, chunk_timeout=self._timeout)
        chunks = self._chunks
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            self._ended = True
            raise
        except (JobFailed, JobExpired):
            # The job's end (JobCancelled among them): raised once, as the blocking stream raises it; a call after
            # it is the stream's end, not another round trip to be told it again.
            self._ended, self._chunks = True, None
            raise
        except BaseException:
            if chunks.ag_frame is None and self._chunks is chunks:  # not a concurrent anext() refused
                self._chunks = None  # it ended, and left its subscription in its finally
            raise
        self._next = chunk.index + len(chunk.token_ids)
        return chunk

    async def aclose(self) -> None:
        """Stop reading: its gateway is told now, not when the garbage collector gets to the stream."""
        self._ended = True
        if self._chunks is not None:
            chunks, self._chunks = self._chunks, None
            await chunks.aclose()
