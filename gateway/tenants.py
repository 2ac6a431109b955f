"""Tenants: API key -> tenant record -> entitled tiers and P0 quota.

Keys are kept only as SHA-256 digests: the file may hold plain keys (development)
or their digests (production), the process never keeps a plain key after loading.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass
from pathlib import Path

from common.settings import ConfigError
from common.tiers import Tier, parse_tier


@dataclass(frozen=True)
class Tenant:
    name: str
    tiers: frozenset[Tier]  # entitled tiers; a request may ask for any of these, never another
    p0_rate_per_s: float | None = None  # P0 token bucket refill; None: no P0 quota
    p0_burst: int = 1
    on_quota_exhausted: str = "refuse"  # or "downgrade": serve as P1 instead

    @property
    def highest_tier(self) -> Tier:
        return min(self.tiers, key=lambda t: t.rank)


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


class TenantDirectory:
    def __init__(self, tenants: dict[str, Tenant]) -> None:
        self._by_digest = tenants  # sha256 hex -> Tenant

    @classmethod
    def from_file(cls, path: str | Path) -> TenantDirectory:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read tenants file {path}: {e}") from None
        out: dict[str, Tenant] = {}
        for i, t in enumerate(data.get("tenant", [])):
            where = f"{path}: tenant #{i + 1}"
            try:
                digest = t.get("api_key_sha256") or key_digest(t["api_key"])
                mode = t.get("on_quota_exhausted", "refuse")
                if mode not in ("refuse", "downgrade"):
                    raise ConfigError(f"{where}: on_quota_exhausted must be refuse or downgrade")
                tiers = frozenset(parse_tier(x) for x in t["tiers"])
                if not tiers:
                    raise ConfigError(f"{where}: tiers is empty")
                out[digest] = Tenant(t["name"], tiers, t.get("p0_rate_per_s"), int(t.get("p0_burst", 1)), mode)
            except (KeyError, ValueError) as e:
                raise ConfigError(f"{where}: {e}") from None
        return cls(out)

    def lookup(self, api_key: object) -> Tenant | None:
        if not isinstance(api_key, str) or not api_key:
            return None
        # Looked up by digest: what the lookup's timing could reveal is about a hash, not the key.
        return self._by_digest.get(key_digest(api_key))
