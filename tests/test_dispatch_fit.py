"""A job goes only where it can finish: what admission lets in is a job some worker can run at the tier it runs as.

Real processes (tests/durable_cluster.py): redis-server, a gateway, and real workers or, where a test needs a worker
to say something no real one would at that moment, a peer speaking the wire protocol (tests/test_durability.py's
adversary; the big worker of tests/uneven_cluster.py).
"""

from __future__ import annotations

import pytest

from gateway.sdk import InvalidRequest, JobFailed, QuotaExceeded
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster
from tests.uneven_cluster import start_small_worker, uneven_cluster

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


def test_a_queued_job_waits_for_the_worker_it_fits_while_smaller_jobs_behind_it_use_the_other(tmp_path,
                                                                                               tiny_model_dir):
    """A job admitted while only a big worker served went, once a smaller worker joined, wherever there was credit:
    to the small one, which failed it (TierLimitExceeded), though the big one could run it once its slot freed. Now
    dispatch sends a job only to a worker whose hello says it fits there, and a smaller job queued behind it takes
    the small worker's slot meanwhile (no head-of-line blocking)."""
    with uneven_cluster(tmp_path, tiny_model_dir, small=False) as u:
        c = u.cluster
        lab = c.client("lab-co", timeout_s=60.0)
        big = lab.submit(prompt_token_ids=[5] * 100, max_tokens=100, ignore_eos=True)  # fits the big worker only
        start_small_worker(c)
        small = lab.submit(prompt_token_ids=[5] * 10, max_tokens=20, ignore_eos=True)
        assert len(small.result(timeout=60).token_ids) == 20
        assert c.job(small.id)["worker"] == b"wk-0"
        assert c.state(big.id) == "queued", c.job(big.id).get("reason")
        u.big.free.set()
        assert big.result(timeout=60).token_ids == [7] * 100
        assert [d.job_id for d in u.big.received] == [big.id]
        lab.close()


def test_a_queued_job_no_worker_left_can_run_fails_with_the_reason_rather_than_waiting_for_ever(tmp_path,
                                                                                                tiny_model_dir):
    """The other side of that rule: once the only worker a queued job fits has gone (silent, and timed out), nothing
    could ever run it, and a P3 has no queue timeout. It is sent on all the same, and fails with why."""
    with uneven_cluster(tmp_path, tiny_model_dir, small=False) as u:
        c = u.cluster
        lab = c.client("lab-co", timeout_s=60.0)
        big = lab.submit(prompt_token_ids=[5] * 100, max_tokens=100, ignore_eos=True)
        start_small_worker(c)
        u.big.stop()
        with pytest.raises(JobFailed, match="pool holds only 4|exceeds the 64 tokens"):
            big.result(timeout=60)
        assert u.big.received == []
        lab.close()


def test_a_queued_job_only_a_draining_worker_fits_waits_for_it_rather_than_failing_on_a_smaller_one(
        tmp_path, tiny_model_dir):
    """The big worker drains (a redeploy), and a job only it fits is queued (handed back, or admitted before): no
    worker that is not draining fits it, so dispatch took it for a job no worker left could run and sent it to the
    small worker, which failed it, though the big one was still there and came back. It waits for it now."""
    with uneven_cluster(tmp_path, tiny_model_dir, draining=True, small=False) as u:
        c = u.cluster
        lab = c.client("lab-co", timeout_s=60.0)
        big = lab.submit(prompt_token_ids=[5] * 100, max_tokens=100, ignore_eos=True)
        start_small_worker(c)
        small = lab.submit(prompt_token_ids=[5] * 10, max_tokens=20, ignore_eos=True)
        assert len(small.result(timeout=60).token_ids) == 20  # dispatch ran with the small worker's credit
        assert c.state(big.id) == "queued", c.job(big.id).get("reason")
        u.big.draining.clear()  # back from its redeploy
        u.big.free.set()
        assert big.result(timeout=60).token_ids == [7] * 100
        lab.close()


def test_a_job_one_worker_fits_is_admitted_though_a_smaller_worker_serves_beside_it(tmp_path, tiny_model_dir):
    """Admission took the smallest worker's limit for the whole cluster: one small worker (or one whose P0 reserve
    or low-tier share leaves the lower tiers little) made every job past its share refused (TierLimitExceeded),
    though the other workers could run it. Dispatch sends a job only where it fits, so a job some worker that is
    not draining fits is admitted, and runs there."""
    with uneven_cluster(tmp_path, tiny_model_dir, free=True) as u:
        lab = u.cluster.client("lab-co", timeout_s=60.0)
        big = lab.submit(prompt_token_ids=[5] * 100, max_tokens=100, ignore_eos=True)
        assert big.result(timeout=60).token_ids == [7] * 100
        with pytest.raises(InvalidRequest, match="2048"):  # past every worker's limit (the context): refused
            lab.submit(prompt_token_ids=[5] * 100, max_tokens=1949)
        lab.close()


class UnevenCluster(DurableCluster):
    """One gateway and two real workers: wk-0 small (4 KV blocks of 16 tokens: 64 a job, two slots), wk-big with
    the default pool and a single slot, so one long job fills it."""

    def __init__(self, tmp_path, model_dir) -> None:
        super().__init__(tmp_path, model_dir, gateways=1, workers=0)
        self.worker_ids += ["wk-0", "wk-big"]

    def _cmd(self, name: str) -> list[str]:
        extra = {"wk-0": ["--num-kv-blocks", "4"], "wk-big": ["--max-num-seqs", "1"]}.get(name, [])
        return super()._cmd(name) + extra


def test_an_urgent_job_only_the_full_big_worker_fits_preempts_there_while_the_small_worker_has_slots(
        tmp_path, tiny_model_dir):
    """A P0 too large for the small worker, with the big worker full of P3 work: the credit pass found no worker it
    fits with credit, and the preemption pass ran only when no worker anywhere had credit, so the small worker's
    idle slots kept the P0 queued behind the P3 until it finished by itself (a priority inversion). It must preempt
    the P3 on the big worker at once, as it would were the small worker full too."""
    with UnevenCluster(tmp_path, tiny_model_dir) as c:
        lab, chat = c.client("lab-co", timeout_s=60.0), c.client("chat-co", timeout_s=60.0)
        p3 = lab.submit(prompt_token_ids=[5] * 10, max_tokens=2000, ignore_eos=True)  # fits wk-big only
        wait_for(lambda: c.state(p3.id) == "dispatched" and c.redis.exists(f"ts:{{c}}:tok:{p3.id}"), 60,
                 "the P3 to stream on wk-big", interval=0.05)
        p0 = chat.submit(prompt_token_ids=[5] * 60, max_tokens=40, tier="P0", ignore_eos=True)  # 100 > 64: wk-big
        assert len(p0.result(timeout=60).token_ids) == 40
        assert c.job(p0.id)["worker"] == b"wk-big"
        assert c.state(p3.id) == "dispatched", "the P0 waited for the P3 to finish"
        done = p3.result(timeout=120)
        assert len(done.token_ids) == 2000 and done.preemptions >= 1
        lab.close()
        chat.close()


def test_a_job_only_the_busy_big_worker_fits_is_told_the_wait_there_not_the_small_workers_free_slots(
        tmp_path, tiny_model_dir):
    """Admission's estimate counted every worker's slots: a job only the big worker fits, queued behind the long P3
    that worker runs, was told no wait because the small worker had free slots it can never use."""
    with UnevenCluster(tmp_path, tiny_model_dir) as c:
        lab = c.client("lab-co", timeout_s=60.0)
        p3 = lab.submit(prompt_token_ids=[5] * 10, max_tokens=2000, ignore_eos=True)  # fits wk-big only
        wait_for(lambda: c.state(p3.id) == "dispatched" and c.redis.exists(f"ts:{{c}}:tok:{p3.id}"), 60,
                 "the P3 to stream on wk-big", interval=0.05)
        big = lab.submit(prompt_token_ids=[5] * 100, max_tokens=100, ignore_eos=True)
        small = lab.submit(prompt_token_ids=[5] * 10, max_tokens=20, ignore_eos=True)
        assert c.state(p3.id) == "dispatched"
        assert big.estimated_wait_s > 1.0 and small.estimated_wait_s < 0.5
        assert len(big.result(timeout=120).token_ids) == 100 and len(small.result(timeout=60).token_ids) == 20
        lab.close()
