"""One model per cluster, pinned in its Redis (gateway/model_pin.py), not per gateway.

Each gateway pinned the model of the first worker it took, in its memory: two gateways that heard workers of two
models in another order each took one and refused the other, and a restarted gateway took whichever came first.
The jobs in their shared queues went to both models, each answer marked done. Real parts: a real redis-server,
two real `python -m gateway` processes on it, and raw worker hellos over real ZeroMQ sockets."""

from __future__ import annotations

import os
import signal
import time
import uuid
from contextlib import contextmanager

import pytest
import redis
import zmq

from common import protocol as P
from common.redis_server import RedisServer
from common.sockets import make_socket
from common.redis_keys import KeySpace
from gateway.model_pin import UNKNOWN, ModelPin
from tests.cluster_helpers import wait_for
from tests.gateway_helpers import built_gateway
from tests.test_model_digest import _hello, _raw_hello
from tests.test_outage_token_share import _admit
from tests.test_tokenizer_match import _Gateway

LAPSE_ENV = {"TS_GATEWAY_LEASE_S": "1", "TS_GATEWAY_WORKER_TIMEOUT_S": "1"}  # the pin outlives its last worker 2 s
D1, D2 = "sha256t:" + "1" * 64, "sha256t:" + "2" * 64


def _welcomed(endpoint: str, hello: P.WorkerHello) -> bool:
    reply = _raw_hello(endpoint, hello)
    assert isinstance(reply, (P.GatewayWelcome, P.ErrorReply)), reply
    return isinstance(reply, P.GatewayWelcome)


@contextmanager
def _two_gateways(tmp_path):
    """Two `python -m gateway` processes on one real redis-server, under one key prefix; (their list, the Redis url,
    the prefix): a test may replace one in the list, and every one in it is stopped after."""
    with RedisServer() as redis_server:
        prefix = f"pin-{uuid.uuid4().hex[:8]}"
        gws = [_Gateway(tmp_path, f"gw-{i}", redis_server.url, prefix) for i in range(2)]
        try:
            for gw in gws:
                gw.started()
            yield gws, redis_server.url, prefix
        finally:
            for gw in gws:
                gw.stop()


def test_two_gateways_and_a_restarted_one_hold_workers_to_the_clusters_one_model(tmp_path):
    with _two_gateways(tmp_path) as (gws, redis_url, prefix):
        assert _welcomed(gws[0].workers, _hello("wk-a", "/mnt/a/model", D1))
        # gw-1 has taken no worker yet: the cluster's model is wk-a's, not the first gw-1 hears.
        assert not _welcomed(gws[1].workers, _hello("wk-b", "/mnt/b/model", D2))
        assert "refused hello from wk-b" in gws[1].log.read_text()
        assert _welcomed(gws[1].workers, _hello("wk-c", "/srv/c/model", D1))  # the same weights elsewhere
        gws[0].stop()  # well within the pin's 20 s (lease 10 s, worker timeout 5 s)
        gws[0] = _Gateway(tmp_path, "gw-0-again", redis_url, prefix).started()
        assert not _welcomed(gws[0].workers, _hello("wk-d", "/mnt/b/model", D2))
        assert _welcomed(gws[0].workers, _hello("wk-e", "/mnt/a/model", D1))


def test_with_no_worker_of_it_heard_for_the_pins_lifetime_the_cluster_may_serve_another_model(tmp_path,
                                                                                           monkeypatch):
    for name, value in LAPSE_ENV.items():
        monkeypatch.setenv(name, value)
    with _two_gateways(tmp_path) as (gws, _, _):
        assert _welcomed(gws[0].workers, _hello("wk-a", "/mnt/a/model", D1))
        assert not _welcomed(gws[1].workers, _hello("wk-b", "/mnt/b/model", D2))
        time.sleep(2.5)  # no load report kept it: wk-a's hello was its last keep
        assert _welcomed(gws[1].workers, _hello("wk-b", "/mnt/b/model", D2))
        assert not _welcomed(gws[0].workers, _hello("wk-c", "/mnt/a/model", D1))


@contextmanager
def _stopped(server):
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.pid, signal.SIGCONT)


def _backing_off(gw) -> None:
    """The gateway starts a Redis back-off that lasts the test, whatever the machine's pace."""
    gw._redis_failed(redis.ConnectionError("test: the back-off starts"))
    gw._redis_retry_at = gw.clock() + 600


def _hello_in_process(gw, hello: P.WorkerHello):
    """``hello`` sent to the in-process gateway ``gw`` from a worker socket of its own; the gateway's reply."""
    sock = make_socket(zmq.Context.instance(), zmq.DEALER, identity=hello.worker_id.encode())
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(gw.worker_sock.getsockopt_string(zmq.LAST_ENDPOINT))
        sock.send(P.encode(hello))
        return _answered(gw, sock)
    finally:
        sock.close()


def test_while_redis_does_not_answer_the_gateways_memory_of_the_model_decides(tmp_path):
    with built_gateway(tmp_path, "pin-outage") as (gw, _, server):
        assert isinstance(_hello_in_process(gw, _hello("wk-a", "/mnt/a/model", D1)), P.GatewayWelcome)
        assert gw.queue.client.hget(gw.queue.keys.model, "digest:sha256t") == D1.encode()
        with _stopped(server):
            _backing_off(gw)
            assert isinstance(_hello_in_process(gw, _hello("wk-b", "/srv/b/model", D1)), P.GatewayWelcome)
            refused = _hello_in_process(gw, _hello("wk-c", "/mnt/a/model", D2))
            assert isinstance(refused, P.ErrorReply) and "weights" in refused.message, refused


def _answered(gw, sock) -> P.Message:
    wait_for(lambda: (gw._drain(gw.worker_sock, gw._worker_handlers), sock.poll(0))[1], 10, "the answer")
    return P.decode(sock.recv())


def _report(gw, sock, read) -> None:
    """wk-a reports a free slot, and the gateway reads it (until ``read()``)."""
    sock.send(P.encode(P.WorkerLoad("wk-a", 1, 1024, {}, {}, [], 0.0)))
    wait_for(lambda: (gw._drain(gw.worker_sock, gw._worker_handlers), read())[1], 10, "the report read")



@contextmanager
def _in_process(tmp_path, pinned: str | None):
    """An in-process gateway on a real Redis (pinned first to ``pinned``'s weights by another gateway, if given), its
    redis-server and wk-a's socket."""
    with built_gateway(tmp_path, "pin-confirm") as (gw, _, server):
        if pinned is not None:
            assert ModelPin(gw.queue.client, gw.queue.keys, 20.0).keep(_hello("wk-b", "/mnt/b/model", pinned))
        sock = make_socket(zmq.Context.instance(), zmq.DEALER, identity=b"wk-a")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(gw.worker_sock.getsockopt_string(zmq.LAST_ENDPOINT))
        try:
            yield gw, sock, server
        finally:
            sock.close()


def _welcomed_in_an_outage(gw, sock) -> None:
    """wk-a says hello while the gateway waits out a Redis back-off: its memory alone takes it."""
    _backing_off(gw)
    sock.send(P.encode(_hello("wk-a", "/mnt/a/model", D1)))
    assert isinstance(_answered(gw, sock), P.GatewayWelcome)


def _back(gw) -> None:
    """Redis answers again and the back-off is over: the loop replays the frames kept meanwhile first."""
    gw._redis_retry_at, gw._answer_clients_first = 0.0, False
    gw.replay_kept()


def test_a_worker_taken_by_memory_alone_is_dropped_once_redis_says_the_cluster_serves_another_model(tmp_path):
    """While Redis did not answer, a gateway with no model in its memory took wk-a; meanwhile another gateway had
    pinned another model. Kept, wk-a would answer jobs with its own model, every answer marked done: its first load
    report once Redis answers drops it (its leases run out, and its jobs go to the cluster's model)."""
    # One socket throughout (_in_process): a ROUTER refuses a second connection with an identity in use.
    with _in_process(tmp_path, None) as (gw, sock, server):
        with _stopped(server):
            _welcomed_in_an_outage(gw, sock)
        gw._redis_retry_at, gw._answer_clients_first = 0.0, False  # the back-off is over
        other = ModelPin(gw.queue.client, gw.queue.keys, 20.0)  # another gateway's, taking a worker of its model
        assert other.keep(_hello("wk-b", "/mnt/b/model", D2)).weights_digests == {"sha256t": D2}
        _report(gw, sock, lambda: "wk-a" not in gw.workers.workers)
        sock.send(P.encode(_hello("wk-a", "/mnt/a/model", D1)))
        refused = _answered(gw, sock)
        assert isinstance(refused, P.ErrorReply) and "weights" in refused.message, refused
        assert gw.counters["workers_of_another_model"] == 1


def test_a_keep_redis_did_not_answer_is_not_noted_as_done(tmp_path):
    """A keep whose call timed out was noted as done: the worker's reports skipped the pin's check for a quarter of
    its lifetime (5 s by default), a worker taken while Redis did not answer included."""
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url, socket_timeout=0.5)
        pin = ModelPin(client, KeySpace(f"pin-{uuid.uuid4().hex[:8]}"), 20.0)
        with _stopped(server):
            assert pin.keep(_hello("wk-a", "/mnt/a/model", D1)) is UNKNOWN
        assert pin.due("wk-a")
        assert pin.keep(_hello("wk-a", "/mnt/a/model", D1)).weights_digests == {"sha256t": D1}
        assert not pin.due("wk-a")
        client.close()


@pytest.mark.parametrize("pinned", [D2, D1], ids=["another model", "its model"])
def test_a_worker_taken_by_memory_alone_gets_no_job_before_redis_confirms_its_model(tmp_path, pinned):
    """wk-a's report comes once the back-off is over but while Redis is still stopped: a Redis call under it times
    out, its credit is taken and its check of the pin is not made. Dispatch, once Redis answers, sent it the queued
    jobs before its next report could drop it. It now gets none until Redis has said its model is the cluster's
    (then at once, where it is)."""
    with _in_process(tmp_path, pinned) as (gw, sock, server):
        with _stopped(server):
            _welcomed_in_an_outage(gw, sock)
            gw._redis_retry_at = 0.0
            _report(gw, sock, gw._redis_down)  # handled at once (Redis is not known down): a call under it times out
            assert not gw.kept and gw.workers.workers["wk-a"].load is not None
        _back(gw)
        _admit(gw, "job-1")
        gw.dispatch(gw.clock())
        if sock.poll(300):
            raise AssertionError(f"sent to a worker whose model Redis never confirmed: {P.decode(sock.recv())}")
        _report(gw, sock, lambda: "wk-a" not in gw.workers.workers or not gw.workers.workers["wk-a"].unconfirmed)
        gw.dispatch(gw.clock())
        if pinned == D2:
            assert "wk-a" not in gw.workers.workers and gw.counters["workers_of_another_model"] == 1
            assert not sock.poll(300) and gw.queue.get("job-1").state == "queued"
        else:
            assert isinstance(dispatch := _answered(gw, sock), P.DispatchJob) and dispatch.job_id == "job-1", dispatch


def test_a_pin_this_gateway_cannot_read_leaves_the_decision_to_its_memory_and_the_workers_their_jobs(tmp_path):
    """A pin Redis holds but this gateway cannot read (another version's, a hand edit) says nothing: the gateway's
    memory decides, as while Redis does not answer. Taken as Redis not answering, its workers waited for a check that
    could never pass, and the cluster ran nothing."""
    with _in_process(tmp_path, None) as (gw, sock, _):
        gw.queue.client.hset(gw.queue.keys.model, mapping={"model": "/mnt/a/model", "vocab_size": "many"})
        sock.send(P.encode(_hello("wk-a", "/mnt/a/model", D1)))
        assert isinstance(_answered(gw, sock), P.GatewayWelcome)
        _report(gw, sock, lambda: gw.workers.workers["wk-a"].load is not None)
        _admit(gw, "job-1")
        gw.dispatch(gw.clock())
        assert isinstance(dispatch := _answered(gw, sock), P.DispatchJob) and dispatch.job_id == "job-1", dispatch
        refused = _hello_in_process(gw, _hello("wk-b", "/mnt/b/model", D2))  # the memory still holds one model
        assert isinstance(refused, P.ErrorReply) and "weights" in refused.message, refused
