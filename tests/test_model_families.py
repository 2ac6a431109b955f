"""Model families beyond Llama: the engine's greedy tokens equal transformers' generate(), or the model is refused
at load with a ConfigError that names what the paged engine cannot serve. Tiny random-weight models, float32."""

from __future__ import annotations

import json

import pytest

from scripts.make_tiny_model import build
from tests.engine_helpers import hf_greedy
from worker import ConfigError, Engine, EngineConfig, SamplingParams
from worker.model_checks import VERIFIED_MODEL_TYPES, check_model

# initializer_range 0.3 (not the default 0.02): with near-uniform attention a wrong rotary frequency or a missing
# soft-cap barely moves the logits, and a test that cannot see the bug would pass on it.
BASE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
            initializer_range=0.3)
NO_WINDOW = dict(sliding_window=None, use_sliding_window=False)  # windows: the "-windowed" ones, test_sliding_window
# Gemma 2/3 cannot leave sliding_window unset (generate's cache needs one): make every layer full instead.
FULL_LAYERS = dict(layer_types=["full_attention"] * 2)
MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
LONGROPE = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[4.0] * 8)

SUPPORTED = {
    "llama": dict(model_type="llama"),
    "llama-tied-bias": dict(model_type="llama", tie_word_embeddings=True, attention_bias=True, mlp_bias=True),
    "llama-head-dim-32": dict(model_type="llama", head_dim=32),
    "llama-rope-linear": dict(model_type="llama", rope_parameters=dict(rope_type="linear", factor=2.0,
                                                                       rope_theta=10000.0)),
    # Dynamic NTK only rescales past max_position_embeddings, which the engine never serves: the longest request
    # here ends exactly there (90 + 8 tokens).
    "llama-rope-dynamic": dict(model_type="llama", max_position_embeddings=98,
                               rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=10000.0)),
    "llama-rope-llama3": dict(model_type="llama", rope_parameters=dict(
        rope_type="llama3", factor=8.0, rope_theta=10000.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64)),
    "llama-rope-yarn": dict(model_type="llama", rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
                                                                     original_max_position_embeddings=64)),
    "mistral": dict(model_type="mistral", **NO_WINDOW),
    "mixtral": dict(model_type="mixtral", **NO_WINDOW, **MOE),
    "qwen2": dict(model_type="qwen2", **NO_WINDOW),
    "qwen2-moe": dict(model_type="qwen2_moe", **NO_WINDOW, **MOE, shared_expert_intermediate_size=32),
    "qwen3": dict(model_type="qwen3", **NO_WINDOW, head_dim=32),
    "qwen3-moe": dict(model_type="qwen3_moe", **NO_WINDOW, **MOE),
    "phi3": dict(model_type="phi3", **NO_WINDOW),
    # longrope that can never switch to its long factors inside the served context
    "phi3-longrope-short": dict(model_type="phi3", **NO_WINDOW, original_max_position_embeddings=256,
                                rope_parameters=dict(LONGROPE, original_max_position_embeddings=256)),
    "phi": dict(model_type="phi"),
    "olmo2": dict(model_type="olmo2"),
    "gemma": dict(model_type="gemma"),
    "gemma2-no-softcap": dict(model_type="gemma2", **FULL_LAYERS, attn_logit_softcapping=None),
    # A cap of 2 squashes these logits hard (every released Gemma2 caps at 50, which tiny models never reach), on a
    # windowed layer beside a full one.
    "gemma2-softcap-windowed": dict(model_type="gemma2", attn_logit_softcapping=2.0, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention"]),
    "gemma3-text": dict(model_type="gemma3_text", **FULL_LAYERS),
    # Windows of 8 tokens on prompts of up to 90: Gemma3's sliding layers (with their own RoPE base) beside a full
    # one; Phi-3's on every layer (Phi-3-mini's is 2047).
    "gemma3-text-windowed": dict(model_type="gemma3_text", sliding_window=8,
                                 layer_types=["sliding_attention", "full_attention"]),
    "phi3-windowed": dict(model_type="phi3", sliding_window=8),
    # Attention sinks (a logit per head in each softmax), on a windowed layer beside a full one, as released.
    "gpt-oss": dict(model_type="gpt_oss", **MOE, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
    "granite": dict(model_type="granite"),
    "cohere": dict(model_type="cohere"),
}

REFUSED = {
    "phi3-longrope": (dict(model_type="phi3", **NO_WINDOW, original_max_position_embeddings=64,
                           rope_parameters=dict(LONGROPE, original_max_position_embeddings=64)), "longrope"),
    "qwen3-next": (dict(model_type="qwen3_next"), "not attention"),
    "gemma3-bidirectional": (dict(model_type="gemma3_text", **FULL_LAYERS, use_bidirectional_attention=True),
                             "not causal"),
    "bloom-alibi": (dict(model_type="bloom", n_layer=2, n_head=4), "not verified"),
    "stablelm": (dict(model_type="stablelm"), "not verified"),
    "gpt2": (dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=256), "not verified"),
}

# Lengths chosen so one run has a first chunk, later chunks (budget 16), and decodes of different context lengths
# sharing a step, some in one masked group (17 and 22 tokens: both two blocks).
PROMPT_LENGTHS = (3, 40, 17, 22, 90)
NEW_TOKENS = 8


def model_dir(tmp_path, overrides: dict):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**BASE, **overrides}))
    return build(config, tmp_path / "model")


def engine_tokens(path) -> list[list[int]]:
    engine = Engine.from_pretrained(str(path), EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64,
                                                            max_num_batched_tokens=16))
    prompts = [[5 + (i * 37 + j * 11) % 500 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=NEW_TOKENS))
        out[f"r{i}"] = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return prompts, [out[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("family", SUPPORTED)
def test_family_matches_generate(tmp_path, family):
    from transformers import AutoModelForCausalLM

    path = model_dir(tmp_path, SUPPORTED[family])
    prompts, got = engine_tokens(path)
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    for p, tokens in zip(prompts, got):
        assert tokens == hf_greedy(reference, p, NEW_TOKENS), f"{family}: prompt of {len(p)} tokens"


@pytest.mark.parametrize("family", REFUSED)
def test_family_refused_at_load(tmp_path, family):
    overrides, feature = REFUSED[family]
    path = model_dir(tmp_path, overrides)
    with pytest.raises(ConfigError, match=feature) as refused:
        Engine.from_pretrained(str(path), EngineConfig(device="cpu", dtype="float32", num_kv_blocks=8))
    assert overrides["model_type"] in str(refused.value)


def test_dynamic_rope_that_could_grow_inside_the_context_is_refused(tmp_path):
    # No family in transformers starts its dynamic cache below max_position_embeddings today; one that did would
    # pick its frequencies from the longest sequence in a packed step, so the guard must hold.
    from transformers import AutoModelForCausalLM

    path = model_dir(tmp_path, SUPPORTED["llama-rope-dynamic"])
    model = AutoModelForCausalLM.from_pretrained(path)
    check_model(model)
    model.model.rotary_emb.max_seq_len_cached = 32
    with pytest.raises(ConfigError, match="dynamic"):
        check_model(model)


def test_every_verified_model_type_is_tested_here():
    assert VERIFIED_MODEL_TYPES == {c["model_type"] for c in SUPPORTED.values()}


def test_longrope_is_served_within_its_original_context(tmp_path):
    """The longrope model refused above loads with max_model_len at its original context, where no sequence ever
    switches to the long factors, and its tokens are generate()'s."""
    from transformers import AutoModelForCausalLM

    overrides, _ = REFUSED["phi3-longrope"]
    path = model_dir(tmp_path, overrides)
    engine = Engine.from_pretrained(str(path), EngineConfig(device="cpu", dtype="float32", num_kv_blocks=64,
                                                            max_num_batched_tokens=16, max_model_len=64))
    prompts = [[5 + (i * 37 + j * 11) % 500 for j in range(n)] for i, n in enumerate((3, 17, 40, 55))]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=64 - len(p)))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    for i, p in enumerate(prompts):
        assert out[f"r{i}"] == hf_greedy(reference, p, 64 - len(p))[:len(out[f"r{i}"])], f"prompt of {len(p)}"
        assert len(out[f"r{i}"]) == 64 - len(p) or out[f"r{i}"][-1] in engine.runner.info.eos_token_ids
    with pytest.raises(ConfigError, match="max_model_len to 64 or less"):
        Engine.from_pretrained(str(path), EngineConfig(device="cpu", dtype="float32", num_kv_blocks=8,
                                                       max_model_len=65))


def test_a_worker_given_a_model_it_cannot_serve_says_why_and_exits_2(tmp_path):
    """Before any gateway hears of it (a worker that says hello and then dies costs its jobs an attempt each)."""
    import subprocess
    import sys
    from pathlib import Path

    overrides, _ = REFUSED["gpt2"]
    path = model_dir(tmp_path, overrides)
    done = subprocess.run([sys.executable, "-m", "worker", "--model", str(path), "--gateway", "tcp://127.0.0.1:9",
                           "--metrics-bind", "127.0.0.1:0"], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "cannot serve model type 'gpt2'" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
