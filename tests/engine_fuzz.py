"""A seeded adversarial driver for the real engine over the tiny model, checking invariants after every step.

Each case draws a small engine (a pool that may only just hold one request, a few slots, chunked prefill, swap or
recompute, a P0 block/slot reserve, a matrix where P1 may not preempt P2) and a request mix built to hit the edges:
prompts of exactly max_model_len - max_tokens, max_tokens=1, identical prompts, P0 floods of several requests a step,
re-dispatched jobs with output to go on from, manual suspends, and aborts in every state. Greedy sampling, so every
request's tokens must equal the same request run alone (``Reference``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from common.errors import InvalidRequest
from worker import Engine, EngineConfig, FinishReason, SamplingParams
from worker.preemption import PreemptMode
from worker.request import RequestStatus

VOCAB = 512  # models/configs/tiny-llama.json


class Reference:
    """Greedy output of a prompt run alone in an engine of its own (cached per prompt, longest run kept)."""

    def __init__(self, model_dir, max_model_len: int) -> None:
        self.engine = Engine.from_pretrained(model_dir, EngineConfig(max_model_len=max_model_len, num_kv_blocks=64,
                                                                     block_size=16, swap_space_mb=0))
        self.max_model_len = max_model_len
        self._cache: dict[tuple[int, ...], list[int]] = {}
        self._n = 0

    def tokens(self, prompt: list[int], max_tokens: int, ignore_eos: bool) -> list[int]:
        """What the request generates alone: EOS (id 1) ends it unless ignore_eos."""
        key = tuple(prompt)
        if len(self._cache.get(key, ())) < max_tokens:
            self._n += 1
            rid = f"ref{self._n}"
            self.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), tier="P0")
            out: list[int] = []
            while self.engine.has_unfinished():
                for o in self.engine.step():
                    out.extend(o.new_token_ids)
            self._cache[key] = out
        out = self._cache[key][:max_tokens]
        if not ignore_eos and 1 in out:
            out = out[:out.index(1) + 1]
        return out


@dataclass
class Spec:
    rid: str
    prompt: list[int]
    params: SamplingParams
    tier: str
    resumed: list[int] = field(default_factory=list)


def random_config(rng: random.Random) -> EngineConfig:
    block_size = rng.choice([2, 4, 8, 16])
    max_model_len = rng.choice([24, 40, 64])
    per_request = -(-max_model_len // block_size)
    # From "only just one request" to a few.
    num_blocks = rng.choice([per_request, per_request + 1, 2 * per_request, 3 * per_request + 1])
    max_num_seqs = rng.randint(1, 5)
    chunked = rng.random() < 0.8
    matrix = rng.choice([None, {"P0": ["P1", "P2", "P3"], "P1": ["P3"]}, {"P0": ["P2", "P3"], "P1": ["P2", "P3"]},
                         {"P0": ["P3"]}])
    return EngineConfig(
        block_size=block_size, num_kv_blocks=num_blocks, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=rng.choice([4, 8, 32]) if chunked else max_model_len,
        enable_chunked_prefill=chunked, isolate_p0_prefill=rng.random() < 0.5,
        preemption_matrix=matrix, min_residency_steps=rng.choice([0, 2, 8]),
        guard_remaining_tokens=rng.choice([0, 2, 4]), guard_max_generated=rng.choice([None, None, 6]),
        p0_reserve_blocks=rng.choice([0, 0, 1]), p0_reserve_slots=min(max_num_seqs - 1, rng.choice([0, 0, 1])),
        low_tier_kv_share=rng.choice([1.0, 1.0, 0.75]), swap_space_mb=rng.choice([0, 1]),
        recompute_tokens_per_s=rng.choice([None, 1e12]))


def random_specs(rng: random.Random, n: int, max_model_len: int, prefix: str) -> list[Spec]:
    shared = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, max_model_len - 1))]
    specs = []
    for i in range(n):
        max_tokens = rng.choice([1, 1, 2, rng.randint(1, 12), rng.randint(1, max_model_len - 1)])
        shape = rng.random()
        if shape < 0.2:  # exactly the context
            plen = max_model_len - max_tokens
        elif shape < 0.35:  # identical prompts
            plen = len(shared)
        else:
            plen = rng.randint(1, max(1, min(30, max_model_len - max_tokens)))
        plen = max(1, min(plen, max_model_len - 1))
        max_tokens = min(max_tokens, max_model_len - plen)
        prompt = shared[:plen] if shape >= 0.2 and shape < 0.35 else [rng.randrange(3, VOCAB) for _ in range(plen)]
        tier = rng.choice(["P0", "P1", "P2", "P3"])
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=rng.random() < 0.7)
        specs.append(Spec(f"{prefix}{i}", prompt, params, tier))
    return specs


@dataclass
class Outcome:
    tokens: dict[str, list[int]]
    reasons: dict[str, FinishReason]
    aborted: set[str]
    refused: set[str]
    steps: int
    seen_states: set[str]


def check_step(engine: Engine) -> None:
    s = engine.scheduler
    engine.blocks.check_invariants()
    if s.host_blocks is not None:
        s.host_blocks.check_invariants()
    live = {r.request_id for r in s.running + s.waiting}
    assert set(engine.blocks._tables) <= live, f"blocks held by finished requests: {set(engine.blocks._tables) - live}"
    if s.host_blocks is not None:
        assert set(s.host_blocks._tables) <= live
    assert len(s.running) <= s.config.max_num_seqs
    assert len(live) == len(s.running) + len(s.waiting), "a request both running and waiting"
    assert set(engine._requests) == live, "the engine's requests and the scheduler's queues disagree"
    for r in s.running + s.waiting:
        assert len(r.output_token_ids) <= r.params.max_tokens, r.request_id
        assert r.num_tokens <= engine.max_model_len, r.request_id
        assert r.num_computed_tokens <= r.num_tokens
        held = len(engine.blocks.block_table(r.request_id))
        if r.preempt_mode == PreemptMode.SWAP.value:  # its KV is on the host
            held = len(s.host_blocks.block_table(r.request_id))
        assert held * engine.blocks.block_size >= r.num_computed_tokens, f"{r.request_id} computed past its blocks"
        if r.status is RequestStatus.RUNNING:
            assert r in s.running
        else:
            assert r in s.waiting


def run_case(model_dir, seed: int, ref: Reference | None = None, n: int = 24, max_steps: int = 4000,
             fail: bool = True) -> Outcome:
    rng = random.Random(seed)
    config = random_config(rng)
    engine = Engine.from_pretrained(model_dir, config)
    ref = ref or Reference(model_dir, engine.max_model_len)
    specs = {s.rid: s for s in random_specs(rng, n, engine.max_model_len, f"s{seed}-")}
    # Arrival step per request: bursts (several at once), P0 floods.
    arrivals: dict[int, list[Spec]] = {}
    for s in specs.values():
        at = rng.choice([0, 0, rng.randint(0, 10), rng.randint(0, 60)])
        if s.tier == "P0" and rng.random() < 0.5:
            at = rng.randint(5, 8)  # a flood: several P0s in the same few steps
        if rng.random() < 0.15 and s.params.max_tokens > 1:  # a re-dispatched job: goes on from earlier output
            done = ref.tokens(s.prompt, s.params.max_tokens, s.params.ignore_eos)
            s.resumed = done[:rng.randint(1, max(1, len(done) - 1))]
        arrivals.setdefault(at, []).append(s)
    fail_steps = set(rng.sample(range(1, 80), rng.choice([0, 0, 2]))) if fail else set()
    failed: set[str] = set()
    abort_p = rng.choice([0.0, 0.02, 0.05])
    suspend_p = rng.choice([0.0, 0.05, 0.15])
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    aborted: set[str] = set()
    refused: set[str] = set()
    seen: set[str] = set()
    inversions: dict[str, int] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for s in arrivals.get(step, []):
            try:
                engine.add_request(s.rid, s.prompt, s.params, tier=s.tier, output_token_ids=s.resumed)
            except InvalidRequest:
                refused.add(s.rid)
                continue
            tokens[s.rid] = list(engine.get_request(s.rid).output_token_ids)
        live = list(engine.scheduler.running + engine.scheduler.waiting)
        for r in live:
            roll = rng.random()
            if roll < abort_p:
                state = _state(r)
                seen.add(f"abort:{state}")
                assert engine.abort(r.request_id)
                aborted.add(r.request_id)
                check_step(engine)
            elif roll < abort_p + suspend_p and r.status is RequestStatus.RUNNING:
                mode = rng.choice(list(PreemptMode))
                try:
                    engine.suspend(r.request_id, mode)
                except ValueError:
                    continue
                seen.add(f"suspend:{mode.value}")
        if step in fail_steps:  # fault injection into the real runner: this step's copies or forward raise
            _fail_next(engine.runner, rng.choice(["execute", "copy_blocks"]))
            seen.add("step-failure")
        for out in engine.step():
            rid = out.request_id
            if out.finish_reason is FinishReason.ERROR:
                failed.add(rid)
            assert rid not in reasons and rid not in aborted, f"{rid} produced output after it ended"
            tokens[rid].extend(out.new_token_ids)
            assert out.num_output_tokens == len(tokens[rid]), (rid, out.num_output_tokens, len(tokens[rid]))
            if out.finished:
                reasons[rid] = out.finish_reason
        for r in engine.scheduler.running + engine.scheduler.waiting:
            seen.add(_state(r))
        check_step(engine)
        _check_inversion(engine, inversions)
        step += 1
        assert step < max_steps, f"seed {seed}: no end after {step} steps: " + _dump(engine)
    assert engine.kv_usage().num_used == 0
    host = engine.scheduler.host_blocks
    assert host is None or host.num_free == host.num_blocks
    for rid, s in specs.items():
        if rid in refused or rid in aborted:
            continue
        want = ref.tokens(s.prompt, s.params.max_tokens, s.params.ignore_eos)
        if rid in failed:
            assert tokens[rid] == want[:len(tokens[rid])], f"seed {seed}: {rid} failed with wrong tokens"
            continue
        assert reasons.get(rid) in (FinishReason.STOP, FinishReason.LENGTH), (seed, rid, reasons.get(rid))
        assert tokens[rid] == want, (f"seed {seed}: {rid} ({s.tier}, prompt {len(s.prompt)}, "
                                     f"max_tokens {s.params.max_tokens}, resumed {len(s.resumed)}): "
                                     f"{tokens[rid]} != alone {want}")
    return Outcome(tokens, reasons, aborted, refused, step, seen)


# Steps the queue head may wait while a victim it may preempt runs unguarded and the step's token budget had room:
# the step it arrived in (phase 0 ran before it was queued) and the one after a manual suspend (the request that
# gave way does not resume in the step after, and strict order holds everyone behind it).
MAX_INVERSION_STEPS = 2


def _check_inversion(engine: Engine, waited: dict[str, int]) -> None:
    s = engine.scheduler
    pc = s.preemption.config
    for w in list(waited):
        if w not in {r.request_id for r in s.waiting[:1]}:
            del waited[w]
    left = s.config.max_num_batched_tokens - engine.last_batched_tokens
    for w in s.waiting[:1]:  # strict policy order: whoever is behind the head waits for it
        victims = [v for v in s.running
                   if pc.may_preempt(w.tier, v.tier) and s.preemption.guard(v, s.step_index) is None]
        if not victims:
            waited.pop(w.request_id, None)
            continue
        # Running work took the token budget: a chunk needs one token of it; an unchunked remainder needs all its
        # tokens, and the victims' own tokens count (they give them up when they give way).
        unchunked = not s.config.enable_chunked_prefill
        if (left + sum(v.num_uncomputed_tokens for v in victims) < w.num_uncomputed_tokens if unchunked
                else left < 1):
            waited.pop(w.request_id, None)
            continue
        # Only the slot matters when the victims' blocks and the free ones would hold it.
        held = sum(len(engine.blocks.block_table(v.request_id)) for v in victims)
        if s._missing(w, 1, starting=True) > s._usable_free(w) + held:
            waited.pop(w.request_id, None)
            continue
        waited[w.request_id] = waited.get(w.request_id, 0) + 1
        assert waited[w.request_id] <= MAX_INVERSION_STEPS, (
            f"{w.request_id} ({w.tier.value}) waited {waited[w.request_id]} steps while it could preempt "
            f"{[v.request_id for v in victims]}: " + _dump(engine))


def _fail_next(runner, name: str) -> None:
    """Make the runner's next ``name`` call raise (its copies or its forward pass), then behave again."""
    real = getattr(runner, name)

    def once(*args, **kwargs):
        setattr(runner, name, real)
        raise RuntimeError(f"injected {name} fault")

    setattr(runner, name, once)


def _state(r) -> str:
    if r.status is RequestStatus.RUNNING:
        return "prefilling" if r.num_computed_tokens < r.num_prompt_tokens else "running"
    if r.status is RequestStatus.SUSPENDED:
        return f"suspended-{r.preempt_mode}"
    return "waiting"


def _dump(engine: Engine) -> str:
    s = engine.scheduler
    return "; ".join(f"{r.request_id} {r.tier.value} {r.status.value} {r.preempt_mode} computed "
                     f"{r.num_computed_tokens}/{r.num_tokens} out {len(r.output_token_ids)}/{r.params.max_tokens} "
                     f"blocks {len(engine.blocks.block_table(r.request_id))}"
                     for r in s.running + s.waiting) + f"; free {engine.blocks.num_free}/{engine.blocks.num_blocks}"
