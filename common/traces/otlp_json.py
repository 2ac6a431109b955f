"""OTLP/JSON spans: parse what the OpenTelemetry file exporter, an OTLP/JSON document or Jaeger's
api_v3 returns into plain span records.

Input: one ``{"resourceSpans": [...]}`` object per line (lines from several processes and
batches), a single (pretty-printed) OTLP/JSON document, or Jaeger api_v3 responses
(``{"result": {"resourceSpans": [...]}}``). Ids may be hex (any case) or base64 (protobuf
JSON); they are normalised to lowercase hex. Nothing here knows what the spans mean:
``common.traces.analysis`` does the analysis. The text is read as JSON values by ``common.traces.json_values``; a
request's lines are picked out of a large file by ``common.traces.id_lines``; ids, times and attribute values are
read by ``common.traces.otlp_values``.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from common.spans_file import open_rotated
from common.traces.id_lines import id_forms, lines_naming
from common.traces.json_values import iter_json_values
# parse_any_value is not used here: imported so that it stays importable from here, as before otlp_values held it.
from common.traces.otlp_values import (_dict, _list, _pick, normalise_id, parse_any_value,  # noqa: F401
                                       parse_attributes, parse_nanos)
from common.traces.schema import REQUEST_ID
from common.traces.spans import Span, SpanEvent, SpanLink, SpanSet, dedupe
from common.traces.truncation import FileTruncated, TruncationWatch


class TraceFormatError(ValueError):
    """The input is not OTLP/JSON (nothing at all could be read from it)."""


def _parse_span(raw: dict, service: str | None) -> Span | None:
    trace_id = normalise_id(_pick(raw, "traceId", "trace_id"), 16)
    span_id = normalise_id(_pick(raw, "spanId", "span_id"), 8)
    if trace_id is None or span_id is None:
        return None
    links = []
    for link in _list(raw.get("links")):
        if not isinstance(link, dict):
            continue
        lt = normalise_id(_pick(link, "traceId", "trace_id"), 16)
        ls = normalise_id(_pick(link, "spanId", "span_id"), 8)
        if lt and ls:
            links.append(SpanLink(lt, ls, parse_attributes(link.get("attributes"))))
    events = [SpanEvent(str(e.get("name", "")), parse_nanos(_pick(e, "timeUnixNano", "time_unix_nano")),
                        parse_attributes(e.get("attributes")))
              for e in _list(raw.get("events")) if isinstance(e, dict)]
    status = raw.get("status")
    return Span(
        trace_id=trace_id, span_id=span_id,
        parent_span_id=normalise_id(_pick(raw, "parentSpanId", "parent_span_id"), 8),
        name=str(raw.get("name") or ""),
        start_ns=parse_nanos(_pick(raw, "startTimeUnixNano", "start_time_unix_nano")),
        end_ns=parse_nanos(_pick(raw, "endTimeUnixNano", "end_time_unix_nano")),
        attributes=parse_attributes(raw.get("attributes")),
        events=events, links=links, service=service,
        kind=raw.get("kind") if isinstance(raw.get("kind"), (int, str)) else None,
        status_code=status.get("code") if isinstance(status, dict) else None,
    )


def _resource_spans(doc: Any) -> list[dict] | None:
    """The ``resourceSpans`` list of an OTLP/JSON document or a Jaeger api_v3 answer, else None."""
    if isinstance(doc, list):
        out: list[dict] = []
        found = False
        for d in doc:
            rs = _resource_spans(d)
            if rs is not None:
                found = True
                out.extend(rs)
        return out if found else None
    if not isinstance(doc, dict):
        return None
    if "result" in doc and isinstance(doc["result"], (dict, list)):
        return _resource_spans(doc["result"])
    rs = _pick(doc, "resourceSpans", "resource_spans")
    return [r for r in rs if isinstance(r, dict)] if isinstance(rs, list) else None


def spans_from_document(doc: Any) -> list[Span]:
    """Every span of one OTLP/JSON document (or api_v3 answer); [] when it holds none."""
    out: list[Span] = []
    for rs in _resource_spans(doc) or []:
        resource = parse_attributes(_dict(rs.get("resource")).get("attributes"))
        service = resource.get("service.name")
        scopes = _list(_pick(rs, "scopeSpans", "scope_spans")) or _list(_pick(rs, "instrumentationLibrarySpans",
                                                                              "instrumentation_library_spans"))
        for ss in scopes:
            for raw in _list(_dict(ss).get("spans")):
                if isinstance(raw, dict):
                    span = _parse_span(raw, None if service is None else str(service))
                    if span is not None:
                        out.append(span)
    return out


def is_otlp_document(doc: Any) -> bool:
    return _resource_spans(doc) is not None


def trace_ids_from_summaries(doc: Any) -> list[str]:
    """Trace ids of a FindTraceSummaries answer (``{"summaries": [{"traceId": ...}]}``)."""
    if isinstance(doc, dict) and isinstance(doc.get("result"), dict):
        doc = doc["result"]
    if not isinstance(doc, dict) or not isinstance(doc.get("summaries"), list):
        return []
    ids = []
    for s in doc["summaries"]:
        tid = normalise_id(_pick(s, "traceId", "trace_id"), 16) if isinstance(s, dict) else None
        if tid and tid not in ids:
            ids.append(tid)
    return ids


def parse_spans_text(text: str, where: Callable[[int], str] | None = None) -> SpanSet:
    """Spans of OTLP/JSON text: JSON lines or one document. Raises TraceFormatError if none is OTLP. ``where`` names
    the text's line n in a warning (iter_json_values)."""
    spans: list[Span] = []
    warnings: list[str] = []
    docs = 0
    for value, error in iter_json_values(text, where):
        if error is not None:
            warnings.append(error)
            continue
        if is_otlp_document(value):
            docs += 1
            spans.extend(spans_from_document(value))
        else:
            warnings.append("a JSON value that is not OTLP/JSON (no resourceSpans) was skipped")
    if docs == 0 and text.strip():
        raise TraceFormatError("no OTLP/JSON in the input (expected lines of {\"resourceSpans\": [...]}"
                               + (f"; {warnings[0]}" if warnings else "") + ")")
    return SpanSet(dedupe(spans), warnings)


TRUNCATED_TRIES = 3  # readings from the start when the file is truncated in place while it is read


def read_spans_file(path: str | Path, request_id: str | None = None) -> SpanSet:
    """Spans of an OTLP-JSON lines file (or a file holding one document), and of its rotated files (FILE.1, FILE.2,
    ...: common/spans_file.py) if any.

    With ``request_id``, the files are streamed twice and only the lines that can matter are kept and
    parsed: those naming the request id, then those naming one of its traces or spans (in hex or
    base64), which holds the decision spans of other traces that link to it. Memory stays that of
    those lines, however large the files (up.py's grow about 2.6 KB a job). A bad line is told by its file and
    its line there, not by its place among the lines kept.

    A file truncated in place while it is read (common.traces.truncation) is read again from the start, and a
    warning says so: the spans read before the truncation are kept (a copy that logrotate left as FILE.1 holds the
    same ones: a span read twice counts once, the first read kept, as dedupe does for any duplicate id).
    Raises OSError when the file cannot be read, TraceFormatError when it holds no OTLP/JSON.
    """
    carried: list[Span] = []  # read before a truncation
    truncated: list[str] = []
    got: SpanSet | None = None
    whole = True
    for _ in range(TRUNCATED_TRIES):
        files, whole = open_rotated(path)
        try:
            got = _read_files(files, request_id, TruncationWatch(), carried)
            break
        except FileTruncated as e:
            carried.extend(_quiet_spans(e.read))
            truncated.append(str(e.path))
        finally:
            for _, f in files:
                f.close()
    if got is None:
        got = SpanSet([], [f"{truncated[-1]} was truncated again each time it was read ({TRUNCATED_TRIES} times): "
                           "spans may be missing (run explain again)"])
    if truncated:
        got = SpanSet(dedupe(carried + got.spans), got.warnings)
        got.warnings.insert(0, f"{truncated[0]} was truncated in place while it was read (logrotate's copytruncate?): "
                               "read again from the start; spans it held and that were not yet read are missing "
                               "unless a rotated copy (FILE.1) holds them")
    if not whole:
        got.warnings.insert(0, f"{path} was rotated while it was opened, again each time: spans may be missing "
                               "(run explain again)")
    return got


def _quiet_spans(texts: list[str]) -> list[Span]:
    """The spans of texts read before a truncation; a stretch that is not JSON is skipped without a word: it may be a
    line the truncation cut (the warning says the file was read again), and a bad line still in the file is told
    when it is read again."""
    out: list[Span] = []
    for value, error in iter_json_values("\n".join(texts)):
        if error is None and is_otlp_document(value):
            out.extend(spans_from_document(value))
    return out


def _names(span: Span, request_id: str) -> bool:
    return span.get(REQUEST_ID) is not None and str(span.get(REQUEST_ID)) == str(request_id)


def _read_files(files: list[tuple[Path, TextIO]], request_id: str | None, watch: TruncationWatch,
                carried: list[Span]) -> SpanSet:
    """The files' spans (both passes with ``request_id``); ``carried``, spans read before a truncation, name traces to
    keep lines of as the first pass's do. Raises FileTruncated."""
    if request_id is None or not all(f.seekable() for _, f in files):
        return _parse_all(files, watch)  # a pipe (--spans <(...)) is read once: a second pass would find it empty
    needle = json.dumps(str(request_id))
    first = lines_naming(files, {needle}, watch=watch)
    mine = [s for s in carried if _names(s, request_id)]
    seed: list[Span] = []
    if first:
        try:
            seed = parse_spans_text("\n".join(first)).spans
        except TraceFormatError:
            first = []
    if not first and not mine:
        # Nothing names the request (or the file is one pretty-printed document): parse it all.
        return _parse_all(files, watch)
    tokens = {needle}
    for s in mine + seed:
        if _names(s, request_id):
            tokens.update(id_forms(s.trace_id))
    traces = {t for t in tokens if len(t) == 32}  # not per span: tokens grow by each link (minutes, for thousands)
    for s in carried + seed:  # links out of the request's spans (the victim's preempted_by link)
        if s.trace_id in traces:
            for link in s.links:
                tokens.update(id_forms(link.span_id))
    at: list[tuple[Path, int]] = []
    try:
        kept = lines_naming(files, tokens, at, watch=watch)
    except FileTruncated as e:
        e.read[:0] = first  # read whole before it: its check passed
        raise
    return parse_spans_text("\n".join(kept), lambda n: _line_of(*at[n - 1]))


def _parse_all(files: list[tuple[Path, TextIO]], watch: TruncationWatch | None = None) -> SpanSet:
    """Every file whole, as one text; its line n told as the line of the file it came from."""
    paths = [p for p, _ in files]
    texts: list[str] = []
    for path, f in files:
        if watch is not None:
            watch.begin(f)
        if f.seekable():
            f.seek(0)
        texts.append(f.read())
        if watch is not None:
            watch.check(path, f, list(texts))
    firsts = [1]  # the text's line each file begins on: one more for each file's join
    for t in texts[:-1]:
        firsts.append(firsts[-1] + t.count("\n") + 1)

    def where(n: int) -> str:
        i = bisect_right(firsts, n) - 1
        return _line_of(paths[i], n - firsts[i] + 1)
    # One file's text as it is: a pretty-printed document stays one.
    return parse_spans_text(texts[0] if len(texts) == 1 else "\n".join(texts), where)


def _line_of(path: Path, n: int) -> str:
    return f"{path}, line {n}"
