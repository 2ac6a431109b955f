"""Small helpers shared by the gateway's modules."""

from __future__ import annotations

FINAL_STATES = ("done", "failed", "expired", "cancelled", "dead")


def ms(t: float) -> int:
    """Seconds to whole milliseconds (the unit of every time stored in Redis)."""
    return int(t * 1000)
