"""A step's logits changed for the requests that ask for vLLM's sampling extras, before any pick (greedy too):

- penalties, as vLLM applies them: the repetition penalty divides the positive logit of each token of the prompt or
  output and multiplies the negative one; then each output token loses ``frequency_penalty`` x its count and,
  once, ``presence_penalty``;
- ``min_tokens``: a request short of it cannot draw a token that would end it (its stop ids; EOS unless it ignores
  EOS): those logits are -inf.

Only the tokens a request has seen are touched (flat indices into the batch's logits), so a step costs what those
requests' prompts and outputs hold, not what the vocabulary does; a batch that asks for none costs one scan of its
requests' parameters.
"""

from __future__ import annotations

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


def _keys(rows: list[tuple[int, list[int]]], vocab: int) -> torch.Tensor:
    """Flat indices (row * vocab + token) of each row's tokens."""
    parts = [torch.tensor(tokens, dtype=torch.int64) + i * vocab for i, tokens in rows if tokens]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)


def _penalise_(flat: torch.Tensor, rows: list[tuple[int, Request]], batch: int, vocab: int, dev) -> None:
    per_row = torch.zeros(3, batch, dtype=torch.float32)  # repetition, frequency, presence: by batch row
    per_row[0] = 1.0
    for i, r in rows:
        per_row[:, i] = torch.tensor([r.params.repetition_penalty, r.params.frequency_penalty,
                                      r.params.presence_penalty])
    per_row = per_row.to(dev)
    repeating = [(i, r) for i, r in rows if r.params.repetition_penalty != 1.0]
    if repeating:
        seen = torch.unique(_keys([(i, r.prompt_token_ids) for i, r in repeating]
                                  + [(i, r.output_token_ids) for i, r in repeating], vocab)).to(dev)
        values, rep = flat[seen], per_row[0][seen // vocab]
        flat[seen] = torch.where(values > 0, values / rep, values * rep)
    keys, counts = torch.unique(_keys([(i, r.output_token_ids) for i, r in rows], vocab), return_counts=True)
    if keys.numel():
        keys, counts = keys.to(dev), counts.to(dev)
        row = keys // vocab
        flat[keys] -= per_row[1][row] * counts + per_row[2][row]
