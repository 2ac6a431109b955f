"""Explain a request from its spans: parse them (otlp_json), pick the request's (select), analyse
(analysis, with wait_causes and preemption_causes) into an Explanation (model), using the span schema (schema)."""

from common.traces.analysis import explain_request
from common.traces.model import Explanation, NoSchedulingSpans

__all__ = ["Explanation", "NoSchedulingSpans", "explain_request"]
