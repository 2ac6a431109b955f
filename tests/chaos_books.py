"""The books of a run with faults (tests/test_chaos.py, tests/test_long_pauses.py): what the clients saw, one plain
dict a job (``Books``, ``outcome``), and the checks at the end against the jobs' records in Redis and the workers'
metrics (``check_books``)."""

from __future__ import annotations

import threading
from contextlib import contextmanager

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gateway.sdk import JobCancelled, JobExpired, JobFailed
from tests.cluster_helpers import wait_for
from tests.durable_cluster import DurableCluster

TERMINAL = {"done", "failed", "expired", "cancelled", "dead"}
EOS = 1  # scripts/make_tiny_model.py: <|bos|>, <|eos|>, <|pad|>


def scrape(url: str) -> dict[str, float]:
    """{sample name + sorted labels: value} of one /metrics page."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in family.samples:
            out[s.name + repr(sorted(s.labels.items()))] = s.value
    return out


def summed(page: dict[str, float], name: str) -> float:
    return sum(v for k, v in page.items() if k.startswith(name + "["))


class Books:
    """What the clients saw, shared by every client thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: dict[str, dict] = {}  # job id -> record
        self.refused: list[str] = []
        self.problems: list[str] = []

    def add(self, rec: dict) -> None:
        with self.lock:
            if rec["id"] in self.jobs:
                self.problems.append(f"two submissions under different keys got job {rec['id']}")
            self.jobs[rec["id"]] = rec

    def problem(self, msg: str) -> None:
        with self.lock:
            self.problems.append(msg)


@contextmanager
def outcome(rec: dict):
    """Around a wait for a job's result, sync or async: what it gave goes in the record, the result the caller hands
    to ``got`` (its tokens and finish reason) or the error's kind."""
    try:
        yield lambda res: rec.update(result=list(res.token_ids), finish_reason=res.finish_reason)
    except JobCancelled:
        rec["error"] = "cancelled"
    except JobExpired:
        rec["error"] = "expired"
    except JobFailed as e:
        rec["error"] = f"failed: {e}"


def jobs_in_redis(c: DurableCluster) -> set[str]:
    return {k.decode().rsplit(":", 1)[1] for k in c.redis.scan_iter(match="ts:{c}:job:*", count=1000)}


def check_books(c: DurableCluster, books: Books, *, wait_s: float, ends: tuple[str, ...] = ("done",),
                allowed_failures: tuple[str, ...] = (), wk_metrics: dict[str, str] | None = None) -> list[str]:
    """What went wrong, as lines: every admitted job ended (within ``wait_s``) in one of ``ends``, or failed for
    one of ``allowed_failures`` (substrings of a reason the scenario may rightly give) with its client told so;
    what its client was told agrees with it; a done job is whole and streamed as stored; no queue or index holds an
    ended job and no lease is left; and with ``wk_metrics`` (worker -> /metrics URL), the idle workers hold no KV."""
    bad = list(books.problems)
    jobs = books.jobs
    wait_for(lambda: all(c.state(j) in TERMINAL for j in jobs), wait_s,
             f"every admitted job to end: {sorted((c.state(j), j) for j in jobs if c.state(j) not in TERMINAL)}",
             interval=0.5)
    in_redis = jobs_in_redis(c)
    if in_redis != set(jobs):
        bad.append(f"jobs in Redis no client was given: {sorted(in_redis - set(jobs))}; "
                   f"admitted jobs missing from Redis: {sorted(set(jobs) - in_redis)}")
    for j, rec in jobs.items():
        bad += job_problems(c, j, rec, ends, allowed_failures)
    bad += index_problems(c)
    if wk_metrics:
        bad += kv_held(wk_metrics)
    return bad


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def job_problems(c: DurableCluster, j: str, rec: dict, ends: tuple[str, ...],
                 allowed_failures: tuple[str, ...]) -> list[str]:
    """One ended job against its client's record (outcome's result or error; ``cancelled``, what cancel() said;
    ``streamed`` and ``indices``, what a whole stream gave; ``action`` "abandon", a client that read no result)."""
    bad = []
    h = c.job(j)
    state, spec, reason = h.get("state", b"").decode(), rec["spec"], h.get("reason", b"").decode()
    told = rec.get("error")
    if state == "failed" and any(a in reason for a in allowed_failures):
        if (told or "").split(":")[0] != "failed":
            bad.append(f"{j} failed ({reason}), but its client was told {told or 'a result'}")
    elif state not in ends:
        what = ", ".join(x for x in (rec.get("action"), spec["tier"], f"attempt {h.get('attempt')}") if x)
        bad.append(f"{j} ({what}) ended {state}: {reason}; its client: {told}")
    if rec.get("cancelled") and state != "cancelled":
        bad.append(f"{j}: cancel() said True, but the job is {state}")
    if rec.get("cancelled") is False and state == "cancelled":
        bad.append(f"{j}: cancel() said False, but the job is cancelled")
    if state == "cancelled" and "result" in rec:
        bad.append(f"{j}: cancelled, yet its client got a result of {len(rec['result'])} tokens")
    if told == "cancelled" and state != "cancelled":
        bad.append(f"{j}: its client was told cancelled, but the job is {state}")
    if state != "done":
        return bad
    stored = c.stored_tokens(j)
    n, want_n = len(stored), spec["max_tokens"]
    if not (n == want_n or (n < want_n and not spec["ignore_eos"] and stored and stored[-1] == EOS)):
        bad.append(f"{j}: done with {n} of {want_n} tokens, last {stored[-1:]}, ignore_eos={spec['ignore_eos']}")
    if EOS in stored[:-1] and not spec["ignore_eos"]:
        bad.append(f"{j}: EOS inside its result at {stored.index(EOS)}")
    if told is not None:
        bad.append(f"{j}: done, but its client was told {told}")
    elif rec.get("action") != "abandon" and rec.get("result") != stored:
        bad.append(f"{j}: its client's result ({len(rec.get('result') or [])} tokens) is not the stored one "
                   f"({n} tokens)")
    if "streamed" in rec and rec["streamed"] != stored:
        bad.append(f"{j}: streamed {len(rec['streamed'])} tokens (chunk indices {rec['indices'][:8]}...), stored "
                   f"{n}; first difference at {first_difference(rec['streamed'], stored)}")
    return bad


def index_problems(c: DurableCluster) -> list[str]:
    """Queues and indices hold only jobs that may still run; no lease is left."""
    bad = []
    for key, ok in [(f"q:P{t}", {"queued"}) for t in range(4)] + [("inflight", {"dispatched"}),
                                                                    ("aging", {"queued"}),
                                                                    ("deadlines", {"queued"})]:
        for m in c.redis.zrange(f"ts:{{c}}:{key}", 0, -1):
            st = c.state(m.decode())
            if st not in ok:
                bad.append(f"{key} holds {m.decode()}, which is {st}")
    left = c.redis.zcard("ts:{c}:inflight")
    if left:
        bad.append(f"{left} leases left with every job ended")
    return bad


def kv_held(wk_metrics: dict[str, str]) -> list[str]:
    """The idle workers come to hold no KV block and no request (within 30 s), or what they still hold."""
    def idle() -> bool:
        pages = [scrape(u) for u in wk_metrics.values()]
        return all(summed(p, "ts_kv_cache_usage_ratio") == 0 and summed(p, "ts_num_requests_running") == 0
                   and summed(p, "ts_num_requests_waiting") == 0 for p in pages)
    try:
        wait_for(idle, 30, "idle workers to hold no KV block", interval=0.5)
    except AssertionError as e:
        held = {n: {k: v for k, v in scrape(u).items() if v and ("kv_cache_usage" in k or "num_requests" in k)}
                for n, u in wk_metrics.items()}
        return [f"{e}: {held}"]
    return []
