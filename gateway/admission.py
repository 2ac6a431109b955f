"""Admission checks that need no Redis: who is asking, for which tier, and is the request servable.

Everything here runs before anything is stored or charged; a refusal raises a typed error.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import msgpack

from common.client_messages import MAX_IDEMPOTENCY_KEY_LEN
from common.errors import Forbidden, InvalidRequest, Overloaded, TierLimitExceeded, Unauthorized
from common.protocol import SubmitRequest
from common.tiers import Tier, parse_tier
from gateway import sampling_extras
from gateway.tenants import Tenant, TenantDirectory

# The wait told with a refusal of a job only a draining worker fits: when to ask again, not an estimate (nothing says
# when the worker is back: its drain takes up to its drain_timeout_s, then the restart).
DRAINING_RETRY_S = 5.0


@dataclass(frozen=True)
class Admission:
    tenant: Tenant
    tier_requested: Tier
    prompt_token_ids: list[int]


class OnlyDraining(Overloaded):
    """Refused as overloaded: only workers a redeploy is restarting fit the request. ``admission``: the request's,
    valid in every other way, so that a retry of a job admitted under its idempotency key before the drain gets that
    job back (the key's promise), not a refusal saying nothing was stored."""

    def __init__(self, message: str, admission: Admission) -> None:
        super().__init__(message, DRAINING_RETRY_S)
        self.admission = admission


class BeyondWorkers(InvalidRequest):
    """Refused as invalid by the workers registered now (their context, their vocabulary), not by the request alone.
    ``admission``: the request's, valid in every other way, so that a retry of a job its idempotency key admitted
    before the cluster changed gets that job (the key's promise), not a refusal saying it could never be stored."""

    def __init__(self, message: str, admission: Admission, *, field: str) -> None:
        super().__init__(message, field=field)
        self.admission = admission


class FitsNoWorker(TierLimitExceeded):
    """Past every registered worker's share of the KV cache for the tier (the only worker it fitted may have left):
    ``admission`` as BeyondWorkers'."""

    def __init__(self, message: str, admission: Admission, *, tier: str, limit_tokens: int) -> None:
        super().__init__(message, tier=tier, limit_tokens=limit_tokens)
        self.admission = admission


def check(req: SubmitRequest, tenants: TenantDirectory, *, tokenize, vocab_size: int | None,
          max_model_len: int, max_tokens_limit: int,
          tier_max_tokens: Callable[[str], int | None] = lambda tier: None,
          returning_max_tokens: Callable[[str], int | None] = lambda tier: None,
          extras_served: bool = True) -> Admission:
    """``tier_max_tokens(tier)``: the workers' limit on prompt + max_tokens for the tier (their share of the
    KV cache), or None if unknown; a job over it could never finish and is refused. ``returning_max_tokens(tier)``:
    that of the workers draining or drained lately (a redeploy brings them back): a job over the first limit and
    within this one is refused as overloaded (retryable), not as invalid. ``extras_served``: every registered worker
    takes the sampling extras (gateway/sampling_extras.py; an older one drops a job asking for them)."""
    tenant = tenants.lookup(req.api_key)
    if tenant is None:
        raise Unauthorized("unknown API key")
    tier = parse_tier(req.tier) if req.tier is not None else tenant.highest_tier
    if tier not in tenant.tiers:
        allowed = ", ".join(sorted(t.value for t in tenant.tiers))
        raise Forbidden(f"tenant {tenant.name!r} may use {allowed}, not {tier.value}")
    if (req.prompt is None) == (req.prompt_token_ids is None):
        raise InvalidRequest("give exactly one of prompt and prompt_token_ids", field="prompt")
    if req.prompt is not None:
        if tokenize is None:
            raise InvalidRequest("this gateway has no tokenizer; send prompt_token_ids", field="prompt")
        ids = tokenize(req.prompt)
    else:
        ids = req.prompt_token_ids
    if not ids:
        raise InvalidRequest("the prompt is empty", field="prompt")
    if not 1 <= req.max_tokens <= max_tokens_limit:
        raise InvalidRequest(f"max_tokens must be in 1..{max_tokens_limit}", field="max_tokens")
    if not math.isfinite(req.temperature) or req.temperature < 0:
        raise InvalidRequest("temperature must be finite and >= 0", field="temperature")
    if not math.isfinite(req.top_p) or not 0 < req.top_p <= 1:
        raise InvalidRequest("top_p must be in (0, 1]", field="top_p")
    if req.top_k is not None and req.top_k < 1:
        raise InvalidRequest("top_k must be >= 1", field="top_k")
    if req.seed is not None and not 0 <= req.seed < 2**63:
        raise InvalidRequest("seed must be in [0, 2**63)", field="seed")
    if req.retry_key and req.idempotency_key is None:
        raise InvalidRequest("retry_key says the idempotency_key is the client's own retry key: give one",
                             field="retry_key")
    if req.idempotency_key is not None and not 0 < len(req.idempotency_key) <= MAX_IDEMPOTENCY_KEY_LEN:
        raise InvalidRequest(f"idempotency_key must be 1..{MAX_IDEMPOTENCY_KEY_LEN} characters",
                             field="idempotency_key")
    sampling_extras.check(req)
    # Last, the checks against the workers registered now (their context, vocabulary and KV shares): a request they
    # refuse must be valid in every other way, for a retry of its job admitted before the cluster changed gets that
    # job (client_api._replay), and one refused as overloaded would be refused anyway on its retry.
    adm = Admission(tenant, tier, list(ids))
    if len(ids) + req.max_tokens > max_model_len:
        raise BeyondWorkers(f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the "
                            f"model's context of {max_model_len}", adm,
                            field="prompt" if len(ids) >= max_model_len else "max_tokens")
    # After the length check (cheap, and it bounds this one); min and max run in C.
    if vocab_size is not None and (min(ids) < 0 or max(ids) >= vocab_size):
        raise BeyondWorkers(f"token ids must be in 0..{vocab_size - 1}", adm, field="prompt_token_ids")
    if vocab_size is not None and req.stop_token_ids and max(req.stop_token_ids) >= vocab_size:
        raise BeyondWorkers(f"stop token ids must be in 0..{vocab_size - 1}", adm, field="stop_token_ids")
    if not extras_served and (extras := sampling_extras.asked(req)):
        field = next(iter(extras))
        raise BeyondWorkers(f"a worker of this cluster is of a release that cannot honour {field}: upgrade it, or "
                            "ask without it", adm, field=field)
    limit = tier_max_tokens(tier.value)
    if limit is not None and len(ids) + req.max_tokens > limit:
        later = returning_max_tokens(tier.value)
        if later is not None and len(ids) + req.max_tokens <= later:
            raise OnlyDraining(f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) fits only workers that "
                               f"are draining or restarting (a redeploy), past the {limit} tokens a {tier.value} job "
                               "may hold on the others; nothing was stored, retry shortly", adm)
        raise FitsNoWorker(f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the {limit} "
                           f"tokens a {tier.value} job may hold on this cluster's workers", adm, tier=tier.value,
                           limit_tokens=limit)
    return adm


def fingerprint(req: SubmitRequest, adm: Admission) -> str:
    """What the request asks for, as stored with its idempotency key: the same on every gateway and on every
    retry of it (the trace context and request id, which a retry may change, are left out; the seed is the one
    asked for, None where the gateway draws it; a max_tokens the client did not send is left out too: its front end
    may size another on a retry of the same request)."""
    # temperature and top_p as floats, as the SDK sends them: a raw client's 0 and 0.0 are one request (packed as
    # sent, they were two), and the keys stored before from the SDK's requests keep their fingerprints.
    return _digest(req, adm, None if req.max_tokens_defaulted else req.max_tokens, _as_float(req.temperature),
                   _as_float(req.top_p))


def _as_float(value) -> float:
    """``value`` as a float, -0.0 as 0.0: equal numbers that msgpack packs apart (a client's encoder may write -0.0,
    P.encode leaves a 0.0 temperature out), while every other float, so every stored fingerprint, stays as it was."""
    return float(value) + 0.0


def fingerprint_before(req: SubmitRequest, adm: Admission) -> str:
    """The fingerprint as the release before computed it (the numbers as sent, max_tokens always), for keys it
    stored (idempotency_ttl_s, 24 h): where it differs from fingerprint()'s, a key stored with it still matches.
    Can go a release later."""
    return _digest(req, adm, req.max_tokens, req.temperature, req.top_p)


def _digest(req: SubmitRequest, adm: Admission, max_tokens, temperature, top_p) -> str:
    asked = [adm.prompt_token_ids, max_tokens, temperature, top_p, req.top_k, req.seed, adm.tier_requested.value,
             bool(req.ignore_eos)]
    if extras := sampling_extras.asked(req):  # only then: every key stored before keeps its fingerprint
        asked.append([[name, _as_float(v) if name.endswith("_penalty") else v] for name, v in extras.items()])
    return hashlib.sha256(msgpack.packb(asked)).hexdigest()[:32]
