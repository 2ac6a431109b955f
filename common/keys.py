"""CURVE key pairs for gateways and workers, and the key-generation command.

    python -m common.keys --out keys/ --workers wk-0 wk-1

writes, in pyzmq's certificate format (``zmq.auth``; a ``.key`` file holds a public
key, a ``.key_secret`` file the pair):

    keys/gateway.key, keys/gateway.key_secret       the gateways' pair (one for the cluster)
    keys/workers/NAME.key, keys/workers/NAME.key_secret   one pair per worker
    keys/authorized_workers/NAME.key                 the allow-list gateways read: public keys only

A gateway needs gateway.key_secret and authorized_workers/; a worker needs its own
NAME.key_secret and gateway.key; an SDK client that wants encryption needs gateway.key.
Existing files are never overwritten (rotation adds new names; see SECURITY.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

import zmq
import zmq.auth

from common.secrets import check_writers

GATEWAY_NAME = "gateway"
WORKERS_DIR = "workers"
ALLOW_LIST_DIR = "authorized_workers"


class KeyFileError(ValueError):
    """A key file that is missing, unreadable or of the wrong kind."""


def load_public(path: str | Path) -> bytes:
    """The z85 public key in a ``.key`` (or ``.key_secret``) file."""
    check_writers(path, "CURVE key file")
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeyFileError(f"cannot read a CURVE public key from {path}: {e}") from None
    return public


def load_pair(path: str | Path) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a ``.key_secret`` file."""
    check_writers(path, "CURVE key file")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise KeyFileError(f"cannot read a CURVE key pair from {path}: {e}") from None
    if not secret:
        raise KeyFileError(f"{path} holds no secret key (a .key_secret file is needed)")
    return public, secret


def load_allow_list(directory: str | Path) -> set[bytes]:
    """Every public key in ``directory/*.key``; an empty or missing directory is an error."""
    d = Path(directory)
    if not d.is_dir():
        raise KeyFileError(f"worker allow-list {d} is not a directory")
    check_writers(d, "worker allow-list directory")  # whoever may add a file to it adds a worker
    keys = {load_public(p) for p in sorted(d.glob("*.key"))}
    if not keys:
        raise KeyFileError(f"worker allow-list {d} holds no *.key file")
    return keys


def _create(directory: Path, name: str) -> Path:
    secret = directory / f"{name}.key_secret"
    if secret.exists():
        return secret
    directory.mkdir(parents=True, exist_ok=True)
    old = os.umask(0o077)  # the secret file is readable by its owner only
    try:
        zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    return secret


def generate(out: str | Path, workers: list[str]) -> dict[str, Path]:
    """Create the gateway pair (if absent) and one pair per worker; returns what each process needs."""
    if not zmq.has("curve"):
        raise KeyFileError("this libzmq was built without CURVE support")
    root = Path(out)
    paths = {"gateway_secret": _create(root, GATEWAY_NAME), "gateway_public": root / f"{GATEWAY_NAME}.key",
             "allow_list": root / ALLOW_LIST_DIR}
    paths["allow_list"].mkdir(parents=True, exist_ok=True)
    for name in workers:
        if not name or "/" in name or name.startswith("."):
            raise KeyFileError(f"bad worker name {name!r}")
        _create(root / WORKERS_DIR, name)
        shutil.copyfile(root / WORKERS_DIR / f"{name}.key", paths["allow_list"] / f"{name}.key")
        paths[f"worker:{name}"] = root / WORKERS_DIR / f"{name}.key_secret"
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m common.keys", description=__doc__.splitlines()[0],
                                 epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="key directory (created; existing keys are kept)")
    ap.add_argument("--workers", nargs="*", default=[], metavar="NAME", help="one key pair per worker name")
    args = ap.parse_args(argv)
    try:
        paths = generate(args.out, args.workers)
    except KeyFileError as e:
        print(f"keys: {e}", file=sys.stderr)
        return 2
    for what, path in paths.items():
        print(f"{what}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
