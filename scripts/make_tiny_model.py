"""Build a random-weight model directory from a configuration file.

The directory loads through the normal ``AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer.from_pretrained`` paths, so tests and benchmarks exercise
exactly what a real model directory would. Nothing is downloaded: weights come
from the config's ``init_seed`` and the tokenizer is a byte-level BPE trained
on a small corpus embedded below.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Keys in our configuration files that are notes for people, not model fields.
_NON_MODEL_KEYS = {"purpose", "init_seed", "peers_measured_on_a_2_core_dev_machine"}

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]

# A fixed corpus so the tokenizer's merges are the same on every machine.
_CORPUS = """\
A priority-tiered serving cluster admits jobs from many tenants into per-tier
queues and dispatches them to workers. Each worker runs a continuous batcher
over a paged key-value cache. Urgent interactive requests preempt batch work at
step boundaries; the batch work resumes later and produces the same tokens it
would have produced without interruption. The quick brown fox jumps over the
lazy dog. Hello, world! What is the weather like today? Summarise the following
document in three sentences. Translate this paragraph into French. Write a
Python function that returns the n-th Fibonacci number. 0123456789
"""


def build_tokenizer(vocab_size: int):
    """Byte-level BPE: every byte string is encodable, ids stay below vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines() * 4, trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} ids, model vocab is {vocab_size}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )


def build(config_path: Path, out_dir: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    raw = json.loads(config_path.read_text())
    seed = int(raw.get("init_seed", 0))
    vocab_size = int(raw["vocab_size"])
    tokenizer = build_tokenizer(vocab_size)
    fields = {k: v for k, v in raw.items() if k not in _NON_MODEL_KEYS}
    model_type = fields.pop("model_type")
    fields.pop("architectures", None)
    config = AutoConfig.for_model(
        model_type,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **fields,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


CONFIGS = Path(__file__).resolve().parent.parent / "models" / "configs"
MODELS = Path(__file__).resolve().parent.parent / ".models"


def ensure(config_name: str, out: Path | None = None) -> Path:
    """The model built from ``models/configs/<config_name>`` (into ``.models/<stem>`` by default),
    building it only when it is missing."""
    out = out or MODELS / Path(config_name).stem
    if not (out / "config.json").exists():
        build(CONFIGS / config_name, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path, help="model configuration JSON (models/configs/*.json)")
    parser.add_argument("--out", required=True, type=Path, help="directory to write the model into")
    args = parser.parse_args(argv)
    if not args.config.is_file():
        parser.error(f"config file not found: {args.config}")
    out = build(args.config, args.out)
    n = sum(1 for _ in out.iterdir())
    print(f"wrote {out} ({n} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
