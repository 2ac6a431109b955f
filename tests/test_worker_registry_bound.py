"""The worker registry is bounded: a peer saying hello under fresh worker ids cannot grow it without end.

Without CURVE (insecure_workers) any peer on the worker socket is taken at its hello's word, and every hello under a
new id was kept until the worker timeout: a peer looping hellos grew the registry (and every pass over it: dispatch,
admission limits, scrapes) by as many as it could send in that time. Now past MAX_WORKERS the oldest worker that never
reported is forgotten to make room, and a hello finding every registered worker reporting is refused. Real parts: a
gateway built as `python -m gateway` builds it on a real redis-server, and real DEALER sockets as the peer, one per
id (a worker's routing id is its worker id). The same registry serves CURVE gateways: a listed key looping ids meets
the same bound, and a hello refused for want of room binds no id to its key.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import zmq

from common import protocol as P
from common.keys import generate, load_public
from common.redis_keys import KeySpace
from common.redis_server import RedisServer
from common.sockets import curve_client
from gateway.__main__ import build
from gateway.config import GatewayConfig
from gateway.security import secure_sockets
from gateway.workers import MAX_WORKERS
from scripts.up import write_tenants
from tests.gateway_helpers import built_gateway

BATCH = 128


@contextmanager
def _curve_gateway(tmp_path: Path) -> Iterator[tuple]:
    """(the gateway, with CURVE on its worker socket and one listed worker key; the key files; its key space)."""
    keys = generate(tmp_path / "keys", ["wk-a"])
    write_tenants(tmp_path / "tenants.toml")
    space = KeySpace(f"registry-curve-{uuid.uuid4().hex[:8]}")
    with RedisServer() as server:
        config = GatewayConfig(client_bind="tcp://127.0.0.1:*", worker_bind="tcp://127.0.0.1:*", redis_url=server.url,
                               tenants_file=str(tmp_path / "tenants.toml"), key_prefix=space.prefix,
                               curve_secret_key_file=str(keys["gateway_secret"]),
                               authorized_workers_dir=str(keys["allow_list"]))
        gw = build(config)
        auth = secure_sockets(gw, config)  # as `python -m gateway` does, after build
        try:
            gw.bind()
            yield gw, keys, space, server
        finally:
            gw.close()
            auth.stop()


def _hello(worker_id: str) -> P.WorkerHello:
    return P.WorkerHello(worker_id, "tiny", 512, 256, 2, 64)


def _load(worker_id: str) -> P.WorkerLoad:
    return P.WorkerLoad(worker_id, free_slots=0, free_kv_blocks=64, running={}, waiting={}, job_ids=[],
                        preemption_cost_s=0.0)


def _say_hello(gw, endpoint: str, ids: list[str], report: bool = False, keys: dict | None = None) -> list:
    """Each id's hello (and a load report after its welcome, where ``report``) from a DEALER of its own (a CURVE
    client with the listed key wk-a, where ``keys``); returns the gateway's answer to each hello, in order."""
    with ExitStack() as stack:
        socks = []
        for wid in ids:
            s = zmq.Context.instance().socket(zmq.DEALER)
            stack.callback(s.close, 0)
            s.setsockopt(zmq.IDENTITY, wid.encode())
            s.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                curve_client(s, load_public(keys["gateway_public"]), keys["worker:wk-a"])
            s.connect(endpoint)
            s.send(P.encode(_hello(wid)))
            socks.append(s)
        answers: list = [None] * len(ids)
        for _ in range(2000):
            gw._drain(gw.worker_sock, gw._worker_handlers)
            for i, s in enumerate(socks):
                if answers[i] is None and s.poll(0):
                    answers[i] = P.decode(s.recv())
                    if report and isinstance(answers[i], P.GatewayWelcome):
                        s.send(P.encode(_load(ids[i])))
            if all(a is not None for a in answers):
                break
            socks[0].poll(5)  # bounded: the gateway's answers come over loopback
        else:
            raise AssertionError(f"{sum(a is None for a in answers)} hellos never answered")
        if report:  # every report read before the sockets close
            reported = [w for w, a in zip(ids, answers) if isinstance(a, P.GatewayWelcome)]
            for _ in range(2000):
                gw._drain(gw.worker_sock, gw._worker_handlers)
                if all(gw.workers.workers[w].load is not None for w in reported):
                    break
                socks[0].poll(5)
            else:
                raise AssertionError("the load reports never read")
        return answers


def _flood(gw, endpoint: str, prefix: str, n: int, report: bool = False, keys: dict | None = None) -> list:
    answers = []
    for start in range(0, n, BATCH):
        answers += _say_hello(gw, endpoint, [f"{prefix}-{i}" for i in range(start, min(n, start + BATCH))], report,
                              keys)
    return answers


def test_hellos_under_fresh_ids_forget_the_oldest_silent_ones_and_keep_the_reporting_ones(tmp_path):
    with built_gateway(tmp_path, "registry-bound") as (gw, _, _):
        endpoint = gw.worker_sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        assert _say_hello(gw, endpoint, ["wk-real"], report=True) == [P.GatewayWelcome(gw.config.gateway_id)]

        extra = 300
        answers = _flood(gw, endpoint, "fake", MAX_WORKERS + extra)
        assert all(isinstance(a, P.GatewayWelcome) for a in answers)  # room is made, no one is refused
        registered = gw.workers.workers
        assert len(registered) == MAX_WORKERS
        assert "wk-real" in registered and registered["wk-real"].load is not None
        # The newest silent ones stay: the first to go were the oldest. Batches come one after another, but within
        # one the gateway reads the hellos in whatever order its ROUTER queues their connections: the forgotten are
        # the oldest batches whole, then some of the batch that holds the last of them.
        forgotten = {f"fake-{i}" for i in range(MAX_WORKERS + extra)} - set(registered)
        last_batch = extra // BATCH  # the batch of the (extra + 1)th oldest
        assert len(forgotten) == extra + 1
        assert forgotten >= {f"fake-{i}" for i in range(last_batch * BATCH)}, "a newer one went before an older"
        assert forgotten <= {f"fake-{i}" for i in range((last_batch + 1) * BATCH)}, "a newer one went before an older"
        assert gw.counters["workers_forgotten"] == extra + 1
        assert gw.counters["hello_refused"] == 0


def test_a_hello_finding_every_worker_reporting_is_refused_and_changes_nothing(tmp_path):
    with built_gateway(tmp_path, "registry-full") as (gw, _, _):
        endpoint = gw.worker_sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        answers = _flood(gw, endpoint, "wk", MAX_WORKERS, report=True)
        assert all(isinstance(a, P.GatewayWelcome) for a in answers)
        before = dict(gw.workers.workers)
        assert len(before) == MAX_WORKERS

        (refused,) = _say_hello(gw, endpoint, ["wk-late"])
        assert isinstance(refused, P.ErrorReply) and refused.code == "forbidden", refused
        assert "workers" in refused.message
        assert gw.workers.workers == before  # nothing forgotten, nothing added
        assert gw.counters["hello_refused"] == 1 and gw.counters["workers_forgotten"] == 0
        # A registered worker's own hello (its periodic one) is no newcomer: welcome as ever.
        assert _say_hello(gw, endpoint, ["wk-7"]) == [P.GatewayWelcome(gw.config.gateway_id)]
        assert len(gw.workers.workers) == MAX_WORKERS


def test_with_curve_a_listed_key_meets_the_same_bound_and_a_refused_hello_binds_no_id(tmp_path):
    with _curve_gateway(tmp_path) as (gw, keys, space, server):
        endpoint = gw.worker_sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        answers = _flood(gw, endpoint, "wk", MAX_WORKERS, report=True, keys=keys)
        assert all(isinstance(a, P.GatewayWelcome) for a in answers)
        assert len(gw.workers.workers) == MAX_WORKERS
        redis = server.client()
        assert redis.exists(space.worker_key("wk-0")) == 1  # each accepted id is bound to the key it came with

        (refused,) = _say_hello(gw, endpoint, ["wk-late"], keys=keys)
        assert isinstance(refused, P.ErrorReply) and refused.code == "forbidden", refused
        assert len(gw.workers.workers) == MAX_WORKERS and "wk-late" not in gw.workers.workers
        assert redis.exists(space.worker_key("wk-late")) == 0
        assert gw.counters["hello_refused"] == 1 and gw.counters["workers_forgotten"] == 0
