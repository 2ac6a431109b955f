"""Per-job token buffers held by a gateway: for the jobs whose lease it holds (fed by worker frames)
and for the jobs its clients watch (followed from the job's Redis stream, see gateway/streaming.py).

Invariant: each token index reaches each subscriber exactly once, in order.
Tokens are appended only at the next index; a re-dispatched job restarts at
index 0 on another worker and, with its seed fixed at admission, reproduces the
same tokens, so indices already held are simply skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


@dataclass
class JobStream:
    job_id: str
    tenant: str | None = None  # owner, so a stream request is checked without a Redis read
    tokens: list[int] = field(default_factory=list)
    subscribers: dict[Hashable, int] = field(default_factory=dict)  # client reply address -> next index to send
    first_token_at: float | None = None
    flushed: int = 0  # tokens written to the job's Redis stream by this gateway
    redis_pos: str = "0-0"  # last Redis stream entry read (followers)
    follow: bool = False  # held by another gateway: read its tokens from Redis
    touched: float = 0.0  # last time tokens arrived, by the gateway's clock
    decoded: object | None = None  # IncrementalText of ``tokens`` (gateway/detokenize.py), when there is a tokenizer


class StreamTable:
    def __init__(self, detokenize: Callable[[list[int]], str] | None, incremental: Callable[[], object] | None = None
                 ) -> None:
        self.detokenize = detokenize
        self.incremental = incremental  # makes a stream's incremental decoder: each token decoded once
        self.streams: dict[str, JobStream] = {}

    def get_or_create(self, job_id: str) -> JobStream:
        s = self.streams.get(job_id)
        if s is None:
            s = self.streams[job_id] = JobStream(job_id)
        return s

    def add_tokens(self, job_id: str, index: int, token_ids: list[int], now: float) -> bool:
        """Record tokens [index, index + len); False if they leave a gap (then nothing is recorded)."""
        s = self.get_or_create(job_id)
        if index > len(s.tokens):
            return False
        new = token_ids[len(s.tokens) - index:]
        if new and s.first_token_at is None:
            s.first_token_at = now
        s.tokens.extend(new)
        s.touched = now
        if self.incremental is not None and new:
            if s.decoded is None:
                s.decoded = self.incremental()
            s.decoded.extend(new)
        return True

    def chunk_text(self, job_id: str, start: int) -> str:
        """Text of a live stream's tokens from ``start`` on, without decoding any token again."""
        s = self.streams[job_id]
        if s.decoded is not None:
            return s.decoded.text(start)
        return self.text(s.tokens[start:], s.tokens[:start])

    def forget_peer(self, peer: Hashable) -> None:
        """``peer``'s connection is gone: none of its subscriptions can be read any more."""
        for s in self.streams.values():
            s.subscribers.pop(peer, None)

    def pending_chunks(self, job_id: str) -> list[tuple[Hashable, int, list[int]]]:
        """(subscriber, start index, token ids) for every subscriber behind; advances them."""
        s = self.streams.get(job_id)
        if s is None:
            return []
        out = []
        for sub, nxt in s.subscribers.items():
            if nxt < len(s.tokens):
                out.append((sub, nxt, s.tokens[nxt:]))
                s.subscribers[sub] = len(s.tokens)
        return out

    def text(self, token_ids: list[int], before: list[int]) -> str:
        """Text of ``token_ids`` given the tokens before them (byte-level pieces join correctly)."""
        if self.incremental is not None:  # the same text live chunks carry (one pass, linear)
            d = self.incremental()
            d.extend(before + token_ids)
            return d.text(len(before))
        if self.detokenize is None:
            return ""
        whole = self.detokenize(before + token_ids)
        return whole[len(self.detokenize(before)):] if before else whole
