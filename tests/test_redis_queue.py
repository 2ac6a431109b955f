"""The Redis queue layer against a real redis-server (common.redis_server).

One server for the module; each test works under its own key prefix (never FLUSHALL).
Time is injected (now_ms), so nothing sleeps.
"""

from __future__ import annotations

import math
import random
import subprocess
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgpack
import pytest
import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from common import redis_server as redis_server_mod
from common.errors import DuplicateRequest, IncompleteResult
from common.ports import free_port
from common.redis_keys import LUA_DIR, KeySpace, load_scripts
from common.redis_server import RedisServer, RedisServerError, find_redis_server
from common.tiers import ALL_TIERS, Tier
from gateway.queue_reads import MIN_DRAIN_RATE_PER_S
from gateway.redis_queue import (
    DEFAULT_TIER_TIMEOUTS_S,
    Admitted,
    IdempotencyMismatch,
    JobState,
    Overloaded,
    QuotaRefused,
    QuotaSpec,
    RedisQueue,
    Settled,
)

T0 = 1_700_000_000_000  # injected "now" in ms
WHOLE = {"num_tokens": 2, "token_ids": msgpack.packb([7, 8])}  # a done result with all its tokens
P0, P1, P2, P3 = Tier.P0, Tier.P1, Tier.P2, Tier.P3
ALL = list(ALL_TIERS)
NO_RETRY = Retry(NoBackoff(), 0)  # redis-py retries failed connections by default, with backoff


@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


@pytest.fixture
def client(server):
    c = server.client()
    yield c
    c.close()


@pytest.fixture
def keys():
    return KeySpace(prefix=f"test-{uuid.uuid4().hex[:10]}")


@pytest.fixture
def queue(client, keys):
    return RedisQueue(client, keys, tier_timeouts_s=DEFAULT_TIER_TIMEOUTS_S)


def admit(q: RedisQueue, job_id: str, tier: Tier = P1, *, now_ms: int = T0, tenant: str = "acme",
          key: str | None = None, quota: QuotaSpec | None = None, rates=None,
          requested: Tier | None = None):  # fmt: skip
    return q.admit(job_id=job_id, tenant=tenant, tier_requested=requested or tier, tier=tier,
                   payload=b"\x93\x01payload-" + job_id.encode(), now_ms=now_ms, idempotency_key=key,
                   quota=quota, drain_rate_per_s=rates if rates is not None else {t: 10.0 for t in ALL})  # fmt: skip


def snapshot(client: redis.Redis, keys: KeySpace) -> dict[bytes, tuple[bytes, bool]]:
    """Every key under the prefix: serialized value and whether it has a TTL."""
    return {k: (client.dump(k), client.pttl(k) > 0) for k in client.scan_iter(match=keys.scan_pattern(), count=1000)}


def zmembers(client, key) -> list[str]:
    return [m.decode() for m in client.zrange(key, 0, -1)]


# --- the server helper and the key space -------------------------------------------------------
def test_find_redis_server_returns_an_executable_or_says_why(monkeypatch):
    path = find_redis_server()
    assert Path(path).is_file()
    assert b"Redis server v=" in subprocess.run([path, "--version"], capture_output=True, check=True, timeout=10).stdout
    monkeypatch.setattr(redis_server_mod.shutil, "which", lambda name: None)
    monkeypatch.setattr(redis_server_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RedisServerError, match="no redis-server found"):
        find_redis_server()


def test_redis_server_given_port_password_appendonly_and_stop():
    port = free_port()
    with RedisServer(port=port, password="s3cret:/@", appendonly=True) as s:
        assert s.port == port and s.url == f"redis://:s3cret%3A%2F%40@127.0.0.1:{port}/0"
        assert redis.Redis.from_url(s.url).ping()
        c = s.client()
        c.set(b"k", b"v")
        assert c.get(b"k") == b"v"
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=port, retry=NO_RETRY).set(b"k", b"x")
        assert c.config_get("appendonly")["appendonly"] in (b"yes", "yes")
        proc, workdir = s._proc, s.dir
        c.close()
    assert proc.poll() is not None and not workdir.exists() and not s.running
    with pytest.raises(redis.ConnectionError):
        redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1, retry=NO_RETRY).ping()


def test_redis_server_reports_a_port_in_use():
    with RedisServer() as first:
        with pytest.raises(RedisServerError, match="exited"):
            RedisServer(port=first.port, startup_timeout_s=5).start()


def test_keyspace_shares_one_slot_and_validates():
    ks = KeySpace(prefix="ts")
    assert ks.queue(P0) == "ts:{c}:q:P0"
    names = [*ks.queues(), ks.job("j1"), ks.inflight, ks.dead, ks.idem("a:b", "k:1"), ks.quota("t"),
             ks.drain, ks.aging, ks.deadlines, ks.promises]  # fmt: skip
    assert len({key_slot(n.encode()) for n in names}) == 1
    assert ks.idem("a:b", "c") != ks.idem("a", "b:c")  # tenant is escaped, so no collision
    for bad in ("", "x{y}"):
        with pytest.raises(ValueError):
            KeySpace(prefix=bad)


def test_lua_scripts_have_headers_and_load_once(client):
    scripts = load_scripts(client)
    assert set(scripts) == {"admit", "peek", "claim", "extend", "complete", "requeue", "age", "expire", "cancel",
                            "promote", "release", "first_token", "first_prefill",
                            "append_tokens", "note_drained", "stop_at", "model_pin"}
    assert load_scripts(client) is scripts
    for path in LUA_DIR.glob("*.lua"):
        header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("--"))
        assert "KEYS[" in header and "ARGV[" in header and "Returns" in header, path.name


# --- admission ---------------------------------------------------------------------------------
def test_admit_stores_the_job_and_estimates_from_tiers_ahead(queue, client, keys):
    rates = {P0: 2.0, P1: 1.0, P2: 5.0, P3: 5.0}
    for i in range(3):
        assert isinstance(admit(queue, f"p0-{i}", P0, now_ms=T0 + i, rates=rates), Admitted)
    for i in range(2):
        admit(queue, f"p1-{i}", P1, now_ms=T0 + i, rates=rates)
    for i in range(4):
        admit(queue, f"p2-{i}", P2, now_ms=T0 + i, rates=rates)  # lower tier: not ahead of a P1 job
    got = admit(queue, "new", P1, now_ms=T0 + 100, rates=rates, requested=P2)
    assert got == Admitted("new", P1, 3 / 2.0 + 2 / 1.0, False, 5)
    job = queue.get("new")
    assert (job.state, job.tier, job.tier_requested, job.tier_granted) == (JobState.QUEUED, P1, P2, P1)
    assert (job.enqueued_at_ms, job.tier_since_ms, job.attempt, job.estimate_s) == (T0 + 100, T0 + 100, 0, 3.5)
    assert job.payload == b"\x93\x01payload-new" and job.deadline_ms == T0 + 100 + 60_000
    assert client.zscore(keys.queue(P1), "new") == T0 + 100
    assert queue.depths() == {P0: 3, P1: 3, P2: 4, P3: 0}
    # Missing or zero rates are floored.
    assert admit(queue, "p0-x", P0, rates={}).estimated_wait_s == pytest.approx(3 / MIN_DRAIN_RATE_PER_S)
    with pytest.raises(DuplicateRequest):
        admit(queue, "new", P3)


def test_idempotent_admission_returns_the_first_job_and_changes_nothing(queue, client, keys):
    quota = QuotaSpec(rate_per_s=1.0, burst=1)
    admit(queue, "blocker", P0, key="other", tenant="t2")
    first = admit(queue, "j1", P0, key="req-1", quota=quota)
    assert first == Admitted("j1", P0, pytest.approx(0.1), False, 1)
    assert 0 < client.pttl(keys.idem("acme", "req-1")) <= 86_400_000
    before = snapshot(client, keys)
    # Same key, new job id, bucket already empty: the duplicate wins, nothing is charged or stored.
    again = admit(queue, "j2", P0, now_ms=T0 + 5, key="req-1", quota=quota)
    assert again == Admitted("j1", P0, pytest.approx(1 / 10.0), True, 1)
    assert snapshot(client, keys) == before and queue.get("j2") is None
    # The key is per tenant.
    assert admit(queue, "j3", P1, key="req-1", tenant="globex").duplicate is False
    # A duplicate of a job no longer queued has no position.
    queue.claim(["j1"], worker="w", gateway="g", now_ms=T0, lease_ms=1000)
    assert admit(queue, "j4", P0, key="req-1") == Admitted("j1", P0, 0.0, True, None)
    # The TTL is configurable.
    short = RedisQueue(client, keys, tier_timeouts_s=DEFAULT_TIER_TIMEOUTS_S, idempotency_ttl_s=60)
    admit(short, "j5", P2, key="req-2")
    assert 0 < client.pttl(keys.idem("acme", "req-2")) <= 60_000


def test_an_idempotency_key_reused_for_another_request_is_refused_and_changes_nothing(queue, client, keys):
    """A key stands for one request: its retries get the first job; another request under it (another prompt,
    other sampling) gets a refusal naming that job, never the first job's result as if it were its own."""
    def with_fp(job_id, fp, **kw):
        return queue.admit(job_id=job_id, tenant="acme", tier_requested=P2, tier=P2, payload=b"x", now_ms=T0,
                           idempotency_key="req-1", quota=None, drain_rate_per_s={t: 10.0 for t in ALL},
                           fingerprint=fp, **kw)

    first = with_fp("j1", "fp-a")
    assert not first.duplicate
    assert with_fp("j2", "fp-a") == Admitted("j1", P2, 0.0, True, 0)  # a retry
    before = snapshot(client, keys)
    assert with_fp("j3", "fp-b") == IdempotencyMismatch("j1")
    assert snapshot(client, keys) == before and queue.get("j3") is None
    # A caller that sends no fingerprint is told the first job, as before fingerprints existed.
    assert with_fp("j4", None).job_id == "j1"
    # A key stored before fingerprints (the job id alone) matches any request.
    client.set(keys.idem("acme", "req-old"), "j1")
    old = queue.admit(job_id="j5", tenant="acme", tier_requested=P2, tier=P2, payload=b"x", now_ms=T0,
                      idempotency_key="req-old", quota=None, drain_rate_per_s={}, fingerprint="fp-c")
    assert old.job_id == "j1" and old.duplicate
    with pytest.raises(ValueError):
        with_fp("j6", "has space")


def test_p0_quota_refuses_then_refills_over_time_and_refusal_changes_nothing(queue, client, keys):
    quota = QuotaSpec(rate_per_s=1.0, burst=2)
    assert isinstance(admit(queue, "a", P0, quota=quota, key="ka"), Admitted)
    assert isinstance(admit(queue, "b", P0, quota=quota), Admitted)
    before = snapshot(client, keys)
    assert admit(queue, "c", P0, quota=quota, key="kc") == QuotaRefused(pytest.approx(1.0))
    assert admit(queue, "c", P0, now_ms=T0 + 500, quota=quota) == QuotaRefused(pytest.approx(0.5))
    assert snapshot(client, keys) == before  # no job, no idempotency key, no charge
    assert isinstance(admit(queue, "c", P0, now_ms=T0 + 1000, quota=quota, key="kc"), Admitted)
    assert admit(queue, "d", P0, now_ms=T0 + 1000, quota=quota) == QuotaRefused(pytest.approx(1.0))
    # The bucket key expires when it would be full again (a missing bucket is full).
    assert 0 < client.pttl(keys.quota("acme")) <= 2001
    # Another tenant has its own bucket; other tiers are never charged.
    assert isinstance(admit(queue, "e", P0, tenant="globex", quota=quota), Admitted)
    tokens = client.hget(keys.quota("acme"), "tokens")
    assert isinstance(admit(queue, "f", P1, now_ms=T0 + 1000, quota=quota), Admitted)
    assert client.hget(keys.quota("acme"), "tokens") == tokens


def test_p0_quota_downgrades_to_p1(queue, client, keys):
    quota = QuotaSpec(rate_per_s=0.5, burst=1, on_exhausted="downgrade")
    assert admit(queue, "a", P0, quota=quota).tier is P0
    got = admit(queue, "b", P0, now_ms=T0 + 10, quota=quota)
    assert isinstance(got, Admitted) and got.tier is P1 and got.position == 1  # a (P0) is ahead
    job = queue.get("b")
    assert (job.tier, job.tier_requested, job.tier_granted, job.deadline_ms) == (P1, P0, P1, T0 + 10 + 60_000)
    assert client.zscore(keys.queue(P1), "b") == T0 + 10 and queue.depths()[P0] == 1


def test_overload_refuses_with_the_estimate_and_changes_nothing(queue, client, keys):
    quota = QuotaSpec(rate_per_s=1.0, burst=10)
    for i in range(4):  # 3 ahead at the floor rate: 30 s, exactly the P0 timeout, still admitted
        assert isinstance(admit(queue, f"j{i}", P0, now_ms=T0 + i, rates={}, quota=quota), Admitted)
    before = snapshot(client, keys)
    got = admit(queue, "late", P0, now_ms=T0 + 5, rates={}, quota=quota, key="k")
    assert got == Overloaded(pytest.approx(4 / MIN_DRAIN_RATE_PER_S), P0, 30.0)
    assert snapshot(client, keys) == before  # quota not charged, no job, no idempotency key
    # A downgraded job is judged against P1's timeout.
    spent = QuotaSpec(rate_per_s=0.001, burst=1, on_exhausted="downgrade")
    assert admit(queue, "x", P0, tenant="t", quota=spent).tier is P0
    for i in range(3):
        assert isinstance(admit(queue, f"p1-{i}", P1), Admitted)
    before = snapshot(client, keys)
    assert admit(queue, "y", P0, tenant="t", quota=spent, rates={}) == Overloaded(pytest.approx(80.0), P1, 60.0)
    assert snapshot(client, keys) == before
    # P3 has no timeout: never refused.
    assert isinstance(admit(queue, "z", P3, rates={}), Admitted)



def test_a_downgraded_p0_is_shed_and_told_its_wait_as_a_p1_not_as_the_p0_it_asked_for(queue, client, keys):
    # The gateway's estimate for a P0 counts no P1 job: one the quota downgrades into a deep P1 queue was admitted
    # on it, told a P0's wait, and expired in that queue instead of being refused.
    spent = QuotaSpec(rate_per_s=0.001, burst=1, on_exhausted="downgrade")
    assert queue.admit(job_id="x", tenant="t", tier_requested=P0, tier=P0, payload=b"x", idempotency_key=None,
                       quota=spent, drain_rate_per_s={}, estimate_s=0.5, downgrade_estimate_s=99.0).tier is P0

    def again(job_id: str, **kw):
        return queue.admit(job_id=job_id, tenant="t", tier_requested=P0, tier=P0, payload=b"y", idempotency_key="k",
                           quota=spent, drain_rate_per_s={t: 10.0 for t in ALL}, estimate_s=0.5, **kw)

    before = snapshot(client, keys)
    assert again("y", downgrade_estimate_s=80.0) == Overloaded(80.0, P1, 60.0)
    assert snapshot(client, keys) == before  # nothing stored, nothing charged
    got = again("y", downgrade_estimate_s=12.5)
    assert isinstance(got, Admitted) and got.tier is P1 and got.estimated_wait_s == 12.5
    assert queue.get("y").estimate_s == 12.5
    # Without the P1 estimate, the drain rates estimate it (x and y ahead, at 10 jobs/s each), not the P0 one.
    got = queue.admit(job_id="z", tenant="t", tier_requested=P0, tier=P0, payload=b"z", idempotency_key=None,
                      quota=spent, drain_rate_per_s={t: 10.0 for t in ALL}, estimate_s=0.5)
    assert isinstance(got, Admitted) and got.tier is P1 and got.estimated_wait_s == pytest.approx(0.2)

# --- dispatch ----------------------------------------------------------------------------------
def test_peek_orders_by_tier_then_enqueue_time(queue):
    admit(queue, "a", P3, now_ms=T0 + 1)
    admit(queue, "b", P0, now_ms=T0 + 2)
    admit(queue, "c", P1, now_ms=T0)
    admit(queue, "d", P0, now_ms=T0 + 1)
    assert queue.peek(ALL, 10) == ["d", "b", "c", "a"]
    assert queue.peek(ALL, 3) == ["d", "b", "c"]
    assert queue.peek([P3, P1], 10) == ["c", "a"]
    assert queue.peek([], 5) == [] and queue.peek(ALL, 0) == []


def test_claim_leases_queued_jobs_once(queue, client, keys):
    admit(queue, "a", P0)
    admit(queue, "b", P2)
    got = queue.claim(["b", "unknown", "a"], worker="w1", gateway="g1", now_ms=T0 + 50, lease_ms=5000)
    assert [j.id for j in got] == ["b", "a"]
    for job in got:
        assert (job.state, job.attempt, job.worker, job.gateway) == (JobState.DISPATCHED, 1, "w1", "g1")
        assert job.dispatched_at_ms == T0 + 50 and job.payload.startswith(b"\x93\x01")
        assert client.zscore(keys.inflight, job.id) == T0 + 5050
    assert queue.depths() == {t: 0 for t in ALL}
    assert client.zcard(keys.aging) == 0 and client.zcard(keys.deadlines) == 0
    assert queue.claim(["a", "b"], worker="w2", gateway="g2", now_ms=T0 + 60, lease_ms=5000) == []
    assert queue.claim([], worker="w2", gateway="g2", now_ms=T0, lease_ms=1) == []


def test_concurrent_claims_from_two_gateways_claim_each_job_exactly_once(server, keys):
    clients = [server.client(), server.client()]
    queues = [RedisQueue(c, keys, tier_timeouts_s=DEFAULT_TIER_TIMEOUTS_S) for c in clients]
    job_ids = [f"j{i:03d}" for i in range(300)]
    for i, job_id in enumerate(job_ids):
        admit(queues[0], job_id, ALL[i % 4], now_ms=T0 + i)
    start = threading.Barrier(16, timeout=10)

    def worker(n: int) -> list[str]:
        # Every thread tries every job (in its own seeded order), so each job is contended
        # 16 times over, whatever the thread scheduling.
        q, mine = queues[n % 2], random.Random(n).sample(job_ids, len(job_ids))
        start.wait()
        claimed: list[str] = []
        for i in range(0, len(mine), 20):
            got = q.claim(mine[i : i + 20], worker=f"w{n}", gateway=f"g{n % 2}", now_ms=T0, lease_ms=60_000)
            claimed += [j.id for j in got]
        return claimed

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(worker, range(16), timeout=60))
    everything = [j for r in results for j in r]
    assert sorted(everything) == job_ids  # each job exactly once
    assert queues[1].peek(ALL, 10) == []
    assert queues[1].claim(job_ids, worker="x", gateway="g", now_ms=T0, lease_ms=1) == []
    for n, claimed in enumerate(results):
        assert all(r.worker == f"w{n}" and r.attempt == 1 for r in map(queues[1].get, claimed))
    for c in clients:
        c.close()


def test_extend_leases_only_for_the_workers_jobs(queue, client, keys):
    for j in ("a", "b", "c", "d"):
        admit(queue, j, P1)
    queue.claim(["a", "b"], worker="w1", gateway="g", now_ms=T0, lease_ms=1000)
    queue.claim(["c"], worker="w2", gateway="g", now_ms=T0, lease_ms=1000)
    assert queue.extend_leases("w1", ["a", "b", "c", "d", "nope"], T0 + 500, 1000) == 2
    assert [client.zscore(keys.inflight, j) for j in "abc"] == [T0 + 1500, T0 + 1500, T0 + 1000]
    assert client.zscore(keys.inflight, "d") is None
    assert queue.extend_leases("w1", [], T0, 1000) == 0


def test_complete_records_the_outcome_and_drain_stats(queue, client, keys):
    for j in ("a", "b", "c"):
        admit(queue, j, P0)
    queue.claim(["a", "b", "c"], worker="w", gateway="g", now_ms=T0, lease_ms=10_000)
    fields = {**WHOLE, "text": "hi", "tokens": 7, "latency_s": 0.25, "blob": b"\x00\xff"}
    assert queue.complete("a", attempt=1, state="done", now_ms=T0 + 1000, worker="w", fields=fields)
    job = queue.get("a")
    assert (job.state, job.finished_at_ms, job.payload) == (JobState.DONE, T0 + 1000, None)
    assert job.result == {"num_tokens": b"2", "token_ids": msgpack.packb([7, 8]), "text": b"hi", "tokens": b"7",
                          "latency_s": b"0.25", "blob": b"\x00\xff"}
    assert client.zscore(keys.inflight, "a") is None
    assert 0 < client.pttl(keys.job("a")) <= 86_400_000
    assert queue.complete("b", attempt=1, state="failed", now_ms=T0 + 2000, worker="w",
                          fields={"reason": "oom", "n": 0})
    job = queue.get("b")
    assert (job.state, job.reason, job.result) == (JobState.FAILED, "oom", {"n": b"0"})
    assert not queue.complete("b", attempt=1, state="done", now_ms=T0 + 2001, worker="w", fields=WHOLE)  # already final
    stats = queue.drain_stats(T0 + 2000)
    tau = 30.0
    assert stats[P0].completed == 2 and stats[P1].completed == 0
    assert stats[P0].rate_per_s == pytest.approx(math.exp(-1 / tau) / tau + 1 / tau)
    assert queue.drain_stats(T0 + 32_000)[P0].rate_per_s == pytest.approx(stats[P0].rate_per_s * math.exp(-1))
    with pytest.raises(ValueError):
        queue.complete("c", attempt=1, state="expired", now_ms=T0, worker="w", fields={})
    with pytest.raises(ValueError):
        queue.complete("c", attempt=1, state="done", now_ms=T0, worker="w", fields={"state": "x"})


def test_stale_completion_from_an_expired_lease_changes_nothing(queue, client, keys):
    admit(queue, "a", P2)
    queue.claim(["a"], worker="w1", gateway="g", now_ms=T0, lease_ms=1000)
    assert [s[:2] for s in queue.requeue_expired(T0 + 1000, max_attempts=3)] == [("a", "queued")]
    before = snapshot(client, keys)
    late = {**WHOLE, "text": "late"}
    assert not queue.complete("a", attempt=1, state="done", now_ms=T0 + 1100, worker="w1", fields=late)
    assert snapshot(client, keys) == before
    [again] = queue.claim(["a"], worker="w2", gateway="g", now_ms=T0 + 1200, lease_ms=1000)
    assert again.attempt == 2
    before = snapshot(client, keys)
    assert not queue.complete("a", attempt=1, state="done", now_ms=T0 + 1300, worker="w1", fields=late)
    # Fencing: the right attempt number from a worker that does not hold the lease changes nothing either.
    assert not queue.complete("a", attempt=2, state="done", now_ms=T0 + 1300, worker="w1", fields=late)
    assert snapshot(client, keys) == before
    assert queue.complete("a", attempt=2, state="done", now_ms=T0 + 1300, worker="w2", fields={**WHOLE, "text": "ok"})
    # The lost attempt is recorded for the trace of the next dispatch.
    assert queue.get("a").result == {**{k: str(v).encode() if isinstance(v, int) else v for k, v in WHOLE.items()},
                                     "text": b"ok", "requeued_at_ms": str(T0 + 1000).encode(), "lost_worker": b"w1"}


@pytest.mark.parametrize("fields", [
    {}, {"num_tokens": 3}, {"num_tokens": 3, "token_ids": msgpack.packb([])},
    {"num_tokens": 3, "token_ids": msgpack.packb([1, 2])}, {"num_tokens": 1, "token_ids": b"\xc1not-msgpack"},
    {"num_tokens": 0, "token_ids": msgpack.packb([5])},
])
def test_done_without_all_its_tokens_is_refused_and_changes_nothing(queue, client, keys, fields):
    """Issue 9, defects 1 and 2 at the store: a short, empty or missing token list is never a done."""
    admit(queue, "a", P1)
    queue.claim(["a"], worker="w", gateway="g", now_ms=T0, lease_ms=60_000)
    before = snapshot(client, keys)
    with pytest.raises(IncompleteResult):
        queue.complete("a", attempt=1, state="done", now_ms=T0 + 1, worker="w", fields=fields)
    assert snapshot(client, keys) == before
    # failed needs no tokens: that is how the gateway reports an incomplete result
    assert queue.complete("a", attempt=1, state="failed", now_ms=T0 + 1, worker="w", fields={"reason": "short"})


def test_without_an_injected_now_every_script_uses_the_redis_clock(queue, client, keys):
    """Issue 9, defect 6: scores, leases, quotas and finish times come from Redis TIME, not the caller."""
    sec, usec = client.time()
    server_now = int(sec) * 1000 + int(usec) // 1000
    assert queue.admit(job_id="a", tenant="t", tier_requested=P0, tier=P0, payload=b"x", idempotency_key=None,
                       quota=QuotaSpec(1.0, 2), drain_rate_per_s={}).tier is P0
    score = client.zscore(keys.queue(P0), "a")
    assert abs(score - server_now) < 5_000
    assert abs(int(client.hget(keys.quota("t"), "ts_ms")) - server_now) < 5_000
    assert abs(int(client.hget(keys.job("a"), "deadline_ms")) - (server_now + 30_000)) < 5_000
    [job] = queue.claim(["a"], worker="w", gateway="g", lease_ms=60_000)
    assert abs(client.zscore(keys.inflight, "a") - (server_now + 60_000)) < 5_000
    assert queue.extend_leases("w", ["a"], None, 120_000) == 1
    assert abs(client.zscore(keys.inflight, "a") - (server_now + 120_000)) < 5_000
    assert queue.complete("a", attempt=1, state="done", worker="w", fields=WHOLE)
    assert abs(queue.get("a").finished_at_ms - server_now) < 5_000
    assert abs(queue.server_ms() - server_now) < 5_000


def test_requeue_keeps_the_original_score_then_dead_letters(queue, client, keys):
    admit(queue, "a", P3, now_ms=T0)
    admit(queue, "b", P3, now_ms=T0 + 5)
    admit(queue, "held", P1, now_ms=T0)
    queue.claim(["a"], worker="w", gateway="g", now_ms=T0 + 10, lease_ms=1000)
    queue.claim(["held"], worker="w", gateway="g", now_ms=T0 + 10, lease_ms=60_000)
    assert queue.requeue_expired(T0 + 1009, max_attempts=2) == []
    assert [s[:2] for s in queue.requeue_expired(T0 + 1010, max_attempts=2)] == [("a", "queued")]
    assert client.zscore(keys.queue(P3), "a") == T0 and queue.peek([P3], 10) == ["a", "b"]
    job = queue.get("a")
    assert (job.state, job.attempt, job.worker, job.gateway) == (JobState.QUEUED, 1, None, None)
    assert client.zscore(keys.aging, "a") == T0  # agable again, with its old tier_since
    queue.claim(["a"], worker="w", gateway="g", now_ms=T0 + 2000, lease_ms=1000)
    assert queue.requeue_expired(T0 + 3000, max_attempts=2) == [Settled("a", "dead", "w", 2)]
    job = queue.get("a")
    assert (job.state, job.attempt, job.reason) == (JobState.DEAD, 2, "lease expired 2 times")
    # Kept for the operator (payload included), but not for ever: it expires like a finished job's result.
    assert job.payload is not None and 0 < client.pttl(keys.job("a")) <= 86_400_000
    assert client.zscore(keys.dead, "a") == T0 + 3000
    assert client.zscore(keys.inflight, "a") is None and queue.peek(ALL, 10) == ["b"]
    assert queue.get("held").state is JobState.DISPATCHED


def test_a_released_attempt_is_requeued_at_once_and_does_not_count_against_max_attempts(queue, client, keys):
    admit(queue, "a", P3, now_ms=T0)
    queue.claim(["a"], worker="w", gateway="g", now_ms=T0 + 10, lease_ms=60_000)
    # Only the worker holding that attempt's lease may hand it back: anything else changes nothing.
    before = snapshot(client, keys)
    assert not queue.release("a", 1, "other-worker")
    assert not queue.release("a", 2, "w")  # an attempt that is not the current one
    assert not queue.release("nope", 1, "w")
    assert snapshot(client, keys) == before
    assert queue.release("a", 1, "w")
    assert not queue.release("a", 1, "w")  # once
    # A report the worker sent before the release, read after it, must not extend the lease again.
    assert queue.extend_leases("w", ["a"], T0 + 20, 60_000) == 0
    assert queue.requeue(["a"], T0 + 20, max_attempts=1) == [Settled("a", "queued", "w", 1)]
    job = queue.get("a")
    assert (job.state, job.attempt, job.worker) == (JobState.QUEUED, 1, None)
    assert client.zscore(keys.queue(P3), "a") == T0 and client.zscore(keys.inflight, "a") is None
    # max_attempts 1, and attempt 2 is its first that counts: lost to its lease, it is dead only then.
    queue.claim(["a"], worker="w2", gateway="g", now_ms=T0 + 30, lease_ms=1000)
    assert queue.extend_leases("w2", ["a"], T0 + 40, 1000) == 1  # a new attempt's lease extends as ever
    assert queue.requeue_expired(T0 + 2000, max_attempts=1) == [Settled("a", "dead", "w2", 2)]
    assert queue.get("a").reason == "lease expired 1 times"
    assert "releases" not in queue.get("a").result  # queue bookkeeping, not a result field


def test_aging_moves_up_one_tier_ahead_of_newer_jobs_never_into_p0(queue, client, keys):
    interval = 60_000
    admit(queue, "a", P3, now_ms=T0)
    admit(queue, "b", P2, now_ms=T0 + 10_000)
    admit(queue, "c", P1, now_ms=T0 + 1)
    assert queue.age(T0 + interval - 1, interval) == []
    assert queue.age(T0 + interval, interval) == [("a", P3, P2)]
    assert queue.peek([P2], 10) == ["a", "b"]  # the aged job keeps its score: ahead of newer b
    job = queue.get("a")
    assert (job.tier, job.tier_since_ms, job.tier_granted) == (P2, T0 + interval, P3)
    assert client.zscore(keys.queue(P2), "a") == T0
    assert queue.age(T0 + 70_000, interval) == [("b", P2, P1)]
    assert queue.age(T0 + 2 * interval, interval) == [("a", P2, P1)]
    assert queue.peek([P1], 10) == ["a", "c", "b"]
    assert queue.age(T0 + 100 * interval, interval) == []  # P1 never moves into P0
    assert queue.depths() == {P0: 0, P1: 3, P2: 0, P3: 0} and client.zcard(keys.aging) == 0
    # A dispatched job does not age.
    admit(queue, "d", P3, now_ms=T0)
    queue.claim(["d"], worker="w", gateway="g", now_ms=T0, lease_ms=1000)
    assert queue.age(T0 + 100 * interval, interval) == []


def test_expire_uses_the_timeout_of_the_tier_granted_at_admission(queue, client, keys):
    admit(queue, "a", P0, now_ms=T0)
    admit(queue, "never", P3, now_ms=T0)
    admit(queue, "c", P2, now_ms=T0)
    admit(queue, "held", P0, now_ms=T0)
    queue.claim(["held"], worker="w", gateway="g", now_ms=T0, lease_ms=10**9)
    assert queue.expire(T0 + 29_999) == []
    assert queue.expire(T0 + 30_000) == ["a"]
    job = queue.get("a")
    assert (job.state, job.finished_at_ms) == (JobState.EXPIRED, T0 + 30_000)
    assert job.reason == "queue timeout of 30s for tier P0 exceeded"
    assert job.payload is None and client.zscore(keys.queue(P0), "a") is None
    assert queue.age(T0 + 60_000, 60_000) == [("c", P2, P1), ("never", P3, P2)]
    assert queue.expire(T0 + 299_999) == []  # c now sits in P1 (60 s) but was granted P2 (300 s)
    assert queue.expire(T0 + 300_000) == ["c"]
    assert queue.get("c").reason == "queue timeout of 300s for tier P2 exceeded"
    assert queue.expire(T0 + 10**8) == []
    assert queue.get("never").state is JobState.QUEUED and queue.get("held").state is JobState.DISPATCHED


@pytest.mark.parametrize("handed_back", [False, True])
def test_a_requeued_job_gets_its_queue_timeout_again_from_the_requeue(queue, client, keys, handed_back):
    # The queue timeout bounds a wait for a slot. A job that got one, ran past its admission's deadline and lost
    # it (its worker died, or drained and handed it back) went back to its queue with that deadline still in the
    # index: the next maintenance pass expired it, streamed tokens and all, instead of resuming it elsewhere.
    admit(queue, "a", P0, now_ms=T0)
    queue.claim(["a"], worker="w", gateway="g", now_ms=T0 + 10, lease_ms=1000)
    queue.extend_leases("w", ["a"], T0 + 40_000, 1000)  # it runs on past its 30 s deadline
    if handed_back:
        assert queue.release("a", 1, "w")
    assert [s[:2] for s in queue.requeue_expired(T0 + 41_000, max_attempts=3)] == [("a", "queued")]
    assert queue.expire(T0 + 41_001) == [] and queue.get("a").state is JobState.QUEUED
    assert queue.expire(T0 + 41_000 + 29_999) == []
    assert queue.expire(T0 + 41_000 + 30_000) == ["a"]  # 30 s more without a slot: that is a queue timeout
    assert queue.get("a").reason == "queue timeout of 30s for tier P0 exceeded"
    # Requeued before its deadline, it keeps at least the rest of its wait, and the reason its tier's timeout.
    admit(queue, "b", P1, now_ms=T0)
    queue.claim(["b"], worker="w", gateway="g", now_ms=T0 + 10, lease_ms=1000)
    assert [s[:2] for s in queue.requeue_expired(T0 + 2000, max_attempts=3)] == [("b", "queued")]
    assert queue.expire(T0 + 60_000) == [] and queue.expire(T0 + 62_000) == ["b"]
    assert queue.get("b").reason == "queue timeout of 60s for tier P1 exceeded"


def test_a_stop_is_kept_through_requeues_lowered_never_raised_and_not_kept_on_an_ended_job(queue, client, keys):
    admit(queue, "s", P1)
    assert queue.stop_at("s", 9).stop_at == 9  # queued: kept for its next attempt
    got = queue.claim(["s"], worker="w", gateway="g", now_ms=T0, lease_ms=1000)
    assert [j.stop_at for j in got] == [9]  # the claim hands it to the dispatch
    assert queue.stop_at("s", 12).stop_at == 9 and queue.stop_at("s", 4).stop_at == 4
    assert queue.get("s").result == {} and queue.requeue_expired(T0 + 1000, max_attempts=5)[0][:2] == ("s", "queued")
    assert queue.claim(["s"], worker="w2", gateway="g", now_ms=T0 + 1001, lease_ms=1000)[0].stop_at == 4
    assert queue.complete("s", attempt=2, state="done", now_ms=T0 + 1002, worker="w2", fields=WHOLE)
    ended = snapshot(client, keys)
    assert queue.stop_at("s", 2) is None and queue.stop_at("unknown", 2) is None
    assert snapshot(client, keys) == ended


def test_cancel_queued_and_dispatched_jobs(queue, client, keys):
    admit(queue, "q", P2)
    admit(queue, "d", P0)
    before = queue.cancel("q", now_ms=T0 + 5)
    assert before.state is JobState.QUEUED and before.tier is P2
    job = queue.get("q")
    assert (job.state, job.finished_at_ms, job.reason) == (JobState.CANCELLED, T0 + 5, "cancelled")
    assert queue.peek(ALL, 10) == ["d"] and client.zscore(keys.aging, "q") is None
    queue.claim(["d"], worker="w7", gateway="g", now_ms=T0, lease_ms=1000)
    before = queue.cancel("d", now_ms=T0 + 6, reason="client disconnected")
    assert (before.state, before.worker, before.attempt) == (JobState.DISPATCHED, "w7", 1)
    assert queue.get("d").state is JobState.CANCELLED and client.zcard(keys.inflight) == 0
    assert not queue.complete("d", attempt=1, state="done", now_ms=T0 + 7, worker="w", fields=WHOLE)
    assert queue.requeue_expired(T0 + 10**6, max_attempts=1) == []
    assert queue.cancel("d") is None and queue.cancel("unknown") is None
    assert queue.get("unknown") is None


# --- cost of one job ---------------------------------------------------------------------------
def _commandstats(c: redis.Redis) -> dict[str, int]:
    return {name.removeprefix("cmdstat_"): s["calls"] for name, s in c.info("commandstats").items()}


def test_a_job_lifecycle_costs_at_most_six_commands():
    """admit + peek + claim + complete, counted with INFO commandstats on a dedicated server.

    commandstats also counts the commands a script runs inside Redis, so MONITOR (which
    tags those with the source "lua") separates them from the commands the client sent.
    """
    with RedisServer() as s:
        qc, stats, mc = s.client(), s.client(), s.client(socket_timeout=5)
        q = RedisQueue(qc, KeySpace(prefix="count"), tier_timeouts_s=DEFAULT_TIER_TIMEOUTS_S)

        def lifecycle(job_id: str) -> None:
            admit(q, job_id, P0)
            [candidate] = q.peek(ALL, 1)
            [job] = q.claim([candidate], worker="w", gateway="g", now_ms=T0, lease_ms=1000)
            assert q.complete(job.id, attempt=job.attempt, state="done", now_ms=T0 + 1, worker="w",
                              fields={**WHOLE, "text": "x"})

        lifecycle("warm-up")  # loads the scripts (NOSCRIPT + SCRIPT LOAD once per script)
        stats.ping()  # open its connection now, so its HELLO is not in the measured window
        with mc.monitor() as monitor:
            before = _commandstats(stats)
            lifecycle("measured")
            after = _commandstats(stats)
            delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            assert delta.pop("info") == 1  # the first snapshot itself
            total = sum(delta.values())
            seen = [monitor.next_command() for _ in range(total + 2)]  # + both INFO snapshots
        from_client = [m["command"].split()[0].lower() for m in seen if m["client_type"] != "lua"]
        from_lua = [m for m in seen if m["client_type"] == "lua"]
        assert from_client[0] == from_client[-1] == "info"
        from_client = from_client[1:-1]
        assert len(from_client) + len(from_lua) == total  # MONITOR agrees with commandstats
        assert from_client == ["evalsha"] * 4 and delta["evalsha"] == 4
        assert len(from_client) <= 6
        print(f"\nlifecycle: {len(from_client)} commands sent, {total} counted by commandstats "
              f"({len(from_lua)} inside scripts): {sorted((k, v) for k, v in delta.items() if v)}")  # fmt: skip
        for c in (qc, stats, mc):
            c.close()


def test_scripts_touch_only_the_keys_passed_in_KEYS():
    """Redis Cluster safety: every command a script runs names a key from that call's KEYS.

    All operations run under MONITOR on a dedicated server; each command tagged "lua" must
    have its key (the first argument, for every command the scripts use) in the KEYS of
    the EVALSHA that precedes it.
    """
    with RedisServer() as s:
        qc, mc = s.client(), s.client(socket_timeout=5)
        q = RedisQueue(qc, KeySpace(prefix="cluster-safe"), tier_timeouts_s=DEFAULT_TIER_TIMEOUTS_S)
        for script in load_scripts(qc).values():
            qc.script_load(script.script)  # so no EVAL fallback interleaves with the check
        with mc.monitor() as monitor:
            quota = QuotaSpec(rate_per_s=1.0, burst=1, on_exhausted="downgrade")
            admit(q, "a", P0, key="k", quota=quota)
            admit(q, "b", P0, key="k2", quota=quota)  # downgraded
            admit(q, "dup", P0, key="k")
            admit(q, "c", P3, now_ms=T0 - 120_000)
            admit(q, "d", P2)
            admit(q, "e", P1)
            admit(q, "f", P1)
            assert len(q.peek(ALL, 10)) == 6
            q.claim(["a", "b", "e"], worker="w", gateway="g", now_ms=T0, lease_ms=1000)
            assert q.extend_leases("w", ["a", "b"], T0, 1000) == 2
            assert q.complete("a", attempt=1, state="done", now_ms=T0, worker="w", fields={**WHOLE, "text": "x"})
            assert q.cancel("e", now_ms=T0) is not None and q.cancel("d", now_ms=T0) is not None
            assert [s[:2] for s in q.requeue_expired(T0 + 5000, max_attempts=1)] == [("b", "dead")]
            assert q.age(T0, 60_000) == [("c", P3, P2)]
            assert q.expire(T0 + 10**7) == ["f"]
            qc.echo("end-of-test")
            lines = []
            while not lines or lines[-1]["command"] != "ECHO end-of-test":
                lines.append(monitor.next_command())  # bounded by the socket timeout
        current_keys: set[str] | None = None
        checked = 0
        for line in lines:
            parts = line["command"].split(" ")
            if line["client_type"] != "lua":
                name = parts[0].upper()
                assert name not in ("EVAL", "SCRIPT")  # the scripts were preloaded
                current_keys = set(parts[3 : 3 + int(parts[2])]) if name == "EVALSHA" else None
                continue
            assert current_keys is not None, line
            assert parts[1] in current_keys, f"{parts[0]} on an undeclared key {parts[1]}"
            checked += 1
        assert checked > 50
        for c in (qc, mc):
            c.close()


def test_scripts_run_pipelined_in_one_round_trip_and_reload_after_redis_lost_them(client, keys):
    """run_pipelined sends EVALSHA only: Script objects on a pipeline asked SCRIPT EXISTS first on every execute
    (a second round trip per token-log flush). A script Redis lost (SCRIPT FLUSH, as after a restart) is loaded and
    only the calls it refused are run again, so none runs twice."""
    from common.redis_keys import run_pipelined

    client.hset(keys.job("j"), mapping={"state": "dispatched", "worker": "w", "attempt": "1"})
    calls = [("append_tokens", [keys.tokens("j"), keys.job("j")], ["w", 1, 0, msgpack.packb([7]), 100, 60_000]),
             ("first_token", [keys.job("j")], ["gw-a"]), ("first_prefill", [keys.job("j")], [T0])]
    client.script_flush()
    load_scripts(client)["first_token"](keys=[keys.job("nobody")], args=["x"])  # loaded; the other two are not
    client.config_resetstat()
    assert run_pipelined(client, calls) == [1, 1, 1]
    stats = client.info("commandstats")
    assert "cmdstat_script" in stats and stats["cmdstat_evalsha"]["calls"] == 3 + 2  # two refused, run again
    assert client.xlen(keys.tokens("j")) == 1 and client.hget(keys.job("j"), "ttft_observed_by") == b"gw-a"
    client.config_resetstat()
    assert run_pipelined(client, calls) == [1, 0, 0]  # the claim and the start are kept, the tokens appended
    stats = client.info("commandstats")
    assert "cmdstat_script" not in stats and stats["cmdstat_evalsha"]["calls"] == 3
    client.hset(keys.job("j"), "state", "done")
    with pytest.raises(redis.ResponseError):
        run_pipelined(client, [("claim", [], [])])  # a call's own error is raised, not returned
