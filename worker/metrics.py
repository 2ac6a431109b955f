"""The worker's Prometheus metrics.

Cumulative engine statistics (preemptions by victim tier and mode, wasted and recomputed
tokens, bytes swapped) and the engine's state (KV usage, requests running, waiting and
suspended per tier) are read from the engine when Prometheus scrapes: the scheduler already
counts them, so they are counted once. Events the scheduler keeps no count of (a suspended
request resuming, tokens produced, requests ending) come from the engine's observer
(worker/tracing.py), one call per event.

The scrape runs in the metrics server's thread while the step loop runs: it reads copies of
lists and counters (each copy is atomic under the GIL) and never changes anything.
"""

from __future__ import annotations


from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common import metrics
from common.metrics import LATENCY_BUCKETS, TIER_VALUES
from worker import linger
from worker.request import Request, RequestStatus
from worker.scheduler import SchedulerOutput

RECOVERED = Counter("ts_preempt_recover_total", "Preempted requests that resumed running")
PREEMPT_WAIT = Histogram("ts_request_preempt_wait_seconds", "Time a preempted request spent suspended before it "
                         "resumed, per suspension", ["tier"], buckets=LATENCY_BUCKETS)
PROMPT_TOKENS = Counter("ts_prompt_tokens_total", "Prompt tokens of requests that produced their first token here, "
                        "once per request (prefilled again after a recompute preemption: not counted again; a job "
                        "re-dispatched to this worker: its prompt counted here too, the earlier attempts' tokens "
                        "prefilled with it not)")
GENERATION_TOKENS = Counter("ts_generation_tokens_total", "Tokens sampled here, each once (a preempted request "
                            "samples none again on resume), including those of requests later cancelled, handed back "
                            "or cut off: summed over workers, a job's tokens plus any a lost attempt sampled that no "
                            "gateway logged before the job was re-dispatched (sampled again there)")
FINISHED = Counter("ts_requests_finished_total", "Requests that ended on this worker, by tier and finish reason",
                   ["tier", "reason"])

LINGER_OFFERS = Counter("ts_dispatch_linger_total", "Load reports offering a gateway a slot or a victim, by what "
                        "the step loop did next: waited and the dispatch came in time (answered), waited it out "
                        "(unanswered), or stepped at once (not_waited)", ["outcome"])
LINGER_SECONDS = Counter("ts_dispatch_linger_seconds", "Seconds the step loop waited for dispatches answering its "
                         "reports, summed (every running job waited them too)")
LINGER_OUTCOMES = linger.OUTCOMES
UNCONFIRMED = Counter("ts_unconfirmed_completions_total", "Completions no gateway had confirmed in time (a gateway "
                      "restarting or gone): a copy sent again to every gateway that one took (resent), or that every "
                      "one refused, its send queue full (refused: tried again every 0.1 s), or left to their lease "
                      "after a minute (given_up)", ["event"])

for _t in TIER_VALUES:
    PREEMPT_WAIT.labels(_t)
for _o in LINGER_OUTCOMES:
    LINGER_OFFERS.labels(_o)
for _e in ("resent", "refused", "given_up"):
    UNCONFIRMED.labels(_e)

# request id -> its suspended_total_s when last seen resuming, so each resume observes only its own gap.
_suspended_before: dict[str, float] = {}


def resumed(req: Request) -> None:
    RECOVERED.inc()
    before = _suspended_before.get(req.request_id, 0.0)
    PREEMPT_WAIT.labels(req.tier.value).observe(max(0.0, req.suspended_total_s - before))
    _suspended_before[req.request_id] = req.suspended_total_s


def dispatch_linger(outcome: str, waited_s: float) -> None:
    """An offering report's wait ended (worker/linger.py)."""
    LINGER_OFFERS.labels(outcome).inc()
    LINGER_SECONDS.inc(waited_s)


def unconfirmed_completions(event: str, n: int) -> None:
    """``n`` completions were sent again (taken or refused), or given up (worker/completions.py)."""
    UNCONFIRMED.labels(event).inc(n)


def step_finished(out: SchedulerOutput) -> None:
    sampled = [c.request for c in out.chunks if c.sample]
    GENERATION_TOKENS.inc(len(sampled))
    # A request's first token here (its output now holds one past what it was added with: a re-dispatch resumes
    # from earlier attempts' tokens) completes its prompt; a recompute after preemption prefills again but
    # produces a later token, so no prompt counts twice.
    PROMPT_TOKENS.inc(sum(r.num_prompt_tokens for r in sampled if len(r.output_token_ids) == r.added_output_tokens + 1))


def request_finished(req: Request) -> None:
    _suspended_before.pop(req.request_id, None)
    FINISHED.labels(req.tier.value, req.finish_reason.value if req.finish_reason else "unknown").inc()


class EngineState(Collector):
    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        e = self.engine
        stats = e.stats()
        preemptions = CounterMetricFamily("ts_preemptions", "Preemptions, by the victim's tier and how it gave way "
                                          "(keep, swap, recompute)", labels=["victim_tier", "mode"])
        for (tier, mode), n in dict(stats.preemptions).items():
            preemptions.add_metric([getattr(tier, "value", str(tier)), getattr(mode, "value", str(mode))], n)
        yield preemptions
        yield CounterMetricFamily("ts_preempt_wasted_tokens", "Computed KV tokens discarded by recompute "
                                  "preemptions", value=stats.wasted_tokens)
        yield CounterMetricFamily("ts_preempt_recomputed_tokens", "Tokens prefilled again after a recompute "
                                  "preemption", value=stats.recomputed_tokens)
        yield CounterMetricFamily("ts_preempt_swapped_bytes", "KV bytes copied between device and host by swap "
                                  "preemptions (both directions)", value=stats.bytes_swapped)
        yield CounterMetricFamily("ts_preempt_declined", "Preemptions considered and declined",
                                  value=stats.declined)
        yield CounterMetricFamily("ts_preempt_suspended_seconds", "Time resumed requests spent suspended, summed",
                                  value=stats.suspended_s)
        usage = e.kv_usage()
        yield GaugeMetricFamily("ts_kv_cache_usage_ratio", "KV cache blocks in use / blocks in the pool",
                                value=usage.utilisation)
        yield GaugeMetricFamily("ts_kv_cache_blocks", "KV cache blocks in the pool", value=usage.num_blocks)
        running = {t: 0 for t in TIER_VALUES}
        waiting = {t: 0 for t in TIER_VALUES}
        suspended = {t: 0 for t in TIER_VALUES}
        for r in list(e.scheduler.running):
            running[r.tier.value] += 1
        for r in list(e.scheduler.waiting):
            waiting[r.tier.value] += 1
            if r.status is RequestStatus.SUSPENDED:
                suspended[r.tier.value] += 1
        for name, help_, values in (
                ("ts_num_requests_running", "Requests holding a batch slot", running),
                ("ts_num_requests_waiting", "Requests waiting for a batch slot (new and preempted)", waiting),
                ("ts_num_requests_suspended", "Preempted requests waiting to resume (part of waiting)", suspended)):
            family = GaugeMetricFamily(name, help_, labels=["tier"])
            for tier, n in values.items():
                family.add_metric([tier], n)
            yield family


def serve(bind: str, engine) -> None:
    """Serve /metrics on ``bind`` (``host:port``; empty: none), with the scrape-time state of ``engine``."""
    metrics.serve(bind, EngineState(engine) if bind else None)
