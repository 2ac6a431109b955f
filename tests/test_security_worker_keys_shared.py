"""A worker id's key binding is the cluster's, not one gateway's memory: a gateway that restarted, or another gateway
of the cluster, must refuse a hello under a live worker's id from another listed key. Before, each gateway bound an id
to the first key it heard it from, so a holder of any listed key could take a live worker's id at a gateway that had
not heard the worker yet (a restart's first second, a gateway the worker was slow to reach) and be sent its jobs.
Real parts: a redis-server, two `python -m gateway` processes on one key prefix with CURVE on their worker sockets,
and raw CURVE DEALERs playing the workers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from common import protocol as P
from common.keys import generate
from common.ports import free_port
from common.redis_keys import KeySpace
from common.redis_server import RedisServer
from gateway.security import SharedWorkerKeys
from scripts.up import write_tenants
from tests.cluster_helpers import stop_process, wait_for
from tests.test_security_worker_keys import _first_reply, _hello, _reply

ROOT = Path(__file__).resolve().parent.parent


def _start_gateway(tmp: Path, name: str, redis_url: str, prefix: str, keys: dict) -> tuple[subprocess.Popen, dict]:
    client_ep, worker_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OTEL_TRACES_EXPORTER="none", TS_GATEWAY_KEY_PREFIX=prefix,
               TS_GATEWAY_GATEWAY_ID=name, TS_GATEWAY_METRICS_BIND=f"127.0.0.1:{free_port()}",
               TS_GATEWAY_AUTHORIZED_WORKERS_DIR=str(keys["allow_list"]),
               TS_GATEWAY_CURVE_SECRET_KEY_FILE=str(keys["gateway_secret"]),
               TS_GATEWAY_WORKER_TIMEOUT_S="60", TS_GATEWAY_LEASE_S="120")
    log = tmp / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "--client-bind", client_ep, "--worker-bind",
                                 worker_ep, "--redis-url", redis_url, "--tenants-file", str(tmp / "tenants.toml")],
                                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    wait_for(lambda: proc.poll() is None and "workers on" in log.read_text(), 60, f"{name} to start")
    return proc, {"client": client_ep, "workers": worker_ep, "keys": keys, "log": log}


@pytest.fixture
def two_gateways(tmp_path):
    keys = generate(tmp_path / "keys", ["wk-a", "wk-b"])
    write_tenants(tmp_path / "tenants.toml")
    prefix = f"wkshared-{uuid.uuid4().hex[:8]}"
    procs = []
    with RedisServer() as redis_server:
        try:
            for name in ("gw-1", "gw-2"):
                proc, gw = _start_gateway(tmp_path, name, redis_server.url, prefix, keys)
                procs.append((proc, gw))
            yield [gw for _, gw in procs], (tmp_path, redis_server.url, prefix, keys), procs
        finally:
            for proc, _ in procs:
                stop_process(proc, timeout=15)


def test_another_gateway_and_a_restarted_one_refuse_a_live_workers_id_under_another_key(two_gateways):
    (gw1, gw2), (tmp, redis_url, prefix, keys), procs = two_gateways
    worker, welcome = _first_reply(gw1, "wk-a", "wk-a", _hello("wk-a"))
    assert isinstance(welcome, P.GatewayWelcome), welcome

    # gw-2 never heard wk-a: key wk-b's hello under its id is refused there too.
    rogue, refused = _first_reply(gw2, "wk-a", "wk-b", _hello("wk-a"))
    assert isinstance(refused, P.ErrorReply) and refused.code == "forbidden", refused
    assert "another key" in refused.message
    rogue.close()

    # gw-1 restarts (kill -9): the new process has no memory of wk-a, the cluster does.
    old, _ = procs[0]
    old.kill()
    old.wait(10)
    proc, gw1b = _start_gateway(tmp, "gw-1b", redis_url, prefix, keys)
    procs[0] = (proc, gw1b)
    rogue, refused = _first_reply(gw1b, "wk-a", "wk-b", _hello("wk-a"))
    assert isinstance(refused, P.ErrorReply) and refused.code == "forbidden", refused
    rogue.close()
    for gw in (gw2, gw1b):
        wait_for(lambda: "refused hello from wk-a" in gw["log"].read_text(), 10, "the refusal logged")

    # The worker's own key is welcome everywhere, and an id no key holds is free to the first.
    for gw in (gw1b, gw2):
        peer, hi = _first_reply(gw, "wk-a", "wk-a", _hello("wk-a"))
        assert isinstance(hi, P.GatewayWelcome), hi
        peer.close()
        assert isinstance(_reply(_first_reply(gw, "wk-new", "wk-b", _hello("wk-new"))[0], _hello("wk-new")),
                          P.GatewayWelcome)
    worker.close()


def test_a_binding_lasts_its_ttl_from_the_last_refresh_then_frees_the_id():
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        try:
            keys = KeySpace(f"wkttl-{uuid.uuid4().hex[:8]}")
            a = SharedWorkerKeys(client, keys, ttl_s=0.6)
            b = SharedWorkerKeys(client, keys, ttl_s=0.6)  # another gateway of the cluster
            assert a.claim("wk-0", "key-a") is None
            assert b.claim("wk-0", "key-b") == "key-a"
            time.sleep(0.4)
            assert a.claim("wk-0", "key-a") is None  # a refresh: the binding lives 0.6 s from now
            time.sleep(0.4)
            assert b.claim("wk-0", "key-b") == "key-a"
            wait_for(lambda: b.claim("wk-0", "key-b") is None, 5, "the binding to expire")
            assert a.claim("wk-0", "key-a") == "key-b"
            assert 0 < client.pttl(keys.worker_key("wk-0")) <= 600
        finally:
            client.close()


def test_the_clusters_binding_decides_while_redis_answers_and_memory_while_it_does_not():
    from gateway.security import WorkerKeys

    with RedisServer() as server:
        client = redis.Redis.from_url(server.url, socket_timeout=2)
        try:
            keys = KeySpace(f"wkmem-{uuid.uuid4().hex[:8]}")
            here = WorkerKeys(shared=SharedWorkerKeys(client, keys, ttl_s=0.3))
            assert here.claim("wk-0", "key-a", set()) is None and here.matches("wk-0", "key-a")
            # wk-0 is gone for good: once its binding expires, a worker moved to a new key takes its id, here too.
            wait_for(lambda: client.exists(keys.worker_key("wk-0")) == 0, 5, "the binding to expire")
            assert here.claim("wk-0", "key-b", set()) is None
            assert here.matches("wk-0", "key-b") and not here.matches("wk-0", "key-a")
            assert here.claim("wk-0", "key-a", set()) == "key-b"
        finally:
            client.close()
    # Redis gone: this gateway's memory decides, and a hello is not refused for Redis's silence.
    dead = redis.Redis(host="127.0.0.1", port=free_port(), socket_timeout=0.5, socket_connect_timeout=0.5,
                       retry=Retry(NoBackoff(), 0))
    alone = WorkerKeys(shared=SharedWorkerKeys(dead, KeySpace("wkdead"), ttl_s=20))
    assert alone.claim("wk-1", "key-a", set()) is None
    assert alone.claim("wk-1", "key-b", set()) == "key-a"
    alone.refresh("wk-1", "key-a")  # logged, not raised
    # Asked at the hello a moment ago: a Redis that does not answer is not asked again at every load report.
    assert not alone.shared.due("wk-1")
