"""What scripts/up.py keeps on disk beside its processes: the state file (written atomically, readable by its owner
only, present while the cluster is up), and the sweep of what a dead run left (its secrets folder, whose record
scripts/leftovers.py keeps, Redis's folder, its state file)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from scripts.leftovers import live_owner, sweep_dead_runs

SECRETS_PREFIX = "ts-cluster-secrets-"  # a temporary folder per run: the keys, the Redis password, the API keys


def sweep_leftovers(state_file: Path | None = None) -> None:
    """Remove the secrets, Redis's folder and the state file of runs dead with their leftovers helper (kill -9 of
    both, a crash of the machine): nobody else will. Those in the temporary folder, and the run's that
    ``state_file`` names (started with another TMPDIR, it is found there alone). A live run's are left alone."""
    also = [] if state_file is None else recorded_secrets(state_file)
    for d in sweep_dead_runs(Path(tempfile.gettempdir()), SECRETS_PREFIX, also):
        print(f"up.py: removed {d}, left by a run that died without cleaning up", file=sys.stderr, flush=True)


def running_launcher(state_file: Path) -> int | None:
    """The pid of the launcher still running the cluster ``state_file`` names, if any."""
    for folder in recorded_secrets(state_file):
        if (pid := live_owner(folder)) is not None:
            return pid
    return None


def recorded_secrets(state_file: Path) -> list[Path]:
    """The secrets folder a state file names (its keys folder's parent), if any: a lead, checked by the sweep."""
    try:
        if not Path(state_file).is_file():  # /dev/null, a pipe: nothing to read, or a read that never ends
            return []
        with open(state_file, "rb") as f:
            keys_dir = json.loads(f.read(1 << 20))["keys"]["dir"]
        return [Path(keys_dir).parent] if isinstance(keys_dir, str) and keys_dir else []
    except (OSError, ValueError, KeyError, TypeError):
        return []


def write_state(path: Path, state: dict) -> None:
    # A new file of a name nobody had (O_EXCL, mode 0600): it holds the Redis URL with its password and the API keys.
    # A fixed "<name>.tmp" was reused as found, so a stale one (mode 0644), or another user's file or link in a shared
    # folder, got the secrets and passed its mode on to the state file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(state, indent=2))
        os.replace(tmp, path)  # atomic: readers never see half a file
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_state(path: Path) -> None:
    """Remove a state file (a regular file only: --state-file /dev/null stays)."""
    if path.is_file():
        path.unlink(missing_ok=True)
