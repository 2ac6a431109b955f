"""Types of the HTTP door's request fields, found by an adversarial run: a wrong-typed value that asks for nothing
("stop": {}, "logit_bias": [], "tools": {}, "min_tokens": 0.0) was served as if absent, and a negative seed, which
OpenAI and vLLM accept, was refused.

A real local cluster (scripts/up.py: redis-server, a gateway, a worker, `python -m gateway.http`), the official
openai client over real HTTP, and the SDK against the same gateway.
"""

from __future__ import annotations

import pytest

from gateway.sdk import GatewayClient
from tests.cluster_helpers import assert_unchanged, local_cluster, snapshot
from tests.test_http import key, post

CHAT = [{"role": "user", "content": "Hello"}]

# (endpoint, field, a value of the wrong type that is empty or falsy, what the field's type is called).
WRONG_TYPED = [
    ("chat", "stop", {}, "string or an array"), ("completions", "stop", {}, "string or an array"),
    ("completions", "stop", 0, "string or an array"),
    ("chat", "logit_bias", [], "object"), ("completions", "logit_bias", [], "object"),
    ("chat", "tools", {}, "array"), ("chat", "functions", {}, "array"),
    ("completions", "bad_words", {}, "array"),
    ("completions", "logits_processors", {}, "array"), ("completions", "vllm_xargs", [], "object"),
    ("chat", "chat_template_kwargs", [], "object"), ("chat", "documents", {}, "array"),
    ("chat", "top_logprobs", 0.0, "integer"),
    ("completions", "best_of", 1.0, "integer"),
    # An integer on /v1/completions (vLLM reads false as 0: the chosen tokens' log probabilities).
    ("completions", "logprobs", False, "integer"),
    ("chat", "logprobs", 0, "boolean"), ("completions", "echo", 0, "boolean"),
    ("chat", "response_format", [], "object"), ("chat", "modalities", {}, "array"),
    ("chat", "tool_choice", [], "string or an object"),
]


def openai_client(cluster, tenant: str = "api-co"):
    import openai

    return openai.OpenAI(base_url=cluster["http"] + "/v1", api_key=key(cluster, tenant), max_retries=0)


def create(client, endpoint: str, **kwargs):
    extra = {"extra_body": {"ignore_eos": True}} | kwargs
    if endpoint == "chat":
        return client.chat.completions.create(model="tiny-llama", messages=extra.pop("messages", CHAT), **extra)
    return client.completions.create(model="tiny-llama", prompt="Hello", **extra)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("http-types"), tiny_model_dir, workers=1, max_running=4) as c:
        yield c


@pytest.mark.parametrize("endpoint,field,value,type_name", WRONG_TYPED,
                         ids=[f"{e}-{f}-{v!r}" for e, f, v, _ in WRONG_TYPED])
def test_a_wrong_typed_empty_value_is_refused_naming_the_field(cluster, endpoint, field, value, type_name):
    """Served as if absent, when OpenAI and vLLM refuse it as a type error: the client's bug went unseen (and for
    completions' logprobs, vLLM's answer would have held log probabilities). Now a 400 naming the field and its
    type, with nothing stored and no quota charged."""
    import openai

    before = snapshot(cluster)
    with pytest.raises(openai.BadRequestError) as raised:
        create(openai_client(cluster), endpoint, max_tokens=1, extra_body={field: value})
    body = raised.value.body
    assert body["param"] == field and body["type"] == "invalid_request_error", body
    assert "must be" in body["message"] and type_name in body["message"], body
    assert_unchanged(before, snapshot(cluster))


def test_a_message_s_tool_calls_of_the_wrong_type_is_refused(cluster):
    import openai

    before = snapshot(cluster)
    with pytest.raises(openai.BadRequestError) as raised:
        create(openai_client(cluster), "chat", max_tokens=1,
               messages=[{"role": "assistant", "content": "x", "tool_calls": {}}, *CHAT])
    assert raised.value.body["param"] == "messages.0.tool_calls", raised.value.body
    assert "must be an array" in raised.value.body["message"], raised.value.body
    assert_unchanged(before, snapshot(cluster))


def test_right_typed_neutral_values_are_still_served(cluster):
    client = openai_client(cluster)
    chat = create(client, "chat", max_tokens=2, stop=[], logit_bias={}, tools=[], top_logprobs=0, logprobs=False,
                  extra_body={"ignore_eos": True, "min_tokens": 0, "chat_template_kwargs": {}, "documents": []})
    assert chat.usage.completion_tokens == 2
    text = create(client, "completions", max_tokens=2, stop=[], logit_bias={}, best_of=1, presence_penalty=0.0,
                  extra_body={"ignore_eos": True, "min_tokens": 0, "stop_token_ids": [], "vllm_xargs": {}})
    assert text.usage.completion_tokens == 2


def test_a_negative_seed_is_served_reproducibly(cluster):
    """A negative seed was a 400, though OpenAI and vLLM accept any 64-bit seed. The worker's seeds are
    [0, 2**63): the door maps a seed to seed mod 2**63, so one seed always gives one answer, a non-negative seed is
    the SDK's same seed, and a negative one is the SDK's seed + 2**63."""
    client = openai_client(cluster)
    prompt = [5, 6, 7]

    def text(endpoint: str, seed: int) -> str:
        if endpoint == "chat":
            return create(client, "chat", max_tokens=12, temperature=1.0, seed=seed).choices[0].message.content
        return client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=12, temperature=1.0,
                                         seed=seed, extra_body={"ignore_eos": True}).choices[0].text

    for endpoint in ("chat", "completions"):
        assert text(endpoint, -7) == text(endpoint, -7)
        assert text(endpoint, -2**63) == text(endpoint, -2**63)
    # The mapping is the documented one: what the SDK serves for the worker's seed.
    with GatewayClient(cluster["gateway"], key(cluster, "api-co")) as sdk:
        def sdk_text(seed: int) -> str:
            job = sdk.submit(prompt_token_ids=prompt, max_tokens=12, temperature=1.0, ignore_eos=True, seed=seed)
            return job.result(timeout=60).text

        assert text("completions", -7) == sdk_text(2**63 - 7)
        assert text("completions", -2**63) == sdk_text(0) == text("completions", 0)
        assert text("completions", 7) == sdk_text(7)
    assert text("completions", -7) != text("completions", 7)


@pytest.mark.parametrize("seed", [-2**63 - 1, 2**63, True, 1.5, "7"])
def test_a_seed_outside_64_bits_is_refused_naming_the_range(cluster, seed):
    import openai

    before = snapshot(cluster)
    with pytest.raises(openai.BadRequestError) as raised:
        create(openai_client(cluster), "completions", max_tokens=1, extra_body={"seed": seed})
    assert raised.value.body["param"] == "seed", raised.value.body
    if isinstance(seed, int) and not isinstance(seed, bool):
        assert "-9223372036854775808" in raised.value.body["message"], raised.value.body
    assert_unchanged(before, snapshot(cluster))


# (a /v1/completions prompt the door cannot serve, words its refusal must hold). pydantic's words for the union of
# the prompt's shapes named one of them only: "prompt: Input should be a valid string", for an array of ids too.
BAD_PROMPTS = [
    (["Hello", "world"], ["batch of 2", "one prompt per request"]),
    ([[5, 6], [7]], ["batch of 2", "one prompt per request"]),
    ([], ["empty"]),
    ([[]], ["empty"]),
    ([""], ["empty"]),
    ([5.0, 6.0], ["token ids", "a number"]),
    ([5, True], ["token ids", "a boolean"]),
    ([5, "six"], ["token ids", "a string"]),
    ([[5], "six"], ["token ids", "an array"]),
    ([[5, None]], ["token ids", "null"]),
    (5, ["a string or an array of token ids", "an integer"]),
    ({"text": "Hello"}, ["a string or an array of token ids", "an object"]),
]


@pytest.mark.parametrize("prompt,words", BAD_PROMPTS, ids=[repr(p) for p, _ in BAD_PROMPTS])
def test_a_prompt_of_a_shape_the_door_cannot_serve_is_refused_in_words_that_say_why(cluster, prompt, words):
    import openai

    before = snapshot(cluster)
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client(cluster).completions.create(model="tiny-llama", prompt=prompt, max_tokens=1)
    body = raised.value.body
    assert body["param"] == "prompt" and body["type"] == "invalid_request_error", body
    assert "valid string" not in body["message"] and all(w in body["message"] for w in words), body
    assert_unchanged(before, snapshot(cluster))


BAD_PARTS = [
    ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], ["'image_url'", "text"]),
    ([{"type": "text", "text": "Hi"}, {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
     ["'input_audio'", "text"]),
    ([{"text": "Hi"}], ["type", "text"]),
    ([{"type": "text"}], ["text"]),
    (["Hi"], ["a string"]),
    (5, ["a string or an array of text parts", "an integer"]),
]


@pytest.mark.parametrize("content,words", BAD_PARTS, ids=[repr(c)[:40] for c, _ in BAD_PARTS])
def test_a_message_content_this_model_cannot_read_is_refused_naming_the_part(cluster, content, words):
    """An image part was refused as "messages.0.content: Input should be a valid string": the client could not tell
    that the server reads text only."""
    import openai

    before = snapshot(cluster)
    with pytest.raises(openai.BadRequestError) as raised:
        create(openai_client(cluster), "chat", max_tokens=1, messages=[{"role": "user", "content": content}])
    body = raised.value.body
    assert body["param"] == "messages.0.content" and body["type"] == "invalid_request_error", body
    assert "valid string" not in body["message"] and all(w in body["message"] for w in words), body
    assert_unchanged(before, snapshot(cluster))
