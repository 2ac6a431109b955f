"""A request without max_tokens at the HTTP door: it gets the room its prompt leaves (at most the door's default),
as vLLM does, and is refused only for its prompt, never for a max_tokens the client did not send. Real cluster
(scripts/up.py), real HTTP (httpx and the official openai client)."""

from __future__ import annotations

import httpx
import pytest

from gateway.http.sizing import max_tokens_for
from gateway.http.errors import HttpError
from gateway.http.prompts import plain_chat_text
from gateway.http.schemas import Message
from gateway.sdk import GatewayClient
from tests.cluster_helpers import assert_unchanged, local_cluster, snapshot

DEFAULT = 256  # HttpConfig.default_max_tokens, as up.py starts the door
# kv_blocks -> the largest prompt + max_tokens any tier admits: 64 blocks of 16 tokens hold 1024 (the tiers' share
# of the KV cache is the limit); with the cache sized from memory, the model's context of 2048 is.
LIMITS = {64: 1024, 0: 2048}


@pytest.fixture(scope="module", params=sorted(LIMITS), ids=lambda b: f"kv{b}")
def cluster(request, tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("http-room"), tiny_model_dir, workers=1, max_running=4,
                       kv_blocks=request.param) as c:
        c["limit"] = LIMITS[request.param]
        yield c


# api-co: its highest tier, the door's default, is P1. chat-co's is P0, whose quota (2/s, burst 4) refuses a quick
# run of these requests with a 429.
def key(c: dict, tenant: str = "api-co") -> str:
    return c["tenants"][tenant]["api_key"]


def post(c: dict, path: str, body: dict, tenant: str = "api-co") -> httpx.Response:
    return httpx.post(c["http"] + path, json=body, headers={"Authorization": f"Bearer {key(c, tenant)}"},
                      timeout=120)


def chat_of(tokenizer, tokens: int) -> tuple[list[dict], int]:
    """Messages whose prompt (the plain chat format) is about ``tokens`` long, and its exact length."""
    words = tokens
    while True:
        messages = [{"role": "user", "content": " the" * words}]
        n = len(tokenizer(plain_chat_text([Message(**m) for m in messages])).input_ids)
        if n <= tokens:
            return messages, n
        words -= n - tokens


def test_gateway_says_each_tiers_limit(cluster):
    with GatewayClient(cluster["gateway"], key(cluster, "api-co"), timeout_s=10) as sdk:
        info = sdk.info(limits=True)
        plain = sdk.info()
    # The asking tenant's tiers only (api-co has no P0): the door reads its default tier from them.
    assert info.tier_token_limits == {t: cluster["limit"] for t in ("P1", "P2", "P3")}
    assert info.max_tokens_limit == 4096
    # Not asked for, not sent: an older SDK refuses reply fields it does not know (tests/test_wire_compat.py).
    assert plain.tier_token_limits is None and plain.max_tokens_limit is None and plain.workers == info.workers


def test_chat_without_max_tokens_gets_the_room_its_prompt_leaves(cluster, tiny_model_dir):
    import openai
    from transformers import AutoTokenizer

    limit = cluster["limit"]
    messages, n = chat_of(AutoTokenizer.from_pretrained(tiny_model_dir), limit - 100)
    room = limit - n
    assert 0 < room < DEFAULT  # the old default of 256 did not fit: a 400 naming max_tokens, never sent
    client = openai.OpenAI(base_url=cluster["http"] + "/v1", api_key=key(cluster), max_retries=0)
    reply = client.chat.completions.create(model="tiny-llama", messages=messages, extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens == n and reply.usage.completion_tokens == room
    assert reply.choices[0].finish_reason == "length"
    # The room was the largest max_tokens the cluster takes: one more, asked for, is refused, naming the field
    # as the client named it.
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny-llama", messages=messages, **{field: room + 1})
        assert e.value.body["param"] == field, e.value.body
    # An explicit max_tokens is the client's, as before.
    reply = client.chat.completions.create(model="tiny-llama", messages=messages, max_completion_tokens=3,
                                           extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"


def test_a_short_prompt_still_gets_the_default(cluster):
    # The room is far larger; the default bounds it (each job's max_tokens is reserved and counted in waits).
    r = post(cluster, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True,
                                               "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    usage = [line for line in r.text.splitlines() if '"usage": {' in line or '"usage":{' in line]
    assert usage and '"completion_tokens":256' in usage[-1].replace(" ", ""), usage


@pytest.mark.parametrize("max_tokens,room,expected", [
    ({}, 5, 5),  # absent: OpenAI's 16 for a completion, at most the room
    ({}, 40, 16),
    ({"max_tokens": None}, 5, 5),  # null is the default
])
def test_completion_without_max_tokens(cluster, max_tokens, room, expected):
    r = post(cluster, "/v1/completions", {"prompt": [5] * (cluster["limit"] - room), "ignore_eos": True,
                                          **max_tokens})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == expected and body["choices"][0]["finish_reason"] == "length"


def test_a_prompt_that_fills_the_context_alone_is_refused_for_the_prompt(cluster, tiny_model_dir):
    import openai
    from transformers import AutoTokenizer

    limit = cluster["limit"]
    before = snapshot(cluster)
    r = post(cluster, "/v1/completions", {"prompt": [5] * limit})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    messages, n = chat_of(AutoTokenizer.from_pretrained(tiny_model_dir), limit + 20)
    assert n >= limit
    client = openai.OpenAI(base_url=cluster["http"] + "/v1", api_key=key(cluster), max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-llama", messages=messages)
    assert e.value.body["param"] == "messages" and "prompt" in e.value.body["message"], e.value.body
    assert_unchanged(before, snapshot(cluster))  # no job stored, nothing charged


def test_rule_without_the_gateways_limits():
    # An older gateway says no limits: the door's default, as before.
    assert max_tokens_for(256, 1000, None, None, None, "prompt") == 256
    assert max_tokens_for(256, 1000, None, {"P1": 1100, "P2": 900}, 4096, "prompt") == 100  # the highest tier's
    assert max_tokens_for(256, 10, "P2", {"P1": 1100, "P2": 900}, 64, "prompt") == 64  # max_tokens_limit
    assert max_tokens_for(256, 10, "P0", {"P1": 1100}, 4096, "prompt") == 256  # not entitled: the gateway's 403
    with pytest.raises(HttpError) as e:
        max_tokens_for(256, 900, "P2", {"P1": 1100, "P2": 900}, 4096, "messages")
    assert e.value.status == 400 and e.value.param == "messages"
