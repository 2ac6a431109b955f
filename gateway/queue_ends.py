"""The queue's ends: a dispatched job completed, a queued or dispatched job cancelled (a mixin of
gateway.redis_queue.RedisQueue). Each end is one script (common/lua/complete.lua, cancel.lua), run after the token
log's writes it would otherwise refuse, in the same round trip: the record a job ended with is final.
"""

from __future__ import annotations

from collections.abc import Mapping

import redis

from common.errors import IncompleteResult
from common.redis_keys import run_pipelined
from gateway.queue_records import _QUEUE_FIELDS, WITHDRAWN_MARK, JobRecord, JobState, Stored
from gateway.token_log import first_prefill_call, first_token_call


def _now(now_ms: int | None) -> str:
    """A script's "now" argument: empty means the script reads Redis TIME (one clock for all gateways)."""
    return "" if now_ms is None else str(int(now_ms))


class QueueEnds:
    """Needs the queue's ``client``, ``keys``, ``_scripts``, ``_retention_ms``, ``drain_tau_s`` and
    ``_reply_deadline_ms``."""

    # --- completion ------------------------------------------------------------------------
    def complete(
        self, job_id: str, *, attempt: int, state: str, fields: Mapping[str, str | int | float | bytes],
        worker: str, now_ms: int | None = None,
    ) -> bool:
        """Finish a dispatched job as done or failed; False (nothing changed) if the attempt is stale or
        ``worker`` does not hold its lease. A done job needs ``num_tokens`` and ``token_ids`` (msgpack)
        of that many tokens: anything else raises IncompleteResult and changes nothing."""
        return self.complete_recording(job_id, attempt=attempt, state=state, fields=fields, worker=worker,
                                       now_ms=now_ms)[0] is not None

    def complete_recording(
        self, job_id: str, *, attempt: int, state: str, fields: Mapping[str, str | int | float | bytes],
        worker: str, now_ms: int | None = None, first_prefill_ms: int | None = None,
        first_token_claim: str | None = None,
    ) -> tuple[Stored | None, bool]:
        """complete(), and in the same round trip, before it, what the token log's next flush would have written
        into the job's hash (a finished job's record must not change after its result): its first prefill start
        (first_prefill.lua) and the claim of its first token's observation for the gateway named (first_token.lua).
        Returns (the figures stored, None if the attempt was stale; claim won)."""
        final = JobState(state)
        if final not in (JobState.DONE, JobState.FAILED):
            raise ValueError(f"complete() takes state 'done' or 'failed', got {state!r}")
        clash = sorted(set(fields) & _QUEUE_FIELDS)
        if clash:
            raise ValueError(f"result fields may not overwrite queue fields: {clash}")
        flat: list[str | bytes] = []
        for name, value in fields.items():
            if isinstance(value, bool) or not isinstance(value, (str, bytes, int, float)):
                raise TypeError(f"result field {name!r} must be str, bytes, int or float, got {type(value).__name__}")
            flat += [name, value if isinstance(value, (str, bytes)) else repr(value)]
        keys = [self.keys.job(job_id), self.keys.inflight, self.keys.drain, self.keys.tokens(job_id)]
        args = [job_id, str(attempt), final.value, _now(now_ms), self._retention_ms,
                str(int(self.drain_tau_s * 1000)), worker, self._reply_deadline_ms(), *flat]  # fmt: skip
        try:
            stored, won = self._after_flush("complete", keys, args, job_id, first_prefill_ms, first_token_claim)
        except redis.ResponseError as e:
            if "incomplete result" in str(e):
                raise IncompleteResult(str(e)) from None
            raise
        if stored == b"late":  # as the timeout it came close to: the caller keeps the result and stores it again
            raise redis.TimeoutError("the completion reached Redis as its caller gave up on it; nothing was changed")
        if not stored:
            return None, won
        _, queued, total_ms, ttft = stored
        return Stored(float(queued) if queued else None, int(total_ms) / 1000, float(ttft) if ttft else None), won

    # --- cancel ----------------------------------------------------------------------------
    def stop_at(self, job_id: str, n: int) -> JobRecord | None:
        """Keep the stop ``n`` with a queued or dispatched job (stop_at.lua: lowered, never raised), so that every
        later attempt ends there too; the job as it is now, or None (finished or unknown: nothing changed)."""
        raw = self._scripts["stop_at"](keys=[self.keys.job(job_id)], args=[int(n)])
        return JobRecord.from_redis(raw) if raw else None

    def cancel(self, job_id: str, *, now_ms: int | None = None, reason: str = "cancelled") -> JobRecord | None:
        """Cancel a queued or dispatched job; returns it as it was, with the reason and finished_at_ms it ended
        with, or None if unknown or final."""
        return self.cancel_recording(job_id, now_ms=now_ms, reason=reason)[0]

    def withdraw(self, tenant: str, idempotency_key: str, ttl_s: int) -> str | None:
        """The job admitted under the tenant's ``idempotency_key``, to cancel; or None, where none is: the key is
        then marked withdrawn for ``ttl_s`` (admit.lua refuses a submission under it; a mark set before stays). SET NX
        first, so an admission racing it either wrote the key before (its job is returned) or finds the mark."""
        key = self.keys.idem(tenant, idempotency_key)
        while not self.client.set(key, WITHDRAWN_MARK, nx=True, px=ttl_s * 1000):
            stored = self.client.get(key)
            if stored is not None:
                job_id = stored.decode(errors="replace").partition(" ")[0]
                return None if job_id == WITHDRAWN_MARK else job_id
            # Gone in between (it expired): no job holds the key now, and a late submission may still come; mark it.
        return None

    def cancel_recording(self, job_id: str, *, now_ms: int | None = None, reason: str = "cancelled",
                         first_prefill_ms: int | None = None,
                         first_token_claim: str | None = None) -> tuple[JobRecord | None, bool]:
        """cancel(), and in the same round trip, before it, what the token log's next flush would have written into
        the job's hash (as complete_recording: the record a job ended with is final, first_token.lua): its first
        prefill start and the claim of its first token for the gateway named. Returns (the job as it was, with
        what those wrote, or None; claim won)."""
        keys = [self.keys.job(job_id), *self.keys.queues(), self.keys.inflight, self.keys.aging, self.keys.deadlines,
                self.keys.tokens(job_id)]  # fmt: skip
        args = [job_id, _now(now_ms), self._retention_ms, reason, self._reply_deadline_ms()]
        raw, won = self._after_flush("cancel", keys, args, job_id, first_prefill_ms, first_token_claim)
        if raw == b"late":  # as the timeout it came close to: the caller retries, and its retry cancels
            raise redis.TimeoutError("the cancel reached Redis as its caller gave up on it; nothing was changed")
        return (JobRecord.from_redis(raw) if raw else None), won

    def _after_flush(self, script: str, keys: list, args: list, job_id: str, first_prefill_ms: int | None,
                     first_token_claim: str | None) -> tuple[object, bool]:
        """(``script``'s reply, claim won): the script run after, in the same round trip, the writes of the token
        log's next flush for the job (its first prefill start, the claim of its first token for the gateway named)
        that the end it makes would otherwise refuse (the record a job ended with is final)."""
        calls = []
        if first_prefill_ms is not None:
            calls.append(first_prefill_call(self.keys, job_id, first_prefill_ms))
        if first_token_claim is not None:
            calls.append(first_token_call(self.keys, job_id, first_token_claim))
        if not calls:
            return self._scripts[script](keys=keys, args=args), False
        *before, reply = run_pipelined(self.client, [*calls, (script, keys, args)])
        return reply, first_token_claim is not None and bool(before[-1])
