"""A seeded, randomized workload and fault schedule for tests/test_chaos.py; the books each keeps are
tests/chaos_books.py's (tests/test_long_pauses.py's streaming clients are ClientThreads too).

Clients (sync threads, and coroutines sharing one AsyncGatewayClient) submit jobs of every tier their tenant may
use, with random sizes up to the tier's limits, and then wait for the result, stream it whole, stream a few chunks
and walk away, cancel it at a random moment, or submit it again under its idempotency key. Every submission
carries a key of the test's own, so one whose answer was lost to a fault is asked again until it has a definite
answer: the test knows every job that was admitted. Meanwhile the fault schedule kill -9s and restarts gateways,
workers and Redis, and freezes (SIGSTOP) a process for a moment. Every record is a plain dict, checked at the end.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time
from contextlib import contextmanager

from common.ports import free_port
from gateway.sdk import AsyncGatewayClient, GatewayClient, Overloaded, QuotaExceeded, ServingError
from tests.chaos_books import Books, outcome, scrape, summed
from tests.durable_cluster import DurableCluster

TENANT_TIERS = {"chat-co": ["P0", "P1", "P2", "P3"], "api-co": ["P1", "P2", "P3"], "batch-co": ["P2", "P3"],
                "lab-co": ["P3"]}
ACTIONS = ["result", "stream", "abandon", "cancel", "again"]
ACTION_WEIGHTS = [35, 20, 15, 15, 15]


def metrics_env(names: list[str]) -> tuple[dict[str, dict], dict[str, str]]:
    """A metrics port for each gateway (gw-N) and worker (wk-N) named: (process_env for DurableCluster,
    name -> /metrics URL)."""
    binds = {n: f"127.0.0.1:{free_port()}" for n in names}
    var = {n: "TS_GATEWAY_METRICS_BIND" if n.startswith("gw-") else "TS_WORKER_METRICS_BIND" for n in names}
    return {n: {var[n]: b} for n, b in binds.items()}, {n: f"http://{b}/metrics" for n, b in binds.items()}


def limits_of(c: DurableCluster) -> tuple[dict[str, dict[str, int]], int]:
    """Each tenant's token limit per tier, and the largest max_tokens, as gw-0 tells them."""
    out, most = {}, 0
    for tenant in TENANT_TIERS:
        with GatewayClient(c.endpoint("gw-0"), c.key(tenant), timeout_s=10) as cl:
            info = cl.info(limits=True)
        out[tenant], most = dict(info.tier_token_limits), info.max_tokens_limit
    return out, most


class SubmitGate:
    """Lets the fault schedule wait for every submission on its way to end, and hold new ones back, so that a
    gateway's admission counter is read whole before it is killed (the kill takes the counter with it)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.paused = False
        self.inflight = 0

    def try_enter(self) -> bool:
        with self.cv:
            if self.paused:
                return False
            self.inflight += 1
            return True

    def enter(self) -> None:
        while not self.try_enter():
            time.sleep(0.05)

    def leave(self) -> None:
        with self.cv:
            self.inflight -= 1
            self.cv.notify_all()

    @contextmanager
    def paused_submissions(self, timeout_s: float):
        with self.cv:
            self.paused = True
            assert self.cv.wait_for(lambda: self.inflight == 0, timeout_s), "submissions did not end in time"
        try:
            yield
        finally:
            with self.cv:
                self.paused = False


def job_spec(rng: random.Random, limits: dict[str, dict[str, int]], max_tokens_limit: int) -> dict:
    tenant = rng.choice(sorted(TENANT_TIERS))
    tier = rng.choice(TENANT_TIERS[tenant])
    room = limits[tenant][tier]
    size = rng.random()
    if size < 0.08:  # the largest prompt the tier takes, with the fewest tokens to make
        max_tokens = rng.randint(1, 3)
        n_prompt = room - max_tokens
    elif size < 0.14:  # max_tokens at the limit the prompt leaves
        n_prompt = rng.randint(1, 4)
        max_tokens = min(room - n_prompt, max_tokens_limit)
    elif size < 0.2:
        n_prompt, max_tokens = rng.randint(1, 8), 1
    else:
        n_prompt, max_tokens = rng.randint(1, 48), rng.randint(2, 96)
    spec = dict(tenant=tenant, tier=tier, prompt_token_ids=[rng.randint(3, 511) for _ in range(n_prompt)],
                max_tokens=max_tokens, ignore_eos=rng.random() < 0.5, seed=rng.randint(0, 2**31))
    if rng.random() < 0.5:
        spec |= dict(temperature=0.8, top_p=rng.choice([1.0, 0.9]), top_k=rng.choice([None, 20]))
    return spec


def submit_args(spec: dict) -> dict:
    return {k: v for k, v in spec.items() if k != "tenant"}


REFUSED = (QuotaExceeded, Overloaded)


class ClientThread(threading.Thread):
    """Jobs one after another (``one``, the subclass's) until ``stop``, through one blocking GatewayClient per tenant
    over ``self.eps`` (the subclass's order); what it raises is kept in ``crashed`` for the test thread to report."""

    def __init__(self, cluster: DurableCluster, books: Books, stop: threading.Event, seed: int, name: str,
                 gate: SubmitGate | None = None) -> None:
        super().__init__(daemon=True, name=name)
        self.c, self.books, self.stop, self.rng = cluster, books, stop, random.Random(seed)
        self.gate = gate if gate is not None else SubmitGate()  # one never paused holds nothing back
        self.eps: list[str] = []
        self.clients: dict[str, GatewayClient] = {}
        self.crashed: BaseException | None = None

    def client(self, tenant: str) -> GatewayClient:
        if tenant not in self.clients:
            self.clients[tenant] = GatewayClient(self.eps, self.c.key(tenant), timeout_s=5, retries=30)
        return self.clients[tenant]

    def submit(self, spec: dict, key: str):
        """The job, or None if refused; asked again under ``key`` until the answer is definite."""
        deadline = time.monotonic() + 90
        while True:
            self.gate.enter()
            try:
                return self.client(spec["tenant"]).submit(**submit_args(spec), idempotency_key=key)
            except REFUSED as e:
                self.books.refused.append(type(e).__name__)
                return None
            except ServingError:
                if time.monotonic() > deadline:
                    raise
            finally:
                self.gate.leave()
            time.sleep(0.2)

    def run(self) -> None:
        try:
            n = 0
            while not self.stop.is_set():
                n += 1
                self.one(f"{self.name}-{n}")
        except BaseException as e:  # the test thread reports it
            self.crashed = e
        finally:
            for cl in self.clients.values():
                cl.close()

    def one(self, key: str) -> None:
        raise NotImplementedError


class SyncClient(ClientThread):
    def __init__(self, cluster: DurableCluster, books: Books, gate: SubmitGate, stop: threading.Event, seed: int,
                 limits: dict, max_tokens_limit: int, name: str) -> None:
        super().__init__(cluster, books, stop, seed, name, gate)
        self.limits, self.max_tokens_limit = limits, max_tokens_limit
        eps = [cluster.endpoint(g) for g in sorted(cluster.gateways)]
        first = self.rng.randrange(len(eps))
        self.eps = eps[first:] + eps[:first]

    def one(self, key: str) -> None:
        spec = job_spec(self.rng, self.limits, self.max_tokens_limit)
        action = self.rng.choices(ACTIONS, ACTION_WEIGHTS)[0]
        job = self.submit(spec, key)
        if job is None:
            time.sleep(self.rng.uniform(0.1, 0.5))
            return
        rec = dict(id=job.id, spec=spec, action=action, key=key, client="sync")
        self.books.add(rec)
        if action == "again":
            again = self.submit(spec, key)
            if again is None or again.id != job.id:
                self.books.problem(f"{key}: resubmitted under its key, {job.id} came back as {again and again.id}")
        if action == "stream":
            chunks = list(job.stream(timeout=120))
            rec["streamed"] = [t for ch in chunks for t in ch.token_ids]
            rec["indices"] = [ch.index for ch in chunks]
        elif action == "abandon":
            stream = job.stream(timeout=120)
            for _ in zip(range(self.rng.randint(1, 3)), stream):
                pass
            stream.close()
            return
        elif action == "cancel":
            time.sleep(self.rng.uniform(0.0, 1.5))
            rec["cancelled"] = job.cancel()
        with outcome(rec) as got:
            got(job.result(timeout=240))


class AsyncClients(threading.Thread):
    """``n`` coroutines on one event loop, one AsyncGatewayClient per tenant shared by all of them."""

    def __init__(self, cluster: DurableCluster, books: Books, gate: SubmitGate, stop: threading.Event, seed: int,
                 limits: dict, max_tokens_limit: int, n: int) -> None:
        super().__init__(daemon=True, name="async")
        self.c, self.books, self.gate, self.stop, self.seed, self.n = cluster, books, gate, stop, seed, n
        self.limits, self.max_tokens_limit = limits, max_tokens_limit
        self.eps = [self.c.endpoint(g) for g in sorted(self.c.gateways)][::-1]
        self.crashed: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self.main())
        except BaseException as e:
            self.crashed = e

    async def main(self) -> None:
        clients = {t: AsyncGatewayClient(self.eps, self.c.key(t), timeout_s=5, retries=30) for t in TENANT_TIERS}
        try:
            await asyncio.gather(*(self.loop(clients, i) for i in range(self.n)))
        finally:
            for cl in clients.values():
                cl.close()

    async def submit(self, cl: AsyncGatewayClient, spec: dict, key: str):
        deadline = time.monotonic() + 90
        while True:
            while not self.gate.try_enter():
                await asyncio.sleep(0.05)
            try:
                return await cl.submit(**submit_args(spec), idempotency_key=key)
            except REFUSED as e:
                self.books.refused.append(type(e).__name__)
                return None
            except ServingError:
                if time.monotonic() > deadline:
                    raise
            finally:
                self.gate.leave()
            await asyncio.sleep(0.2)

    async def loop(self, clients: dict, i: int) -> None:
        rng = random.Random(self.seed * 100 + i)
        n = 0
        while not self.stop.is_set():
            n += 1
            key = f"async-{i}-{n}"
            spec = job_spec(rng, self.limits, self.max_tokens_limit)
            action = rng.choices(ACTIONS, ACTION_WEIGHTS)[0]
            cl = clients[spec["tenant"]]
            job = await self.submit(cl, spec, key)
            if job is None:
                await asyncio.sleep(rng.uniform(0.1, 0.5))
                continue
            rec = dict(id=job.id, spec=spec, action=action, key=key, client="async")
            self.books.add(rec)
            if action == "again":
                again = await self.submit(cl, spec, key)
                if again is None or again.id != job.id:
                    self.books.problem(f"{key}: resubmitted under its key, {job.id} came back as "
                                       f"{again and again.id}")
            if action == "stream":
                chunks = [ch async for ch in job.stream(timeout=120)]
                rec["streamed"] = [t for ch in chunks for t in ch.token_ids]
                rec["indices"] = [ch.index for ch in chunks]
            elif action == "abandon":
                stream = job.stream(timeout=120)
                for _ in range(rng.randint(1, 3)):
                    if await anext(stream, None) is None:
                        break
                await stream.aclose()
                continue
            elif action == "cancel":
                await asyncio.sleep(rng.uniform(0.0, 1.5))
                rec["cancelled"] = await job.cancel()
            with outcome(rec) as got:
                got(await job.result(timeout=240))


class Faults(threading.Thread):
    """The seeded fault schedule: (at seconds, what, process, freeze seconds), run in order."""

    def __init__(self, cluster: DurableCluster, gate: SubmitGate, seed: int, span_s: float,
                 gateway_metrics: dict[str, str]) -> None:
        super().__init__(daemon=True, name="faults")
        self.c, self.gate, self.gateway_metrics = cluster, gate, gateway_metrics
        rng = random.Random(seed)
        gws, wks = sorted(cluster.gateways), list(cluster.worker_ids)
        events = [("kill", rng.choice(gws)), ("kill", rng.choice(wks)), ("kill", "redis"),
                  ("stop", rng.choice(gws + wks + ["redis"])), ("stop", rng.choice(gws + wks + ["redis"]))]
        rng.shuffle(events)
        # Evenly spread with jitter, so one fault's recovery is mostly over before the next.
        step = span_s / (len(events) + 1)
        self.schedule = [(step * (i + 1) + rng.uniform(-step / 4, step / 4), what, name, rng.uniform(0.5, 2.5))
                         for i, (what, name) in enumerate(events)]
        self.admitted_before_kill: dict[str, float] = {g: 0.0 for g in gws}
        self.log: list[str] = []
        self.crashed: BaseException | None = None

    def run(self) -> None:
        t0 = time.monotonic()
        try:
            for at, what, name, freeze_s in self.schedule:
                time.sleep(max(0.0, t0 + at - time.monotonic()))
                self.log.append(f"{time.monotonic() - t0:.1f}s {what} {name}")
                if what == "stop":
                    pid = self.c.procs[name].pid
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(freeze_s)
                    os.kill(pid, signal.SIGCONT)
                elif name in self.c.gateways:
                    with self.gate.paused_submissions(60):
                        page = scrape(self.gateway_metrics[name])
                        self.admitted_before_kill[name] += summed(page, "ts_admissions_total")
                        self.c.kill(name)
                    self.c.restart(name)
                elif name == "redis":
                    self.c.kill(name)
                    time.sleep(freeze_s)
                    self.c.restart(name)
                else:
                    self.c.kill(name)
                    self.c.restart(name)
        except BaseException as e:
            self.crashed = e
