"""A refused hello changes nothing. The first acceptable hello pins the cluster's model, vocabulary and context on a
gateway; a hello refused because its worker id belongs to another key had pinned them all the same, so a listed key
saying hello under a live worker's id, with another model, shut every real worker out of a gateway that had just
started (a restart, a new one): their hellos were refused as "differs from this cluster's". Real parts: a
redis-server, a `python -m gateway` process with CURVE on its worker socket, and raw CURVE DEALERs as workers."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import zmq

from common import protocol as P
from common.keys import generate, load_public
from common.ports import free_port
from common.redis_keys import KeySpace
from common.redis_server import RedisServer
from common.sockets import curve_client, make_socket
from scripts.up import write_tenants
from tests.cluster_helpers import stop_process, wait_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def gateway(tmp_path):
    keys = generate(tmp_path / "keys", ["wk-a", "wk-b"])
    write_tenants(tmp_path / "tenants.toml")
    client_ep, worker_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    prefix = f"hello-{uuid.uuid4().hex[:8]}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OTEL_TRACES_EXPORTER="none", TS_GATEWAY_KEY_PREFIX=prefix,
               TS_GATEWAY_AUTHORIZED_WORKERS_DIR=str(keys["allow_list"]),
               TS_GATEWAY_CURVE_SECRET_KEY_FILE=str(keys["gateway_secret"]))
    log = tmp_path / "gateway.log"
    with RedisServer() as redis_server, log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "--client-bind", client_ep, "--worker-bind",
                                 worker_ep, "--redis-url", redis_server.url, "--tenants-file",
                                 str(tmp_path / "tenants.toml")], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: proc.poll() is None and "workers on" in log.read_text(), 60, "the gateway to start")
            yield {"workers": worker_ep, "keys": keys, "redis": redis_server, "space": KeySpace(prefix)}
        finally:
            stop_process(proc, timeout=15)


def _hello(gw, identity: str, key_name: str, model: str, max_model_len: int):
    s = make_socket(zmq.Context.instance(), zmq.DEALER, identity=identity.encode())
    s.setsockopt(zmq.LINGER, 0)
    curve_client(s, load_public(gw["keys"]["gateway_public"]), gw["keys"][f"worker:{key_name}"])
    s.connect(gw["workers"])
    try:
        s.send(P.encode(P.WorkerHello(identity, model, 512, max_model_len, 4, 512)))
        assert s.poll(20_000), f"no answer to the hello of {identity}"
        return P.decode(s.recv())
    finally:
        s.close()


def test_a_hello_refused_for_its_key_pins_nothing(gateway):
    # wk-live is bound to key wk-a in the cluster (its worker said hello to another gateway, or to this one
    # before it restarted).
    bound_to = load_public(gateway["keys"]["worker:wk-a"]).decode()
    gateway["redis"].client().set(gateway["space"].worker_key("wk-live"), bound_to, px=60_000)

    refused = _hello(gateway, "wk-live", "wk-b", "another-model", 4096)
    assert isinstance(refused, P.ErrorReply) and refused.code == "forbidden", refused
    assert "another key" in refused.message

    welcome = _hello(gateway, "wk-new", "wk-a", "the-model", 2048)
    assert isinstance(welcome, P.GatewayWelcome), welcome
    # And what it pinned is the accepted worker's.
    other = _hello(gateway, "wk-other", "wk-a", "another-model", 2048)
    assert isinstance(other, P.ErrorReply) and "differs" in other.message, other
