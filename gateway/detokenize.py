"""Streamed text, decoded once per token: the cost of a stream is linear in its length.

Decoding the whole prefix again for every chunk (text = decode(all) - decode(before)) costs
O(n^2) for an n-token stream. ``IncrementalText`` feeds each token once to the tokenizers
library's ``DecodeStream`` (which keeps the few-token window byte-level and SentencePiece
decoders need) and records the text each token completed; any range of tokens then has its
text by joining pieces. A token that ends in the middle of a UTF-8 character completes no
text; the token that finishes the character carries it.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalText:
    def __init__(self, tokenizer) -> None:
        # The Rust tokenizer behind a transformers "fast" tokenizer (or a tokenizers.Tokenizer itself).
        self._backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        self._stream = DecodeStream(skip_special_tokens=True)
        self.pieces: list[str] = []  # text completed by token i
        self.tokens_decoded = 0  # every token fed to the decoder, counted (a test checks linearity)

    def extend(self, token_ids: list[int]) -> None:
        for t in token_ids:
            self.tokens_decoded += 1
            try:
                piece = self._stream.step(self._backend, t)
            except Exception:  # an id the tokenizer does not know: it completes no text (admission and the
                piece = None   # worker's sampler keep ids in the vocab; this only guards the stream)
            self.pieces.append(piece or "")

    def text(self, start: int, end: int | None = None) -> str:
        """Text completed by tokens [start, end)."""
        return "".join(self.pieces[start:end])
