"""The blame chain's gateway side: re-dispatches, dead letters, queue waits and aging, worker-queue waits and slow
hand-overs to a worker (a mixin of common.traces.analysis._Analyser)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from common.traces.lookups import LastEnded
from common.traces.model import Cause
from common.traces.schema import (GATEWAY_DEAD_LETTER, STEP_BEFORE_END, STEP_BEFORE_REQUESTS, STEP_BEFORE_START,
                                  STEP_BEFORE_TOKENS, WORKER_QUEUE, WORKER_REQUEST, attr_float, attr_int, attr_str,
                                  per_tier)
from common.traces.spans import Span


class WaitCauses:
    """Needs the analyser's ``rel``, ``spans`` and ``min_wait_s``; each method adds its causes through ``add``. The
    spans given come in the order of their starts (the analyser sorts them): what the bisections below rely on."""

    def _dispatch_causes(self, dispatches: list[Span], queues: list[Span], add) -> list[str]:
        """Each re-dispatch (why, what was kept and lost) and each dispatch with no free credit; the workers, in
        dispatch order."""
        workers: list[str] = []
        queue_starts = [q.start_ns for q in queues]
        for i, d in enumerate(dispatches):
            worker = attr_str(d.get("dispatch.worker")) or "?"
            workers.append(worker)
            attempt = attr_int(d.get("dispatch.attempt")) or i + 1
            if i > 0 or attempt > 1:
                prev = workers[i - 1] if i > 0 else None
                # The queue spans begun from the previous dispatch's start to this one's: the last is its re-queue.
                last = bisect_right(queue_starts, d.start_ns)
                requeue = last > (bisect_left(queue_starts, dispatches[i - 1].start_ns) if i > 0 else 0)
                at = queue_starts[last - 1] if requeue and i > 0 else d.start_ns
                # A draining worker hands its job back (gateway.dispatch says so since it can): its time on that
                # worker is in its worker.request span, and the next attempt goes on from its tokens.
                released = attr_str(d.get("dispatch.requeue_cause")) == "released"
                prev = prev or attr_str(d.get("dispatch.lost_worker"))
                # Time between handing it to the previous worker and the lease expiring: lost work, but for its run
                # up to the last token this attempt resumed with (written to the token log then), which was kept.
                lost = (at - dispatches[i - 1].end_ns) / 1e9 if i > 0 and requeue and not released else None
                resumed = attr_int(d.get("dispatch.resumed_tokens"))
                last_ms = attr_int(d.get("dispatch.last_kept_token_ms"))
                kept_s = None
                if lost is not None and resumed and last_ms:
                    kept_s = min(lost, max(0.0, (last_ms * 1_000_000 - dispatches[i - 1].end_ns) / 1e9))
                    lost -= kept_s
                if released:
                    text = (f"worker {prev or '?'} handed it back (shutting down); attempt {attempt} on worker "
                            f"{worker}")
                elif prev:
                    text = f"lease expired on worker {prev}; attempt {attempt} on worker {worker}"
                else:
                    text = f"attempt {attempt} on worker {worker} (an earlier attempt's lease expired)"
                said = [f"{resumed} token{'s' if resumed != 1 else ''} kept"
                        + (f": {kept_s:.2f} s of its run on {prev}" if kept_s else "")] if resumed else []
                if lost is not None and lost > 0:
                    said.append(f"{lost:.2f} s lost on {prev}")
                if said:
                    text += f" ({'; '.join(said)})"
                detail = {"attempt": attempt, "previous_worker": prev, "worker": worker,
                          "cause": "released" if released else "lease_expired"}
                if resumed is not None:
                    detail |= {"kept_tokens": resumed, "kept_s": None if kept_s is None else round(kept_s, 9)}
                add(1, Cause(self.rel(at), "redispatch", text, lost, detail=detail))
            if attr_str(d.get("dispatch.reason")) == "cheapest_preemption":
                add(5, Cause(self.rel(d.start_ns), "dispatch",
                             f"dispatched to worker {worker} with no free credit anywhere: it had the cheapest "
                             f"preemption", detail={"worker": worker, "attempt": attempt}))
        return workers

    def _dead_letter_causes(self, dispatches: list[Span], add) -> None:
        """Its last allowed attempt lost its lease: the job was dead-lettered (no next dispatch tells of it)."""
        ended = LastEnded(dispatches)
        for s in self.spans(GATEWAY_DEAD_LETTER):
            before = ended.at(s.start_ns)
            worker = attr_str(s.get("dead_letter.lost_worker")) or \
                (attr_str(before.get("dispatch.worker")) if before else None)
            attempt = attr_int(s.get("dead_letter.attempt"))
            cause = attr_str(s.get("dead_letter.cause")) or "lease_expired"
            lost = (s.start_ns - before.end_ns) / 1e9 if before else None
            how = "handed back by" if cause == "released" else "lease expired on"
            text = f"{how} worker {worker or '?'}" + (f" (attempt {attempt})" if attempt else "") + \
                ": dead-lettered, no attempt left"
            if attr_str(s.get("dead_letter.reason")):
                text += f" ({s.get('dead_letter.reason')})"
            if lost is not None and lost > 0:
                text += f"; {lost:.2f} s lost on {worker or '?'}"
            add(1, Cause(self.rel(s.start_ns), "dead_letter", text, lost,
                         {"attempt": attempt, "worker": worker, "cause": cause,
                          "reason": attr_str(s.get("dead_letter.reason"))}))


    def _queue_causes(self, queues: list[Span], admit: Span | None, add) -> None:
        """Gateway queue waits (behind how many, estimated, how it left) and aging."""
        for i, q in enumerate(queues):
            src = q if any(k.startswith("queue.ahead.") or k == "queue.position" for k in q.attributes) else \
                (admit if i == 0 and admit is not None else None)
            ahead = per_tier(src, "queue.ahead") if src else {}
            position = attr_int(src.get("queue.position")) if src else None
            jobs = position if position is not None else (sum(ahead.values()) if ahead else None)
            verb = "queued" if i == 0 else "re-queued"
            dur = q.duration_s
            if jobs is None:
                text = f"{verb} {dur:.2f} s (jobs ahead not recorded)"
            elif jobs == 0 and not any(ahead.values()):
                text = f"{verb} {dur:.2f} s with no job ahead at admission (waiting for worker capacity)"
            else:
                breakdown = ", ".join(f"{t}: {n}" for t, n in ahead.items() if n)
                text = f"{verb} {dur:.2f} s behind {jobs} job{'s' if jobs != 1 else ''}" + \
                    (f" ({breakdown})" if breakdown else "")
            estimate = attr_float(admit.get("admission.estimated_wait_s")) if admit is not None and i == 0 else None
            if estimate:
                text += f"; estimated {estimate:.2f} s at admission"
            outcome = attr_str(q.get("queue.outcome"))  # it left the queue undispatched (gateway.spans.left_queue)
            if outcome == "expired":
                text += "; then expired: its queue timeout ran out"
            elif outcome:
                text += f"; then {outcome} while queued"
            if dur >= self.min_wait_s or jobs or outcome:
                add(2, Cause(self.rel(q.start_ns), "queue", text, dur,
                             {"jobs_ahead": jobs, "ahead": ahead, "estimated_wait_s": estimate, "outcome": outcome,
                              "tier": attr_str(q.get("queue.tier")),
                              "tier_granted": attr_str(q.get("queue.tier_granted"))}))
            for ev in q.events:
                if ev.name == "aged":
                    frm, to = attr_str(ev.attributes.get("from_tier")), attr_str(ev.attributes.get("to_tier"))
                    at = self.rel(ev.time_ns)
                    add(3, Cause(at, "aging", f"aged {frm or '?'} -> {to or '?'} at +{at:.1f} s",
                                 detail={"from_tier": frm, "to_tier": to,
                                         "after_queued_s": round((ev.time_ns - q.start_ns) / 1e9, 9)}))
                elif ev.name == "promised start":  # gateway/promises.py: no newer job went first from then on
                    at = self.rel(ev.time_ns)
                    add(3, Cause(at, "promise", f"its promised start fell due at +{at:.1f} s: moved to P2, ahead of "
                                 "every P2 admitted after it", detail={
                                     "to_tier": attr_str(ev.attributes.get("to_tier")),
                                     "after_queued_s": round((ev.time_ns - q.start_ns) / 1e9, 9)}))

    def _worker_queue_causes(self, dispatches: list[Span], add) -> None:
        """Worker queue waits (attempt i's worker from the dispatch that preceded it)."""
        starts = [d.start_ns for d in dispatches]
        for wq in self.spans(WORKER_QUEUE):
            if wq.duration_s < self.min_wait_s:
                continue
            at = bisect_right(starts, wq.start_ns)  # the last dispatch begun by then
            worker = attr_str(dispatches[at - 1].get("dispatch.worker")) if at else None
            where = f"worker {worker}'s queue" if worker else "the worker's queue"
            add(4, Cause(self.rel(wq.start_ns), "worker_queue", f"waited {wq.duration_s:.2f} s in {where}",
                         wq.duration_s, {"worker": worker}))

    def _to_worker_causes(self, dispatches: list[Span], add) -> None:
        """A hand-over to a worker that took a while: the step the worker was running when the job came."""
        ended = LastEnded(dispatches)
        for w in self.spans(WORKER_REQUEST):
            before = ended.at(w.start_ns)
            if before is None:
                continue
            gap = (w.start_ns - before.end_ns) / 1e9
            if gap < self.min_wait_s:
                continue
            worker = attr_str(before.get("dispatch.worker")) or "?"
            text = f"reached worker {worker} {gap:.3f} s after dispatch"
            step_end = attr_int(w.get(STEP_BEFORE_END))
            detail = {"worker": worker, "step_requests": attr_int(w.get(STEP_BEFORE_REQUESTS)),
                      "step_tokens": attr_int(w.get(STEP_BEFORE_TOKENS))}
            if step_end is not None and step_end > before.end_ns:
                step_start = attr_int(w.get(STEP_BEFORE_START)) or step_end
                detail["step_s"] = (step_end - step_start) / 1e9
                text += (f": it was running a step ({detail['step_requests']} requests, {detail['step_tokens']} "
                         f"tokens, {detail['step_s']:.3f} s) and reads new jobs between steps")
            add(4, Cause(self.rel(before.end_ns), "to_worker", text, gap, detail))
