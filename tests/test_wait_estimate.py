"""Wait estimates on a real cluster (redis-server, gateway, workers via scripts/up.py, the tiny model).

The wait is admission until the job's first prefill starts on a worker; the estimate comes from
the work ahead in tokens over the workers' measured rates. No test here asserts a duration:
only which side of zero or of a queue timeout an estimate falls, and how estimates move.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from common.errors import JobExpired, Overloaded
from gateway.sdk import GatewayClient
from tests.cluster_helpers import job_hash, job_ids, local_cluster, wait_for
from tests.durable_cluster import DurableCluster


def client(cluster, tenant: str) -> GatewayClient:
    return GatewayClient(cluster["gateway"], cluster["tenants"][tenant]["api_key"], timeout_s=30)


def running_on_workers(c, job_ids) -> bool:
    return all(job_hash(c, j).get("state") == "dispatched" for j in job_ids)


def test_a_fresh_cluster_admits_the_p2_backlog_its_capacity_clears(tiny_model_dir, tmp_path):
    # 300 short P2 jobs at once: a fresh cluster (nothing finished yet) clears them in seconds, so none
    # may be refused against a 60 s queue timeout; the estimates come from the workers' calibrated rates.
    with local_cluster(tmp_path, tiny_model_dir, workers=2, max_running=2,
                       env={"TS_GATEWAY_TIER_TIMEOUTS_S": '{"P0": 30, "P1": 60, "P2": 60}'}, http=False) as c:
        batch = client(c, "batch-co")
        jobs = [batch.submit(prompt_token_ids=[5 + i % 50, 6, 7], max_tokens=4, tier="P2", ignore_eos=True)
                for i in range(300)]
        estimates = [j.estimated_wait_s for j in jobs]
        assert estimates[-1] > 0  # the backlog counts...
        assert max(estimates) < 60  # ...at the rate the cluster clears it
        results = [j.result(timeout=300) for j in jobs]
        assert all(r.finish_reason == "length" and len(r.token_ids) == 4 for r in results)
        assert all(0 <= r.queued_s <= r.ttft_s for r in results)


def test_estimates_count_unpreemptible_work_and_fall_as_it_drains(tiny_model_dir, tmp_path):
    with local_cluster(tmp_path, tiny_model_dir, workers=1, max_running=2, http=False) as c:
        lab, batch, chat = client(c, "lab-co"), client(c, "batch-co"), client(c, "chat-co")
        blockers = [lab.submit(prompt_token_ids=[3, 4], max_tokens=600, ignore_eos=True) for _ in range(2)]
        wait_for(lambda: running_on_workers(c, [b.id for b in blockers]), 60, "the P3 blockers to run")
        # Both slots hold P3 work that a P2 may not preempt: the P2 waits for it, and says so.
        p2 = batch.submit(prompt_token_ids=[5, 6], max_tokens=4, tier="P2", ignore_eos=True)
        assert p2.estimated_wait_s > 0
        # A P0 may preempt P3: nothing is ahead of it, only the worker's hand-off (reading it between steps).
        p0 = chat.submit(prompt_token_ids=[7, 8], max_tokens=2, tier="P0")
        assert 0 <= p0.estimated_wait_s < p2.estimated_wait_s / 2
        p0.result(timeout=60)
        # Kept current: as the P3 work drains, the P2's estimate falls.
        first = batch.status(p2.id).estimated_wait_s
        assert first > 0
        wait_for(lambda: 0 < batch.status(p2.id).estimated_wait_s < first * 0.8, 120, "the estimate to fall")
        r = p2.result(timeout=300)
        assert 0 < r.queued_s <= r.ttft_s
        for b in blockers:
            lab.cancel(b.id)


def test_refused_on_the_estimate_and_expired_when_overtaken(tiny_model_dir, tmp_path):
    # Promises off: with them, the P2 below would stop being overtaken once its estimate was up (next test).
    env = {"TS_GATEWAY_TIER_TIMEOUTS_S": '{"P0": 30, "P1": 60, "P2": 5}', "TS_GATEWAY_PROMISE_FACTOR": "0"}
    with local_cluster(tmp_path, tiny_model_dir, workers=1, max_running=1, env=env, http=False) as c:
        lab, batch, api = client(c, "lab-co"), client(c, "batch-co"), client(c, "api-co")
        blocker = lab.submit(prompt_token_ids=[3, 4], max_tokens=2000, ignore_eos=True)
        wait_for(lambda: running_on_workers(c, [blocker.id]), 60, "the blocker to run")
        # Long P2 jobs queue behind it until the estimate passes the 5 s timeout: that one is refused
        # (with the estimate) and stores nothing. How many fit depends on the machine, not the outcome.
        admitted = []
        for _ in range(200):
            # Job hashes, not every key: running jobs keep streaming tokens into Redis, and on a fast machine
            # a queued job may start meanwhile.
            before = job_ids(c)
            try:
                admitted.append(batch.submit(prompt_token_ids=[6], max_tokens=2000, tier="P2", ignore_eos=True))
            except Overloaded as over:
                assert over.estimated_wait_s > 5
                assert job_ids(c) == before
                break
        else:
            pytest.fail("200 jobs of 2,000 tokens each fit in a 5 s wait")
        assert all(j.estimated_wait_s <= 5 for j in admitted)
        for j in [blocker, *admitted]:
            lab.cancel(j.id) if j is blocker else batch.cancel(j.id)
        # A P2 admitted behind a short P3 is overtaken by P1 jobs that arrive after it (P1 may preempt P3, a
        # P2 may not) until it outlives its timeout: expired, with the reason.
        for length in (400, 100, 25):  # shorter on a slow machine, so the P2's estimate stays under 5 s
            short = lab.submit(prompt_token_ids=[3, 4], max_tokens=length, ignore_eos=True)
            wait_for(lambda: running_on_workers(c, [short.id]), 60, "the short blocker to run")
            try:
                p2 = batch.submit(prompt_token_ids=[6], max_tokens=2, tier="P2")
                break
            except Overloaded:
                lab.cancel(short.id)
        overtakers = []
        for _ in range(40):  # over 5 s of P1 work on any machine: 12,000 tokens, or until P1's 60 s are full
            try:
                overtakers.append(api.submit(prompt_token_ids=[9, 10], max_tokens=300, tier="P1", ignore_eos=True))
            except Overloaded:
                break
        assert 0 < p2.estimated_wait_s <= 5
        with pytest.raises(JobExpired):
            p2.result(timeout=60)
        assert "queue timeout" in job_hash(c, p2.id)["reason"]
        for j in overtakers:
            api.cancel(j.id)


def keeps_its_promise(c, tenant: str, tier: str, overtaking_tenant: str, overtaking_tier: str) -> None:
    """The one slot holds a P2 blocker (a P1 may not preempt it), so every job waits for it to free. Once its
    estimate is up, the job under test moves up a queue with its enqueue time, ahead of the twelve jobs of the
    tier above admitted after it, and takes the next slot that frees (promotions run in the gateway's maintenance
    pass). Without the promise, all twelve would have gone first."""
    owner, others = client(c, tenant), client(c, overtaking_tenant)
    blocker = client(c, "batch-co").submit(prompt_token_ids=[3, 4], max_tokens=100, tier="P2", ignore_eos=True)
    wait_for(lambda: running_on_workers(c, [blocker.id]), 60, "the P2 blocker to run")
    job = owner.submit(prompt_token_ids=[6], max_tokens=2, tier=tier)
    # Long, so that however far this machine's calibrated rates (so the job's estimate and promise) are off, only
    # a few can go before the promise falls due: at 200 tokens each, a machine decoding far faster than its
    # calibration said ran seven of them first (one every 0.25 s against an estimate of seconds).
    overtakers = [others.submit(prompt_token_ids=[9, 10], max_tokens=2000, tier=overtaking_tier, ignore_eos=True)
                  for _ in range(12)]
    r = job.result(timeout=120)
    assert r.finish_reason in ("length", "stop") and r.queued_s > 0
    h = job_hash(c, job.id)
    assert int(h["promise_at_ms"]) <= int(h["promoted_at_ms"]) <= int(h["dispatched_at_ms"])
    assert h["tier"] == overtaking_tier and h["tier_granted"] == tier
    sent = [int(job_hash(c, o.id).get("dispatched_at_ms") or 2**62) for o in overtakers]
    # From its promotion on, none admitted after it went first (one dispatch may have been under way then).
    promoted, started = int(h["promoted_at_ms"]), int(h["dispatched_at_ms"])
    assert sum(promoted < t < started for t in sent) <= 1, (promoted, started, sent)
    # How many went before that depends on how far the estimate (so the promise) is off on this machine, but
    # most of the twelve, 2,000 tokens each, are still to go.
    assert sum(t < started for t in sent) <= 3, (promoted, started, sent)
    for o in overtakers:
        others.cancel(o.id)


# Twelve jobs of 2,000 tokens queued behind one another: on a slow machine the last ones' estimates pass the
# default P1/P2 queue timeouts (60 s, 300 s) and would be refused as Overloaded, which is not what these test.
LONG_TIMEOUTS = {"TS_GATEWAY_TIER_TIMEOUTS_S": '{"P0": 30, "P1": 3600, "P2": 3600}'}
# And the tier a promoted job is dispatched in must be its promise's: where up to three of those jobs go first (a
# machine slower than its calibration said, or one shared with other runs) the job under test waited past the
# default aging interval (60 s) and aged a tier further (seen under pytest-xdist on 2 cores: P1, not P2).
NO_AGING_S = 3600.0


def test_a_promise_keeps_p2s_admitted_later_from_overtaking_a_p3_past_its_estimate(tiny_model_dir, tmp_path):
    # With P3 promises only (P2s given none: a P2 promised into P1 would pass the P3 in P2, as a test below shows).
    with local_cluster(tmp_path, tiny_model_dir, workers=1, max_running=1, aging_interval=NO_AGING_S,
                       env=LONG_TIMEOUTS | {"TS_GATEWAY_PROMISE_TIERS": '["P3"]'}, http=False) as c:
        keeps_its_promise(c, "lab-co", "P3", "batch-co", "P2")


def test_a_promise_keeps_p1s_admitted_later_from_overtaking_a_p2_past_its_estimate(tiny_model_dir, tmp_path):
    # The same for a P2 against P1s (promise_tiers has P2 by default).
    with local_cluster(tmp_path, tiny_model_dir, workers=1, max_running=1, aging_interval=NO_AGING_S,
                       env=LONG_TIMEOUTS, http=False) as c:
        keeps_its_promise(c, "batch-co", "P2", "api-co", "P1")


def test_with_p2_promises_a_p3_promised_into_p2_is_passed_by_p2s_promised_after_it(tiny_model_dir, tmp_path):
    # The cost of P2 promises (the default), pinned so that a change to it is seen: the P3 of the first test is
    # promised into P2, but each P2 admitted after it is promised into P1 once its own estimate is up, and a job in
    # P1 goes before any in P2. Its promise held against P2s with none; these have one. A lead longer than any
    # estimate here makes every promise fall due at once, and the blocker is cancelled only once all have moved,
    # so the order of the slot's next dispatches is decided by the queues alone.
    with local_cluster(tmp_path, tiny_model_dir, workers=1, max_running=1,
                       env={"TS_GATEWAY_PROMISE_LEAD_S": "1000"}, http=False) as c:
        batch, lab = client(c, "batch-co"), client(c, "lab-co")
        blocker = batch.submit(prompt_token_ids=[3, 4], max_tokens=2000, tier="P2", ignore_eos=True)
        wait_for(lambda: running_on_workers(c, [blocker.id]), 60, "the P2 blocker to run")
        p3 = lab.submit(prompt_token_ids=[6], max_tokens=2)
        overtakers = [batch.submit(prompt_token_ids=[9, 10], max_tokens=100, tier="P2", ignore_eos=True)
                      for _ in range(4)]
        wait_for(lambda: all("promoted_at_ms" in job_hash(c, j.id) for j in [p3, *overtakers]), 30,
                 "every promise to fall due")
        batch.cancel(blocker.id)
        p3.result(timeout=120)
        h = job_hash(c, p3.id)
        assert h["tier"] == "P2" and int(h["promoted_at_ms"]) <= int(h["dispatched_at_ms"])
        passed = [job_hash(c, o.id) for o in overtakers]
        passed = [p for p in passed if int(p.get("dispatched_at_ms") or 2**62) < int(h["dispatched_at_ms"])]
        assert len(passed) == 4 and all(p["tier"] == "P1" and "promoted_at_ms" in p for p in passed), [
            {k: v for k, v in p.items() if k.endswith(("_ms", "tier"))} for p in passed]
        for j in overtakers:
            batch.cancel(j.id)


def test_the_wait_ends_at_the_first_prefill_even_when_the_job_is_redispatched(tiny_model_dir, tmp_path):
    # JobResult.queued_s is admission until the job's first prefill started. A worker killed mid-job makes
    # its lease expire and the job run again elsewhere; that detour is not waiting in the queue.
    with local_cluster(tmp_path, tiny_model_dir, workers=2, max_running=1, lease_s=2.0, http=False) as c:
        lab = client(c, "lab-co")
        t0 = time.monotonic()
        job = lab.submit(prompt_token_ids=[3, 4, 5], max_tokens=1500, ignore_eos=True, seed=3)
        stream = job.stream(timeout=60)
        next(stream)  # the first token is out: its prefill started before now
        first_token_after = time.monotonic() - t0
        holder = job_hash(c, job.id)["worker"]
        os.kill(next(w["pid"] for w in c["workers"] if w["id"] == holder), signal.SIGKILL)
        for _ in stream:
            pass
        r = job.result(timeout=300)
        assert job_hash(c, job.id)["attempt"] == "2" and len(r.token_ids) == 1500
        assert 0 <= r.queued_s <= first_token_after < r.total_s
        assert r.queued_s == pytest.approx(float(job_hash(c, job.id)["queued_s"]))


def test_a_p0_the_quota_downgrades_is_shed_on_the_p1_wait(tiny_model_dir, tmp_path):
    # chat-co's P0 bucket holds one job and a spent one downgrades to P1. The gateway estimated the P0 wait (which
    # no P1 job delays) and admit.lua shed the downgraded job on it: into a P1 queue a P1 job is refused from, it
    # was admitted, told a P0's wait, and expired there instead.
    env = {"TS_GATEWAY_TIER_TIMEOUTS_S": '{"P0": 30, "P1": 5, "P2": 300}'}
    c = DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, max_running=1, gateway_env=env)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(tenants.read_text().replace("p0_burst = 4", 'p0_burst = 1\non_quota_exhausted = "downgrade"'))
    with c:
        api, chat = c.client("api-co"), c.client("chat-co")
        queued = []
        for _ in range(200):  # P1 jobs until the P1 queue holds over 5 s of work: how many fit depends on the machine
            try:
                queued.append(api.submit(prompt_token_ids=[6], max_tokens=2000, tier="P1", ignore_eos=True))
            except Overloaded as over:
                assert over.estimated_wait_s > 5
                break
        else:
            pytest.fail("200 jobs of 2,000 tokens each fit in a 5 s wait")
        first = chat.submit(prompt_token_ids=[7], max_tokens=2, tier="P0")  # the bucket's one token: no P1 ahead
        assert first.tier == "P0" and first.estimated_wait_s < 30
        prefix = "ts:{c}:job:"
        before = set(c.redis.scan_iter(match=prefix + "*", count=1000))
        bucket = c.redis.hgetall("ts:{c}:quota:chat-co")
        with pytest.raises(Overloaded) as over:
            late = chat.submit(prompt_token_ids=[8], max_tokens=2, tier="P0")
            pytest.fail(f"admitted as {late.tier}, told {late.estimated_wait_s:.1f}s, behind {len(queued)} P1 jobs")
        assert over.value.estimated_wait_s > 5 and "P1 queue timeout" in str(over.value)
        assert set(c.redis.scan_iter(match=prefix + "*", count=1000)) == before  # nothing stored
        assert c.redis.hgetall("ts:{c}:quota:chat-co") == bucket  # a refusal charges nothing
        for j in queued:
            api.cancel(j.id)
