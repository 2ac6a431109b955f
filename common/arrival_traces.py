"""Read the arrivals of a public LLM serving trace: (seconds since the first arrival, prompt tokens, output tokens).

The wait estimates (scripts/bench_estimate.py) and the scheduler simulator (worker/simulator.py) replay
traces; they are judged on more than the Azure trace shipped in data/, so load_trace reads the common public
formats, told apart by the header (CSV) or the first record (JSONL):

- Azure LLM inference traces 2023 and 2024 and the Azure multimodal (LMM) trace, CSV: TIMESTAMP (ISO
  datetime, up to 7 fractional digits, with or without a UTC offset), ContextTokens, GeneratedTokens
  (NumImages is ignored). A timestamp without an offset is UTC, whatever the machine's time zone.
- BurstGPT, CSV: Timestamp (seconds), Request tokens, Response tokens (Model, Total tokens, Log Type,
  Session ID and Elapsed time are ignored).
- Mooncake / FAST'25, JSONL: timestamp (milliseconds), input_length, output_length (hash_ids is ignored).
- Any other CSV or JSONL with one column of each role in COLUMNS: time in seconds (or an ISO datetime),
  prompt tokens, output tokens.

Column names match whatever their case, spaces and underscores. A file ending in .gz is read through gzip.
Reading stops once start + count rows are read, as traces run to millions of rows. The rows of the window
are returned in arrival order (a stable sort): a trace that is out of order would otherwise give negative
gaps between arrivals.

Some traces record arrivals to the whole second (BurstGPT) and so give a busy second's arrivals one
timestamp. They did not come at one instant: replayed as recorded, each second's arrivals hit the cluster
together, a clump the real traffic never had. spread_ties() places every arrival of such a trace at a
random moment within its recorded unit (seeded), the replay a trace of that resolution allows.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import random
import re
from collections.abc import Iterator
from datetime import datetime, timezone
from itertools import groupby, islice
from pathlib import Path

# Each role's accepted names, normalised (see _norm), in order of preference.
COLUMNS = {
    "time": ("timestamp", "arrivaltime", "arrivedat", "time"),
    "prompt tokens": ("contexttokens", "requesttokens", "inputlength", "prompttokens", "inputtokens",
                      "numprefilltokens"),
    "output tokens": ("generatedtokens", "responsetokens", "outputlength", "outputtokens", "completiontokens",
                      "numdecodetokens"),
}
MOONCAKE = ("timestamp", "inputlength", "outputlength")  # in JSONL, its timestamps are milliseconds
ACCEPTED = ("Azure LLM/LMM inference traces (CSV: TIMESTAMP, ContextTokens, GeneratedTokens), "
            "BurstGPT (CSV: Timestamp, Request tokens, Response tokens), "
            "Mooncake (JSONL: timestamp in ms, input_length, output_length), "
            "or a CSV/JSONL with a time in seconds (timestamp|arrival_time|arrived_at|time), prompt tokens "
            "(prompt_tokens|input_tokens|input_length|context_tokens|request_tokens|num_prefill_tokens) and "
            "output tokens (output_tokens|completion_tokens|output_length|generated_tokens|response_tokens|"
            "num_decode_tokens)")


def load_trace(path: Path, start: int, count: int) -> list[tuple[float, int, int]]:
    """(seconds since the first arrival, prompt tokens, output tokens) of rows start..start+count, by arrival."""
    path = Path(path)
    rows = []
    with _open(path) as f:
        while (first := f.readline()) and not first.strip():
            pass
        jsonl = first.lstrip().startswith("{")
        f.seek(0)
        records = _jsonl(path, f) if jsonl else _csv(f)
        names = next(records)
        keys, unit = _columns(path, names, jsonl)
        first_row = max(start, 0)
        for line, record in islice(records, first_row, first_row + max(count, 0)):
            rows.append(_row(path, line, [record.get(k) for k in keys], unit))
    if not rows:
        raise SystemExit(f"trace: no rows in {path} from row {start}")
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0]
    return [(at - t0, prompt, output) for at, prompt, output in rows]


# Units a trace's timestamps may be recorded to, coarsest first (Mooncake: milliseconds); the Azure traces record
# theirs to 100 ns, and ties there are too rare to matter.
UNITS_S = (1.0, 0.1, 0.01, 0.001)


def resolution(times: list[float]) -> float | None:
    """The coarsest of UNITS_S that every time (seconds from the first) is a whole number of, if some arrivals
    share a time; None: no ties, or recorded finer than UNITS_S (the Azure traces: to 100 ns)."""
    if len(set(times)) == len(times):
        return None
    return next((unit for unit in UNITS_S if all(abs(t / unit - round(t / unit)) < 1e-6 for t in times)), None)


def spread_ties(rows: list[tuple[float, int, int]], rng: random.Random) -> tuple[list[tuple[float, int, int]],
                                                                                 float | None]:
    """``rows`` (load_trace's) with each arrival moved to a uniformly random moment within the unit its trace
    records time to, in arrival order, again from 0; and that unit. Rows unchanged (None) where resolution()
    finds none: a trace that records arrivals finely is replayed as it is."""
    unit = resolution([at for at, _, _ in rows])
    if unit is None:
        return rows, None
    moved: list[tuple[float, int, int]] = []
    for at, group in groupby(rows, key=lambda r: r[0]):  # within a unit, the file's order is kept
        group = list(group)
        offsets = sorted(rng.uniform(0.0, unit) for _ in group)
        moved += [(at + dt, prompt, output) for dt, (_, prompt, output) in zip(offsets, group)]
    t0 = moved[0][0]
    return [(at - t0, prompt, output) for at, prompt, output in moved], unit


def ties_rng(seed: int) -> random.Random:
    """The generator a replay seeded with ``seed`` spreads ties with: apart from its other draws (the tiers), and
    one for the estimate bench and the scheduler simulator, so one trace and seed give both the same arrivals."""
    return random.Random(f"spread ties {seed}")


def _open(path: Path):
    # utf-8-sig: a CSV saved by a spreadsheet starts with a byte-order mark that would hide the first column's name.
    if path.suffix == ".gz":
        return gzip.open(path, "rt", newline="", encoding="utf-8-sig")
    return path.open(newline="", encoding="utf-8-sig")


def _csv(f) -> Iterator:
    """The header, then (line number, {column: field}) of each row."""
    reader = csv.reader(f)
    header = next(reader, [])
    yield header
    for fields in reader:
        if fields:
            yield reader.line_num, dict(zip(header, fields))


def _jsonl(path: Path, f) -> Iterator:
    """The first record's keys, then (line number, record) of each record."""
    named = False
    for line, text in enumerate(f, 1):
        if not text.strip():
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict):
            raise SystemExit(f"trace: {path}, line {line}: not a JSON object")
        if not named:
            named = True
            yield list(record)
        yield line, record


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _columns(path: Path, names: list[str], jsonl: bool) -> tuple[list[str], float]:
    """The time, prompt and output column names as the file spells them, and the time unit in seconds."""
    spelled: dict[str, str] = {}
    for name in names:
        spelled.setdefault(_norm(name), name)
    picked = [next((a for a in aliases if a in spelled), None) for aliases in COLUMNS.values()]
    if None in picked:
        raise SystemExit(f"trace: {path}: unknown trace format, header {names}; "
                         f"the formats read are {ACCEPTED}")
    unit = 1e-3 if jsonl and tuple(picked) == MOONCAKE else 1.0
    return [spelled[a] for a in picked], unit


def _row(path: Path, line: int, raw: list, unit: float) -> tuple[float, int, int]:
    try:
        return _seconds(raw[0], unit), _tokens(raw[1]), _tokens(raw[2])
    except (TypeError, ValueError):
        roles = ", ".join(f"{role} {value!r}" for role, value in zip(COLUMNS, raw))
        raise SystemExit(f"trace: {path}, line {line}: bad row ({roles}); need a time and token counts "
                         f">= 0") from None


def _seconds(value, unit: float) -> float:
    if isinstance(value, bool) or value is None:
        raise ValueError(value)
    try:
        seconds = float(value) * unit
    except ValueError:
        # Python 3.11's fromisoformat reads Azure's 7 fractional digits (dropping the 7th), 'Z' and offsets.
        at = datetime.fromisoformat(value.strip())
        seconds = (at if at.tzinfo else at.replace(tzinfo=timezone.utc)).timestamp()
    if not math.isfinite(seconds):
        raise ValueError(value)
    return seconds


def _tokens(value) -> int:
    if isinstance(value, bool) or value is None:
        raise ValueError(value)
    n = float(value)
    if not n.is_integer() or n < 0:
        raise ValueError(value)
    return int(n)
