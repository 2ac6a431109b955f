"""One string that names what a tokenizer does, so a gateway can tell that its workers' model speaks its tokens.

The gateway turns text into token ids with its own tokenizer and the ids back into text; the workers only see ids.
A gateway started with another model's tokenizer (or a worker serving another model) ran every text job to
completion with tokens the model never learnt, and returned fluent-looking nonsense marked ``done``. A worker says
the digest of its model directory's tokenizer in its hello, and the gateway refuses one that differs from its own.

The digest covers the whole tokenizer as the ``tokenizers`` library serialises it (vocabulary, merges,
normaliser, pre-tokeniser, special tokens, post-processor, decoder), with its keys sorted, so two copies of one
tokenizer in different directories agree and a tokenizer that encodes one string differently does not. Truncation
and padding are left out: they are call-time settings, not what the ids mean.
"""

from __future__ import annotations

import hashlib
import json
import logging

log = logging.getLogger(__name__)

PREFIX = "sha256:"


def digest(tokenizer) -> str:
    """The digest of a loaded ``transformers`` tokenizer (fast or slow) or of a bare ``tokenizers.Tokenizer``."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or (tokenizer if hasattr(tokenizer, "to_str") else None)
    if backend is not None:
        body = json.loads(backend.to_str())
        body.pop("truncation", None)
        body.pop("padding", None)
    else:  # a slow tokenizer with no fast counterpart: what each id means is all there is to compare
        body = {"vocab": sorted(tokenizer.get_vocab().items())}
    text = json.dumps(body, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return PREFIX + hashlib.sha256(text.encode()).hexdigest()


def of_model(model: str) -> str | None:
    """The digest of the tokenizer saved with ``model`` (a directory or hub name), or None where it has none (the
    gateway can then not check this worker, and says so)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError, KeyError) as e:
        log.warning("no tokenizer with model %s (%s): gateways cannot check that it matches theirs", model, e)
        return None
    return digest(tokenizer)
