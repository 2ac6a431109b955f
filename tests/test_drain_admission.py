"""Admission while the only workers a request fits drain (a redeploy): a retryable refusal, but only for a request
valid in every other way (a bad one is told what is wrong, not to retry it for ever)."""

from __future__ import annotations

import pytest

from common import protocol as P
from common.errors import InvalidRequest, Overloaded, TierLimitExceeded
from common.tiers import Tier
from gateway import admission
from gateway.tenants import Tenant, TenantDirectory, key_digest
from gateway.workers import WorkerRegistry


def test_a_request_only_a_draining_worker_fits_is_overloaded_only_when_nothing_else_is_wrong_with_it():
    registry = WorkerRegistry(timeout_s=5.0)
    registry.hello(P.WorkerHello("small", "m", 512, 2048, 2, 4, {t.value: 64 for t in Tier}), b"s", 0.0)
    registry.hello(P.WorkerHello("big", "m", 512, 2048, 1, 64, {t.value: 1024 for t in Tier}, draining=True), b"b", 0.0)
    tenants = TenantDirectory({key_digest("k"): Tenant("lab", frozenset({Tier.P3}))})

    def check(max_tokens: int, **kw):
        return admission.check(P.SubmitRequest(api_key="k", prompt_token_ids=[5] * 10, max_tokens=max_tokens, **kw),
                               tenants, tokenize=None, vocab_size=512, max_model_len=2048, max_tokens_limit=2048,
                               tier_max_tokens=registry.tier_max_tokens,
                               returning_max_tokens=registry.returning_max_tokens)

    assert check(54).prompt_token_ids == [5] * 10  # the small worker's limit
    with pytest.raises(Overloaded) as e:
        check(100)
    assert e.value.estimated_wait_s > 0
    with pytest.raises(TierLimitExceeded):  # past the draining worker's too
        check(1100)
    # Checked before the limits: its retry would be refused all the same.
    with pytest.raises(InvalidRequest, match="temperature"):
        check(100, temperature=-1.0)
    with pytest.raises(InvalidRequest, match="token ids"):
        admission.check(P.SubmitRequest(api_key="k", prompt_token_ids=[600] * 10, max_tokens=100), tenants,
                        tokenize=None, vocab_size=512, max_model_len=2048, max_tokens_limit=2048,
                        tier_max_tokens=registry.tier_max_tokens, returning_max_tokens=registry.returning_max_tokens)
    registry.workers["small"].last_seen = 100.0
    registry.expire(10.0)  # the big worker exited: remembered
    with pytest.raises(Overloaded):
        check(100)
    registry.workers["small"].last_seen = 1000.0
    registry.expire(10.0 + registry.drained_memory_s + 1)  # not back for long: too big for the cluster again
    with pytest.raises(TierLimitExceeded):
        check(100)
