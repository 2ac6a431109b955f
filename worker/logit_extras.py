"""A step's logits changed for the requests that ask for vLLM's sampling extras, before any pick (greedy too):

- penalties, as vLLM applies them: the repetition penalty divides the positive logit of each token of the prompt or
  output and multiplies the negative one; then each output token loses ``frequency_penalty`` x its count and,
  once, ``presence_penalty``;
- ``min_tokens``: a request short of it cannot draw a token that would end it (its stop ids; EOS unless it ignores
  EOS): those logits are -inf.

Only the tokens a request has seen are touched (flat indices into the batch's logits), so a step costs what those
requests' distinct tokens number, not what the vocabulary does; a batch that asks for none costs one scan of its
requests' parameters. What a penalised request has seen is kept between steps (``_Seen``): its prompt's distinct
tokens once, its output's counts as they grow, so a step adds its new tokens rather than counting all again.
"""

from __future__ import annotations

import weakref

import torch

from worker.request import Request


def wanted(requests: list[Request]) -> bool:
    return any(r.params.penalized or len(r.output_token_ids) < r.params.min_tokens for r in requests)


def apply_(logits: torch.Tensor, requests: list[Request], eos_token_ids: tuple[int, ...]) -> None:
    """Change ``logits`` ([len(requests), vocab], float32, contiguous: the caller's own copy) in place."""
    vocab = logits.shape[-1]
    flat = logits.view(-1)
    dev = logits.device
    penalised = [(i, r) for i, r in enumerate(requests) if r.params.penalized]
    if penalised:
        _penalise_(flat, penalised, len(requests), vocab, dev)
    held = [i * vocab + t for i, r in enumerate(requests) if len(r.output_token_ids) < r.params.min_tokens
            for t in sorted(r.params.ending_ids(eos_token_ids))]
    if held:
        flat[torch.tensor(held, dtype=torch.int64).to(dev)] = float("-inf")


class _Grown:
    """A 1-d tensor grown in place a value at a time (doubling its storage), so that a step adds what it drew
    without building the whole tensor again."""

    def __init__(self, values: list, dtype: torch.dtype) -> None:
        self._buf = torch.tensor(values + [0] * max(16, len(values)), dtype=dtype)
        self.n = len(values)

    def append(self, value) -> None:
        if self.n == len(self._buf):
            self._buf = torch.cat([self._buf, torch.zeros_like(self._buf)])
        self._buf[self.n] = value
        self.n += 1

    def add_at(self, i: int, value) -> None:
        self._buf[i] += value

    @property
    def values(self) -> torch.Tensor:
        return self._buf[:self.n]


class _Seen:
    """The tokens one penalised request has seen, kept up to date with its output: each step reads only the tokens
    added since the last, so its cost is what it drew, not its prompt and output (no list copied, no sort)."""

    def __init__(self, r: Request) -> None:
        self._repeats = r.params.repetition_penalty != 1.0
        prompt = list(dict.fromkeys(r.prompt_token_ids)) if self._repeats else []
        self._prompt = set(prompt)
        self.repeated = _Grown(prompt, torch.int64)  # distinct tokens of the prompt, then new ones of the output
        self.drawn = _Grown([], torch.int64)  # distinct output tokens
        self.counts = _Grown([], torch.float32)  # times each of ``drawn`` was drawn
        self._at: dict[int, int] = {}  # output token -> its place in ``drawn``
        self._read = 0

    def update(self, output: list[int]) -> None:
        if len(output) < self._read:  # never by the engine (an output only grows); counted again, to be safe
            self.drawn, self.counts, self._at, self._read = _Grown([], torch.int64), _Grown([], torch.float32), {}, 0
            self.repeated.n = len(self._prompt)
        for t in output[self._read:]:
            at = self._at.get(t)
            if at is not None:
                self.counts.add_at(at, 1.0)
                continue
            self._at[t] = self.drawn.n
            self.drawn.append(t)
            self.counts.append(1.0)
            if self._repeats and t not in self._prompt:
                self.repeated.append(t)
        self._read = len(output)


_seen: weakref.WeakKeyDictionary[Request, _Seen] = weakref.WeakKeyDictionary()  # goes with its request


def _seen_by(r: Request) -> _Seen:
    seen = _seen.get(r)
    if seen is None:
        seen = _seen[r] = _Seen(r)
    seen.update(r.output_token_ids)
    return seen


def _penalise_(flat: torch.Tensor, rows: list[tuple[int, Request]], batch: int, vocab: int, dev) -> None:
    table = [[1.0] * batch, [0.0] * batch, [0.0] * batch]  # repetition, frequency, presence: by batch row
    for i, r in rows:
        table[0][i], table[1][i], table[2][i] = (r.params.repetition_penalty, r.params.frequency_penalty,
                                                 r.params.presence_penalty)
    per_row = torch.tensor(table, dtype=torch.float32).to(dev)
    seen = [(i, r, _seen_by(r)) for i, r in rows]
    # Distinct within a row, and rows apart by their offsets: each index once, as the in-place updates need.
    repeating = [s.repeated.values + i * vocab for i, r, s in seen if r.params.repetition_penalty != 1.0]
    if repeating:
        keys = torch.cat(repeating).to(dev)
        values, rep = flat[keys], per_row[0][keys // vocab]
        flat[keys] = torch.where(values > 0, values / rep, values * rep)
    counted = [(i, s) for i, r, s in seen if s.drawn.n]
    if counted:
        keys = torch.cat([s.drawn.values + i * vocab for i, s in counted]).to(dev)
        counts = torch.cat([s.counts.values for _, s in counted]).to(dev)
        row = keys // vocab
        flat[keys] -= per_row[1][row] * counts + per_row[2][row]
