"""A request resumed from the output an earlier run produced (a re-dispatched job: DispatchJob.resume_token_ids).

The engine prefills prompt + that output and samples on from its index; sampling is seeded by (seed, index), so
the rest equals what the request draws when run from the start, greedy or sampled, and whatever else shares its
batch. Bad resumed output is refused like a bad prompt; output past an EOS, or that would leave nothing to
generate, is cut so the request still generates and ends here.
"""

from __future__ import annotations

import pytest

from common.errors import InvalidRequest
from worker import Engine, EngineConfig, SamplingParams


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams, list[int]]]) -> dict[str, list[int]]:
    for rid, (prompt, params, resumed) in requests.items():
        engine.add_request(rid, prompt, params, output_token_ids=resumed)
    out = {rid: [] for rid in requests}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return out


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return Engine.from_pretrained(str(tiny_model_dir), EngineConfig(max_num_seqs=4, max_num_batched_tokens=64))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("cut", [1, 17, 47])
def test_resumed_output_goes_on_as_the_run_from_the_start(engine, temperature, cut):
    prompt = [5, 9, 300, 41, 7, 77, 12]
    params = dict(max_tokens=48, temperature=temperature, top_p=0.95, seed=1234, ignore_eos=True)
    whole = run(engine, {"full": (prompt, SamplingParams(**params), [])})["full"]
    # Resumed beside another request, so the batch differs from the first run's.
    rest = run(engine, {"resumed": (prompt, SamplingParams(**params), whole[:cut]),
                        "other": ([8, 8, 8], SamplingParams(max_tokens=30, ignore_eos=True), [])})["resumed"]
    assert whole[:cut] + rest == whole and len(rest) == 48 - cut
    assert engine.kv_usage().num_used == 0


def test_resumed_output_is_cut_before_an_eos_and_leaves_a_token_to_generate(engine):
    eos = engine.scheduler.config.eos_token_ids[0]
    prompt = [5, 6, 7]
    engine.add_request("eos", prompt, SamplingParams(max_tokens=10), output_token_ids=[11, 12, eos, 13])
    assert engine.get_request("eos").output_token_ids == [11, 12]  # the earlier run had ended at the EOS
    engine.add_request("full", prompt, SamplingParams(max_tokens=3, ignore_eos=True), output_token_ids=[11, 12, 13])
    assert engine.get_request("full").output_token_ids == [11, 12]  # it generates its last token here
    for rid in ("eos", "full"):
        engine.abort(rid)


def test_resumed_output_is_cut_before_a_stop_token_and_the_result_ends_there(engine):
    """A stop token ends a request as an EOS does. Before, only an EOS cut the resumed output: a request resumed
    with the whole output of a run that had stopped (the worker died before saying it finished) went on past its
    stop token, and returned tokens the run from the start never produces."""
    prompt = [5, 9, 300, 41, 7]
    whole = run(engine, {"full": (prompt, SamplingParams(max_tokens=12, ignore_eos=True), [])})["full"]
    stop = whole[4]
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=(stop,))
    stopped = run(engine, {"stopped": (prompt, params, [])})["stopped"]
    assert stopped == whole[:whole.index(stop) + 1]
    for cut in range(1, len(stopped) + 1):
        rest = run(engine, {"resumed": (prompt, params, stopped[:cut])})["resumed"]
        assert stopped[:min(cut, len(stopped) - 1)] + rest == stopped, cut
    assert engine.kv_usage().num_used == 0


# 5, None, 2.5: len() of them raised TypeError, not the typed refusal.
@pytest.mark.parametrize("bad", [[1, -1], [1, 10**9], [1.5], "abc", [True], 5, None, 2.5])
def test_bad_resumed_output_is_refused_and_changes_nothing(engine, bad):
    before = engine.kv_usage().num_used
    with pytest.raises(InvalidRequest) as e:
        engine.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=5), output_token_ids=bad)
    assert e.value.field == "output_token_ids"
    assert engine.get_request("bad") is None and not engine.has_unfinished()
    assert engine.kv_usage().num_used == before


def test_a_resumed_requests_prompt_is_counted_once_and_its_earlier_output_not_again(engine):
    """ts_prompt_tokens_total counts a prompt at the request's first token. A resumed request's first token here
    is past its earlier output, so its prompt was never counted; ts_generation_tokens_total counts only the tokens
    sampled here (the earlier ones were counted where they were drawn)."""
    from worker import metrics

    def counted() -> tuple[float, float]:
        return metrics.PROMPT_TOKENS._value.get(), metrics.GENERATION_TOKENS._value.get()

    before = counted()
    run(engine, {"resumed": ([5, 9, 300, 41, 7], SamplingParams(max_tokens=20, ignore_eos=True), [3] * 12),
                 "fresh": ([8, 8, 8], SamplingParams(max_tokens=6, ignore_eos=True), [])})
    after = counted()
    assert (after[0] - before[0], after[1] - before[1]) == (5 + 3, (20 - 12) + 6)
