"""The lines of spans files that name some ids, found without parsing them: how read_spans_file keeps only the
lines of one request out of a file of many megabytes."""

from __future__ import annotations

import base64
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from common.traces.truncation import TruncationWatch


def lines_naming(files: Sequence[Path | tuple[Path, TextIO]], tokens: set[str],
                 at: list[tuple[Path, int]] | None = None, watch: TruncationWatch | None = None) -> list[str]:
    """The lines of ``files`` that hold any of ``tokens`` (as a substring), read one at a time; with ``at``, the file
    and line number (from 1) of each is appended to it, so that a bad one can be told where the file has it. Each is
    a path, or a path and its file open (read from its start: a file read again is the same file, however renamed
    since). With ``watch``, a file truncated in place while it was read raises FileTruncated (common.traces.truncation)
    with the lines found so far."""
    finder = _TokenFinder(tokens)
    out = []
    for item in files:
        if isinstance(item, tuple):
            path, f = item
            _scan(path, f, finder, out, at, watch)
        else:
            with item.open(encoding="utf-8", errors="replace") as f:
                _scan(item, f, finder, out, at, watch)
    return out


def _scan(path: Path, f: TextIO, finder: _TokenFinder, out: list[str], at: list[tuple[Path, int]] | None,
          watch: TruncationWatch | None) -> None:
    if watch is not None:
        watch.begin(f)
    f.seek(0)
    for n, ln in enumerate(f, 1):
        if finder.in_line(ln):
            out.append(ln.rstrip("\n"))
            if at is not None:
                at.append((path, n))
    if watch is not None:
        watch.check(path, f, list(out))


# An id in each form id_forms makes of a span's or a trace's: hex of either case, base64, URL-safe base64. Other
# tokens (the request id in quotes, an odd id a producer wrote) are searched for as they are: they are few.
_ID_TOKEN = re.compile(r"[0-9A-Za-z+/=_-]{12}|[0-9A-Za-z+/=_-]{16}|[0-9A-Za-z+/=_-]{24}|[0-9A-Za-z+/=_-]{32}")


class _TokenFinder:
    """Whether a line holds any of many tokens, at a cost that does not grow with their number: searching each
    token in each line took (lines x tokens), four per link of the request, minutes for a request preempted
    thousands of times in a large spans file. An id-like token can only lie inside a run of id characters in the
    line, so each run at least as long as the shortest is looked up in a set, and so are its substrings of each
    length sought (a span id inside a longer string still counts, as with a substring search)."""

    def __init__(self, tokens: set[str]) -> None:
        self.ids = {t for t in tokens if _ID_TOKEN.fullmatch(t)}
        self.others = [t for t in tokens if t not in self.ids]
        self.lengths = sorted({len(t) for t in self.ids})
        self.runs = re.compile(f"[0-9A-Za-z+/=_-]{{{self.lengths[0]},}}") if self.lengths else None

    def in_line(self, line: str) -> bool:
        if any(t in line for t in self.others):
            return True
        if self.runs is None:
            return False
        ids = self.ids
        for run in self.runs.findall(line):
            if run in ids:
                return True
            for k in self.lengths:
                if k >= len(run):
                    break
                if any(run[i:i + k] in ids for i in range(len(run) - k + 1)):
                    return True
        return False


def id_forms(hex_id: str) -> set[str]:
    forms = {hex_id, hex_id.upper()}
    try:
        raw = bytes.fromhex(hex_id)
        forms.add(base64.b64encode(raw).decode())
        forms.add(base64.urlsafe_b64encode(raw).decode())
    except ValueError:
        pass
    return forms
