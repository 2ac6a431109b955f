"""Client requests: submit (admission into Redis), status, info and cancel.

A mixin of gateway.server.Gateway: it uses the gateway's queue, tenants, sockets and counters.
"""

from __future__ import annotations

import logging
import random
import uuid

import msgpack

from common import protocol as P
from common import tracing
from common.errors import Forbidden, InvalidRequest, Unauthorized
from common.tiers import Tier
from gateway import admission, metrics, promises, sampling_extras, security
from gateway.redis_queue import (Admitted, IdempotencyMismatch, Overloaded, QuotaRefused, QuotaSpec,
                                 StoreFull, TenantFull, Withdrawn)
from gateway.spans import GatewaySpans

log = logging.getLogger("gateway")
REDIS_FULL_LOG_EVERY_S = 60.0  # a full Redis refuses every submission: say so once a minute, not each time


class ClientApi:
    """Handlers of SubmitRequest, StatusRequest and InfoRequest (CancelRequest: gateway.client_cancel)."""

    def on_submit(self, ident: bytes, req: P.SubmitRequest) -> None:
        with self.spans.admission(req) as span:
            reply = self._admit(req, span)
            if isinstance(reply, P.ErrorReply):
                GatewaySpans.refused(span, reply.code, reply.message)
                metrics.refused(reply.code)
        self._send(self.clients, ident, reply)

    def _admit(self, req: P.SubmitRequest, span) -> P.SubmitReply | P.ErrorReply:
        max_len = self.workers.max_model_len() or self.config.max_model_len
        tokenize = security.bounded_tokenize(self.tokenizer, max_len) if self.tokenizer is not None else None
        try:
            adm = admission.check(req, self.tenants, tokenize=tokenize, vocab_size=self.workers.vocab_size(),
                                  max_model_len=max_len,
                                  max_tokens_limit=self.config.max_tokens_limit,
                                  tier_max_tokens=self.workers.tier_max_tokens,
                                  returning_max_tokens=self.workers.returning_max_tokens,
                                  extras_served=self.workers.all_take_sampling_extras())
        except (admission.BeyondWorkers, admission.FitsNoWorker) as e:  # judged by the workers there are now
            if (replay := self._replay(req, e.admission)) is not None:
                return replay
            return self._error_for(e)
        except (Unauthorized, Forbidden, InvalidRequest) as e:
            return self._error_for(e)
        except admission.OnlyDraining as e:  # fits only a worker a redeploy is restarting: nothing stored or charged
            if (replay := self._replay(req, e.admission)) is not None:
                return replay
            self.counters["refused_overloaded"] += 1
            return P.ErrorReply("overloaded", str(e), estimated_wait_s=e.estimated_wait_s)
        now = self.clock()
        job_id = uuid.uuid4().hex
        t = adm.tenant
        span.set_attributes(tracing.request_attributes(job_id, adm.tier_requested.value, t.name))
        # A P0 the quota would downgrade must fit P1's share of the workers' KV cache too (admission checked it as a
        # P0, which may also use the P0 reserve): admitted as a P1 past it, it failed on the worker, though it was
        # runnable as the P0 it asked to be. Such a job is refused with a retry-after instead, as the quota is.
        p1_limit = self.workers.tier_max_tokens(Tier.P1.value)
        on_exhausted = ("refuse" if p1_limit is not None and len(adm.prompt_token_ids) + req.max_tokens > p1_limit
                        else t.on_quota_exhausted)
        quota = (QuotaSpec(t.p0_rate_per_s, t.p0_burst, on_exhausted)
                 if adm.tier_requested is Tier.P0 and t.p0_rate_per_s else None)
        # The job's later spans (queue, dispatch, worker) are children of this admission span.
        parent = tracing.carrier()
        payload = msgpack.packb({
            "prompt_token_ids": adm.prompt_token_ids, "max_tokens": req.max_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "top_k": req.top_k,
            "seed": req.seed if req.seed is not None else random.getrandbits(63),
            "trace_context": parent, "ignore_eos": req.ignore_eos,
            # Only when asked for: the payloads of every other job stay as an older gateway stores them.
            **sampling_extras.asked(req),
        })
        # A P0 the quota may downgrade is shed, and told its wait, as the P1 it becomes: the P0 wait counts none of
        # the P1 queue. Estimated first, so the estimate dump holds the P0's (as the job was asked for).
        # On workers of different sizes, only the slots of those the job fits serve it.
        tokens = len(adm.prompt_token_ids) + req.max_tokens
        downgrade = (self.estimator.for_new(t.name, Tier.P1, now, tokens)
                     if quota is not None and quota.on_exhausted == "downgrade" else None)
        estimate = self.estimator.for_new(t.name, adm.tier_requested, now, tokens)
        # No worker known, no capacity behind the estimate: nothing to promise on.
        promise = promises.promise_s(adm.tier_requested, estimate if self.workers.workers else None,
                                     self.config.promise_factor, self.config.promise_lead_s,
                                     self.promise_tiers)
        drain_rates = self.drain_rates(now)

        def admit(fingerprint: str | None):
            return self.queue.admit(job_id=job_id, tenant=t.name, tier_requested=adm.tier_requested,
                                    tier=adm.tier_requested, payload=payload,
                                    idempotency_key=req.idempotency_key, quota=quota,
                                    drain_rate_per_s=drain_rates, estimate_s=estimate, promise_s=promise,
                                    fingerprint=fingerprint, downgrade_estimate_s=downgrade,
                                    key_ttl_s=self._retry_key_ttl_s() if req.retry_key else None)

        fingerprint = admission.fingerprint(req, adm) if req.idempotency_key else None
        result = admit(fingerprint)
        # A key the release before stored, with its fingerprint of the same request (a mismatch changed nothing).
        before = admission.fingerprint_before(req, adm) if isinstance(result, IdempotencyMismatch) else fingerprint
        if before != fingerprint:
            result = admit(before)
        if isinstance(result, (IdempotencyMismatch, Withdrawn)):
            return self._key_mismatch(req, result)
        if isinstance(result, QuotaRefused):
            self.counters["refused_quota"] += 1
            return P.ErrorReply("quota_exceeded", f"P0 quota of tenant {t.name!r} is spent",
                                retry_after_s=result.retry_after_s)
        if isinstance(result, TenantFull):
            self.counters["refused_tenant_full"] += 1
            return P.ErrorReply("overloaded", f"tenant {t.name!r} already holds {result.cap} unfinished jobs (its "
                                "cap, tenant_max_jobs); nothing was stored, retry when some have finished")
        if isinstance(result, StoreFull):
            # Redis is reachable (reads, streams and cancels still work), just full: no "unavailable" back-off.
            self.counters["refused_redis_full"] += 1
            if now - self._redis_full_logged_at >= REDIS_FULL_LOG_EVERY_S:
                self._redis_full_logged_at = now
                log.warning("admissions refused: Redis is full (%s); raise maxmemory or free memory", result.detail)
            return P.ErrorReply("overloaded", "the queue store (Redis) is full; nothing was stored, retry later")
        if isinstance(result, Overloaded):
            self.counters["refused_overloaded"] += 1
            return P.ErrorReply("overloaded", f"estimated wait {result.estimated_wait_s:.1f}s exceeds the "
                                f"{result.tier.value} queue timeout", estimated_wait_s=result.estimated_wait_s)
        assert isinstance(result, Admitted)
        GatewaySpans.admitted(span, result.job_id, t.name, adm.tier_requested, result.tier, quota is not None,
                              result.estimated_wait_s, result.position, result.ahead_by_tier, result.admitted_at_ms)
        if not result.duplicate:
            metrics.admitted(result.tier.value)
            self.estimator.admitted(result.job_id, t.name, result.tier, len(adm.prompt_token_ids), req.max_tokens,
                                    result.estimated_wait_s, now, result.promise_at_ms)
            self.enqueued_at[result.job_id] = now
            s = self.streams.get_or_create(result.job_id)  # its owner, so a stream request needs no Redis read
            s.tenant, s.touched = t.name, now
            self._dirty = True
        return _submitted(result, adm)

    def _replay(self, req: P.SubmitRequest, adm: admission.Admission) -> P.SubmitReply | P.ErrorReply | None:
        """What admit.lua answers a request whose idempotency key names a job already (that job, or the key's
        mismatch), for a request refused before it reached admit.lua; None where the key names none (read only)."""
        if req.idempotency_key is None:
            return None
        found = self.queue.idempotent(adm.tenant.name, req.idempotency_key,
                                      (admission.fingerprint(req, adm), admission.fingerprint_before(req, adm)),
                                      adm.tier_requested, self.drain_rates(self.clock()))
        if found is None:
            return None
        if isinstance(found, (IdempotencyMismatch, Withdrawn)):
            return self._key_mismatch(req, found)
        return _submitted(found, adm)

    def _key_mismatch(self, req: P.SubmitRequest, found: IdempotencyMismatch | Withdrawn) -> P.ErrorReply:
        if isinstance(found, Withdrawn):
            return self._error_for(InvalidRequest(
                f"idempotency_key {req.idempotency_key!r} was withdrawn by its client (a cancel by key, sent when "
                "it gave up on this submission): nothing was stored", field="idempotency_key"))
        return self._error_for(InvalidRequest(
            f"idempotency_key {req.idempotency_key!r} was used for another request (job {found.job_id}); "
            "a key stands for one request and its retries", field="idempotency_key"))

    def _own_job(self, ident: bytes, api_key: str, job_id: str):
        """The job record if the caller's tenant owns it; else replies with an error and returns None."""
        tenant = self.tenants.lookup(api_key)
        if tenant is None:
            self._reply_error(ident, Unauthorized("unknown API key"), job_id)
            return None
        rec = self.queue.get(job_id) if isinstance(job_id, str) and job_id else None
        if rec is None or rec.tenant != tenant.name:
            self.counters["refused_not_found"] += 1
            self._send(self.clients, ident, P.ErrorReply("not_found", f"no job {job_id!r}", in_reply_to=job_id))
            return None
        return rec

    def on_status(self, ident: bytes, req: P.StatusRequest) -> None:
        rec = self._own_job(ident, req.api_key, req.job_id)
        if rec is None:
            return
        # Kept current: the work ahead now, at the rates measured now.
        estimate = self.estimator.for_queued(rec.id, rec.tier, self.clock()) if rec.state == "queued" else 0.0
        self._send(self.clients, ident, P.StatusReply(rec.id, str(rec.state.value), rec.tier.value, rec.attempt,
                                                      estimate, rec.reason))

    def on_info(self, ident: bytes, req: P.InfoRequest) -> None:
        tenant = self.tenants.lookup(req.api_key)
        if tenant is None:
            self._reply_error(ident, Unauthorized("unknown API key"))
            return
        if req.frame_bytes > self.config.client_max_message_bytes:
            self._reply_error(ident, InvalidRequest(
                f"a frame of {req.frame_bytes} bytes is over this gateway's limit of "
                f"{self.config.client_max_message_bytes} (client_max_message_bytes)", field="frame_bytes"))
            return
        depths = {t.value: n for t, n in self.queue.depths().items()}
        limits = {"tier_token_limits": self._token_limits(tenant),
                  "max_tokens_limit": self.config.max_tokens_limit} if req.limits else {}
        if req.tokenizer:
            limits["tokenizer_digest"] = self.hello_policy.tokenizer_digest
        self._send(self.clients, ident, P.InfoReply(self.config.gateway_id, sorted(self.workers.workers), depths,
                                                    **limits))

    def _token_limits(self, tenant) -> dict[str, int]:
        """Per tier of ``tenant``: the largest prompt + max_tokens _admit takes from it now. The same limits as
        admission.check, and P1's for a P0 that a spent quota would downgrade (such a P0 past P1's share is
        refused, not downgraded), so a request sized to this is never refused where a smaller one passes."""
        context = self.workers.max_model_len() or self.config.max_model_len
        p1 = self.workers.tier_max_tokens(Tier.P1.value)
        limits = {}
        for tier in sorted(tenant.tiers, key=lambda t: t.rank):
            share = [self.workers.tier_max_tokens(tier.value)]
            if tier is Tier.P0 and tenant.p0_rate_per_s and tenant.on_quota_exhausted == "downgrade":
                share.append(p1)
            limits[tier.value] = min([context] + [s for s in share if s is not None])
        return limits


def _submitted(result: Admitted, adm: admission.Admission) -> P.SubmitReply:
    # Downgraded: served at a lower priority than asked (the quota's P1). A duplicate's tier is the job's current one,
    # which aging may have raised: a tier other than the one asked for is not by itself a downgrade.
    return P.SubmitReply(result.job_id, result.tier.value, result.estimated_wait_s, result.duplicate,
                         result.tier.rank > adm.tier_requested.rank)
