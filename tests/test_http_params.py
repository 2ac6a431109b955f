"""Request fields of the HTTP door that changed the answer, or were refused, unlike OpenAI's and vLLM's servers:
`stream_options` without a stream, and `reasoning_effort`, which vLLM hands the chat template.

A real local cluster (scripts/up.py: redis-server, a gateway, a worker, `python -m gateway.http`), a second real
door for a tokenizer with a chat template, over real HTTP (httpx and the official openai client).
"""

from __future__ import annotations

import shutil

import httpx
import pytest

from tests.cluster_helpers import assert_unchanged, local_cluster, snapshot
from tests.test_http import assert_error, front_door, key, post


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("http-params"), tiny_model_dir, workers=1, max_running=4) as c:
        yield c


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_options_without_a_stream_is_refused(cluster, path):
    """stream_options in a request that is not streamed was ignored: a client asking for the usage chunk got a whole
    answer and no word that its option did nothing. OpenAI and vLLM answer 400 naming stream_options; an empty one
    (or null) asks for nothing and is served, as vLLM serves it. One whose only option is null was served: vLLM
    refuses any stream_options that holds something, a null included."""
    base = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    before = snapshot(cluster)
    for stream in ({}, {"stream": False}, {"stream": None}):
        for options in ({"include_usage": True}, {"include_usage": False}, {"continuous_usage_stats": False},
                        {"include_usage": None}, {"continuous_usage_stats": None}):
            err = assert_error(post(cluster, path, {**base, "max_tokens": 1, **stream, "stream_options": options}),
                               400, "invalid_request_error", "stream_options")
            assert "stream" in err["message"], err
    assert_unchanged(before, snapshot(cluster))
    for options in ({}, None):
        r = post(cluster, path, {**base, "max_tokens": 1, "stream": False, "stream_options": options})
        assert r.status_code == 200, r.text


def test_the_openai_client_is_told_stream_options_need_a_stream(cluster):
    import openai

    client = openai.OpenAI(base_url=cluster["http"] + "/v1", api_key=key(cluster, "api-co"), max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny-llama", prompt="Hi", max_tokens=2, stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options", e.value.body


EFFORT_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                   "{% if reasoning_effort is defined %}effort: {{ reasoning_effort }}, thinking: {{ enable_thinking }}"
                   "\n{% endif %}{% if add_generation_prompt %}assistant:{% endif %}")


def test_reasoning_effort_reaches_the_chat_template(cluster, tiny_model_dir, tmp_path):
    """reasoning_effort was accepted and ignored: a model whose chat template reads it (gpt-oss's, or Qwen3's
    enable_thinking) got the prompt of another effort than the one asked for. vLLM hands the template
    reasoning_effort, and enable_thinking (false for "none"); so does the door now. A value no API defines is a
    400 naming the field; null asks for nothing."""
    from transformers import AutoTokenizer

    templated = tmp_path / "templated"
    shutil.copytree(tiny_model_dir, templated)
    tok = AutoTokenizer.from_pretrained(templated)
    tok.chat_template = EFFORT_TEMPLATE
    tok.save_pretrained(templated)
    messages = [{"role": "user", "content": "Hello"}]

    def expected(**kwargs) -> int:
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return len(tok(text, add_special_tokens=False).input_ids)

    auth = {"Authorization": f"Bearer {key(cluster, 'api-co')}"}
    with front_door(templated, [cluster["gateway"]], tmp_path / "http.log") as door:
        def prompt_tokens(**extra) -> int:
            r = httpx.post(door + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1, **extra},
                           headers=auth, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]

        assert prompt_tokens() == prompt_tokens(reasoning_effort=None) == expected()
        assert prompt_tokens(reasoning_effort="high") == expected(reasoning_effort="high", enable_thinking=True)
        assert prompt_tokens(reasoning_effort="none") == expected(reasoning_effort="none", enable_thinking=False)
        assert expected(reasoning_effort="high", enable_thinking=True) != expected()
        before = snapshot(cluster)
        for bad in ("extreme", 3, True):
            r = httpx.post(door + "/v1/chat/completions", headers=auth, timeout=120,
                           json={"messages": messages, "max_tokens": 1, "reasoning_effort": bad})
            assert_error(r, 400, "invalid_request_error", "reasoning_effort")
        assert_unchanged(before, snapshot(cluster))
