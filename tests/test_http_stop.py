"""Stop strings (OpenAI's ``stop``) at the HTTP door: the answer ends where the first one begins, whole or
streamed, with the tokens up to the one that completed it counted; the job is cancelled there; bad values are
refused and store nothing.

A real local cluster (scripts/up.py: redis-server, a gateway, a worker, ``python -m gateway.http``), real HTTP
(httpx and the official openai client), and the job's tokens read back through the SDK to place each stop.
"""

from __future__ import annotations

import httpx
import pytest

from gateway.sdk import GatewayClient
from tests.cluster_helpers import assert_unchanged, job_hash, local_cluster, snapshot, wait_for
from tests.test_http import assert_error, kv_usage, key, post, sse

PROMPT = [5, 17, 42, 99, 7, 250, 31]
N = 40


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("http-stop"), tiny_model_dir, workers=1, max_running=4) as c:
        yield c


@pytest.fixture(scope="module")
def pieces(cluster, tiny_model_dir) -> list[str]:
    """The text each of the job's N greedy tokens completes (its own decoder, not the door's)."""
    from tokenizers.decoders import DecodeStream
    from transformers import AutoTokenizer

    with GatewayClient(cluster["gateway"], key(cluster, "api-co")) as sdk:
        tokens = sdk.submit(prompt_token_ids=PROMPT, max_tokens=N, ignore_eos=True).result(timeout=120).token_ids
    backend = AutoTokenizer.from_pretrained(tiny_model_dir).backend_tokenizer
    stream = DecodeStream(skip_special_tokens=True)
    out = [stream.step(backend, t) or "" for t in tokens]
    assert len(out) == N and "".join(out)
    return out


def body(stop, stream: bool = False, max_tokens: int = N, **extra) -> dict:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stop": stop,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {}), **extra}


def ask(cluster, b: dict, headers: dict | None = None) -> tuple[str, str, int, str]:
    """(text, finish reason, completion tokens, job id) of a completion, whole or streamed."""
    if not b["stream"]:
        r = post(cluster, "/v1/completions", b, tenant="api-co", headers=headers)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return choice["text"], choice["finish_reason"], r.json()["usage"]["completion_tokens"], \
            r.headers["X-Request-Id"]
    with httpx.stream("POST", cluster["http"] + "/v1/completions", json=b, timeout=120,
                      headers={"Authorization": f"Bearer {key(cluster, 'api-co')}", **(headers or {})}) as r:
        assert r.status_code == 200, r.read()
        events, done = sse(r.iter_lines())
    assert done
    *chunks, usage = events
    finishes = [c["choices"][0]["finish_reason"] for c in chunks]
    assert all(f is None for f in finishes[:-1]), finishes  # nothing after the finish
    return "".join(c["choices"][0]["text"] for c in chunks), finishes[-1], usage["usage"]["completion_tokens"], \
        r.headers["X-Request-Id"]


def spanning(pieces: list[str], k: int) -> str:
    """A stop string that begins inside token k's text and ends inside a later token's."""
    j = next(j for j in range(k + 1, len(pieces)) if pieces[j])
    return pieces[k][len(pieces[k]) // 2:] + pieces[j][:1]


def expected(pieces: list[str], stop: str) -> tuple[str, int]:
    """The answer's text and its tokens: up to where ``stop`` first begins, through the token that completes it."""
    n = next(n for n in range(1, len(pieces) + 1) if stop in "".join(pieces[:n]))
    text = "".join(pieces)
    return text[:text.index(stop)], n


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stop_string_ends_the_answer_where_it_begins(cluster, pieces, stream):
    whole = "".join(pieces)
    k = next(k for k in range(3, N - 5) if len(pieces[k]) >= 2)
    stop = spanning(pieces, k)
    text, n = expected(pieces, stop)
    assert n < N and len(text) < len(whole)
    assert ask(cluster, body(stop, stream))[:3] == (text, "stop", n)
    # Among several, the first to begin; one string alone as in OpenAI's API.
    later = spanning(pieces, k + 5)
    assert ask(cluster, body([later, stop, "\x00never"], stream))[:3] == (text, "stop", n)
    assert ask(cluster, body(stop, stream))[:3] == ask(cluster, body([stop], stream))[:3]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_text_that_only_begins_a_stop_string_is_sent_in_full(cluster, pieces, stream):
    """A stream holds back what may begin a stop string; one the text never completes leaves nothing out."""
    whole = "".join(pieces)
    for stop in (whole[-3:] + "\u2603", whole[-1] + "\u2603" * 20, "\u2603"):
        assert ask(cluster, body(stop, stream))[:3] == (whole, "length", N), stop


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_the_job_is_cancelled_at_its_stop(cluster, pieces, stream):
    """What the job would make past the stop is nobody's: the door cancels it and the worker frees its blocks."""
    stop = spanning(pieces, 4)
    text, n = expected(pieces, stop)
    got, finish, tokens, job_id = ask(cluster, body(stop, stream, max_tokens=1500))
    assert (got, finish, tokens) == (text, "stop", n)
    h = wait_for(lambda: (h := job_hash(cluster, job_id))["state"] == "cancelled" and h, 60, "the job's cancel")
    assert int(h.get("num_tokens", 0) or 0) < 1500
    wait_for(lambda: kv_usage(cluster["metrics"][1]) == 0, 60, "the worker to free the job's KV blocks")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_with_an_idempotency_key_the_job_runs_on_and_a_retry_answers_the_same(cluster, pieces, stream):
    stop = spanning(pieces, 6)
    text, n = expected(pieces, stop)
    headers = {"Idempotency-Key": f"stop-{stream}"}
    first = ask(cluster, body(stop, stream), headers)
    assert first[:3] == (text, "stop", n)
    again = ask(cluster, body(stop, stream), headers)
    assert again == first
    h = wait_for(lambda: (h := job_hash(cluster, first[3]))["state"] == "done" and h, 60, "the job's end")
    assert int(h["num_tokens"]) == N


BAD = [5, True, {"a": 1}, ["a", 5], [None], "", [""], ["a", ""], ["a", "b", "c", "d", "e"], "x" * 1001]


@pytest.mark.parametrize("stop", BAD, ids=[repr(s)[:20] for s in BAD])
def test_bad_stop_strings_are_refused_and_store_nothing(cluster, stop):
    before = snapshot(cluster)
    for path, base in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        err = assert_error(post(cluster, path, {**base, "max_tokens": 1, "stop": stop}), 400,
                           "invalid_request_error", "stop")
        assert "stop" in err["message"], err
    assert_unchanged(before, snapshot(cluster))


def test_no_stop_strings_asks_for_none(cluster, pieces):
    for stop in ([], None):
        assert ask(cluster, body(stop))[:3] == ("".join(pieces), "length", N)


def test_the_openai_client_stops_whole_and_streamed(cluster, pieces):
    import openai

    client = openai.OpenAI(base_url=cluster["http"] + "/v1", api_key=key(cluster, "api-co"), max_retries=0)
    stop = spanning(pieces, 3)
    text, n = expected(pieces, stop)
    c = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=N, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert (c.choices[0].text, c.choices[0].finish_reason, c.usage.completion_tokens) == (text, "stop", n)
    # A chat: its answer whole, then streamed, both cut at a stop string inside the whole answer.
    messages = [{"role": "user", "content": "Hello there"}]
    ref = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=N, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].message.content
    chat_stop = ref[len(ref) // 2:len(ref) // 2 + 3]
    cut = ref[:ref.index(chat_stop)]
    whole = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=N, temperature=0,
                                           stop=chat_stop, extra_body={"ignore_eos": True})
    assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == (cut, "stop")
    deltas, finish = [], None
    for chunk in client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=N, temperature=0,
                                                stop=[chat_stop], stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices:
            deltas.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert ("".join(deltas), finish) == (cut, "stop")
