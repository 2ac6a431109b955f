"""The ASGI application: OpenAI-compatible routes over the async SDK.

A request is authenticated by the gateway (the bearer token is the tenant's API key; a key
the door has not yet seen is checked before the body is read), its prompt tokenized here
(gateway/http/prompts.py), submitted as one job, and answered whole or as server-sent events.
Response headers are sent only once the job's first token (or its end) is known, so a job that
expires in the queue is a real 504, not a 200 with an error inside; a stream's, at the latest
after sse_keepalive_s, for it then sends keep-alives a proxy does not cut as idle. A client that goes away
cancels its job, which frees its KV blocks on the worker, unless it sent an `Idempotency-Key`
(gateway/http/idempotency.py): then it is coming back for the job, which runs on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.middleware import Middleware
from starlette.routing import Route

from common.errors import ServingError
from common.tiers import ALL_TIERS
from gateway.http import errors, health, idempotency, metrics, stops, streaming
from gateway.http.config import HttpConfig
from gateway.http.errors import HttpError
from gateway.http.headers import bearer, one_header, refuse_compressed
from gateway.http.prompts import Prompts
from gateway.http.responses import Reply
from gateway.http.schemas import ChatCompletionRequest, CompletionRequest
from gateway.http.submission import Submitter, no_gateway
from gateway.http.upstream import Upstream

log = logging.getLogger("gateway.http")

TOKENIZING_THREADS = 4


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class FrontDoor:
    def __init__(self, config: HttpConfig, prompts: Prompts, model: str, upstream: Upstream) -> None:
        self.config = config
        self.prompts = prompts
        self.model = model
        self.upstream = upstream
        self.submitter = Submitter(config, upstream)
        self.started = int(time.time())
        self._background: set[asyncio.Task] = set()  # cancellations in flight (a reference keeps them alive)
        # Threads of its own, so that tokenizing never waits behind /health's calls in the default executor.
        self._tokenizing = ThreadPoolExecutor(max_workers=TOKENIZING_THREADS, thread_name_prefix="tokenize")

    # -- routes ---------------------------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, chat=False)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.model, "object": "model", "created": self.started, "owned_by": "tiered-serve"}]})

    async def health(self, request: Request) -> Response:
        return await health.answer(request, self.config.health_api_key, self.upstream.endpoints, self.prompts)

    # -- one completion -------------------------------------------------------------------------------------------

    async def _serve(self, request: Request, schema: type[BaseModel], chat: bool) -> Response:
        try:
            key = bearer(request)
            if not key:
                raise HttpError(401, "authentication_error", "missing 'Authorization: Bearer <api key>'",
                                code="invalid_api_key")
            await self._authenticate(key)
            if (wrong := self.prompts.mismatch(self.upstream.tokenizer_digest(key))) is not None:
                raise wrong  # before the body is read: nothing is tokenized, stored or charged
            idem = idempotency.key_of(request)
            refuse_compressed(request)
            raw = await self._read_body(request)
            loop = asyncio.get_running_loop()
            # Off the event loop as the tokenizing below: a body of a million ids takes ~0.1 s to validate.
            body = await loop.run_in_executor(self._tokenizing, schema.model_validate_json, raw)
            if unhonoured := body.unhonoured():
                raise errors.invalid(unhonoured[1], unhonoured[0])
            tier = _tier(one_header(request, "X-Priority", "priority"), body.priority)
            if body.model is not None and body.model != self.model:
                raise HttpError(404, "invalid_request_error", f"the model {body.model!r} does not exist; this "
                                f"server serves {self.model!r}", param="model", code="model_not_found")
            # Off the event loop: a prompt of megabytes takes seconds to tokenize, and every other request waited.
            ids = await loop.run_in_executor(self._tokenizing, self._prompt_ids, body, chat)
            if await request.is_disconnected():  # gave up while it was tokenized: no job (nor quota) for nobody
                metrics.DISCONNECTS.inc()
                raise ClientGone
            prompt_param = "messages" if chat else "prompt"
            job, release = await self.submitter.submit(key, body, ids, tier, idem, prompt_param)
            return await self._answer(request, key, body, chat, ids, job, idem, prompt_param, release)
        except ValidationError as e:
            return _validation_error(e).response()
        except HttpError as e:
            return e.response()
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; says what happened in the access log

    def _prompt_ids(self, body, chat: bool) -> list[int]:
        if chat:
            ids = self.prompts.chat(body.messages, body.template_kwargs())
        else:
            ids = self.prompts.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        return ids[-body.truncate_prompt_tokens:] if body.truncate_prompt_tokens else ids

    async def _authenticate(self, key: str) -> None:
        """401 for a key no gateway knows, before the body is read: a stranger learns nothing of this server."""
        try:
            await self.upstream.check(key)
        except TimeoutError:
            raise no_gateway() from None
        except ServingError as e:  # Unauthorized; or Unavailable after the SDK waited out a Redis outage
            raise errors.from_serving_error(e) from None

    async def _read_body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.config.max_body_bytes:
            raise self._too_large()
        chunks, size = [], 0
        try:
            # One deadline for the whole body, not one per read: a client trickling a byte at a time is as slow.
            async with asyncio.timeout(self.config.body_timeout_s):
                async for part in request.stream():
                    size += len(part)
                    if size > self.config.max_body_bytes:
                        raise self._too_large()
                    chunks.append(part)
        except ClientDisconnect:
            raise ClientGone from None
        except TimeoutError:
            raise HttpError(408, "invalid_request_error", f"the request body did not arrive within "
                            f"{self.config.body_timeout_s}s of its headers (body_timeout_s)",
                            code="request_timeout") from None
        return b"".join(chunks)

    def _too_large(self) -> HttpError:
        # A code of its own (as Anthropic's request_too_large): it was null, the one refusal a client could not
        # tell by its code.
        return HttpError(413, "invalid_request_error", f"the request body is over {self.config.max_body_bytes} "
                         "bytes (max_body_bytes)", code="request_too_large")

    async def _answer(self, request: Request, key: str, body, chat: bool, ids: list[int], job, idem: str | None,
                      prompt_param: str, release: Callable[[], None]) -> Response:
        headers = {"X-Request-Id": job.id, "X-Tier": job.tier,
                   "X-Estimated-Wait-Seconds": f"{job.estimated_wait_s:.3f}"}
        if job.duplicate:
            headers[idempotency.REPLAYED] = "true"
        # A client that sent a key is coming back for its job (gateway/http/idempotency.py): it is not cancelled.
        # At a stop string (``stop_at``: the tokens its answer holds) the job ends done there rather than cancelled.
        cancel = ((lambda stop_at=None: None) if idem is not None
                  else (lambda stop_at=None: self._cancel_later(key, job.id, stop_at)))
        reply = Reply.for_job(chat, job.id, int(time.time()), self.model, len(ids))
        stop = stops.scan_for(body, self.prompts.tokenizer)
        streaming = False
        try:
            if body.stream:
                response = await self._stream(request, job, reply, headers, body.include_usage(), cancel, release,
                                              stop)
                streaming = True  # its events release the client once sent
                return response
            # No bound of its own on the wait: the job's tier bounds it (queue timeout), the SDK a gateway's silence.
            if stop is not None:
                answer = await self._until_disconnect(request, stops.until_stop(job, stop, cancel))
                return JSONResponse(reply.answer(*answer), headers=headers)
            result = await self._until_disconnect(request, job.result())
            return JSONResponse(reply.whole(result), headers=headers)
        except ClientGone:
            metrics.DISCONNECTS.inc()
            cancel()
            raise
        except TimeoutError:
            cancel()
            raise HttpError(504, "timeout_error", f"no gateway said anything of job {job.id} for "
                            f"{self.config.upstream_timeout_s}s", code="upstream_timeout", headers=headers) from None
        except ServingError as e:
            err = errors.from_serving_error(e, prompt_param)
            err.headers |= headers
            raise err from None
        finally:
            if not streaming:
                release()

    async def _stream(self, request: Request, job, reply: Reply, headers: dict[str, str], include_usage: bool,
                      cancel: Callable[..., None], release: Callable[[], None],
                      stop: stops.StopScan | None) -> Response:
        chunks = job.stream()  # as job.result() above: only a gateway's silence ends it early
        interval = self.config.sse_keepalive_s
        # The first chunk (or the job's end) decides the status line if it comes within sse_keepalive_s: a job that
        # expires or fails sooner has its real status. Past that the status line goes out (200) with keep-alives, lest
        # a proxy's idle timeout cut a stream that only waits its turn; an error is then an event, as mid-stream.
        first = asyncio.ensure_future(streaming.next_chunk(chunks))
        late = not await self._settled(request, first, interval or None)
        if not late and first.result() is None:
            await job.result()  # ended without a token: raises if it expired or failed (a real status line)

        body = streaming.events(request, job, chunks, first, late=late, reply=reply, include_usage=include_usage,
                                keepalive_s=interval, cancel=cancel, release=release, stop=stop)
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers=headers | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _until_disconnect(self, request: Request, work: Awaitable):
        """The result of ``work``, unless the client disconnects first (then ClientGone; ``work`` is cancelled)."""
        task = asyncio.ensure_future(work)
        await self._settled(request, task, None)
        return task.result()

    async def _settled(self, request: Request, task: asyncio.Future, timeout_s: float | None) -> bool:
        """Whether ``task`` is done within ``timeout_s`` (None: no bound; it is left running if not). ClientGone, and
        ``task`` cancelled, if the client disconnects first."""
        watch = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, watch}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone = watch.done()
            watch.cancel()
        if task.done():
            return True
        if gone:
            task.cancel()
            raise ClientGone
        return False

    def _cancel_later(self, key: str, job_id: str, stop_at: int | None = None) -> None:
        """Cancel a job from its own task: the caller may itself be in the middle of being cancelled."""
        async def cancel() -> None:
            try:
                async with self.upstream.client(key) as up:
                    await up.client.cancel(job_id, stop_at=stop_at)
            except (ServingError, TimeoutError) as e:
                log.warning("could not cancel job %s: %s", job_id, e)

        task = asyncio.get_running_loop().create_task(cancel())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _tier(header: str | None, priority: int | None) -> str | None:
    """The tier asked for (None: the tenant's highest); the gateway refuses one above the tenant's entitlement."""
    names = [t.value for t in ALL_TIERS]
    from_header = None
    if header is not None:
        from_header = header.strip().upper()
        if from_header not in names:
            raise errors.invalid(f"X-Priority must be one of {', '.join(names)}, not {header!r}", "priority")
    from_body = names[priority] if priority is not None else None
    if from_header and from_body and from_header != from_body:
        raise errors.invalid(f"X-Priority {from_header} and body priority {priority} disagree", "priority")
    return from_header or from_body


def _validation_error(e: ValidationError) -> HttpError:
    first = e.errors()[0] if e.errors() else {}
    # Less the tags pydantic puts in a union member's path ("str", "list[int]", "function-after[...]"); a field
    # whose name begins so ("stream") stays.
    loc = [str(p) for p in first.get("loc", ())
           if not (str(p) == "str" or str(p).startswith(("function-", "list[")))]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return errors.invalid(f"the body is not valid JSON: {first.get('msg')}", None)
    return errors.invalid(f"{param or 'body'}: {first.get('msg', 'invalid')}", param)


async def _route_error(request: Request, e: HTTPException) -> Response:
    """Starlette's own refusals (no such route, a method the route does not take) in OpenAI's error shape: they
    were plain text, the one answer of the door a client written for OpenAI could not read as an error object."""
    what = {404: "no such route", 405: "method not allowed"}.get(e.status_code, e.detail)
    return HttpError(e.status_code, "invalid_request_error", f"{what}: {request.method} {request.url.path}",
                     headers=dict(e.headers or {})).response()


async def _server_fault(request: Request, e: Exception) -> Response:
    """Whatever else escaped a route (a bug of the door's): still OpenAI's error shape, not Starlette's plain text.
    Starlette logs the traceback and re-raises once this is sent."""
    return HttpError(500, "server_error", f"the front door failed: {type(e).__name__}",
                     code="internal_error").response()


def create_app(config: HttpConfig, prompts: Prompts, model: str, upstream: Upstream | None = None) -> Starlette:
    upstream = upstream or Upstream(config.gateways, config.upstream_timeout_s, max_clients=config.max_clients,
                                    server_public_key=config.gateway_public_key)
    door = FrontDoor(config, prompts, model, upstream)
    routes = [
        Route("/v1/chat/completions", door.chat_completions, methods=["POST"]),
        Route("/v1/completions", door.completions, methods=["POST"]),
        Route("/v1/models", door.models, methods=["GET"]),
        Route("/health", door.health, methods=["GET"]),
        Route("/metrics", metrics.metrics_endpoint, methods=["GET"]),
    ]
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        upstream.close()
        door._tokenizing.shutdown(wait=False, cancel_futures=True)
        door.submitter.close()

    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _route_error, Exception: _server_fault},
                    middleware=[Middleware(metrics.MetricsMiddleware, routes={r.path for r in routes})])
    app.state.front_door = door
    return app
