"""Attention over the paged KV pool, plugged into transformers as a registered
attention implementation (``attn_implementation="paged_kv"``).

The model runs on a packed batch: all scheduled tokens of all sequences in one
row, each with its own position id. The HF attention module projects Q/K/V
and applies RoPE as usual, then calls ``paged_attention_forward``, which
writes this step's K/V into the pool at ``slot_mapping`` and attends each
sequence to its own blocks. Decodes (one query each) are batched in one SDPA
call; prefill chunks are attended one sequence at a time (their query lengths
differ too much to pad them together cheaply).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "paged_kv"


@dataclass
class PrefillSpan:
    q_start: int  # offset of the chunk's first query in the packed batch
    q_len: int
    # None when the chunk starts at position 0: its K/V are all in this step's tensors.
    block_ids: torch.Tensor | None  # [num_blocks] covering positions [0, ctx_len)
    ctx_len: int  # positions the chunk's last query sees (start + q_len)
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = may attend


@dataclass
class AttentionMetadata:
    """Everything one forward step's attention needs; shared by all layers."""

    kv_cache: list[tuple[torch.Tensor, torch.Tensor]]  # per layer K and V pools [blocks, block_size, kv_heads, dim]
    slot_mapping: torch.Tensor  # [T] flat pool slot of each packed token's new K/V
    decode_q_index: torch.Tensor | None  # [Bd] packed index of each decode query
    decode_block_ids: torch.Tensor | None  # [Bd, max_blocks] padded block tables
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, max_blocks * block_size] additive: 0 or -inf
    prefills: list[PrefillSpan]
    # Every packed token is a decode, in order: attention output needs no scatter.
    decode_only: bool = False


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            paged_metadata: AttentionMetadata | None = None, **kwargs):
    if paged_metadata is None:
        raise RuntimeError("paged_kv attention needs paged_metadata; run the model through worker.ModelRunner")
    meta = paged_metadata
    k_pool, v_pool = meta.kv_cache[module.layer_idx]
    num_blocks, block_size, kv_heads, head_dim = k_pool.shape
    # [1, kv_heads, T, d] -> [T, kv_heads, d], the pool's slot layout.
    k_new = key[0].transpose(0, 1)
    v_new = value[0].transpose(0, 1)
    k_pool.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k_new)
    v_pool.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v_new)

    q = query[0]  # [heads, T, d]
    out = None  # [T, heads, d]; not needed when every token is a decode

    if meta.decode_q_index is not None:
        bd, max_blocks = meta.decode_block_ids.shape
        flat_ids = meta.decode_block_ids.view(-1)
        # index_select copies whole blocks with memcpy; advanced indexing is several times slower on CPU.
        kd = k_pool.index_select(0, flat_ids).view(bd, max_blocks * block_size, kv_heads, head_dim).transpose(1, 2)
        vd = v_pool.index_select(0, flat_ids).view(bd, max_blocks * block_size, kv_heads, head_dim).transpose(1, 2)
        if meta.decode_only:
            qd = q.transpose(0, 1).unsqueeze(2)  # [Bd, heads, 1, d]
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scaling, enable_gqa=True)
            return od.transpose(1, 2).reshape(1, bd, q.shape[0], q.shape[2]), None
        qd = q.index_select(1, meta.decode_q_index).transpose(0, 1).unsqueeze(2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scaling, enable_gqa=True)
        out = _empty_out(q)
        out[meta.decode_q_index] = od[:, :, 0]

    if out is None:
        out = _empty_out(q)

    for span in meta.prefills:
        sl = slice(span.q_start, span.q_start + span.q_len)
        qp = q[:, sl].unsqueeze(0)
        if span.block_ids is None:
            kp, vp = key[:, :, sl], value[:, :, sl]
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            n = span.block_ids.shape[0]
            kp = k_pool.index_select(0, span.block_ids).view(1, n * block_size, kv_heads, head_dim)
            vp = v_pool.index_select(0, span.block_ids).view(1, n * block_size, kv_heads, head_dim)
            kp, vp = kp[:, :span.ctx_len].transpose(1, 2), vp[:, :span.ctx_len].transpose(1, 2)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=span.mask, scale=scaling, enable_gqa=True)
        out[sl] = op[0].transpose(0, 1)

    return out.unsqueeze(0), None


def _empty_out(q: torch.Tensor) -> torch.Tensor:
    return torch.empty(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype, device=q.device)


def no_mask(*args, **kwargs):
    """The paged path builds its own masks; skip the model's dense causal mask."""
    return None


def register() -> None:
    """Make ``attn_implementation="paged_kv"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, no_mask)
