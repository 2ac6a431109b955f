"""Refuse, at load, models the paged engine would serve wrongly.

The engine runs every scheduled token of every sequence as one packed row through the model's own modules, with
attention replaced by ``paged_attention_forward``. That is only exact when attention is plain causal softmax
attention over K/V computed per token, and nothing else in the model mixes tokens or depends on the batch. Model
types outside ``VERIFIED_MODEL_TYPES`` have not been compared with transformers' ``generate`` and are refused:
several load fine and then crash mid-step (StableLM, GPT-2, GPT-NeoX) or return other tokens (BLOOM's ALiBi).
"""

from __future__ import annotations

from worker.config import ConfigError

# Each has a greedy-equivalence test in tests/test_model_families.py; add a type here only with one.
VERIFIED_MODEL_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "phi",
                        "olmo2", "gemma", "gemma2", "gemma3_text", "granite", "cohere", "gpt_oss"}
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}


def check_model(model, max_model_len: int | None = None) -> None:
    """Raise ConfigError naming the first feature of ``model`` the engine would serve wrongly within the context
    it serves (``max_model_len``; the model's whole context by default)."""
    cfg = model.config.get_text_config()
    name = model.config.model_type
    layer_types = set(getattr(cfg, "layer_types", None) or ()) - _ATTENTION_LAYER_TYPES
    if layer_types:
        _refuse(name, f"layers that are not attention ({', '.join(sorted(layer_types))}) would carry their state "
                      f"across all sequences packed into one step; only all-attention models are served")
    for module in model.modules():
        if getattr(module, "is_causal", True) is False:
            _refuse(name, f"{type(module).__name__} is not causal (an encoder / embedding model); the paged "
                          f"attention is causal")
        if hasattr(module, "rope_type"):
            _check_rope(name, cfg, module, max_model_len or cfg.max_position_embeddings)
    if name not in VERIFIED_MODEL_TYPES:
        _refuse(name, f"it is not verified against transformers' generate with the paged engine (verified: "
                      f"{', '.join(sorted(VERIFIED_MODEL_TYPES))}); serve a verified type or add this one to "
                      f"worker/model_checks.py with a test in tests/test_model_families.py")


def _check_rope(name: str, cfg, rotary, limit: int) -> None:
    """RoPE whose frequencies change with the longest position in a forward pass: in a packed step that is the
    longest sequence in the batch (and a prefill chunk's end, not the prompt's), never what generate() used.
    Served only where no sequence reaches the change (``limit``, the context served)."""
    types = rotary.rope_type if isinstance(rotary.rope_type, dict) else {None: rotary.rope_type}
    for layer_type, rope_type in types.items():
        prefix = f"{layer_type}_" if layer_type else ""
        if "dynamic" in rope_type:
            cached = getattr(rotary, f"{prefix}max_seq_len_cached", getattr(rotary, "max_seq_len_cached", limit))
            if cached < limit:
                _refuse(name, f"dynamic RoPE rescales past {cached} positions, inside the context served "
                              f"({limit}), from the longest sequence in each step; set max_model_len to {cached} "
                              f"or less")
        elif rope_type == "longrope":
            params = cfg.rope_parameters[layer_type] if layer_type else cfg.rope_parameters
            original = params["original_max_position_embeddings"]
            if original < limit:
                _refuse(name, f"longrope switches every sequence in a step to its long factors once any one passes "
                              f"{original} positions (context served: {limit}); set max_model_len to {original} "
                              f"or less, or use the model's short-context variant")


def _refuse(name: str, why: str) -> None:
    raise ConfigError(f"cannot serve model type {name!r}: {why}")
