"""A client whose CURVE settings do not match its gateway's (no key for an encrypted socket, a wrong key, a key for a
plain socket) is told so, at once and by name, instead of waiting out every retry's timeout for a gateway that
never got its request. Real gateway processes (`python -m gateway`), one encrypted and one plain, on one
redis-server; the blocking and the asyncio client."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import zmq

from common import keys as curve_keys
from common.ports import free_port
from common.redis_server import RedisServer
from gateway.sdk import AsyncGatewayClient, GatewayClient, HandshakeFailed
from common.handshakes import REFUSED_AFTER
from gateway.sdk._drops import DOUBT_S, Doubt, DropWatch
from scripts.up import write_tenants
from tests.cluster_helpers import stop_process, wait_for

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 60  # each attempt's wait for an answer: a client that waited one out has not been told
RETRIES = 2


def _gateway(tmp: Path, server: RedisServer, name: str, secret: Path | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ) | {
        "TS_GATEWAY_REDIS_URL": server.url,
        "TS_GATEWAY_CLIENT_BIND": f"tcp://127.0.0.1:{port}",
        "TS_GATEWAY_WORKER_BIND": f"tcp://127.0.0.1:{free_port()}",
        "TS_GATEWAY_TENANTS_FILE": str(tmp / "tenants.toml"),
        "TS_GATEWAY_KEY_PREFIX": f"handshake-{uuid.uuid4().hex[:8]}",
        "TS_GATEWAY_INSECURE_WORKERS": "true",
        "OTEL_SDK_DISABLED": "true",
    } | ({"TS_GATEWAY_CLIENT_CURVE": "true", "TS_GATEWAY_CURVE_SECRET_KEY_FILE": str(secret)} if secret else {})
    log = (tmp / f"{name}.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "gateway"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    return proc, f"tcp://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def gateways(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("handshake")
    tenants = write_tenants(tmp / "tenants.toml")
    keys = curve_keys.generate(tmp / "keys", [])
    public = curve_keys.load_public(keys["gateway_public"]).decode()
    api_key = next(iter(tenants.values()))["api_key"]
    with RedisServer() as server:
        procs = []
        try:
            curve, curve_at = _gateway(tmp, server, "curve", keys["gateway_secret"])
            procs.append(curve)
            plain, plain_at = _gateway(tmp, server, "plain", None)
            procs.append(plain)
            for at, key in ((curve_at, public), (plain_at, None)):
                def up(at=at, key=key) -> bool:
                    assert all(p.poll() is None for p in procs), (tmp / "curve.log").read_text()
                    try:
                        with GatewayClient(at, api_key, timeout_s=1, retries=0, server_public_key=key) as c:
                            return bool(c.info().gateway_id)
                    except TimeoutError:
                        return False
                wait_for(up, 60, f"gateway {at} to answer")
            yield {"curve": curve_at, "plain": plain_at, "public": public, "api_key": api_key}
        finally:
            for p in procs:
                stop_process(p, timeout=15)


def _cases(g) -> dict[str, tuple[str, str | None, str]]:
    """case -> (endpoint, the key the client is given, what the error must say)"""
    return {
        "no key, encrypted gateway": (g["curve"], None, "server_public_key"),
        "wrong key, encrypted gateway": (g["curve"], zmq.curve_keypair()[0].decode(), "server_public_key"),
        "key, plain gateway": (g["plain"], g["public"], "server_public_key"),
    }


CASES = ["no key, encrypted gateway", "wrong key, encrypted gateway", "key, plain gateway"]


@pytest.mark.parametrize("case", CASES)
def test_a_blocking_client_is_told_its_keys_do_not_match(gateways, case):
    endpoint, key, says = _cases(gateways)[case]
    with GatewayClient(endpoint, gateways["api_key"], timeout_s=TIMEOUT_S, retries=RETRIES,
                       server_public_key=key) as client:
        t0 = time.monotonic()
        with pytest.raises(HandshakeFailed) as refused:
            client.info()
        took = time.monotonic() - t0
        assert isinstance(refused.value, TimeoutError)  # what callers that catch "no gateway answered" expect
        assert says in str(refused.value) and endpoint in str(refused.value)
        assert took < TIMEOUT_S / 2, f"told only after {took:.1f}s: it waited out a timeout"
        # A submit is refused the same way (and nothing reached the gateway to admit).
        with pytest.raises(HandshakeFailed):
            client.submit("hello", max_tokens=4)


@pytest.mark.parametrize("case", CASES)
def test_an_async_client_is_told_its_keys_do_not_match(gateways, case):
    endpoint, key, says = _cases(gateways)[case]

    async def main():
        async with AsyncGatewayClient(endpoint, gateways["api_key"], timeout_s=TIMEOUT_S, retries=RETRIES,
                                      server_public_key=key) as client:
            t0 = time.monotonic()
            with pytest.raises(HandshakeFailed) as refused:
                await client.info()
            took = time.monotonic() - t0
            assert isinstance(refused.value, TimeoutError)
            assert says in str(refused.value) and endpoint in str(refused.value)
            assert took < TIMEOUT_S / 2, f"told only after {took:.1f}s: it waited out a timeout"
            # Many coroutines on the one client: each is told.
            results = await asyncio.gather(*(client.info() for _ in range(20)), return_exceptions=True)
            assert all(isinstance(r, HandshakeFailed) for r in results), results

    asyncio.run(main())


def test_clients_with_matching_keys_are_served(gateways):
    for endpoint, key in ((gateways["curve"], gateways["public"]), (gateways["plain"], None)):
        with GatewayClient(endpoint, gateways["api_key"], timeout_s=10, server_public_key=key) as client:
            assert client.info().gateway_id

        async def main(endpoint=endpoint, key=key):
            async with AsyncGatewayClient(endpoint, gateways["api_key"], timeout_s=10,
                                          server_public_key=key) as client:
                return (await client.info()).gateway_id
        assert asyncio.run(main())


def _close_mid_handshake(listener, watch, endpoint: str, times: int) -> None:
    for closes in range(1, times + 1):
        conn, _ = listener.accept()  # the client reconnects on its own
        conn.close()  # mid-handshake: before the greeting
        wait_for(watch.dropped, 10, "the drop of the connection closed mid-handshake")
        if closes < REFUSED_AFTER:
            assert watch.in_doubt() and watch.refused(endpoint) is None, f"{closes} close(s) mid-handshake: refused"


def test_a_connection_closed_mid_handshake_is_a_refusal_only_three_times_in_a_row():
    """A gateway going down may close a connection mid-handshake (its kernel accepted it; the process is being
    killed): once or twice is a drop like any other (the call retries as before, the dying-gateway tests of
    test_sdk_drop_after_send), three in a row are a refusal; a handshake that succeeds clears it."""
    ctx = zmq.Context()
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    router = ctx.socket(zmq.ROUTER)
    router.bind(endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    watch = DropWatch(dealer)
    dealer.connect(endpoint)

    def round_trip() -> None:
        dealer.send(b"ping")
        assert router.poll(10_000), "no round trip"
        router.recv_multipart()

    try:
        round_trip()
        router.close(linger=0)
        wait_for(watch.dropped, 10, "the drop of the gateway's end")
        listener = socket.create_server(("127.0.0.1", port))
        try:
            _close_mid_handshake(listener, watch, endpoint, REFUSED_AFTER)
            refused = watch.refused(endpoint)
            assert isinstance(refused, HandshakeFailed) and endpoint in str(refused)
            assert watch.blocked(endpoint) is None  # closed without a reason: still worth sending
        finally:
            listener.close()
        router = ctx.socket(zmq.ROUTER)
        router.bind(endpoint)
        wait_for(lambda: watch.refused(endpoint) is None, 10, "a good handshake to clear the refusal")
        round_trip()
    finally:
        watch.close()
        dealer.close(linger=0)
        router.close(linger=0)
        ctx.term()


def test_a_fresh_curve_connection_closed_mid_handshake_three_times_names_the_key():
    ctx = zmq.Context()
    listener = socket.create_server(("127.0.0.1", 0))
    endpoint = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    watch = DropWatch(dealer, curve=True)
    dealer.connect(endpoint)
    try:
        _close_mid_handshake(listener, watch, endpoint, REFUSED_AFTER)
        refused = watch.refused(endpoint)
        assert isinstance(refused, HandshakeFailed) and "server_public_key" in str(refused)
    finally:
        listener.close()
        watch.close()
        dealer.close(linger=0)
        ctx.term()


def test_a_request_sent_while_a_handshake_is_in_doubt_goes_on_the_next_good_one():
    """A drop in doubt (one handshake closed without a reason) does not end the wait at once: the request is still
    queued in the socket, and a gateway back within DOUBT_S gets it on the next handshake, which ends the doubt."""
    ctx = zmq.Context()
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    watch = DropWatch(dealer)
    dealer.connect(endpoint)
    router = None
    try:
        dealer.send(b"queued before any handshake")
        doubt = Doubt(watch)
        conn, _ = listener.accept()
        conn.close()
        wait_for(watch.dropped, 10, "the drop of the connection closed mid-handshake")
        now = time.monotonic()
        assert not doubt.on_drop(now), "a drop in doubt ended the wait at once"
        listener.close()
        router = ctx.socket(zmq.ROUTER)
        router.bind(endpoint)
        assert router.poll(10_000), "the queued request never came"
        assert router.recv_multipart()[-1] == b"queued before any handshake"
        assert not watch.failing() and not doubt.ended(now + 2 * DOUBT_S) and doubt.until is None
    finally:
        listener.close()
        watch.close()
        dealer.close(linger=0)
        if router is not None:
            router.close(linger=0)
        ctx.term()


def test_a_front_door_with_the_wrong_gateway_key_says_so_in_health_and_answers_503(gateways, tiny_model_dir,
                                                                                    tmp_path):
    """The door's own settings for its gateway: its health names the mismatch for the operator, and a request gets
    the door's usual "no gateway answered" (503, Retry-After), not a wait of every retry's timeout, nor a 502."""
    import httpx

    from tests.test_http import front_door

    wrong = zmq.curve_keypair()[0].decode()
    with front_door(tiny_model_dir, [gateways["curve"]], tmp_path / "door.log", health_key=gateways["api_key"],
                    env={"TS_HTTP_GATEWAY_PUBLIC_KEY": wrong, "TS_HTTP_UPSTREAM_TIMEOUT_S": str(TIMEOUT_S)}) as base:
        health = httpx.get(base + "/health", timeout=TIMEOUT_S)
        assert health.status_code == 503, health.text
        assert "HandshakeFailed" in health.text and "server_public_key" in health.text, health.text
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {gateways['api_key']}"}, timeout=TIMEOUT_S * 4)
        assert r.status_code == 503 and r.json()["error"]["code"] == "gateway_unavailable", r.text
        assert time.monotonic() - t0 < TIMEOUT_S / 2


@pytest.mark.parametrize("bad", ["garbage", "/no/such/dir/gateway.key", "", b"\x00" * 32, 5, 4.0, ["k"]])
def test_a_bad_server_public_key_is_refused_at_construction_by_name(bad, tmp_path):
    """It was read only when a call opened a socket: a KeyFileError (or a TypeError for a number) at the first
    call, from neither client's list of errors."""
    from common.errors import InvalidRequest

    for make in (GatewayClient, AsyncGatewayClient):
        with pytest.raises(InvalidRequest) as refused:
            make("tcp://127.0.0.1:9", "k", server_public_key=bad)
        assert refused.value.field == "server_public_key" and "server_public_key" in str(refused.value)


def test_a_server_public_key_file_is_read_once_at_construction(gateways, tmp_path):
    """The key file's z85 text or its path both serve; the file is read when the client is made (a file moved or
    rotated afterwards does not fail the client's later connections with a KeyFileError)."""
    key_file = tmp_path / "gateway.key"
    key_file.write_text(f'metadata\ncurve\n    public-key = "{gateways["public"]}"\n')
    with GatewayClient(gateways["curve"], gateways["api_key"], timeout_s=10, server_public_key=str(key_file)) as c:
        key_file.unlink()
        assert c.info().gateway_id
        other: list = []  # a second thread opens sockets of its own, after the file is gone
        t = threading.Thread(target=lambda: other.append(c.info().gateway_id))
        t.start()
        t.join(30)
        assert other and other[0], other


@pytest.mark.parametrize("bad", ["garbage", "/no/such/gateway.key"])
def test_a_front_door_with_a_bad_gateway_key_says_which_setting_and_exits_2(bad, tiny_model_dir):
    """It started, and the first request of each API key failed as a 400 (the SDK's refusal of its argument)."""
    done = subprocess.run([sys.executable, "-m", "gateway.http", "--tokenizer", str(tiny_model_dir), "--port", "0"],
                          cwd=ROOT, env=dict(os.environ, TS_HTTP_GATEWAY_PUBLIC_KEY=bad), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "gateway_public_key" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
