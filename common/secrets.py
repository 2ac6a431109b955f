"""A warning for a secret or trust file (a key, a password, the tenants file, the worker allow-list) others may write.

Whoever can write one, or rename it or a folder above it away, can swap a key or the Redis password, add a tenant or a
worker key: the file is still read (a refusal would stop a running deployment on its next restart), with one warning
naming it, or the directory, and its mode. Readable by others is left alone: the Compose specification's default mode
for a secret is 0444, and Compose bind-mounts a file secret with its host mode, so an image running as its own uid (the
gateway's 10001) often reads its secrets through the "other" bits alone; a warning there would be said by every such
deployment, and so heard by none.
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import stat

log = logging.getLogger("secrets")
_warned: set[tuple[str, int]] = set()  # (path, mode): said once a process, though a key pair is read once a socket


def check_writers(path: str | os.PathLike, what: str) -> None:
    """Warn (once per path and mode) when someone other than its owner may write ``path``, or replace it through
    its directory (or, named through a link, the directory the file is in) or any directory above. Not said where
    nobody else can: a read-only mount (as Kubernetes and Compose mount secrets), a directory others cannot enter
    (scripts/up.py's 0700 secrets folder, and all below it), a group that is its owner's alone (the user private
    groups of umask 002 systems), a sticky directory of root's, the reader's or the file owner's (/tmp)."""
    path = os.fspath(path)
    # The directory of the name given, and of the file it names through any links (/etc/tiered/tenants.toml ->
    # /srv/shared/tenants.toml): whoever may write either may put another file there.
    folders = dict.fromkeys(os.path.dirname(p) for p in (os.path.abspath(path), os.path.realpath(path)))
    try:
        st, parents = os.stat(path), [(folder, os.stat(folder)) for folder in folders]
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            return
    except OSError:
        return  # the reader says why it cannot read it
    if who := next((w for _, parent in parents if (w := _writers(st, parent))), ""):
        _say(path, st.st_mode, f"{what} {path} is writable by {who}")
        return
    trusted = {0, os.geteuid(), st.st_uid}
    for folder, parent in parents:
        if who := _loose(parent, trusted):
            _say(folder, parent.st_mode, f"directory {folder} (of {what} {path}) is writable by {who}")
            return
    for folder in folders:
        if found := _loose_ancestor(folder, trusted):
            _say(found[0], found[1].st_mode, f"directory {found[0]} (above {what} {path}) is writable by {found[2]}")
            return


def _loose_ancestor(folder: str, trusted: set[int]) -> tuple[str, os.stat_result, str] | None:
    """The first directory above ``folder``, from the root down, in which others may rename the one below it (a
    folder's own mode does not stop its rename within its directory, and whoever renames it may put a folder of
    their own in its place); the walk ends at a directory others cannot enter, nothing below it being theirs."""
    above = []
    while (up := os.path.dirname(folder)) != folder:
        above.append(up)
        folder = up
    for d in reversed(above):
        try:
            st = os.stat(d)
        except OSError:
            return None
        if who := _loose(st, trusted):
            return d, st, who
        if not (st.st_mode & stat.S_IXOTH or st.st_mode & stat.S_IXGRP and _shared_group(st)):
            return None
    return None


def _loose(folder: os.stat_result, trusted: set[int]) -> str:
    """Who besides its owner may rename the entries of a directory: none in a sticky one (/tmp), unless its owner is
    someone other than ``trusted`` (the sticky bit does not bind a directory's owner)."""
    who = _writers(folder, None)
    if who and folder.st_mode & stat.S_ISVTX:
        return "" if folder.st_uid in trusted else f"{who} (sticky, but its owner, uid {folder.st_uid}, is not bound)"
    return who


def _writers(st: os.stat_result, parent: os.stat_result | None) -> str:
    """Who besides the owner may write (``parent``: the directory they must enter to reach it; None: not checked)."""
    mode, enter = st.st_mode, parent.st_mode if parent is not None else 0o777
    who = []
    if mode & stat.S_IWGRP and enter & (stat.S_IXGRP | stat.S_IXOTH) and _shared_group(st):
        who.append("its group")
    if mode & stat.S_IWOTH and enter & stat.S_IXOTH:
        who.append("others")
    return " and ".join(who)


def _shared_group(st: os.stat_result) -> bool:
    try:
        group, owner = grp.getgrgid(st.st_gid), pwd.getpwuid(st.st_uid).pw_name
    except KeyError:  # an id this host does not name (a mount from another host): it may be anyone's
        return True
    return group.gr_name != owner or any(m != owner for m in group.gr_mem)


def _say(path: str, mode: int, text: str) -> None:
    if (path, mode) in _warned:  # a directory of several keys: said once
        return
    _warned.add((path, mode))
    log.warning("%s (mode %04o): whoever can write it can replace what the file holds; chmod go-w it", text,
                stat.S_IMODE(mode))
