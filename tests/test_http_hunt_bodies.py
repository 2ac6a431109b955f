"""Request bodies the HTTP door cannot read: sent slowly or not at all, or compressed. A real local cluster
(scripts/up.py), a real `python -m gateway.http` process, raw sockets as the slow clients (no HTTP library finishes
a request it began) and httpx.

A client that sends its headers and then nothing (or part of its body) held a request of the door open for ever:
the door waited on the body with no bound, and uvicorn, stopping on SIGTERM, waits for every request in progress,
so one such client kept a door being redeployed from ever exiting.
"""

from __future__ import annotations

import json
import signal
import socket
import time

import httpx
import pytest

from tests.cluster_helpers import assert_unchanged, job_hash, local_cluster, snapshot, wait_for
from tests.test_http import front_door, key

pytestmark = pytest.mark.faults  # real clusters: `make test-faults` runs these alone

BODY_TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("http-slow"), tiny_model_dir, workers=1, max_running=4,
                       http=False) as c:
        yield c


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


def slow_request(port: int, api_key: str, sent: bytes, declared: int | None, expect: bool = False) -> socket.socket:
    """A POST whose headers are complete and whose body is ``sent`` of ``declared`` bytes (None: chunked, and not
    one chunk is sent), then nothing more. ``expect``: with ``Expect: 100-continue``, and returned once the door
    has said 100 Continue, which uvicorn says when the door begins to read the body."""
    length = f"Content-Length: {declared}" if declared is not None else "Transfer-Encoding: chunked"
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Authorization: Bearer {api_key}\r\n{length}\r\n".encode()
              + (b"Expect: 100-continue\r\n" if expect else b"") + b"\r\n" + sent)
    if expect:
        s.settimeout(30)
        got = b""
        while len(got) < len(CONTINUE):
            part = s.recv(len(CONTINUE) - len(got))
            assert part, f"the door closed the connection before 100 Continue ({got!r})"
            got += part
        assert got == CONTINUE, got
    return s


def answer_of(s: socket.socket, within_s: float) -> tuple[int, dict]:
    """The status and JSON body of the response the door sends on ``s`` (an AssertionError if none within
    ``within_s``)."""
    s.settimeout(within_s)
    data = b""
    try:
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            part = s.recv(65536)
            if not part:
                break
            data += part
    except TimeoutError:
        raise AssertionError(f"no answer within {within_s}s (got {data!r})") from None
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 1


def test_a_client_that_never_sends_its_body_is_answered_408_and_holds_nothing(cluster, tiny_model_dir, tmp_path):
    api_key = key(cluster, "api-co")
    with front_door(tiny_model_dir, [cluster["gateway"]], tmp_path / "http.log",
                    env={"TS_HTTP_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)}) as base:
        port = int(base.rsplit(":", 1)[1])
        before = snapshot(cluster)
        started = time.monotonic()
        partial = slow_request(port, api_key, b'{"prompt": "Hel', 100)
        headers_only = slow_request(port, api_key, b"", 40, expect=True)
        no_chunk = slow_request(port, api_key, b"", None)
        try:
            for s in (partial, headers_only, no_chunk):
                status, body = answer_of(s, BODY_TIMEOUT_S + 10)
                assert status == 408, body
                assert body["error"]["type"] == "invalid_request_error", body
                assert body["error"]["code"] == "request_timeout", body
                assert str(BODY_TIMEOUT_S) in body["error"]["message"], body
        finally:
            for s in (partial, headers_only, no_chunk):
                s.close()
        assert time.monotonic() - started < BODY_TIMEOUT_S + 10
        assert_unchanged(before, snapshot(cluster))  # no job, nothing charged
        # The door still serves; a body sent in time is read, however slowly it began.
        r = httpx.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
                       headers={"Authorization": f"Bearer {api_key}"}, timeout=60)
        assert r.status_code == 200, r.text
        wait_for(lambda: job_hash(cluster, r.headers["X-Request-Id"])["state"] == "done", 30, "the job to be done")


def test_a_door_stopping_does_not_wait_for_ever_on_a_client_that_sends_no_body(cluster, tiny_model_dir, tmp_path):
    # SIGTERM: uvicorn stops accepting, then waits for every request in progress. One whose body never came kept
    # the door up until its client left (for ever, for a client that does not).
    api_key = key(cluster, "api-co")
    door = front_door(tiny_model_dir, [cluster["gateway"]], tmp_path / "http.log",
                      env={"TS_HTTP_BODY_TIMEOUT_S": str(BODY_TIMEOUT_S)})
    base = door.__enter__()
    # Once it is answered 100 Continue, the door is reading its body: a request in progress.
    s = slow_request(int(base.rsplit(":", 1)[1]), api_key, b"", 100, expect=True)
    try:
        door.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: door.proc.poll() is not None, BODY_TIMEOUT_S + 15,
                 "the door to exit on SIGTERM with a client that sends no body")
        assert door.proc.returncode in (0, -signal.SIGTERM)
    finally:
        s.close()
        door.__exit__(None, None, None)



@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br", "GZip, identity"])
def test_a_compressed_body_is_refused_as_such_not_as_invalid_json(cluster, tiny_model_dir, tmp_path, encoding):
    # The door reads bodies as they come: a compressed one was refused 400 "the body is not valid JSON", and its
    # client went looking for a mistake in JSON that had none.
    import gzip

    api_key = key(cluster, "api-co")
    body = gzip.compress(json.dumps({"prompt": "Hello", "max_tokens": 2}).encode())
    with front_door(tiny_model_dir, [cluster["gateway"]], tmp_path / "http.log") as base:
        before = snapshot(cluster)
        r = httpx.post(base + "/v1/completions", content=body, timeout=60,
                       headers={"Authorization": f"Bearer {api_key}", "Content-Type": "application/json",
                                "Content-Encoding": encoding})
        assert r.status_code == 415, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["code"] == "unsupported_content_encoding", err
        assert "Content-Encoding" in err["message"] and encoding in err["message"], err
        assert_unchanged(before, snapshot(cluster))
        # identity is no encoding at all: served.
        r = httpx.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60,
                       headers={"Authorization": f"Bearer {api_key}", "Content-Encoding": "identity"})
        assert r.status_code == 200, r.text
