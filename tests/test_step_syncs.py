"""A step reads device values back to the host at most once (the sampled tokens), counted on CPU.

Every Python-level read (``.tolist()``, ``.item()``, ``bool()``/``int()``/``float()`` of a tensor)
is counted with a TorchFunctionMode, and every op that needs a device value on the host (item,
_local_scalar_dense, nonzero, masked_select, ...) with the profiler. On CUDA each of these would
stall the host until the GPU caught up.
"""

from __future__ import annotations

import random

import pytest
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

from worker import Engine, EngineConfig, SamplingParams

_PY_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "__len__"}
_SYNC_OPS = {"aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select",
             "aten::is_nonzero", "aten::unique", "aten::_unique2", "aten::repeat_interleave"}


class _Reads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _PY_READS and name != "__len__":
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def count_syncs(engine: Engine) -> tuple[int, list[str], dict[str, int]]:
    with _Reads() as mode, profile(activities=[ProfilerActivity.CPU]) as prof:
        outputs = engine.step()
    assert outputs
    ops = {e.key: e.count for e in prof.key_averages() if e.key in _SYNC_OPS}
    # .tolist() reads without an aten op; the rest show up in both counts, so take the larger.
    return max(len(mode.reads), sum(ops.values()) + mode.reads.count("tolist")), mode.reads, ops


@pytest.mark.parametrize("sampling", [False, True])
def test_one_host_read_per_decode_step_and_per_mixed_step(tiny_model_dir, sampling):
    rng = random.Random(0)
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(num_kv_blocks=128, max_num_batched_tokens=40))

    def params(i: int) -> SamplingParams:
        if sampling and i % 2:
            return SamplingParams(max_tokens=60, temperature=0.9, top_k=20, top_p=0.9, seed=i, ignore_eos=True)
        return SamplingParams(max_tokens=60, ignore_eos=True)

    for i in range(6):
        engine.add_request(f"r{i}", [rng.randrange(3, 500) for _ in range(rng.randrange(5, 70))], params(i))
    for _ in range(12):  # prefills done (chunked: 40 tokens a step), everyone decoding
        engine.step()
    assert all(engine.get_request(f"r{i}").num_computed_tokens >= 5 for i in range(6))
    n, reads, ops = count_syncs(engine)
    assert n <= 1, (reads, ops)

    # A mixed step: decodes plus a prompt chunk that continues an earlier chunk (attends to the pool).
    engine.add_request("late", [rng.randrange(3, 500) for _ in range(70)], params(1))
    engine.step()  # its first chunk
    assert 0 < engine.get_request("late").num_computed_tokens < 70
    n, reads, ops = count_syncs(engine)
    assert n <= 1, (reads, ops)
