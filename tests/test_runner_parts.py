"""The step path's parts on CPU: block-table rows and their update log, decode grouping, swap runs,
the new GPU-facing config keys, and the start-up cost calibration."""

from __future__ import annotations

import math
import random

import pytest

from worker import Engine, EngineConfig
from worker.block_manager import BlockManager
from worker.config import ConfigError
from worker.kv_swap import runs
from worker.paged_attention import decode_group_key


def test_rows_are_reused_and_updates_carry_only_new_entries():
    bm = BlockManager(num_blocks=16, block_size=4)
    bm.allocate("a", 5)  # 2 blocks
    bm.allocate("b", 1)
    ra, rb = bm.row("a"), bm.row("b")
    assert {ra, rb} == {0, 1}
    first = bm.take_table_updates()
    assert first == {(ra, 0): bm.block_table("a")[0], (ra, 1): bm.block_table("a")[1], (rb, 0): bm.block_table("b")[0]}
    assert bm.take_table_updates() == {}
    bm.allocate("a", 8)  # no new block
    assert bm.take_table_updates() == {}
    bm.allocate("a", 9)
    assert bm.take_table_updates() == {(ra, 2): bm.block_table("a")[2]}
    bm.free("a")
    bm.allocate("c", 3)
    assert bm.row("c") == ra  # the lowest free row is reused
    # Freed and reused within one step: each entry is sent once, with its last value.
    bm.free("c")
    bm.allocate("d", 8)
    assert bm.take_table_updates() == {(ra, 0): bm.block_table("d")[0], (ra, 1): bm.block_table("d")[1]}
    assert bm.num_rows == 2
    bm.check_invariants()
    with pytest.raises(KeyError):
        bm.row("a")


def test_rows_and_tables_stay_consistent_under_random_churn():
    rng = random.Random(7)
    bm = BlockManager(num_blocks=40, block_size=4)
    mirror: dict[int, dict[int, int]] = {}  # what a device copy built from the updates would hold
    for _ in range(2000):
        sid = f"s{rng.randrange(12)}"
        if rng.random() < 0.3:
            bm.free(sid)
        else:
            bm.allocate(sid, rng.randrange(1, 40))
        for (row, col), b in bm.take_table_updates().items():
            mirror.setdefault(row, {})[col] = b
        bm.check_invariants()
        for s in (f"s{i}" for i in range(12)):
            if bm.has_blocks(s):
                table = bm.block_table(s)
                assert [mirror[bm.row(s)][c] for c in range(len(table))] == table


def test_decode_groups_pad_by_less_than_half():
    keys = [decode_group_key(n) for n in range(1, 5000)]
    assert keys[:8] == [1, 2, 3, 4, 6, 6, 8, 8]
    assert all(n <= k < 1.5 * n or k == n for n, k in zip(range(1, 5000), keys))
    assert len(set(keys)) < 30  # a handful of groups per step, not one per length


def test_runs_of_consecutive_ids():
    assert runs([]) == []
    assert runs([5, 6, 7, 2, 3, 9]) == [(0, 5, 3), (3, 2, 2), (5, 9, 1)]
    assert runs([4, 3]) == [(0, 4, 1), (1, 3, 1)]


def test_gpu_facing_config_keys():
    assert EngineConfig().resolved_dtype() == "float32"
    assert EngineConfig(device="cuda").resolved_dtype() == "bfloat16"
    assert EngineConfig(device="cuda:1", dtype="float16").resolved_dtype() == "float16"
    for bad in (dict(gpu_memory_utilization=0.0), dict(gpu_memory_utilization=1.5), dict(kv_cache_memory_mb=0),
                dict(swap_bytes_per_s=0.0), dict(recompute_tokens_per_s=-1.0), dict(dtype="fp8")):
        with pytest.raises(ConfigError):
            EngineConfig(**bad).validate()
    pc = EngineConfig().preemption_config(bytes_per_block=1024)
    assert pc.swap_bytes_per_s == 4e9 and pc.recompute_tokens_per_s == 2000.0  # CPU constants when unset
    assert EngineConfig(swap_bytes_per_s=1e9).preemption_config(1024).swap_bytes_per_s == 1e9


def test_cpu_pool_defaults_to_512_mb_and_costs_can_be_measured(tiny_model_dir):
    from worker.gpu_memory import measure_costs

    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig())
    runner = engine.runner
    assert runner.num_blocks == 512 * 2**20 // runner.bytes_per_block
    swap, recompute = measure_costs(runner, blocks=4, tokens=32)
    assert math.isfinite(swap) and swap > 0 and math.isfinite(recompute) and recompute > 0
