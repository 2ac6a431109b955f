"""A gateway and its workers must agree on the tokenizer. The gateway turns text into ids with its own tokenizer and
the workers run those ids through their model: a gateway started with another model's tokenizer had every text job
run to completion on ids the model never learnt, and come back as nonsense marked done. Workers now say their
model's tokenizer digest (common/tokenizer_digest.py) in the hello, and a gateway refuses one that differs.

Real parts: a redis-server, a `python -m gateway` process with a tokenizer, `python -m worker` processes serving two
models built with different tokenizers, and the SDK."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import zmq

from common import protocol as P
from common import tokenizer_digest
from common.ports import free_port
from common.redis_server import RedisServer
from common.sockets import make_socket
from gateway.sdk import GatewayClient
from scripts.up import write_tenants
from tests.cluster_helpers import job_ids, local_cluster, stop_process, wait_for
from tests.test_http import front_door

ROOT = Path(__file__).resolve().parent.parent


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def test_the_digest_names_what_the_tokenizer_does_not_where_it_lives(tiny_model_dir, bench_model_dir, tmp_path):
    own = tokenizer_digest.of_model(str(tiny_model_dir))
    copy = shutil.copytree(tiny_model_dir, tmp_path / "elsewhere")
    assert own is not None and own.startswith("sha256:")
    assert tokenizer_digest.of_model(str(copy)) == own
    assert tokenizer_digest.of_model(str(bench_model_dir)) != own  # another vocabulary (same corpus, more merges)

    tok = _tokenizer(tiny_model_dir)
    tok("a call that truncates", truncation=True, max_length=2)  # a call-time setting, not what the ids mean
    assert tokenizer_digest.digest(tok) == own

    # One special token more, the rest the same: ids past it mean something else to the model.
    tok.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    assert tokenizer_digest.digest(tok) != own
    # A slow tokenizer (no serialised backend) is compared by what each id means.
    assert tokenizer_digest.digest(_Slow({"a": 0, "b": 1})) == tokenizer_digest.digest(_Slow({"b": 1, "a": 0}))
    assert tokenizer_digest.digest(_Slow({"a": 0, "b": 1})) != tokenizer_digest.digest(_Slow({"a": 1, "b": 0}))


class _Slow:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def test_a_model_without_a_tokenizer_has_no_digest(tiny_model_dir, tmp_path):
    weights = tmp_path / "weights-only"
    weights.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, weights / name)
    assert tokenizer_digest.of_model(str(weights)) is None


class _Gateway:
    """A `python -m gateway` process taking workers without CURVE, under ``prefix`` on ``redis_url``; with
    ``tokenizer``, its --tokenizer."""

    def __init__(self, tmp_path: Path, name: str, redis_url: str, prefix: str, tokenizer: Path | None = None) -> None:
        self.tenants = write_tenants(tmp_path / f"{name}-tenants.toml")
        self.clients, self.workers = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        env = dict(os.environ, PYTHONPATH=str(ROOT), OTEL_TRACES_EXPORTER="none", TS_GATEWAY_KEY_PREFIX=prefix,
                   TS_GATEWAY_GATEWAY_ID=name) | ({"TS_GATEWAY_TOKENIZER": str(tokenizer)} if tokenizer else {})
        self.log = tmp_path / f"{name}.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "gateway", "--client-bind", self.clients,
                                          "--worker-bind", self.workers, "--redis-url", redis_url, "--tenants-file",
                                          str(tmp_path / f"{name}-tenants.toml"), "--insecure-workers"], cwd=ROOT,
                                         env=env, stdout=out, stderr=subprocess.STDOUT)

    def started(self) -> _Gateway:
        wait_for(lambda: "workers on" in self.log.read_text(), 90, "the gateway to start")
        assert self.proc.poll() is None, self.log.read_text()[-3000:]
        return self

    def stop(self) -> None:
        stop_process(self.proc, timeout=15)


@pytest.fixture
def gateway(tmp_path, tiny_model_dir):
    """A gateway whose tokenizer is the tiny model's."""
    with RedisServer() as redis_server:
        gw = _Gateway(tmp_path, "gw-tok", redis_server.url, f"tok-{uuid.uuid4().hex[:8]}", tiny_model_dir)
        try:
            yield gw.started()
        finally:
            gw.stop()


def _worker(tmp_path: Path, worker_id: str, model: Path, endpoint: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"{worker_id}.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OTEL_TRACES_EXPORTER="none", TS_WORKER_TORCH_THREADS="1")
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "worker", "--worker-id", worker_id, "--model", str(model),
                                 "--gateway", endpoint, "--device", "cpu"], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    return proc, log


def test_a_worker_whose_model_speaks_other_tokens_is_refused_and_runs_nothing(gateway, tmp_path, tiny_model_dir,
                                                                              bench_model_dir, reference):
    tenant = gateway.tenants["chat-co"]["api_key"]
    with GatewayClient(gateway.clients, tenant, timeout_s=10) as client:
        job = client.submit("the quick brown fox", max_tokens=6, tier="P2", ignore_eos=True)
        wrong, wrong_log = _worker(tmp_path, "wk-other-model", bench_model_dir, gateway.workers)
        try:
            wait_for(lambda: "refused hello from wk-other-model" in gateway.log.read_text(), 120,
                     "the gateway to refuse the worker of another model")
            line = next(ln for ln in gateway.log.read_text().splitlines() if "wk-other-model" in ln)
            assert "tokenizer" in line and str(bench_model_dir) in line, line
            wait_for(lambda: "tokenizer" in wrong_log.read_text(), 30, "the worker to say why it was refused")
            assert wrong.poll() is None, wrong_log.read_text()[-3000:]
            time.sleep(1.0)  # room for a dispatch, had it been taken
            assert job.status().state == "queued"  # nothing ran on the wrong model

            right, right_log = _worker(tmp_path, "wk-same-model", tiny_model_dir, gateway.workers)
            try:
                result = job.result(timeout=120)
            finally:
                stop_process(right, timeout=30)
        finally:
            stop_process(wrong, timeout=30)
    prompt = _tokenizer(tiny_model_dir)("the quick brown fox").input_ids
    assert result.token_ids == reference([(prompt, 6, 0.0, 0)])[0]
    assert "hello refused" not in right_log.read_text()


def test_a_gateway_without_a_tokenizer_pins_its_first_workers(tmp_path):
    """Token ids only: the first accepted worker's tokenizer is the cluster's, as its model is."""
    with RedisServer() as redis_server:
        gw = _Gateway(tmp_path, "gw-ids", redis_server.url, f"tok-{uuid.uuid4().hex[:8]}").started()
        try:
            answers = {wid: _hello(gw.workers, wid, digest) for wid, digest in
                       [("wk-unsaid", None), ("wk-first", "sha256:" + "a" * 64), ("wk-same", "sha256:" + "a" * 64),
                        ("wk-other", "sha256:" + "b" * 64), ("wk-unsaid-2", None)]}
        finally:
            gw.stop()
    refused = {wid for wid, a in answers.items() if isinstance(a, P.ErrorReply)}
    assert refused == {"wk-other"}, answers
    assert "tokenizer" in answers["wk-other"].message


def test_the_clusters_redis_pins_its_tokenizer(tmp_path, tiny_model_dir, bench_model_dir):
    """Gateways share the queues: a gateway started with another tokenizer queued ids its tokenizer made, and the
    other gateways dispatched them to their workers, whose model read them as its own. The first gateway with a
    tokenizer pins it in Redis; one with another refuses to start, one without takes the pinned one."""
    tiny = tokenizer_digest.of_model(str(tiny_model_dir))
    prefix = f"tok-{uuid.uuid4().hex[:8]}"
    with RedisServer() as redis_server:
        first = _Gateway(tmp_path, "gw-first", redis_server.url, prefix, tiny_model_dir).started()
        try:
            assert redis_server.client().get(f"{prefix}:{{c}}:tokenizer").decode() == tiny
            other = _Gateway(tmp_path, "gw-other", redis_server.url, prefix, bench_model_dir)
            try:
                assert other.proc.wait(timeout=120) == 2
            finally:
                other.stop()
            said = other.log.read_text()
            assert "tokenizer" in said and f"{prefix}:{{c}}:tokenizer" in said and "Traceback" not in said, said
            assert redis_server.client().get(f"{prefix}:{{c}}:tokenizer").decode() == tiny  # changed nothing

            ids_only = _Gateway(tmp_path, "gw-ids", redis_server.url, prefix).started()
            try:
                refused = _hello(ids_only.workers, "wk-bench", tokenizer_digest.of_model(str(bench_model_dir)))
                assert isinstance(refused, P.ErrorReply) and "tokenizer" in refused.message, refused
                assert isinstance(_hello(ids_only.workers, "wk-tiny", tiny), P.GatewayWelcome)
            finally:
                ids_only.stop()
            # Another model is served under another prefix (its own queues), on the same Redis.
            _Gateway(tmp_path, "gw-elsewhere", redis_server.url, f"{prefix}-b", bench_model_dir).started().stop()
        finally:
            first.stop()


def _hello(endpoint: str, worker_id: str, digest: str | None):
    s = make_socket(zmq.Context.instance(), zmq.DEALER, identity=worker_id.encode())
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        s.send(P.encode(P.WorkerHello(worker_id, "the-model", 512, 2048, 4, 512, tokenizer_digest=digest)))
        assert s.poll(20_000), f"no answer to the hello of {worker_id}"
        return P.decode(s.recv())
    finally:
        s.close()


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("tokenizer-door"), tiny_model_dir, workers=1, http=False) as c:
        yield c


def test_a_front_door_with_another_tokenizer_refuses_to_serve(cluster, tiny_model_dir, bench_model_dir, tmp_path):
    """The door tokenizes prompts itself: one given another model's tokenizer than the cluster serves ran every
    request on ids the model never learnt (200, nonsense). It now answers 503 before it reads the body, stores
    nothing, and its /health says why."""
    import openai

    gateways = [g["endpoint"] for g in cluster["gateways"]]
    api_key = cluster["tenants"]["api-co"]["api_key"]
    auth = {"Authorization": f"Bearer {api_key}"}
    before = job_ids(cluster)
    log = tmp_path / "door.log"
    with front_door(bench_model_dir, gateways, log, health_key=api_key) as base:
        for path, body in (("/v1/completions", {"prompt": "the quick brown fox", "max_tokens": 4}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 4, "stream": True})):
            r = httpx.post(base + path, json=body, headers=auth, timeout=60)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "tokenizer_mismatch" and "tokenizer" in r.json()["error"]["message"]
        client = openai.OpenAI(base_url=base + "/v1", api_key=api_key, max_retries=0)
        with pytest.raises(openai.InternalServerError) as raised:
            client.completions.create(model="bench-llama-32m", prompt="hello", max_tokens=2)
        assert raised.value.status_code == 503 and "tokenizer" in str(raised.value)
        health = httpx.get(base + "/health", timeout=60)
        assert health.status_code == 503 and health.json()["status"] == "tokenizer_mismatch", health.text
    assert job_ids(cluster) == before  # nothing stored
    said = [ln for ln in log.read_text().splitlines() if "differs from the cluster's" in ln]
    assert len(said) == 1, said  # once, not once per request

    with front_door(tiny_model_dir, gateways, tmp_path / "right.log", health_key=api_key) as base:
        r = httpx.post(base + "/v1/completions", json={"prompt": "the quick brown fox", "max_tokens": 4,
                                                       "ignore_eos": True}, headers=auth, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
        assert httpx.get(base + "/health", timeout=60).status_code == 200
