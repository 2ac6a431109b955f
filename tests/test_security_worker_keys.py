"""A worker id belongs to the CURVE key it first said hello with. ZeroMQ's ROUTER refuses a second connection with
an identity in use, but not a later one: once a worker's connection was gone (it restarted, or was cut off), a holder
of any other listed key could connect under its id and, without a hello, store its jobs' results, or, with one, take
it over. Real parts: a redis-server, a `python -m gateway` process with CURVE on its worker socket and two listed
worker keys, and raw CURVE DEALERs playing the workers."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import zmq

from common import protocol as P
from common.keys import generate, load_public
from common.ports import free_port
from common.redis_server import RedisServer
from common.sockets import curve_client, make_socket
from gateway.sdk import GatewayClient
from scripts.up import write_tenants
from tests.cluster_helpers import stop_process, wait_for

ROOT = Path(__file__).resolve().parent.parent
MODEL = "any-model"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wkeys")
    keys = generate(tmp / "keys", ["wk-a", "wk-b"])
    tenants = write_tenants(tmp / "tenants.toml")
    client_ep, worker_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    # Long timeouts: the test acts while the cut-off worker is still registered and still holds its lease.
    env = dict(os.environ, PYTHONPATH=str(ROOT), OTEL_TRACES_EXPORTER="none",
               TS_GATEWAY_KEY_PREFIX=f"wkeys-{uuid.uuid4().hex[:8]}",
               TS_GATEWAY_METRICS_BIND=f"127.0.0.1:{free_port()}",
               TS_GATEWAY_AUTHORIZED_WORKERS_DIR=str(keys["allow_list"]),
               TS_GATEWAY_CURVE_SECRET_KEY_FILE=str(keys["gateway_secret"]),
               TS_GATEWAY_WORKER_TIMEOUT_S="60", TS_GATEWAY_LEASE_S="120")
    log = tmp / "gateway.log"
    with RedisServer() as redis_server, log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway", "--client-bind", client_ep, "--worker-bind",
                                 worker_ep, "--redis-url", redis_server.url, "--tenants-file",
                                 str(tmp / "tenants.toml")], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        state = {"client": client_ep, "workers": worker_ep, "keys": keys, "tenants": tenants, "log": log}
        try:
            wait_for(lambda: proc.poll() is None and "workers on" in log.read_text(), 60, "the gateway to start")
            yield state
        finally:
            stop_process(proc, timeout=15)


def _peer(gw, identity: str, key_name: str) -> zmq.Socket:
    s = make_socket(zmq.Context.instance(), zmq.DEALER, identity=identity.encode())
    s.setsockopt(zmq.LINGER, 0)
    curve_client(s, load_public(gw["keys"]["gateway_public"]), gw["keys"][f"worker:{key_name}"])
    s.connect(gw["workers"])
    return s


def _first_reply(gw, identity: str, key_name: str, msg, timeout_s: float = 20) -> tuple[zmq.Socket, object]:
    """A new peer that sends ``msg`` until it gets an answer. ROUTER drops a connection whose identity is still in
    use, so a peer that connected before the gateway saw the last one go is silently unheard: connect again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = _peer(gw, identity, key_name)
        s.send(P.encode(msg))
        if s.poll(1000):
            return s, P.decode(s.recv())
        s.close()
    raise AssertionError(f"no answer to {type(msg).__name__} from {identity} with key {key_name}")


def _reply(sock: zmq.Socket, msg, timeout_ms: int = 10_000):
    sock.send(P.encode(msg))
    assert sock.poll(timeout_ms), f"no answer to {type(msg).__name__}"
    return P.decode(sock.recv())


def _hello(worker_id: str) -> P.WorkerHello:
    return P.WorkerHello(worker_id, MODEL, 512, 2048, 4, 512)


def _finished(dispatch: P.DispatchJob, tokens: list[int]) -> P.JobFinished:
    return P.JobFinished(dispatch.job_id, dispatch.attempt, "done", "length", len(tokens), 0.0, 0.0, 0,
                         token_ids=tokens)


def test_another_key_cannot_take_over_a_worker_id_after_its_connection_is_gone(gateway):
    worker, welcome = _first_reply(gateway, "wk-a", "wk-a", _hello("wk-a"))
    assert isinstance(welcome, P.GatewayWelcome), welcome
    client = GatewayClient(gateway["client"], gateway["tenants"]["lab-co"]["api_key"], timeout_s=30)
    try:
        worker.send(P.encode(P.WorkerLoad("wk-a", 1, 512, {}, {}, [], 0.0)))
        job = client.submit(prompt_token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True)
        assert worker.poll(10_000), "no job dispatched to wk-a"
        dispatch = P.decode(worker.recv())
        assert isinstance(dispatch, P.DispatchJob) and dispatch.job_id == job.id, dispatch
        worker.close()  # wk-a is cut off: still registered here, still holding the job's lease

        # Key wk-b, connected as wk-a: its result for wk-a's job is not taken (no hello from this key), and its
        # hello as wk-a is refused.
        rogue, answer = _first_reply(gateway, "wk-a", "wk-b", _finished(dispatch, [9, 9, 9, 9]))
        assert isinstance(answer, P.ErrorReply) and answer.code == P.HELLO_FIRST, answer
        refused = _reply(rogue, _hello("wk-a"))
        assert isinstance(refused, P.ErrorReply) and refused.code == "forbidden", refused
        assert "another key" in refused.message
        rogue.send(P.encode(P.WorkerLoad("wk-a", 1, 512, {}, {}, [dispatch.job_id], 0.0)))
        assert client.status(job.id).state == "dispatched"
        rogue.close()

        # wk-a's own key, reconnected: its frames count again, with or without a new hello.
        worker, ack = _first_reply(gateway, "wk-a", "wk-a", _finished(dispatch, [5, 6, 7, 8]))
        assert ack == P.JobFinishedAck(dispatch.job_id, dispatch.attempt), ack
        assert job.result(timeout=30).token_ids == [5, 6, 7, 8]
        assert isinstance(_reply(worker, _hello("wk-a")), P.GatewayWelcome)
        worker.close()

        # A key may serve several ids (compose's scaled workers share one pair); an id it was first is its own.
        for wid in ("wk-b", "wk-c"):
            peer, hi = _first_reply(gateway, wid, "wk-b", _hello(wid))
            assert isinstance(hi, P.GatewayWelcome), (wid, hi)
            peer.close()
        _, no = _first_reply(gateway, "wk-c", "wk-a", _hello("wk-c"))
        assert isinstance(no, P.ErrorReply) and no.code == "forbidden", no
        assert "refused hello from wk-a" in gateway["log"].read_text()
    finally:
        client.close()


def test_the_id_memory_is_bounded_and_never_forgets_a_registered_worker():
    from gateway.security import WorkerKeys

    keys = WorkerKeys(memory=3)
    registered = {"wk-0"}
    assert keys.claim("wk-0", "key-a", registered) is None
    for i in range(1, 10):  # a stranger's made-up ids cannot grow it, nor push a registered worker out
        assert keys.claim(f"made-up-{i}", "key-b", registered) is None
    assert len(keys.keys) == 3 and keys.claim("wk-0", "key-b", registered) == "key-a"
    assert keys.matches("wk-0", "key-a") and not keys.matches("wk-0", "key-b") and not keys.matches("wk-9", None)
