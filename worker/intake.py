"""What comes in from the gateways: every frame on a socket read and acted on (dispatches, cancels, confirmations,
a gateway's errors), on the step loop's thread and under the service's socket lock.

A dispatch becomes a ``RunningJob``: the attempt the worker runs, which gateway streams it, and every token it has
sent so far (replayed to a gateway that lost them: worker/redelivery.py). A frame that cannot be decoded is counted
and dropped; a dispatch that cannot run is answered with a failed completion, never left to its lease.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import zmq

from common import protocol as P
from common.errors import InvalidRequest
from worker.request import SamplingParams

log = logging.getLogger("worker")


@dataclass
class RunningJob:
    job_id: str
    attempt: int
    reply: zmq.Socket  # the gateway that streams this job
    started: float
    tokens: list[int] = field(default_factory=list)  # every output token so far (the next index is its length)
    first_token: float | None = None
    stop_at: int | None = None  # CancelJob.stop_at: it ends done with this many tokens once it has them


class EarlyStops:
    """Stops (CancelJob.stop_at) of an attempt not here yet. Each gateway has its own connection: a stop sent by
    one may come before the dispatch another sent first (the job claimed there as the stop was kept in Redis), and
    dropped, it let that attempt run past its caller's answer. Kept ``KEEP_S``, at most ``MAX`` of them."""

    KEEP_S = 60.0  # a dispatch comes within a round trip of its claim; a stop never claimed is let go
    MAX = 4096

    def __init__(self) -> None:
        self._stops: dict[tuple[str, int], tuple[int, float]] = {}  # (job, attempt) -> (n, kept at), oldest first

    def keep(self, job_id: str, attempt: int, n: int, now: float) -> None:
        self._prune(now)
        if len(self._stops) >= self.MAX:
            del self._stops[next(iter(self._stops))]
        kept = self._stops.get((job_id, attempt))
        self._stops[(job_id, attempt)] = (n, now) if kept is None else (min(n, kept[0]), kept[1])

    def take(self, job_id: str, attempt: int, now: float) -> int | None:
        self._prune(now)
        kept = self._stops.pop((job_id, attempt), None)
        return None if kept is None else kept[0]

    def __len__(self) -> int:
        return len(self._stops)

    def _prune(self, now: float) -> None:
        while self._stops and next(iter(self._stops.values()))[1] < now - self.KEEP_S:
            del self._stops[next(iter(self._stops))]


class Intake:
    """The worker service's inbound side (a mixin of worker.service.WorkerService): needs its ``jobs``, ``engine``,
    ``rates``, ``linger``, ``drain``, ``unconfirmed``, ``unconfirmed_releases``, ``early_stops``, ``counters``,
    ``clock``, ``_finish``, ``_hello``, ``_replay_tokens``, ``_release`` and ``_beat_soon``."""

    def _drain(self, sock: zmq.Socket) -> None:
        for _ in range(1000):
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = P.decode(frame)
            except P.ProtocolError as e:
                self.counters["malformed"] += 1
                log.warning("dropped a malformed frame: %s", e)
                continue
            if isinstance(msg, P.DispatchJob):
                self._dispatch(sock, msg)
            elif isinstance(msg, P.CancelJob) and msg.stop_at is not None:
                self._stop_at(msg.job_id, msg.attempt, msg.stop_at)
            elif isinstance(msg, P.CancelJob):
                self._cancel(msg.job_id, msg.attempt)
            elif isinstance(msg, P.JobFinishedAck):
                self.unconfirmed.confirmed(msg.job_id, msg.attempt)
                self.unconfirmed_releases.confirmed(msg.job_id, msg.attempt)
            elif isinstance(msg, P.GatewayWelcome):
                pass  # nothing to learn: a job's tokens go back on the socket its dispatch came in on
            elif isinstance(msg, P.ErrorReply) and msg.code == P.HELLO_FIRST:
                # The gateway restarted, or forgot this worker: what was sent to it meanwhile is lost.
                self._hello([sock])
                self._replay_tokens(sock, [job for job in self.jobs.values() if job.reply is sock])
            elif isinstance(msg, P.ErrorReply):
                self.counters["gateway_errors"] += 1
                log.warning("gateway says: %s %s", msg.code, msg.message)
            else:
                self.counters["unexpected"] += 1

    def _dispatch(self, sock: zmq.Socket, msg: P.DispatchJob) -> None:
        if msg.attempt < 1:
            # Attempts count from 1 (claim.lua): a buggy gateway's frame. Taken for a stale copy, it got no answer
            # and the job waited out its lease in silence; answered as an invalid job is, and nothing here touched.
            self.counters["invalid_dispatches"] += 1
            self._finish(sock, P.JobFinished(msg.job_id, msg.attempt, "failed", None, 0, None, 0.0, 0,
                                             f"invalid dispatch: attempt must be >= 1, got {msg.attempt}", []))
            return
        newest = max([a for j, a in self.unconfirmed.attempts() if j == msg.job_id]
                     + ([self.jobs[msg.job_id].attempt] if msg.job_id in self.jobs else []), default=0)
        if msg.attempt <= newest:
            # A copy of a frame, or an older attempt's delayed past a newer one (on another gateway's connection):
            # run, it would start the current attempt over, or replace it with one whose frames are all stale.
            self.counters["duplicate_dispatches" if msg.attempt == newest else "stale_dispatches"] += 1
            log.warning("dropped a dispatch of job %s attempt %d: attempt %d is here", msg.job_id, msg.attempt,
                        newest)
            return
        if msg.job_id in self.jobs:  # re-dispatched here after its lease expired: start over
            self.engine.abort(msg.job_id)
            del self.jobs[msg.job_id]  # else a refused re-dispatch leaves it reported (its lease renewed) forever
            self.rates.forget(msg.job_id)  # and its timing, which holds the aborted request, kept for good
        params = SamplingParams(max_tokens=msg.max_tokens, temperature=msg.temperature, top_k=msg.top_k,
                                top_p=msg.top_p, seed=msg.seed, ignore_eos=msg.ignore_eos,
                                stop_token_ids=tuple(msg.stop_token_ids), min_tokens=msg.min_tokens,
                                presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
                                repetition_penalty=msg.repetition_penalty)
        self.linger.dispatched(self.clock())  # a job refused below answered the offer all the same
        if self.drain.active:  # sent before the gateway read the report offering nothing
            self._release({msg.job_id: msg.attempt}, "draining: not started")
            return
        try:
            self.engine.add_request(msg.job_id, msg.prompt_token_ids, params, tier=msg.tier, tenant=msg.tenant,
                                    trace_context=msg.trace_context, output_token_ids=msg.resume_token_ids)
        except InvalidRequest as e:
            # A gateway validates what it sends against this worker's hello: a refusal here is a buggy or
            # mismatched gateway, which went unseen (no log line, no count) while its jobs failed.
            self.counters["invalid_dispatches"] += 1
            log.warning("refused a dispatch of job %s attempt %d: %s", msg.job_id, msg.attempt, e)
            self._finish(sock, P.JobFinished(msg.job_id, msg.attempt, "failed", None, 0, None, 0.0, 0, str(e), []))
            return
        # Resumed: its output so far (as the engine kept it) is the start of what it streams and returns.
        resumed = list(self.engine.get_request(msg.job_id).output_token_ids)
        if resumed:
            log.info("job %s attempt %d resumes after %d tokens", msg.job_id, msg.attempt, len(resumed))
        # Its tokens go back on the socket the dispatch came in on (reply_to names that gateway). Looked up by the id
        # gateways welcomed this worker with, a welcome naming another gateway's id (a buggy one, or two started with
        # one id) took its tokens.
        self.jobs[msg.job_id] = RunningJob(msg.job_id, msg.attempt, sock, self.clock(), resumed)
        self.rates.added(msg.job_id)
        # Stopped before this attempt (its worker died or handed it back after the stop), or since, by a stop that
        # came before this dispatch: it ends where its caller's answer did, at once if its resumed tokens reach it.
        stop = msg.stop_at
        if stop is not None and (type(stop) is not int or stop < 1):  # a buggy gateway's: the job runs as without
            self.counters["malformed"] += 1
            log.warning("dropped the stop of a dispatch of job %s: %r tokens is not an integer >= 1", msg.job_id, stop)
            stop = None
        stops = [n for n in (stop, self.early_stops.take(msg.job_id, msg.attempt, self.clock())) if n is not None]
        if stops:
            self._stop_at(msg.job_id, msg.attempt, min(stops))
            if msg.job_id not in self.jobs:
                return
        self._beat_soon()  # confirm it now: the gateway counts it against this worker's credit until then

    def _stop_at(self, job_id: str, attempt: int | None, n: int) -> None:
        """The job's answer ends with its first ``n`` tokens: it ends done there (now, if it has them; else at the
        step that brings them), with exactly those, rather than run on or be dropped."""
        job = self.jobs.get(job_id)
        if type(n) is not int or n < 1:
            self.counters["malformed"] += 1
            log.warning("dropped a stop of job %s at %r tokens: not an integer >= 1", job_id, n)
            return
        if attempt is not None and (job is None or job.attempt < attempt):
            self.counters["early_stops"] += 1  # its dispatch may be on its way from another gateway
            self.early_stops.keep(job_id, attempt, n, self.clock())
            return
        if job is None or (attempt is not None and job.attempt != attempt):
            # Another attempt's tokens need not be the ones its caller read: that one runs on, as a cancel of
            # an earlier attempt leaves it.
            self.counters["stale_cancels"] += 1
            return
        job.stop_at = n if job.stop_at is None else min(job.stop_at, n)
        if len(job.tokens) >= job.stop_at:
            self._end_at_stop(job)

    def _end_at_stop(self, job: RunningJob) -> None:
        req = self.engine.get_request(job.job_id)
        preemptions = req.num_preemptions if req is not None else 0
        self.engine.abort(job.job_id)  # False if it finished in the same step: it ends here all the same
        self._complete(job, "done", "stop", job.tokens[:job.stop_at], preemptions, None, self.clock())

    def _complete(self, job: RunningJob, state: str, finish_reason: str | None, tokens: list[int],
                  preemptions: int, error: str | None, now: float) -> None:
        """Send the end of ``job``'s attempt (its engine request is over) and let go of it."""
        del self.jobs[job.job_id]
        self._finish(job.reply, P.JobFinished(
            job.job_id, job.attempt, state, finish_reason, len(tokens),
            None if job.first_token is None else job.first_token - job.started, now - job.started, preemptions,
            error, tokens, prefill_start_s=self.rates.prefill_start_s(job.job_id),
            prefill_start_age_s=self.rates.prefill_start_age_s(job.job_id, now)))
        self.rates.forget(job.job_id)
        self._beat_soon()  # report the free slot now, not at the next beat: the wait estimate counts on it

    def _cancel(self, job_id: str, attempt: int | None) -> None:
        job = self.jobs.get(job_id)
        if job is not None and attempt is not None and job.attempt > attempt:
            self.counters["stale_cancels"] += 1  # meant for an earlier attempt; this one is current
            return
        if self.engine.abort(job_id):
            self.jobs.pop(job_id, None)
            self.rates.forget(job_id)
            self._beat_soon()  # its slot is free: a gateway counts it busy, and the job held, until a report
