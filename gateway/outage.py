"""Worker frames while Redis is unreachable (the gateway's back-off): the ones that need no Redis are handled at once,
the others kept aside, in order, and replayed when the back-off ends, before the background work.

Left in the socket for the whole outage, as they were, every frame waited, and with them the tokens of the jobs
whose lease this gateway holds: their clients' streams stood still (keepalives only) while the worker went on
generating, though forwarding those tokens needs no Redis (the lease is known here, the token log is flushed from
memory once Redis is back). Handled at once: JobTokens of a job whose lease this gateway holds, from the registered
worker that holds it; hellos of workers whose key needs no cluster binding read. Kept aside: everything else
(completions, hand-backs, tokens whose lease is unknown here, hellos to bind), each copy once (a worker sends a
completion again until it is confirmed: a second kept copy would only be found stale), and of each worker's load
reports only its latest (it lists every job the worker holds, so it extends as many leases as all the earlier ones).
A frame is replayed with the CURVE key it came with: a handler judges its sender by that key (security.py).
Bounded (KEPT_FRAMES, KEPT_BYTES): beyond, frames wait in the socket as before, behind the kept ones. A frame is kept
as it came on the wire (decoded again when replayed), so the bytes bound is what the kept frames hold: decoded, a
completion's token list took 13 times its size on the wire (Python ints and the list's pointers), 444 MB under the
32 MiB bound. Kept as read, not encoded again: a completion of 4096 tokens cost its encoding once more to keep.

Token frames kept (their lease is unknown here, as every lease is to a gateway just restarted: Redis judges them) have
a share of the bound of their own (TOKEN_SHARE); past it they are dropped and counted (tokens_dropped_in_outage).
Without a share a flood of them filled the bound, and the frames of the jobs this gateway holds waited in the socket
behind it: their streams stood still again, their completions unkept. Dropped rather than left in the socket
(which would block those same frames): a dropped token frame costs no token. The job's next frame shows the gap, which
asks its worker to say hello and send every token so far again (worker_link.on_tokens), and its completion carries them
all. The first frames are the ones kept, not the latest: a stream takes no token past a gap (streams.add_tokens).

A mixin of gateway.server.Gateway.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import NamedTuple

from common import protocol as P
from gateway import security

log = logging.getLogger("gateway")
# Enough for every completion and hand-back of a large cluster's outage of minutes (a worker resends each, but a
# copy is kept once), and for the tokens of jobs whose lease is unknown here; the bytes bound the completions'
# token lists (up to max_tokens_limit each).
KEPT_FRAMES = 4096
KEPT_BYTES = 32 * 1024 * 1024
# Token frames take at most this fraction (1/TOKEN_SHARE) of either bound: the rest is room for the completions,
# hand-backs, reports and hellos, whatever the tokens of leases unknown here.
TOKEN_SHARE = 4
KEPT_TOKEN_FRAMES, KEPT_TOKEN_BYTES = KEPT_FRAMES // TOKEN_SHARE, KEPT_BYTES // TOKEN_SHARE


class Kept(NamedTuple):
    """A worker frame kept aside, as it came on the wire."""

    ident: bytes  # the worker socket's routing id of the sender
    frame: bytes  # the frame as read (its length counts against the bound)
    key: str | None  # the CURVE key it came with (gateway.frame_key), None without CURVE

    def decoded(self):
        """The frame's message: it decoded when it was read, so it decodes again."""
        return P.decode(self.frame)


class KeptFrames:
    """Worker frames kept aside in arrival order, one per key (_key_of), within a count and a size; token frames
    within a share of them (can_keep)."""

    def __init__(self, max_frames: int = KEPT_FRAMES, max_bytes: int = KEPT_BYTES) -> None:
        if max_frames < 1 or max_bytes < 1:
            raise ValueError(f"max_frames and max_bytes must be >= 1, got {max_frames} and {max_bytes}")
        self.max_frames, self.max_bytes = max_frames, max_bytes
        self.max_token_frames = max(1, max_frames // TOKEN_SHARE)
        self.max_token_bytes = max(1, max_bytes // TOKEN_SHARE)
        self._frames: OrderedDict[tuple, Kept] = OrderedDict()
        self.bytes = 0
        self.token_frames = self.token_bytes = 0  # the token frames' part of len(self) and self.bytes

    def __len__(self) -> int:
        return len(self._frames)

    def full(self) -> bool:
        return len(self._frames) >= self.max_frames or self.bytes >= self.max_bytes

    def can_keep(self, ident: bytes, msg) -> bool:
        """False for a token frame (from ``ident``) not kept yet once the token frames fill their share."""
        if not isinstance(msg, P.JobTokens) or _key_of(ident, msg) in self._frames:
            return True
        return self.token_frames < self.max_token_frames and self.token_bytes < self.max_token_bytes

    def keep(self, frame: Kept, msg) -> bool:
        """Keep ``frame``, whose message is ``msg`` (its kind and ids say which frames are copies of one another);
        False if a copy of it is kept already (nothing changes, unless it is a newer load report or hello, which
        takes the older one's place)."""
        key = _key_of(frame.ident, msg)
        old = self._frames.get(key)
        if old is not None and not isinstance(msg, (P.WorkerLoad, P.WorkerHello)):
            return False
        if old is not None:
            self._count(key, old, -1)
        self._frames[key] = frame
        self._count(key, frame, 1)
        if isinstance(msg, P.WorkerLoad):
            # The latest report goes where it came: replayed after the frames that came before it, as it was sent.
            # A newer hello stays in its predecessor's place, ahead of the frames whose sender it registers.
            self._frames.move_to_end(key)
        return old is None

    def put_back(self, frame: Kept, msg) -> None:
        """``frame`` (message ``msg``), the one taken last, goes back in front: its handler found Redis down again."""
        key = _key_of(frame.ident, msg)
        if key not in self._frames:
            self._frames[key] = frame
            self._frames.move_to_end(key, last=False)
            self._count(key, frame, 1)

    def take(self) -> Kept | None:
        if not self._frames:
            return None
        key, frame = self._frames.popitem(last=False)
        self._count(key, frame, -1)
        return frame

    def _count(self, key: tuple, frame: Kept, sign: int) -> None:
        self.bytes += sign * len(frame.frame)
        if key[0] == "JobTokens":
            self.token_frames += sign
            self.token_bytes += sign * len(frame.frame)


def _key_of(ident: bytes, msg) -> tuple:
    """Copies of one frame share a key: a worker's load reports and hellos one each, a job attempt's completion or
    hand-back one, a token batch one per index and length."""
    if isinstance(msg, (P.WorkerLoad, P.WorkerHello)):
        return type(msg).__name__, ident
    if isinstance(msg, P.JobTokens):
        return "JobTokens", ident, msg.job_id, msg.attempt, msg.index, len(msg.token_ids)
    return type(msg).__name__, ident, msg.job_id, msg.attempt


class OutageFrames:
    """The worker-socket side of the back-off: what to handle at once, what to keep aside, and the replay."""

    def holding_back(self) -> bool:
        """Worker frames go by ``needs_no_redis`` now: Redis is known down, or frames kept during the back-off wait
        for their replay (a frame handled before them would overtake them, a job's tokens their predecessors)."""
        return self._redis_down() or bool(self.kept)

    def needs_no_redis(self, ident: bytes, msg) -> bool:
        """True if handling ``msg`` (from ``ident``, with ``self.frame_key``) reads and writes no Redis."""
        if isinstance(msg, P.JobTokens):
            # Fenced by the lease this gateway holds (worker_link._holds_lease reads Redis only when it is unknown).
            worker = ident.decode(errors="replace")
            return security.is_registered_worker(self, ident) and self.leases.get(msg.job_id) == (worker, msg.attempt)
        if isinstance(msg, P.WorkerHello):
            # A key that the cluster binds (security.WorkerKeys.shared) is bound when Redis answers; a worker heard
            # here with its key already says hello again as before (its binding here decides meanwhile).
            keys = self.worker_keys
            return keys is None or keys.shared is None or security.is_registered_worker(self, ident)
        return False

    def answers_without_redis(self, msg) -> bool:
        """True if the client frame ``msg`` is answered from memory alone, so not refused in the back-off: a stream
        this gateway has (streaming.live_stream), whose tokens go on meanwhile, or the end of a subscription."""
        return isinstance(msg, P.StreamRequest) and (msg.unsubscribe or self.live_stream(msg) is not None)

    def keep_aside(self, ident: bytes, msg, frame: bytes) -> None:
        """Keep ``frame``, read from ``ident`` with ``self.frame_key`` and decoded to ``msg``, for the replay; a token
        frame past the tokens' share is dropped (its job's next frame asks for it again, see the module's note)."""
        if not self.kept.can_keep(ident, msg):
            self.counters["tokens_dropped_in_outage"] += 1
            return
        if self.kept.keep(Kept(ident, frame, self.frame_key), msg):
            self.counters["kept_in_outage"] += 1

    def replay_kept(self) -> None:
        """Hand the kept frames to their handlers, oldest first, until none is left or Redis fails again (the rest
        wait for the next end of the back-off)."""
        replayed = 0
        while not self._redis_down() and (frame := self.kept.take()) is not None:
            self.frame_key = frame.key
            msg = frame.decoded()
            self._handle(self.worker_sock, frame.ident, msg, self._worker_handlers[type(msg)])
            if self._redis_down():
                # Redis failed under it: tokens were not taken (their lease is read first), a report extended no
                # lease, a completion or hand-back whose lease is unknown here was not even fenced (its lease is read
                # first too; its worker may have given up resending it, worker/completions.give_up_s). Each waits for
                # the next end of the back-off, but for a completion its handler kept (worker_link._unstored). One
                # handled in full before Redis failed is replayed again as a copy: the handlers take copies.
                if not (isinstance(msg, P.JobFinished) and self._unstored_copy(msg)):
                    self.kept.put_back(frame, msg)
                break
            replayed += 1
        if replayed:
            log.info("replayed %d worker frame(s) kept while Redis was unreachable (%d still kept)", replayed,
                     len(self.kept))
