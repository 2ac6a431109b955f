"""ts_preempt_recomputed_tokens counts tokens prefilled again after a recompute preemption, when they are.

The scheduler counted a recomputed request's discarded tokens all at once when it resumed, so a request cancelled
(aborted) in the middle of its re-prefill, or a forward step that failed, counted tokens never prefilled again.
They are now counted as each re-prefill chunk is computed. Real engine, real tiny model, 16 tokens a step."""

from __future__ import annotations

from prometheus_client.core import CollectorRegistry

from worker import Engine, EngineConfig, SamplingParams
from worker.metrics import EngineState

PROMPT = list(range(3, 63))  # 60 tokens: four steps of 16 at most


def _engine(tiny_model_dir) -> Engine:
    return Engine.from_pretrained(tiny_model_dir, EngineConfig(num_kv_blocks=64, max_num_batched_tokens=16))


def _exported(engine: Engine) -> float:
    registry = CollectorRegistry()
    registry.register(EngineState(engine))
    return registry.get_sample_value("ts_preempt_recomputed_tokens_total")


def _computed_48_then_recomputed(tiny_model_dir) -> Engine:
    engine = _engine(tiny_model_dir)
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=4))
    for _ in range(3):
        engine.step()
    assert engine.get_request("a").num_computed_tokens == 48
    engine.suspend("a", "recompute")
    return engine


def _re_prefill_one_chunk(engine: Engine) -> None:
    """Steps until the request resumed and computed its first chunk again (16 of its 48 discarded tokens)."""
    for _ in range(10):
        engine.step()
        if engine.get_request("a").num_computed_tokens:
            break
    assert engine.get_request("a").num_computed_tokens == 16


def test_a_request_aborted_in_its_re_prefill_counts_only_what_was_prefilled_again(tiny_model_dir):
    engine = _computed_48_then_recomputed(tiny_model_dir)
    _re_prefill_one_chunk(engine)
    assert engine.abort("a")
    stats = engine.stats()
    assert stats.wasted_tokens == 48
    assert stats.recomputed_tokens == 16
    assert _exported(engine) == 16


def test_a_request_aborted_before_it_resumed_counts_none(tiny_model_dir):
    engine = _computed_48_then_recomputed(tiny_model_dir)
    assert engine.abort("a")
    assert engine.stats().recomputed_tokens == 0 and _exported(engine) == 0


def test_recomputed_again_in_its_re_prefill_it_counts_each_token_each_time_it_is_prefilled_again(tiny_model_dir):
    """Discarded at 48, re-prefilled to 16, discarded again at 16: it finishes after prefilling 16 + 48 tokens again,
    as many as were thrown away (16 + 48)."""
    engine = _computed_48_then_recomputed(tiny_model_dir)
    _re_prefill_one_chunk(engine)
    engine.suspend("a", "recompute")
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert steps < 100
    stats = engine.stats()
    assert stats.wasted_tokens == 48 + 16
    assert stats.recomputed_tokens == 16 + 48
