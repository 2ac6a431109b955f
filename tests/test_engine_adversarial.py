"""The real engine over the tiny model under adversarial request mixes (tests/engine_fuzz.py): after every step the
blocks partition the pool, no finished request holds one, nobody passes max_tokens or the context, the queue head
does not wait on a victim it may preempt; at the end every request's tokens equal the same request run alone."""

from __future__ import annotations

import logging
import random

import pytest

from tests import engine_fuzz
from worker.kv_swap import HostPool

# Chosen to cover, together, aborts while waiting, mid-prefill, running and suspended (recompute and swap), manual
# suspends in every mode, and failed steps (injected into the real runner's copies and forward pass).
SEEDS = (11, 13, 17, 19, 21, 25, 30)


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    """One alone-reference engine per context length (the cases draw a few)."""
    refs: dict[int, engine_fuzz.Reference] = {}

    def get(seed: int) -> engine_fuzz.Reference:
        n = engine_fuzz.random_config(random.Random(seed)).max_model_len
        return refs.get(n) or refs.setdefault(n, engine_fuzz.Reference(tiny_model_dir, n))

    return get


def test_adversarial_mixes_keep_every_invariant(tiny_model_dir, references, caplog):
    caplog.set_level(logging.CRITICAL, logger="worker.engine")  # the injected step failures log tracebacks
    seen: set[str] = set()
    for seed in SEEDS:
        seen |= engine_fuzz.run_case(tiny_model_dir, seed, references(seed)).seen_states
    # The mix reached the states it is meant to (a silent change of the generator would make the test vacuous).
    assert {"abort:waiting", "abort:prefilling", "abort:running", "abort:suspended-recompute",
            "abort:suspended-swap", "suspend:keep", "suspend:swap", "suspend:recompute", "step-failure"} <= seen


def test_the_driver_catches_kv_lost_on_the_way_to_the_host(tiny_model_dir, references, monkeypatch):
    """Guard against a checker that cannot fail: swap-outs that never reach the host pool (the KV comes back as
    zeros) must show as tokens that differ from the request run alone."""
    real = HostPool.copy

    def lose_swap_outs(self, copies):
        real(self, [c for c in copies if not c.to_host])

    monkeypatch.setattr(HostPool, "copy", lose_swap_outs)
    with pytest.raises(AssertionError, match="!= alone"):
        engine_fuzz.run_case(tiny_model_dir, 17, references(17), fail=False)
