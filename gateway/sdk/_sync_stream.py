"""The blocking client's stream of one job: a socket of its own, resubscribed from the next undelivered index on
the next gateway when its gateway falls silent, fails, or drops the connection."""

from __future__ import annotations

import time
from collections.abc import Iterator
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
           deadline: float | None = None) -> Iterator[Chunk]:
    """``job``'s tokens from ``from_index``, on a socket of the stream's own (Job.stream, Job.result)."""
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
        to_result(st.done)  # a job that ended otherwise than done raises here, as result() does
    finally:
        if sock is not None:
            close_stream_socket(sock, watch)
