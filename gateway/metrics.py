"""The gateway's Prometheus metrics.

Events (admission, refusal, dispatch, the end of a job this gateway streamed) are counted by
one-line calls from where they happen. What is state rather than an event (queue depth, the
workers registered, the gateway's own event counters) is read when Prometheus scrapes, so it
is never stale and costs nothing between scrapes. Queue depth is the cluster's (Redis), the
same from every gateway: aggregate it with ``max``, not ``sum``.
"""

from __future__ import annotations

import logging
import uuid
from collections import OrderedDict
from collections.abc import Container

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common import metrics
from common.metrics import LATENCY_BUCKETS, TIER_VALUES

log = logging.getLogger("gateway.metrics")

ADMISSIONS = Counter("ts_admissions_total", "Jobs admitted (duplicates of an idempotency key not counted), by the "
                     "tier they queue in", ["tier"])
REFUSALS = Counter("ts_refusals_total", "Submissions refused, by error code (nothing was stored; unavailable: Redis "
                   "unreachable), and client frames of any kind refused before they could be read (an unknown API "
                   "key, a malformed frame)", ["code"])
QUEUE_WAIT = Histogram("ts_queue_wait_seconds", "Time from admission (or re-queue) to dispatch, per attempt",
                       ["tier"], buckets=LATENCY_BUCKETS)
TTFT = Histogram("ts_time_to_first_token_seconds", "Time from admission to the job's first token reaching the "
                 "gateway holding its lease, once per job that produced one (observed there, whichever gateway "
                 "admitted it, once it claimed the observation in the job's hash: sum over gateways)", ["tier"],
                 buckets=LATENCY_BUCKETS)
E2E = Histogram("ts_request_e2e_latency_seconds", "Time from admission to the end of a job that ended done, observed "
                "by the gateway that stored its result (sum over gateways)", ["tier"], buckets=LATENCY_BUCKETS)
# Workers with hand-off series at once (up to 2 histograms of 20 samples each: 128 make some 5,000 a scrape); the
# rest are counted under OTHER_WORKERS, an id no hello may claim (gateway/hello_policy.HelloPolicy refuses it).
HANDOFF_WORKERS = 128
OTHER_WORKERS = "_other_workers"
_handoff_workers: set[str] = set()
HANDOFF = Histogram("ts_dispatch_handoff_seconds", "Time from a dispatch to the first prefill of that attempt "
                    "starting on the worker, once per dispatch attempt, observed by the gateway that sent it: mostly "
                    "the rest of the engine step in progress there (a worker reads its dispatches between steps), "
                    "during which the slot the job was sent to stands idle; worker_state: "
                    "whether the worker was running other work (busy) or nothing (idle) when the job was sent; "
                    f"worker: the workers registered now only, past {HANDOFF_WORKERS} of them the later ones as "
                    f"{OTHER_WORKERS}",
                    ["worker", "worker_state"], buckets=LATENCY_BUCKETS)
FINISHED = Counter("ts_jobs_finished_total", "Jobs that ended, by the tier they were admitted at and final state, "
                   "counted once by the gateway that stored the final state (sum over gateways: it matches the sum "
                   "of ts_admissions_total less the jobs still queued or running)", ["tier", "state"])
PROMOTIONS = Counter("ts_promotions_total", "Queued P2/P3 jobs this gateway moved up one tier when their promised "
                     "start fell due (gateway/promises.py), by the tier they left: each is a job that arrivals beyond "
                     "the forecast would have kept waiting past its estimate", ["tier"])
REQUEUES = Counter("ts_requeues_total", "Dispatched jobs this gateway put back in their queue (outcome queued) or "
                   "dead-lettered (dead), by cause: lease_expired (its worker went silent: the attempt's work is "
                   "lost) or released (a draining worker handed it back, worker/drain.py)", ["cause", "outcome"])

WITHDRAWALS = Counter("ts_withdrawals_total", "Submissions their client gave up on and withdrew (the SDK does after a "
                      "submit() that got no answer: cancelled, timed out): admitted (a job was, and the withdrawal "
                      "cancelled it unless it had ended) or before_admission (none yet: one on its way is refused)",
                      ["outcome"])

for _cause in ("lease_expired", "released"):
    REQUEUES.labels(_cause, "queued")
for _outcome in ("admitted", "before_admission"):
    WITHDRAWALS.labels(_outcome)

for _t in TIER_VALUES:  # every tier's series exists from the start, so rate() sees the first event
    ADMISSIONS.labels(_t)
    if _t == "P3":
        PROMOTIONS.labels(_t)
    for _h in (QUEUE_WAIT, TTFT, E2E):
        _h.labels(_t)

# job id -> [tier admitted at, its admission on this gateway's clock (None: unknown), first token seen], for the
# jobs whose lease this gateway took. Bounded: a job another gateway ends (a cancel, a lease moved on) stays until
# it ages out.
_HELD: OrderedDict[str, list] = OrderedDict()
_MAX_TRACKED = 200_000
# job id -> (tier, TTFT, claim tag): first tokens seen here, observed once this gateway claims them in Redis
# (first_token.lua, with the next token-log flush; the tag wins a claim asked again after a lost reply). Seen here
# alone says little: a job's first token reaches a second gateway when its lease moved on before the token log had
# it, or when the gateway holding it stood still with the frames unread.
_FIRST_TOKENS: OrderedDict[str, tuple[str, float, str]] = OrderedDict()


def admitted(tier: str) -> None:
    ADMISSIONS.labels(tier).inc()


def holding(job_id: str, tier: str, admitted_at: float | None, token_seen: bool) -> None:
    """This gateway took ``job_id``'s lease. ``token_seen``: an earlier attempt produced its first token (its
    TTFT was observed then)."""
    _HELD[job_id] = [tier, admitted_at, token_seen]
    _HELD.move_to_end(job_id)
    while len(_HELD) > _MAX_TRACKED:
        _HELD.popitem(last=False)


def first_token(job_id: str, now: float) -> None:
    """A token reached the lease holder; the job's first is to be observed once it is claimed (first_tokens())."""
    held = _HELD.get(job_id)
    if held is None or held[2]:
        return
    held[2] = True
    if held[1] is not None:
        _FIRST_TOKENS[job_id] = (held[0], max(0.0, now - held[1]), uuid.uuid4().hex[:16])
        while len(_FIRST_TOKENS) > _MAX_TRACKED:
            _FIRST_TOKENS.popitem(last=False)


def first_tokens() -> list[str]:
    """The jobs whose first token this gateway saw and has not claimed yet (kept until claimed() says)."""
    return list(_FIRST_TOKENS)


def first_token_pending(job_id: str) -> bool:
    """Whether ``job_id``'s first token was seen here and not claimed yet."""
    return job_id in _FIRST_TOKENS


def claim_tag(job_id: str) -> str:
    """The tag of ``job_id``'s pending claim (first_token.lua), the same each time it is asked; "" if none."""
    pending = _FIRST_TOKENS.get(job_id)
    return pending[2] if pending is not None else ""


def claim_ttft_ms(job_id: str) -> int | None:
    """The pending first token's delay after the admission, ms (first_token.lua keeps the earliest in the hash, for
    the gateway that stores the result: it may never have heard that token); None if none is pending."""
    pending = _FIRST_TOKENS.get(job_id)
    return round(pending[1] * 1000) if pending is not None else None


def claimed(job_id: str, won: bool) -> None:
    """The claim of ``job_id``'s first token was answered: observed if this gateway won it, else dropped."""
    pending = _FIRST_TOKENS.pop(job_id, None)
    if pending is not None and won:
        TTFT.labels(pending[0]).observe(pending[1])


def ended(job_id: str, tier: str | None, state: str, now: float) -> None:
    """This gateway stored ``job_id``'s final state (only one gateway can: the scripts change a job's state once).
    ``tier``: the tier it was admitted at, if the caller has its record."""
    held = _HELD.pop(job_id, None)
    tier = tier or (held[0] if held is not None else None)
    if tier is None:
        return
    FINISHED.labels(tier, state).inc()
    if state == "done" and held is not None and held[1] is not None:
        E2E.labels(tier).observe(max(0.0, now - held[1]))


def let_go(job_id: str) -> None:
    """``job_id``'s lease here was settled (back in its queue): whoever dispatches it next holds it."""
    _HELD.pop(job_id, None)


def held_tier(job_id: str) -> str | None:
    held = _HELD.get(job_id)
    return held[0] if held is not None else None


def withdrawn(outcome: str) -> None:
    WITHDRAWALS.labels(outcome).inc()


def refused(code: str) -> None:
    REFUSALS.labels(code).inc()


def handed_off(worker: str, seconds: float, busy: bool, registered: Container[str]) -> None:
    """``registered``: the workers this gateway knows now. A worker's id is whatever its hello claims where workers
    are not authenticated, and each id handed a job kept its series for the gateway's life (a peer's flood of ids, or
    every restart under a new one, made series without end): those of the workers gone are dropped when another's
    first comes, and past HANDOFF_WORKERS at once the others' are counted under OTHER_WORKERS."""
    if worker not in _handoff_workers and worker != OTHER_WORKERS:
        for gone in [w for w in _handoff_workers if w not in registered]:
            _handoff_workers.discard(gone)
            for state in ("busy", "idle"):
                try:
                    HANDOFF.remove(gone, state)
                except KeyError:  # only one of its two states was observed
                    pass
        if len(_handoff_workers) < HANDOFF_WORKERS:
            _handoff_workers.add(worker)
        else:
            worker = OTHER_WORKERS
    HANDOFF.labels(worker, "busy" if busy else "idle").observe(max(0.0, seconds))


def promoted(tier: str) -> None:
    PROMOTIONS.labels(tier).inc()


def requeued(cause: str, outcome: str) -> None:
    REQUEUES.labels(cause, outcome).inc()


def dispatched(tier: str, waited_s: float) -> None:
    QUEUE_WAIT.labels(tier).observe(max(0.0, waited_s))


class GatewayState(Collector):
    """Read at scrape time from the gateway object (its Redis queue, worker registry and counters)."""

    def __init__(self, gateway) -> None:
        self.gateway = gateway

    def collect(self):
        depth = GaugeMetricFamily("ts_queue_depth", "Jobs queued in Redis, per tier (cluster-wide)", labels=["tier"])
        try:
            depths = {t.value: n for t, n in self.gateway.queue.depths().items()}
        except Exception as e:  # Redis away: the scrape still answers, without this family's samples
            log.warning("queue depth unavailable: %s", e)
            depths = {}
        for tier, n in depths.items():
            depth.add_metric([tier], n)
        yield depth
        yield GaugeMetricFamily("ts_workers_registered", "Workers this gateway can dispatch to",
                                value=len(self.gateway.workers.workers))
        events = CounterMetricFamily("ts_gateway_events", "The gateway's own event counts (malformed frames, "
                                     "handler errors, unroutable replies, dispatches, ...)", labels=["event"])
        for name, n in dict(self.gateway.counters).items():
            events.add_metric([name], n)
        yield events


def serve(bind: str, gateway) -> None:
    """Serve /metrics on ``bind`` (``host:port``; empty: none), with the scrape-time state of ``gateway``."""
    metrics.serve(bind, GatewayState(gateway) if bind else None)
