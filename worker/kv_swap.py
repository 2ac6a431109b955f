"""The host side of the KV pool: swapped-out blocks, and the copies between it and the device pool.

On CUDA the host pool is pinned and every copy runs on a stream of its own,
straight between the device pool (through one device staging buffer, since a
gather cannot write into host memory) and slices of the pinned pool: runs of
consecutive host block ids move as one ``copy_``. The forward pass waits for
the copy stream with a stream dependency, not a host sync. On CPU the copies
are plain index ops.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from worker.scheduler_types import BlockCopy


def runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(offset in ids, first id, length) for each run of consecutive ids."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == b:
            off, first, n = out[-1]
            out[-1] = (off, first, n + 1)
        else:
            out.append((i, b, 1))
    return out


class HostPool:
    def __init__(self, kv_cache: list[tuple[torch.Tensor, torch.Tensor]], num_blocks: int) -> None:
        self.kv_cache = kv_cache
        self.device = kv_cache[0][0].device if kv_cache else torch.device("cpu")
        self.on_cuda = self.device.type == "cuda"
        shape = (num_blocks, *kv_cache[0][0].shape[1:]) if kv_cache and num_blocks else None
        dtype = kv_cache[0][0].dtype if kv_cache else torch.float32
        self.host_cache: list[tuple[torch.Tensor, torch.Tensor]] = [] if shape is None else [
            (torch.zeros(shape, dtype=dtype, pin_memory=self.on_cuda),
             torch.zeros(shape, dtype=dtype, pin_memory=self.on_cuda))
            for _ in kv_cache
        ]
        self.stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def elapsed_seconds(self) -> float:
        """Copy time recorded on the copy stream since the last call (waits for those copies to end)."""
        total = sum(a.elapsed_time(b) for a, b in self._timings if not b.synchronize()) / 1000
        self._timings.clear()
        return total

    @torch.inference_mode()
    def copy(self, copies: Sequence[BlockCopy]) -> None:
        """Run the copies in order (later copies may reuse ids); the next kernels on the current stream
        start after them."""
        if not self.on_cuda:
            for c in copies:
                dev, host = torch.tensor(c.device_block_ids), torch.tensor(c.host_block_ids)
                for (dk, dv), (hk, hv) in zip(self.kv_cache, self.host_cache):
                    if c.to_host:
                        hk.index_copy_(0, host, dk.index_select(0, dev))
                        hv.index_copy_(0, host, dv.index_select(0, dev))
                    else:
                        dk.index_copy_(0, dev, hk.index_select(0, host))
                        dv.index_copy_(0, dev, hv.index_select(0, host))
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the blocks to copy out were written by earlier steps
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            for c in copies:
                dev = torch.tensor(c.device_block_ids, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
                spans = runs(c.host_block_ids)
                for pools in zip(self.kv_cache, self.host_cache):
                    for d, h in zip(*pools):
                        (self._out if c.to_host else self._in)(d, h, dev, spans)
            end.record()
        self._timings.append((start, end))
        compute.wait_stream(self.stream)

    @staticmethod
    def _out(d: torch.Tensor, h: torch.Tensor, dev: torch.Tensor, spans) -> None:
        staged = d.index_select(0, dev)  # allocated on the copy stream: freed only after its copies ran
        for off, first, n in spans:
            h[first:first + n].copy_(staged[off:off + n], non_blocking=True)

    @staticmethod
    def _in(d: torch.Tensor, h: torch.Tensor, dev: torch.Tensor, spans) -> None:
        staged = torch.empty((dev.shape[0], *d.shape[1:]), dtype=d.dtype, device=d.device)
        for off, first, n in spans:
            staged[off:off + n].copy_(h[first:first + n], non_blocking=True)
        d.index_copy_(0, dev, staged)
