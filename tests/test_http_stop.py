"""Stop strings (OpenAI's ``stop``) at the HTTP door: the answer ends where the first one begins, whole or
streamed, with the tokens up to the one that completed it counted; the job ends there (done, finish_reason stop,
those tokens: tests/test_stop_at.py for the gateway's side); bad values are refused and store nothing.

A real local cluster (scripts/up.py: redis-server, a gateway, a worker, ``python -m gateway.http``), real HTTP
(httpx and the official openai client), and the job's tokens read back through the SDK to place each stop.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import msgpack
import pytest

from gateway.sdk import GatewayClient
from tests.cluster_helpers import (assert_unchanged, frozen, job_hash, job_ids, local_cluster, snapshot,
                                   state_pids, wait_for)
from tests.test_http import assert_error, kv_usage, key, post, sse
from tests.test_metrics_counts import summed

PROMPT = [5, 17, 42, 99, 7, 250, 31]
N = 40
KEEPALIVE_S = 0.25  # the door's sse_keepalive_s: short, so that a stream silent past it shows within a test


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("http-stop"), tiny_model_dir, workers=1, max_running=16,
                       env={"TS_HTTP_SSE_KEEPALIVE_S": str(KEEPALIVE_S)}) as c:
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


def reference(pieces: list[str], stops: list[str], include: bool = False) -> tuple[str, str, int]:
    """(text, finish reason, tokens) by the contract, read naively: at the first token after which the text holds
    any stop string, the text up to where the first of those begins (through it, ``include``; of two beginning
    there, the one listed first)."""
    text = ""
    for n, piece in enumerate(pieces, 1):
        text += piece
        if hits := [(text.index(s), i) for i, s in enumerate(stops) if s in text]:
            at, i = min(hits)
            return text[:at + (len(stops[i]) if include else 0)], "stop", n
    return text, "length", len(pieces)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stop_string_ends_the_answer_where_it_begins(cluster, pieces, stream):
    whole = "".join(pieces)
    k = next(k for k in range(3, N - 5) if len(pieces[k]) >= 2)
    stop = spanning(pieces, k)
    text, _, n = reference(pieces, [stop])
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
def test_the_job_ends_done_at_its_stop_with_the_tokens_its_answer_holds(cluster, pieces, stream):
    """What the job would make past the stop is nobody's: the door ends it there and the worker frees its blocks.
    Its record says so (done, finish_reason stop, the answer's tokens), as do the gateway's counts: it was
    recorded cancelled, which read as a client giving up on every request a stop string ended."""
    stop = spanning(pieces, 4)
    text, _, n = reference(pieces, [stop])
    with GatewayClient(cluster["gateway"], key(cluster, "api-co")) as sdk:
        whole = sdk.submit(prompt_token_ids=PROMPT, max_tokens=N, ignore_eos=True).result(timeout=120).token_ids
    ended = {s: summed(cluster, "ts_jobs_finished_total", state=s) for s in ("done", "cancelled")}
    got, finish, tokens, job_id = ask(cluster, body(stop, stream, max_tokens=1500))
    assert (got, finish, tokens) == (text, "stop", n)
    h = wait_for(lambda: (h := job_hash(cluster, job_id))["state"] != "dispatched" and h, 60, "the job's end")
    assert (h["state"], h["finish_reason"], int(h["num_tokens"])) == ("done", "stop", n), h
    raw = cluster["redis_client"].hget(f"{cluster['key_prefix']}:{{c}}:job:{job_id}", "token_ids")
    assert msgpack.unpackb(raw) == whole[:n]
    with GatewayClient(cluster["gateway"], key(cluster, "api-co")) as sdk:
        result = sdk.job(job_id).result(timeout=30)
    assert (result.token_ids, result.finish_reason) == (whole[:n], "stop")
    wait_for(lambda: summed(cluster, "ts_jobs_finished_total", state="done") == ended["done"] + 1, 30,
             "the gateway to count the job done")
    assert summed(cluster, "ts_jobs_finished_total", state="cancelled") == ended["cancelled"]
    wait_for(lambda: kv_usage(cluster["metrics"][1]) == 0, 60, "the worker to free the job's KV blocks")


def test_a_stop_past_the_tokens_made_so_far_ends_the_job_when_it_has_them(cluster, pieces):
    """The SDK's ``cancel(job_id, stop_at=n)`` with n tokens not yet made: the worker ends the job at the step that
    makes the n-th, with exactly n; a stop already passed ends it at once with the first n."""
    with GatewayClient(cluster["gateway"], key(cluster, "api-co")) as sdk:
        whole = sdk.submit(prompt_token_ids=PROMPT, max_tokens=N, ignore_eos=True).result(timeout=120).token_ids
        for at, after in ((N - 3, 1), (3, 10)):
            job = sdk.submit(prompt_token_ids=PROMPT, max_tokens=1500, ignore_eos=True)
            seen = 0
            for chunk in job.stream(timeout=60):
                seen += len(chunk.token_ids)
                if seen >= after:
                    break
            assert (sdk.cancel(job.id, stop_at=at) if at > 5 else job.cancel(stop_at=at)) is True
            result = job.result(timeout=60)
            assert (result.token_ids, result.finish_reason) == (whole[:at], "stop"), (at, after)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_with_an_idempotency_key_the_job_runs_on_and_a_retry_answers_the_same(cluster, pieces, stream):
    stop = spanning(pieces, 6)
    text, _, n = reference(pieces, [stop])
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
    text, _, n = reference(pieces, [stop])
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


def adversarial(pieces: list[str]) -> dict[str, list[str]]:
    """Stop strings at the edges: of the answer, of each other, of characters, of their lengths."""
    whole = "".join(pieces)
    mid = len(whole) // 2
    s = whole[mid:mid + 6]
    last = next(whole[-k:] for k in range(1, len(whole)) if whole.find(whole[-k:]) == len(whole) - k)
    again = next(p for p in pieces[2:] if pieces.count(p) >= 3 and len(p) >= 2)  # a piece the text repeats
    at = whole.rindex(again)
    return {
        "first token": [whole[:1]],
        "the whole text": [whole],
        "the last token": [last],
        "one inside another": [s, s[2:4]],
        "a prefix of another": [s, s[:3]],
        "a suffix of another": [s[1:], s],
        "its start many times": [whole[at:at + 12]],
        "after a token mid-character": ["\ufffd"],
        "two incomplete characters": ["\U0001F600", "\ufffd\ufffd"],
        "1000 characters and a short one": ["\U0001F600" * 1000, s],
        "1000 characters, never": ["\U0001F600" * 1000, "\u2603" * 999 + whole[:1]],
        # vLLM's include_stop_str_in_output (it was ignored, the one field vLLM defines that changed the answer
        # and was neither honoured nor refused): the answer ends where the stop string does.
        "included": [spanning(pieces, 4)],
        "included, one inside another": [s, s[2:4]],
        "included, a prefix of another": [s[:3], s],
        "included, after tokens mid-character": ["\ufffd\ufffd"],
    }


@pytest.fixture(scope="module")
def cases(pieces) -> dict[str, tuple[list[str], bool, tuple[str, str, int]]]:
    """name: (stop strings, include_stop_str_in_output, the answer)."""
    out = {name: (stops, name.startswith("included"), reference(pieces, stops, name.startswith("included")))
           for name, stops in adversarial(pieces).items()}
    assert out["first token"][2][1:] == ("stop", 1)
    assert out["the last token"][2][1:] == out["the whole text"][2][1:] == ("stop", N)
    assert out["1000 characters, never"][2][1:] == ("length", N)
    assert all(want[0].endswith(tuple(stops)) for stops, included, want in out.values() if included)
    return out


def test_adversarial_stops_concurrently_through_the_async_openai_client(cluster, cases):
    """Every case twice, whole and streamed, all at once through one AsyncOpenAI client: each answer's text, finish
    and usage as the contract says, and no streamed chunk holds anything past the stop."""
    import asyncio

    import openai

    def extra(included: bool) -> dict:
        return {"ignore_eos": True, **({"include_stop_str_in_output": True} if included else {})}

    async def whole(client, stops, included):
        c = await client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=N, temperature=0,
                                            stop=stops, extra_body=extra(included))
        return c.choices[0].text, c.choices[0].finish_reason, c.usage.completion_tokens

    async def streamed(client, stops, included):
        texts, finishes, usage = [], [], None
        async for chunk in await client.completions.create(
                model="tiny-llama", prompt=PROMPT, max_tokens=N, temperature=0, stop=stops, stream=True,
                stream_options={"include_usage": True}, extra_body=extra(included)):
            usage = chunk.usage or usage
            for c in chunk.choices:
                texts.append(c.text)
                finishes.append(c.finish_reason)
        assert all(f is None for f in finishes[:-1]), finishes
        return "".join(texts), finishes[-1], usage.completion_tokens

    async def main():
        client = openai.AsyncOpenAI(base_url=cluster["http"] + "/v1", api_key=key(cluster, "api-co"), max_retries=0,
                                    timeout=120)
        async with client:
            return await asyncio.gather(*(f(client, stops, included) for stops, included, _ in cases.values()
                                          for f in (whole, streamed)))

    got = iter(asyncio.run(main()))
    for name, (stops, included, want) in cases.items():
        assert (next(got), next(got)) == (want, want), name


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_gone_while_text_is_held_back_cancels_the_job(cluster, stream):
    """A stop string of 1000 characters holds back everything the job has made; the client leaving then still
    cancels the job and frees its blocks."""
    before = job_ids(cluster)
    b = body("\U0001F600" * 1000, stream, max_tokens=1500)
    u = urlsplit(cluster["http"])
    raw = json.dumps(b).encode()
    s = socket.create_connection((u.hostname, u.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Authorization: Bearer {key(cluster, 'api-co')}\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
    (job_id,) = wait_for(lambda: job_ids(cluster) - before, 60, "the job to be admitted")
    wait_for(lambda: job_hash(cluster, job_id)["state"] == "dispatched", 60, "the job to run")
    if stream:
        assert s.recv(12) == b"HTTP/1.1 200"  # its status line is out: the door holds its text back
    s.close()
    h = wait_for(lambda: (h := job_hash(cluster, job_id))["state"] == "cancelled" and h, 60, "the job's cancel")
    assert int(h.get("num_tokens", 0) or 0) < 1500
    wait_for(lambda: kv_usage(cluster["metrics"][1]) == 0, 60, "the worker to free the job's KV blocks")


def test_a_retry_under_the_same_idempotency_key_reads_the_job_with_its_own_stop_strings(cluster, pieces):
    """The stop strings are the door's reading of the job, as streaming is: a retry that sends others gets the
    same job's tokens cut at its own (the job ran on, uncancelled, under the key)."""
    early, late = spanning(pieces, 5), spanning(pieces, 20)
    headers = {"Idempotency-Key": "stop-another"}
    first = ask(cluster, body(early, False), headers)
    assert first[:3] == reference(pieces, [early])
    for stops, stream in (([late], True), ([late], False), (None, False)):
        assert ask(cluster, body(stops, stream), headers) == reference(pieces, stops or []) + (first[3],)


def test_a_chat_whose_stop_begins_its_answer(cluster):
    """The stop at the answer's first character: nothing but the role, then the finish, streamed; "" whole."""
    import openai

    client = openai.OpenAI(base_url=cluster["http"] + "/v1", api_key=key(cluster, "api-co"), max_retries=0)
    ask = dict(model="tiny-llama", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0,
               extra_body={"ignore_eos": True})
    ref = client.chat.completions.create(**ask).choices[0].message.content
    whole = client.chat.completions.create(**ask, stop=ref[0])
    assert (whole.choices[0].message.content, whole.choices[0].finish_reason) == ("", "stop")
    chunks = [c for c in client.chat.completions.create(**ask, stop=ref[0], stream=True)]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stop_scan_is_linear_in_the_tokens_fed_at_once(tiny_model_dir):
    """A retry under an Idempotency-Key of a finished job gets all its tokens in one chunk: scanning them must not
    cost the square of their number on the event loop (it did: 1.9 s for 131k tokens, 0.15 s for 32k)."""
    import random

    from transformers import AutoTokenizer

    from gateway.http.stops import StopScan

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rng = random.Random(0)
    ids = [rng.randrange(3, tokenizer.vocab_size) for _ in range(131072)]
    stops = ["\U0001F600" * 1000, "\u2603" * 1000]

    def cost(n: int) -> float:
        scan = StopScan(stops, tokenizer)
        t = time.process_time()
        scan.feed(ids[:n])
        return time.process_time() - t

    assert cost(131072) < 16 * cost(16384) + 0.05  # 8 times the tokens: 8 times the time, not 64


def test_a_stream_holding_its_text_back_still_sends_keep_alives(cluster):
    """Chunks that release no text (all of it may begin the stop string) send nothing: the door's keep-alives must
    still go out each sse_keepalive_s, or a proxy cuts the stream as idle (it was silent for the job's whole run)."""
    b = body("\U0001F600" * 1000, True, max_tokens=250)
    with httpx.stream("POST", cluster["http"] + "/v1/completions", json=b, timeout=120,
                      headers={"Authorization": f"Bearer {key(cluster, 'api-co')}"}) as r:
        assert r.status_code == 200, r.read()
        times, lines = [time.monotonic()], []
        for line in r.iter_lines():
            if line:
                times.append(time.monotonic())
                lines.append(line)
    events, done = sse(lines)
    assert done and len(events[0]["choices"][0]["text"]) < 999  # held back to its end
    assert ": keep-alive" in lines and max(b - a for a, b in zip(times, times[1:])) < 4 * KEEPALIVE_S



def test_a_stream_that_fails_sends_the_text_it_held_back_before_its_error(cluster, tiny_model_dir):
    """The job ends in an error (its tenant cancels it elsewhere, the worker frozen so that it cannot finish first)
    while the stream holds its text back for a stop string of 1000 characters: that text is the answer's as far as
    it went, and reaches the client before the error event, as every token's text does without stop strings. It
    was dropped: the client got the error alone."""
    from tokenizers.decoders import DecodeStream
    from transformers import AutoTokenizer

    with GatewayClient(cluster["gateway"], key(cluster, "api-co")) as sdk:
        tokens = sdk.submit(prompt_token_ids=PROMPT, max_tokens=1500, ignore_eos=True).result(timeout=120).token_ids
    backend = AutoTokenizer.from_pretrained(tiny_model_dir).backend_tokenizer
    decoder = DecodeStream(skip_special_tokens=True)
    so_far, texts = "", {""}  # the reference's text through each of its tokens
    for t in tokens:
        so_far += decoder.step(backend, t) or ""
        texts.add(so_far)
    worker = state_pids(cluster)["wk-0"]
    with httpx.stream("POST", cluster["http"] + "/v1/completions", json=body("\U0001F600" * 1000, True, 1500),
                      timeout=120, headers={"Authorization": f"Bearer {key(cluster, 'api-co')}"}) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        assert next(line for line in lines if line) == ": keep-alive"  # tokens come; their text is held
        with frozen(worker):
            with GatewayClient(cluster["gateway"], key(cluster, "api-co"), timeout_s=30) as sdk:
                assert sdk.cancel(r.headers["X-Request-Id"]) is True
            events, done = sse(list(lines))
    assert done and events[-1]["error"]["code"] == "job_cancelled", events[-1:]
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    assert text and text in texts, (text, events[:-1])
