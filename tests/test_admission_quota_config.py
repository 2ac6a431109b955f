"""A tenant's P0 bucket that could never admit a job is refused when the tenants file is read.

p0_burst was read with int(): 0 or a negative burst loaded, and then every P0 submission of that tenant failed inside
the gateway's handler (QuotaSpec refuses a burst below 1) with an "internal error", for as long as the gateway ran; a
fractional burst (1.5) or a boolean (true) was silently truncated to another bucket than the one written.
"""

from __future__ import annotations

import pytest

from common.settings import ConfigError
from gateway.redis_queue import QuotaSpec
from gateway.tenants import TenantDirectory


def _tenants(tmp_path, burst: str):
    path = tmp_path / "tenants.toml"
    path.write_text(f'[[tenant]]\nname = "chat"\napi_key = "k"\ntiers = ["P0", "P1"]\np0_rate_per_s = 2\n'
                    f"p0_burst = {burst}\n")
    return path


@pytest.mark.parametrize("burst", ["0", "-2", "1.5", "true", '"3"'])
def test_a_burst_that_is_not_a_whole_number_of_at_least_one_is_a_config_error(tmp_path, burst):
    with pytest.raises(ConfigError, match="p0_burst"):
        TenantDirectory.from_file(_tenants(tmp_path, burst))


@pytest.mark.parametrize("burst", ["1", "4"])
def test_a_valid_burst_loads_and_makes_a_quota(tmp_path, burst):
    tenant = TenantDirectory.from_file(_tenants(tmp_path, burst)).lookup("k")
    assert tenant.p0_burst == int(burst)
    QuotaSpec(tenant.p0_rate_per_s, tenant.p0_burst, tenant.on_quota_exhausted)  # what admission builds from it


def test_without_a_burst_it_is_one(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text('[[tenant]]\nname = "chat"\napi_key = "k"\ntiers = ["P0"]\np0_rate_per_s = 2\n')
    assert TenantDirectory.from_file(path).lookup("k").p0_burst == 1
