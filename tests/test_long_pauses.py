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
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from gateway.sdk import GatewayClient, ServingError, Unavailable
from tests.chaos_books import Books, check_books, outcome
from tests.chaos_helpers import ClientThread, limits_of, metrics_env
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster, settle

pytestmark = pytest.mark.faults
SEED = 20240901

TIERS = [("chat-co", "P0"), ("api-co", "P1"), ("batch-co", "P2"), ("lab-co", "P3"), ("chat-co", "P1"),
         ("api-co", "P3")]


class StreamingClient(ClientThread):
    """Submits and streams jobs one after another until ``stop``; ``first`` is the gateway it asks first."""

    def __init__(self, c: DurableCluster, books: Books, stop: threading.Event, seed: int, first: str,
                 limits: dict, max_tokens: tuple[int, int]) -> None:
        super().__init__(c, books, stop, seed, f"client-{seed}")
        others = [g for g in sorted(c.gateways) if g != first]
        self.eps = [c.endpoint(first)] + [c.endpoint(g) for g in others]
        self.first, self.limits, self.max_tokens = first, limits, max_tokens
        self.tiers = itertools.cycle(TIERS[seed % len(TIERS):] + TIERS[:seed % len(TIERS)])

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


def summary(c: DurableCluster, books: Books) -> str:
    attempts = sorted(int(c.job(j).get("attempt", b"0")) for j in books.jobs)
    return (f"{len(books.jobs)} jobs, {len(books.refused)} refused, attempts "
            f"{ {a: attempts.count(a) for a in set(attempts)} }")


def every_gateway_sees_every_worker(c: DurableCluster, timeout: float) -> None:
    """Both gateways list both workers within ``timeout`` (the test's bound on recovery)."""
    for gw in c.gateways:
        c.wait_workers(gw, timeout=timeout)


def paused(c: DurableCluster, name: str, seconds: float) -> None:
    pid = c.procs[name].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        settle(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


@dataclass
class Busy:
    """A two-gateway, two-worker cluster (each worker's metrics served) with six StreamingClients at work."""

    c: DurableCluster
    books: Books
    stop: threading.Event
    clients: list[StreamingClient]
    wk_urls: dict[str, str]  # worker -> /metrics URL

    def end(self, where: str) -> None:
        end_clients(self.clients, self.stop, where)

    def check(self) -> list[str]:
        return check_books(self.c, self.books, wait_s=120, wk_metrics=self.wk_urls)

    def verdict(self, where: str, bad: list[str]) -> None:
        print(f"{where}: {summary(self.c, self.books)}")
        assert not bad, f"{where}: " + "\n".join(bad[:30])


@contextmanager
def busy_cluster(tmp_path, model_dir, *, lease_s: float, seed: int) -> Iterator[Busy]:
    wk_env, wk_urls = metrics_env(["wk-0", "wk-1"])
    with DurableCluster(tmp_path, model_dir, gateways=2, workers=2, max_running=2, lease_s=lease_s,
                        process_env=wk_env) as c:
        limits, _ = limits_of(c)
        books, stop = Books(), threading.Event()
        yield Busy(c, books, stop, start_clients(c, books, stop, 6, limits, (200, 1200), seed), wk_urls)


@pytest.mark.parametrize("pause_s", [6.0, 20.0])
def test_a_gateway_paused_past_its_timeouts_loses_no_job_and_no_token(tmp_path, tiny_model_dir, pause_s):
    """6 s: past ZeroMQ's heartbeat timeout (the workers reconnect to it, their streams move to the other gateway).
    20 s: past the lease (8 s), the gateways' worker timeout and the workers' silent reconnect as well."""
    with busy_cluster(tmp_path, tiny_model_dir, lease_s=8.0, seed=SEED) as run:
        c, where = run.c, f"gw-0 paused {pause_s} s"
        try:
            wait_for(lambda: running_through(c, run.books, gateway="gw-0", at_least=2), 60, "jobs leased through gw-0")
            paused(c, "gw-0", pause_s)
            every_gateway_sees_every_worker(c, 30)
            settle(4.0)  # jobs admitted and streamed after the pause too
        finally:
            run.end(where)
        run.verdict(where, run.check())


@pytest.mark.parametrize("pause_s", [6.0, 20.0])
def test_a_worker_paused_past_its_leases_completes_nothing_twice(tmp_path, tiny_model_dir, pause_s):
    """Its leases (4 s) run out while it stands still: its jobs run again on the other worker. Woken, it sends the
    frames of attempts it no longer holds, which must be dropped as stale: no job completed twice or with tokens of
    two attempts, and it is told to stop them (its KV freed). 20 s: past its gateways' ZeroMQ heartbeats and its
    own silent reconnect as well."""
    with busy_cluster(tmp_path, tiny_model_dir, lease_s=4.0, seed=SEED + 100) as run:
        c, where = run.c, f"wk-0 paused {pause_s} s"
        try:
            wait_for(lambda: running_through(c, run.books, worker="wk-0", at_least=2), 60, "two jobs running on wk-0")
            paused(c, "wk-0", pause_s)
            every_gateway_sees_every_worker(c, 30)
            settle(4.0)
        finally:
            run.end(where)
        run.verdict(where, run.check())


def test_redis_paused_past_the_gateways_timeouts_refuses_as_unavailable_and_loses_nothing(tmp_path, tiny_model_dir):
    """Redis stands still at least 8 s: past the gateways' 2 s socket timeout and the 4 s lease. Meanwhile each
    gateway answers an admission with the typed, retryable Unavailable within the client's timeout (and stores
    nothing), the clients' submissions are retried under their keys, and once it goes on, every admitted job ends
    whole and the cluster serves again. Before, a gateway whose workers streamed jobs answered no client at all
    while Redis stood still: each worker frame (a load report every 0.5 s) waited out the 2 s Redis timeout, one
    after another, so a submission got no answer (TimeoutError, not Unavailable) and no stream a keepalive."""
    with busy_cluster(tmp_path, tiny_model_dir, lease_s=4.0, seed=SEED + 200) as run:
        c, where = run.c, "redis paused"
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
            wait_for(lambda: running_through(c, run.books, at_least=3), 60, "jobs running")
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
            run.end(where)
        assert {gw: type(a).__name__ for gw, a in answers.items()} == {g: "Unavailable" for g in c.gateways}, answers
        bad = run.check()
        probes_stored = list(c.redis.scan_iter(match="ts:{c}:idem:*probe-*"))
        assert not probes_stored, f"an admission refused as unavailable was stored: {probes_stored}"
        run.verdict(where, bad)
