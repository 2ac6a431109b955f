"""Clients of the HTTP door that go away at its awkward moments: a real local cluster (scripts/up.py), the door's
app served by a real uvicorn in this process (so its client table can be read), raw sockets as clients."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest

from common.ports import free_port
from gateway.http.config import HttpConfig
from tests.cluster_helpers import job_hash, job_ids, local_cluster, wait_for
from tests.test_http import key

pytestmark = pytest.mark.faults  # real clusters: `make test-faults` runs these alone


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("http-disconnects"), tiny_model_dir, workers=1, max_running=4,
                       http=False) as c:
        yield c


class served_door:
    """The door's app (gateway.http.__main__.build) under uvicorn on a thread of this process, on a free port."""

    def __init__(self, tokenizer, gateway: str, **config) -> None:
        import uvicorn

        from gateway.http.__main__ import build

        self.port = free_port()
        self.app = build(HttpConfig(port=self.port, gateways=[gateway], tokenizer=str(tokenizer), **config))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> served_door:
        self.thread.start()
        wait_for(lambda: self.server.started, 60, "the door to listen", interval=0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def front_door(self):
        return self.app.state.front_door


def raw_request(port: int, api_key: str, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Authorization: Bearer {api_key}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def test_a_stream_whose_client_leaves_before_its_first_event_is_cancelled_and_released(cluster, tiny_model_dir):
    # The client hangs up once its job's first token is in, before the response starts. Uvicorn speaks ASGI 2.3,
    # so Starlette's StreamingResponse saw the disconnect at once and cancelled its sending task before that task
    # ever ran: the events generator never started, and its finally (the release of the tenant's client, the
    # job's cancel) never ran. The job ran to its end for nobody, and the client could never be evicted.
    api_key = key(cluster, "lab-co")
    with served_door(tiny_model_dir, cluster["gateway"]) as door:
        fd = door.front_door
        stream = fd._stream
        first_token_in, gone = threading.Event(), {}

        async def stream_after_the_client_left(request, job, *args):
            response = await stream(request, job, *args)
            gone["job"] = job.id
            first_token_in.set()
            for _ in range(500):  # until the door has seen the client go (bounded: 10 s)
                if await request.is_disconnected():
                    gone["seen"] = True
                    break
                await asyncio.sleep(0.02)
            return response

        fd._stream = stream_after_the_client_left
        s = raw_request(door.port, api_key, "/v1/completions",
                        {"prompt": [3, 4], "max_tokens": 1500, "ignore_eos": True, "stream": True})
        try:
            assert first_token_in.wait(60), "the job's first token never came"
        finally:
            s.close()
        wait_for(lambda: gone.get("seen"), 30, "the door to see its client go")
        h = wait_for(lambda: (h := job_hash(cluster, gone["job"]))["state"] in ("cancelled", "done") and h, 90,
                     "the job to end")
        assert h["state"] == "cancelled", h
        entry = fd.upstream._entries[api_key]
        wait_for(lambda: entry.users == 0, 10, f"the tenant's client to be released (users {entry.users})")


def test_a_client_that_leaves_while_its_prompt_is_tokenized_gets_no_job(cluster, tiny_model_dir):
    # Tokenizing a prompt of megabytes takes seconds, during which the client may give up (a timeout, a retry).
    # The door submitted the job anyway and only then saw the client gone: a job admitted for nobody (a P0 quota
    # token charged, a queue place taken, perhaps dispatched before its cancel landed). Nothing is submitted now.
    from gateway.http import metrics

    api_key = key(cluster, "chat-co")  # P0: a job would charge its quota
    with served_door(tiny_model_dir, cluster["gateway"]) as door:
        fd = door.front_door
        tokenize, tokenizing, go_on = fd._prompt_ids, threading.Event(), threading.Event()

        def slow_prompt_ids(body, chat):
            tokenizing.set()
            assert go_on.wait(30)
            return tokenize(body, chat)

        fd._prompt_ids = slow_prompt_ids
        gone = metrics.REQUESTS.labels("/v1/completions", "499")
        before_499, before = gone._value.get(), job_ids(cluster)
        s = raw_request(door.port, api_key, "/v1/completions", {"prompt": "Hello", "max_tokens": 1})
        try:
            assert tokenizing.wait(60), "the door never began tokenizing"
        finally:
            s.close()
        wait_for(lambda: not door.server.server_state.connections, 30, "the door to see its client go")
        go_on.set()
        wait_for(lambda: gone._value.get() > before_499, 30, "the request to end as a 499")
        assert job_ids(cluster) == before
