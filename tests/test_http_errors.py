"""Every answer of the HTTP door is an OpenAI error object a client can read, whatever went wrong: a chat template
that cannot compile, a body over the limit. Against a real local cluster (scripts/up.py), a real door process and
real HTTP clients (httpx and the official openai client)."""

from __future__ import annotations

import shutil

import httpx
import pytest

from tests.cluster_helpers import assert_unchanged, local_cluster, snapshot
from tests.test_http import assert_error, front_door, key

MAX_BODY = 4096


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    # No front door of up.py's: the tests use broken_door's.
    with local_cluster(tmp_path_factory.mktemp("http-errors"), tiny_model_dir, workers=1, max_running=4,
                       http=False) as c:
        yield c


@pytest.fixture(scope="module")
def broken_door(cluster, tiny_model_dir, tmp_path_factory):
    """A door whose model's chat template does not compile (an unclosed tag), with a small body limit."""
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("broken-template")
    broken = tmp / "broken"
    shutil.copytree(tiny_model_dir, broken)
    tok = AutoTokenizer.from_pretrained(broken)
    tok.chat_template = "{% for m in messages %}{{ m.content }}"  # no endfor: a TemplateSyntaxError
    tok.save_pretrained(broken)
    with front_door(broken, [cluster["gateway"]], tmp / "door.log",
                    env={"TS_HTTP_MAX_BODY_BYTES": str(MAX_BODY)}) as base:
        yield base


def auth(c: dict, tenant: str = "api-co") -> dict:
    return {"Authorization": f"Bearer {key(c, tenant)}"}


def test_a_chat_template_that_cannot_compile_is_a_json_server_error(cluster, broken_door):
    """jinja2's TemplateSyntaxError escaped the door: Starlette's plain-text "Internal Server Error", which no OpenAI
    client reads as an error object and which named nothing an operator could act on."""
    import openai

    before = snapshot(cluster)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for stream in (False, True):
        r = httpx.post(broken_door + "/v1/chat/completions", json=body | {"stream": stream}, headers=auth(cluster),
                       timeout=120)
        err = assert_error(r, 500, "server_error")
        assert err["code"] == "chat_template_error" and "chat template" in err["message"], err
        assert err["param"] is None, err
    client = openai.OpenAI(base_url=broken_door + "/v1", api_key=key(cluster, "api-co"), max_retries=0)
    with pytest.raises(openai.InternalServerError, match="chat template") as raised:
        client.chat.completions.create(model="broken", **body)
    assert raised.value.code == "chat_template_error"
    assert_unchanged(before, snapshot(cluster))
    # A completion needs no template: the door still serves it.
    r = httpx.post(broken_door + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=auth(cluster),
                   timeout=120)
    assert r.status_code == 200, r.text


def test_a_body_over_the_limit_has_a_stable_code(cluster, broken_door):
    """The 413's error object had "code": null, the one refusal a client could not tell apart by its code."""
    import openai

    before = snapshot(cluster)
    client = openai.OpenAI(base_url=broken_door + "/v1", api_key=key(cluster, "api-co"), max_retries=0)
    with pytest.raises(openai.APIStatusError) as raised:
        client.completions.create(model="broken", prompt="x" * (2 * MAX_BODY), max_tokens=1)
    assert raised.value.status_code == 413
    assert raised.value.code == "request_too_large", raised.value.body
    assert raised.value.body["type"] == "invalid_request_error" and str(MAX_BODY) in raised.value.body["message"]
    # Streamed without a Content-Length (chunked): the same answer, read part by part.
    def chunks():
        yield b'{"prompt": "'
        for _ in range(4):
            yield b"y" * MAX_BODY
        yield b'", "max_tokens": 1}'

    r = httpx.post(broken_door + "/v1/completions", content=chunks(), headers=auth(cluster), timeout=120)
    err = assert_error(r, 413, "invalid_request_error")
    assert err["code"] == "request_too_large", err
    assert_unchanged(before, snapshot(cluster))
