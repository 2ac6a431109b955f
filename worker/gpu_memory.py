"""CUDA start-up measurements: how big the KV pool may be, and what swap and recompute cost here.

KV pool (as vLLM sizes it): ``gpu_memory_utilization`` of the device's total
memory, minus what is in use once the weights are loaded (weights, CUDA
context, other processes) and minus the peak activation memory of a profiled
forward pass over ``max_num_batched_tokens`` tokens and the sampler's logits.

Costs: the preemption policy chooses between swapping blocks to host memory and
recomputing them; its two rates are timed here on this device instead of
constants measured on a CPU.
"""

from __future__ import annotations

import time

import torch

from worker.paged_attention import AttentionMetadata, PrefillSpan


def _profile_forward(runner, num_tokens: int) -> None:
    """One prefill of ``num_tokens`` tokens from position 0 into a scratch pool (the real one may not exist yet)."""
    info, bs, dev = runner.info, runner.block_size, runner.device
    blocks = -(-num_tokens // bs)
    shape = (blocks, bs, info.num_kv_heads, info.head_dim)
    scratch = [(torch.empty(shape, dtype=runner.dtype, device=dev), torch.empty(shape, dtype=runner.dtype, device=dev))
               for _ in range(info.num_layers)]
    meta = AttentionMetadata(kv_cache=scratch, block_tables=torch.arange(blocks, device=dev)[None],
                             slot_mapping=torch.arange(num_tokens, device=dev), decodes=[],
                             prefills=[PrefillSpan(0, num_tokens, None, num_tokens)], expand_kv=dev.type == "cuda")
    keep = torch.arange(num_tokens - min(num_tokens, runner.config.max_num_seqs), num_tokens, device=dev)
    with torch.inference_mode():
        runner.model(input_ids=torch.zeros(1, num_tokens, dtype=torch.long, device=dev),
                     position_ids=torch.arange(num_tokens, device=dev)[None], use_cache=False,
                     logits_to_keep=keep, paged_metadata=meta)


def kv_cache_bytes(runner) -> int:
    dev = runner.device
    n = min(runner.config.max_num_batched_tokens, runner.info.max_position_embeddings)
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    _profile_forward(runner, n)
    torch.cuda.synchronize(dev)
    activations = torch.cuda.max_memory_allocated(dev) - base
    # The sampler's float32 working copies of the logits (about six live at once).
    sampler = 6 * runner.config.max_num_seqs * runner.info.vocab_size * 4
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    budget = int(total * runner.config.gpu_memory_utilization) - (total - free) - activations - sampler
    if budget < runner.bytes_per_block:
        from worker.config import ConfigError

        raise ConfigError(f"no room for a KV pool: {total / 2**30:.1f} GiB x gpu_memory_utilization "
                          f"{runner.config.gpu_memory_utilization} leaves {budget / 2**30:.2f} GiB after weights "
                          f"({(total - free) / 2**30:.1f} GiB in use) and activations ({activations / 2**30:.2f} GiB)")
    return budget


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure_costs(runner, blocks: int = 32, tokens: int = 512) -> tuple[float, float]:
    """(swap bytes/s counting both directions, recompute tokens/s), timed on this device (CUDA at start-up;
    it runs on CPU too, for tests)."""
    from worker.kv_swap import HostPool
    from worker.scheduler_types import BlockCopy

    dev = runner.device
    blocks = min(blocks, runner.num_blocks)
    ids = tuple(range(blocks))
    pool = HostPool(runner.kv_cache, blocks)
    copies = [BlockCopy(True, ids, ids), BlockCopy(False, ids, ids)]
    pool.copy(copies)  # warm-up
    _sync(dev)
    t0 = time.perf_counter()
    pool.copy(copies)
    _sync(dev)
    swap = 2 * blocks * runner.bytes_per_block / (time.perf_counter() - t0)

    n = min(tokens, runner.config.max_num_batched_tokens, runner.info.max_position_embeddings)
    _profile_forward(runner, n)  # warm-up
    _sync(dev)
    t0 = time.perf_counter()
    _profile_forward(runner, n)
    _sync(dev)
    return swap, n / (time.perf_counter() - t0)
