"""Small helpers shared by the gateway's modules."""

from __future__ import annotations

FINAL_STATES = ("done", "failed", "expired", "cancelled", "dead")


def ms(t: float) -> int:
    """Seconds to whole milliseconds (the unit of every time stored in Redis)."""
    return int(t * 1000)


def time_ms(reply: tuple[int, int]) -> int:
    """A Redis TIME reply (seconds, microseconds) in ms, as the scripts read it (common/lua/lib/clock.lua)."""
    sec, usec = reply
    return int(sec) * 1000 + int(usec) // 1000
