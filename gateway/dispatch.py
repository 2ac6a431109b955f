"""Dispatch: queued jobs from Redis to workers with credit; P0/P1 also to a full worker, but only one
that reports a job it may preempt for them.

A mixin of gateway.server.Gateway.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import msgpack

from common import protocol as P
from common.tiers import ALL_TIERS, PREEMPTING_TIERS, Tier
from gateway import metrics
from gateway.timeutil import ms as _ms
from gateway.waits import first_prefill_ms

# Queued P0/P1 jobs read at most per preemption pass, looking past jobs aged up from P2/P3 (a bound on its cost).
PREEMPTION_SCAN_MAX = 1024


class Dispatcher:
    """Drain-rate estimates and the dispatch pass."""

    def drain_rates(self, now: float) -> dict[Tier, float]:
        """Jobs per second each tier drains at (measured in Redis, floored until measurements exist)."""
        floor = self.config.default_drain_rate_per_s
        return {t: max(floor, self._measured_rates.get(t, 0.0)) for t in ALL_TIERS}

    def dispatch(self, now: float) -> None:
        if not self.workers.workers:
            return
        by_worker, reason = self._plan(now)
        for wid, job_ids in by_worker.items():
            w = self.workers.workers[wid]
            busy = w.stepping  # before this pass's jobs join w.pending: the worker reads them together
            claimed = self.queue.claim(job_ids, worker=wid, gateway=self.config.gateway_id,
                                       lease_ms=_ms(self.config.lease_s))
            # The claim's moment on this gateway's clock: ``now`` was read before this pass's Redis round trips,
            # and the times below are the claim's Redis times put on this clock (a job's admission, for its TTFT;
            # the offset its first start is written to Redis with). From ``now``, a pass that stood still before
            # its claim added that time to the job's TTFT and wait.
            claimed_at = self.clock()
            for rec in claimed:
                if rec.stop_at is not None and not w.hello.stops_at:
                    # Stopped (CancelRequest.stop_at) and going to a worker that cannot end it there: it would run
                    # to its end, past the answer its caller was given, so it is cancelled, as a stop of a job on
                    # such a worker is (the worker is sent a cancel of a job it never got: nothing).
                    self.cancel_job(rec.id)
                    continue
                body = msgpack.unpackb(rec.payload)
                # Span times are Unix times: ``now`` is the loop's monotonic clock, good for intervals only.
                now_ns = time.time_ns()
                # The worker preempts by the tier the job was admitted at: aging only moved it up the queue.
                # Its tokens come back here (reply_to): this gateway holds the lease and writes the token log.
                # A re-dispatch goes on from what earlier attempts streamed (the token log, read into this gateway's
                # buffer), so the stream here has no gap and the worker does not decode it all again.
                resume = rec.attempt > 1 and w.hello.resumes
                stream = self._open_stream(rec.id, rec.tenant) if resume else self.streams.get_or_create(rec.id)
                # What the lost attempt's run left kept, for explain: not all of its time was lost (a worker that
                # cannot resume decodes it all again).
                kept = (len(stream.tokens), stream.redis_pos) if resume else None
                ctx = self.spans.dispatched(rec, body.get("trace_context") or {}, wid, reason[rec.id], now_ns,
                                            kept=kept)
                self._send(self.worker_sock, w.identity, P.DispatchJob(
                    rec.id, rec.attempt, rec.tier_granted.value, rec.tenant, body["prompt_token_ids"],
                    body["max_tokens"], body["temperature"], body["top_p"], body["top_k"], body["seed"],
                    self.config.gateway_id, ctx, bool(body.get("ignore_eos", False)),
                    resume_token_ids=list(stream.tokens) if resume else [],
                    # A stop kept with the job (stop_at.lua): this attempt ends where its caller's answer did.
                    stop_at=rec.stop_at if w.hello.stops_at else None,
                    **{name: body[name] for name in P.SAMPLING_EXTRAS if name in body}))
                self.leases[rec.id] = (wid, rec.attempt)
                waited_s = (rec.dispatched_at_ms - rec.enqueued_at_ms) / 1e3 if rec.dispatched_at_ms else None
                # A token held here was observed where it arrived. None held (a worker that cannot resume, or an
                # earlier attempt that produced none): this attempt's first token is claimed, and the claim loses
                # if an earlier one was observed (first_token.lua), so it is counted once either way.
                metrics.holding(rec.id, rec.tier_granted.value,
                                None if waited_s is None else claimed_at - waited_s, bool(stream.tokens))
                stream.tenant = rec.tenant
                stream.touched = now
                w.pending.add(rec.id)
                self.waits.dispatched(rec.id, claimed_at, busy, rec.attempt, sent_ms=rec.dispatched_at_ms,
                                      enqueued_ms=rec.enqueued_at_ms, first_ms=first_prefill_ms(rec))
                if rec.tier_granted in PREEMPTING_TIERS:
                    self._urgent_sent.add(rec.id)
                self.counters["dispatched"] += 1

    def _plan(self, now: float) -> tuple[dict[str, list[str]], dict[str, str]]:
        """Which queued jobs go to which worker now, and why (for their dispatch spans)."""
        if self.workers.total_credit() <= 0:
            return self._plan_preemptions(now)
        by_worker, reason, read = self._plan_by_credit()
        if self.workers.uneven():
            # A P0/P1 that fits only full workers found no credit it fits, and credit elsewhere does not
            # serve it: it preempts there now, rather than wait behind their low-tier work until a slot frees.
            planned = {j for js in by_worker.values() for j in js}
            more, why = self._plan_preemptions(now, skip=planned, read=read)
            for wid, job_ids in more.items():
                by_worker.setdefault(wid, []).extend(job_ids)
            reason.update(why)
        return by_worker, reason

    def _plan_by_credit(self) -> tuple[dict[str, list[str]], dict[str, str], list[str] | None]:
        """As many jobs as there are free slots, each to the worker with the most credit left that it fits. A job
        whose workers are all full waits in Redis, and the queue behind it goes on (read further, to
        PREEMPTION_SCAN_MAX). Also every queued job, in dispatch order, where the read took them all (else None)."""
        credit = self.workers.total_credit()
        limit = credit
        while True:
            ids = self.queue.peek(list(ALL_TIERS), limit)
            places = self._places(ids)
            by_worker: dict[str, list[str]] = {}
            planned: Counter = Counter()
            for job_id in ids:
                where = [w for w in self.workers.workers.values()
                         if job_id not in places or w.hello.worker_id in places[job_id]]
                w = max(where, key=lambda w: w.credit - planned[w.hello.worker_id], default=None)
                if w is not None and w.credit - planned[w.hello.worker_id] > 0:
                    by_worker.setdefault(w.hello.worker_id, []).append(job_id)
                    planned[w.hello.worker_id] += 1
            if sum(planned.values()) >= credit or len(ids) < limit or limit >= PREEMPTION_SCAN_MAX:
                return by_worker, {j: "credit" for js in by_worker.values() for j in js}, \
                    ids if len(ids) < limit else None
            limit = min(PREEMPTION_SCAN_MAX, 4 * limit)

    def _places(self, ids: list[str]) -> dict[str, set[str]]:
        """The workers each of ``ids`` may go to, for the jobs that fit some of them and not others (by prompt +
        max_tokens, at the tier the job was admitted at: the hellos' tier_max_tokens; WorkerRegistry.places). Sent
        where it does not fit, it failed there, though another worker could run it. Left out (may go anywhere): a
        job every worker fits (workers alike: nothing is read), and one no registered worker fits."""
        if not ids or not self.workers.uneven():
            return {}
        out = {}
        for job_id, info in self.estimator.job_infos(ids).items():
            where = self.workers.places(info.tier, info.prompt_tokens + info.max_tokens)
            if where is not None:
                out[job_id] = where
        return out

    def _plan_preemptions(self, now: float, skip: frozenset[str] | set[str] = frozenset(),
                          read: list[str] | None = None) -> tuple[dict[str, list[str]], dict[str, str]]:
        """Every worker is full (or every worker a job fits, on uneven workers; ``skip``: the jobs the credit
        pass placed): a P0/P1 job goes only to a full worker with a running job it may preempt
        (as reported, less the urgent jobs already sent there and not yet reported, plus the jobs it may preempt
        sent there since), to the worker where the wait model expects it to start first (a worker reads a job
        after the step in progress, and one may be midway through a long prompt's chunk while the other decodes);
        a job with no such victim anywhere stays in Redis, where aging, queue timeouts and wait estimates still
        apply to it. ``read``: every queued job, in dispatch order, where the credit pass read them all (the
        queues are not read again)."""
        room = {wid: w.victims_left(self._urgent_sent, self.estimator.tier_of)
                for wid, w in self.workers.workers.items() if w.credit == 0}
        # Where the starts tie, a worker with a victim no preemption guard protects now goes first, then the one
        # with the most victims, then the one this pass has sent fewer to.
        guarded = {wid: {t: w.guarded_victims(t) for t in PREEMPTING_TIERS} for wid, w in self.workers.workers.items()}
        most = sum(max(0, n) for v in room.values() for n in v.values())
        by_worker: dict[str, list[str]] = {}
        victims = {wid for wid, v in room.items() if any(n > 0 for n in v.values())}
        places: dict[str, set[str]] = {}  # the workers each job read may go to (_places), kept for the plan below

        def placeable(ids: list[str]) -> set[str]:
            # Those that fit a worker with a victim: the P0s only a draining worker fits (handed back in a redeploy),
            # or only a full one with none, took every candidate's place, and a P0 behind them that a victim on a
            # smaller worker could serve waited for a free slot (a priority inversion, for the whole redeploy).
            places.update(self._places(ids))
            return {i for i in ids if i not in places or places[i] & victims}

        candidates = self._urgent_candidates(most, skip, read, placeable)
        starts = self.estimator.starts_s(sorted({t for _, t in candidates}, key=lambda t: t.rank), now) \
            if candidates else {}
        for job_id, tier in candidates:
            fits = [wid for wid, v in room.items() if v.get(tier, 0) > 0 and wid in places.get(job_id, room)]
            if not fits:
                continue
            wid = min(fits, key=lambda wid: (starts.get(wid, {}).get(tier, 0.0), room[wid][tier] <= guarded[wid][tier],
                                             -room[wid][tier], len(by_worker.get(wid, ()))))
            by_worker.setdefault(wid, []).append(job_id)
            for t in room[wid]:  # one victim is gone, whoever would have taken it
                room[wid][t] -= 1
        return by_worker, {j: "preemption" for js in by_worker.values() for j in js}

    def _urgent_candidates(self, most: int, skip: frozenset[str] | set[str] = frozenset(),
                           read: list[str] | None = None,
                           placeable: Callable[[list[str]], set[str]] | None = None) -> list[tuple[str, Tier]]:
        """Up to ``most`` queued jobs admitted as P0 or P1, in dispatch order, with their tiers. Jobs aged up
        from P2/P3 share the P1 queue, ahead of newer P1s, but wait for a free slot like the tier they were
        admitted at: they are passed over here, so however many there are, they cannot hide a P1 from the
        victims it may preempt (the scan reads further until it finds enough, to PREEMPTION_SCAN_MAX). ``read``:
        every queued job, in dispatch order (a job admitted as P0 or P1 is in its own queue, ahead of P2's and
        P3's): a peek of the P0/P1 queues would read them again, a Redis round trip per pass on uneven workers.
        ``placeable``: of the ids given, those some worker may take now; the others are passed over too."""
        def urgent(ids: list[str]) -> list[tuple[str, Tier]]:
            found = [(i, t) for i, t in zip(ids, self._granted_tiers(ids)) if t in PREEMPTING_TIERS]
            if placeable is None or not found:
                return found
            kept = placeable([i for i, _ in found])
            return [(i, t) for i, t in found if i in kept]

        if read is not None and most > 0:
            return urgent([i for i in read if i not in skip])[:most]
        limit = most
        while limit > 0:
            peeked = self.queue.peek(list(PREEMPTING_TIERS), limit)
            found = urgent([i for i in peeked if i not in skip])
            if len(found) >= most or len(peeked) < limit or limit >= PREEMPTION_SCAN_MAX:
                return found[:most]
            limit = min(PREEMPTION_SCAN_MAX, 4 * limit)
        return []

    def _granted_tiers(self, ids: list[str]) -> list[Tier | None]:
        """The tier each job was admitted at: known here for the jobs this gateway admitted, else read."""
        known = [self.estimator.tier_of(i) for i in ids]
        unknown = [i for i, t in zip(ids, known) if t is None]
        read = iter(self.queue.granted_tiers(unknown))
        return [t if t is not None else next(read) for t in known]
