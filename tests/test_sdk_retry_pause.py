"""The SDK's pause before retrying a cluster that said Unavailable: the gateway's retry_after_s is the same back-off
end for every client it refused during one back-off, so the retries must not all come back in that one instant."""

from __future__ import annotations

import random

import pytest

from common.errors import Unavailable
from gateway.sdk._retry import RETRY_AFTER_SPREAD, RetryBudget


def test_clients_told_one_retry_after_come_back_spread_over_a_quarter_more():
    random.seed(47)
    asked = 0.8
    pauses = [RetryBudget(retries=2, budget_s=30.0).pause_s(Unavailable("no Redis", asked)) for _ in range(400)]
    assert min(pauses) >= asked  # never before the gateway tries Redis again
    assert max(pauses) <= asked * (1 + RETRY_AFTER_SPREAD)
    # Spread over the whole quarter, not bunched: each tenth of it holds some of the 400 clients.
    tenths = {int((p - asked) / (asked * RETRY_AFTER_SPREAD) * 10) for p in pauses}
    assert tenths >= set(range(10)), sorted(tenths)


def test_the_spread_pauses_still_end_at_the_budget():
    random.seed(7)
    budget = RetryBudget(retries=2, budget_s=5.0)
    error = Unavailable("no Redis", 1.0)
    waited = 0.0
    with pytest.raises(Unavailable):
        for _ in range(100):
            waited += budget.pause_s(error)
    assert 3.0 <= waited <= 5.0  # four pauses of 1-1.25 s fit in 5 s at most, three at least


def test_without_a_retry_after_the_pause_doubles_from_a_tenth_of_a_second_with_jitter():
    random.seed(3)
    budget = RetryBudget(retries=2, budget_s=60.0)
    pauses = [budget.pause_s(Unavailable("no Redis")) for _ in range(8)]
    for n, p in enumerate(pauses):
        cap = min(2.0, 0.1 * 2 ** n)
        assert cap / 2 <= p <= cap
