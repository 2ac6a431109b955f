"""One request's job, submitted: sized by the gateway's limits where the client set no max_tokens
(gateway/http/sizing.py), its prompt judged by the room the serving workers leave, and the client it streams
through held until the answer is sent (gateway/http/upstream.py). What the gateway refuses comes back as the
door's HttpError (gateway/http/errors.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from common import protocol as P
from common.errors import InvalidRequest, ServingError, Unauthorized
from gateway.http import errors, sizing
from gateway.http.config import HttpConfig
from gateway.http.errors import HttpError
from gateway.http.upstream import Upstream
from gateway.sdk import AsyncGatewayClient, AsyncJob

# Prompt ids past which a submission leaves the event loop (_submit_in_thread): the SDK's check of 32768 ids takes
# ~20 ms, a pause the door's other requests do not notice; a blocking client's own connection costs about as much.
LOOP_SUBMIT_MAX_IDS = 2**15
SUBMITTING_THREADS = 2


def no_gateway() -> HttpError:
    return HttpError(503, "overloaded_error", "no gateway answered", code="gateway_unavailable",
                     headers={"Retry-After": "1"})


class Submitter:
    def __init__(self, config: HttpConfig, upstream: Upstream) -> None:
        self.config = config
        self.upstream = upstream
        self._submitting = ThreadPoolExecutor(max_workers=SUBMITTING_THREADS, thread_name_prefix="submit")

    async def submit(self, key: str, body, ids: list[int], tier: str | None, idem: str | None,
                     prompt_param: str) -> tuple[AsyncJob, Callable[[], None]]:
        """The job, submitted with the client's max_tokens or, without one, the default that fits
        (sizing.max_tokens_for), and the release of its client (_submit_once)."""
        asked = body.requested_max_tokens()
        try:
            # Also with max_tokens sent: a prompt the room cannot hold is refused here, not by a gateway after the
            # SDK has checked each of its ids on the event loop (a second for a million, nobody else served).
            try:
                fitted = await self._default_max_tokens(key, body, ids, tier, prompt_param, sizing.LIMITS_MAX_AGE_S)
            except HttpError:  # no room by the limits held: by the gateway's of now, before refusing the prompt
                try:
                    fitted = await self._default_max_tokens(key, body, ids, tier, prompt_param, 0.0)
                except HttpError as no_room:
                    return await self._past_serving_limits(key, body, ids, tier, asked, idem, no_room)
            max_tokens = asked if asked is not None else fitted
            try:
                return await self._submit_once(key, body, ids, tier, max_tokens, idem, defaulted=asked is None)
            except InvalidRequest as e:
                if asked is not None or e.field != "max_tokens":
                    raise
                # The limits held had moved (a worker left, or began draining): the gateway's limits of now, once.
                again = await self._default_max_tokens(key, body, ids, tier, prompt_param, 0.0)
                if again >= max_tokens:
                    raise
                return await self._submit_once(key, body, ids, tier, again, idem, defaulted=True)
        except Unauthorized as e:
            self.upstream.forget(key)
            raise errors.from_serving_error(e) from None
        except TimeoutError:  # HandshakeFailed too: the door's settings for the gateways, not the caller's doing
            raise no_gateway() from None
        except ServingError as e:
            raise errors.from_serving_error(e, prompt_param, body.max_tokens_param()) from None

    async def _past_serving_limits(self, key: str, body, ids: list[int], tier: str | None, asked: int | None,
                                   idem: str | None, no_room: HttpError):
        """A prompt the workers serving now leave no room for: the gateway judges it, for it also knows the workers
        a redeploy is bringing back (draining, or drained lately: gateway/drained.py), and answers overloaded
        (a 503 with Retry-After) where one of them fits it; ``no_room`` where none does. Refused here at once past
        the ids a request may carry, which no frame carries (tests/test_http_faults.py)."""
        if len(ids) > P.MAX_LIST_LEN:
            raise no_room
        cap = body.default_max_tokens(self.config.default_max_tokens)
        limit = (await self.upstream.info(key, sizing.LIMITS_MAX_AGE_S)).max_tokens_limit or cap
        try:
            # The door's default, not the room, which only the gateway knows: a job admitted meanwhile (the worker
            # is back) gets the max_tokens it would have got; one the room is smaller than is refused, as before.
            return await self._submit_once(key, body, ids, tier, asked if asked is not None else min(cap, limit),
                                           idem, defaulted=asked is None)
        except InvalidRequest as e:
            # TierLimitExceeded names max_tokens: past every worker the gateway knows. Past the model's context it
            # names the prompt, in words that give the door's max_tokens: the client that sent none is told of its
            # prompt alone, as the limits held would have told it.
            if e.field != "max_tokens" and not (asked is None and e.field == "prompt"):
                raise
            raise no_room from None

    async def _submit_once(self, key: str, body, ids: list[int], tier: str | None, max_tokens: int,
                           idem: str | None, defaulted: bool):
        """The job, and the release of its client: the door keeps that client (the job streams through it) until
        the answer is sent. Held only once the job exists, so a key refused meanwhile is forgotten (submit).
        ``defaulted``: max_tokens is the door's, not the client's; a retry under the same Idempotency-Key may size
        another by the limits of then, and is the same request all the same (gateway/admission.fingerprint)."""
        args = dict(prompt_token_ids=ids, max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                    top_k=body.top_k_or_none(), seed=body.worker_seed(), tier=tier, ignore_eos=body.ignore_eos,
                    idempotency_key=idem, max_tokens_defaulted=defaulted, stop_token_ids=body.stop_token_ids or [],
                    min_tokens=body.min_tokens, presence_penalty=body.presence_penalty,
                    frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty)
        # The async SDK multiplexes concurrent calls on one connection: a tenant's requests do not queue here.
        async with self.upstream.client(key) as up:
            if len(ids) <= LOOP_SUBMIT_MAX_IDS:
                job = await up.client.submit(**args)
            else:
                job = await self._submit_in_thread(key, up.client, args)
            return job, self.upstream.hold(key)[1]

    async def _submit_in_thread(self, key: str, client: AsyncGatewayClient, args: dict) -> AsyncJob:
        """As ``client.submit(**args)``, through a blocking client of the same key on a thread of its own: the SDK
        checks each prompt id before it sends (~0.7 s for the 1,048,576 a request may carry), and on the event
        loop every other request of the door stood still meanwhile. The job then streams through ``client``."""
        def submit():
            with self.upstream.blocking_client(key) as blocking:
                return blocking.submit(**args)

        job = await asyncio.get_running_loop().run_in_executor(self._submitting, submit)
        return AsyncJob(client, job.id, job.tier, job.estimated_wait_s, job.duplicate, job.downgraded)

    def close(self) -> None:
        self._submitting.shutdown(wait=False, cancel_futures=True)

    async def _default_max_tokens(self, key: str, body, ids: list[int], tier: str | None, prompt_param: str,
                                  max_age_s: float) -> int:
        info = await self.upstream.info(key, max_age_s)
        return sizing.max_tokens_for(body.default_max_tokens(self.config.default_max_tokens), len(ids), tier,
                                     info.tier_token_limits, info.max_tokens_limit, prompt_param)
