"""Tenants: API key -> tenant record -> entitled tiers and P0 quota.

Keys are kept only as SHA-256 digests: the file may hold plain keys (development)
or their digests (production), the process never keeps a plain key after loading.
"""

from __future__ import annotations

import hashlib
import tomllib
from dataclasses import dataclass
from pathlib import Path

from common.secrets import check_writers
from common.settings import ConfigError
from common.tiers import Tier, parse_tier


ENTRY_KEYS = frozenset({"name", "api_key", "api_key_sha256", "tiers", "p0_rate_per_s", "p0_burst",
                        "on_quota_exhausted"})


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


def _digest(entry: dict, where: str) -> str:
    """The entry's key digest, normalised: a SHA-256 hex digest is compared in lower case."""
    if "api_key" in entry and "api_key_sha256" in entry:
        # The digest was used and api_key ignored: a key written there was refused at every request, the file said
        # to be fine. The plain key is not repeated here: the message goes to logs.
        raise ConfigError(f"{where} ({entry.get('name')!r}): both api_key and api_key_sha256; give one (api_key_sha256 "
                          "alone keeps no usable key in the file)")
    if "api_key" not in entry and "api_key_sha256" not in entry:
        raise ConfigError(f"{where}: needs api_key or api_key_sha256")
    if "api_key_sha256" in entry:
        digest = str(entry["api_key_sha256"]).strip().lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ConfigError(f"{where}: api_key_sha256 must be 64 hexadecimal digits")
        return digest
    key = entry["api_key"]
    if not isinstance(key, str) or not key.strip():
        # A blank key loaded: a tenant whose key is a space, which nobody meant to hand out.
        raise ConfigError(f"{where}: api_key must be a non-empty string (not only white space)")
    _no_white_space_around(key, "api_key", where)
    return key_digest(key)


def _no_white_space_around(value: str, field: str, where: str, shown: str = "") -> None:
    """Refuse a name or key with white space at an end: " chat" was a tenant other than "chat" (its own jobs, bucket
    and idempotency keys, told apart in no log), and a key "k " one no client can present (an HTTP header's value is
    stripped of it). A key is told without its value: it must not reach the logs."""
    if value != value.strip():
        raise ConfigError(f"{where}: {field}{shown} has white space at its start or end; remove it (a name is matched "
                          "exactly, and a key with it cannot be sent in an HTTP header)")


def _differs(a: Tenant, b: Tenant) -> str:
    return " and ".join(f for f in ("tiers", "p0_rate_per_s", "p0_burst", "on_quota_exhausted")
                        if getattr(a, f) != getattr(b, f))


class TenantDirectory:
    def __init__(self, tenants: dict[str, Tenant]) -> None:
        self._by_digest = tenants  # sha256 hex -> Tenant

    @classmethod
    def from_file(cls, path: str | Path) -> TenantDirectory:
        check_writers(path, "tenants file")  # whoever may write it adds a tenant, with a key of their own
        try:
            # TOML is UTF-8 whatever the locale; a file in another encoding is named, not a traceback.
            data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read tenants file {path}: {e}") from None
        out: dict[str, Tenant] = {}
        named: dict[str, tuple[str, Tenant]] = {}  # name -> (its first entry, its record)
        # Unknown keys are refused, as in every other configuration file: a misspelled p0_rate_per_s loaded a tenant
        # with no P0 quota at all, and [[tenants]] a file of no tenant.
        if set(data) - {"tenant"} or not isinstance(data.get("tenant", []), list):
            raise ConfigError(f"{path}: holds {sorted(data)}; expected only [[tenant]] entries (an array of tables)")
        for i, t in enumerate(data.get("tenant", [])):
            where = f"{path}: tenant #{i + 1}"
            if not isinstance(t, dict):
                raise ConfigError(f"{where}: not a table (write each entry as [[tenant]])")
            if unknown := set(t) - ENTRY_KEYS:
                raise ConfigError(f"{where}: unknown keys {sorted(unknown)}; known: {sorted(ENTRY_KEYS)}")
            if not isinstance(t.get("tiers", []), list):
                raise ConfigError(f"{where}: tiers must be a list of tiers, such as [\"P1\", \"P2\"]")
            try:
                name = t["name"]
                if not isinstance(name, str) or not name.strip():
                    # Jobs are owned by the name as Redis holds it, a string: 5 and "5" were two tenants here and
                    # one there, each seeing and cancelling the other's jobs.
                    # A blank one is a tenant that logs, traces and `explain` cannot tell from another.
                    raise ConfigError(f"{where}: name must be a non-empty string (not only white space)")
                _no_white_space_around(name, "name", where, f" {name!r}")
                digest = _digest(t, where)
                mode = t.get("on_quota_exhausted", "refuse")
                if mode not in ("refuse", "downgrade"):
                    raise ConfigError(f"{where}: on_quota_exhausted must be refuse or downgrade")
                tiers = frozenset(parse_tier(x) for x in t["tiers"])
                if not tiers:
                    raise ConfigError(f"{where}: tiers is empty")
                rate = t.get("p0_rate_per_s")
                if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or
                                         not 0 < rate < float("inf")):
                    # 0 used to mean "no quota" (unlimited P0): refused, to give no P0 leave P0 out of tiers.
                    raise ConfigError(f"{where}: p0_rate_per_s must be a number > 0 (to give a tenant no P0, "
                                      "leave P0 out of its tiers; to leave P0 unlimited, omit p0_rate_per_s)")
                burst = t.get("p0_burst", 1)
                if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
                    # Read with int() before: 0 loaded, and every P0 submission of the tenant then failed in the
                    # gateway's handler (a bucket that can never hold a job); 1.5 became another bucket silently.
                    raise ConfigError(f"{where}: p0_burst must be a whole number >= 1, got {burst!r}")
                if digest in out:
                    raise ConfigError(f"{where}: the same API key as tenant {out[digest].name!r}")
                tenant = Tenant(name, tiers, rate, burst, mode)
                first, same = named.setdefault(name, (f"tenant #{i + 1}", tenant))
                if same != tenant:
                    raise ConfigError(f"{where}: tenant {name!r} is also {first}, with other "
                                      f"{_differs(same, tenant)}; entries of one name (an API key's rotation) are one "
                                      "tenant (its quota, jobs and idempotency keys are kept by name): make them agree")
                out[digest] = tenant
            except ConfigError:  # already says where: wrapped again below, it said so twice
                raise
            except KeyError as e:  # told as the bare key: "tenant #1: 'name'"
                raise ConfigError(f"{where}: missing {e.args[0]}") from None
            except ValueError as e:
                raise ConfigError(f"{where}: {e}") from None
        if not out:
            # Loaded as zero tenants it refused every client ("unknown API key") with nothing said at start.
            raise ConfigError(f"{path}: holds no tenant; add a [[tenant]] entry (name, api_key or api_key_sha256, "
                              "tiers)")
        return cls(out)

    def lookup(self, api_key: object) -> Tenant | None:
        if not isinstance(api_key, str) or not api_key:
            return None
        # Looked up by digest: what the lookup's timing could reveal is about a hash, not the key.
        return self._by_digest.get(key_digest(api_key))
