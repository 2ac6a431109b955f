"""A text of JSON values, read one after another: one document, JSON lines, or values back to back, as the spans
file (several processes appending batches) or a Jaeger answer holds them. A stretch that is not JSON is told and
skipped, so one bad line does not lose the rest. Nothing here knows OTLP: ``common.traces.otlp_json`` does."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

_BATCH_START = '{"resourceSpans":'  # how the file exporter begins each line


def iter_json_values(text: str) -> Iterator[tuple[Any, str | None]]:
    """Every JSON value in ``text`` (one document, JSON lines, or values back to back).

    Yields (value, None), or (None, error) for a stretch that is not JSON (skipped up to the
    next line, or to a batch that begins later on its line), so one truncated line does not lose the rest of the file.
    """
    decoder = json.JSONDecoder()
    pos, n = 0, len(text)
    while True:
        while pos < n and text[pos] in " \t\r\n":
            pos += 1
        if pos >= n:
            return
        try:
            value, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            line = text.count("\n", 0, pos) + 1
            yield None, f"line {line}: not JSON ({e.msg})"
            nl = text.find("\n", pos)
            # A batch cut short (a full disk) and the next process's batch appended to it: the line's rest is whole.
            again = text.find(_BATCH_START, pos + 1, None if nl < 0 else nl)
            if again >= 0:
                pos = again
                continue
            if nl < 0:
                return
            pos = nl + 1
            continue
        yield value, None
        pos = end
