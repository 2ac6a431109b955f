"""Removes what a launcher (scripts/up.py) leaves on disk when it is killed outright (SIGKILL, the OOM killer).

Its processes die with it (PR_SET_PDEATHSIG), but its secrets folder (CURVE keys, the tenants' API keys, the Redis
password), Redis's folder (its password in redis.conf, the jobs in the AOF) and its state file stayed behind. This
helper runs in a session of its own, so it outlives the launcher, and reads JSON lines from a pipe whose other end
only the launcher holds: the end of file comes however the launcher ends. Lines: {"dir": path} (remove it),
{"state": path, "keys_dir": path} (remove that state file while it still names these keys: a later run's, written to
the same path, is not ours), {"forget": true} (the launcher cleaned up itself: remove nothing).

    python -m scripts.leftovers    (started by LeftoversGuard; not for people)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parent.parent
RETRY_S = 10.0  # a dying redis-server may write its log once more; a folder it recreated is removed again


class LeftoversGuard:
    """The launcher's end of the pipe. Every method is best effort: a guard that died costs the cleanup, not the
    cluster."""

    def __init__(self) -> None:
        # No die_with_parent: outliving the launcher is its whole job. close_fds (the default) keeps the pipe's
        # write end out of every other child, or the end of file would wait for them.
        self._proc = subprocess.Popen([sys.executable, "-m", "scripts.leftovers"], cwd=ROOT, stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def remove_dir(self, path: Path) -> None:
        self._send({"dir": str(path)})

    def remove_state(self, path: Path, keys_dir: Path) -> None:
        self._send({"state": str(Path(path).resolve()), "keys_dir": str(keys_dir)})

    def forget(self) -> None:
        """Everything was removed already: end the guard without it touching anything."""
        self._send({"forget": True})
        try:
            self._proc.stdin.close()
            self._proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass

    def _send(self, line: dict) -> None:
        try:
            self._proc.stdin.write(json.dumps(line).encode() + b"\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):  # the guard is gone (or closed): nothing to tell
            pass


def watch(stream: IO[bytes]) -> None:
    dirs: list[Path] = []
    states: list[tuple[Path, str]] = []
    for raw in stream:  # until the end of file: the launcher's end
        try:
            line = json.loads(raw)
        except ValueError:
            continue
        if line.get("forget"):
            return
        if "dir" in line:
            dirs.append(Path(line["dir"]))
        if "state" in line:
            states.append((Path(line["state"]), str(line.get("keys_dir"))))
    for path, keys_dir in states:
        try:
            if json.loads(path.read_text())["keys"]["dir"] == keys_dir:
                path.unlink()
        except (OSError, ValueError, KeyError, TypeError):
            pass  # gone already, or not this run's
    deadline = time.monotonic() + RETRY_S
    while dirs and time.monotonic() < deadline:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
        dirs = [d for d in dirs if d.exists()]
        time.sleep(0.2)  # only while a folder came back


if __name__ == "__main__":
    watch(sys.stdin.buffer)
