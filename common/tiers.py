"""The priority tiers. P0 is the most urgent; a lower rank is served first."""

from __future__ import annotations

import enum

from common.errors import InvalidRequest


class Tier(str, enum.Enum):
    P0 = "P0"  # interactive chat
    P1 = "P1"  # API calls
    P2 = "P2"  # batch jobs
    P3 = "P3"  # offline analysis

    @property
    def rank(self) -> int:
        """0 for P0 ... 3 for P3, so sorting by rank puts urgent work first."""
        return int(self.value[1])


ALL_TIERS: tuple[Tier, ...] = tuple(Tier)
# Tiers the gateway dispatches even to a full worker, which preempts lower work for them (in queue order). The
# others wait for a free slot. A job preempts as the tier it was admitted at: aging moves it up the queues only.
PREEMPTING_TIERS: tuple[Tier, ...] = (Tier.P0, Tier.P1)


def parse_tier(value: str | Tier) -> Tier:
    """Return the Tier for ``value`` or raise InvalidRequest naming the valid ones."""
    if isinstance(value, Tier):
        return value
    try:
        return Tier(value)
    except ValueError:
        valid = ", ".join(t.value for t in ALL_TIERS)
        raise InvalidRequest(f"unknown tier {value!r}; expected one of {valid}", field="tier") from None
