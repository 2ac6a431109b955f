"""A text of JSON values, read one after another: one document, JSON lines, or values back to back, as the spans
file (several processes appending batches) or a Jaeger answer holds them. A stretch that is not JSON is told and
skipped, so one bad line does not lose the rest. Nothing here knows OTLP: ``common.traces.otlp_json`` does."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

_BATCH_START = '{"resourceSpans":'  # how the file exporter begins each line
_LOOKAHEAD = 16  # more than the decoder reads at once: a \uXXXX\uXXXX surrogate pair, -Infinity


def iter_json_values(text: str, where: Callable[[int], str] | None = None) -> Iterator[tuple[Any, str | None]]:
    """Every JSON value in ``text`` (one document, JSON lines, or values back to back).

    Yields (value, None), or (None, error) for a stretch that is not JSON (skipped up to the
    next line, or to a batch that begins later on its line), so one truncated line does not lose the rest of the file.
    ``where`` names the text's line n in an error (default ``line n``): the text may be a file's picked lines.
    """
    decoder = json.JSONDecoder()
    pos, n = 0, len(text)
    # Both counted on from where the last bad stretch was, never from the start: a file of bad lines (or a line of
    # many cut batches) took time growing with the square of its size.
    line, counted = 1, 0  # the line that offset `counted` is on
    nl = -1  # where the line of the last bad stretch ends (n: it is the last)
    while True:
        while pos < n and text[pos] in " \t\r\n":
            pos += 1
        if pos >= n:
            return
        try:
            value, end = _decode(decoder, text, pos)
        except (json.JSONDecodeError, RecursionError) as e:
            # RecursionError: a value nested deeper than the decoder goes (a hostile line), bad like any other.
            line += text.count("\n", counted, pos)
            counted = pos
            why = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply"
            yield None, f"{where(line) if where else f'line {line}'}: not JSON ({why})"
            if nl < pos:
                nl = text.find("\n", pos)
                nl = n if nl < 0 else nl
            # A batch cut short (a full disk) and the next process's batch appended to it: the line's rest is whole.
            again = text.find(_BATCH_START, pos + 1, nl)
            if again >= 0:
                pos = again
                continue
            if nl >= n:
                return
            pos = nl + 1
            continue
        yield value, None
        pos = end


def _decode(decoder: json.JSONDecoder, text: str, pos: int) -> tuple[Any, int]:
    """What ``decoder.raw_decode(text, pos)`` returns or raises (the same value, or an error of the same msg), at a
    cost growing with the value's extent, not with ``pos``: each JSONDecodeError counts the newlines of the text it
    was given from its start, so the decoder is given a window of whole lines, doubled while its end may have
    made the answer differ (an error near the window's end, or a string it cut). Each window ends before a newline,
    where no token goes on, so a value decoded in it is the one the whole text holds."""
    n = len(text)
    stop = text.find("\n", pos)
    stop = n if stop < 0 else stop
    while True:
        window = text[pos:stop]
        try:
            value, end = decoder.raw_decode(window)
        except json.JSONDecodeError as e:
            if stop >= n or (e.pos + _LOOKAHEAD < len(window) and not e.msg.startswith("Unterminated string")):
                raise
            stop = text.find("\n", max(stop + 1, pos + 2 * len(window)))
            stop = n if stop < 0 else stop
            continue
        return value, pos + end
