"""OpenAI's presence and frequency penalties and vLLM's repetition penalty: the HTTP door refused them (a 400 for
any non-zero value, which common clients send) and the SDK had none. The reference here is independent of the
engine: the transformers model run on the whole sequence at each step, the penalties applied by their published
definitions in plain Python, and the greedy pick taken. Through a cluster (SDK, HTTP door, openai client):
tests/test_sampling_extras.py.

Real parts: the tiny model's engine in this process."""

from __future__ import annotations

import random

import pytest
import torch

from common.errors import InvalidRequest
from common.tiers import Tier
from worker import Engine, EngineConfig, SamplingParams, logit_extras
from worker.request import Request

PROMPT = [5, 9, 33, 71, 2, 14, 150, 8, 9, 33]
NEW = 16


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


# On CUDA too where there is one (scripts/gpu_check.sh, step 1): worker/logit_extras.py's flat-index updates must
# land on the device's logits, against the same host reference.
@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def engine(tiny_model_dir, request):
    return Engine.from_pretrained(str(tiny_model_dir), EngineConfig(device=request.param, dtype="float32",
                                                                    max_num_seqs=8))


@torch.inference_mode()
def reference(hf, prompt: list[int], presence=0.0, frequency=0.0, repetition=1.0, n=NEW) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        logits = hf(torch.tensor([prompt + out])).logits[0, -1].tolist()
        for t in set(prompt) | set(out):  # vLLM's repetition penalty: prompt and output tokens
            logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t in set(out):  # OpenAI's: output tokens, by count and once
            logits[t] -= frequency * out.count(t) + presence
        out.append(max(range(len(logits)), key=lambda i: (logits[i], -i)))
    return out


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


CASES = {
    "presence": dict(presence=1.5), "frequency": dict(frequency=0.8), "repetition": dict(repetition=1.6),
    "negative": dict(presence=-1.0, frequency=-0.5), "below-one": dict(repetition=0.5),
    "all": dict(presence=0.4, frequency=0.6, repetition=1.3),
}


def params_of(case: dict, **more) -> SamplingParams:
    return SamplingParams(max_tokens=NEW, ignore_eos=True, presence_penalty=case.get("presence", 0.0),
                          frequency_penalty=case.get("frequency", 0.0),
                          repetition_penalty=case.get("repetition", 1.0), **more)


def test_penalised_greedy_runs_match_the_definitions_batched_beside_others(engine, hf):
    plain = reference(hf, PROMPT)
    # All at once in one batch, beside an unpenalised greedy run and a sampled one: each row gets its own.
    requests = {name: (PROMPT, params_of(case)) for name, case in CASES.items()}
    requests["plain"] = (PROMPT, SamplingParams(max_tokens=NEW, ignore_eos=True))
    requests["sampled"] = (PROMPT[:4], SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=1.0, seed=3))
    got = run(engine, requests)
    assert got["plain"] == plain
    changed = 0
    for name, case in CASES.items():
        want = reference(hf, PROMPT, **case)
        assert got[name] == want, (name, got[name], want)
        changed += want != plain
    assert changed >= 4, "the penalties changed too few runs for the comparison to mean anything"


def test_a_sampled_penalised_run_is_repeatable_and_batch_independent(engine):
    params = params_of(CASES["all"], temperature=0.05, seed=21)  # near greedy: the random model is flat
    alone = run(engine, {"a": (PROMPT, params)})["a"]
    beside = run(engine, {"a": (PROMPT, params), "b": (PROMPT[:3], params_of(CASES["presence"])),
                          "c": (PROMPT[2:], SamplingParams(max_tokens=NEW, ignore_eos=True))})["a"]
    assert alone == beside
    assert alone != run(engine, {"a": (PROMPT, SamplingParams(max_tokens=NEW, ignore_eos=True, temperature=0.05,
                                                               seed=21))})["a"]


def test_a_resumed_penalised_run_counts_the_output_it_came_with(engine, hf):
    """A re-dispatched job goes on from its earlier attempts' tokens (``output_token_ids`` at its start): they count
    for the penalties from its first step here, as a run from the start counts them (the counts kept between steps
    must take every token they have not read, not one a step)."""
    for name in ("all", "frequency"):
        whole = reference(hf, PROMPT, **CASES[name])
        engine.add_request("resumed", PROMPT, params_of(CASES[name]), output_token_ids=whole[:NEW // 2])
        got = list(whole[:NEW // 2])
        while engine.has_unfinished():
            for o in engine.step():
                got += o.new_token_ids
        assert got == whole, (name, got, whole)


def test_counts_kept_between_steps_match_a_fresh_count_of_every_token():
    """worker/logit_extras.py keeps each penalised request's counts between steps and reads only the tokens added
    since: against the definitions counted afresh each step, on random logits of a small vocabulary (tokens repeat
    often, counts climb past 1), outputs growing by one token a step, by none, or by a burst (a resumed job's
    output, more distinct tokens than the kept tensors start with room for), rows joining and leaving the batch."""
    rng = random.Random(12)
    vocab = 60
    gen = torch.Generator().manual_seed(12)
    pool = []
    for i in range(10):
        pen = dict(presence=rng.choice([0.0, 0.7, -1.3]), frequency=rng.choice([0.0, 0.4, -0.9, 2.0]),
                   repetition=rng.choice([1.0, 1.5, 0.6, 2.0])) if i % 4 else {}
        r = Request(f"r{i}", [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))],
                    SamplingParams(max_tokens=10_000, presence_penalty=pen.get("presence", 0.0),
                                   frequency_penalty=pen.get("frequency", 0.0),
                                   repetition_penalty=pen.get("repetition", 1.0)), Tier.P3, arrival_seq=i, seed=i)
        r.output_token_ids.extend(rng.randrange(vocab) for _ in range(rng.choice([0, 0, 3, 70])))
        pool.append((r, pen))
    for step in range(80):
        batch = [p for p in pool if rng.random() < 0.8] or pool[:1]
        logits = torch.randn(len(batch), vocab, generator=gen)
        want = logits.tolist()
        for row, (r, pen) in zip(want, batch):
            out = r.output_token_ids
            for t in set(r.prompt_token_ids) | set(out):
                rep = pen.get("repetition", 1.0)
                row[t] = row[t] / rep if row[t] > 0 else row[t] * rep
            for t in set(out):
                row[t] -= pen.get("frequency", 0.0) * out.count(t) + pen.get("presence", 0.0)
        logit_extras.apply_(logits, [r for r, _ in batch], ())
        assert torch.allclose(logits, torch.tensor(want), rtol=1e-5, atol=1e-5), f"step {step}"
        for r, _ in batch:
            grow = rng.choice([1, 1, 1, 0, 25])
            r.output_token_ids.extend(rng.randrange(vocab) for _ in range(grow))


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("presence_penalty", float("nan")),
    ("repetition_penalty", 0.0), ("repetition_penalty", 2.5), ("frequency_penalty", float("inf")),
])
def test_out_of_range_penalties_are_refused(engine, field, value):
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("bad", PROMPT, SamplingParams(max_tokens=4, **{field: value}))
    assert e.value.field == field
    assert not engine.has_unfinished()
