"""Models whose attention sees only the last ``sliding_window`` keys (Mistral, Qwen2 with ``use_sliding_window``):
the engine's tokens equal transformers' own once a sequence outgrows the window, in every kind of step (a first
prefill, a later chunk, decodes of different lengths side by side), and on every layer the window applies to."""

from __future__ import annotations

import json

import pytest
import torch

from scripts.make_tiny_model import build
from tests.engine_helpers import hf_greedy, prompts
from tests.test_engine_equivalence import run_all
from worker import Engine, EngineConfig, SamplingParams

WINDOW = 8
BASE = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
        "tie_word_embeddings": False, "init_seed": 0}
CONFIGS = {
    "mistral": {"model_type": "mistral", "sliding_window": WINDOW},
    # Qwen2: the window on the layers past max_window_layers only, so a model mixes windowed and full layers.
    "qwen2-mixed": {"model_type": "qwen2", "sliding_window": WINDOW, "use_sliding_window": True,
                    "max_window_layers": 1},
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def windowed(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    root = tmp_path_factory.mktemp(request.param)
    (root / "config.json").write_text(json.dumps({**BASE, **CONFIGS[request.param]}))
    model_dir = build(root / "config.json", root / "model")
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    return model_dir, reference


def test_the_window_changes_what_the_reference_generates(windowed):
    """Without this the tests below could pass with the window ignored: the same weights with a window wider than
    every sequence give other tokens for prompts longer than the window."""
    from transformers import AutoModelForCausalLM

    model_dir, reference = windowed
    wide = AutoModelForCausalLM.from_pretrained(model_dir, sliding_window=4096).eval()
    differ = [p for p in prompts(6, seed=3, lo=20, hi=40) if hf_greedy(reference, p, 16) != hf_greedy(wide, p, 16)]
    assert len(differ) >= 4


@pytest.mark.parametrize("length", [3, WINDOW, WINDOW + 1, 37])
def test_one_sequence_matches_generate_past_the_window(windowed, length):
    model_dir, reference = windowed
    engine = Engine.from_pretrained(model_dir, EngineConfig(num_kv_blocks=128, block_size=4))
    prompt = prompts(1, seed=length, lo=length, hi=length + 1)[0]
    out = run_all(engine, {0: [("solo", prompt, SamplingParams(max_tokens=20))]})
    assert out["solo"] == hf_greedy(reference, prompt, 20)


@pytest.mark.parametrize("budget", [5, 64])
def test_sequences_of_every_length_side_by_side_match_generate(windowed, budget):
    """Chunked prefill (a 5-token budget splits every prompt past the window) with decodes of different context
    lengths in one step: each sees its own window."""
    model_dir, reference = windowed
    engine = Engine.from_pretrained(model_dir, EngineConfig(num_kv_blocks=256, block_size=4,
                                                            max_num_batched_tokens=budget))
    ps = prompts(6, seed=11, lo=1, hi=30)
    arrivals = {2 * i: [(f"r{i}", p, SamplingParams(max_tokens=18))] for i, p in enumerate(ps)}
    out = run_all(engine, arrivals)
    for i, p in enumerate(ps):
        assert out[f"r{i}"] == hf_greedy(reference, p, 18), f"r{i} ({len(p)} prompt tokens)"


def test_the_windowed_attention_agrees_with_eager_attention(windowed):
    """The reference's own two attentions agree for the window (the ground truth is not one path's bug)."""
    from transformers import AutoModelForCausalLM

    model_dir, reference = windowed
    eager = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    ids = torch.tensor([prompts(1, seed=5, lo=30, hi=31)[0]])
    with torch.inference_mode():
        assert torch.allclose(reference(ids).logits, eager(ids).logits, atol=1e-5)


@pytest.mark.parametrize("swap_space_mb,mode", [(0, "recompute"), (64, "swap")])
def test_sequences_pushed_back_under_kv_pressure_resume_within_their_window(windowed, swap_space_mb, mode):
    """A recomputed sequence prefills its context again in chunks past the window; a swapped one comes back with
    blocks behind it: either way its next tokens see the same window."""
    model_dir, reference = windowed
    ps = prompts(4, seed=4, lo=40, hi=50)
    engine = Engine.from_pretrained(model_dir, EngineConfig(num_kv_blocks=12, max_num_batched_tokens=64,
                                                            swap_space_mb=swap_space_mb))
    out = run_all(engine, {0: [(f"r{i}", p, SamplingParams(max_tokens=30)) for i, p in enumerate(ps)]})
    for i, p in enumerate(ps):
        assert out[f"r{i}"] == hf_greedy(reference, p, 30)
    assert engine.stats().by_mode()[mode] > 0
    assert engine.kv_usage().num_used == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (scripts/gpu_check.sh runs it on one)")
def test_windowed_attention_on_cuda_takes_no_math_kernel_and_matches_generate(windowed):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AutoModelForCausalLM

    model_dir, _ = windowed
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("cuda").eval()
    engine = Engine.from_pretrained(model_dir, EngineConfig(device="cuda", dtype="float32", num_kv_blocks=256,
                                                            block_size=4, max_num_batched_tokens=16))
    ps = prompts(8, seed=2, lo=1, hi=60)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out = run_all(engine, {i: [(f"r{i}", p, SamplingParams(max_tokens=20, ignore_eos=True))]
                               for i, p in enumerate(ps)})
    matching = 0
    for i, p in enumerate(ps):
        with torch.inference_mode():
            want = ref.generate(torch.tensor([p], device="cuda"), attention_mask=torch.ones(1, len(p), device="cuda"),
                                do_sample=False, max_new_tokens=20, eos_token_id=None)[0, len(p):].tolist()
        matching += out[f"r{i}"] == want
    assert matching >= 7, matching  # kernels sum in other orders: a near-tie on a random model may flip one
