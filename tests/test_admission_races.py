"""Admission races across gateways: many clients submitting at the same moment through two real gateways on one
real Redis (tests/durable_cluster.py, no workers: every admitted job stays queued, so what was admitted is counted
exactly). Each promise is checked by counting: one job per idempotency key, no more P0 jobs than the bucket holds,
no more unfinished jobs than the tenant cap, and no charge for a refusal.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from gateway.sdk import GatewayClient, Overloaded, QuotaExceeded
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster

pytestmark = pytest.mark.faults  # real clusters: `make test-faults` runs these alone

PREFIX = "ts:{c}"
BURST = 6
CAP = 20  # per tenant: above what the other tests admit, below what the cap test sends


def _add_tenant(cluster: DurableCluster, name: str, lines: list[str]) -> str:
    key = f"dev-{name}-key"
    with (cluster.tmp / "tenants.toml").open("a") as f:
        f.write("\n".join(["", "[[tenant]]", f'name = "{name}"', f'api_key = "{key}"', *lines, ""]))
    cluster.tenants[name] = {"api_key": key}
    return key


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    c = DurableCluster(tmp_path_factory.mktemp("races"), tiny_model_dir, gateways=2, workers=0,
                       aging_interval_s=1.0, gateway_env={"TS_GATEWAY_TENANT_MAX_JOBS": str(CAP)})
    # A bucket that refills nothing within the test: every P0 admitted is one token, counted exactly.
    _add_tenant(c, "rush", ['tiers = ["P0", "P3"]', "p0_rate_per_s = 0.000001", f"p0_burst = {BURST}"])
    _add_tenant(c, "idem", ['tiers = ["P0", "P3"]', "p0_rate_per_s = 0.000001", "p0_burst = 1000"])
    _add_tenant(c, "capped", ['tiers = ["P3"]'])
    with c:
        yield c


def _clients(c: DurableCluster, tenant: str, n: int) -> list[GatewayClient]:
    """``n`` clients, alternating between the two gateways; no retries (a retry would hide a refusal)."""
    return [GatewayClient(c.endpoint(f"gw-{i % 2}"), c.key(tenant), timeout_s=20.0, retries=0) for i in range(n)]


def _jobs(c: DurableCluster, tenant: str) -> set[str]:
    ids = set()
    for k in c.redis.scan_iter(match=f"{PREFIX}:job:*"):
        if c.redis.hget(k, "tenant") == tenant.encode():
            ids.add(k.decode().rsplit(":", 1)[1])
    return ids


def _queued(c: DurableCluster) -> set[str]:
    return {m.decode() for t in ("P0", "P1", "P2", "P3") for m in c.redis.zrange(f"{PREFIX}:q:{t}", 0, -1)}


def _tokens(c: DurableCluster, tenant: str) -> float:
    raw = c.redis.hget(f"{PREFIX}:quota:{tenant}", "tokens")
    return float(raw) if raw is not None else float("nan")


def _race(clients: list[GatewayClient], submit) -> list:
    """``submit(client, n)`` on every client at once (threads released together); each outcome or its error."""
    start = threading.Barrier(len(clients), timeout=30)

    def one(n: int):
        start.wait()
        try:
            return submit(clients[n], n)
        except (QuotaExceeded, Overloaded) as e:
            return e

    with ThreadPoolExecutor(len(clients)) as pool:
        return list(pool.map(one, range(len(clients)), timeout=120))


def test_one_idempotency_key_sent_through_both_gateways_at_once_admits_one_job_charged_once(cluster):
    c = cluster
    clients = _clients(c, "idem", 6)
    try:
        for rnd in range(12):
            before_jobs, before_tokens = _jobs(c, "idem"), _tokens(c, "idem")
            replies = _race(clients, lambda cl, n: cl.submit(prompt_token_ids=[3, 4, 5], max_tokens=4, tier="P0",
                                                              seed=7, idempotency_key=f"round-{rnd}"))
            assert all(not isinstance(r, Exception) for r in replies), replies
            ids = {r.id for r in replies}
            assert len(ids) == 1, f"round {rnd}: several jobs for one key: {ids}"
            new = _jobs(c, "idem") - before_jobs
            assert new == ids, f"round {rnd}: stored {new}, answered {ids}"
            assert new <= _queued(c)
            assert sum(not r.duplicate for r in replies) <= 1
            if rnd:  # the first round made the bucket (full, less the one charge)
                assert before_tokens - _tokens(c, "idem") == pytest.approx(1.0, abs=1e-3), f"round {rnd}"
            else:
                assert _tokens(c, "idem") == pytest.approx(999.0, abs=1e-3)
    finally:
        for cl in clients:
            cl.close()


def test_concurrent_p0_submits_through_two_gateways_never_pass_the_bucket(cluster):
    c = cluster
    clients = _clients(c, "rush", 16)
    try:
        replies = _race(clients, lambda cl, n: cl.submit(prompt_token_ids=[1, 2, n + 3], max_tokens=2, tier="P0"))
        admitted = [r for r in replies if not isinstance(r, Exception)]
        refused = [r for r in replies if isinstance(r, QuotaExceeded)]
        assert len(admitted) + len(refused) == len(replies), replies
        assert len(admitted) == BURST and all(r.tier == "P0" for r in admitted)
        assert _jobs(c, "rush") == {r.id for r in admitted} <= _queued(c)
        assert _tokens(c, "rush") == pytest.approx(0.0, abs=1e-3)  # charged once per job, not per refusal
        assert all(r.retry_after_s > 0 for r in refused)
    finally:
        for cl in clients:
            cl.close()


def test_concurrent_submits_through_two_gateways_never_pass_the_tenant_cap(cluster):
    c = cluster
    clients = _clients(c, "capped", 32)
    try:
        replies = _race(clients, lambda cl, n: cl.submit(prompt_token_ids=[1, 2, n + 3], max_tokens=2, tier="P3"))
        admitted = [r for r in replies if not isinstance(r, Exception)]
        assert all(isinstance(r, Overloaded) and "unfinished" in str(r) for r in replies if r not in admitted)
        assert len(admitted) == CAP
        assert _jobs(c, "capped") == {r.id for r in admitted} <= _queued(c)
        assert c.redis.zcard(f"{PREFIX}:tenant-jobs:capped") == CAP
    finally:
        for cl in clients:
            cl.close()


def test_a_retry_of_a_job_that_aged_up_is_not_told_it_was_downgraded(cluster):
    """The reply to a duplicate said ``downgraded`` wherever the job's tier was not the one asked for: a P3 job
    that had aged up to P2 (a higher priority) was reported downgraded to its retry, through either gateway."""
    c = cluster
    with GatewayClient(c.endpoint("gw-0"), c.key("idem"), retries=0) as first, \
            GatewayClient(c.endpoint("gw-1"), c.key("idem"), retries=0) as retry:
        job = first.submit(prompt_token_ids=[9, 9], max_tokens=2, tier="P3", idempotency_key="aging")
        assert not job.downgraded
        wait_for(lambda: c.redis.hget(f"{PREFIX}:job:{job.id}", "tier") != b"P3", 30, "the job to age up")
        again = retry.submit(prompt_token_ids=[9, 9], max_tokens=2, tier="P3", idempotency_key="aging")
        assert again.id == job.id and again.tier in ("P2", "P1")
        assert not again.downgraded, f"a job aged up to {again.tier} was reported downgraded"
