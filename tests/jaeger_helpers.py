"""A Jaeger api_v3 stand-in for tests: a real HTTP server on a free port whose answers come from a function
(jaeger_from_file: FindTraces and GetTrace over an OTLP-JSON spans file)."""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def resource_spans_of(path: Path) -> list[dict]:
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            out.extend(json.loads(line)["resourceSpans"])
    return out


def only_traces(rss: list[dict], trace_ids: set[str]) -> list[dict]:
    out = []
    for rs in rss:
        scopes = []
        for ss in rs.get("scopeSpans", []):
            kept = [s for s in ss.get("spans", []) if s["traceId"].lower() in trace_ids]
            if kept:
                scopes.append({**ss, "spans": kept})
        if scopes:
            out.append({**rs, "scopeSpans": scopes})
    return out


def _service(rs: dict) -> str | None:
    for kv in rs.get("resource", {}).get("attributes", []):
        if kv["key"] == "service.name":
            return kv["value"].get("stringValue")
    return None


def _attrs(span: dict) -> dict:
    return {kv["key"]: next(iter(kv["value"].values())) for kv in span.get("attributes", [])}


def not_found(message: str) -> tuple[int, dict]:
    return 404, {"error": {"httpCode": 404, "message": message}}


def jaeger_from_file(path: Path):
    """api_v3 answers built from a spans file: FindTraces by service + attributes, GetTrace by id."""
    rss = resource_spans_of(path)

    def app(route: str, query: dict[str, str]):
        if route == "/api/v3/traces":
            wanted = json.loads(query["query.attributes"])
            ids = {s["traceId"].lower() for rs in rss if _service(rs) == query["query.service_name"]
                   for ss in rs["scopeSpans"] for s in ss["spans"]
                   if all(str(_attrs(s).get(k)) == v for k, v in wanted.items())}
            return (200, {"result": {"resourceSpans": only_traces(rss, ids)}}) if ids else not_found("No traces found")
        if route.startswith("/api/v3/traces/"):
            kept = only_traces(rss, {route.rsplit("/", 1)[1].lower()})
            return (200, {"result": {"resourceSpans": kept}}) if kept else not_found("trace not found")
        return not_found("no such route")
    return app


class FakeJaeger:
    def __init__(self, app) -> None:
        self.app = app
        self.calls: list[tuple[str, dict[str, str]]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                parts = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(parts.query))
                outer.calls.append((parts.path, query))
                status, body = outer.app(parts.path, query)
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (the timeout case)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.server.block_on_close = False
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                                       daemon=True)

    def __enter__(self) -> FakeJaeger:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def get_trace_ids(self) -> list[str]:
        return [p.rsplit("/", 1)[1] for p, _ in self.calls if p.startswith("/api/v3/traces/")]
