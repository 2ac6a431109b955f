"""The HTTP door's `Idempotency-Key` header against a real local cluster (scripts/up.py) over real HTTP (httpx and
the official openai client): a client that retries a request, whole or streamed, after losing its connection gets
the one job it started, never a second; a key reused for another request is refused and changes nothing."""

from __future__ import annotations

import threading
import uuid

import httpx
import pytest

from tests.cluster_helpers import job_hash, job_ids, local_cluster, wait_for
from tests.test_http import assert_error, key, sse


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("http-idem"), tiny_model_dir, workers=1, max_running=4) as c:
        yield c


def post(c: dict, body: dict, idem: str | None, tenant: str = "api-co", path: str = "/v1/completions"):
    headers = {"Authorization": f"Bearer {key(c, tenant)}"}
    if idem is not None:
        headers["Idempotency-Key"] = idem
    return httpx.post(c["http"] + path, json=body, headers=headers, timeout=120)


def test_a_retried_request_gets_the_job_it_started_not_a_second(cluster):
    idem = uuid.uuid4().hex
    body = {"prompt": [5, 6, 7], "max_tokens": 12, "ignore_eos": True, "temperature": 0.9, "seed": 4}
    before = job_ids(cluster)
    first = post(cluster, body, idem)
    again = post(cluster, body, idem)
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert first.headers["X-Request-Id"] == again.headers["X-Request-Id"]
    assert first.json()["choices"] == again.json()["choices"]
    assert "Idempotent-Replayed" not in first.headers and again.headers["Idempotent-Replayed"] == "true"
    assert len(job_ids(cluster) - before) == 1
    # Without the header, the same body is a new job each time; another tenant's same key is its own.
    other = post(cluster, body, idem, tenant="batch-co")
    plain = post(cluster, body, None)
    assert len({first.headers["X-Request-Id"], other.headers["X-Request-Id"], plain.headers["X-Request-Id"]}) == 3


def test_a_stream_cut_off_is_not_cancelled_with_a_key_and_its_retry_streams_it_whole(cluster):
    """Without a key, a client gone mid-stream has its job cancelled (tests/test_http.py); with one it is coming
    back for it: the job runs on, and the retry streams every token from the first, once."""
    idem = uuid.uuid4().hex
    body = {"prompt": [3, 4], "max_tokens": 400, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {key(cluster, 'lab-co')}", "Idempotency-Key": idem}
    with httpx.stream("POST", cluster["http"] + "/v1/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200
        job_id = r.headers["X-Request-Id"]
        assert next(r.iter_lines()).startswith("data: ")
    with httpx.stream("POST", cluster["http"] + "/v1/completions", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200 and r.headers["X-Request-Id"] == job_id
        assert r.headers["Idempotent-Replayed"] == "true"
        events, done = sse(r.iter_lines())
    assert done and events[-1]["usage"]["completion_tokens"] == 400
    assert job_hash(cluster, job_id)["state"] == "done" and int(job_hash(cluster, job_id)["num_tokens"]) == 400
    # Streamed or whole is how the answer is sent, not what the job is: a retry may switch.
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    whole = post(cluster, {k: v for k, v in body.items() if k not in ("stream", "stream_options")}, idem,
                 tenant="lab-co")
    assert whole.status_code == 200 and whole.headers["X-Request-Id"] == job_id
    assert whole.json()["choices"][0]["text"] == text and whole.json()["usage"]["completion_tokens"] == 400


def test_concurrent_retries_share_one_job(cluster):
    idem = uuid.uuid4().hex
    body = {"prompt": [9, 8, 7], "max_tokens": 40, "ignore_eos": True, "seed": 12, "temperature": 0.7}
    before = job_ids(cluster)
    answers: list[httpx.Response] = []
    threads = [threading.Thread(target=lambda: answers.append(post(cluster, body, idem))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(answers) == 6 and all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert len({a.headers["X-Request-Id"] for a in answers}) == 1
    assert len({a.json()["choices"][0]["text"] for a in answers}) == 1
    assert sum(a.headers.get("Idempotent-Replayed") == "true" for a in answers) == 5
    assert len(job_ids(cluster) - before) == 1


@pytest.mark.parametrize("change", [{"max_tokens": 13}, {"prompt": [5, 6, 8]}, {"temperature": 0.1},
                                    {"priority": 2}])
def test_a_key_reused_for_another_request_is_refused_and_changes_nothing(cluster, change):
    idem = uuid.uuid4().hex
    body = {"prompt": [5, 6, 7], "max_tokens": 12, "ignore_eos": True, "temperature": 0.9, "seed": 4}
    first = post(cluster, body, idem)
    assert first.status_code == 200
    before = job_ids(cluster)
    r = post(cluster, body | change, idem)
    err = assert_error(r, 422, "invalid_request_error")
    assert err["code"] == "idempotency_key_reused" and first.headers["X-Request-Id"] in err["message"]
    assert job_ids(cluster) == before


@pytest.mark.parametrize("bad", ["", "x" * 201, "a\tb"])
def test_a_bad_key_is_refused_before_anything_is_stored(cluster, bad):
    before = job_ids(cluster)
    r = post(cluster, {"prompt": [1, 2], "max_tokens": 3}, bad)
    err = assert_error(r, 400, "invalid_request_error")
    assert "Idempotency-Key" in err["message"]
    assert job_ids(cluster) == before


def test_the_openai_client_retries_with_a_key(cluster):
    from openai import OpenAI

    client = OpenAI(base_url=cluster["http"] + "/v1", api_key=key(cluster, "api-co"), max_retries=0)
    idem = uuid.uuid4().hex
    before = job_ids(cluster)
    answers = [client.chat.completions.with_raw_response.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hello"}], max_tokens=8, seed=3,
        extra_headers={"Idempotency-Key": idem}) for _ in range(2)]
    ids = [a.headers["X-Request-Id"] for a in answers]
    parsed = [a.parse() for a in answers]
    assert ids[0] == ids[1] and parsed[0].choices[0].message.content == parsed[1].choices[0].message.content
    assert len(job_ids(cluster) - before) == 1
    wait_for(lambda: job_hash(cluster, ids[0])["state"] == "done", 30, "the job to be done")


def test_a_retry_of_a_cancelled_job_is_a_409_not_a_server_error(cluster):
    """The tenant cancelled the job its key names (through the SDK): a retry answers that, as a conflict with the
    job's state (openai.ConflictError), not as a 500 that blames the server for the tenant's own cancel."""
    from gateway.sdk import GatewayClient

    idem = uuid.uuid4().hex
    body = {"prompt": [5, 6], "max_tokens": 1500, "ignore_eos": True, "temperature": 0}
    with GatewayClient(cluster["gateway"], key(cluster, "api-co"), timeout_s=30) as sdk:
        job = sdk.submit(prompt_token_ids=[5, 6], max_tokens=1500, ignore_eos=True, idempotency_key=idem)
        assert sdk.cancel(job.id) is True
    for stream in (False, True):
        r = post(cluster, body | {"stream": stream}, idem)
        err = assert_error(r, 409, "invalid_request_error")
        assert err["code"] == "job_cancelled" and job.id in err["message"] and r.headers["X-Request-Id"] == job.id
