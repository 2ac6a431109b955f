"""The blocking client's Job: its stream, result, status and cancel, through the GatewayClient that made it."""

from __future__ import annotations

import time
from collections.abc import Iterator

from gateway.sdk._common import JobBase
from gateway.sdk._results import Chunk, JobResult, JobStatus, to_result
from gateway.sdk._requests import wait_limit
from gateway.sdk._sync_stream import Chunks


class Job(JobBase):

    def stream(self, from_index: int = 0, timeout: float | None = None) -> Iterator[Chunk]:
        """Yield the job's tokens from ``from_index`` until it ends. ``timeout``: the longest wait between token
        chunks (None: as long as the job takes; keepalives tell a queued job from a dead gateway). A TimeoutError
        (or any exception) out of a wait does not end the stream: the next ``next()`` reads on from the next token.
        ``close()`` stops it at once."""
        return Chunks(self, from_index, timeout)

    def result(self, timeout: float | None = None) -> JobResult:
        """The job's result; ``timeout``: seconds to wait in all (None: as long as the job takes)."""
        if self._done is None:
            deadline = None if wait_limit(timeout) is None else time.monotonic() + timeout
            try:
                for _ in self._client._stream(self, 0, deadline=deadline):
                    pass
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"job {self.id} not done within {timeout}s") from None
                raise
        return to_result(self._done)

    def status(self) -> JobStatus:
        return self._client.status(self.id)

    def cancel(self, *, stop_at: int | None = None) -> bool:
        """As GatewayClient.cancel of this job."""
        return self._client.cancel(self.id, stop_at=stop_at)
