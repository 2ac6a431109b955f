"""A job's answer as server-sent events: OpenAI's chunks, keep-alives while the job has nothing to say, an error
event if it fails after the status line, then [DONE]."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request

from common.errors import ServingError
from gateway.http import errors, metrics
from gateway.http.errors import HttpError
from gateway.http.responses import DONE_EVENT, KEEPALIVE, Reply, finish_reason, keepalives_until
from gateway.http.stops import StopScan


async def next_chunk(chunks: AsyncIterator):
    """The stream's next chunk, None at its end: a coroutine, so that a task can wait for it across keep-alives."""
    return await anext(chunks, None)


async def events(request: Request, job, chunks: AsyncIterator, first: asyncio.Future, *, late: bool, reply: Reply,
                 include_usage: bool, keepalive_s: float, cancel: Callable[..., None],
                 release: Callable[[], None], stop: StopScan | None = None) -> AsyncIterator[bytes]:
    """The SSE body of ``job``: ``first`` is the task reading its first chunk (done unless ``late``: its status line
    did not wait for it). Every wait, for a chunk or for the result, sends KEEPALIVE each ``keepalive_s``. The client
    gone (this generator closed or cancelled before the end) cancels the job; ``release`` is called in any case.
    ``stop``: the request's stop strings; the text is theirs to release, and one found ends the answer (and the
    job there, by ``cancel(stop_at=...)``)."""
    count, done, step = 0, False, first
    clock = asyncio.get_running_loop().time
    sent = clock()  # when the client last got bytes
    try:
        if late:  # silent sse_keepalive_s already, headers and all
            yield KEEPALIVE
        if reply.chat:  # OpenAI's first chat chunk names the role
            yield reply.chunk("", role=True, with_usage_field=include_usage)
        while True:
            async for keepalive in keepalives_until(step, keepalive_s):
                yield keepalive
                sent = clock()
            chunk = step.result()
            if chunk is None:
                break
            if stop is None:
                count += len(chunk.token_ids)
                yield reply.chunk(chunk.text, with_usage_field=include_usage)
            else:
                if text := stop.feed(chunk.token_ids):
                    yield reply.chunk(text, with_usage_field=include_usage)
                    sent = clock()
                elif keepalive_s and clock() - sent >= keepalive_s:
                    # Chunks keep coming, so keepalives_until never fires, yet the text they bring is held back:
                    # without this the client (and a proxy's idle timeout) saw nothing for as long as that lasts.
                    yield KEEPALIVE
                    sent = clock()
                if stop.stopped:
                    break
            step = asyncio.ensure_future(next_chunk(chunks))
        if stop is not None and stop.stopped:
            done = True
            cancel(stop_at=stop.tokens)  # what it makes past the stop is nobody's: it ends there, done
            await chunks.aclose()  # and its gateway stops sending it (the SDK unsubscribes)
            finish = "stop"
        else:
            step = asyncio.ensure_future(job.result())  # the stream has ended: this reads what it left
            async for keepalive in keepalives_until(step, keepalive_s):
                yield keepalive
            result = step.result()
            done = True
            if stop is not None and (text := stop.flush()):
                yield reply.chunk(text, with_usage_field=include_usage)
            finish = finish_reason(result.finish_reason)
        yield reply.chunk(None if reply.chat else "", finish, with_usage_field=include_usage)
        if include_usage:
            yield reply.usage_chunk(count if stop is None else stop.tokens)
    except (ServingError, TimeoutError) as e:
        done = True
        if isinstance(e, TimeoutError):  # every gateway silent: the door gives it up, as a whole request's
            cancel()
        err = HttpError(504, "timeout_error", str(e), code="upstream_timeout") if isinstance(e, TimeoutError) \
            else errors.from_serving_error(e)  # (HandshakeFailed is a TimeoutError: the door's doing, not the caller's)
        metrics.STREAM_ERRORS.labels(request.scope["path"], err.code or err.type).inc()
        if stop is not None and not stop.stopped and (text := stop.flush()):
            # No token will complete a stop string now: what was held back is the answer's, as far as it went.
            yield reply.chunk(text, with_usage_field=include_usage)
        yield b"data: " + json.dumps(err.body()).encode() + b"\n\n"
    finally:
        step.cancel()  # a wait the client left (one done already ignores it)
        release()
        if not done:  # the client went away (or the server is stopping): nobody wants the rest
            metrics.DISCONNECTS.inc()
            cancel()
    yield DONE_EVENT
