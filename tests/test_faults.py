"""Fault injection under load (issue 9): 2 gateways, 2 workers, one Redis (AOF everysec); kill -9 of a
worker, of Redis and of the admitting gateway while jobs stream, each restarted with the same identity,
ports and data directory (by the test: the harness plays the supervisor). Every job must end done with
all its tokens, exactly max_tokens for ignore_eos jobs, equal to the reference engine's, and be readable
through either gateway.
"""

from __future__ import annotations

import pytest

from common.errors import ServingError
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster, settle, wait_states
from tests.test_cluster_robustness import reference  # noqa: F401  (fixture)
from tests.test_durability import assert_whole

pytestmark = pytest.mark.faults


def _load(c: DurableCluster, wave: int, n: int = 6) -> list[tuple[str, tuple[list[int], int, float, int]]]:
    """Submit ``n`` jobs alternately through both gateways; (job id, reference spec) each."""
    out = []
    for i in range(n):
        spec = ([wave + 1, i + 1], 40 + 8 * i, 0.0, 1000 * wave + i)
        cl = c.client("lab-co", f"gw-{i % 2}")
        job = wait_for(lambda: _submit(cl, spec), 60, "a gateway to admit again after the fault", interval=0.2)
        cl.close()
        out.append((job.id, spec))
    return out


def _submit(cl, spec):
    """The job, or None while the gateway answers 'unavailable' (Redis just came back: it retries with backoff)."""
    try:
        return cl.submit(prompt_token_ids=spec[0], max_tokens=spec[1], seed=spec[3], ignore_eos=True)
    except ServingError as e:
        if "unavailable" not in str(e):
            raise
        return None


@pytest.mark.parametrize("victim", ["wk-0", "redis", "gw-0"])
def test_kill_9_under_load_every_job_ends_whole(tmp_path, tiny_model_dir, reference, victim):  # noqa: F811
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=2, lease_s=4.0) as c:
        jobs = _load(c, 0)
        wait_for(lambda: sum(c.state(j) == "dispatched" for j, _ in jobs) >= 2, 120, "jobs running")
        settle(1.2)  # AOF everysec: admitted more than a second before the kill
        c.kill(victim)
        settle(1.0)
        c.restart(victim)
        if victim.startswith("gw"):
            c.wait_workers(victim)
        jobs += _load(c, 1)  # more load once it is back
        wait_states(c, [j for j, _ in jobs], {"done", "failed", "dead", "expired", "cancelled"}, 600)
        want = reference([spec for _, spec in jobs])
        for (job_id, spec), tokens in zip(jobs, want):
            assert len(tokens) == spec[1]
            assert_whole(c, "lab-co", job_id, tokens)
