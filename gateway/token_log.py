"""Each running job's tokens in Redis (one Redis Stream per job), so any gateway can stream any job.

The gateway that holds a job's lease receives its JobTokens and appends them here in batches
(one XADD per job per flush, each entry ``i`` = index of its first token, ``t`` = msgpack list; only while the
job's hash says that lease is current: append_tokens.lua);
gateways whose clients watch the job read the entries back. The stream is capped (MAXLEN) and
has a TTL; completion and cancellation delete it, the result then lives in the job hash.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import NamedTuple

import msgpack
import redis

from common.redis_keys import KeySpace, run_pipelined
from gateway import metrics

MAX_ENTRIES = 8192  # more than any job has tokens (max_tokens_limit), fewer than a runaway writer could add
TTL_MS = 3_600_000  # an abandoned stream (its writer died, the job dead-lettered) goes after an hour


class Appended(NamedTuple):
    written: list[bool]  # per batch entry: False if its job is no longer dispatched to the lease given
    claimed: list[bool]  # per first token: whether this gateway won its claim


def first_prefill_call(keys: KeySpace, job_id: str, start_ms: int) -> tuple[str, list, list]:
    """run_pipelined's call recording ``job_id``'s first prefill start (Redis ms) in its hash (first_prefill.lua)."""
    return "first_prefill", [keys.job(job_id)], [int(start_ms)]


def first_token_call(keys: KeySpace, job_id: str, gateway: str) -> tuple[str, list, list]:
    """run_pipelined's call claiming for ``gateway`` the observation of ``job_id``'s first token (first_token.lua),
    under the tag of the claim pending here (metrics.claim_tag): asked again after a lost reply, it wins again. With
    the token's delay after the admission: the hash keeps the earliest first token, whoever wins the claim."""
    after_ms = metrics.claim_ttft_ms(job_id)
    return "first_token", [keys.job(job_id)], [gateway, metrics.claim_tag(job_id),
                                               "" if after_ms is None else after_ms]


class TokenLog:
    def __init__(self, client: redis.Redis, keys: KeySpace) -> None:
        self.client, self.keys = client, keys

    def append(self, batch: Iterable[tuple[str, int, list[int], str, int]], first_tokens: list[str] = (),
               gateway: str = "", first_prefills: Mapping[str, int] | None = None) -> Appended:
        """Append (job id, index of the first token, tokens, worker, attempt) entries, each only while its job is
        dispatched to that worker and attempt (append_tokens.lua), and claim for ``gateway`` the first token of
        each of ``first_tokens`` (first_token.lua), one round trip for both.
        The claims go after the entries: whoever reads a token in the log finds its first token claimed.
        ``first_prefills``: job id -> its first prefill start (Redis ms) for its hash (first_prefill.lua), before
        the entries: a job whose tokens are in the log has its start recorded."""
        calls = [first_prefill_call(self.keys, job_id, start_ms) for job_id, start_ms in (first_prefills or {}).items()]
        skip = len(calls)
        batch = list(batch)
        calls += [("append_tokens", [self.keys.tokens(job_id), self.keys.job(job_id)],
                   [worker, attempt, index, msgpack.packb(tokens), MAX_ENTRIES, TTL_MS])
                  for job_id, index, tokens, worker, attempt in batch]
        calls += [first_token_call(self.keys, job_id, gateway) for job_id in first_tokens]
        if not calls:
            return Appended([], [])
        replies = [bool(r) for r in run_pipelined(self.client, calls)[skip:]]
        return Appended(replies[:len(batch)], replies[len(batch):])

    def read(self, positions: Mapping[str, str]) -> dict[str, list[tuple[str, int, list[int]]]]:
        """New entries after each job's position: job id -> [(entry id, index, tokens)]. One XREAD."""
        if not positions:
            return {}
        streams = {self.keys.tokens(j): pos for j, pos in positions.items()}
        by_key = {self.keys.tokens(j): j for j in positions}
        out: dict[str, list[tuple[str, int, list[int]]]] = {}
        for key, entries in self.client.xread(streams, count=MAX_ENTRIES) or []:
            job_id = by_key[key.decode() if isinstance(key, bytes) else key]
            out[job_id] = [(eid.decode(), int(f[b"i"]), msgpack.unpackb(f[b"t"])) for eid, f in entries]
        return out
