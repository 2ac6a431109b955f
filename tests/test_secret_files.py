"""A key, password, tenants or allow-list file that others may write is loaded with one clear warning.

Whoever can write such a file can swap the gateway's key pair or the Redis password, add a tenant with a key of their
own, or add a worker key to the allow-list: they were all read without a word, whatever their mode. Readable by
others is not warned about: the Compose specification's default mode for a secret is 0444, and Compose bind-mounts a
file secret with its host mode, so an image running as its own uid (the gateway's 10001) often reads its secrets only
through the "other" bits. Nor where nobody else can write: a directory others cannot enter, a user private group.
Real files on disk; the warning names the file and its mode, never what it holds.
"""

from __future__ import annotations

import grp
import logging
import os

import pytest

from common import keys
from common.redis_server import read_secret
from gateway.tenants import TenantDirectory

TENANTS = '[[tenant]]\nname = "chat"\napi_key = "tenant-key-123"\ntiers = ["P1"]\n'


@pytest.fixture
def files(tmp_path):
    os.chmod(tmp_path, 0o755)  # others may enter (pytest makes it 0700): what they may write is up to each file
    pair = keys.generate(tmp_path / "keys", ["wk-a"])
    password = tmp_path / "redis-password"
    password.write_text("hunter2-password\n")
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(TENANTS)
    readers = {
        "password": (password, lambda: read_secret(password)),
        "tenants": (tenants, lambda: TenantDirectory.from_file(tenants)),
        "key pair": (pair["gateway_secret"], lambda: keys.load_pair(pair["gateway_secret"])),
        "public key": (pair["gateway_public"], lambda: keys.load_public(pair["gateway_public"])),
        "allow-list key": (pair["allow_list"] / "wk-a.key", lambda: keys.load_allow_list(pair["allow_list"])),
        "allow-list": (pair["allow_list"], lambda: keys.load_allow_list(pair["allow_list"])),
    }
    os.chmod(tmp_path / "keys", 0o755)
    return readers


def _shared_gid() -> int:
    """A group id that is no user's private group: one this host does not name (a chown needs root)."""
    if os.geteuid() != 0:
        pytest.skip("giving a file a group not its owner's needs root")
    return next(g for g in range(54321, 60000) if g not in {x.gr_gid for x in grp.getgrall()})


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _warned_only_while_others_may_write(caplog, read, directory, *named) -> None:
    """``read()`` of a secret that ``directory`` (all its owner's so far) holds, or holds the folder of: read without
    a word; with ``directory`` 0777, with one warning naming it, its mode and each of ``named``; made sticky (1777,
    as /tmp: only an entry's owner may rename it), without a word again."""
    caplog.set_level(logging.WARNING)
    read()
    assert _warnings(caplog) == []
    os.chmod(directory, 0o777)
    read()
    said = _warnings(caplog)
    assert len(said) == 1 and f"directory {directory} " in said[0] and "0777" in said[0], said
    assert all(str(x) in said[0] for x in named), said
    caplog.clear()
    os.chmod(directory, 0o1777)
    read()
    assert _warnings(caplog) == []


@pytest.mark.parametrize("which", ["password", "tenants", "key pair", "public key", "allow-list key", "allow-list"])
@pytest.mark.parametrize("mode", [0o666, 0o620, 0o602])
def test_a_file_others_may_write_is_read_with_one_warning_naming_it_and_its_mode(files, caplog, which, mode):
    path, read = files[which]
    extra = 0o111 if path.is_dir() else 0
    if mode & 0o020:
        os.chown(path, -1, _shared_gid())
    os.chmod(path, mode | extra)
    caplog.set_level(logging.WARNING)
    read()
    read()  # read again (the allow-list on each reload, a key pair once a socket): warned once
    said = [m for m in _warnings(caplog) if str(path) in m]
    assert len(said) == 1, _warnings(caplog)
    assert f"{(mode | extra):04o}" in said[0] and "writ" in said[0]
    for secret in ("hunter2", "tenant-key-123"):
        assert secret not in said[0]


@pytest.mark.parametrize("mode", [0o600, 0o400, 0o640, 0o644, 0o444])
def test_a_file_only_its_owner_may_write_is_read_without_a_word(files, caplog, mode):
    caplog.set_level(logging.WARNING)
    for path, read in files.values():
        os.chmod(path, mode | (0o100 if path.is_dir() else 0) | (0o011 if path.is_dir() and mode & 0o044 else 0))
        read()
    assert _warnings(caplog) == []


def test_a_directory_others_may_write_is_warned_about_once_for_the_keys_in_it(files, caplog, tmp_path):
    """Whoever may write the directory may rename another file over the key, whatever the key's own mode."""
    caplog.set_level(logging.WARNING)
    path, read = files["key pair"]
    os.chmod(path.parent, 0o777)
    read()
    keys.load_public(path.parent / "gateway.key")
    said = _warnings(caplog)
    assert len(said) == 1 and f"directory {path.parent} " in said[0] and "0777" in said[0], said
    os.chmod(path.parent, 0o1777)  # sticky, as /tmp: only a file's owner may rename it
    os.chmod(path, 0o600)
    caplog.clear()
    files["password"][1]()
    os.chmod(tmp_path, 0o1777)
    files["password"][1]()
    assert _warnings(caplog) == []


def test_a_file_in_a_directory_others_cannot_enter_is_read_without_a_word(files, caplog, tmp_path):
    """scripts/up.py keeps the local cluster's secrets in a 0700 folder: a 0666 file in there is its owner's alone."""
    caplog.set_level(logging.WARNING)
    os.chmod(tmp_path, 0o700)
    for which in ("password", "tenants"):
        path, read = files[which]
        os.chmod(path, 0o666)
        read()
    assert _warnings(caplog) == []


@pytest.mark.parametrize("which", ["password", "tenants", "key pair"])
def test_a_file_named_through_a_link_is_judged_where_it_lives(files, caplog, tmp_path, which):
    """A secret named through a symbolic link (/etc/tiered/tenants.toml -> /srv/shared/tenants.toml) is replaced by
    whoever may write the directory it lives in: only the link's own directory was looked at, and a file in a
    directory everybody may write was read without a word."""
    path, read = files[which]
    shared = tmp_path / "shared"
    shared.mkdir()
    real = shared / path.name
    os.replace(path, real)
    os.chmod(real, 0o600)
    path.symlink_to(real)
    _warned_only_while_others_may_write(caplog, read, shared)


@pytest.fixture
def reachable(tmp_path):
    """A folder under /tmp that others may enter all the way down (pytest's own tmp folders are 0700, and nothing
    under a folder others cannot enter is theirs to change): base/keys holds the secrets, base starts 0755."""
    import shutil
    import tempfile
    base = tempfile.mkdtemp(prefix="secret-ancestors-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        pair = keys.generate(os.path.join(base, "keys"), ["wk-a"])
        folder = pair["gateway_secret"].parent
        os.chmod(folder, 0o755)
        (folder / "redis-password").write_text("hunter2-password\n")
        (folder / "tenants.toml").write_text(TENANTS)
        for name in ("redis-password", "tenants.toml"):
            os.chmod(folder / name, 0o600)
        yield base, {"password": (folder / "redis-password", lambda: read_secret(folder / "redis-password")),
                     "tenants": (folder / "tenants.toml", lambda: TenantDirectory.from_file(folder / "tenants.toml")),
                     "key pair": (pair["gateway_secret"], lambda: keys.load_pair(pair["gateway_secret"]))}
    finally:
        shutil.rmtree(base)


@pytest.mark.parametrize("which", ["password", "tenants", "key pair"])
def test_an_ancestor_directory_others_may_write_is_warned_about_naming_it(reachable, caplog, which):
    """Whoever may write a directory above the secret's may rename the folder that holds it (its own mode does not
    stop a rename within one directory) and put a folder of their own in its place: base 0777 holding keys/secret
    was read without a word, only the secret's own directory being looked at."""
    base, files = reachable
    path, read = files[which]
    _warned_only_while_others_may_write(caplog, read, base, path)


@pytest.mark.parametrize("level", ["its own", "above"])
def test_a_sticky_directory_of_another_user_is_warned_about(reachable, caplog, level):
    """The sticky bit does not bind the directory's own owner: a 1777 folder of another user's is theirs to empty."""
    if os.geteuid() != 0:
        pytest.skip("giving a directory another owner needs root")
    base, files = reachable
    path, read = files["password"]
    folder = str(path.parent) if level == "its own" else base
    os.chmod(folder, 0o1777)
    os.chown(folder, 65534, -1)
    caplog.set_level(logging.WARNING)
    read()
    said = _warnings(caplog)
    assert len(said) == 1 and f"directory {folder} " in said[0] and "1777" in said[0] and "65534" in said[0], said
    os.chown(folder, os.geteuid(), -1)  # the reader's own: only it may rename what others put there
    caplog.clear()
    read()
    assert _warnings(caplog) == []


def test_an_ancestor_others_may_write_above_one_they_cannot_enter_is_no_concern(reachable, caplog):
    """base 0777 holding keys 0700: others may rename keys away, so that is warned about; but a 0700 folder above
    a 0777 one keeps everyone else out of all below it, as pytest's own tmp folders do (/tmp/pytest-of-root)."""
    base, files = reachable
    path, read = files["tenants"]
    os.chmod(base, 0o700)
    os.chmod(path.parent, 0o755)
    caplog.set_level(logging.WARNING)
    read()
    assert _warnings(caplog) == []
    os.chmod(base, 0o777)
    os.chmod(path.parent, 0o700)
    read()
    said = _warnings(caplog)
    assert len(said) == 1 and f"directory {base} " in said[0], said


def test_a_file_named_through_a_link_is_judged_by_the_ancestors_of_where_it_lives(reachable, caplog, tmp_path):
    base, files = reachable
    path, read = files["tenants"]
    link = tmp_path / "tenants.toml"
    link.symlink_to(path)
    os.chmod(base, 0o777)
    caplog.set_level(logging.WARNING)
    TenantDirectory.from_file(link)
    said = _warnings(caplog)
    assert len(said) == 1 and f"directory {base} " in said[0], said
