"""What the engine does when a step fails (device out of memory, or any exception from the model
runner or the sampler): the requests in that step end with ``FinishReason.ERROR`` and a reason, their
KV blocks go back to the pool, and everything else keeps its place.

Requests outside the step are untouched, except one case: a request that was to be swapped out in
this step (a running victim, or a keep-suspended one demoted to swap), when the copies themselves
failed, may have lost its KV on the way, so it resumes by recompute instead.
"""

from __future__ import annotations

import logging
import time

from worker.preemption import PreemptMode
from worker.request import FinishReason, RequestOutput
from worker.scheduler import SchedulerOutput

log = logging.getLogger("worker.engine")

MAX_REASON_CHARS = 500


def fail_step(engine, sched: SchedulerOutput, error: BaseException, copies_done: bool) -> list[RequestOutput]:
    """End the requests of the failed step ``sched``; their outputs (finished, ERROR, ``error`` set)."""
    reason = f"step failed: {type(error).__name__}: {error}"[:MAX_REASON_CHARS]
    affected = list({id(c.request): c.request for c in sched.chunks}.values())
    log.error("%s; failing %d requests: %s", reason, len(affected), [r.request_id for r in affected],
              exc_info=error)
    _release_cached_device_memory(engine.runner)
    if not copies_done:
        for req in sched.swapped_out:
            if req.preempt_mode == PreemptMode.SWAP.value and not req.is_finished:
                engine.scheduler.swap_lost(req)
    now = time.monotonic()
    outputs = []
    for req in affected:
        if req.is_finished:
            continue
        engine.scheduler.remove(req, FinishReason.ERROR)
        req.finish_time = now
        engine._requests.pop(req.request_id, None)
        engine.tracer.request_finished(req)
        outputs.append(RequestOutput(req.request_id, [], True, FinishReason.ERROR, len(req.output_token_ids),
                                     req.num_preemptions, error=reason))
    return outputs


def _release_cached_device_memory(runner) -> None:
    """After a CUDA out-of-memory, hand the allocator's cached blocks back so the next step can succeed."""
    device = getattr(runner, "device", None)
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.empty_cache()
