"""Redis hygiene against a real redis-server: a per-tenant cap on unfinished jobs (every tier), result
retention apart from the idempotency TTL, a capped dead-letter set, and a full Redis (maxmemory,
noeviction) refused as ``overloaded`` by a real gateway process that stores nothing and keeps running,
and, under work in flight, waited out without losing a job."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import msgpack
import pytest
import redis

from common.errors import Overloaded
from common.redis_keys import KeySpace
from common.redis_server import RedisServer
from common.ports import free_port
from common.tiers import ALL_TIERS, Tier
from gateway.redis_queue import Admitted, RedisQueue, StoreFull, TenantFull
from gateway.redis_queue import Overloaded as OverloadedResult
from gateway.sdk import GatewayClient
from scripts.up import write_tenants
from tests.cluster_helpers import stop_process, wait_for
from tests.durable_cluster import DurableCluster

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_700_000_000_000
RATES = {t: 1.0 for t in ALL_TIERS}
WHOLE = {"num_tokens": 1, "token_ids": msgpack.packb([7])}


@pytest.fixture(scope="module")
def server():
    with RedisServer() as s:
        yield s


def _queue(server, timeouts=None, **kw) -> RedisQueue:
    timeouts = timeouts or {t: None for t in ALL_TIERS}  # no overload refusals: only the cap may refuse
    return RedisQueue(server.client(), KeySpace(prefix=f"sec-{uuid.uuid4().hex[:8]}"), tier_timeouts_s=timeouts,
                      **kw)


def _admit(q: RedisQueue, tenant: str, tier: Tier, n: int = 0, **kw):
    return q.admit(job_id=uuid.uuid4().hex, tenant=tenant, tier_requested=tier, tier=tier, payload=b"x",
                   now_ms=T0 + n, idempotency_key=kw.pop("key", None), quota=None, drain_rate_per_s=RATES, **kw)


def _dump(q: RedisQueue) -> dict:
    return {k: q.client.dump(k) for k in q.client.scan_iter(match=q.keys.scan_pattern())}


# --- the per-tenant cap (queue layer) ------------------------------------------------------------------------

def test_a_tenant_cap_counts_unfinished_jobs_in_every_tier(server):
    q = _queue(server, tenant_max_jobs=3)
    first = [_admit(q, "a", tier, i) for i, tier in enumerate((Tier.P3, Tier.P2, Tier.P0))]
    assert all(isinstance(r, Admitted) for r in first)
    before = _dump(q)
    refused = _admit(q, "a", Tier.P1, 10, key="k-refused")
    assert refused == TenantFull(3)
    assert _dump(q) == before  # nothing stored, not even the idempotency key
    assert isinstance(_admit(q, "b", Tier.P3, 11), Admitted)  # other tenants are not affected
    # A finished job frees its place (found by the admission that needs it; no other script keeps count).
    q.cancel(first[1].job_id, now_ms=T0 + 20)
    assert isinstance(_admit(q, "a", Tier.P1, 21), Admitted)
    assert isinstance(_admit(q, "a", Tier.P1, 22), TenantFull)


def test_a_refusal_after_the_cap_check_prunes_nothing(server):
    timeouts = {Tier.P0: 30.0, Tier.P1: 60.0, Tier.P2: 300.0, Tier.P3: None}
    q = _queue(server, timeouts=timeouts, tenant_max_jobs=2)
    a, _ = _admit(q, "a", Tier.P1, 0), _admit(q, "a", Tier.P1, 1)
    q.cancel(a.job_id, now_ms=T0 + 2)  # its place is free, found (and pruned) only by an admission
    before = _dump(q)
    assert isinstance(_admit(q, "a", Tier.P1, 3, estimate_s=600.0), OverloadedResult)
    assert _dump(q) == before  # shed on the estimate: the pruning was not written either
    assert isinstance(_admit(q, "a", Tier.P1, 4), Admitted)
    assert q.client.zcard(q.keys.tenant_jobs("a")) == 2 and q.client.zscore(q.keys.tenant_jobs("a"), a.job_id) is None


def test_a_duplicate_at_the_cap_still_gets_its_job(server):
    q = _queue(server, tenant_max_jobs=1)
    first = _admit(q, "a", Tier.P3, 0, key="k1")
    again = _admit(q, "a", Tier.P3, 1, key="k1")
    assert again.duplicate and again.job_id == first.job_id  # a retry is never refused by the cap it counts in


def test_dispatched_jobs_count_and_completed_ones_do_not(server):
    q = _queue(server, tenant_max_jobs=2)
    a, b = _admit(q, "a", Tier.P3, 0), _admit(q, "a", Tier.P3, 1)
    claimed = q.claim([a.job_id, b.job_id], worker="w", gateway="g", now_ms=T0 + 2, lease_ms=10_000)
    assert len(claimed) == 2 and isinstance(_admit(q, "a", Tier.P3, 3), TenantFull)
    assert q.complete(a.job_id, attempt=1, state="done", now_ms=T0 + 4, fields=WHOLE, worker="w")
    assert isinstance(_admit(q, "a", Tier.P3, 5), Admitted)


def test_the_cap_and_a_callers_wait_estimate_work_together(server):
    # The cap is ARGV[19], the caller's estimate the optional ARGV[20]: both must reach the script.
    q = _queue(server, timeouts={Tier.P0: 30.0, Tier.P1: 60.0, Tier.P2: 300.0, Tier.P3: None}, tenant_max_jobs=2)
    adm = _admit(q, "a", Tier.P1, 0, estimate_s=12.5)
    assert isinstance(adm, Admitted) and adm.estimated_wait_s == 12.5 and q.get(adm.job_id).estimate_s == 12.5
    shed = _admit(q, "a", Tier.P1, 1, estimate_s=61.0)
    assert isinstance(shed, OverloadedResult) and shed.estimated_wait_s == 61.0
    assert isinstance(_admit(q, "a", Tier.P1, 2), Admitted)
    assert _admit(q, "a", Tier.P1, 3, estimate_s=0.0) == TenantFull(2)


def test_no_cap_keeps_no_tenant_set(server):
    q = _queue(server)  # tenant_max_jobs=0: no cap, and nothing kept for one
    for i in range(5):
        assert isinstance(_admit(q, "a", Tier.P3, i), Admitted)
    assert not q.client.exists(q.keys.tenant_jobs("a"))


@pytest.mark.parametrize("kw", [{"tenant_max_jobs": -1}, {"result_ttl_s": 0}, {"dead_letter_max": 0}])
def test_bad_bounds_are_refused(server, kw):
    with pytest.raises(ValueError):
        _queue(server, **kw)


def _counted_memory(r: redis.Redis) -> int:
    """The memory Redis holds against maxmemory: used_memory less what it leaves out (the AOF buffer, which a busy
    disk lets grow for seconds under appendfsync everysec, and replicas' output buffers)."""
    info = r.info("memory")
    return int(info["used_memory"]) - int(info.get("mem_not_counted_for_evict", 0))


def _fill(r: redis.Redis) -> int:
    """Fill Redis until a write is refused, then keep it full (a limit below what it holds, so buffers Redis
    frees meanwhile cannot make room). Returns how many filler keys to delete."""
    r.config_set("maxmemory", _counted_memory(r) + 2 * 2**20)
    for n in range(1, 1000):
        try:
            r.set(f"filler:{n}", b"x" * 2**16)
        except redis.exceptions.OutOfMemoryError:
            # Below what is counted, not below used_memory: a limit under a used_memory that uncounted buffers
            # inflated sat above the counted memory, and Redis took writes again.
            r.config_set("maxmemory", _counted_memory(r) - 2**20)
            try:
                r.set("filler:probe", b"x")
            except redis.exceptions.OutOfMemoryError:
                return n
            pytest.fail(f"Redis took a write under a maxmemory below its counted memory: {r.info('memory')}")
    pytest.fail("Redis never refused a write")


def _empty(r: redis.Redis, filled: int) -> None:
    r.delete(*(f"filler:{i}" for i in range(1, filled + 1)))
    r.config_set("maxmemory", 0)


def test_the_fill_holds_redis_full_beside_memory_redis_does_not_count():
    """A Redis whose used_memory holds buffers maxmemory leaves out (here a replica that reads nothing; in the
    suites, the AOF buffer, which a busy disk lets grow) must still refuse writes once filled: a fill that set its
    limit under used_memory left room, as a job stored "done" on a Redis meant full suggests it once did."""
    with RedisServer(appendonly=True, extra_args=["--maxmemory-policy", "noeviction"]) as s:
        r = s.client()
        replica = socket.socket()
        replica.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        try:
            replica.connect(("127.0.0.1", s.port))
            replica.sendall(b"SYNC\r\n")
            wait_for(lambda: r.info("replication")["connected_slaves"] == 1, timeout=10, what="the replica")
            for _ in range(64):  # past the kernel's socket buffers: the rest waits in Redis, not counted
                r.set("big", b"y" * 2**20)
                if r.info("memory")["mem_not_counted_for_evict"] > 2 * 2**20:
                    break
            else:
                pytest.fail("the replica's output buffer never held 2 MiB")
            r.delete("big")
            filled = _fill(r)
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                r.hset("job", "state", "done")
            _empty(r, filled)
            r.hset("job", "state", "done")
        finally:
            replica.close()
            r.close()


def test_a_full_redis_refuses_the_admission_before_any_write():
    # Its own server: a full Redis must not fail the other tests. noeviction: refuse writes, never drop jobs.
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as s:
        q = RedisQueue(s.client(), KeySpace(prefix="full"), tier_timeouts_s={t: None for t in ALL_TIERS},
                       tenant_max_jobs=1)
        done = _admit(q, "a", Tier.P3, 0)
        q.cancel(done.job_id, now_ms=T0 + 1)  # at the cap with a finished job: this admission would prune it
        filled = _fill(q.client)
        try:
            before = _dump(q)
            refused = _admit(q, "a", Tier.P3, 2, key="k")
            assert isinstance(refused, StoreFull) and "maxmemory" in refused.detail
            # Nothing written, not even the pruning (a write before the job's own would have let the rest through).
            assert _dump(q) == before
        finally:
            _empty(q.client, filled)
        assert isinstance(_admit(q, "a", Tier.P3, 3, key="k"), Admitted)
        q.client.close()


# --- retention ------------------------------------------------------------------------------------------------

def test_results_are_kept_for_their_own_retention_not_the_idempotency_ttl(server):
    q = _queue(server, idempotency_ttl_s=86_400, result_ttl_s=60)
    adm = _admit(q, "a", Tier.P3, 0, key="k1")
    q.claim([adm.job_id], worker="w", gateway="g", now_ms=T0 + 1, lease_ms=10_000)
    assert q.complete(adm.job_id, attempt=1, state="done", now_ms=T0 + 2, fields=WHOLE, worker="w")
    assert 0 < q.client.pttl(q.keys.job(adm.job_id)) <= 60_000
    assert q.client.pttl(q.keys.idem("a", "k1")) > 3_600_000
    # Once the result is gone, a duplicate still gets the job id (nothing is admitted twice).
    q.client.delete(q.keys.job(adm.job_id))
    again = _admit(q, "a", Tier.P3, 3, key="k1")
    assert again.duplicate and again.job_id == adm.job_id and q.get(adm.job_id) is None


def test_the_dead_letter_set_is_capped_and_dead_jobs_expire(server):
    q = _queue(server, dead_letter_max=2, result_ttl_s=60)
    ids = []
    for i in range(3):
        adm = _admit(q, "a", Tier.P3, i)
        q.claim([adm.job_id], worker="w", gateway="g", now_ms=T0 + 10 + i, lease_ms=5)
        ids.append(adm.job_id)
    settled = q.requeue_expired(T0 + 1_000, max_attempts=1)
    assert sorted(s.job_id for s in settled) == sorted(ids)
    assert all(s.state == "dead" and s.worker == "w" and s.attempt == 1 for s in settled)
    dead = [m.decode() for m in q.client.zrange(q.keys.dead, 0, -1)]
    assert len(dead) == 2 and set(dead) < set(ids)
    dropped = (set(ids) - set(dead)).pop()
    assert not q.client.exists(q.keys.job(dropped))
    assert all(0 < q.client.pttl(q.keys.job(j)) <= 60_000 for j in dead)


# --- a real gateway: the cap and a full Redis -------------------------------------------------------------------

class _Gateway:
    """One `python -m gateway` process (no workers, no tokenizer) on its own Redis."""

    def __init__(self, tmp: Path, redis_server: RedisServer, **config: str) -> None:
        self.tenants = write_tenants(tmp / "tenants.toml")
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.metrics = f"127.0.0.1:{free_port()}"
        self.prefix = f"gw-{uuid.uuid4().hex[:8]}"
        env = dict(os.environ, PYTHONPATH=str(ROOT), OTEL_TRACES_EXPORTER="none", TS_GATEWAY_INSECURE_WORKERS="true",
                   TS_GATEWAY_KEY_PREFIX=self.prefix, TS_GATEWAY_METRICS_BIND=self.metrics,
                   **{f"TS_GATEWAY_{k.upper()}": v for k, v in config.items()})
        self.log = tmp / "gateway.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway", "--client-bind", self.endpoint,
                 "--worker-bind", f"tcp://127.0.0.1:{free_port()}", "--redis-url", redis_server.url,
                 "--tenants-file", str(tmp / "tenants.toml")],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(self._answers, 60, "the gateway to answer")
        except BaseException:
            self.stop()
            raise

    def _answers(self) -> bool:
        assert self.proc.poll() is None, f"gateway exited {self.proc.returncode}: {self.log.read_text()[-3000:]}"
        try:
            with self.client("lab-co", timeout_s=1.0) as c:
                return c.info() is not None
        except Exception:  # noqa: BLE001 - not listening yet
            return False

    def client(self, tenant: str, timeout_s: float = 10.0) -> GatewayClient:
        return GatewayClient(self.endpoint, self.tenants[tenant]["api_key"], timeout_s=timeout_s, retries=0)

    def scrape(self) -> str:
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=5) as r:
            return r.read().decode()

    def stop(self) -> None:
        stop_process(self.proc, timeout=15)


def _sample(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def capped_gateway(tmp_path_factory):
    # noeviction: a full Redis refuses writes (what a queue needs) instead of dropping keys (jobs).
    with RedisServer(extra_args=["--maxmemory-policy", "noeviction"]) as s:
        gw = _Gateway(tmp_path_factory.mktemp("gw"), s, tenant_max_jobs="2")
        try:
            yield gw, s
        finally:
            gw.stop()


def test_a_tenant_over_its_cap_is_refused_overloaded_by_the_gateway(capped_gateway):
    gw, _ = capped_gateway
    with gw.client("lab-co") as c, gw.client("api-co") as other:
        before = _sample(gw.scrape(), "ts_refusals_total", code="overloaded")
        jobs = [c.submit(prompt_token_ids=[1, 2, 3], max_tokens=2) for _ in range(2)]
        with pytest.raises(Overloaded, match="unfinished jobs"):
            c.submit(prompt_token_ids=[1, 2, 3], max_tokens=2)
        assert other.submit(prompt_token_ids=[1, 2], max_tokens=2, tier="P3").id  # another tenant is not capped
        assert jobs[0].cancel()
        assert c.submit(prompt_token_ids=[1, 2, 3], max_tokens=2).id  # a finished job frees its place
    text = gw.scrape()
    assert _sample(text, "ts_refusals_total", code="overloaded") == before + 1
    assert _sample(text, "ts_gateway_events_total", event="refused_tenant_full") == 1


def test_a_full_redis_refuses_a_submit_as_overloaded_stores_nothing_and_the_gateway_keeps_serving(capped_gateway):
    gw, s = capped_gateway
    r = s.client()
    with gw.client("batch-co") as c:
        queued = c.submit(prompt_token_ids=[1, 2], max_tokens=2)  # scripts loaded, the path known to work
        filled = _fill(r)
        try:
            before = {k: r.dump(k) for k in r.scan_iter(match=f"{gw.prefix}:*")}
            refused_before = _sample(gw.scrape(), "ts_refusals_total", code="overloaded")
            with pytest.raises(Overloaded, match="full"):
                c.submit(prompt_token_ids=[1, 2, 3], max_tokens=2)
            assert {k: r.dump(k) for k in r.scan_iter(match=f"{gw.prefix}:*")} == before  # nothing stored
            # Still serving, and not as if Redis were unreachable: reads answer at once.
            assert gw.proc.poll() is None
            assert c.status(queued.id).state == "queued"
            text = gw.scrape()
            assert _sample(text, "ts_refusals_total", code="overloaded") == refused_before + 1
            assert _sample(text, "ts_refusals_total", code="internal") == 0
            assert _sample(text, "ts_gateway_events_total", event="refused_redis_full") == 1
            assert _sample(text, "ts_gateway_events_total", event="handler_errors") == 0
        finally:
            _empty(r, filled)
        assert c.submit(prompt_token_ids=[1, 2, 3], max_tokens=2).id  # room again: admitted
    r.close()


def test_a_full_redis_under_running_work_is_full_not_unreachable_and_loses_nothing(tmp_path, tiny_model_dir):
    """Redis fills while jobs wait for a worker: the dispatch's writes are refused too. The gateway must say
    so ("full"), keep answering reads at once (not as if Redis were unreachable), and, once there is room,
    dispatch and finish every job with all its tokens."""
    metrics = f"127.0.0.1:{free_port()}"
    with DurableCluster(tmp_path, tiny_model_dir, gateways=1, workers=0, max_running=1,
                        gateway_env={"TS_GATEWAY_METRICS_BIND": metrics}) as c:
        key = c.key("batch-co")
        with GatewayClient(c.endpoint(), key, timeout_s=10) as client:
            jobs = [client.submit(prompt_token_ids=[5, 6, 7], max_tokens=6, ignore_eos=True) for _ in range(3)]
        filled = _fill(c.redis)
        try:
            c.worker_ids.append("wk-0")
            c.start_process("wk-0")  # the dispatch to it needs a write: refused now
            c.wait_workers("gw-0")
            # Reads answer at once, again and again, while the gateway keeps trying: a client that waits out no
            # "unavailable" back-off (the SDK would retry one for its whole timeout).
            with GatewayClient(c.endpoint(), key, timeout_s=0.3, retries=0) as quick:
                for _ in range(15):
                    # Dispatched: sent (a claim may fit), and finished on the worker, but its result not storable.
                    states = {quick.status(j.id).state for j in jobs}
                    assert states <= {"queued", "dispatched"}, states
                    time.sleep(0.2)  # spread the reads over several of the gateway's retries
            text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
            assert _sample(text, "ts_gateway_events_total", event="refused_unavailable") == 0
            assert _sample(text, "ts_gateway_events_total", event="redis_full") >= 1
            log = c.log_tail("gw-0", 20_000)
            assert "Redis is full" in log and "Redis unreachable" not in log
        finally:
            _empty(c.redis, filled)
        with GatewayClient(c.endpoint(), key, timeout_s=60) as client:
            for j in jobs:
                result = client.job(j.id).result(timeout=60)
                assert len(result.token_ids) == 6 and result.finish_reason == "length"
