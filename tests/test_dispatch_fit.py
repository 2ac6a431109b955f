"""A job goes only where it can finish: what admission lets in is a job some worker can run at the tier it runs as.

Real processes (tests/durable_cluster.py): redis-server, a gateway, and real workers or, where a test needs a worker
to say something no real one would at that moment, a peer speaking the wire protocol (tests/test_durability.py's
adversary).
"""

from __future__ import annotations

import pytest

from gateway.sdk import JobFailed, QuotaExceeded
from tests.durable_cluster import DurableCluster

pytestmark = pytest.mark.faults  # real clusters: `make test-faults` runs these alone


def add_tenant(cluster: DurableCluster, name: str, lines: list[str]) -> str:
    """A tenant appended to the cluster's tenants file (before its gateways start); its API key."""
    key = f"dev-{name}-key"
    with (cluster.tmp / "tenants.toml").open("a") as f:
        f.write("\n".join(["", "[[tenant]]", f'name = "{name}"', f'api_key = "{key}"', *lines, ""]))
    cluster.tenants[name] = {"api_key": key}
    return key


def test_a_p0_the_quota_would_downgrade_past_p1s_share_is_refused_not_admitted_to_fail(tmp_path, tiny_model_dir):
    """8 KV blocks of 16 tokens, 4 of them reserved for P0: a P0 may hold 128 tokens, a P1 64. A 100-token P0 past
    its tenant's quota (on_quota_exhausted = downgrade) became a P1 in admit.lua after the gateway had checked it
    against P0's share: admitted, it failed on the worker (TierLimitExceeded) though it was runnable as the P0 it
    asked to be. Now the quota refuses it with a retry-after, as a tenant that refuses does; nothing is stored."""
    env = {"TS_WORKER_NUM_KV_BLOCKS": "8", "TS_WORKER_BLOCK_SIZE": "16", "TS_WORKER_P0_RESERVE_BLOCKS": "4"}
    cluster = DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, worker_env=env)
    add_tenant(cluster, "chat-down", ['tiers = ["P0", "P1"]', "p0_rate_per_s = 0.01", "p0_burst = 1",
                                      'on_quota_exhausted = "downgrade"'])
    with cluster as c:
        client = c.client("chat-down", timeout_s=60.0)
        first = client.submit(prompt_token_ids=[5] * 20, max_tokens=80, tier="P0", ignore_eos=True)
        assert not first.downgraded
        assert len(first.result(timeout=120).token_ids) == 80
        jobs_before = set(c.redis.keys("ts:{c}:job:*"))
        # Small enough for P1's share: downgraded as before.
        small = client.submit(prompt_token_ids=[5] * 20, max_tokens=20, tier="P0", ignore_eos=True)
        assert small.downgraded and small.tier == "P1"
        assert len(small.result(timeout=120).token_ids) == 20
        jobs_before.add(f"ts:{{c}}:job:{small.id}".encode())
        try:
            big = client.submit(prompt_token_ids=[5] * 20, max_tokens=80, tier="P0", ignore_eos=True)
        except QuotaExceeded as e:
            assert e.retry_after_s > 0
        else:
            try:
                big.result(timeout=120)
            except JobFailed as e:
                pytest.fail(f"a P0 downgraded past P1's share was admitted and failed: {e}")
            pytest.fail("a P0 downgraded past P1's share was admitted")
        assert set(c.redis.keys("ts:{c}:job:*")) == jobs_before  # nothing stored
        client.close()
