"""Removes what a launcher (scripts/up.py) leaves on disk when it is killed outright (SIGKILL, the OOM killer).

Its processes die with it (PR_SET_PDEATHSIG), but its secrets folder (CURVE keys, the tenants' API keys, the Redis
password), Redis's folder (its password in redis.conf, the jobs in the AOF) and its state file stayed behind. This
helper runs in a session of its own, so it outlives the launcher, and reads JSON lines from a pipe whose other end
only the launcher holds: the end of file comes however the launcher ends. Lines: {"dir": path} (remove it),
{"state": path, "keys_dir": path} (remove that state file while it still names these keys: a later run's, written to
the same path, is not ours), {"forget": true} (the launcher cleaned up itself: remove nothing).

Both killed at once (kill -9 of the group, the OOM killer, a crash of the machine), nobody was left to remove them.
So the guard also keeps a record of the same lines, led by the pids of the launcher and of this helper, in the
launcher's secrets folder (LEFTOVERS_FILE), and the next launcher's sweep_dead_runs() removes what a run whose
launcher and helper are both gone left behind; a live run's (either process alive) is never touched.

    python -m scripts.leftovers    (started by LeftoversGuard; not for people)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
RETRY_S = 10.0  # a dying redis-server may write its log once more; a folder it recreated is removed again
LEFTOVERS_FILE = "leftovers.jsonl"  # the record, in the folder it names first (the launcher's secrets)


class LeftoversGuard:
    """The launcher's end of the pipe. Every method is best effort: a guard that died costs the cleanup, not the
    cluster."""

    def __init__(self, record: Path | None = None) -> None:
        """``record``: a file to keep the lines in too, for a later launcher should this helper die with us."""
        # No die_with_parent: outliving the launcher is its whole job. close_fds (the default) keeps the pipe's
        # write end out of every other child, or the end of file would wait for them.
        self._proc = subprocess.Popen([sys.executable, "-m", "scripts.leftovers"], cwd=ROOT, stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self._record = None
        if record is not None:
            try:
                self._record = open(record, "a", encoding="utf-8")  # noqa: SIM115 (closed by forget)
                owners = {"owner": identity(os.getpid()), "helper": identity(self._proc.pid)}
                self._record.write(json.dumps(owners) + "\n")
                self._record.flush()
            except OSError:
                self._record = None

    def remove_dir(self, path: Path) -> None:
        self._send({"dir": str(path)})

    def remove_state(self, path: Path, keys_dir: Path) -> None:
        self._send({"state": str(Path(path).resolve()), "keys_dir": str(keys_dir)})

    def forget(self) -> None:
        """Everything was removed already: end the guard without it touching anything."""
        self._send({"forget": True})
        if self._record is not None:
            self._record.close()
            self._record = None
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def _send(self, line: dict) -> None:
        if self._record is not None and "forget" not in line:
            try:  # written before the helper hears it: the record never holds less than the helper would remove
                self._record.write(json.dumps(line) + "\n")
                self._record.flush()
            except (OSError, ValueError):
                pass
        try:
            self._proc.stdin.write(json.dumps(line).encode() + b"\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):  # the guard is gone (or closed): nothing to tell
            pass


def identity(pid: int) -> list:
    """[pid, its start time]: a pid alone may name another process by the time it is checked."""
    return [pid, _start_time(pid)]


def _start_time(pid: int) -> str | None:
    try:  # /proc/PID/stat: the 22nd field, after the command name (which may hold spaces and parentheses)
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def alive(ident: object) -> bool:
    """Whether the process ``identity()`` named still runs (a malformed one counts as alive: not ours to judge)."""
    if not (isinstance(ident, list) and len(ident) == 2 and isinstance(ident[0], int) and ident[0] > 0):
        return True
    pid, started = ident
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's process: the pid was reused
        return False
    now = _start_time(pid)
    if started is None or now is None:
        return True  # no /proc to tell a reused pid by
    try:  # a zombie is dead too
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
    except (OSError, IndexError):
        pass
    return now == started


def sweep_dead_runs(folder: Path, prefix: str, also: tuple[Path, ...] | list[Path] = ()) -> list[Path]:
    """Remove what a dead run (launcher and helper both gone) left: each ``prefix``* folder of ours in ``folder``
    holding a record, and each in ``also`` (one a state file names: its run may have had another temporary
    folder). The folders removed."""
    removed = []
    found = sorted(Path(folder).glob(prefix + "*"))
    for d in found + [Path(p) for p in also if Path(p).name.startswith(prefix) and Path(p) not in found]:
        try:
            if d.is_symlink() or not d.is_dir() or d.stat().st_uid != os.getuid():
                continue
            lines = _read_record(d / LEFTOVERS_FILE)
        except OSError:
            continue
        if not lines or "owner" not in lines[0] or alive(lines[0].get("owner")) or alive(lines[0].get("helper")):
            continue  # no record yet (a run starting), or a live run's
        dirs, states = _collect(lines[1:])
        # Only folders beside this one (the launcher's and Redis's temporary folders), whatever a record says; the
        # record's own folder last, so that a sweep cut short leaves the record for the next one.
        dirs = sorted((p for p in dirs if p.parent == d.parent), key=lambda p: p.name == d.name)
        remove(states, dirs, retry_s=0.0)
        removed += [p for p in dirs if not p.exists()]
    return removed


def live_owner(folder: Path) -> int | None:
    """The pid of the launcher whose record ``folder`` holds, while it runs; else None."""
    try:
        lines = _read_record(Path(folder) / LEFTOVERS_FILE)
    except OSError:
        return None
    owner = lines[0].get("owner") if lines else None
    # alive() counts a malformed identity as alive (the sweep's caution); here only a well-formed one is a run.
    if isinstance(owner, list) and len(owner) == 2 and isinstance(owner[0], int) and owner[0] > 0 and alive(owner):
        return owner[0]
    return None


def _read_record(path: Path) -> list[dict]:
    out = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            line = json.loads(raw)
        except ValueError:
            continue  # a line cut short by the kill
        if isinstance(line, dict):
            out.append(line)
    return out


def _collect(lines) -> tuple[list[Path], list[tuple[Path, str]]]:
    dirs: list[Path] = []
    states: list[tuple[Path, str]] = []
    for line in lines:
        if "dir" in line:
            dirs.append(Path(line["dir"]))
        if "state" in line:
            states.append((Path(line["state"]), str(line.get("keys_dir"))))
    return dirs, states


def remove(states: list[tuple[Path, str]], dirs: list[Path], retry_s: float = RETRY_S) -> None:
    """Remove each state file still naming its keys folder, then each folder (again while one comes back)."""
    for path, keys_dir in states:
        try:
            if json.loads(path.read_text())["keys"]["dir"] == keys_dir:
                path.unlink()
        except (OSError, ValueError, KeyError, TypeError):
            pass  # gone already, or not this run's
    deadline = time.monotonic() + retry_s
    while dirs:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
        dirs = [d for d in dirs if d.exists()]
        if not dirs or time.monotonic() >= deadline:
            return
        time.sleep(0.2)  # only while a folder came back


def watch(stream: IO[bytes]) -> None:
    lines = []
    for raw in stream:  # until the end of file: the launcher's end
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(line, dict):
            continue
        if line.get("forget"):
            return
        lines.append(line)
    dirs, states = _collect(lines)
    remove(states, dirs)


if __name__ == "__main__":
    watch(sys.stdin.buffer)
