"""Entries of the tenants file that share a name are one tenant: they must say the same about it.

Several entries under one name are how an API key is rotated (SECURITY.md: add an entry with the same name and the
new key, move the clients, remove the old one). The name is what Redis keys the tenant's P0 bucket, its jobs, its
idempotency keys and its cap by, so two entries that disagree on the tenant's tiers or quota made one bucket filled
and drained at two rates (the generous key's admissions refilled it for the other's), and which limits held depended
on the key a client happened to hold. They loaded silently; now the file is refused, naming both entries.
"""

from __future__ import annotations

import pytest

from common.settings import ConfigError
from common.tiers import Tier
from gateway.tenants import TenantDirectory

ENTRY = 'name = "chat"\ntiers = ["P0", "P1"]\np0_rate_per_s = 2\np0_burst = 4\non_quota_exhausted = "refuse"\n'


def _write(tmp_path, *entries: str):
    path = tmp_path / "tenants.toml"
    path.write_text("".join(f"[[tenant]]\n{e}" for e in entries))
    return path


def test_two_keys_of_one_tenant_load_as_that_tenant(tmp_path):
    """The rotation SECURITY.md describes: the old key and the new one, the same tenant record."""
    d = TenantDirectory.from_file(_write(tmp_path, ENTRY + 'api_key = "old"\n', ENTRY + 'api_key = "new"\n'))
    old, new = d.lookup("old"), d.lookup("new")
    assert old == new and old.name == "chat" and old.tiers == {Tier.P0, Tier.P1} and old.p0_burst == 4


@pytest.mark.parametrize("field, other", [("p0_rate_per_s", "p0_rate_per_s = 50\n"), ("p0_burst", "p0_burst = 40\n"),
                                          ("tiers", 'tiers = ["P0", "P1", "P2"]\n'),
                                          ("on_quota_exhausted", 'on_quota_exhausted = "downgrade"\n')])
def test_entries_of_one_name_that_disagree_are_refused_naming_both(tmp_path, field, other):
    second = "".join(line + "\n" for line in ENTRY.splitlines() if not line.startswith(field)) + other
    path = _write(tmp_path, 'name = "ops"\napi_key = "o"\ntiers = ["P3"]\n', ENTRY + 'api_key = "old"\n',
                  second + 'api_key = "new"\n')
    with pytest.raises(ConfigError) as e:
        TenantDirectory.from_file(path)
    msg = str(e.value)
    assert "tenant #3" in msg and "tenant #2" in msg and "'chat'" in msg and field in msg, msg


def test_a_quota_left_out_of_one_entry_of_a_name_is_a_disagreement(tmp_path):
    """No p0_rate_per_s is no P0 quota: one key of the tenant would have unlimited P0 and share the other's jobs."""
    unlimited = "".join(line + "\n" for line in ENTRY.splitlines() if not line.startswith("p0_rate"))
    with pytest.raises(ConfigError, match="p0_rate_per_s"):
        TenantDirectory.from_file(_write(tmp_path, ENTRY + 'api_key = "a"\n', unlimited + 'api_key = "b"\n'))
