"""Python SDK: submit jobs to a gateway, stream their tokens, wait for results.

    client = GatewayClient(["tcp://gw-a:5555", "tcp://gw-b:5555"], api_key="...")  # or one endpoint
    job = client.submit(prompt="Hello", max_tokens=32, tier="P0")
    for chunk in job.stream():
        print(chunk.index, chunk.text, end="")
    result = job.result()            # waits as long as the job takes; result(timeout=30) bounds the wait
    same = client.job(job.id)        # re-attach by id, e.g. after a restart: stream/result/status/cancel

``AsyncGatewayClient`` has the same surface with ``await`` (and ``async for`` on ``job.stream()``); any
number of coroutines share one client and its one connection per gateway. Refusals raise typed errors:
``Unauthorized``, ``Forbidden``, ``InvalidRequest``, ``QuotaExceeded`` (``.retry_after_s``), ``Overloaded``
(``.estimated_wait_s``), ``NotFound``; ``Unavailable`` (the cluster's Redis is unreachable) and
``TimeoutError`` (no gateway answered) once the client's retries are spent; ``HandshakeFailed``, a
``TimeoutError`` told at once, when a gateway refuses the connection itself (``server_public_key`` missing,
wrong, or given for a gateway that does not encrypt). A job that ends without a
result raises ``JobFailed`` (``JobCancelled``, a subclass, if it was cancelled) or ``JobExpired`` from
``result()``, and at the end of ``stream()``: a stream
never ends quietly short of its tokens. Threads may share a ``GatewayClient`` (each gets its own
connections); an ``AsyncGatewayClient`` serves one running event loop at a time.

Liveness: while a job is queued the gateway sends a keepalive every few seconds, so ``timeout_s`` (the
longest silence accepted from a gateway, and the wait for an answer to one call) must exceed the gateway's
``keepalive_interval_s`` (2 s by default). A silent gateway is replaced by the next endpoint in the list
(at most ``retries`` times in a row; ``Unavailable`` is waited out with backoff for up to ``timeout_s``); a
stream resumes there from its next token index. Each ``submit()``
carries an idempotency key (the caller's, or one made for the call), so its retries admit the job once.

Importing this package does not import torch, transformers or redis.
"""

from common.errors import (Forbidden, HandshakeFailed, InvalidRequest, JobCancelled, JobExpired, JobFailed, NotFound,
                           Overloaded, QuotaExceeded, ServingError, Unauthorized, Unavailable)
from gateway.sdk._async import AsyncGatewayClient, AsyncJob
from gateway.sdk._common import SDK_TRACER
from gateway.sdk._results import Chunk, JobResult, JobStatus
from gateway.sdk._sync import GatewayClient, Job

__all__ = ["AsyncGatewayClient", "AsyncJob", "Chunk", "Forbidden", "GatewayClient", "HandshakeFailed",
           "InvalidRequest", "Job", "JobCancelled", "JobExpired", "JobFailed", "JobResult", "JobStatus", "NotFound",
           "Overloaded", "QuotaExceeded", "SDK_TRACER", "ServingError", "Unauthorized", "Unavailable"]
