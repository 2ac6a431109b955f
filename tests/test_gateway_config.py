"""A gateway (or HTTP door) configuration that could not run is refused before anything starts, naming the key:
a zero aging interval used to start a gateway, then crash its loop at the first sweep (every job stranded)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common import settings
from common.settings import ConfigError
from common.ports import free_port
from gateway.config import GatewayConfig
from tests.cluster_helpers import ROOT

BAD = [
    ("lease_s", 0.0), ("lease_s", float("nan")), ("worker_timeout_s", -1.0), ("aging_interval_s", 0.0),
    ("maintenance_interval_s", 0.0), ("stream_flush_interval_s", float("inf")), ("keepalive_interval_s", 0.0),
    ("default_drain_rate_per_s", 0.0), ("max_model_len", 0), ("max_tokens_limit", 0), ("max_attempts", 0),
    ("idempotency_ttl_s", 0), ("result_ttl_s", 0), ("tenant_max_jobs", -1), ("dead_letter_max", 0),
    ("client_max_message_bytes", 0), ("client_queue_bytes_per_peer", 0),
    ("tier_timeouts_s", {"P0": 0.0, "P1": 60.0, "P2": 300.0, "P3": None}),
    ("tier_timeouts_s", {"P0": -5}), ("tier_timeouts_s", {"P7": 1.0}), ("tier_timeouts_s", {"P1": "60"}),
]


@pytest.mark.parametrize("key, value", BAD)
def test_a_value_that_could_not_run_is_refused_naming_its_key(key, value):
    with pytest.raises(ConfigError, match=key):
        GatewayConfig(**{key: value})


def test_the_defaults_and_the_documented_choices_are_accepted():
    GatewayConfig()
    GatewayConfig(tenant_max_jobs=0, tier_timeouts_s={"P0": None, "P1": None, "P2": None, "P3": None})
    GatewayConfig(tier_timeouts_s={"P0": 10})  # the tiers left out have no timeout (TOML has no None)


def test_the_gateway_process_says_which_key_in_one_line_and_exits_2():
    # Redis at a port where nothing listens, not the default: a check that let the value through would then be a
    # refusal of another kind at once, not a gateway serving against whatever listens on 6379 until the timeout.
    done = subprocess.run([sys.executable, "-m", "gateway", "--insecure-workers"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PATH": "/usr/bin:/bin", "TS_GATEWAY_AGING_INTERVAL_S": "0",
                                                       "TS_GATEWAY_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"})
    assert done.returncode == 2 and "aging_interval_s" in done.stderr and "Traceback" not in done.stderr, \
        done.stderr[-2000:]


@pytest.mark.parametrize("flag, value", [("--gateways", "0"), ("--workers", "-1"), ("--max-running", "0"),
                                         ("--kv-blocks", "-1"), ("--lease-s", "0"), ("--aging-interval", "inf"),
                                         ("--ready-timeout", "nan"), ("--http-port", "70000"), ("--lease-s", "soon")])
def test_up_refuses_a_flag_that_could_not_run_before_starting_anything(tmp_path, flag, value):
    """--gateways 0 was a traceback; --aging-interval 0 started a gateway that died at its first sweep."""
    state = tmp_path / "cluster.json"
    done = subprocess.run([sys.executable, "scripts/up.py", flag, value, "--state-file", str(state)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and flag in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert not state.exists()


@pytest.mark.parametrize("key, value", [("port", 70000), ("gateways", []), ("gateways", [""]),
                                        ("upstream_timeout_s", 0.0), ("upstream_timeout_s", float("inf")),
                                        ("default_max_tokens", 0), ("max_body_bytes", 0)])
def test_the_http_door_refuses_a_value_it_could_not_serve_with(key, value):
    from gateway.http.config import HttpConfig

    with pytest.raises(ConfigError, match=key):
        HttpConfig(**{key: value})
    HttpConfig()


def test_a_config_file_not_in_utf8_is_refused_naming_it(tmp_path):
    path = tmp_path / "gateway.toml"
    path.write_text('key_prefix = "é"\n', encoding="latin-1")
    with pytest.raises(ConfigError, match="cannot read configuration") as e:
        settings.load(GatewayConfig, path)
    assert str(path) in str(e.value)
