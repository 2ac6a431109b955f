"""Entries of the tenants file that share a name are one tenant: they must say the same about it.

Several entries under one name are how an API key is rotated (SECURITY.md: add an entry with the same name and the
new key, move the clients, remove the old one). The name is what Redis keys the tenant's P0 bucket, its jobs, its
idempotency keys and its cap by, so two entries that disagree on the tenant's tiers or quota made one bucket filled
and drained at two rates (the generous key's admissions refilled it for the other's), and which limits held depended
on the key a client happened to hold. They loaded silently; now the file is refused, naming both entries.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.ports import free_port
from common.settings import ConfigError
from common.tiers import Tier
from gateway.tenants import TenantDirectory

ROOT = Path(__file__).resolve().parent.parent
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


@pytest.mark.parametrize("body, said", [
    # A misspelled quota key was ignored: the tenant loaded with no P0 quota at all (unlimited P0).
    (ENTRY.replace("p0_rate_per_s", "p0_rate_per_sec") + 'api_key = "k"\n', "p0_rate_per_sec"),
    (ENTRY.replace("p0_burst", "p0_bursts") + 'api_key = "k"\n', "p0_bursts"),
    # [[tenants]] loaded no tenant (every key refused, the file said to be fine); [tenant] crashed with a TypeError.
    ("[[tenants]]\n" + ENTRY + 'api_key = "k"\n', "tenants"),
    ("[tenant]\n" + ENTRY + 'api_key = "k"\n', "tenant"),
    ("tenant = 5\n", "tenant"),
    ("tenant = [5]\n", "tenant #1"),
    ("[[tenant]]\n" + ENTRY.replace('tiers = ["P0", "P1"]', "tiers = 5") + 'api_key = "k"\n', "tiers"),
    ("[[tenant]]\n" + ENTRY.replace('tiers = ["P0", "P1"]', 'tiers = "P1"') + 'api_key = "k"\n', "tiers"),
])
def test_a_tenants_file_not_as_documented_is_a_config_error_naming_what(tmp_path, body, said):
    path = tmp_path / "tenants.toml"
    path.write_text(body if body.startswith(("[", "tenant")) else "[[tenant]]\n" + body)
    with pytest.raises(ConfigError, match=said):
        TenantDirectory.from_file(path)


def run_gateway(tenants_file: Path) -> subprocess.CompletedProcess:
    """A gateway given ``tenants_file``, Redis at a port where nothing listens (not the default URL, nor the caller's
    TS_GATEWAY_REDIS_URL): a file taken as good is a refusal of another kind at once ("cannot reach Redis"), not a
    gateway serving against whatever listens there until the timeout."""
    return subprocess.run([sys.executable, "-m", "gateway", "--tenants-file", str(tenants_file), "--insecure-workers",
                           "--redis-url", f"redis://127.0.0.1:{free_port()}/0",
                           "--client-bind", "tcp://127.0.0.1:0", "--worker-bind", "tcp://127.0.0.1:0"],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT), OTEL_TRACES_EXPORTER="none"),
                          capture_output=True, text=True, timeout=60)


def test_a_gateway_given_a_tenants_file_it_cannot_use_says_why_in_one_line_and_exits_2(tmp_path):
    """Read before Redis is reached: no other process is needed to see it."""
    path = tmp_path / "tenants.toml"
    path.write_text("[tenant]\n" + ENTRY + 'api_key = "k"\n')
    done = run_gateway(path)
    assert done.returncode == 2 and "Traceback" not in done.stderr and str(path) in done.stderr, done.stderr


@pytest.mark.parametrize("same", [False, True])
def test_an_entry_with_both_a_key_and_a_digest_is_refused_naming_it(tmp_path, same):
    """api_key and api_key_sha256 in one entry: the digest was used and api_key silently ignored, so the key written
    there (a rotation's new key, say) was refused at every request while the file was said to be fine. One of the
    two is what README and SECURITY.md document; both, even of the same key, leaves a plain key in a file meant to
    hold none."""
    from gateway.tenants import key_digest
    digest = key_digest("new" if same else "old")
    path = _write(tmp_path, 'name = "ops"\napi_key = "o"\ntiers = ["P3"]\n',
                  ENTRY + f'api_key = "new"\napi_key_sha256 = "{digest}"\n')
    with pytest.raises(ConfigError) as e:
        TenantDirectory.from_file(path)
    msg = str(e.value)
    assert "tenant #2" in msg and "'chat'" in msg and "api_key" in msg and "api_key_sha256" in msg, msg
    assert "new" not in msg.replace(str(path), "")  # the plain key is not echoed into logs


@pytest.mark.parametrize("drop, said", [("api_key", "api_key or api_key_sha256"), ("name", "missing name"),
                                        ("tiers", "missing tiers")])
def test_an_entry_without_a_required_key_says_which(tmp_path, drop, said):
    """Each was told as the bare KeyError: "tenant #1: 'api_key'"."""
    body = "".join(line + "\n" for line in (ENTRY + 'api_key = "k"\n').splitlines() if not line.startswith(drop + " "))
    with pytest.raises(ConfigError, match=f"tenant #1: .*{said}"):
        TenantDirectory.from_file(_write(tmp_path, body))


@pytest.mark.parametrize("body", ["", "# tenants: none yet\n", "tenant = []\n"])
def test_a_tenants_file_of_no_tenant_is_refused_naming_it(tmp_path, body):
    """It loaded zero tenants silently: every client was told "unknown API key" and the operator saw nothing."""
    path = tmp_path / "tenants.toml"
    path.write_text(body)
    with pytest.raises(ConfigError, match="no tenant") as e:
        TenantDirectory.from_file(path)
    assert str(path) in str(e.value)


BLANK = " must be a non-empty string"
AROUND = "( .+)? has white space at its start or end"


@pytest.mark.parametrize("field, value, says", [
    ("name", '""', BLANK), ("name", '"   "', BLANK), ("name", '"\\t"', BLANK), ("api_key", '""', BLANK),
    ("api_key", '"  "', BLANK), ("api_key", '"\\n"', BLANK),
    ("name", '" chat"', AROUND), ("name", '"chat\\t"', AROUND), ("name", '"\\nchat"', AROUND),
    ("api_key", '"new "', AROUND), ("api_key", '" new"', AROUND), ("api_key", '"new\\r\\n"', AROUND)])
def test_an_entry_whose_name_or_key_is_blank_or_has_white_space_around_it_is_refused_naming_it(tmp_path, field,
                                                                                               value, says):
    """A blank name is a tenant nobody can tell from another in logs and Redis keys; a blank key a tenant whose
    key is a space. " chat" loaded as a tenant other than "chat" (its own jobs, bucket and idempotency keys, told
    apart from it in no log), and a key "new " as one no client could present: an HTTP header's value is stripped
    of it."""
    entry = {"name": '"chat"', "api_key": '"new"'} | {field: value}
    body = "".join(line + "\n" for line in ENTRY.splitlines() if not line.startswith("name "))
    path = _write(tmp_path, 'name = "ops"\napi_key = "o"\ntiers = ["P3"]\n',
                  body + f'name = {entry["name"]}\napi_key = {entry["api_key"]}\n')
    with pytest.raises(ConfigError, match=f"tenant #2: {field}{says}") as e:
        TenantDirectory.from_file(path)
    assert str(path) in str(e.value)
    assert "new" not in str(e.value).replace(str(path), "")  # the plain key is not echoed into logs


def test_a_gateway_given_a_tenants_file_of_no_tenant_says_so_and_exits_2(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text("# every tenant removed\n")
    done = run_gateway(path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert str(path) in done.stderr and "no tenant" in done.stderr, done.stderr


@pytest.mark.parametrize("encoding", ["latin-1", "utf-16"])
def test_a_tenants_file_not_in_utf8_is_refused_naming_it(tmp_path, encoding):
    """TOML is UTF-8. A file saved in another encoding (a Windows editor's UTF-16, a latin-1 tenant name) was a
    UnicodeDecodeError traceback that named no file; under a non-UTF-8 locale a latin-1 name loaded as other text."""
    path = tmp_path / "tenants.toml"
    path.write_text('[[tenant]]\nname = "café"\napi_key = "k"\ntiers = ["P3"]\n', encoding=encoding)
    with pytest.raises(ConfigError, match="cannot read tenants file") as e:
        TenantDirectory.from_file(path)
    assert str(path) in str(e.value)


def test_a_gateway_given_a_tenant_name_with_white_space_around_it_says_so_and_exits_2(tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text('[[tenant]]\nname = "ops"\napi_key = "o"\ntiers = ["P3"]\n'
                    '[[tenant]]\nname = "chat "\napi_key = "k"\ntiers = ["P1"]\n')
    done = run_gateway(path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert str(path) in done.stderr and "tenant #2: name 'chat ' has white space" in done.stderr, done.stderr


@pytest.mark.parametrize("key", ["k ", " k", "k\n"])
def test_the_http_doors_health_key_with_white_space_around_it_is_refused_without_echoing_it(key):
    """No tenant's key has white space at an end (refused above): a health_api_key with it (an env file's
    TS_HTTP_HEALTH_API_KEY="k ") was accepted, and /health then told every caller the key was unknown."""
    from gateway.http.config import HttpConfig

    with pytest.raises(ConfigError, match="health_api_key has white space at its start or end") as e:
        HttpConfig(health_api_key=key)
    assert "k" not in str(e.value).replace("health_api_key", "")


def test_the_http_door_given_a_health_key_with_white_space_around_it_says_so_and_exits_2():
    done = subprocess.run([sys.executable, "-m", "gateway.http", "--tokenizer", "no-such-tokenizer"], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=str(ROOT), TS_HTTP_HEALTH_API_KEY="health-key ",
                                   HF_HUB_OFFLINE="1"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "health_api_key has white space" in done.stderr and "health-key" not in done.stderr, done.stderr
