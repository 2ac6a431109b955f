"""Attention over the paged KV pool, plugged into transformers as a registered
attention implementation (``attn_implementation="paged_kv"``).

The model runs on a packed batch: all scheduled tokens of all sequences in one
row, each with its own position id. The HF attention module projects Q/K/V
and applies RoPE as usual, then calls ``paged_attention_forward``, which
writes this step's K/V into the pool at ``slot_mapping`` and attends each
sequence to its own blocks, found through the runner's persistent device
block table.

Cost follows the tokens in the batch, not batch x longest context: decodes
are grouped by context length (about two groups per doubling), and each group
gathers only as many blocks as its longest member needs (under 1.5x any
member's own), so one long sequence no longer pads every short one. Prefill chunks are attended one sequence at a
time. On CUDA no call takes SDPA's math kernel: decodes fold the query heads
that share a KV head into the query-length axis (plain multi-head attention,
no ``enable_gqa``), masked only when a group's lengths differ (the efficient
kernel takes that mask); a first prefill chunk is ``is_causal`` on its own
K/V (flash, GQA); a later chunk uses a lower-right causal bias over KV heads
expanded to the query heads (flash or efficient). A sliding window's masks are
explicit (efficient). A layer with soft-capped logits (Gemma2) or attention
sinks (GPT-OSS) is computed in full, as transformers' eager attention: no
SDPA kernel takes either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "paged_kv"


@dataclass
class DecodeGroup:
    """Decode queries of similar context length, attended in one SDPA call."""

    q_index: torch.Tensor  # [n] packed index of each query
    rows: torch.Tensor  # [n] each sequence's row in the block table
    width: int  # blocks gathered per sequence: the longest member's
    ctx: int | None  # every member sees exactly ctx keys: no mask needed
    mask: torch.Tensor | None  # [n, 1, 1, width * block_size] additive 0 / -inf, when ctx is None
    contexts: torch.Tensor  # [n] each member's context length (for a sliding window's mask)
    longest: int  # the longest member's context


@dataclass
class PrefillSpan:
    q_start: int  # offset of the chunk's first query in the packed batch
    q_len: int
    # None when the chunk starts at position 0: its K/V are all in this step's tensors.
    row: int | None
    ctx_len: int  # positions the chunk's last query sees (start + q_len)
    # Later chunks: query i sits at position ctx - q_len + i and sees keys at positions <= its own
    # (a bool mask on CPU, torch's lower-right CausalBias on CUDA, which dispatches to flash/efficient).
    mask: object = None


@dataclass
class AttentionMetadata:
    """Everything one forward step's attention needs; shared by all layers."""

    kv_cache: list[tuple[torch.Tensor, torch.Tensor]]  # per layer K and V pools [blocks, block_size, kv_heads, dim]
    block_tables: torch.Tensor  # [rows, max blocks per sequence] the runner's persistent device copy
    slot_mapping: torch.Tensor  # [T] flat pool slot of each packed token's new K/V
    decodes: list[DecodeGroup]
    prefills: list[PrefillSpan]
    # Expand KV heads for masked prefill chunks (CUDA): SDPA's fast kernels take a mask or GQA, not both.
    expand_kv: bool = False
    # A sliding window's keys and masks, built by the first layer that has it and shared by the others: window ->
    # (per decode group, per prefill span: None where every key the queries see is in the window).
    windows: dict[int, tuple[list, list]] = field(default_factory=dict)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            paged_metadata: AttentionMetadata | None = None, sliding_window: int | None = None,
                            softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    """``sliding_window`` (Mistral, Qwen2's windowed layers...): a query sees only the last ``sliding_window``
    keys up to its own position, as transformers' masks do, and only the blocks that can hold them are gathered
    (_window_masks); the blocks behind the window stay allocated (the scheduler knows no windows). ``softcap``
    (Gemma2): logits squashed to ``softcap * tanh(logit / softcap)`` before the softmax; ``s_aux`` (GPT-OSS's
    sinks): a logit per query head that takes its share of the softmax and attends to nothing (_in_full)."""
    if paged_metadata is None:
        raise RuntimeError("paged_kv attention needs paged_metadata; run the model through worker.ModelRunner")
    meta = paged_metadata
    k_pool, v_pool = meta.kv_cache[module.layer_idx]
    _, block_size, kv_heads, head_dim = k_pool.shape
    heads, num_tokens = query.shape[1], query.shape[2]
    group = heads // kv_heads
    # [1, kv_heads, T, d] -> [T, kv_heads, d], the pool's slot layout.
    k_pool.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))
    v_pool.view(-1, kv_heads, head_dim).index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))

    out = torch.empty(num_tokens, heads, head_dim, dtype=query.dtype, device=query.device)
    q_tokens = query[0].transpose(0, 1)  # [T, heads, d]
    windowed = _window_masks(meta, sliding_window, block_size, query.dtype) if sliding_window else None
    for i, g in enumerate(meta.decodes):
        n = g.q_index.shape[0]
        # Query heads sharing a KV head become that head's query "positions": plain MHA over KV heads.
        qd = q_tokens.index_select(0, g.q_index).view(n, kv_heads, group, head_dim)
        if windowed and (w := windowed[0][i]) is not None:
            ids, slots, ctx, mask = w.ids, w.slots, None, w.mask
        else:
            ids = meta.block_tables.index_select(0, g.rows)[:, :g.width].reshape(-1)
            slots, ctx, mask = g.width * block_size, g.ctx, g.mask
        kd = _gather(k_pool, ids, n, slots, ctx)
        vd = _gather(v_pool, ids, n, slots, ctx)
        sinks = None if s_aux is None else s_aux.view(1, kv_heads, group, 1)
        od = _attend(qd, kd, vd, mask=mask, scale=scaling, softcap=softcap, sinks=sinks)
        out.index_copy_(0, g.q_index, od.reshape(n, heads, head_dim))

    sinks = None if s_aux is None else s_aux.view(1, heads, 1, 1)
    for i, span in enumerate(meta.prefills):
        sl = slice(span.q_start, span.q_start + span.q_len)
        qp = query[:, :, sl]
        if windowed and (w := windowed[1][i]) is not None:
            if span.row is None:
                kp, vp = key[:, :, sl], value[:, :, sl]
            else:  # the blocks from the one holding the first key any query of the chunk sees
                ids = meta.block_tables[span.row, w.first_block:-(-span.ctx_len // block_size)]
                keys = span.ctx_len - w.first_block * block_size
                kp = _gather(k_pool, ids, 1, ids.shape[0] * block_size, keys)
                vp = _gather(v_pool, ids, 1, ids.shape[0] * block_size, keys)
            if meta.expand_kv and group > 1:
                kp, vp = kp.repeat_interleave(group, dim=1), vp.repeat_interleave(group, dim=1)
            op = _attend(qp, kp, vp, mask=w.mask, scale=scaling, gqa=not meta.expand_kv, softcap=softcap,
                         sinks=sinks)
        elif span.row is None:
            op = _attend(qp, key[:, :, sl], value[:, :, sl], causal=True, scale=scaling, gqa=True, softcap=softcap,
                         sinks=sinks)
        else:
            ids = meta.block_tables[span.row, :-(-span.ctx_len // block_size)]
            n_slots = ids.shape[0] * block_size
            kp = _gather(k_pool, ids, 1, n_slots, span.ctx_len)
            vp = _gather(v_pool, ids, 1, n_slots, span.ctx_len)
            if meta.expand_kv and group > 1:
                kp, vp = kp.repeat_interleave(group, dim=1), vp.repeat_interleave(group, dim=1)
            op = _attend(qp, kp, vp, mask=span.mask, scale=scaling, gqa=not meta.expand_kv, softcap=softcap,
                         sinks=sinks)
        out[sl] = op[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _attend(q, k, v, *, mask=None, causal: bool = False, scale: float | None = None, gqa: bool = False,
            softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    return _in_full(q, k, v, mask, causal, scale, softcap, sinks)


def _in_full(q, k, v, mask, causal: bool, scale: float | None, cap: float | None,
             sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention with what no SDPA kernel takes, computed in full as transformers' eager attention does: logits
    soft-capped before the softmax (``cap``), and ``sinks``, a logit per query head (broadcast to the scores'
    [.., heads.., queries, 1]) that joins each softmax and is dropped from it."""
    if k.shape[1] != q.shape[1]:  # grouped-query: each query head its KV head
        k, v = k.repeat_interleave(q.shape[1] // k.shape[1], 1), v.repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    q_len, k_len = scores.shape[-2:]
    if causal or (mask is not None and not isinstance(mask, torch.Tensor)):  # is_causal, or a CausalBias (CUDA)
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril_(k_len - q_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype), v)
    scores = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(scores - scores.amax(dim=-1, keepdim=True), dim=-1, dtype=torch.float32)
    return torch.matmul(probs[..., :-1].to(v.dtype), v)


@dataclass
class WindowedDecode:
    """A decode group's keys under a sliding window: only the blocks that can hold the last ``window`` positions
    of each member (ceil(window / block_size) + 1), not the whole context."""

    ids: torch.Tensor  # [n * blocks] pool block of each gathered block, member by member
    slots: int  # gathered slots per member (blocks * block_size)
    mask: torch.Tensor  # [n, 1, 1, slots] additive 0 / -inf: inside the member's window


@dataclass
class WindowedPrefill:
    first_block: int  # the block holding the first key any query of the chunk sees (a later chunk's)
    mask: torch.Tensor  # [q_len, keys from that block's start] bool: inside the query's window


def _window_masks(meta: AttentionMetadata, window: int, block_size: int, dtype: torch.dtype) -> tuple[list, list]:
    """Each decode group's and prefill span's keys and mask for ``window`` (None where all its keys are inside it),
    built by the first layer that has this window and shared by the others."""
    if window not in meta.windows:
        device = meta.slot_mapping.device
        decodes: list[WindowedDecode | None] = []
        for g in meta.decodes:
            if g.longest <= window:
                decodes.append(None)
                continue
            blocks = min(g.width, -(-window // block_size) + 1)  # any `window` positions lie in so many blocks
            ctx = g.contexts[:, None]
            first = ((ctx - window).clamp_(min=0) // block_size).clamp_(max=g.width - blocks)
            cols = first + torch.arange(blocks, device=device)[None, :]
            ids = meta.block_tables.index_select(0, g.rows).gather(1, cols).reshape(-1)
            at = (cols[:, :, None] * block_size + torch.arange(block_size, device=device)).reshape(len(ctx), -1)
            seen = (at < ctx) & (at >= ctx - window)
            mask = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))
            decodes.append(WindowedDecode(ids, blocks * block_size, mask[:, None, None, :]))
        prefills: list[WindowedPrefill | None] = []
        for span in meta.prefills:
            if span.ctx_len <= window:
                prefills.append(None)
                continue
            first_key = 0 if span.row is None else max(0, span.ctx_len - span.q_len - window + 1)
            first_block = first_key // block_size
            query_at = torch.arange(span.ctx_len - span.q_len, span.ctx_len, device=device)[:, None]
            # A first chunk's keys are its own (ctx == q_len, first_block 0).
            key_at = torch.arange(first_block * block_size, span.ctx_len, device=device)[None, :]
            prefills.append(WindowedPrefill(first_block, (key_at <= query_at) & (key_at > query_at - window)))
        meta.windows[window] = (decodes, prefills)
    return meta.windows[window]


def _gather(pool: torch.Tensor, ids: torch.Tensor, n: int, slots: int, ctx: int | None) -> torch.Tensor:
    """Blocks ``ids`` of ``pool`` as [n, kv_heads, ctx or slots, d]."""
    _, _, kv_heads, head_dim = pool.shape
    # index_select copies whole blocks with memcpy; advanced indexing is several times slower on CPU.
    x = pool.index_select(0, ids).view(n, slots, kv_heads, head_dim)
    if ctx is not None:
        x = x[:, :ctx]
    return x.transpose(1, 2)


def decode_group_key(num_blocks: int) -> int:
    """Decodes whose block counts share a key are attended together: keys split each doubling in two
    (1, 2, 3, 4, 6, 8, 12, 16, 24, ...), so a group pads a member to less than 1.5x its own blocks."""
    step = 1 << max(0, num_blocks.bit_length() - 2)
    return -(-num_blocks // step) * step


def register() -> None:
    """Make ``attn_implementation="paged_kv"`` known to transformers (idempotent).

    Only the attention function is registered, not a mask function: transformers then skips mask
    preparation entirely for this implementation (no dense causal mask, and no packed-sequence
    detection, which would read a device tensor back to the host in every forward)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
