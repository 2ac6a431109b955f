"""Blocks freed for a waiting request go to it: on the real engine (tiny model), a P0 that preempts a P3 for KV
blocks starts in that same step, even when another P3 it outranks reaches a block boundary in that step."""

from __future__ import annotations

import pytest

from worker import Engine, EngineConfig, FinishReason, SamplingParams

PARAMS = dict(block_size=4, num_kv_blocks=5, max_model_len=20, max_num_seqs=4, max_num_batched_tokens=64,
              isolate_p0_prefill=False, min_residency_steps=0, guard_remaining_tokens=0)


def alone(model_dir, prompt: list[int], params: SamplingParams) -> list[int]:
    engine = Engine.from_pretrained(model_dir, EngineConfig(num_kv_blocks=64, max_model_len=20, swap_space_mb=0))
    engine.add_request("r", prompt, params, tier="P0")
    out: list[int] = []
    while engine.has_unfinished():
        for o in engine.step():
            out.extend(o.new_token_ids)
    return out


@pytest.mark.parametrize("swap_space_mb", [0, 1])
def test_blocks_freed_for_a_p0_are_not_taken_by_a_growing_p3(tiny_model_dir, swap_space_mb):
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(**PARAMS, swap_space_mb=swap_space_mb))
    p3 = SamplingParams(max_tokens=10, ignore_eos=True)
    p0 = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = {"long": list(range(10, 17)), "short": [20, 21, 22], "p0": list(range(30, 38))}
    engine.add_request("long", prompts["long"], p3, tier="P3")  # 7 tokens: its 9th needs a third block
    engine.add_request("short", prompts["short"], p3, tier="P3")  # 1 block, the fewest computed: the victim
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    ended: dict[str, FinishReason] = {}

    def step() -> None:
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                assert o.request_id not in ended
                ended[o.request_id] = o.finish_reason
        engine.blocks.check_invariants()

    step()
    step()
    assert engine.kv_usage().num_free == 2
    # 12 tokens: 3 blocks, reserved whole (nothing preempts a P0). 2 are free, the victim frees 1, and "long"
    # needs 1 more this very step for its next token.
    engine.add_request("p0", prompts["p0"], p0, tier="P0")
    step()
    assert len(tokens["p0"]) == 1, "the P0 did not start in the step its victim gave way for it"
    while engine.has_unfinished():
        step()
    assert ended == {rid: FinishReason.LENGTH for rid in prompts}
    assert engine.kv_usage().num_used == 0
    for rid, prompt in prompts.items():
        assert tokens[rid] == alone(tiny_model_dir, prompt, p0 if rid == "p0" else p3), rid
