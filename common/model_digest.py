"""One string that names a model directory's weights, so a gateway can tell that two workers serve one model
wherever each keeps it.

A gateway took the first worker's model path as the cluster's and refused any other path: a worker on another host,
with the same model mounted elsewhere, was refused; and a worker whose directory at that path held other weights (a
fine-tune, a newer revision copied over the old one) was taken, and its jobs came back from another model than
their neighbours', marked done. A worker says this digest in its hello; where both it and the cluster's have one,
the gateway compares digests, not paths.

What it covers, cheaply enough to compute at every start (a few MiB read, however large the model):
the model's config.json (less the keys that name where and by which library version it was saved), every weight
file's name and size, a safetensors file's header (each tensor's name, dtype, shape and place), 4 KiB at the
start, middle and end of each of its tensors (of each entry of a zip file, torch.save's format: a tensor's storage
each), and 64 KiB at 16 places spread over each file's data. A fine-tune changes nearly every weight of each
tensor it tunes, but may tune few tensors (layers frozen, a LoRA merged into some projections): the 16 places alone
missed 60 of the 75 tensors of a 32M-parameter model, each tuned alone.

Digests say their scheme before the colon ("sha256t:" here; "sha256:", an earlier one, sampled no tensor): digests
of two schemes cannot be compared (gateway/hello_policy.py then compares paths).
"""

from __future__ import annotations

import hashlib
import json
import logging
import struct
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "sha256t:"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SAMPLES = 16
SAMPLE_BYTES = 64 * 1024
TENSOR_SAMPLE_BYTES = 4096
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
            header = f.read(header_len)
            h.update(header)
            start = 8 + header_len
            for begin, end in _tensor_spans(header, size - start):
                for at, length in _tensor_reads(begin, end):
                    f.seek(start + at)
                    h.update(f.read(length))
        elif zipfile.is_zipfile(f):  # torch.save's: each tensor's storage an entry of its own
            for name, begin, end in _zip_entries(f, size):
                h.update(f"\0{name}\0".encode())
                for at, length in _tensor_reads(begin, end):
                    f.seek(at)
                    h.update(f.read(length))
        span = max(0, size - start - SAMPLE_BYTES)
        for i in range(SAMPLES):
            f.seek(start + span * i // max(1, SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))


def _tensor_spans(header: bytes, data_size: int) -> list[tuple[int, int]]:
    """Each tensor's (begin, end) in a safetensors file's data, in the order they lie there."""
    tensors = json.loads(header)
    if not isinstance(tensors, dict):
        raise ValueError("a safetensors header that is not a JSON object")
    spans = []
    for name, t in tensors.items():
        if name == "__metadata__":
            continue
        offsets = t.get("data_offsets") if isinstance(t, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_size):
            raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} outside the file's {data_size} bytes of data")
        spans.append((offsets[0], offsets[1]))
    return sorted(spans)


def _zip_entries(f, size: int) -> list[tuple[str, int, int]]:
    """(name, begin, end) of each entry's data in the zip file ``f``, in the order they lie there."""
    try:
        with zipfile.ZipFile(f) as z:  # given a file, it leaves it open
            infos = z.infolist()
    except zipfile.BadZipFile as e:
        raise ValueError(f"a zip file whose directory is unreadable: {e}") from e
    entries = []
    for info in infos:
        f.seek(info.header_offset)
        local = f.read(30)  # the entry's local header; its extra field may differ from the central directory's
        if len(local) < 30 or local[:4] != b"PK\x03\x04":
            raise ValueError(f"zip entry {info.filename!r}: no local header at {info.header_offset}")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        begin = info.header_offset + 30 + name_len + extra_len
        if begin + info.compress_size > size:
            raise ValueError(f"zip entry {info.filename!r}: its data runs past the file's {size} bytes")
        entries.append((info.filename, begin, begin + info.compress_size))
    return sorted(entries, key=lambda e: e[1])


def _tensor_reads(begin: int, end: int) -> list[tuple[int, int]]:
    """(where, how many bytes) of a tensor's samples: its start, middle and end; the whole of a small one."""
    n = TENSOR_SAMPLE_BYTES
    if end - begin <= 3 * n:
        return [(begin, end - begin)]
    return [(begin, n), ((begin + end - n) // 2, n), (end - n, n)]
