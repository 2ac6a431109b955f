"""A process of the cluster stands still (SIGSTOP: a long GC, a frozen VM, a paused container) longer than every
timeout that watches it (ZeroMQ's 5 s heartbeats, the gateways' worker timeout, the workers' 15 s silent reconnect,
the lease), with jobs of every tier running and streaming through both gateways, and then goes on (SIGCONT).
Real redis-server (AOF), two gateways, two workers on the tiny model (tests/durable_cluster.py).

Every client thread submits under an idempotency key of its own (asked again until the answer is definite, so the
test knows every admitted job), streams the job whole through its first gateway (failing over to the other), checks
that each token index arrives once and in order, then reads the result. The checks at the end compare what each
client was streamed against the stored result, count tokens against ``max_tokens`` (every job ignores EOS) and
look for anything left queued, leased or held.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import threading
import time
import traceback

import pytest

from common.ports import free_port
from gateway.sdk import GatewayClient, ServingError, Unavailable
from tests.chaos_helpers import REFUSED, TERMINAL, Books, outcome, scrape, summed
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster, settle
from tests.test_chaos import limits_of

pytestmark = pytest.mark.faults
SEED = 20240901

TIERS = [("chat-co", "P0"), ("api-co", "P1"), ("batch-co", "P2"), ("lab-co", "P3"), ("chat-co", "P1"),
         ("api-co", "P3")]


class StreamingClient(threading.Thread):
    """Submits and streams jobs one after another until ``stop``; ``first`` is the gateway it asks first."""

    def __init__(self, c: DurableCluster, books: Books, stop: threading.Event, seed: int, first: str,
                 limits: dict, max_tokens: tuple[int, int]) -> None:
        super().__init__(daemon=True, name=f"client-{seed}")
        self.c, self.books, self.stop, self.rng = c, books, stop, random.Random(seed)
        others = [g for g in sorted(c.gateways) if g != first]
        self.eps = [c.endpoint(first)] + [c.endpoint(g) for g in others]
        self.first, self.limits, self.max_tokens = first, limits, max_tokens
        self.tiers = itertools.cycle(TIERS[seed % len(TIERS):] + TIERS[:seed % len(TIERS)])
        self.clients: dict[str, GatewayClient] = {}
        self.crashed: BaseException | None = None

    def client(self, tenant: str) -> GatewayClient:
        if tenant not in self.clients:
            self.clients[tenant] = GatewayClient(self.eps, self.c.key(tenant), timeout_s=5, retries=30)
        return self.clients[tenant]

    def run(self) -> None:
        try:
            for n in itertools.count(1):
                if self.stop.is_set():
                    break
                self.one(f"{self.name}-{n}")
        except BaseException as e:  # the test thread reports it
            self.crashed = e
        finally:
            for cl in self.clients.values():
                cl.close()

    def spec(self) -> dict:
        tenant, tier = next(self.tiers)
        n_prompt = self.rng.randint(1, 16)
        room = self.limits[tenant][tier] - n_prompt
        spec = dict(tenant=tenant, tier=tier, prompt_token_ids=[self.rng.randint(3, 511) for _ in range(n_prompt)],
                    max_tokens=min(room, self.rng.randint(*self.max_tokens)), ignore_eos=True,
                    seed=self.rng.randint(0, 2**31))
        if self.rng.random() < 0.5:
            spec |= dict(temperature=0.8, top_p=0.9)
        return spec

    def submit(self, spec: dict, key: str):
        deadline = time.monotonic() + 90
        args = {k: v for k, v in spec.items() if k != "tenant"}
        while True:
            try:
                return self.client(spec["tenant"]).submit(**args, idempotency_key=key)
            except REFUSED as e:
                self.books.refused.append(type(e).__name__)
                return None
            except ServingError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.2)

    def one(self, key: str) -> None:
        spec = self.spec()
        job = self.submit(spec, key)
        if job is None:
            time.sleep(self.rng.uniform(0.2, 0.6))
            return
        rec = dict(id=job.id, spec=spec, key=key, first=self.first, streamed=[], indices=[])
        self.books.add(rec)
        deadline = time.monotonic() + 120
        while True:
            try:
                with outcome(rec) as got:
                    for ch in job.stream(from_index=len(rec["streamed"]), timeout=60):
                        if ch.index != len(rec["streamed"]):
                            self.books.problem(f"{job.id}: chunk at {ch.index} after {len(rec['streamed'])} tokens")
                        rec["indices"].append(ch.index)
                        rec["streamed"].extend(ch.token_ids)
                    got(job.result(timeout=60))
                return
            except Unavailable:  # Redis stood still longer than the client's timeout: typed, and retried here
                rec["unavailable"] = rec.get("unavailable", 0) + 1
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def start_clients(c: DurableCluster, books: Books, stop: threading.Event, n: int, limits: dict,
                  max_tokens: tuple[int, int], seed: int) -> list[StreamingClient]:
    gws = sorted(c.gateways)
    clients = [StreamingClient(c, books, stop, seed + i, gws[i % len(gws)], limits, max_tokens) for i in range(n)]
    for t in clients:
        t.start()
    return clients


def running_through(c: DurableCluster, books: Books, *, gateway: str | None = None, worker: str | None = None,
                    at_least: int = 1) -> bool:
    """At least ``at_least`` admitted jobs run now with that gateway (or worker) holding the lease."""
    with books.lock:
        ids = list(books.jobs)
    held = 0
    for j in ids:
        h = c.job(j)
        if h.get("state") == b"dispatched" and (gateway is None or h.get("gateway") == gateway.encode()) \
                and (worker is None or h.get("worker") == worker.encode()):
            held += 1
    return held >= at_least


def end_clients(clients: list[StreamingClient], stop: threading.Event, where: str) -> None:
    stop.set()
    for t in clients:
        t.join(timeout=240)
    for t in clients:
        assert not t.is_alive(), f"{where}: client {t.name} still waits (a job that never finished?)"
        assert t.crashed is None, f"{where}: client {t.name}: " + "".join(traceback.format_exception(t.crashed))


def check_books(c: DurableCluster, books: Books, wk_metrics: dict[str, str] | None = None,
                allowed_failures: tuple[str, ...] = ()) -> list[str]:
    """What went wrong, as lines: every admitted job ended once, whole, streamed as stored; nothing left behind.
    ``allowed_failures``: substrings of a failed job's reason this scenario may rightly give."""
    bad = list(books.problems)
    jobs = books.jobs
    wait_for(lambda: all(c.state(j) in TERMINAL for j in jobs), 120,
             f"every admitted job to end: {sorted((c.state(j), j) for j in jobs if c.state(j) not in TERMINAL)}",
             interval=0.5)
    in_redis = {k.decode().rsplit(":", 1)[1] for k in c.redis.scan_iter(match="ts:{c}:job:*", count=1000)}
    if in_redis != set(jobs):
        bad.append(f"jobs in Redis no client was given: {sorted(in_redis - set(jobs))}; "
                   f"admitted jobs missing from Redis: {sorted(set(jobs) - in_redis)}")
    for j, rec in jobs.items():
        h = c.job(j)
        state, spec, reason = h.get("state", b"").decode(), rec["spec"], h.get("reason", b"").decode()
        if state != "done":
            if not (state == "failed" and any(a in reason for a in allowed_failures)):
                bad.append(f"{j} ({spec['tier']}, attempt {h.get('attempt')}) ended {state}: {reason}; "
                           f"its client: {rec.get('error')}")
            elif rec.get("error", "").split(":")[0] != "failed":
                bad.append(f"{j} failed ({reason}), but its client was told {rec.get('error') or 'a result'}")
            continue
        stored = c.stored_tokens(j)
        if len(stored) != spec["max_tokens"]:
            bad.append(f"{j}: done with {len(stored)} of {spec['max_tokens']} tokens")
        if rec.get("result") != stored:
            bad.append(f"{j}: its client's result ({rec.get('error') or len(rec.get('result') or [])}) is not "
                       f"the stored one ({len(stored)} tokens)")
        if rec["streamed"] != stored:
            diff = next((i for i, (a, b) in enumerate(zip(rec["streamed"], stored)) if a != b),
                        min(len(rec["streamed"]), len(stored)))
            bad.append(f"{j}: streamed {len(rec['streamed'])} tokens, stored {len(stored)}; first difference at "
                       f"{diff}; chunk indices {rec['indices'][:6]}...")
    for key, ok in [(f"q:P{t}", {"queued"}) for t in range(4)] + [("inflight", {"dispatched"}),
                                                                    ("aging", {"queued"}),
                                                                    ("deadlines", {"queued"})]:
        for m in c.redis.zrange(f"ts:{{c}}:{key}", 0, -1):
            if c.state(m.decode()) not in ok:
                bad.append(f"{key} holds {m.decode()}, which is {c.state(m.decode())}")
    left = c.redis.zcard("ts:{c}:inflight")
    if left:
        bad.append(f"{left} leases left with every job ended")
    if wk_metrics:
        def idle() -> bool:
            pages = [scrape(u) for u in wk_metrics.values()]
            return all(summed(p, "ts_kv_cache_usage_ratio") == 0 and summed(p, "ts_num_requests_running") == 0
                       and summed(p, "ts_num_requests_waiting") == 0 for p in pages)
        try:
            wait_for(idle, 30, "idle workers to hold no KV block", interval=0.5)
        except AssertionError as e:
            bad.append(str(e))
    return bad


def summary(c: DurableCluster, books: Books) -> str:
    attempts = sorted(int(c.job(j).get("attempt", b"0")) for j in books.jobs)
    return (f"{len(books.jobs)} jobs, {len(books.refused)} refused, attempts "
            f"{ {a: attempts.count(a) for a in set(attempts)} }")


def every_gateway_sees_every_worker(c: DurableCluster, timeout: float) -> None:
    """Both gateways list both workers within ``timeout`` (the test's bound on recovery)."""
    for gw in c.gateways:
        c.wait_workers(gw, timeout=timeout)


def metrics_env(c_names: list[str]) -> tuple[dict[str, dict], dict[str, str]]:
    """Each worker's metrics port: (process_env for DurableCluster, worker -> /metrics URL)."""
    binds = {w: f"127.0.0.1:{free_port()}" for w in c_names}
    return ({w: {"TS_WORKER_METRICS_BIND": b} for w, b in binds.items()},
            {w: f"http://{b}/metrics" for w, b in binds.items()})


def paused(c: DurableCluster, name: str, seconds: float) -> None:
    pid = c.procs[name].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        settle(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("pause_s", [6.0, 20.0])
def test_a_gateway_paused_past_its_timeouts_loses_no_job_and_no_token(tmp_path, tiny_model_dir, pause_s):
    """6 s: past ZeroMQ's heartbeat timeout (the workers reconnect to it, their streams move to the other gateway).
    20 s: past the lease (8 s), the gateways' worker timeout and the workers' silent reconnect as well."""
    wk_env, wk_urls = metrics_env(["wk-0", "wk-1"])
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=2, max_running=2, lease_s=8.0,
                        process_env=wk_env) as c:
        limits, _ = limits_of(c)
        books, stop = Books(), threading.Event()
        clients = start_clients(c, books, stop, 6, limits, (200, 1200), SEED)
        where = f"gw-0 paused {pause_s} s"
        try:
            wait_for(lambda: running_through(c, books, gateway="gw-0", at_least=2), 60, "jobs leased through gw-0")
            paused(c, "gw-0", pause_s)
            every_gateway_sees_every_worker(c, 30)
            settle(4.0)  # jobs admitted and streamed after the pause too
        finally:
            end_clients(clients, stop, where)
        bad = check_books(c, books, wk_urls)
        print(f"{where}: {summary(c, books)}")
        assert not bad, f"{where}: " + "\n".join(bad[:30])


@pytest.mark.parametrize("pause_s", [6.0, 20.0])
def test_a_worker_paused_past_its_leases_completes_nothing_twice(tmp_path, tiny_model_dir, pause_s):
    """Its leases (4 s) run out while it stands still: its jobs run again on the other worker. Woken, it sends the
    frames of attempts it no longer holds, which must be dropped as stale: no job completed twice or with tokens of
    two attempts, and it is told to stop them (its KV freed). 20 s: past its gateways' ZeroMQ heartbeats and its
    own silent reconnect as well."""
    wk_env, wk_urls = metrics_env(["wk-0", "wk-1"])
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=2, max_running=2, lease_s=4.0,
                        process_env=wk_env) as c:
        limits, _ = limits_of(c)
        books, stop = Books(), threading.Event()
        clients = start_clients(c, books, stop, 6, limits, (200, 1200), SEED + 100)
        where = f"wk-0 paused {pause_s} s"
        try:
            wait_for(lambda: running_through(c, books, worker="wk-0", at_least=2), 60, "two jobs running on wk-0")
            paused(c, "wk-0", pause_s)
            every_gateway_sees_every_worker(c, 30)
            settle(4.0)
        finally:
            end_clients(clients, stop, where)
        bad = check_books(c, books, wk_urls)
        print(f"{where}: {summary(c, books)}")
        assert not bad, f"{where}: " + "\n".join(bad[:30])


def test_redis_paused_past_the_gateways_timeouts_refuses_as_unavailable_and_loses_nothing(tmp_path, tiny_model_dir):
    """Redis stands still at least 8 s: past the gateways' 2 s socket timeout and the 4 s lease. Meanwhile each
    gateway answers an admission with the typed, retryable Unavailable within the client's timeout (and stores
    nothing), the clients' submissions are retried under their keys, and once it goes on, every admitted job ends
    whole and the cluster serves again. Before, a gateway whose workers streamed jobs answered no client at all
    while Redis stood still: each worker frame (a load report every 0.5 s) waited out the 2 s Redis timeout, one
    after another, so a submission got no answer (TimeoutError, not Unavailable) and no stream a keepalive."""
    wk_env, wk_urls = metrics_env(["wk-0", "wk-1"])
    with DurableCluster(tmp_path, tiny_model_dir, gateways=2, workers=2, max_running=2, lease_s=4.0,
                        process_env=wk_env) as c:
        limits, _ = limits_of(c)
        books, stop = Books(), threading.Event()
        clients = start_clients(c, books, stop, 6, limits, (200, 1200), SEED + 200)
        where = "redis paused"
        answers: dict[str, BaseException | str] = {}

        def probe(gw: str) -> None:
            # 4 s: answered while Redis still stands still (probed 1 s in, 8 s paused), though the loop may wait out
            # the 2 s Redis timeout once before the back-off (the README's limit); before, never.
            with GatewayClient(c.endpoint(gw), c.key("lab-co"), timeout_s=4, retries=0) as cl:
                try:
                    answers[gw] = cl.submit(prompt_token_ids=[7, 7, 7], max_tokens=3, idempotency_key=f"probe-{gw}").id
                except (ServingError, TimeoutError) as e:
                    answers[gw] = e
        try:
            wait_for(lambda: running_through(c, books, at_least=3), 60, "jobs running")
            pid = c.procs["redis"].pid
            os.kill(pid, signal.SIGSTOP)
            try:
                settle(1.0)
                probes = [threading.Thread(target=probe, args=(gw,), daemon=True) for gw in sorted(c.gateways)]
                for t in probes:
                    t.start()
                settle(7.0)
                for t in probes:
                    t.join(30)  # answered while Redis still stands still
            finally:
                os.kill(pid, signal.SIGCONT)
            every_gateway_sees_every_worker(c, 30)
            settle(4.0)
        finally:
            end_clients(clients, stop, where)
        assert {gw: type(a).__name__ for gw, a in answers.items()} == {g: "Unavailable" for g in c.gateways}, answers
        bad = check_books(c, books, wk_urls)
        probes_stored = list(c.redis.scan_iter(match="ts:{c}:idem:*probe-*"))
        assert not probes_stored, f"an admission refused as unavailable was stored: {probes_stored}"
        print(f"{where}: {summary(c, books)}")
        assert not bad, f"{where}: " + "\n".join(bad[:30])
