"""The only module that runs the model: loads it, owns the KV pools, and turns
a scheduled batch into next-token logits."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from worker import paged_attention
from worker.config import ConfigError, EngineConfig
from worker.paged_attention import AttentionMetadata, PrefillSpan
from worker.scheduler import BlockCopy, ScheduledChunk

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    max_position_embeddings: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    eos_token_ids: tuple[int, ...]


def load_model(model_dir: str | Path, config: EngineConfig):
    """Load any causal LM through ``from_pretrained`` with the paged attention plugged in."""
    from transformers import AutoModelForCausalLM

    paged_attention.register()
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {config.device!r} requested but CUDA is not available")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=_DTYPES[config.dtype], attn_implementation=paged_attention.ATTN_IMPLEMENTATION
    )
    return model.to(device).eval()


def model_info(model) -> ModelInfo:
    cfg = model.config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = cfg.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
    return ModelInfo(
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim,
        eos_token_ids=eos_ids,
    )


class ModelRunner:
    def __init__(self, model, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self.info = model_info(model)
        self.device = next(model.parameters()).device
        self.dtype = _DTYPES[config.dtype]
        self.block_size = config.block_size
        self.num_blocks = config.num_kv_blocks or self._blocks_for_memory(config.kv_cache_memory_mb)
        shape = (self.num_blocks, self.block_size, self.info.num_kv_heads, self.info.head_dim)
        self.kv_cache = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.info.num_layers)
        ]

        self.host_cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Wall time spent in block copies and how many copies, for the preemption-cost benchmark.
        self.copy_seconds = 0.0
        self.copy_events = 0

    def allocate_host_pool(self, num_blocks: int) -> None:
        """Host-side pool that swapped-out blocks are copied to (pinned when the device is a GPU)."""
        if num_blocks == 0:
            self.host_cache = []
            return
        shape = (num_blocks, self.block_size, self.info.num_kv_heads, self.info.head_dim)
        pin = self.device.type == "cuda"
        self.host_cache = [
            (torch.zeros(shape, dtype=self.dtype, pin_memory=pin), torch.zeros(shape, dtype=self.dtype, pin_memory=pin))
            for _ in range(self.info.num_layers)
        ]

    @torch.inference_mode()
    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Swap blocks out to / in from the host pool, in the order given (later copies may reuse ids)."""
        t0 = time.perf_counter()
        for c in copies:
            dev = torch.tensor(c.device_block_ids, dtype=torch.long, device=self.device)
            host = torch.tensor(c.host_block_ids, dtype=torch.long)
            for (dk, dv), (hk, hv) in zip(self.kv_cache, self.host_cache):
                if c.to_host:
                    hk.index_copy_(0, host, dk.index_select(0, dev).to("cpu"))
                    hv.index_copy_(0, host, dv.index_select(0, dev).to("cpu"))
                else:
                    dk.index_copy_(0, dev, hk.index_select(0, host).to(self.device, non_blocking=True))
                    dv.index_copy_(0, dev, hv.index_select(0, host).to(self.device, non_blocking=True))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.copy_seconds += time.perf_counter() - t0
        self.copy_events += len(copies)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers."""
        i = self.info
        return 2 * i.num_layers * self.block_size * i.num_kv_heads * i.head_dim * self.dtype.itemsize

    def _blocks_for_memory(self, megabytes: int) -> int:
        return max(1, megabytes * 2**20 // self.bytes_per_block)

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk], block_table: Callable[[str], list[int]]) -> torch.Tensor:
        """Run one forward step; logits [num sampling chunks, vocab] in chunk order."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        keep: list[int] = []
        decode_idx: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        for chunk in chunks:
            req, start, n = chunk.request, chunk.start, chunk.num_tokens
            table = block_table(req.request_id)
            q_start = len(ids)
            ids.extend(req.token_slice(start, start + n))
            pos = range(start, start + n)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in pos)
            if chunk.sample:
                keep.append(q_start + n - 1)
            ctx = start + n
            if n == 1:
                decode_idx.append(q_start)
                decode_tables.append(table[: -(-ctx // bs)])
                decode_lens.append(ctx)
            else:
                prefills.append(self._prefill_span(q_start, n, ctx, table))

        dev = self.device
        meta = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            decode_q_index=None, decode_block_ids=None, decode_mask=None,
            prefills=prefills,
        )
        if decode_idx:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            meta.decode_q_index = torch.tensor(decode_idx, dtype=torch.long, device=dev)
            meta.decode_block_ids = torch.tensor(padded, dtype=torch.long, device=dev)
            lens = torch.tensor(decode_lens, device=dev)
            visible = torch.arange(width * bs, device=dev)[None, :] < lens[:, None]
            # Additive float mask built once per step; a bool mask would be converted again in every layer.
            meta.decode_mask = torch.zeros(visible.shape, dtype=self.dtype, device=dev).masked_fill_(
                ~visible, float("-inf"))[:, None, None, :]
            meta.decode_only = not prefills

        out = self.model(
            input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
            position_ids=torch.tensor([positions], dtype=torch.long, device=dev),
            use_cache=False,
            logits_to_keep=torch.tensor(keep, dtype=torch.long, device=dev),
            paged_metadata=meta,
        )
        return out.logits[0]

    def _prefill_span(self, q_start: int, n: int, ctx: int, table: list[int]) -> PrefillSpan:
        if ctx == n:
            return PrefillSpan(q_start, n, None, ctx, None)
        dev = self.device
        blocks = torch.tensor(table[: -(-ctx // self.block_size)], dtype=torch.long, device=dev)
        # Query i sits at position ctx - n + i and sees keys at positions <= its own.
        q_pos = torch.arange(ctx - n, ctx, device=dev)[:, None]
        mask = torch.arange(ctx, device=dev)[None, :] <= q_pos
        return PrefillSpan(q_start, n, blocks, ctx, mask)
