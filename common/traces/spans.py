"""The span record every part of explain works on: what a tracing backend says about one span."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SpanLink:
    trace_id: str
    span_id: str
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SpanEvent:
    name: str
    time_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[SpanEvent] = field(default_factory=list)
    links: list[SpanLink] = field(default_factory=list)
    service: str | None = None
    kind: int | str | None = None
    status_code: int | str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.trace_id, self.span_id)

    @property
    def duration_ns(self) -> int:
        return max(0, self.end_ns - self.start_ns)

    @property
    def duration_s(self) -> float:
        return self.duration_ns / 1e9

    def get(self, name: str, default: Any = None) -> Any:
        value = self.attributes.get(name, default)
        return default if value is None else value


@dataclass
class SpanSet:
    spans: list[Span]
    warnings: list[str] = field(default_factory=list)


def dedupe(spans: Iterable[Span]) -> list[Span]:
    seen: dict[tuple[str, str], Span] = {}
    for s in spans:
        seen.setdefault(s.key, s)
    return list(seen.values())

