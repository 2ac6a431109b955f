"""One string that names a model directory's weights, so a gateway can tell that two workers serve one model
wherever each keeps it.

A gateway took the first worker's model path as the cluster's and refused any other path: a worker on another host,
with the same model mounted elsewhere, was refused; and a worker whose directory at that path held other weights (a
fine-tune, a newer revision copied over the old one) was taken, and its jobs came back from another model than
their neighbours', marked done. A worker says this digest in its hello; where both it and the cluster's have one,
the gateway compares digests, not paths.

What it covers, cheaply enough to compute at every start (a few MiB read, however large the model):
the model's config.json (less the keys that name where and by which library version it was saved), every weight
file's name and size, a safetensors file's header (each tensor's name, dtype, shape and place), and 64 KiB at 16
places spread over each file's data: a fine-tune changes nearly every weight, so sampled bytes tell it apart.
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "sha256:"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SAMPLES = 16
SAMPLE_BYTES = 64 * 1024
VOLATILE_CONFIG = ("_name_or_path", "transformers_version")  # where and by what it was saved, not what it is


def of_weights(model: str) -> str | None:
    """The digest of the model directory ``model``, or None where there is nothing to read (a hub name, no
    config.json or no weight file): the gateway then compares the model's path, as it did."""
    root = Path(model)
    files = sorted(p for p in root.glob("*") if p.is_file() and p.name.endswith(WEIGHT_SUFFIXES)) \
        if root.is_dir() else []
    if not files or not (root / "config.json").is_file():
        return None
    h = hashlib.sha256()
    try:
        config = json.loads((root / "config.json").read_text())
        for key in VOLATILE_CONFIG:
            config.pop(key, None)
        h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
        for path in files:
            _file(h, path)
    except (OSError, ValueError) as e:
        log.warning("could not read model %s for its digest (%s): gateways compare its path instead", model, e)
        return None
    return PREFIX + h.hexdigest()


def _file(h, path: Path) -> None:
    size = path.stat().st_size
    h.update(f"\0{path.name}\0{size}\0".encode())
    with path.open("rb") as f:
        start = 0
        if path.suffix == ".safetensors" and size >= 8:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                raise ValueError(f"{path.name}: a safetensors header of {header_len} bytes in a {size}-byte file")
            h.update(f.read(header_len))
            start = 8 + header_len
        span = max(0, size - start - SAMPLE_BYTES)
        for i in range(SAMPLES):
            f.seek(start + span * i // max(1, SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))
