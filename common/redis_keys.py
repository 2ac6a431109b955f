"""Every Redis key of the serving cluster, in one place, and the loader of the Lua scripts.

All keys of one cluster start with ``<prefix>:{<tag>}:``. The ``{<tag>}`` is a
Redis Cluster hash tag, so every key of a cluster maps to one slot and every
multi-key Lua script is Cluster-safe (scripts receive all their keys in KEYS).

Key layout (``P`` is a tier P0..P3; ``<id>`` a job id):

======================  ===========  ==========================================================
key                     type         contents and lifetime
======================  ===========  ==========================================================
``q:P``                 sorted set   queued job ids of tier P, score = enqueue time in ms. A job
                                     keeps that score when it ages into a higher tier, so it
                                     lands ahead of newer jobs there. Member while queued.
``job:<id>``            hash         the job (fields below). No TTL while queued or dispatched;
                                     after done / failed / expired / cancelled it expires
                                     ``result_ttl`` later (default: the idempotency TTL; the
                                     gateway's ``result_ttl_s`` 1 h) and its payload is dropped.
                                     A duplicate submission whose job has expired gets the job id
                                     (its status is then not found). Dead-lettered jobs keep their
                                     payload for an operator, and expire ``result_ttl`` later too.
``tok:<id>``            stream       the tokens of a running job, appended in batches by the gateway
                                     holding its lease (entry fields ``i`` = index of the first
                                     token, ``t`` = msgpack list), read by gateways streaming it to
                                     clients. Capped, TTL 1 h; deleted when the job completes or is
                                     cancelled (the result is then in the job hash).
``inflight``            sorted set   dispatched job id -> lease expiry in ms. Member while
                                     dispatched; heartbeats move the expiry forward.
``dead``                sorted set   dead-lettered job id -> time of dead-lettering in ms. Keeps
                                     the newest ``dead_letter_max``; the oldest are dropped with
                                     their hashes. An entry may outlive its (expired) hash.
``idem:<tenant>:<key>`` string       job id admitted under this idempotency key, then a space and
                                     the request's fingerprint (gateway/admission.fingerprint); TTL
                                     ``idempotency_ttl`` (default 24 h) from admission, or for a
                                     client's retry key (SubmitRequest.retry_key) the shorter of it
                                     and ``result_ttl``. ``-``: withdrawn (CancelRequest by key)
                                     before any admission, for that shorter TTL. The
                                     tenant is percent-encoded so ':' cannot make names collide.
``tenant-jobs:<tenant>`` sorted set  the tenant's admitted job ids -> admission ms, kept only under a
                                     per-tenant cap (``tenant_max_jobs``); finished ones are pruned
                                     by admit.lua when the set reaches the cap. At most cap members.
``quota:<tenant>``      hash         P0 token bucket: ``tokens`` (float), ``ts_ms`` (last
                                     update). Expires when the bucket would be full again (a
                                     missing bucket *is* a full one), so idle tenants cost
                                     nothing.
``drain``               hash         drain statistics per tier, updated by complete.lua:
                                     ``completed:P`` (count of done + failed), ``rate:P`` and
                                     ``ts:P`` (see below). Permanent.
``aging``               sorted set   index: queued job id of an agable tier (P2, P3) ->
                                     ``tier_since_ms``, so aging finds due jobs without scanning
                                     queues. Member while queued in P2 or P3.
``deadlines``           sorted set   index: queued job id -> the ms at which its queue timeout
                                     expires (enqueue + timeout of the tier granted at
                                     admission; a requeue starts the timeout again). Member while
                                     queued, if the tier has a timeout.
``promises``            sorted set   index: queued P3 job id -> the ms its promised start falls
                                     due (``promise_at_ms``), when promote.lua moves it to P2 (see
                                     gateway/promises.py). Member from admission until claimed; an
                                     entry of a job no longer queued is dropped when it falls due.
``worker-key:<id>``     string       the CURVE key (z85) worker ``<id>`` said hello with, so that no
                                     gateway gives its id to another key (gateway/security.py). TTL
                                     2 x max(lease, worker timeout), refreshed by its load reports.
``drained-workers``     hash         worker id -> ``<until ms> <msgpack tier limits>`` of a worker whose
                                     reports said it drains (gateway/drained.py): every gateway keeps a
                                     job only it fits waiting for its return. An entry counts until
                                     DRAINED_MEMORY_S + worker timeout after its last draining report;
                                     deleted when the worker says hello or reports as not draining.
``model``               hash         the cluster's one model (gateway/model_pin.py): ``model``,
                                     ``vocab_size``, ``max_model_len`` and ``digest:<scheme>`` of the
                                     first worker a gateway took. TTL 2 x max(lease, worker timeout),
                                     refreshed by the hellos and load reports of workers taken.
``tokenizer``           string       common/tokenizer_digest of the tokenizer the queued jobs' ids
                                     were made with: set by the first gateway started with a
                                     tokenizer (gateway/tokenizer_pin.py); one with another refuses
                                     to start. Permanent: delete it only with the queues drained.
======================  ===========  ==========================================================

Job hash fields: ``id``, ``tenant``, ``tier`` (current), ``tier_requested`` (asked by the
client), ``tier_granted`` (at admission, after any quota downgrade), ``state`` (queued |
dispatched | done | failed | expired | cancelled | dead), ``payload`` (bytes, opaque: the
gateway's msgpack request), ``enqueued_at_ms``, ``tier_since_ms`` (entered current tier),
``attempt`` (0 at admission, +1 per claim), ``estimate_s`` (wait estimate at admission),
``deadline_ms`` (queue deadline, absent if the tier has none; moved on by a requeue), ``promise_at_ms`` (when its
promise falls due, P3 only), ``promoted_at_ms`` (when it did), ``worker`` and ``gateway``
(holder while dispatched), ``dispatched_at_ms``, ``reason`` (why it failed, expired, died or was
cancelled), ``finished_at_ms``, ``ttft_observed_by`` (the gateway that observed its time to first token:
first_token.lua) and ``ttft_claim`` (that claim's tag), ``first_prefill_ms`` (the earliest first prefill start
any attempt reported, the end of its wait: first_prefill.lua; complete.lua stores the wait to it),
``first_token_ms`` (the earliest first token any gateway told with its claim: first_token.lua; complete.lua stores
the TTFT to it), ``stop_at`` (its answer ends with this many tokens, on every attempt: stop_at.lua), plus any
result fields given to complete().

Drain rate formula (per tier, jobs/s): an exponentially decayed count of completions,
``rate(t) = (1/tau) * sum_i exp(-(t - t_i) / tau)`` over completion times ``t_i``. It is
stored as ``rate:P`` = rate at ``ts:P`` and updated on each completion at ``now`` by
``rate = rate * exp(-(now - ts) / tau) + 1/tau``; a reader decays it to the present the same
way. For completions at a steady ``r`` jobs/s it converges to ``r``; ``tau`` (default 30 s) is
the memory of the average.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis
from redis.commands.core import Script

from common.tiers import ALL_TIERS, Tier

LUA_DIR = Path(__file__).resolve().parent / "lua"


@dataclass(frozen=True)
class KeySpace:
    """Key names of one cluster: ``KeySpace(prefix="ts")`` gives ``ts:{c}:q:P0`` and so on."""

    prefix: str  # distinguishes deployments (and tests) sharing one Redis
    tag: str = "c"  # the hash tag: all keys of the cluster share the slot of this string

    def __post_init__(self) -> None:
        for name, value in (("prefix", self.prefix), ("tag", self.tag)):
            if not value or any(ch in value for ch in "{}"):
                raise ValueError(f"KeySpace {name} must be non-empty and free of braces, got {value!r}")

    @property
    def base(self) -> str:
        return f"{self.prefix}:{{{self.tag}}}"

    def queue(self, tier: Tier) -> str:
        return f"{self.base}:q:{tier.value}"

    def queues(self) -> tuple[str, str, str, str]:
        """The four tier queues in rank order (P0 first): the KEYS[1..4] of most scripts."""
        q0, q1, q2, q3 = (self.queue(t) for t in ALL_TIERS)
        return q0, q1, q2, q3

    def job(self, job_id: str) -> str:
        return f"{self.base}:job:{job_id}"

    def tokens(self, job_id: str) -> str:
        return f"{self.base}:tok:{job_id}"

    @property
    def inflight(self) -> str:
        return f"{self.base}:inflight"

    @property
    def dead(self) -> str:
        return f"{self.base}:dead"

    def idem(self, tenant: str, key: str) -> str:
        return f"{self.base}:idem:{quote(tenant, safe='')}:{key}"

    def quota(self, tenant: str) -> str:
        return f"{self.base}:quota:{quote(tenant, safe='')}"

    def tenant_jobs(self, tenant: str) -> str:
        return f"{self.base}:tenant-jobs:{quote(tenant, safe='')}"

    @property
    def drain(self) -> str:
        return f"{self.base}:drain"

    @property
    def aging(self) -> str:
        return f"{self.base}:aging"

    @property
    def deadlines(self) -> str:
        return f"{self.base}:deadlines"

    @property
    def promises(self) -> str:
        return f"{self.base}:promises"

    def worker_key(self, worker_id: str) -> str:
        return f"{self.base}:worker-key:{quote(worker_id, safe='')}"

    @property
    def drained_workers(self) -> str:
        return f"{self.base}:drained-workers"

    @property
    def model(self) -> str:
        return f"{self.base}:model"

    @property
    def tokenizer(self) -> str:
        return f"{self.base}:tokenizer"

    def scan_pattern(self) -> str:
        """A SCAN MATCH pattern for every key of this cluster (glob characters escaped)."""
        escaped = "".join("\\" + ch if ch in "*?[]\\" else ch for ch in self.base)
        return escaped + ":*"


# One dict of Script objects per client: register_script only hashes the source; the
# first call of each script on a server loads it (EVALSHA, NOSCRIPT, SCRIPT LOAD) and
# later calls are a single EVALSHA.
_LOADED: weakref.WeakKeyDictionary[redis.Redis, dict[str, Script]] = weakref.WeakKeyDictionary()


def load_scripts(client: redis.Redis) -> dict[str, Script]:
    """``{name: Script}`` for every ``common/lua/<name>.lua`` (each prefixed with the shared
    ``lib/clock.lua``), registered once per client."""
    scripts = _LOADED.get(client)
    if scripts is None:
        prelude = (LUA_DIR / "lib" / "clock.lua").read_text(encoding="utf-8")
        scripts = {
            path.stem: client.register_script(prelude + path.read_text(encoding="utf-8"))
            for path in sorted(LUA_DIR.glob("*.lua"))
        }
        _LOADED[client] = scripts
    return scripts


def run_pipelined(client: redis.Redis, calls: list[tuple[str, list, list]]) -> list:
    """Each (script name, keys, args) of ``calls`` as EVALSHA, in one round trip; their replies, in order. Not
    Script objects on a pipeline: those ask SCRIPT EXISTS first on every execute, a second round trip each time. A
    script Redis does not hold (it restarted) is loaded, and only the calls it refused are run again. The first
    other error a call met is raised."""
    scripts = load_scripts(client)
    replies = _evalsha_all(client, scripts, calls)
    missing = [i for i, r in enumerate(replies) if isinstance(r, redis.exceptions.NoScriptError)]
    if missing:
        for name in {calls[i][0] for i in missing}:
            client.script_load(scripts[name].script)
        for i, r in zip(missing, _evalsha_all(client, scripts, [calls[i] for i in missing])):
            replies[i] = r
    for r in replies:
        if isinstance(r, Exception):
            raise r
    return replies


def _evalsha_all(client: redis.Redis, scripts: dict[str, Script], calls: list[tuple[str, list, list]]) -> list:
    pipe = client.pipeline(transaction=False)
    for name, keys, args in calls:
        pipe.evalsha(scripts[name].sha, len(keys), *keys, *args)
    return pipe.execute(raise_on_error=False)
