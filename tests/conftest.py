"""Shared fixtures: real model directories built by scripts/make_tiny_model.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.make_tiny_model import build

CONFIGS = Path(__file__).resolve().parent.parent / "models" / "configs"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random-weight Llama built from models/configs/tiny-llama.json, loadable with from_pretrained."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return build(CONFIGS / "tiny-llama.json", tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def hf_reference(tiny_model_dir):
    """The same weights through plain transformers (sdpa attention, DynamicCache): the ground truth."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
