"""The blocking client's stream of one job: a socket of its own, resubscribed from the next undelivered index on
the next gateway when its gateway falls silent, fails, or drops the connection; and the iterator Job.stream returns,
which subscribes again after a wait that ended in an exception."""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import TYPE_CHECKING

import zmq

from common import protocol as P
from gateway.sdk._drops import DROPPED, failure as failure_of
from gateway.sdk._results import Chunk, to_result
from gateway.sdk._retry import RETRYABLE
from gateway.sdk._stream_state import StreamState
from gateway.sdk._sync_sockets import close_stream_socket, closed_under, stream_frame

if TYPE_CHECKING:
    from gateway.sdk._sync import GatewayClient, Job


def stream(client: GatewayClient, job: Job, from_index: int, *, chunk_timeout: float | None = None,
           deadline: float | None = None) -> Generator[Chunk, None, P.JobDone]:
    """``job``'s tokens from ``from_index``, on a socket of the stream's own (Job.stream, Job.result); returns the
    job's final frame (its caller raises the error of a job that did not end done)."""
    st = StreamState(job.id, client.api_key, from_index, liveness_s=client.timeout_s, retries=client.retries,
                     chunk_timeout=chunk_timeout, deadline=deadline)
    sock, watch, at, closes = None, None, client.endpoint, client._closes
    try:
        while st.done is None:
            failure = None
            if sock is None:
                at, watches = client.endpoint, {}
                sock = client._new_socket(at, closes, watches)
                watch = watches[at]
                try:
                    sock.send(P.encode(st.request()))
                except zmq.Again:
                    failure = failure_of(watch, at, "took no stream request")
            if failure is None:
                frame = closed_under(sock, lambda: stream_frame(sock, watch, st.wait_s()), job.id, watch)
                if frame is DROPPED:
                    # The gateway sends a stream's frames on the connection its subscription came on: once that
                    # drops (the gateway died, or restarted on its port), none can come. Resubscribe now, from
                    # the next index not delivered, rather than wait out timeout_s of silence.
                    failure = failure_of(watch, at, f"dropped the connection of the stream of job {job.id}")
                elif frame is None:
                    if st.on_silence():
                        close_stream_socket(sock, watch)
                        sock = None
                        client._fail_over(
                        TimeoutError(f"silent for {client.timeout_s}s while streaming job {job.id}"), at)
                    continue
                else:
                    try:
                        chunk = st.on_frame(P.decode(frame))
                    except RETRYABLE as e:
                        failure = e
                    else:
                        if chunk is not None:
                            yield chunk
                        continue
            pause = st.on_failure(failure)
            close_stream_socket(sock, watch)
            sock = None
            time.sleep(pause)
            client._fail_over(failure, at)
        job._done = st.done
        return st.done
    finally:
        if sock is not None:
            close_stream_socket(sock, watch)


class Chunks:
    """Job.stream's iterator. A wait for its next chunk that ends in an exception (its own ``timeout`` passing with
    no chunk, a KeyboardInterrupt the caller survives) does not end it: the next call subscribes again from the next
    index not delivered. A generator ended for good there, and a heartbeat loop that caught the TimeoutError got
    StopIteration from its next call: the stream ended quietly, short of its tokens."""

    def __init__(self, job: Job, from_index: int, timeout: float | None) -> None:
        self._job, self._next, self._timeout = job, from_index, timeout
        self._chunks: Generator[Chunk, None, P.JobDone] | None = None
        self._ended = False

    def __iter__(self) -> Chunks:
        return self

    def __next__(self) -> Chunk:
        if self._ended:
            raise StopIteration
        if self._chunks is None:
            self._chunks = self._job._client._stream(self._job, self._next, chunk_timeout=self._timeout)
        chunks = self._chunks
        try:
            chunk = next(chunks)
        except StopIteration as end:
            done = end.value
        except BaseException:
            # A frame left: this was a next() refused (ValueError) while another thread's next() runs the generator.
            if chunks.gi_frame is None and self._chunks is chunks:
                self._chunks = None  # it ended, and closed its socket in its finally
            raise
        else:
            self._next = chunk.index + len(chunk.token_ids)
            return chunk
        # The real end: the error of a job that ended otherwise than done is raised once, as a generator raised it;
        # a call after it, like one after the last token of a job done, is StopIteration.
        self._ended, self._chunks = True, None
        to_result(done)
        raise StopIteration

    def close(self) -> None:
        """Stop reading: the stream's socket closes now (the gateway drops its subscription at the first frame it
        cannot deliver), not when the garbage collector gets to the iterator."""
        if self._chunks is not None:
            self._chunks.close()  # ValueError while another thread's next() runs it, as a generator's close() was
        self._ended, self._chunks = True, None
