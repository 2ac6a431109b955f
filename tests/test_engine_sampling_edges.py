"""Sampling parameters at the edges of their ranges, through the real engine over the tiny model."""

from __future__ import annotations

import pytest

from worker import Engine, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.from_pretrained(str(tiny_model_dir), EngineConfig(max_num_seqs=4, num_kv_blocks=64))


def run(engine: Engine, params: dict[str, SamplingParams], prompt: list[int]) -> dict[str, list[int]]:
    out = {rid: [] for rid in params}
    for rid, p in params.items():
        engine.add_request(rid, prompt, p)
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    assert engine.kv_usage().num_used == 0
    return out


@pytest.mark.parametrize("top_p", [1e-46, 1e-60, 5e-324])
def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(engine, top_p):
    """top_p is any float in (0, 1] (the gateway and the HTTP door accept these). One that rounds to 0.0 in float32
    made every token's preceding mass (0 for the first) reach it, so top-p masked every token: softmax of all -inf
    is NaN and the draw was token 0 at every step, whatever the model said. The smallest nucleus is the most
    likely token, as for any top_p below its probability."""
    prompt = [5, 9, 300, 41, 7, 77, 12]
    common = dict(max_tokens=12, ignore_eos=True, seed=7)
    out = run(engine, {"greedy": SamplingParams(**common),
                       "tiny": SamplingParams(temperature=1.0, top_p=top_p, **common),
                       "small": SamplingParams(temperature=1.0, top_p=1e-6, **common)}, prompt)
    assert out["tiny"] == out["greedy"] == out["small"]
    assert out["greedy"] != [0] * 12
