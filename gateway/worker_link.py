"""Worker frames: hello, load reports (which extend leases), token frames and job completions.

A mixin of gateway.server.Gateway.
"""

from __future__ import annotations

import msgpack

from common import protocol as P
from gateway.timeutil import ms as _ms


class WorkerLink:
    """Handlers of WorkerHello, WorkerLoad, JobTokens and JobFinished."""

    def on_hello(self, ident: bytes, msg: P.WorkerHello) -> None:
        if ident != msg.worker_id.encode():
            self.counters["malformed"] += 1
            return
        self.workers.hello(msg, ident, self.clock())
        self._send(self.worker_sock, ident, P.GatewayWelcome(self.config.gateway_id))
        self._dirty = True

    def on_load(self, ident: bytes, msg: P.WorkerLoad) -> None:
        now = self.clock()
        if ident != msg.worker_id.encode() or not self.workers.load(msg, now):
            return
        w = self.workers.workers[msg.worker_id]
        # A job this gateway sent that ended before any report listed it, and whose JobFinished went to
        # another gateway (its reply_to) or that was cancelled or requeued, would hold credit here forever.
        for job_id in list(w.pending):
            rec = self.queue.get(job_id)
            if rec is None or rec.state != "dispatched" or rec.worker != msg.worker_id:
                w.pending.discard(job_id)
        self._urgent_sent &= set().union(*(x.pending for x in self.workers.workers.values()))
        if msg.job_ids:
            self.queue.extend_leases(msg.worker_id, msg.job_ids, _ms(now), _ms(self.config.lease_s))
        self._dirty = True

    def on_tokens(self, ident: bytes, msg: P.JobTokens) -> None:
        if msg.job_id not in self.streams.streams:
            return  # not ours (or long finished): nothing to forward
        if self.streams.add_tokens(msg.job_id, msg.index, msg.token_ids, self.clock()):
            self._flush(msg.job_id)

    def on_finished(self, ident: bytes, msg: P.JobFinished) -> None:
        if msg.state not in ("done", "failed"):  # a malformed frame, not a handler error
            self.counters["malformed"] += 1
            self._send(self.worker_sock, ident, P.ErrorReply("protocol", f"JobFinished.state {msg.state!r} is not "
                                                             "done or failed", field="state"))
            return
        now = self.clock()
        s = self.streams.streams.get(msg.job_id)
        tokens = s.tokens if s is not None else []
        fields = {"finish_reason": msg.finish_reason or "", "num_tokens": msg.num_tokens,
                  "token_ids": msgpack.packb(tokens), "run_s": msg.run_s, "preemptions": msg.preemptions,
                  "ttft_s": -1.0 if msg.ttft_s is None else msg.ttft_s}
        if msg.reason:
            fields["reason"] = msg.reason
        if s is not None and s.first_token_at is not None and msg.job_id in self.enqueued_at:
            fields["ttft_s"] = s.first_token_at - self.enqueued_at[msg.job_id]
        if not self.queue.complete(msg.job_id, attempt=msg.attempt, state=msg.state, now_ms=_ms(now),
                                   fields=fields):
            return  # a stale attempt (its lease expired and the job moved on)
        for w in self.workers.workers.values():
            w.pending.discard(msg.job_id)
        self._urgent_sent.discard(msg.job_id)
        self._finish_stream(msg.job_id, msg.state, msg.finish_reason, msg.reason,
                            run_s=msg.run_s, preemptions=msg.preemptions)
        self._dirty = True
