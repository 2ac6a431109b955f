"""Explain why a request was slow, from its trace: where its time went and what held it up.

    python scripts/explain.py REQUEST_ID --spans spans.jsonl [--json] [--png timeline.png]
    python scripts/explain.py REQUEST_ID --jaeger http://localhost:16686 [--service S] [--lookback 24h]

--spans reads an OTLP-JSON lines file (what the file exporter writes: TS_SPANS_FILE) or one
OTLP/JSON document. --jaeger asks Jaeger's api_v3 over HTTP: it searches the request's trace by
its ``request.id`` attribute, fetches it, and follows span links to the traces of the preemption
decisions that suspended it. The answer: total time split into queued / running / suspended,
and the blame chain ("queued 1.20 s behind 3 jobs (P0: 2, P3: 1)", "suspended 0.40 s (keep) by
request X (P0, tenant chat-co), decision pd-7", ...). --json prints the same as data, --png draws
the request's timeline.

Exit status: 0 explained; 1 no scheduling spans for the request (unknown id, or a trace that
holds none of this project's scheduling spans); 2 the input could not be read (file, Jaeger
error, timeout or empty search, bad arguments).
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import socket
import sys
import urllib.error
import urllib.parse
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from common.traces.otlp_json import (  # noqa: E402
    REQUEST_ID,
    Span,
    TraceFormatError,
    is_otlp_document,
    read_spans_file,
    spans_from_document,
    trace_ids_from_summaries,
)
from common.traces.json_values import iter_json_values  # noqa: E402
from common.traces import Explanation, NoSchedulingSpans, explain_request  # noqa: E402

DEFAULT_SERVICE = "tiered-serve-gateway"
DEFAULT_LOOKBACK = "24h"
MAX_TRACES = 20  # traces fetched for one search (a request has one; more only after lost context)
MAX_LINKED = 50  # decision traces followed through span links


class InputError(Exception):
    """The spans could not be read (file or Jaeger): exit status 2."""


# --------------------------------------------------------------------------------------------
# Jaeger api_v3 over HTTP


class JaegerClient:
    def __init__(self, base_url: str, timeout_s: float = 10.0) -> None:
        url = base_url.rstrip("/")
        for suffix in ("/api/v3/traces", "/api/v3"):
            if url.endswith(suffix):
                url = url[: -len(suffix)]
        if not re.match(r"^https?://", url):
            raise InputError(f"--jaeger {base_url!r}: expected an http:// or https:// URL "
                             "(e.g. http://localhost:16686)")
        self.base = url
        self.timeout_s = timeout_s

    def get(self, path: str, params: dict[str, str] | None = None) -> tuple[int, list[Any]]:
        """(HTTP status, JSON documents of the body); 404 comes back as (404, [...]), other errors raise."""
        url = self.base + path + ("?" + urllib.parse.urlencode(params) if params else "")
        req = urllib.request.Request(url, headers={"Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                status, body = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            status, body = e.code, _read_quietly(e)
            if status != 404:
                raise InputError(f"Jaeger at {self.base} answered HTTP {status} for {path}: "
                                 f"{_error_message(body) or e.reason}") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, (TimeoutError, socket.timeout)):
                raise InputError(f"Jaeger at {self.base} did not answer within {self.timeout_s:g} s") from None
            raise InputError(f"cannot reach Jaeger at {self.base}: {e.reason}") from None
        except (TimeoutError, socket.timeout):
            raise InputError(f"Jaeger at {self.base} did not answer within {self.timeout_s:g} s") from None
        except (http.client.HTTPException, OSError, ValueError) as e:
            raise InputError(f"cannot read from Jaeger at {self.base}: {type(e).__name__}: {e}") from None
        text = body.decode("utf-8", errors="replace")
        docs = [v for v, err in iter_json_values(text) if err is None]
        if not docs and status != 404:
            raise InputError(f"Jaeger at {self.base} answered {path} with something that is not JSON: "
                             f"{text[:120]!r}")
        for d in docs:
            if isinstance(d, dict) and isinstance(d.get("error"), dict) and status != 404:
                raise InputError(f"Jaeger at {self.base} answered an error for {path}: {_error_message(body)}")
        return status, docs

    def search(self, service: str, request_id: str, start: datetime, end: datetime) -> tuple[list[str], list[Span]]:
        """FindTraces by the request.id attribute: (trace ids, spans the answer already held)."""
        params = {
            "query.service_name": service,
            "query.attributes": json.dumps({REQUEST_ID: request_id}, separators=(",", ":")),
            "query.start_time_min": rfc3339(start),
            "query.start_time_max": rfc3339(end),
            "query.num_traces": str(MAX_TRACES),
        }
        status, docs = self.get("/api/v3/traces", params)
        if status == 404:
            return [], []
        ids: list[str] = []
        spans: list[Span] = []
        for d in docs:
            for tid in trace_ids_from_summaries(d):
                if tid not in ids:
                    ids.append(tid)
            if is_otlp_document(d):
                spans.extend(spans_from_document(d))
        matching = [s.trace_id for s in spans if s.get(REQUEST_ID) is not None and str(s.get(REQUEST_ID)) == request_id]
        for tid in matching or [s.trace_id for s in spans]:
            if tid not in ids:
                ids.append(tid)
        return ids[:MAX_TRACES], spans

    def get_trace(self, trace_id: str) -> list[Span] | None:
        """GetTrace; None when Jaeger does not have it."""
        status, docs = self.get(f"/api/v3/traces/{urllib.parse.quote(trace_id)}")
        if status == 404:
            return None
        spans: list[Span] = []
        for d in docs:
            spans.extend(spans_from_document(d))
        return spans


def _read_quietly(e: urllib.error.HTTPError) -> bytes:
    try:
        return e.read()
    except (OSError, http.client.HTTPException):
        return b""


def _error_message(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace").strip()
    try:
        doc = json.loads(text)
    except ValueError:
        return text[:200]
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        err = doc["error"]
        return str(err.get("message") or err)
    return text[:200]


def rfc3339(t: datetime) -> str:
    return t.astimezone(UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


def parse_duration(text: str) -> timedelta:
    """'24h', '90m', '1h30m', '7d', '3600' (seconds)."""
    text = text.strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return timedelta(seconds=float(text))
    if not re.fullmatch(r"(\d+(\.\d+)?(ms|s|m|h|d|w))+", text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a duration such as 24h, 90m, 1h30m, 7d")
    unit_s = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    return timedelta(seconds=sum(float(n) * unit_s[u] for n, _, u in re.findall(r"(\d+(\.\d+)?)(ms|s|m|h|d|w)", text)))


def spans_from_jaeger(client: JaegerClient, request_id: str, services: list[str], lookback: timedelta,
                      warnings: list[str]) -> list[Span]:
    end = datetime.now(UTC)
    start = end - lookback
    ids: list[str] = []
    for name in services:
        for tid in client.search(name, request_id, start, end)[0]:
            if tid not in ids:
                ids.append(tid)
    if not ids:
        raise InputError(f"Jaeger at {client.base} found no trace with {REQUEST_ID}={request_id} for service "
                         f"{', '.join(services)} between {rfc3339(start)} and {rfc3339(end)} "
                         f"(try --service or --lookback)")
    spans: list[Span] = []
    fetched: set[str] = set()
    for tid in ids:
        got = client.get_trace(tid)
        fetched.add(tid)
        if got is None:
            warnings.append(f"Jaeger found trace {tid} but has no spans for it (GetTrace: not found)")
            continue
        spans.extend(got)
    if not spans:
        raise InputError(f"Jaeger at {client.base} returned no spans for the traces of request {request_id}: "
                         f"{', '.join(ids)}")
    # Follow links out of the request's spans: the preemption decisions live in other traces.
    own = [s for s in spans if s.get(REQUEST_ID) is None or str(s.get(REQUEST_ID)) == request_id]
    linked = [lk.trace_id for s in own for lk in s.links if lk.trace_id not in fetched]
    for tid in dict.fromkeys(linked):
        if len(fetched) >= len(ids) + MAX_LINKED:
            warnings.append(f"more than {MAX_LINKED} linked traces; the rest were not fetched")
            break
        fetched.add(tid)
        try:
            got = client.get_trace(tid)
        except InputError as e:
            warnings.append(f"linked trace {tid} not fetched: {e}")
            continue
        if got is None:
            warnings.append(f"linked trace {tid} is not in Jaeger (decision details from the request's own spans)")
            continue
        spans.extend(got)
    return spans


# --------------------------------------------------------------------------------------------
# Timeline picture


ROWS = ("queue", "dispatch", "worker_queue", "prefill", "decode")
ROW_NAMES = {"queue": "gateway queue", "dispatch": "dispatch", "worker_queue": "worker queue",
             "prefill": "prefill", "decode": "decode", "suspended": "suspended"}
ROW_COLOURS = {"queue": "#f2b134", "dispatch": "#9e9e9e", "worker_queue": "#f7d794", "prefill": "#4c9be8",
               "decode": "#2e7d32", "suspended": "#ffffff"}


def render_png(exp: Explanation, out: str | Path) -> None:
    """One Gantt bar per phase; suspended periods hatched, labelled with the request that caused them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    suspended = [p for p in exp.phases if p.phase == "suspended"]
    rows = list(ROWS) + (["suspended"] if suspended else [])
    end = max([exp.total_s] + [p.end_s for p in exp.phases]) or 1.0
    min_w = end * 0.003  # a 2 ms dispatch still shows on a 60 s axis
    fig = Figure(figsize=(11, 1.9 + 0.5 * len(rows)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ypos = {row: len(rows) - 1 - i for i, row in enumerate(rows)}
    for row in rows:
        bars = [(p.start_s, max(p.end_s - p.start_s, min_w)) for p in exp.phases if p.phase == row]
        if not bars:
            continue
        if row == "suspended":
            ax.broken_barh(bars, (ypos[row] - 0.35, 0.7), facecolors="white", edgecolors="#c62828", hatch="///")
        else:
            ax.broken_barh(bars, (ypos[row] - 0.35, 0.7), facecolors=ROW_COLOURS[row], edgecolors="black",
                           linewidth=0.4)
    for p in suspended:
        ax.axvspan(p.start_s, p.end_s, facecolor="none", edgecolor="#c62828", hatch="//", alpha=0.35, linewidth=0)
        ax.text((p.start_s + p.end_s) / 2, ypos["suspended"] + 0.42, p.label, ha="center", va="bottom",
                fontsize=8, color="#c62828")
    for c in exp.blame:
        if c.kind in ("redispatch", "dead_letter"):  # a lease expiry (the work on that worker was lost), a hand-back
            what = "handed back by" if c.detail.get("cause") == "released" else "lease expired on"
            who = c.detail.get("previous_worker") if c.kind == "redispatch" else c.detail.get("worker")
            tail = ": dead-lettered" if c.kind == "dead_letter" else ""
            ax.axvline(c.at_s, linestyle="--", color="#6a1b9a", linewidth=1)
            ax.text(c.at_s, len(rows) - 0.55, f" {what} {who or '?'}{tail}", fontsize=8, color="#6a1b9a", va="bottom")
    ax.set_yticks([ypos[r] for r in rows], labels=[ROW_NAMES[r] for r in rows])
    ax.set_ylim(-0.7, len(rows) - 0.1 + (0.4 if suspended else 0.2))
    ax.set_xlim(0, end * 1.02)
    ax.set_xlabel("seconds since the request's first span")
    ax.grid(axis="x", linestyle=":", linewidth=0.5)
    ax.set_title(exp.summary(), fontsize=9, loc="left")
    fig.tight_layout()
    fig.savefig(str(out), dpi=110, format="png")


# --------------------------------------------------------------------------------------------
# CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="explain.py",
        description="Explain why a request was slow: its time split into queued / running / suspended, and "
                    "each wait with its cause (jobs ahead, aging, quota, preemptions and by whom, declined "
                    "preemptions, lease expiries).",
        epilog="exit status: 0 explained; 1 no scheduling spans for the request; 2 the spans could not be "
               "read (file, Jaeger error, timeout or empty search).",
    )
    p.add_argument("request_id", metavar="REQUEST_ID", help="the request (job) id, as in the request.id attribute")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--spans", metavar="FILE",
                     help="an OTLP-JSON lines file (TS_SPANS_FILE) or one OTLP/JSON document")
    src.add_argument("--jaeger", metavar="URL", help="Jaeger's query base URL (api_v3 over HTTP), e.g. "
                                                    "http://localhost:16686")
    p.add_argument("--service", action="append", metavar="NAME",
                   help=f"with --jaeger: the service whose spans carry request.id (default {DEFAULT_SERVICE}); "
                        "repeat it to search several (when a request's spans ended up in several traces)")
    p.add_argument("--lookback", type=parse_duration, default=parse_duration(DEFAULT_LOOKBACK),
                   help=f"with --jaeger: how far back to search, e.g. 2h, 7d (default {DEFAULT_LOOKBACK})")
    p.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                   help="with --jaeger: HTTP timeout per call (default 10)")
    p.add_argument("--json", action="store_true", help="print the explanation as JSON")
    p.add_argument("--png", metavar="OUT.png", help="also draw the request's timeline (matplotlib) to this file")
    return p


def load_spans(args: argparse.Namespace, warnings: list[str]) -> tuple[list[Span], bool]:
    """(spans, fallback_all): fallback_all when the source already selected the request's traces."""
    if args.spans:
        try:
            result = read_spans_file(args.spans, args.request_id)
        except OSError as e:
            raise InputError(f"cannot read {args.spans}: {e.strerror or e}") from None
        except TraceFormatError as e:
            raise InputError(f"{args.spans}: {e}") from None
        warnings.extend(result.warnings)
        return result.spans, False
    client = JaegerClient(args.jaeger, args.timeout)
    services = list(dict.fromkeys(args.service or [DEFAULT_SERVICE]))
    return spans_from_jaeger(client, args.request_id, services, args.lookback, warnings), True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings: list[str] = []
    try:
        spans, fallback_all = load_spans(args, warnings)
    except InputError as e:
        print(f"explain: {e}", file=sys.stderr)
        return 2
    for w in warnings[:5]:
        print(f"explain: warning: {w}", file=sys.stderr)
    if len(warnings) > 5:
        print(f"explain: warning: ... and {len(warnings) - 5} more", file=sys.stderr)
    try:
        exp = explain_request(spans, args.request_id, fallback_all=fallback_all)
    except NoSchedulingSpans as e:
        print(f"explain: {e}", file=sys.stderr)
        if args.json:
            print(json.dumps({"request_id": args.request_id, "error": str(e), "trace_ids": e.trace_ids,
                              "named_by": e.named_by}))
        return 1
    if args.json:
        print(json.dumps(exp.to_dict(), indent=2))
    else:
        print(exp.render_text())
    if args.png:
        try:
            render_png(exp, args.png)
        except ImportError:
            print("explain: --png needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
        except OSError as e:
            print(f"explain: cannot write {args.png}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"explain: timeline written to {args.png}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
