"""Streamed HTTP requests that wait in a queue, against a real local cluster (scripts/up.py) over real HTTP (httpx for
the raw bytes, the official openai client): the door sends an SSE comment every sse_keepalive_s while a stream has
nothing to say, so a proxy's idle timeout (nginx, an ALB: 60 s) does not cut a request that waits its turn.

The wait is made by a long job of the same tier holding the worker's one slot while the worker stands still
(SIGSTOP), for as long as a test needs; the worker's lease and timeout are long enough that nothing is re-dispatched.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import pytest

from common.settings import ConfigError
from gateway.sdk import GatewayClient
from tests.cluster_helpers import ROOT, job_hash, local_cluster, state_pids, wait_for
from tests.test_http import key

pytestmark = pytest.mark.faults  # a real cluster whose worker is stopped: `make test-faults` runs these alone

KEEPALIVE_S = 1.0
COMMENT = b": keep-alive"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("http-keepalive"), tiny_model_dir, workers=1, max_running=1,
                       lease_s=60.0, env={"TS_HTTP_SSE_KEEPALIVE_S": str(KEEPALIVE_S),
                                          "TS_GATEWAY_WORKER_TIMEOUT_S": "60"}) as c:
        yield c


@contextlib.contextmanager
def held_slot(c: dict):
    """The worker's one slot taken by a lab-co (P3) job and the worker stopped: a P3 request waits in the queue until
    the returned release() is called (or the block ends): the worker goes on and the filler is cancelled."""
    worker = state_pids(c)["wk-0"]
    with GatewayClient(c["gateway"], key(c, "lab-co"), timeout_s=30) as lab:
        filler = lab.submit(prompt_token_ids=[3, 4, 5], max_tokens=2000, ignore_eos=True)
        wait_for(lambda: job_hash(c, filler.id)["state"] == "dispatched", 60, "the filler to run")
        os.kill(worker, signal.SIGSTOP)
        stopped = [True]

        def release() -> None:
            if stopped[0]:
                stopped[0] = False
                os.kill(worker, signal.SIGCONT)
                assert filler.cancel() is True

        try:
            yield release
        finally:
            release()


def blocks(raw: bytes) -> tuple[list[bytes], bytes]:
    """The complete SSE blocks of ``raw`` (each ends with a blank line) and what is left after them."""
    *whole, rest = raw.split(b"\n\n")
    return whole, rest


def read_events(block_list: list[bytes]) -> tuple[list[dict], int, bool]:
    """The JSON data events, the keep-alive count and whether [DONE] came last. Every block is one whole line, either
    a keep-alive comment or one data event: a comment inside an event would break it."""
    events, comments, done = [], 0, False
    for b in block_list:
        assert not done, f"a block after [DONE]: {b!r}"
        assert b"\n" not in b, f"a block of several lines: {b!r}"
        if b == COMMENT:
            comments += 1
        elif b == b"data: [DONE]":
            done = True
        else:
            assert b.startswith(b"data: "), b
            events.append(json.loads(b[len(b"data: "):]))
    return events, comments, done


def assert_gaps(times: list[float], what: str) -> None:
    """Bytes came about every KEEPALIVE_S: never well before it (a flood), never long after (a proxy's idle cut)."""
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert all(0.8 * KEEPALIVE_S <= g <= 3 * KEEPALIVE_S for g in gaps), f"{what}: gaps {gaps}"


def test_a_queued_stream_gets_keepalives_then_every_token(cluster):
    max_tokens = 12
    body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    # A read timeout of 3 keep-alive intervals: the door that sent nothing until the first token fails here.
    timeout = httpx.Timeout(30, read=3 * KEEPALIVE_S)
    with held_slot(cluster) as release:
        start = time.monotonic()
        with httpx.stream("POST", cluster["http"] + "/v1/completions", json=body, timeout=timeout,
                          headers={"Authorization": f"Bearer {key(cluster, 'lab-co')}"}) as r:
            headers_at = time.monotonic() - start
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            job_id = r.headers["X-Request-Id"]
            # The status line waited one interval for the first token: a stream answered sooner has its real status.
            assert headers_at >= 0.8 * KEEPALIVE_S, headers_at
            raw, seen, times = b"", [], [start]
            chunks = r.iter_raw()
            while len(seen) < 4:
                raw += next(chunks)
                whole, raw = blocks(raw)
                for b in whole:
                    assert b == COMMENT, f"the job is queued, yet the stream sent {b!r}"
                    seen.append(b)
                    times.append(time.monotonic())
            assert job_hash(cluster, job_id)["state"] == "queued"
            assert_gaps(times, "while queued")
            release()
            rest = b"".join(chunks)
    whole, left = blocks(raw + rest)
    assert left == b"", left
    events, comments, done = read_events(whole)
    assert done
    *token_events, usage = events
    # Every token, exactly: the usage counts the job's result, and the text is the job's text.
    with GatewayClient(cluster["gateway"], key(cluster, "lab-co"), timeout_s=30) as sdk:
        result = sdk.job(job_id).result(timeout=60)
    assert len(result.token_ids) == max_tokens
    assert usage["usage"]["completion_tokens"] == max_tokens and usage["choices"] == []
    assert "".join(e["choices"][0]["text"] for e in token_events) == result.text
    assert token_events[-1]["choices"][0]["finish_reason"] == "length"
    assert int(job_hash(cluster, job_id)["num_tokens"]) == max_tokens


class RecordingTransport(httpx.HTTPTransport):
    """An httpx transport that keeps every response byte as it arrives (with its time), under the openai client."""

    def __init__(self) -> None:
        super().__init__()
        self.raw = bytearray()
        self.times: list[float] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        inner, transport = response.stream, self

        class Recorded(httpx.SyncByteStream):
            def __iter__(self):
                for part in inner:
                    transport.raw += part
                    transport.times.extend(time.monotonic() for _ in range(part.count(COMMENT)))
                    yield part

            def close(self) -> None:
                inner.close()

        response.stream = Recorded()
        return response


def test_the_openai_client_ignores_the_keepalives(cluster):
    import openai

    transport = RecordingTransport()
    client = openai.OpenAI(base_url=cluster["http"] + "/v1", api_key=key(cluster, "lab-co"), max_retries=0,
                           http_client=httpx.Client(transport=transport, timeout=httpx.Timeout(60, read=10)))
    got: dict = {}

    def consume() -> None:
        try:
            stream = client.chat.completions.create(
                model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=9, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            got["chunks"] = list(stream)
        except BaseException as e:  # noqa: BLE001 (said in the main thread)
            got["error"] = e

    with held_slot(cluster) as release:
        reader = threading.Thread(target=consume)
        reader.start()
        try:
            wait_for(lambda: len(transport.times) >= 3 or "error" in got, 30, "three keep-alives")
        finally:
            release()
            reader.join(60)
    assert not reader.is_alive()
    assert "error" not in got, repr(got.get("error"))
    chunks = got["chunks"]
    events, comments, done = read_events(blocks(bytes(transport.raw))[0])
    assert done and comments >= 3
    # The same chunks: every data event became one, and no keep-alive became anything.
    assert [c.model_dump(exclude_unset=True) for c in chunks] == events
    *token_chunks, usage = chunks
    assert token_chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in token_chunks)
    with GatewayClient(cluster["gateway"], key(cluster, "lab-co"), timeout_s=30) as sdk:
        result = sdk.job(usage.id.removeprefix("chatcmpl-")).result(timeout=60)
    assert usage.usage.completion_tokens == len(result.token_ids) == 9
    assert text == result.text


def test_a_client_that_leaves_during_the_keepalives_cancels_its_job(cluster):
    body = {"prompt": [8, 9], "max_tokens": 4, "ignore_eos": True, "stream": True}
    with held_slot(cluster):
        with httpx.stream("POST", cluster["http"] + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=10),
                          headers={"Authorization": f"Bearer {key(cluster, 'lab-co')}"}) as r:
            assert r.status_code == 200
            job_id = r.headers["X-Request-Id"]
            lines = r.iter_lines()
            assert next(lines) == COMMENT.decode()
        # The connection is closed while the job still waits in the queue: it is cancelled there, never run.
        h = wait_for(lambda: (h := job_hash(cluster, job_id))["state"] != "queued" and h, 30, "the job's cancel")
    assert h["state"] == "cancelled", h
    assert int(h.get("num_tokens", 0) or 0) == 0


def test_a_job_that_expires_before_or_after_the_status_line(tiny_model_dir, tmp_path):
    """No worker, so every job waits out its tier's queue timeout. A P1 (0.5 s) expires before the status line
    waited its 2 s: a real 504. A P2 (5 s) outwaits it: its 200 went out with the keep-alives, so the expiry is an
    error event (code queue_timeout) before [DONE], never a stream that simply ends."""
    with local_cluster(tmp_path, tiny_model_dir, workers=0,
                       env={"TS_HTTP_SSE_KEEPALIVE_S": "2", "TS_GATEWAY_TIER_TIMEOUTS_S":
                            '{"P0": 30, "P1": 0.5, "P2": 5, "P3": null}'}) as c:
        body = {"prompt": [6], "max_tokens": 2, "stream": True}
        r = httpx.post(c["http"] + "/v1/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {key(c, 'api-co')}", "X-Priority": "P1"})
        assert r.status_code == 504 and r.json()["error"]["code"] == "queue_timeout", r.text
        r = httpx.post(c["http"] + "/v1/completions", json=body, timeout=60,
                       headers={"Authorization": f"Bearer {key(c, 'batch-co')}", "X-Priority": "P2"})
        assert r.status_code == 200 and r.headers["X-Tier"] == "P2"
        whole, left = blocks(r.content)
        assert left == b""
        events, comments, done = read_events(whole)
        assert done and comments >= 2, (comments, events)
        assert [e["error"]["code"] for e in events] == ["queue_timeout"], events
        assert job_hash(c, r.headers["X-Request-Id"])["state"] == "expired"


def test_keepalives_off_the_status_line_waits_for_the_first_token(tiny_model_dir, tmp_path):
    """sse_keepalive_s = 0 turns them off: a stream says nothing, status line included, until its first token or its
    end, so a P2 that waits out its 3 s queue timeout gets a real 504 however long that is, with no byte before."""
    with local_cluster(tmp_path, tiny_model_dir, workers=0,
                       env={"TS_HTTP_SSE_KEEPALIVE_S": "0", "TS_GATEWAY_TIER_TIMEOUTS_S":
                            '{"P0": 30, "P1": 30, "P2": 3, "P3": null}'}) as c:
        body = {"prompt": [6], "max_tokens": 2, "stream": True}
        start = time.monotonic()
        with httpx.stream("POST", c["http"] + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {key(c, 'batch-co')}", "X-Priority": "P2"}) as r:
            waited = time.monotonic() - start
            raw = r.read()
        assert r.status_code == 504, raw
        assert json.loads(raw)["error"]["code"] == "queue_timeout" and COMMENT not in raw, raw
        assert waited >= 2.5, f"the status line came after {waited:.2f} s, before the job could expire"
        assert job_hash(c, r.headers["X-Request-Id"])["state"] == "expired"


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_a_keepalive_interval_that_could_not_serve_is_refused(value):
    from gateway.http.config import HttpConfig

    with pytest.raises(ConfigError, match="sse_keepalive_s"):
        HttpConfig(sse_keepalive_s=value)
    assert HttpConfig(sse_keepalive_s=0.0).sse_keepalive_s == 0.0  # 0 turns them off
    assert HttpConfig().sse_keepalive_s == 15.0


@pytest.mark.parametrize("raw", ["-1", "soon", "nan"])
def test_the_door_says_which_setting_and_exits_2(raw, tiny_model_dir):
    import subprocess
    import sys

    # Port 0: a door that wrongly started would take no port of anyone's; it is then killed by the timeout.
    done = subprocess.run([sys.executable, "-m", "gateway.http", "--tokenizer", str(tiny_model_dir), "--port", "0"],
                          cwd=ROOT, env=dict(os.environ, TS_HTTP_SSE_KEEPALIVE_S=raw), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "SSE_KEEPALIVE_S" in done.stderr.upper() and "Traceback" not in done.stderr, done.stderr[-2000:]
