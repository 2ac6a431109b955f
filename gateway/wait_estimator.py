"""The gateway's wait estimates (gateway/estimate.py) fed from Redis and the workers' reports,
(the measured wait of each job, admission until its first prefill started, is gateway/waits.py).

What it reads: the queued jobs that may go before the job, with their enqueue scores (one
pipelined read of the queues and Redis's clock), each job's tokens (kept from admission, or
read once from its payload for jobs other gateways admitted), and the latest WorkerLoad of
every worker (rates and held work). What it learns: output lengths from finished jobs,
arrival rates per tier from admissions.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace

import msgpack

from common.tiers import ALL_TIERS, Tier
from gateway import estimate_dump
from gateway.arrival_forecast import ArrivalForecast
from gateway.estimate import (MAX_EXACT_DISPATCHES, PREEMPTED_BY, RUNNING, Held, Queued, Rates, Work, WorkerView,
                              wait_s)
from gateway.estimate_futures import FUTURES, told_wait_s
from gateway.timeutil import time_ms
from gateway.workers import reported_context, reported_guard, reported_step, step_tokens
from gateway.wait_learning import BiasCorrection, HandOffs, OutputLengths

# A report's age past this is not believed (a worker's clock or a bug): its running work is advanced this far at most.
MAX_REPORT_AGE_S = 5.0
# Rates for a worker that reports none (an older worker): only until a measuring one reports.
FALLBACK_RATES = Rates(prefill_tps=1000.0, decode_tps=50.0)
MAX_KNOWN_JOBS = 200_000  # job token counts kept in memory (oldest dropped first)
# Oldest jobs read per queue for an estimate: the rest are counted, not read (a bound on an estimate's cost). More
# than the dispatches it replays one by one, so the replay never runs out of read jobs where there are more.
MAX_QUEUE_READ = MAX_EXACT_DISPATCHES + 1


@dataclass(frozen=True)
class JobInfo:
    tenant: str | None
    tier: Tier  # granted at admission: the tier it preempts and is preempted as
    prompt_tokens: int
    max_tokens: int
    estimate_s: float | None = None  # the model's estimate at admission, before the bias correction
    promise_at_ms: int | None = None  # when its promised start falls due (Redis ms; gateway/promises.py)


class WaitEstimator:
    def __init__(self, queue, workers, clock: Callable[[], float], aging_interval_s: float = math.inf,
                 learn_bias: bool = True, futures: int = FUTURES,
                 dump: estimate_dump.DumpWriter | None = None, step_cost: bool = True) -> None:
        self.queue = queue  # gateway.redis_queue.RedisQueue
        self.workers = workers  # gateway.workers.WorkerRegistry
        self.aging_interval_s = aging_interval_s
        self.lengths = OutputLengths()
        self.handoffs = HandOffs()
        self.bias = BiasCorrection()
        self.learn_bias = learn_bias
        self.futures = futures  # drawn futures for a job near a slot (gateway/estimate_futures.py)
        self.step_cost = step_cost  # replay the workers' steps where they report their cost (estimate_steps.py)
        self.arrivals = ArrivalForecast(clock())
        self._jobs: OrderedDict[str, JobInfo] = OrderedDict()
        self.dump = dump  # each admitted job's estimate inputs, for scripts/estimate_replay.py

    # -- what happened ----------------------------------------------------------------------------------------------

    def admitted(self, job_id: str, tenant: str, tier: Tier, prompt_tokens: int, max_tokens: int, estimate_s: float,
                 now: float, promise_at_ms: int | None = None) -> None:
        raw = estimate_s / self.bias.factor(tier)
        self._remember(job_id, JobInfo(tenant, tier, prompt_tokens, max_tokens, raw, promise_at_ms))
        expected = self.lengths.expected(tenant, tier, max_tokens)
        if self.dump is not None:
            self.dump.admitted(job_id, now, Work(tier, prompt_tokens, expected))
        self.arrivals.add(tier, prompt_tokens, expected, now)

    def finished(self, job_id: str, state: str, num_tokens: int, queued_s: float | None) -> None:
        info = self._jobs.pop(job_id, None)
        if info is not None and state == "done":
            self.lengths.learn(info.tenant, info.tier, info.max_tokens, num_tokens)
            if self.learn_bias and queued_s is not None and info.estimate_s is not None:
                self.bias.learn(info.tier, info.estimate_s, queued_s)

    def handed_off(self, worker: str, seconds: float, busy: bool = True) -> None:
        """A job sent to ``worker`` started its prefill ``seconds`` after it was sent; ``busy``: the worker was
        running other work then."""
        self.handoffs.learn(worker, seconds, busy)

    def tier_of(self, job_id: str) -> Tier | None:
        """The tier a job was admitted at (what it may preempt as), if this gateway knows the job."""
        info = self._jobs.get(job_id)
        return info.tier if info is not None else None

    def _remember(self, job_id: str, info: JobInfo) -> None:
        self._jobs[job_id] = info
        while len(self._jobs) > MAX_KNOWN_JOBS:
            self._jobs.popitem(last=False)

    # -- estimates --------------------------------------------------------------------------------------------------

    def for_new(self, tenant: str, tier: Tier, now: float, tokens: int | None = None) -> float:
        """The wait of a job admitted now at ``tier``: it goes last in its tier. ``tokens``: its prompt +
        max_tokens (None: not known), by which only the workers it fits serve it (workers of different sizes)."""
        return self._estimate(tier, None, None, now, tokens)

    def for_queued(self, job_id: str, tier: Tier, now: float) -> float:
        """The wait still ahead of a queued job, from where it stands in the queues now."""
        score = self.queue.client.zscore(self.queue.keys.queue(tier), job_id)
        if score is None:
            return 0.0  # dispatched (or gone) meanwhile
        info = self.job_infos([job_id]).get(job_id)
        return self._estimate(info.tier if info else tier, job_id, score, now,
                              info.prompt_tokens + info.max_tokens if info else None)

    def starts_s(self, tiers: list[Tier], now: float) -> dict[str, dict[Tier, float]]:
        """Per worker and tier: seconds until a job of that tier sent there now would start, by the wait model on
        that worker's report alone (nothing queued before it, nothing to come): the rest of the step in progress,
        a waiting prompt's chunk, a guard. Where every worker is full, the dispatcher sends an urgent job where it
        starts first, as the model expects it to."""
        return {wid: {t: wait_s(t, [v]) for t in tiers} for wid, v in self._views_by_worker(now).items()}

    def _queued(self, tier: Tier, score: float | None) -> tuple[list[list[tuple[str, float]]], list[int], float]:
        """The queued jobs that may go before a job of ``tier`` enqueued at ``score`` (None: now), with their
        scores, per queue from P0 down; how many each of those queues holds in all (the read takes the oldest
        MAX_QUEUE_READ, which go first); and Redis's clock (ms). Every higher queue, the older jobs of its own
        and, as they may age past it, of the lower ones (none ever ages into P0)."""
        pipe = self.queue.client.pipeline(transaction=False)
        pipe.time()
        ranks = range(len(ALL_TIERS)) if tier.rank >= 1 else range(1)
        before = "+inf" if score is None else f"({score}"
        for r in ranks:
            key = self.queue.keys.queue(ALL_TIERS[r])
            upto = "+inf" if r < tier.rank else before
            pipe.zrangebyscore(key, "-inf", upto, start=0, num=MAX_QUEUE_READ, withscores=True)
            pipe.zcount(key, "-inf", upto)
        clock, *found = pipe.execute()
        return [[(i.decode(), s) for i, s in ids] for ids in found[0::2]], found[1::2], time_ms(clock)

    def _estimate(self, tier: Tier, job_id: str | None, score: float | None, now: float,
                  tokens: int | None = None) -> float:
        # Every worker serves the line: one the job does not fit takes the jobs ahead that fit it, as dispatch sends
        # them there, and so leaves the job's workers to it (a job only the big worker fits waited behind every job
        # ahead on the big worker alone, though the small one ran half of them). ``own``: the job's workers.
        by_worker = self._views_by_worker(now)
        views = list(by_worker.values())
        if not views:
            return 0.0  # no capacity known yet: nothing to estimate from, so nothing to shed on
        own = self._fits(list(by_worker), tier, tokens)
        per_queue, counts, now_ms = self._queued(tier, score)
        infos = self.job_infos([i for found in per_queue for i, _ in found])
        fits: dict[str, frozenset[int]] = {}
        if self.workers.uneven():
            per_queue, counts, fits = self._sharing(per_queue, counts, infos, list(by_worker))
        works: dict[tuple, Work] = {}  # jobs alike (most of a flood) share one: this runs per admission
        queued: list[Queued] = []
        unread: dict[Tier, tuple[int, Work]] = {}
        for queue, found, count in zip(ALL_TIERS, per_queue, counts):
            # Admitted by now: another gateway may admit between the clock read and the queue reads.
            read = [Queued(self._work_of(infos[i], works), min(0.0, (s - now_ms) / 1000),
                           _relative_s(infos[i].promise_at_ms, now_ms), fits.get(i))
                    for i, s in found if i in infos and i != job_id]
            if count > len(found) and read:  # the rest of a queue deeper than the read: as its read jobs
                unread[queue] = (count - len(found), Work(queue, statistics.fmean(q.work.prefill for q in read),
                                                          statistics.fmean(q.work.decode for q in read)))
            queued += read
        enqueued_s = 0.0 if score is None else min(0.0, (score - now_ms) / 1000)
        known = self._jobs.get(job_id) if job_id is not None else None
        arrivals = self.arrivals.arrivals(ALL_TIERS[:tier.rank], now, views)
        kw = dict(enqueued_s=enqueued_s, aging_interval_s=self.aging_interval_s,
                  promoted_s=_relative_s(known.promise_at_ms if known else None, now_ms))
        est = told_wait_s(tier, views, queued, futures=self.futures, arrivals=arrivals, unread=unread,
                          **({"fits": own} if own is not None else {}), **kw)
        bias = self.bias.factor(tier)
        told = est * bias if math.isfinite(est) else 0.0
        if self.dump is not None and job_id is None:  # a new job's: written once it is admitted
            self.dump.hold(estimate_dump.encode(told, bias, now, tier, views, queued, arrivals, unread, fits=own,
                                                **kw))
        return told

    def _fits(self, serving: list[str], tier: Tier, tokens: int | None) -> frozenset[int] | None:
        """Which of ``serving`` (indexes) a job of ``tier`` and ``tokens`` (prompt + max_tokens) fits, where it fits
        some and not others; None: all, none (it is sent on and fails), or its size not known."""
        if tokens is None:
            return None
        at = frozenset(k for k, wid in enumerate(serving) if self.workers.workers[wid].fits(tier, tokens))
        return at if 0 < len(at) < len(serving) else None

    def _sharing(self, per_queue: list[list[tuple[str, float]]], counts: list[int], infos: dict[str, JobInfo],
                 serving: list[str]) -> tuple[list[list[tuple[str, float]]], list[int], dict[str, frozenset[int]]]:
        """The queued jobs that may take a slot of the workers ``serving`` a job (those it fits, on workers of
        different sizes, in the order of the views replayed), per queue how many of them there are in all (a queue's
        unread jobs in the share of its read ones), and of those that fit only some of ``serving``, which (indexes
        into it: Queued.fits). Dispatch sends a job only to workers it fits: one ahead that fits none of these (or
        only a draining one) never takes their slots, however long it waits for its own; the job was told it would.
        One that fits some of them takes only their slots: the others go to the next job in line that fits there."""
        index = {wid: k for k, wid in enumerate(serving)}
        where: dict[tuple[Tier, int], frozenset[int] | None] = {}  # None: every one of ``serving``
        fits: dict[str, frozenset[int]] = {}
        out, totals = [], []
        for found, count in zip(per_queue, counts):
            kept = []
            for i, s in found:
                info = infos.get(i)
                key = (info.tier, info.prompt_tokens + info.max_tokens) if info is not None else None
                if key is not None and key not in where:
                    places = self.workers.places(*key)
                    at = None if places is None else frozenset(index[w] for w in places if w in index)
                    where[key] = None if at is not None and len(at) == len(serving) else at
                if key is None or where[key] is None:
                    kept.append((i, s))
                elif where[key]:
                    kept.append((i, s))
                    fits[i] = where[key]
            out.append(kept)
            totals.append(len(kept) + round((count - len(found)) * len(kept) / len(found)) if found else count)
        return out, totals, fits

    def _work_of(self, info: JobInfo, memo: dict[tuple, Work]) -> Work:
        key = (info.tenant, info.tier, info.prompt_tokens, info.max_tokens)
        work = memo.get(key)
        if work is None:
            work = memo[key] = self._work(info)
        return work

    def _work(self, info: JobInfo, generated: int = 0, prefill: int | None = None) -> Work:
        return Work(info.tier, info.prompt_tokens if prefill is None else prefill,
                    self.lengths.expected(info.tenant, info.tier, info.max_tokens, generated))

    def _worker_views(self, now: float, fit: tuple[Tier, int] | None = None) -> list[WorkerView]:
        return list(self._views_by_worker(now, fit).values())

    def _views_by_worker(self, now: float, fit: tuple[Tier, int] | None = None) -> dict[str, WorkerView]:
        """Per worker id, the worker as the wait model sees it. ``fit`` (a job's tier, prompt + max_tokens): only
        the workers such a job fits, where it fits some and not others: dispatch sends it nowhere else, so the
        others' slots never serve it. Where it fits all (workers alike) or none (it is sent on and fails), all."""
        # A draining worker takes no new job and hands back what it has not started; a worker silent for a lease
        # takes none until it reports again, and its leased jobs come back to the queue: none of their slots is
        # capacity for queued work.
        ws = [w for w in self.workers.workers.values() if not w.draining and not w.lost_lease]
        measured = [(w.load.prefill_tps, w.load.decode_tps) for w in ws
                    if w.load is not None and w.load.prefill_tps > 0 and w.load.decode_tps > 0]
        default = (Rates(sum(p for p, _ in measured) / len(measured), sum(d for _, d in measured) / len(measured))
                   if measured else FALLBACK_RATES)
        if fit is not None:
            ws = [w for w in ws if w.fits(*fit)] or ws
        pending = self.job_infos([j for w in ws for j in w.pending])
        views = {}
        for w in ws:
            load = w.load
            rates = (Rates(load.prefill_tps, load.decode_tps) if load is not None and load.prefill_tps > 0
                     and load.decode_tps > 0 else default)
            held = []
            # The running work has gone on since the report was built: its age when sent, and since it came. Where
            # the worker says what its steps cost, the model replays the steps since; else the work is advanced here.
            age = report_age_s(load, w.load_at, now) if load is not None else 0.0
            step = reported_step(load) if self.step_cost else None
            for job_id, entry in (load.work.items() if load is not None else ()):
                if len(entry) < 6 or not 0 <= entry[0] < len(ALL_TIERS):
                    continue  # a malformed entry from a worker: leave it out rather than guess
                rank, status, prefill, generated, max_tokens, mask = entry[:6]
                guard = reported_guard(entry)
                known = self._jobs.get(job_id)
                info = JobInfo(known.tenant if known else None, ALL_TIERS[rank], 0, max_tokens)
                h = Held(self._work(info, generated, prefill), status, mask, float(guard),
                         float(reported_context(entry)))
                held.append(advanced_held(h, rates, age) if status == RUNNING and step is None else h)
            for job_id in w.pending:  # sent since its last report: it starts as soon as it arrives
                if job_id in pending:
                    info = pending[job_id]
                    held.append(Held(self._work(info), RUNNING, PREEMPTED_BY[info.tier]))
            wid = w.hello.worker_id
            views[wid] = WorkerView(w.hello.max_num_seqs, rates, held, self.handoffs.of(wid, busy=True),
                                    self.handoffs.of(wid, busy=False), step_tokens(w.hello), step,
                                    age if step is not None else 0.0)
        return views

    def job_infos(self, ids: list[str]) -> dict[str, JobInfo]:
        """Tier granted and token counts of the given jobs (those still known): from memory, else read once from
        their payloads in Redis."""
        out = {i: self._jobs[i] for i in ids if i in self._jobs}
        missing = [i for i in ids if i not in out]
        if missing:
            pipe = self.queue.client.pipeline(transaction=False)
            for i in missing:
                pipe.hmget(self.queue.keys.job(i), "tenant", "tier_granted", "payload", "promise_at_ms")
            for i, (tenant, tier, payload, promise) in zip(missing, pipe.execute()):
                if tenant is None or tier is None or payload is None:
                    continue  # finished meanwhile
                body = msgpack.unpackb(payload)
                info = JobInfo(tenant.decode(), Tier(tier.decode()), len(body["prompt_token_ids"]),
                               int(body["max_tokens"]), promise_at_ms=int(promise) if promise else None)
                self._remember(i, info)
                out[i] = info
        return out


def report_age_s(load, received_at: float, now: float) -> float:
    """How long ago a worker built ``load``: its age when sent (a finite, bounded one) plus the time since it came."""
    sent = load.age_s if isinstance(load.age_s, (int, float)) and math.isfinite(load.age_s) else 0.0
    return min(MAX_REPORT_AGE_S, max(0.0, sent) + max(0.0, now - received_at))


def advanced_held(h: Held, rates: Rates, seconds: float) -> Held:
    """Running work ``h`` after ``seconds`` more at ``rates``: its work and its guard have both gone on."""
    work = advanced(h.work, rates, seconds)
    return replace(h, work=work, guard=max(0.0, h.guard - (h.work.decode - work.decode)))


def advanced(work: Work, rates: Rates, seconds: float) -> Work:
    """``work`` after running ``seconds`` more at ``rates``: prefill first, then decode; never below nothing."""
    prefill_s = work.prefill / rates.prefill_tps
    if seconds <= prefill_s:
        return Work(work.tier, work.prefill - seconds * rates.prefill_tps, work.decode)
    return Work(work.tier, 0.0, max(0.0, work.decode - (seconds - prefill_s) * rates.decode_tps))


def _relative_s(at_ms: int | None, now_ms: int) -> float:
    """Seconds from ``now_ms`` to ``at_ms`` (never: inf)."""
    return math.inf if at_ms is None else (at_ms - now_ms) / 1000
