"""vLLM's ``stop_token_ids``, ``min_tokens`` and penalties, end to end. The engine took stop token ids, but
nothing above it could ask for them: the HTTP door refused them, min_tokens and every non-zero penalty with a 400,
and the SDK had no such arguments, so a chat model whose turn ends with an id its generation config does not call
EOS ran to max_tokens. min_tokens and the penalties are new in the sampler (worker/logit_extras.py).

Real parts: the tiny model's engine and sampler in this process; a local cluster (scripts/up.py) with the HTTP
door, the SDK, httpx and the official openai client."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from common.errors import InvalidRequest
from common.tiers import Tier
from gateway.sdk import GatewayClient
from tests.cluster_helpers import job_ids, local_cluster
from tests.test_penalties import CASES, hf  # noqa: F401 (hf: a fixture)
from tests.test_penalties import NEW as PEN_NEW
from tests.test_penalties import PROMPT as PEN_PROMPT
from tests.test_penalties import reference as penalised_reference
from worker import Engine, EngineConfig, FinishReason, SamplingParams
from worker.request import Request
from worker.sampler import Sampler

PROMPT = [5, 9, 33, 71, 2, 14, 150, 8]
VOCAB = 512  # models/configs/tiny-llama.json


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.from_pretrained(str(tiny_model_dir), EngineConfig(device="cpu", dtype="float32", max_num_seqs=8))


def run(engine: Engine, params: SamplingParams, prompt=PROMPT, resumed=None) -> tuple[list[int], FinishReason]:
    engine.add_request("r", prompt, params, output_token_ids=resumed or [])
    tokens, reason = [], None
    while engine.has_unfinished():
        for o in engine.step():
            tokens += o.new_token_ids
            reason = o.finish_reason if o.finished else reason
    return (list(resumed or []) + tokens), reason


def first_repeat(tokens: list[int]) -> int:
    """The index of the first token that occurred before: a stop id there ends a run earlier than its own index."""
    return next(i for i, t in enumerate(tokens) if t in tokens[:i])


def test_a_stop_id_ends_the_request_and_min_tokens_holds_it_back(engine):
    greedy, reason = run(engine, SamplingParams(max_tokens=40, ignore_eos=True))
    assert reason is FinishReason.LENGTH
    k = 6
    stop = greedy[k]
    cut = greedy.index(stop)  # its first occurrence
    tokens, reason = run(engine, SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(stop,)))
    assert (tokens, reason) == (greedy[:cut + 1], FinishReason.STOP)

    # min_tokens past the stop's first place: the id is never drawn before it, greedy or sampled, and the run
    # ends at the first one drawn from there on (or at max_tokens).
    for params in (SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(stop,), min_tokens=cut + 3),
                   SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(stop,), min_tokens=cut + 3,
                                  temperature=1.0, seed=11)):
        tokens, reason = run(engine, params)
        assert stop not in tokens[:cut + 3], tokens
        assert tokens[:cut] == greedy[:cut] or params.temperature > 0  # held back only from the min on
        if reason is FinishReason.STOP:
            assert tokens[-1] == stop and tokens.index(stop) == len(tokens) - 1
        else:
            assert reason is FinishReason.LENGTH and len(tokens) == 40 and stop not in tokens


def test_min_tokens_holds_back_many_stop_ids_and_eos(engine):
    """Every one of 128 ids (the most a request may give) is held back, on a sampled row beside a greedy one."""
    greedy, _ = run(engine, SamplingParams(max_tokens=30, ignore_eos=True))
    stops = tuple(sorted(set(greedy) | set(range(3, 3 + 128)))[:128])
    tokens, reason = run(engine, SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=stops,
                                                 min_tokens=20, temperature=1.0, seed=5))
    assert not set(tokens[:20]) & set(stops), tokens
    assert reason is FinishReason.LENGTH or tokens[-1] in stops


def test_the_sampler_never_draws_eos_before_min_tokens():
    """EOS as the one likely token: drawn at once without min_tokens, never before it with (unless ignore_eos asks
    that EOS not end the request: then it is an ordinary token)."""
    eos = 7
    sampler = Sampler(torch.device("cpu"), (eos,))
    logits = torch.full((4, 32), -5.0)
    logits[:, eos] = 10.0

    def request(i, min_tokens, temperature=0.0, ignore_eos=False, made=0):
        r = Request(f"r{i}", [1, 2], SamplingParams(max_tokens=8, min_tokens=min_tokens, temperature=temperature,
                                                    ignore_eos=ignore_eos), Tier.P3, arrival_seq=i, seed=i)
        r.output_token_ids.extend([3] * made)
        return r

    rows = [request(0, 0), request(1, 3), request(2, 3, temperature=1.0), request(3, 3, made=3)]
    picked = sampler.sample(logits, rows)
    assert picked[0] == eos and picked[1] != eos and picked[2] != eos and picked[3] == eos, picked
    assert sampler.sample(logits[:1], [request(4, 3, ignore_eos=True)]) == [eos]
    assert logits[:, eos].eq(10.0).all()  # the caller's logits untouched


@pytest.mark.parametrize("params, field", [
    (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
    (SamplingParams(max_tokens=4, min_tokens=-1), "min_tokens"),
    (SamplingParams(max_tokens=4, min_tokens=True), "min_tokens"),
    (SamplingParams(max_tokens=4, stop_token_ids=tuple(range(129))), "stop_token_ids"),
    (SamplingParams(max_tokens=4, stop_token_ids=(True,)), "stop_token_ids"),
])
def test_bad_values_are_refused_and_change_nothing(engine, params, field):
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("bad", PROMPT, params)
    assert e.value.field == field
    assert not engine.has_unfinished()


# -- through the cluster ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with local_cluster(tmp_path_factory.mktemp("stop-ids"), tiny_model_dir, workers=1, max_running=4) as c:
        yield c


def key(c, tenant="api-co") -> str:
    return c["tenants"][tenant]["api_key"]


def test_the_sdk_and_the_http_door_end_a_job_at_a_stop_id(cluster, engine, tiny_model_dir):
    from transformers import AutoTokenizer

    greedy, _ = run(engine, SamplingParams(max_tokens=24, ignore_eos=True))
    stop = greedy[first_repeat(greedy)] if len(set(greedy)) < len(greedy) else greedy[5]
    cut = greedy.index(stop)
    with GatewayClient(cluster["gateway"], key(cluster)) as sdk:
        result = sdk.submit(prompt_token_ids=PROMPT, max_tokens=24, ignore_eos=True,
                            stop_token_ids=[stop]).result(timeout=120)
        assert result.token_ids == greedy[:cut + 1] and result.finish_reason == "stop"
        held = sdk.submit(prompt_token_ids=PROMPT, max_tokens=24, ignore_eos=True, stop_token_ids=[stop],
                          min_tokens=cut + 2).result(timeout=120)
        assert stop not in held.token_ids[:cut + 2] and held.token_ids[:cut] == greedy[:cut]

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    auth = {"Authorization": f"Bearer {key(cluster)}"}
    body = {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, "stop_token_ids": [stop], "temperature": 0}
    whole = httpx.post(cluster["http"] + "/v1/completions", json=body, headers=auth, timeout=120).json()
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "stop" and whole["usage"]["completion_tokens"] == cut + 1, whole
    # The stop token's text is not the answer's (vLLM's), unless include_stop_str_in_output.
    assert choice["text"] == tok.decode(greedy[:cut], skip_special_tokens=True), choice
    with_it = httpx.post(cluster["http"] + "/v1/completions", json=body | {"include_stop_str_in_output": True},
                         headers=auth, timeout=120).json()["choices"][0]["text"]
    assert with_it == tok.decode(greedy[:cut + 1], skip_special_tokens=True)

    client = openai.OpenAI(base_url=cluster["http"] + "/v1", api_key=key(cluster), max_retries=0)
    streamed, finish = "", None
    for chunk in client.completions.create(model=cluster_model(cluster), prompt=PROMPT, max_tokens=24, stream=True,
                                           temperature=0, extra_body={"ignore_eos": True, "stop_token_ids": [stop],
                                                                      "min_tokens": 0}):
        streamed += chunk.choices[0].text
        finish = chunk.choices[0].finish_reason or finish
    assert (streamed, finish) == (choice["text"], "stop")


def cluster_model(c) -> str:
    return httpx.get(c["http"] + "/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.mark.parametrize("extra, param", [
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(129))}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"min_tokens": 9}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.0}, "min_tokens"),
])
def test_bad_stop_ids_and_min_tokens_are_a_400_and_store_nothing(cluster, extra, param):
    before = job_ids(cluster)
    r = httpx.post(cluster["http"] + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8} | extra,
                   headers={"Authorization": f"Bearer {key(cluster)}"}, timeout=60)
    # A wrong-typed element is named by its place ("stop_token_ids.0"), as a message's field is.
    assert r.status_code == 400 and r.json()["error"]["param"].split(".")[0] == param, r.text
    assert job_ids(cluster) == before


@pytest.mark.parametrize("kwargs, field", [
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"), ({"stop_token_ids": ["5"]}, "stop_token_ids"),
    ({"stop_token_ids": list(range(129))}, "stop_token_ids"), ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"min_tokens": 9}, "min_tokens"), ({"min_tokens": 2**64}, "min_tokens"),
])
def test_the_sdk_refuses_them_typed(cluster, kwargs, field):
    before = job_ids(cluster)
    with GatewayClient(cluster["gateway"], key(cluster)) as sdk, pytest.raises(InvalidRequest) as e:
        sdk.submit(prompt_token_ids=PROMPT, max_tokens=8, **kwargs)
    assert e.value.field == field, e.value
    assert job_ids(cluster) == before


def test_an_idempotency_key_tells_stop_ids_apart(cluster):
    with GatewayClient(cluster["gateway"], key(cluster)) as sdk:
        first = sdk.submit(prompt_token_ids=PROMPT, max_tokens=4, stop_token_ids=[9], idempotency_key="stops-1")
        again = sdk.submit(prompt_token_ids=PROMPT, max_tokens=4, stop_token_ids=[9], idempotency_key="stops-1")
        assert again.id == first.id and again.duplicate
        with pytest.raises(InvalidRequest) as e:
            sdk.submit(prompt_token_ids=PROMPT, max_tokens=4, stop_token_ids=[10], idempotency_key="stops-1")
        assert e.value.field == "idempotency_key", e.value
        plain = sdk.submit(prompt_token_ids=PROMPT, max_tokens=4, idempotency_key="stops-2")
        with pytest.raises(InvalidRequest) as e:
            sdk.submit(prompt_token_ids=PROMPT, max_tokens=4, min_tokens=2, idempotency_key="stops-2")
        assert e.value.field == "idempotency_key", e.value
        assert plain.result(timeout=120).token_ids


def test_min_tokens_lets_a_stop_string_count_only_from_its_token_on(tiny_model_dir):
    """vLLM checks stop strings only once min_tokens are out: one that ends in the text of an earlier token does not
    end the answer; the next that ends at or after it does."""
    from transformers import AutoTokenizer

    from gateway.http.stops import StopScan

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok("north wind, south wind, east wind", add_special_tokens=False).input_ids
    plain = StopScan(["wind"], tok)
    assert plain.feed(ids) == "north " and plain.stopped
    first = plain.tokens  # the token that completed the first "wind"
    for min_tokens in (first + 1, len(ids)):
        held = StopScan(["wind"], tok, min_tokens=min_tokens)
        text = held.feed(ids) + ("" if held.stopped else held.flush())
        if min_tokens == len(ids):  # only the last token's "wind" may count: it ends there
            assert held.stopped and text == "north wind, south wind, east ", text
        else:
            assert held.stopped and text == "north wind, south ", text
    # A stop token id's text is left out of the answer, and still counted (the worker ends the job at the first
    # one drawn: it is the last token).
    end = next(t for t in range(100, 512)
               if t not in ids and tok.decode([t]).strip() and "\ufffd" not in tok.decode([t]))
    cut = StopScan([], tok, stop_token_ids=[end])
    assert cut.feed(ids + [end]) + cut.flush() == tok.decode(ids) and cut.tokens == len(ids) + 1
    kept = StopScan([], tok, include=True, stop_token_ids=[end])
    assert kept.feed(ids + [end]) + kept.flush() == tok.decode(ids + [end])


def test_a_worker_too_old_for_them_makes_the_gateway_refuse_them(tmp_path):
    """An earlier worker drops a dispatch carrying fields it does not know (a malformed frame), and the job waited
    out its leases: while one is registered, a job asking for them is refused at admission, naming the field."""
    import uuid

    import zmq

    from common import protocol as P
    from common.redis_server import RedisServer
    from common.sockets import make_socket
    from tests.test_tokenizer_match import _Gateway

    with RedisServer() as redis_server:
        gw = _Gateway(tmp_path, "gw-stops", redis_server.url, f"stops-{uuid.uuid4().hex[:8]}").started()
        old = make_socket(zmq.Context.instance(), zmq.DEALER, identity=b"wk-old")
        old.setsockopt(zmq.LINGER, 0)
        old.connect(gw.workers)
        try:
            old.send(P.encode(P.WorkerHello("wk-old", "m", VOCAB, 2048, 4, 512)))  # says no `stops`
            assert old.poll(20_000) and isinstance(P.decode(old.recv()), P.GatewayWelcome)
            with GatewayClient(gw.clients, gw.tenants["api-co"]["api_key"]) as sdk:
                for kwargs, field in (({"stop_token_ids": [3]}, "stop_token_ids"), ({"min_tokens": 1}, "min_tokens")):
                    with pytest.raises(InvalidRequest) as e:
                        sdk.submit(prompt_token_ids=PROMPT, max_tokens=4, **kwargs)
                    assert e.value.field == field and "upgrade" in str(e.value), e.value
                assert sdk.submit(prompt_token_ids=PROMPT, max_tokens=4).id  # the rest is served as before
        finally:
            old.close()
            gw.stop()


# -- penalties through the cluster (their engine-level checks: tests/test_penalties.py) ------------------------


def test_the_sdk_the_door_and_the_openai_client_apply_penalties(cluster, hf):
    want = penalised_reference(hf, PEN_PROMPT, **CASES["all"])
    with GatewayClient(cluster["gateway"], key(cluster)) as sdk:
        got = sdk.submit(prompt_token_ids=PEN_PROMPT, max_tokens=PEN_NEW, ignore_eos=True, presence_penalty=0.4,
                         frequency_penalty=0.6, repetition_penalty=1.3).result(timeout=120)
        assert got.token_ids == want
    body = {"prompt": PEN_PROMPT, "max_tokens": PEN_NEW, "ignore_eos": True, "temperature": 0,
            "presence_penalty": 0.4, "frequency_penalty": 0.6, "repetition_penalty": 1.3}
    r = httpx.post(cluster["http"] + "/v1/completions", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {key(cluster)}"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == PEN_NEW, r.text
    client = openai.OpenAI(base_url=cluster["http"] + "/v1", api_key=key(cluster), max_retries=0)
    model = client.models.list().data[0].id
    text = client.completions.create(model=model, prompt=PEN_PROMPT, max_tokens=PEN_NEW, temperature=0,
                                     presence_penalty=0.4, frequency_penalty=0.6,
                                     extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
    assert text.choices[0].text == r.json()["choices"][0]["text"]
    # The idempotency fingerprint tells penalties apart.
    with GatewayClient(cluster["gateway"], key(cluster)) as sdk:
        sdk.submit(prompt_token_ids=PEN_PROMPT, max_tokens=2, presence_penalty=0.5, idempotency_key="pen-1")
        with pytest.raises(InvalidRequest) as e:
            sdk.submit(prompt_token_ids=PEN_PROMPT, max_tokens=2, presence_penalty=0.6, idempotency_key="pen-1")
        assert e.value.field == "idempotency_key"


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("repetition_penalty", 2.01),
    ("presence_penalty", True), ("frequency_penalty", "0.5"),
])
def test_bad_penalties_are_a_400_and_store_nothing(cluster, field, value):
    before = job_ids(cluster)
    r = httpx.post(cluster["http"] + "/v1/completions", json={"prompt": PEN_PROMPT, "max_tokens": 4, field: value},
                   headers={"Authorization": f"Bearer {key(cluster)}"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    with GatewayClient(cluster["gateway"], key(cluster)) as sdk, pytest.raises(InvalidRequest) as e:
        sdk.submit(prompt_token_ids=PEN_PROMPT, max_tokens=4, **{field: value})
    assert e.value.field == field
    assert job_ids(cluster) == before
