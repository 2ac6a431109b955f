"""Issue 10, item 8: an exception in a step (device out of memory, a model or sampler error) fails the
requests of that step with a reason and frees their blocks; the engine and the worker process keep
serving everything else. Faults are injected into the real model runner of a real engine."""

from __future__ import annotations

from common import protocol as P
from worker import Engine, EngineConfig, FinishReason, SamplingParams


def _fail_once(obj, name: str, at_call: int, error: BaseException) -> None:
    """Make ``obj.name`` raise ``error`` on its ``at_call``-th call (fault injection into the real runner)."""
    real, calls = getattr(obj, name), {"n": 0}

    def wrapper(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at_call:
            raise error
        return real(*args, **kwargs)

    setattr(obj, name, wrapper)


def _run(engine: Engine, max_steps: int = 2000):
    tokens, outs = {}, {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                outs[o.request_id] = o
        engine.blocks.check_invariants()
    return tokens, outs


def _prompt(i: int) -> list[int]:
    return [(7 * i + j) % 500 + 3 for j in range(12 + i)]


def test_out_of_memory_in_a_step_fails_its_requests_and_the_engine_goes_on(tiny_model_dir):
    import torch

    cfg = EngineConfig(num_kv_blocks=32, block_size=16, max_num_seqs=2)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    reference = Engine.from_pretrained(tiny_model_dir, cfg)
    for i in range(4):
        reference.add_request(f"r{i}", _prompt(i), params)
    expected, _ = _run(reference)

    engine = Engine.from_pretrained(tiny_model_dir, cfg)
    for i in range(4):  # two slots: r0 and r1 run, r2 and r3 wait
        engine.add_request(f"r{i}", _prompt(i), params)
    _fail_once(engine.runner, "execute", 2, torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    tokens, outs = _run(engine)
    for rid in ("r0", "r1"):
        assert outs[rid].finish_reason is FinishReason.ERROR and "out of memory" in outs[rid].error
        assert tokens[rid] == expected[rid][:1]  # the first step's token, nothing after the failure
    for rid in ("r2", "r3"):
        assert outs[rid].finish_reason is FinishReason.LENGTH and outs[rid].error is None
        assert tokens[rid] == expected[rid]
    assert engine.kv_usage().num_used == 0
    engine.add_request("after", _prompt(0), params)  # and it keeps serving
    assert _run(engine)[0]["after"] == expected["r0"]


def test_a_failed_swap_out_makes_the_victim_recompute_instead(tiny_model_dir):
    cfg = EngineConfig(num_kv_blocks=32, block_size=16, max_num_seqs=4, swap_space_mb=16)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    reference = Engine.from_pretrained(tiny_model_dir, cfg)
    for i in range(2):
        reference.add_request(f"r{i}", _prompt(i), params)
    expected, _ = _run(reference)

    engine = Engine.from_pretrained(tiny_model_dir, cfg)
    for i in range(2):
        engine.add_request(f"r{i}", _prompt(i), params)
    engine.step(), engine.step()
    engine.suspend("r1", "swap")  # its copy to the host goes out with the next step, and fails
    _fail_once(engine.runner, "copy_blocks", 1, RuntimeError("copy engine fault"))
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("r0", FinishReason.ERROR)]
    r1 = engine.get_request("r1")
    assert r1.preempt_mode == "recompute" and r1.num_computed_tokens == 0
    assert not engine.scheduler.host_blocks.has_blocks("r1")
    tokens, outs = _run(engine)
    assert tokens["r1"] == expected["r1"][2:] and outs["r1"].finish_reason is FinishReason.LENGTH
    assert engine.kv_usage().num_used == 0 and engine.scheduler.host_blocks.num_free == \
        engine.scheduler.host_blocks.num_blocks


def test_a_failed_swap_out_of_a_demoted_keep_suspended_request_makes_it_recompute(tiny_model_dir):
    """A keep-suspended request whose blocks a P0 takes is demoted to swap in the step: if that step's copies fail,
    its KV never reached the host. Before, only running victims were recovered: the donor resumed from a host pool
    it was never copied to and decoded on from garbage (silently wrong tokens)."""
    cfg = EngineConfig(num_kv_blocks=12, block_size=4, max_num_seqs=2, swap_space_mb=1, min_residency_steps=0,
                       guard_remaining_tokens=0, recompute_tokens_per_s=1.0, isolate_p0_prefill=False)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = {"a": [5 + i for i in range(8)], "b": [40 + i for i in range(8)]}
    reference = Engine.from_pretrained(tiny_model_dir, cfg)
    for rid, prompt in prompts.items():
        reference.add_request(rid, prompt, params, tier="P3")
    expected, _ = _run(reference)

    engine = Engine.from_pretrained(tiny_model_dir, cfg)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params, tier="P3")
    tokens, _ = _run(engine, max_steps=3)
    engine.add_request("p0a", [100, 101, 102, 103], SamplingParams(max_tokens=12, ignore_eos=True), tier="P0")
    for o in engine.step():  # p0a takes b's slot; b keeps its blocks (only the slot was needed)
        tokens[o.request_id] = tokens.get(o.request_id, []) + o.new_token_ids
    b = engine.get_request("b")
    assert b.preempt_mode == "keep" and engine.blocks.has_blocks("b")
    # p0b needs more blocks than are free: b gives up its blocks by swap (cheaper than recompute at 1 token/s).
    engine.add_request("p0b", [200 + i for i in range(12)], SamplingParams(max_tokens=8, ignore_eos=True), tier="P0")
    _fail_once(engine.runner, "copy_blocks", 1, RuntimeError("copy engine fault"))
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == ["p0a", "p0b"]
    assert engine.scheduler.stats.demotions == 1
    assert b.preempt_mode == "recompute" and b.num_computed_tokens == 0
    assert not engine.scheduler.host_blocks.has_blocks("b")
    rest, outs = _run(engine)
    for rid in prompts:
        assert tokens[rid] + rest.get(rid, []) == expected[rid], rid
        assert outs[rid].finish_reason is FinishReason.LENGTH
    assert engine.kv_usage().num_used == 0
    assert engine.scheduler.host_blocks.num_free == engine.scheduler.host_blocks.num_blocks


def test_the_worker_reports_a_failed_step_and_keeps_serving(tiny_model_dir):
    import threading

    import torch
    import zmq

    from worker.service import WorkerService
    from worker.service_config import WorkerConfig

    ctx = zmq.Context.instance()
    gateway = ctx.socket(zmq.ROUTER)
    port = gateway.bind_to_random_port("tcp://127.0.0.1")
    engine = Engine.from_pretrained(tiny_model_dir, EngineConfig(num_kv_blocks=32, block_size=16, max_num_seqs=4))
    service = WorkerService(WorkerConfig(worker_id="wk-oom", gateways=[f"tcp://127.0.0.1:{port}"], model="tiny"),
                            engine)
    service.connect()
    # After the start-up calibration in connect() (its own steps): the first step of a dispatched job fails.
    _fail_once(engine.runner, "execute", 1, torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    stop = threading.Event()
    thread = threading.Thread(target=service.serve, args=(stop.is_set,), daemon=True)
    thread.start()

    def receive(kind: type, job_id: str | None = None, timeout_ms: int = 60_000):
        while gateway.poll(timeout_ms):
            ident, frame = gateway.recv_multipart()
            msg = P.decode(frame)
            if isinstance(msg, kind) and (job_id is None or msg.job_id == job_id):
                return ident, msg
        raise AssertionError(f"no {kind.__name__} from the worker")

    try:
        ident, hello = receive(P.WorkerHello)
        assert hello.tier_max_tokens == engine.tier_limits()
        assert hello.max_num_batched_tokens == engine.config.max_num_batched_tokens  # its step, for wait estimates
        for job_id in ("doomed", "fine"):
            gateway.send_multipart([ident, P.encode(P.DispatchJob(
                job_id, 1, "P1", "t", _prompt(1), 5, 0.0, 1.0, None, 1, "gw", ignore_eos=True))])
            _, done = receive(P.JobFinished, job_id)
            if job_id == "doomed":
                assert done.state == "failed" and "out of memory" in done.reason and done.finish_reason is None
            else:
                assert done.state == "done" and done.num_tokens == 5 and done.reason is None
        assert thread.is_alive() and engine.kv_usage().num_used == 0
    finally:
        stop.set()
        thread.join(30)
        service.close()
        gateway.close(linger=0)
