"""A prompt that fills the model's context at the HTTP door, from a client that sent no max_tokens: the refusal
names the prompt and says why, and not a max_tokens the client never sent. Real cluster (scripts/up.py: redis-server,
a gateway, a worker whose KV cache is sized from memory, so the model's context is the limit, `python -m
gateway.http`), real HTTP (httpx and the official openai client)."""

from __future__ import annotations

import httpx
import pytest

from gateway.sdk import GatewayClient
from tests.cluster_helpers import assert_unchanged, local_cluster, snapshot
from tests.test_http import key
from tests.test_http_max_tokens import chat_of

CONTEXT = 2048  # models/configs/tiny-llama.json, max_position_embeddings


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("http-room"), tiny_model_dir, workers=1, max_running=4) as c:
        with GatewayClient(c["gateway"], key(c, "api-co"), timeout_s=10) as sdk:
            assert sdk.info(limits=True).tier_token_limits["P1"] == CONTEXT  # the context, not the KV cache, limits
        yield c


def post(c: dict, body: dict) -> httpx.Response:
    return httpx.post(c["http"] + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {key(c, 'api-co')}"}, timeout=120)


@pytest.mark.parametrize("extra", [0, 7])
def test_a_prompt_past_the_context_without_max_tokens_is_refused_for_the_prompt_alone(cluster, extra):
    # The door sized no room for it and let the gateway judge it with the door's default max_tokens (16 for a
    # completion): the gateway's refusal, "prompt (2048 tokens) + max_tokens (16) exceeds the model's context",
    # reached the client, who had sent no max_tokens, and would lower one to no avail.
    before = snapshot(cluster)
    r = post(cluster, {"prompt": [5] * (CONTEXT + extra)})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and err["code"] == "invalid_request", err
    assert "max_tokens" not in err["message"], err["message"]
    assert f"the prompt ({CONTEXT + extra} tokens) leaves no room" in err["message"], err["message"]
    assert_unchanged(before, snapshot(cluster))  # no job stored


def test_a_chat_past_the_context_without_max_tokens_is_refused_for_its_messages(cluster, tiny_model_dir):
    import openai
    from transformers import AutoTokenizer

    messages, n = chat_of(AutoTokenizer.from_pretrained(tiny_model_dir), CONTEXT + 20)
    assert n >= CONTEXT
    client = openai.OpenAI(base_url=cluster["http"] + "/v1", api_key=key(cluster, "api-co"), max_retries=0)
    before = snapshot(cluster)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-llama", messages=messages)
    assert e.value.body["param"] == "messages", e.value.body
    assert "max_tokens" not in e.value.body["message"] and f"({n} tokens)" in e.value.body["message"], e.value.body
    assert_unchanged(before, snapshot(cluster))


def test_a_max_tokens_the_client_sent_is_still_named(cluster):
    # The client's own max_tokens is part of the reason: the gateway's words stand.
    r = post(cluster, {"prompt": [5] * CONTEXT, "max_tokens": 3})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "max_tokens (3)" in err["message"], err
    r = post(cluster, {"prompt": [5] * (CONTEXT - 10), "max_tokens": 11})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
