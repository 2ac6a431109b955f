"""Redis misbehaving under a live cluster: frozen (SIGSTOP), on real processes (tests/durable_cluster.py)."""

from __future__ import annotations

import os
import signal
import time
from contextlib import contextmanager

import pytest
import redis
import zmq

from common import protocol as P
from common.redis_keys import KeySpace, load_scripts
from common.redis_server import RedisServer
from common.sockets import make_socket
from common.ports import free_port
from common.tiers import ALL_TIERS, Tier
from gateway.redis_queue import Admitted, RedisQueue
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster, settle, wait_states
from tests.test_durability import Adversary
from tests.test_metrics import scrape, total
from tests.redis_proxy import HoldingProxy
from tests.test_security_redis import _Gateway, _empty, _fill

pytestmark = pytest.mark.faults


def hold_script(r: redis.Redis, proxy: HoldingProxy, name: str, seconds: float) -> None:
    """The proxy holds back the next run of the Lua script ``name`` (common/lua/) ``seconds``: Redis stalls while it
    is on its way. The script is loaded first, as after any earlier run of it: the held EVALSHA finds it."""
    script = load_scripts(r)[name]
    r.script_load(script.script)
    proxy.hold(script.sha.encode(), seconds)


def wait_held(proxy: HoldingProxy, what: str, timeout: float) -> None:
    """The held command reached the proxy within ``timeout`` and then Redis."""
    assert proxy.held.wait(timeout), f"no {what} reached Redis"
    assert proxy.released.wait(10)


def _dump(q: RedisQueue) -> dict[bytes, bytes]:
    return {k: q.client.dump(k) for k in q.client.scan_iter(match=q.keys.scan_pattern())}


@contextmanager
def run_late(q: RedisQueue):
    """What runs inside is run by Redis 10 s after its caller gave up (a clock sample that places the moment in the
    past): its caller hears a timeout and nothing changes. The clock is read afresh after, so what follows is on
    time."""
    before = _dump(q)
    sampled, read_by = q.clock_sample
    q.clock_sample = (sampled - 10_000, read_by)
    with pytest.raises(redis.TimeoutError, match="nothing was changed"):
        yield
    assert _dump(q) == before
    q.server_ms()


def test_a_frozen_redis_costs_no_running_job_its_lease(tmp_path, bench_model_dir):
    """Redis stands still (SIGSTOP) longer than a lease while a job runs, then goes on. Leases are judged by
    Redis's clock, which ran on meanwhile, and no heartbeat could extend them: no gateway may take that as a
    sign the worker died (maintenance.py: leases are judged only after a whole lease_s of listening). Two gateways:
    gw-1 holds no job and has nothing to write but its maintenance, and must not requeue the job gw-0 holds either.
    (A regression guard: this held when it was written.)"""
    lease_s = 10.0
    with DurableCluster(tmp_path, bench_model_dir, gateways=2, workers=1, max_running=1, lease_s=lease_s) as c:
        with c.client("lab-co", "gw-0") as lab:
            job = lab.submit(prompt_token_ids=[3, 1, 4], max_tokens=1500, seed=7, ignore_eos=True)
            wait_for(lambda: c.state(job.id) == "dispatched", 60, "the job to run")
            pid = c.procs["redis"].pid
            os.kill(pid, signal.SIGSTOP)
            try:
                settle(1.5 * lease_s)
            finally:
                os.kill(pid, signal.SIGCONT)
            settle(2.0)  # the gateways' first maintenance passes after the stall
            assert c.job(job.id)["attempt"] == b"1", (c.log_tail("gw-0"), c.log_tail("gw-1"))
            assert c.state(job.id) in {"dispatched", "done"}
            assert lab.cancel(job.id) or c.state(job.id) == "done"
        wait_states(c, [job.id], {"done", "cancelled"}, 60)


def test_an_admission_refused_as_unavailable_stores_nothing_even_if_redis_runs_it_late(tmp_path):
    """Redis stalls while an admission's script is on its way: the gateway's read times out (2 s) and it tells the
    client "unavailable; nothing was stored, retry". Redis then wakes and runs the script it had received. The job
    must not be admitted then: the client was told it was not (and retries, or gives up), so it would run twice,
    or run and charge the tenant's quota unasked. (admit.lua writes all or nothing: no job, no charge.)"""
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as s:
        proxy = HoldingProxy(s.port)
        gw = _Gateway(tmp_path, proxy)
        r = s.client()
        try:
            with gw.client("chat-co", timeout_s=20.0) as c:
                c.submit(prompt_token_ids=[1, 2], max_tokens=2)  # scripts loaded, the path known to work
                jobs = set(r.scan_iter(match=f"{gw.prefix}:*:job:*"))
                hold_script(r, proxy, "admit", 4.0)
                # A raw request, as the HTTP door's or any client's that gets no SDK retry under the same key.
                raw = make_socket(zmq.Context.instance(), zmq.DEALER)
                raw.connect(gw.endpoint)
                raw.send(P.encode(P.SubmitRequest(gw.tenants["chat-co"]["api_key"], 2, prompt_token_ids=[1, 2, 3])))
                assert raw.poll(20_000), "no answer while Redis stalls"
                reply = P.decode(raw.recv())
                raw.close(linger=0)
                assert isinstance(reply, P.ErrorReply) and reply.code == "unavailable", reply
                assert proxy.held.is_set()
                assert proxy.released.wait(10)
                time.sleep(0.5)  # Redis has run what it was sent
                assert set(r.scan_iter(match=f"{gw.prefix}:*:job:*")) == jobs, "a job refused as unavailable ran"
                # Redis answers again: the next admission goes through.
                assert c.submit(prompt_token_ids=[1, 2, 3], max_tokens=2).id
        finally:
            gw.stop()
            proxy.close()
            r.close()


def test_an_admission_a_claim_or_a_cancel_run_past_its_deadline_writes_nothing():
    """The queue layer of the tests here: admit.lua, claim.lua or cancel.lua run after the moment its caller gives
    up (here: a clock sample that places it in the past) changes nothing; an admission's or a cancel's caller hears
    a timeout, as if the reply never came, a claim's claims nothing."""
    with RedisServer() as s:
        q = RedisQueue(s.client(), KeySpace(prefix="late"), tier_timeouts_s={t: None for t in ALL_TIERS})
        admit = dict(tenant="a", tier_requested=Tier.P3, tier=Tier.P3, payload=b"x", idempotency_key="k",
                     quota=None, drain_rate_per_s={})
        q.server_ms()
        assert q.clock_sample is not None
        assert isinstance(q.admit(job_id="on-time", **admit | {"idempotency_key": "k0"}), Admitted)
        before = _dump(q)
        now_ms, read_by = q.clock_sample
        q.clock_sample = (now_ms - 10_000, read_by)  # Redis ran it 10 s after the caller stopped waiting
        with pytest.raises(redis.TimeoutError, match="nothing was stored"):
            q.admit(job_id="late", **admit)
        assert _dump(q) == before
        assert [r.id for r in q.claim(["on-time"], worker="w", gateway="g", lease_ms=10_000)] == []
        with pytest.raises(redis.TimeoutError, match="nothing was changed"):
            q.cancel("on-time")
        assert _dump(q) == before
        q.clock_sample = None  # no reading of Redis's clock: no deadline
        assert isinstance(q.admit(job_id="unbounded", **admit), Admitted)
        assert [r.id for r in q.claim(["on-time"], worker="w", gateway="g", lease_ms=10_000)] == ["on-time"]
        assert q.cancel("on-time").state == "dispatched"
        q.client.close()


class _ProxiedCluster(DurableCluster):
    """A DurableCluster whose gateways reach its redis-server through a HoldingProxy."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.proxy = HoldingProxy(self.redis_port)

    @property
    def redis_url(self) -> str:
        return self.proxy.url

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self.proxy.close()


def test_a_dispatch_given_up_on_leases_nothing_when_redis_runs_it_late(tmp_path, tiny_model_dir):
    """Redis stalls while a dispatch's claim is on its way: the gateway gives up on it (2 s) and sends the worker
    nothing. Redis then runs the claim it had received. The job must still be queued then, and go to the worker as
    its first attempt once Redis answers: not sit leased to a worker that never got it until the lease runs out
    (lease_s), come back as attempt 2 (one of max_attempts spent on nothing) and mark an innocent worker lost."""
    with _ProxiedCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, lease_s=10.0) as c:
        worker = Adversary(c.gateways["gw-0"][1], "wk-adv", slots=1)
        try:
            worker.load([], free=1)
            hold_script(c.redis, c.proxy, "claim", 4.0)
            with c.client("lab-co") as lab:
                job = lab.submit(prompt_token_ids=[1, 2], max_tokens=2, ignore_eos=True)
            wait_held(c.proxy, "claim", 10)
            d = worker.recv(P.DispatchJob, timeout_s=8.0, beat=[])  # well within the 10 s lease
            assert (d.job_id, d.attempt) == (job.id, 1), d
        finally:
            worker.close()


def test_a_cancel_answered_unavailable_is_not_run_late_behind_its_retry(tmp_path, tiny_model_dir):
    """Redis stalls while a cancel of a running job is on its way: the gateway gives up on it (2 s), tells the
    client "unavailable" and tells the worker nothing. Redis then runs the cancel it had received. The SDK's retry
    must find the job still running and cancel it (True, and the worker told to stop): not find it cancelled
    already (False: "not cancelled", to a caller whose cancel took) while the worker computes it to the end."""
    with _ProxiedCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, lease_s=10.0) as c:
        worker = Adversary(c.gateways["gw-0"][1], "wk-adv", slots=1)
        try:
            worker.load([], free=1)
            with c.client("lab-co", timeout_s=20.0) as lab:
                job = lab.submit(prompt_token_ids=[1, 2], max_tokens=50, ignore_eos=True)
                d = worker.recv(P.DispatchJob, beat=[])
                worker.load([d.job_id], free=0)
                hold_script(c.redis, c.proxy, "cancel", 3.0)
                assert lab.cancel(job.id) is True
                assert c.proxy.held.is_set()
            stop = worker.recv(P.CancelJob, timeout_s=10.0, beat=[d.job_id])
            assert (stop.job_id, stop.attempt) == (job.id, 1)
            assert c.state(job.id) == "cancelled"
        finally:
            worker.close()


def test_a_lease_settled_late_still_stops_the_attempt_that_lost_it(tmp_path, tiny_model_dir):
    """Redis stalls while a maintenance pass's requeue of an expired lease is on its way: the gateway gives up on it
    (2 s) and so tells nobody. Redis then ran the requeue it had received: the job was back in its queue, and no
    later pass found its lease to settle, so the worker that lost it was never told to stop (CancelJob) and
    computed it to the end beside the next attempt. A requeue run past its caller's deadline changes nothing; the
    next pass settles the lease and tells the worker."""
    with _ProxiedCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, lease_s=3.0) as c:
        worker = Adversary(c.gateways["gw-0"][1], "wk-adv", slots=1)
        try:
            worker.load([], free=1)
            with c.client("lab-co") as lab:
                job = lab.submit(prompt_token_ids=[1, 2], max_tokens=2, ignore_eos=True)
            d = worker.recv(P.DispatchJob, beat=[])
            assert (d.job_id, d.attempt) == (job.id, 1)
            hold_script(c.redis, c.proxy, "requeue", 4.0)
            # Alive, but its reports never list the job (a worker that lost it): its lease runs out.
            stop = worker.recv(P.CancelJob, timeout_s=30.0, beat=[])
            assert c.proxy.held.is_set()
            assert (stop.job_id, stop.attempt) == (job.id, 1), stop
        finally:
            worker.close()


def test_a_requeue_run_past_its_deadline_writes_nothing():
    """The queue layer of the test above: requeue.lua run after its caller gave up (a clock sample that places the
    moment in the past) settles no lease, and its caller hears a timeout; on time, it settles it."""
    with RedisServer() as s:
        q = RedisQueue(s.client(), KeySpace(prefix="late-rq"), tier_timeouts_s={t: None for t in ALL_TIERS})
        q.admit(job_id="j", tenant="a", tier_requested=Tier.P3, tier=Tier.P3, payload=b"x", idempotency_key=None,
                quota=None, drain_rate_per_s={})
        assert [r.id for r in q.claim(["j"], worker="w", gateway="g", lease_ms=1)] == ["j"]
        now_ms = q.server_ms() + 10
        with run_late(q):
            q.requeue_expired(now_ms, max_attempts=3)
        assert [(x.job_id, x.state, x.worker, x.attempt) for x in q.requeue_expired(now_ms, max_attempts=3)] == [
            ("j", "queued", "w", 1)]
        q.client.close()


def test_a_completion_stored_late_is_counted_by_the_gateway_that_stores_it(tmp_path, tiny_model_dir):
    """Redis stalls while a completion's script is on its way: the gateway gives up on it (2 s) and keeps the
    result to store again. Redis then ran the completion it had received, so the gateway's retry found the job done
    already and took its own completion for a stale one: no gateway counted the job finished (ts_jobs_finished_total,
    which a dashboard sums over gateways) and its wait was never learnt. A completion run past its caller's deadline
    changes nothing; the retry stores it and counts it, once."""
    metrics = f"127.0.0.1:{free_port()}"
    with _ProxiedCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, lease_s=10.0,
                         gateway_env={"TS_GATEWAY_METRICS_BIND": metrics}) as c:
        worker = Adversary(c.gateways["gw-0"][1], "wk-adv", slots=1)
        url = f"http://{metrics}/metrics"
        try:
            worker.load([], free=1)
            with c.client("lab-co") as lab:
                job = lab.submit(prompt_token_ids=[1, 2], max_tokens=2, ignore_eos=True)
            d = worker.recv(P.DispatchJob, beat=[])
            before = total(scrape(url), "ts_jobs_finished_total", state="done")
            hold_script(c.redis, c.proxy, "complete", 4.0)
            worker.send(P.JobFinished(d.job_id, d.attempt, "done", "length", 2, 0.0, 0.1, 0, None, [5, 6]))
            ack = worker.recv(P.JobFinishedAck, timeout_s=30.0, beat=[d.job_id])
            assert c.proxy.held.is_set()
            assert (ack.job_id, ack.attempt) == (job.id, 1)
            assert c.state(job.id) == "done"
            wait_for(lambda: total(scrape(url), "ts_jobs_finished_total", state="done") - before == 1, 10,
                     "the gateway to count the job it stored")
            assert total(scrape(url), "ts_gateway_events", event="stale_frames") == 0
        finally:
            worker.close()


def test_a_completion_run_past_its_deadline_writes_nothing():
    """The queue layer of the test above: complete.lua run after its caller gave up stores nothing (no final state,
    no drain count) and its caller hears a timeout; on time, it stores the result."""
    with RedisServer() as s:
        q = RedisQueue(s.client(), KeySpace(prefix="late-done"), tier_timeouts_s={t: None for t in ALL_TIERS})
        q.admit(job_id="j", tenant="a", tier_requested=Tier.P3, tier=Tier.P3, payload=b"x", idempotency_key=None,
                quota=None, drain_rate_per_s={})
        assert [r.id for r in q.claim(["j"], worker="w", gateway="g", lease_ms=10_000)] == ["j"]
        q.server_ms()
        result = dict(attempt=1, state="done", fields={"num_tokens": 1, "token_ids": b"\x91\x05"}, worker="w")
        with run_late(q):
            q.complete("j", **result)
        assert q.complete("j", **result)
        assert q.get("j").state == "done"
        q.client.close()


def test_a_queue_timeout_settled_late_is_counted(tmp_path, tiny_model_dir):
    """Redis stalls while a maintenance pass's expiry of a job past its queue timeout is on its way: the gateway
    gives up on it (2 s). Redis then ran the expiry it had received: the job was expired, and no later pass found
    it in the deadlines index, so no gateway counted it (ts_jobs_finished_total) or ended its queue span. An expiry
    run past its caller's deadline changes nothing; the next pass expires the job and counts it."""
    metrics = f"127.0.0.1:{free_port()}"
    env = {"TS_GATEWAY_METRICS_BIND": metrics, "TS_GATEWAY_TIER_TIMEOUTS_S": '{"P0": 30, "P1": 3, "P2": 300}'}
    with _ProxiedCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, gateway_env=env) as c:
        url = f"http://{metrics}/metrics"
        before = total(scrape(url), "ts_jobs_finished_total", state="expired")
        hold_script(c.redis, c.proxy, "expire", 4.0)
        with c.client("api-co", timeout_s=20.0) as api:
            job = api.submit(prompt_token_ids=[1, 2], max_tokens=2, tier="P1")
            wait_held(c.proxy, "expiry", 15)
            wait_for(lambda: c.state(job.id) == "expired", 10, "the job to expire")
            wait_for(lambda: total(scrape(url), "ts_jobs_finished_total", state="expired") - before == 1, 10,
                     "the gateway to count the job it expired")


def test_an_expiry_run_past_its_deadline_writes_nothing():
    """The queue layer of the test above: expire.lua run after its caller gave up expires nothing and its caller
    hears a timeout; on time, it expires the job."""
    with RedisServer() as s:
        q = RedisQueue(s.client(), KeySpace(prefix="late-exp"), tier_timeouts_s={t: 1.0 for t in ALL_TIERS})
        q.admit(job_id="j", tenant="a", tier_requested=Tier.P3, tier=Tier.P3, payload=b"x", idempotency_key=None,
                quota=None, drain_rate_per_s={})
        now_ms = q.server_ms() + 5_000
        with run_late(q):
            q.expire(now_ms)
        assert q.expire(now_ms) == ["j"]
        q.client.close()


def test_a_full_redis_still_extends_the_leases_of_live_workers():
    """Redis at maxmemory (noeviction) refuses a script's first write that may use memory, and lets the rest of a
    script that wrote already run. extend.lua's only write is a ZADD: refused, so no heartbeat kept a lease, while
    requeue.lua and claim.lua (a ZREM first) ran in full. Every running job lost its lease after lease_s, went to a
    worker again, and (its completions refused too) was dead-lettered after max_attempts, its workers alive."""
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as s:
        q = RedisQueue(s.client(), KeySpace(prefix="full-lease"), tier_timeouts_s={t: None for t in ALL_TIERS})
        q.admit(job_id="j", tenant="a", tier_requested=Tier.P3, tier=Tier.P3, payload=b"x", idempotency_key=None,
                quota=None, drain_rate_per_s={})
        assert [r.id for r in q.claim(["j"], worker="w", gateway="g", lease_ms=1_000)] == ["j"]
        filled = _fill(q.client)
        try:
            assert q.extend_leases("w", ["j"], None, 60_000) == 1
            assert q.requeue_expired(q.server_ms() + 2_000, max_attempts=3) == []
            assert q.extend_leases("other", ["j"], None, 60_000) == 0  # still only the holder's
        finally:
            _empty(q.client, filled)
        assert q.get("j").state == "dispatched" and q.get("j").attempt == 1
        q.client.close()


def test_a_running_job_keeps_its_lease_while_redis_is_full(tmp_path, tiny_model_dir):
    """The cluster view of the test above: Redis full for longer than a lease while a live worker runs a job (its
    reports list it). The gateway must not take it from the worker (CancelJob, attempt 2): it runs on, and its
    result is stored once Redis has room."""
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, lease_s=2.0) as c:
        worker = Adversary(c.gateways["gw-0"][1], "wk-adv", slots=1)
        try:
            worker.load([], free=1)
            with c.client("lab-co") as lab:
                job = lab.submit(prompt_token_ids=[1, 2], max_tokens=2, ignore_eos=True)
            d = worker.recv(P.DispatchJob, beat=[])
            filled = _fill(c.redis)
            try:
                for _ in range(6):  # three leases; a report a second, as a worker's heartbeats with some to spare
                    with pytest.raises(AssertionError, match="no CancelJob"):
                        worker.recv(P.CancelJob, timeout_s=1.0, beat=None)
                    worker.load([d.job_id], free=0)
                assert c.job(job.id)["attempt"] == b"1" and c.state(job.id) == "dispatched"
            finally:
                _empty(c.redis, filled)
            worker.send(P.JobFinished(d.job_id, d.attempt, "done", "length", 2, 0.0, 0.1, 0, None, [5, 6]))
            worker.recv(P.JobFinishedAck, timeout_s=30.0, beat=[d.job_id])
            wait_states(c, [job.id], {"done"}, 30)
        finally:
            worker.close()


def test_a_full_redis_still_takes_a_hand_back():
    """As for a lease's extension: release.lua's first write (an HSET) was refused by a full Redis, while the
    requeue of the lease it left to run out was not. A job a draining worker handed back waited out its lease, and
    the attempt counted against max_attempts (a rolling redeploy while Redis is full could dead-letter it)."""
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as s:
        q = RedisQueue(s.client(), KeySpace(prefix="full-release"), tier_timeouts_s={t: None for t in ALL_TIERS})
        q.admit(job_id="j", tenant="a", tier_requested=Tier.P3, tier=Tier.P3, payload=b"x", idempotency_key=None,
                quota=None, drain_rate_per_s={})
        assert [r.id for r in q.claim(["j"], worker="w", gateway="g", lease_ms=60_000)] == ["j"]
        filled = _fill(q.client)
        try:
            assert q.release("j", 1, "w")
            assert [(x.job_id, x.state) for x in q.requeue(["j"], q.server_ms(), max_attempts=1)] == [("j", "queued")]
        finally:
            _empty(q.client, filled)
        assert q.client.hget(q.keys.job("j"), "releases") == b"1"
        q.client.close()


def test_a_first_token_claim_redis_ran_after_its_gateway_gave_up_is_still_observed(tmp_path, tiny_model_dir):
    """Redis stalls while the token-log flush that claims a job's first token (first_token.lua) is on its way: the
    gateway gives up on it (2 s) and keeps the claim to ask again. Redis then ran the claim it had received, so the
    gateway's retry found the first token claimed already and dropped its observation: no gateway observed the
    job's time to first token (ts_time_to_first_token_seconds). A claim asked again is answered as the first was."""
    metrics = f"127.0.0.1:{free_port()}"
    with _ProxiedCluster(tmp_path, tiny_model_dir, gateways=1, workers=1, max_running=1, lease_s=10.0,
                         gateway_env={"TS_GATEWAY_METRICS_BIND": metrics}) as c:
        url = f"http://{metrics}/metrics"
        before = total(scrape(url), "ts_time_to_first_token_seconds_count", tier="P3")
        hold_script(c.redis, c.proxy, "first_token", 4.0)
        with c.client("batch-co", timeout_s=30.0) as b:
            job = b.submit(prompt_token_ids=[5, 6], max_tokens=40, ignore_eos=True, tier="P3", seed=3)
            wait_held(c.proxy, "claim", 30)
            assert len(job.result(timeout=60).token_ids) == 40
        assert c.job(job.id)["ttft_observed_by"] == b"gw-0", "not the case tested"
        wait_for(lambda: total(scrape(url), "ts_time_to_first_token_seconds_count", tier="P3") - before == 1, 10,
                 "the gateway to observe the first token it claimed")


def test_a_promotion_run_late_is_counted(tmp_path, tiny_model_dir):
    """Redis stalls while a maintenance pass's promotion of a P3 whose promised start fell due is on its way: the
    gateway gives up on it (2 s). Redis then ran the promotion it had received: the job moved to P2 and left the
    promises index, so no later pass found it and no gateway counted it (ts_promotions_total). A promotion run past
    its caller's deadline changes nothing; the next pass promotes the job and counts it."""
    metrics = f"127.0.0.1:{free_port()}"
    env = {"TS_GATEWAY_METRICS_BIND": metrics, "TS_GATEWAY_PROMISE_LEAD_S": "1000"}  # each promise due at once
    with _ProxiedCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, gateway_env=env) as c:
        worker = Adversary(c.gateways["gw-0"][1], "wk-adv", slots=1)  # a worker to promise on, with no slot free
        url = f"http://{metrics}/metrics"
        try:
            worker.load([], free=0)
            wait_for(lambda: c.client("batch-co").info().workers, 10, "the gateway to know the worker")
            before = total(scrape(url), "ts_promotions_total", tier="P3")
            hold_script(c.redis, c.proxy, "promote", 4.0)
            with c.client("batch-co", timeout_s=20.0) as batch:
                job = batch.submit(prompt_token_ids=[1, 2], max_tokens=2, tier="P3")
            assert "promise_at_ms" in c.job(job.id), "no promise was made: nothing is tested"
            wait_held(c.proxy, "promotion", 15)
            wait_for(lambda: c.job(job.id)["tier"] == b"P2", 10, "the job to be promoted")
            wait_for(lambda: total(scrape(url), "ts_promotions_total", tier="P3") - before == 1, 10,
                     "the gateway to count the job it promoted")
        finally:
            worker.close()


def test_a_promotion_run_past_its_deadline_writes_nothing():
    """The queue layer of the test above: promote.lua run after its caller gave up moves nothing and its caller
    hears a timeout; on time, it promotes the job."""
    with RedisServer() as s:
        q = RedisQueue(s.client(), KeySpace(prefix="late-prom"), tier_timeouts_s={t: None for t in ALL_TIERS})
        q.admit(job_id="j", tenant="a", tier_requested=Tier.P3, tier=Tier.P3, payload=b"x", idempotency_key=None,
                quota=None, drain_rate_per_s={}, estimate_s=1.0, promise_s=0.0)
        now_ms = q.server_ms() + 1_000
        with run_late(q):
            q.promote(now_ms)
        assert q.promote(now_ms) == [("j", Tier.P3)]
        q.client.close()
