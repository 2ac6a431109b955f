"""Streaming a job's tokens to its subscribers: live from memory, or the final result from Redis.

A mixin of gateway.server.Gateway; the per-job token buffers are gateway.streams.StreamTable.
"""

from __future__ import annotations

import msgpack

from common import protocol as P
from gateway.timeutil import FINAL_STATES


class Streaming:
    """Handler of StreamRequest and the sending of TokenChunk / JobDone frames."""

    def on_stream(self, ident: bytes, req: P.StreamRequest) -> None:
        live = self.streams.streams.get(req.job_id)
        tenant = self.tenants.lookup(req.api_key)
        if live is not None and tenant is not None and live.tenant == tenant.name:
            # A job this gateway admitted and is still streaming: no Redis read needed.
            live.subscribers[ident] = max(0, req.from_index)
            self._flush(req.job_id)
            return
        rec = self._own_job(ident, req.api_key, req.job_id)
        if rec is None:
            return
        s = self.streams.streams.get(req.job_id)
        if s is None:
            if rec.state in FINAL_STATES:
                self._send_final(ident, rec, max(0, req.from_index))
                return
            if rec.gateway and rec.gateway != self.config.gateway_id and rec.state == "dispatched":
                self._send(self.clients, ident, P.ErrorReply(
                    "not_found", f"job {req.job_id} streams from gateway {rec.gateway}", in_reply_to=req.job_id))
                return
            s = self.streams.get_or_create(req.job_id)
        s.subscribers[ident] = max(0, req.from_index)
        self._flush(req.job_id)
        if rec.state in FINAL_STATES:
            self._send_final(ident, rec, None)

    def _flush(self, job_id: str) -> None:
        s = self.streams.streams[job_id]
        for sub, start, ids in self.streams.pending_chunks(job_id):
            text = self.streams.text(ids, s.tokens[:start])
            self._send(self.clients, sub, P.TokenChunk(job_id, start, ids, text))

    def _finish_stream(self, job_id: str, state: str, finish_reason: str | None, reason: str | None,
                       run_s: float = 0.0, preemptions: int = 0) -> None:
        s = self.streams.streams.pop(job_id, None)
        enq = self.enqueued_at.pop(job_id, None)
        if s is None:
            return
        now = self.clock()
        total = now - enq if enq is not None else 0.0
        ttft = s.first_token_at - enq if (s.first_token_at is not None and enq is not None) else None
        done = P.JobDone(job_id, state, finish_reason, list(s.tokens), self.streams.text(s.tokens, []),
                         queued_s=max(0.0, total - run_s), ttft_s=ttft, total_s=total, preemptions=preemptions,
                         reason=reason)
        for sub, nxt in s.subscribers.items():
            if nxt < len(s.tokens):
                self._send(self.clients, sub, P.TokenChunk(job_id, nxt, s.tokens[nxt:],
                                                           self.streams.text(s.tokens[nxt:], s.tokens[:nxt])))
            self._send(self.clients, sub, done)

    def _send_final(self, ident: bytes, rec, from_index: int | None) -> None:
        res = rec.result
        tokens = msgpack.unpackb(res["token_ids"]) if res.get("token_ids") else []
        if from_index is not None and from_index < len(tokens):
            self._send(self.clients, ident, P.TokenChunk(rec.id, from_index, tokens[from_index:],
                                                         self.streams.text(tokens[from_index:], tokens[:from_index])))
        total = max(0, (rec.finished_at_ms or rec.enqueued_at_ms) - rec.enqueued_at_ms) / 1000
        run_s = float(res.get("run_s", 0))
        ttft = float(res.get("ttft_s", -1))
        finish = res.get("finish_reason", b"").decode() or None
        self._send(self.clients, ident, P.JobDone(
            rec.id, str(rec.state.value if hasattr(rec.state, "value") else rec.state), finish, tokens,
            self.streams.text(tokens, []), queued_s=max(0.0, total - run_s), ttft_s=ttft if ttft >= 0 else None,
            total_s=total, preemptions=int(res.get("preemptions", 0)), reason=rec.reason or None))
