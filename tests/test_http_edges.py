"""The HTTP door where clients and operators meet its edges, against a real local cluster (scripts/up.py) over real
HTTP (httpx): a header sent twice with different values, /health asked with a key nobody knows, and a stream that
ends in an error event after its 200."""

from __future__ import annotations


import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.sdk import GatewayClient
from tests.cluster_helpers import assert_unchanged, frozen, job_hash, local_cluster, snapshot, state_pids, wait_for
from tests.test_http import assert_error, front_door, key, sse


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("http-edges"), tiny_model_dir, workers=1, max_running=4) as c:
        yield c


def post(c: dict, headers: list[tuple[str, str]], body: dict | None = None) -> httpx.Response:
    # A list of pairs: httpx sends each, so a header can be sent twice.
    return httpx.post(c["http"] + "/v1/completions", json=body or {"prompt": [5, 6], "max_tokens": 2},
                      headers=headers, timeout=120)


def auth(c: dict, tenant: str) -> tuple[str, str]:
    return "Authorization", f"Bearer {key(c, tenant)}"


@pytest.mark.parametrize("name", ["Authorization", "X-Priority", "Idempotency-Key"])
def test_a_header_sent_twice_with_different_values_is_refused_and_changes_nothing(cluster, name):
    """The first value was taken, silently: another tenant's key, a P0 that charged the quota where the second
    said P1, or a job under one of two keys. chat-co is entitled to P0 and P1 (P0 charges its quota)."""
    pairs = {"Authorization": [auth(cluster, "chat-co"), auth(cluster, "api-co")],
             "X-Priority": [("X-Priority", "P0"), ("X-Priority", "P1")],
             "Idempotency-Key": [("Idempotency-Key", "first"), ("Idempotency-Key", "second")]}[name]
    headers = ([] if name == "Authorization" else [auth(cluster, "chat-co")]) + pairs
    before = snapshot(cluster)
    err = assert_error(post(cluster, headers), 400, "invalid_request_error")
    assert err["code"] == "conflicting_headers" and name in err["message"], err
    assert_unchanged(before, snapshot(cluster))
    # The same value twice is one value.
    same = ([] if name == "Authorization" else [auth(cluster, "chat-co")]) + [pairs[0], pairs[0]]
    r = post(cluster, same)
    assert r.status_code == 200, r.text


def test_health_says_its_key_is_unknown_not_that_the_gateway_is_down(cluster, tiny_model_dir, tmp_path):
    """Without health_api_key /health asks with the caller's bearer token; a token nobody knows was reported as
    "unavailable: Unauthorized", an outage that was not there."""
    with front_door(tiny_model_dir, [cluster["gateway"]], tmp_path / "door.log") as base:
        r = httpx.get(base + "/health", headers={"Authorization": "Bearer nobody"}, timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "unknown", r.text
        assert "bearer token" in r.json()["reason"] and "Unauthorized" not in r.json()["reason"], r.text
        r = httpx.get(base + "/health", headers={"Authorization": f"Bearer {key(cluster, 'lab-co')}"}, timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "ok", r.text
        r = httpx.get(base + "/health", headers=[auth(cluster, "lab-co"), ("Authorization", "Bearer nobody")],
                      timeout=30)
        assert_error(r, 400, "invalid_request_error")
    with front_door(tiny_model_dir, [cluster["gateway"]], tmp_path / "door2.log", health_key="wrong") as base:
        r = httpx.get(base + "/health", timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "unknown", r.text
        assert "health_api_key" in r.json()["reason"], r.text


def stream_errors(c: dict) -> dict[tuple, float]:
    text = httpx.get(c["http"] + "/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    family = families.get("ts_http_stream_errors")
    if family is None:
        return {}
    assert family.documentation == ("Streamed requests that ended in an error event after their 200 status line, "
                                    "by route and error code")
    return {(s.labels["route"], s.labels["code"]): s.value for s in family.samples if s.name.endswith("_total")}


def test_a_stream_that_ends_in_an_error_is_counted_as_one(cluster):
    """Its status line said 200 before the error: ts_http_requests_total counts a 200, so only this counter shows
    an operator the failure."""
    before = stream_errors(cluster).get(("/v1/completions", "job_cancelled"), 0.0)
    body = {"prompt": [3, 4], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    worker = state_pids(cluster)["wk-0"]
    with httpx.stream("POST", cluster["http"] + "/v1/completions", json=body, timeout=120,
                      headers=[auth(cluster, "lab-co")]) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        # The job stands still (not finished by a fast machine) while its tenant cancels it elsewhere.
        with frozen(worker):
            with GatewayClient(cluster["gateway"], key(cluster, "lab-co"), timeout_s=30) as sdk:
                assert sdk.cancel(r.headers["X-Request-Id"]) is True
            events, done = sse(list(lines))
    assert done and events[-1]["error"]["code"] == "job_cancelled", events[-1:]
    wait_for(lambda: job_hash(cluster, r.headers["X-Request-Id"])["state"] == "cancelled", 30, "the cancel")
    after = stream_errors(cluster)
    assert after.get(("/v1/completions", "job_cancelled"), 0.0) - before == 1, after


# A Llama-2/Mistral-style template: it refuses, by raise_exception, a conversation whose roles do not alternate
# user/assistant (a system message, say), as those models' own templates do.
ALTERNATING = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
               "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
               "{% endif %}<|bos|>{{ m.role }}\n{{ m.content }}<|eos|>{% endfor %}"
               "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}")


def test_a_conversation_the_chat_template_refuses_is_a_400_not_a_500(cluster, tiny_model_dir, tmp_path):
    """The template's own refusal (jinja2's TemplateError) escaped the door: a plain-text 500 "Internal Server
    Error" for what is the client's input, which the openai client retried as a server fault."""
    import shutil

    import openai
    from transformers import AutoTokenizer

    templated = tmp_path / "templated"
    shutil.copytree(tiny_model_dir, templated)
    tok = AutoTokenizer.from_pretrained(templated)
    tok.chat_template = ALTERNATING
    tok.save_pretrained(templated)
    with front_door(templated, [cluster["gateway"]], tmp_path / "door.log") as base:
        before = snapshot(cluster)
        body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                "max_tokens": 2}
        for stream in (False, True):
            r = httpx.post(base + "/v1/chat/completions", json=body | {"stream": stream}, timeout=120,
                           headers=[auth(cluster, "api-co")])
            err = assert_error(r, 400, "invalid_request_error", "messages")
            assert "roles must alternate" in err["message"], err
        client = openai.OpenAI(base_url=base + "/v1", api_key=key(cluster, "api-co"), max_retries=0)
        with pytest.raises(openai.BadRequestError, match="alternate"):
            client.chat.completions.create(model="templated", **body)
        assert_unchanged(before, snapshot(cluster))
        # The door still serves a conversation the template takes.
        r = httpx.post(base + "/v1/chat/completions", json=body | {"messages": body["messages"][1:]}, timeout=120,
                       headers=[auth(cluster, "api-co")])
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nothing", 404), ("POST", "/v1/chat/completion", 404),
                                                ("GET", "/v1/completions", 405), ("DELETE", "/v1/models", 405)])
def test_a_wrong_route_or_method_gets_an_openai_error_object(cluster, method, path, status):
    """Starlette's own 404 and 405 were plain text ("Not Found"): the one answer of the door not in OpenAI's error
    shape, which clients written for OpenAI read as {"error": {...}}."""
    before = snapshot(cluster)
    r = httpx.request(method, cluster["http"] + path, headers=[auth(cluster, "api-co")], timeout=30)
    err = assert_error(r, status, "invalid_request_error")
    assert path in err["message"] and method in err["message"], err
    if status == 405:
        assert r.headers["Allow"], r.headers
    assert_unchanged(before, snapshot(cluster))
