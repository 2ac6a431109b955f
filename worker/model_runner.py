"""The only module that runs the model: loads it, owns the KV pools, and turns
a scheduled batch into next-token logits.

Per step the host builds one int64 tensor (token ids, positions, block-table
rows, the tokens to keep, the decode groups, and the block-table entries
written since the last step) and copies it to the device once. The device
block table is persistent and updated incrementally from that copy; slot
mappings are computed on the device from it. Nothing in the forward reads a
device value back to the host.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from worker import paged_attention
from worker.block_manager import BlockManager
from worker.config import ConfigError, EngineConfig
from worker.kv_swap import HostPool
from worker.model_checks import check_model
from worker.paged_attention import AttentionMetadata, DecodeGroup, PrefillSpan
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


def torch_dtype(config: EngineConfig) -> torch.dtype:
    return _DTYPES[config.resolved_dtype()]


def load_model(model_dir: str | Path, config: EngineConfig):
    """Load any causal LM through ``from_pretrained`` with the paged attention plugged in, in the target
    dtype; on CUDA its weights are materialised directly on the device when ``accelerate`` is installed
    (transformers needs it for ``device_map``), else loaded on the host and moved."""
    import importlib.util

    from transformers import AutoModelForCausalLM

    paged_attention.register()
    device = torch.device(config.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {config.device!r} requested but CUDA is not available")
    direct = device.type == "cuda" and importlib.util.find_spec("accelerate") is not None
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch_dtype(config), attn_implementation=paged_attention.ATTN_IMPLEMENTATION,
        **({"device_map": device} if direct else {}),
    )
    info = model.config.get_text_config()
    check_model(model, config.served_context(info.max_position_embeddings))
    return model.to(device).eval()  # a no-op when device_map already placed it


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
        self.dtype = torch_dtype(config)
        self.block_size = config.block_size
        self.num_blocks = config.num_kv_blocks or self._default_num_blocks()
        shape = (self.num_blocks, self.block_size, self.info.num_kv_heads, self.info.head_dim)
        self.kv_cache = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device),
             torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.info.num_layers)
        ]
        # Persistent device copy of every sequence's block table, one row each (BlockManager.row);
        # grows by doubling when more sequences hold blocks at once.
        self.max_blocks_per_seq = -(-self.info.max_position_embeddings // self.block_size)
        self.block_tables = torch.zeros(max(8, config.max_num_seqs), self.max_blocks_per_seq, dtype=torch.long,
                                        device=self.device)
        self.host = HostPool(self.kv_cache, 0)
        # Time spent in block copies and how many copies, for the preemption-cost benchmark.
        self._copy_seconds = 0.0
        self.copy_events = 0
        if self.device.type == "cuda" and (config.swap_bytes_per_s is None or config.recompute_tokens_per_s is None):
            from worker.gpu_memory import measure_costs

            swap, recompute = measure_costs(self)
            self.config = dataclasses.replace(config, swap_bytes_per_s=config.swap_bytes_per_s or swap,
                                              recompute_tokens_per_s=config.recompute_tokens_per_s or recompute)

    @property
    def host_cache(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self.host.host_cache

    def allocate_host_pool(self, num_blocks: int) -> None:
        """Host-side pool that swapped-out blocks are copied to (pinned when the device is a GPU)."""
        self.host = HostPool(self.kv_cache, num_blocks)

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Swap blocks out to / in from the host pool, in the order given (later copies may reuse ids)."""
        t0 = time.perf_counter()
        self.host.copy(copies)
        if self.device.type == "cpu":
            self._copy_seconds += time.perf_counter() - t0
        self.copy_events += len(copies)

    @property
    def copy_seconds(self) -> float:
        """Seconds spent copying blocks (on CUDA: timed by events on the copy stream, read here)."""
        return self._copy_seconds + self.host.elapsed_seconds()

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across all layers."""
        i = self.info
        return 2 * i.num_layers * self.block_size * i.num_kv_heads * i.head_dim * self.dtype.itemsize

    def _default_num_blocks(self) -> int:
        if self.config.kv_cache_memory_mb is not None or self.device.type != "cuda":
            return max(1, (self.config.kv_cache_memory_mb or 512) * 2**20 // self.bytes_per_block)
        from worker.gpu_memory import kv_cache_bytes

        return max(1, kv_cache_bytes(self) // self.bytes_per_block)

    # -- one step -------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, chunks: Sequence[ScheduledChunk], blocks: BlockManager) -> torch.Tensor:
        """Run one forward step; logits [num sampling chunks, vocab] in chunk order."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        rows: list[int] = []
        keep: list[int] = []
        decodes: dict[int, list[tuple[int, int, int]]] = {}  # group key -> (query index, row, context)
        prefills: list[PrefillSpan] = []
        for chunk in chunks:
            req, start, n = chunk.request, chunk.start, chunk.num_tokens
            row = blocks.row(req.request_id)
            q_start = len(ids)
            ids.extend(req.token_slice(start, start + n))
            positions.extend(range(start, start + n))
            rows.extend([row] * n)
            if chunk.sample:
                keep.append(q_start + n - 1)
            ctx = start + n
            if n == 1:
                decodes.setdefault(paged_attention.decode_group_key(-(-ctx // bs)), []).append((q_start, row, ctx))
            else:
                prefills.append(PrefillSpan(q_start, n, row if start else None, ctx))
        updates = blocks.take_table_updates()
        self._fit_rows(blocks.num_rows)

        # One host -> device copy: [ids | positions | rows | keep | per group: q, rows, ctx | updates].
        groups = list(decodes.values())
        packed = ids + positions + rows + keep
        for g in groups:
            packed += [q for q, _, _ in g] + [r for _, r, _ in g] + [c for _, _, c in g]
        packed += [r for r, _ in updates] + [c for _, c in updates] + list(updates.values())
        buf = self._to_device(packed)
        t = len(ids)
        ids_d, pos_d, rows_d = buf[:t], buf[t:2 * t], buf[2 * t:3 * t]
        at = 3 * t + len(keep)
        keep_d = buf[3 * t:at]
        groups_d = []
        for g in groups:
            n = len(g)
            groups_d.append(self._decode_group(g, buf[at:at + n], buf[at + n:at + 2 * n], buf[at + 2 * n:at + 3 * n]))
            at += 3 * n
        if updates:
            u = len(updates)
            self.block_tables.index_put_((buf[at:at + u], buf[at + u:at + 2 * u]), buf[at + 2 * u:at + 3 * u])
        slot_mapping = self.block_tables[rows_d, pos_d // bs] * bs + pos_d % bs
        expand = self.device.type == "cuda"
        if expand:  # torch's lower-right causal bias dispatches to flash / efficient attention
            from torch.nn.attention.bias import causal_lower_right
        for span in prefills:
            if span.row is not None:
                span.mask = (causal_lower_right(span.q_len, span.ctx_len) if expand else
                             torch.ones(span.q_len, span.ctx_len, dtype=torch.bool).tril_(span.ctx_len - span.q_len))
        meta = AttentionMetadata(kv_cache=self.kv_cache, block_tables=self.block_tables, slot_mapping=slot_mapping,
                                 decodes=groups_d, prefills=prefills, expand_kv=expand)
        out = self.model(input_ids=ids_d[None], position_ids=pos_d[None], use_cache=False, logits_to_keep=keep_d,
                         paged_metadata=meta)
        return out.logits[0]

    def _to_device(self, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.long)
        if self.device.type == "cpu":
            return host
        # Pinned (the caching host allocator keeps it alive until the copy ran), so the copy is async.
        return host.pin_memory().to(self.device, non_blocking=True)

    def _decode_group(self, members: list[tuple[int, int, int]], q: torch.Tensor, rows: torch.Tensor,
                      ctx: torch.Tensor) -> DecodeGroup:
        bs = self.block_size
        longest = max(c for _, _, c in members)
        width = -(-longest // bs)
        if all(c == longest for _, _, c in members):
            return DecodeGroup(q, rows, width, longest, None, ctx, longest)
        visible = torch.arange(width * bs, device=self.device)[None, :] < ctx[:, None]
        # Additive mask in the model dtype, built once per step and shared by every layer.
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device).masked_fill_(~visible, float("-inf"))
        return DecodeGroup(q, rows, width, None, mask[:, None, None, :], ctx, longest)

    def _fit_rows(self, needed: int) -> None:
        have = self.block_tables.shape[0]
        if needed > have:
            grown = torch.zeros(max(needed, 2 * have), self.max_blocks_per_seq, dtype=torch.long, device=self.device)
            grown[:have] = self.block_tables
            self.block_tables = grown
