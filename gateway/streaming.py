"""Streaming a job's tokens to its subscribers, from any gateway.

The gateway holding a job's lease receives its tokens from the worker, forwards them to its own
subscribers at once and appends them to the job's Redis stream (gateway/token_log.py) every
``stream_flush_interval_s``. A gateway whose clients watch a job it does not hold follows that
stream (one XREAD for all such jobs per tick) and notices the job's end from its hash, then sends
the rest from the stored result. So any gateway streams, resumes (from_index) and ends any job.

A mixin of gateway.server.Gateway; the per-job token buffers are gateway.streams.StreamTable.
"""

from __future__ import annotations

import msgpack
import redis

from common import protocol as P
from gateway import metrics
from gateway.queue_records import JobRecord, Stored
from gateway.streams import JobStream
from gateway.timeutil import FINAL_STATES

IDLE_CHECK_S = 1.0  # a held stream with no tokens for this long gets its job's state checked


class Streaming:
    """Handler of StreamRequest, the Redis token log (write and follow), TokenChunk / JobDone frames."""

    def on_stream(self, ident: bytes, req: P.StreamRequest) -> None:
        if req.unsubscribe:  # ``ident`` names the connection and the request id: only its own client can
            s = self.streams.streams.get(req.job_id)  # name it, so there is nothing more to check
            if s is not None:
                s.subscribers.pop(ident, None)
            self.keepalives.forget(ident, req.job_id)
            return
        live = self.live_stream(req)
        if live is not None:
            live.subscribers[ident] = max(0, req.from_index)
            self.keepalives.watch(ident, req.job_id, self.clock())
            self._flush(req.job_id)
            return
        rec = self._own_job(ident, req.api_key, req.job_id)
        if rec is None:
            return
        if rec.state in FINAL_STATES:
            self._send_final(ident, rec, max(0, req.from_index))
            return
        s = self.streams.streams.get(req.job_id) or self._open_stream(req.job_id, rec.tenant)
        s.follow = rec.state == "dispatched" and req.job_id not in self.leases
        s.subscribers[ident] = max(0, req.from_index)
        self.keepalives.watch(ident, req.job_id, self.clock())
        self._flush(req.job_id)

    def live_stream(self, req: P.StreamRequest) -> JobStream | None:
        """The stream of ``req``'s job this gateway already has, if it is the asking tenant's: served from memory, with
        no Redis read (also in a Redis back-off: outage.py)."""
        live = self.streams.streams.get(req.job_id)
        tenant = self.tenants.lookup(req.api_key)
        return live if live is not None and tenant is not None and live.tenant == tenant.name else None

    def send_keepalives(self, now: float, redis_up: bool = True) -> None:
        """A StatusReply to every stream silent for keepalive_interval_s; a job found ended is served from Redis."""
        for peer, job_id in self.keepalives.due(now):
            try:
                if not redis_up:
                    raise redis.ConnectionError("in back-off")
                rec = self.queue.get(job_id)
            except redis.RedisError as e:
                if redis_up:  # the back-off starts now: the streams due after this one wait out no timeout of their own
                    redis_up = False
                    self._redis_failed(e)
                # Still a sign of life: the client must not fail over from a gateway that waits out a Redis blip.
                self._send(self.clients, peer, P.StatusReply(job_id, "unknown", "", 0, None,
                                                             "queue store unreachable"))
                continue
            if rec is None:
                self._send(self.clients, peer, P.ErrorReply("not_found", f"no job {job_id!r}", in_reply_to=job_id))
            elif rec.state in FINAL_STATES:
                # It ended where this gateway did not see it (another gateway received its tokens).
                s = self.streams.streams.get(job_id)
                self._send_final(peer, rec, s.subscribers.pop(peer, 0) if s is not None else 0)
                if s is not None and not s.subscribers and job_id not in self.enqueued_at:
                    del self.streams.streams[job_id]
            else:
                self._send(self.clients, peer, P.StatusReply(rec.id, str(rec.state.value), rec.tier.value,
                                                             rec.attempt, None, rec.reason))

    def _open_stream(self, job_id: str, tenant: str) -> JobStream:
        """A buffer for a job whose tokens may already be in Redis (written by whichever gateway held it), with
        them in it. Tokens it held already that the log lacks (this gateway held the job, and its lease moved on
        before they were flushed) stay to be flushed."""
        s = self.streams.get_or_create(job_id)
        s.tenant = tenant
        s.touched = self.clock()
        logged = 0
        for entry_id, index, tokens in self.token_log.read({job_id: "0-0"}).get(job_id, []):
            self.streams.add_tokens(job_id, index, tokens, s.touched)
            s.redis_pos = entry_id
            logged = max(logged, index + len(tokens))
        s.flushed = min(len(s.tokens), max(s.flushed, logged))
        return s

    def flush_token_log(self) -> None:
        """Append every held job's new tokens to its Redis stream, record in their hashes the first prefill starts
        heard here (the end of each job's wait, for whichever gateway stores its result), and claim the first
        tokens seen here (metrics.first_tokens: also those of jobs that ended meanwhile), in one round trip."""
        batch = [(j, s.flushed, s.tokens[s.flushed:], *self.leases[j]) for j, s in self.streams.streams.items()
                 if j in self.leases and s.flushed < len(s.tokens)]
        firsts = metrics.first_tokens()
        starts = self.waits.unrecorded()
        if batch or firsts or starts:
            written, won = self.token_log.append(batch, firsts, self.config.gateway_id, starts)
            self.waits.recorded(starts)
            for (job_id, _, _, worker, attempt), ok in zip(batch, written):
                s = self.streams.streams[job_id]
                s.flushed = len(s.tokens)
                if not ok and self.leases.get(job_id) == (worker, attempt):
                    # Its lease moved on (requeued, re-claimed, ended) while this gateway did not look: whoever
                    # holds it now writes the log; this gateway follows the job like any other it does not hold.
                    self.leases.pop(job_id)
                    s.follow = True
            for job_id, w in zip(firsts, won):
                metrics.claimed(job_id, w)

    def follow_token_log(self, now: float) -> None:
        """Bring watched jobs held elsewhere up to date; end streams whose job has ended."""
        followed = {j: s.redis_pos for j, s in self.streams.streams.items()
                    if s.follow and s.subscribers and j not in self.leases}
        for job_id, entries in self.token_log.read(followed).items():
            s = self.streams.streams[job_id]
            for entry_id, index, tokens in entries:
                self.streams.add_tokens(job_id, index, tokens, now)
                s.redis_pos = entry_id
            self._flush(job_id)
        idle = [j for j, s in self.streams.streams.items() if now - s.touched >= IDLE_CHECK_S]
        if not idle:
            return
        for job_id, (state, worker, attempt) in zip(idle, self.queue.lease_views(idle)):
            s = self.streams.streams[job_id]
            s.touched = now
            if state in FINAL_STATES:
                self.leases.pop(job_id, None)
                rec = self.queue.get(job_id)
                self.streams.streams.pop(job_id, None)
                for sub, nxt in list(s.subscribers.items()):  # a send may drop a gone peer
                    if rec is not None:
                        self._send_final(sub, rec, nxt)
                continue
            if job_id in self.leases and self.leases[job_id] != (worker, attempt):
                self.leases.pop(job_id)  # requeued or re-claimed meanwhile: another holder writes the log
            if job_id not in self.leases and not s.subscribers:
                self.streams.streams.pop(job_id, None)  # nobody here needs it; its tokens are in Redis
            s.follow = state == "dispatched" and job_id not in self.leases

    def _flush(self, job_id: str) -> None:
        for sub, start, ids in self.streams.pending_chunks(job_id):
            text = self.streams.chunk_text(job_id, start)
            self._send(self.clients, sub, P.TokenChunk(job_id, start, ids, text))

    def _finish_stream(self, job_id: str, state: str, finish_reason: str | None, reason: str | None,
                       run_s: float = 0.0, preemptions: int = 0, stored: Stored | None = None,
                       ttft_s: float | None = None, ended: JobRecord | None = None) -> None:
        """``stored``, ``ttft_s``: the figures of a result this gateway stored (complete.lua), which the final
        message repeats: a later read of the result reports those. ``ended``: the record of a job ended without a
        result, as it ended (its finished_at_ms and reason, its first token and prefill start): the final message
        tells its figures (ended_figures) and reason, as a later read does; this gateway's own measures may differ
        (another gateway held the job, or admitted it)."""
        s = self.streams.streams.pop(job_id, None)
        enq = self.enqueued_at.pop(job_id, None)
        queued_s = self.waits.queued_s(job_id, enq)  # None: no worker reported a prefill start (an old worker)
        admitted = self.waits.admitted_at(job_id, enq)
        self.waits.forget(job_id)
        if s is None:
            return
        now = self.clock()
        total = now - admitted if admitted is not None else 0.0
        ttft = s.first_token_at - admitted if (s.first_token_at is not None and admitted is not None) else None
        if stored is not None:
            total, queued_s, ttft = stored.total_s, stored.queued_s, ttft_s
        elif ended is not None:
            queued_s, ttft, total = ended_figures(ended)
            reason = ended.reason or reason
        done = P.JobDone(job_id, state, finish_reason, list(s.tokens), self.streams.text(s.tokens, []),
                         queued_s=max(0.0, total - run_s) if queued_s is None else queued_s, ttft_s=ttft,
                         total_s=total, preemptions=preemptions,
                         reason=reason)
        for sub, nxt in list(s.subscribers.items()):  # a send may drop a gone peer
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
        queued_s, ttft, total = ended_figures(rec)
        finish = res.get("finish_reason", b"").decode() or None
        self._send(self.clients, ident, P.JobDone(
            rec.id, str(rec.state.value if hasattr(rec.state, "value") else rec.state), finish, tokens,
            self.streams.text(tokens, []), queued_s=queued_s, ttft_s=ttft,
            total_s=total, preemptions=int(res.get("preemptions", 0)), reason=rec.reason or None))


def ended_figures(rec: JobRecord) -> tuple[float, float | None, float]:
    """(queued_s, ttft_s, total_s) that a finished job's record tells, from its admission (Redis ms): a result's
    as stored; a job ended without one (cancelled, expired, dead), its record's first prefill start (else it
    waited its whole time) and first token (recorded_ttft_s). The record a job ended with is final
    (first_prefill.lua, first_token.lua), so its final message and any later read tell the same."""
    res = rec.result
    total = max(0, (rec.finished_at_ms or rec.enqueued_at_ms) - rec.enqueued_at_ms) / 1000
    # A result's TTFT as stored (-1: none measured); a job ended without one, its record's first token.
    ttft = float(res["ttft_s"]) if "ttft_s" in res else recorded_ttft_s(rec.enqueued_at_ms,
                                                                         res.get("first_token_ms"))
    ttft = None if ttft is None or ttft < 0 else ttft
    if "queued_s" in res:
        queued_s = float(res["queued_s"])
    elif "run_s" not in res and "first_prefill_ms" in res:
        queued_s = min(total, max(0, int(res["first_prefill_ms"]) - rec.enqueued_at_ms) / 1000)
    else:
        queued_s = max(0.0, total - float(res.get("run_s", 0)))
    return queued_s, ttft, total


def recorded_ttft_s(enqueued_at_ms: int, first_token_ms: bytes | int | None) -> float | None:
    """The time to first token the record of a job ended without a result (cancelled, expired, dead) holds: its
    first token (first_token_ms: first_token.lua) after its admission; None if it holds none."""
    return None if first_token_ms is None else max(0, int(first_token_ms) - enqueued_at_ms) / 1000
