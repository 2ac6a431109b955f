"""Which client streams have heard nothing from this gateway for a while, so that it can say it is alive.

A stream waiting on a queued job (or on a running job before its first token) receives no frames; without
a keepalive, a client cannot tell a long queue from a dead gateway. The gateway sends such a stream a
StatusReply every ``interval_s`` of silence; the client treats ``interval_s``-scale silence as normal and
only a much longer one as a gateway to fail over from.
"""

from __future__ import annotations

from typing import Hashable


class Keepalives:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._streams: dict[Hashable, tuple[str, float]] = {}  # reply address -> (job id, last frame sent at)

    def __len__(self) -> int:
        return len(self._streams)

    def watch(self, peer: Hashable, job_id: str, now: float) -> None:
        """``peer`` now waits on ``job_id``'s stream."""
        self._streams[peer] = (job_id, now)

    def forget(self, peer: Hashable, job_id: str) -> None:
        """``peer`` no longer waits on ``job_id``'s stream."""
        if self._streams.get(peer, ("",))[0] == job_id:
            del self._streams[peer]

    def sent(self, peer: Hashable, now: float, final: bool) -> None:
        """A frame went to ``peer``; ``final``: its stream ended (JobDone or an error)."""
        if final:
            self._streams.pop(peer, None)
        elif peer in self._streams:
            self._streams[peer] = (self._streams[peer][0], now)

    def due(self, now: float) -> list[tuple[Hashable, str]]:
        """(peer, job id) for every stream silent for ``interval_s``; each counts as served now."""
        out = [(peer, job_id) for peer, (job_id, last) in self._streams.items() if now - last >= self.interval_s]
        for peer, job_id in out:
            self._streams[peer] = (job_id, now)
        return out
