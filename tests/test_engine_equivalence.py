"""The engine's greedy output is token-identical to transformers' generate()."""

from __future__ import annotations

import pytest

from tests.engine_helpers import hf_greedy, prompts
from worker import Engine, EngineConfig, SamplingParams


def run_all(engine: Engine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]]) -> dict[str, list[int]]:
    """Step the engine to completion, adding arrivals[k] before step k."""
    outputs: dict[str, list[int]] = {}
    finished: set[str] = set()
    step = 0
    while engine.has_unfinished() or any(k >= step for k in arrivals):
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
            outputs[rid] = []
        for out in engine.step():
            assert out.request_id not in finished
            outputs[out.request_id].extend(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)
        step += 1
        assert step < 10_000
    assert finished == set(outputs)
    return outputs


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.from_pretrained(tiny_model_dir, EngineConfig(num_kv_blocks=256, max_num_batched_tokens=64))


@pytest.mark.parametrize("length", [1, 5, 16, 17, 63])
def test_single_request_matches_generate(engine, hf_reference, length):
    prompt = prompts(1, seed=length, lo=length, hi=length + 1)[0]
    out = run_all(engine, {0: [("solo", prompt, SamplingParams(max_tokens=24))]})
    assert out["solo"] == hf_greedy(hf_reference, prompt, 24)
    assert engine.kv_usage().num_used == 0


def test_eight_requests_joining_at_different_steps(engine, hf_reference):
    ps = prompts(8, seed=1)
    arrivals: dict[int, list] = {}
    for i, (step, p) in enumerate(zip([0, 0, 1, 3, 4, 7, 9, 15], ps)):
        arrivals.setdefault(step, []).append((f"r{i}", p, SamplingParams(max_tokens=20 + i)))
    out = run_all(engine, arrivals)
    for i, p in enumerate(ps):
        assert out[f"r{i}"] == hf_greedy(hf_reference, p, 20 + i), f"request r{i} (prompt {len(p)} tokens)"


@pytest.mark.parametrize("budget", [7, 16, 1024])
def test_chunked_prefill_gives_the_same_tokens(tiny_model_dir, hf_reference, budget):
    ps = prompts(4, seed=2, lo=40, hi=120)
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(num_kv_blocks=128, max_num_batched_tokens=budget))
    out = run_all(engine, {0: [(f"r{i}", p, SamplingParams(max_tokens=12)) for i, p in enumerate(ps)]})
    for i, p in enumerate(ps):
        assert out[f"r{i}"] == hf_greedy(hf_reference, p, 12)


def test_unchunked_prefill_matches_chunked(tiny_model_dir):
    ps = prompts(6, seed=3, lo=20, hi=90)
    results = []
    for chunked in (False, True):
        engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(
            num_kv_blocks=128, max_num_batched_tokens=128 if not chunked else 10, enable_chunked_prefill=chunked,
            max_model_len=128))
        results.append(run_all(engine, {0: [(f"r{i}", p, SamplingParams(max_tokens=10)) for i, p in enumerate(ps)]}))
    assert results[0] == results[1]


@pytest.mark.parametrize("swap_space_mb,mode", [(0, "recompute"), (64, "swap")])
def test_kv_pressure_preempts_and_still_matches(tiny_model_dir, hf_reference, swap_space_mb, mode):
    # 12 blocks of 16 tokens cannot hold four 50-token prompts growing to 80 tokens at once:
    # the scheduler must push requests back (recompute, or swap when there is host room)
    # and the output must not change.
    ps = prompts(4, seed=4, lo=40, hi=50)
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(num_kv_blocks=12, max_num_batched_tokens=64,
                                                                 swap_space_mb=swap_space_mb))
    out = run_all(engine, {0: [(f"r{i}", p, SamplingParams(max_tokens=30)) for i, p in enumerate(ps)]})
    for i, p in enumerate(ps):
        assert out[f"r{i}"] == hf_greedy(hf_reference, p, 30)
    assert engine.stats().by_mode()[mode] > 0
    assert engine.kv_usage().num_used == 0
