"""Orderings of requests. A policy is a sort key: lower keys are served first
and, among running requests, give way last."""

from __future__ import annotations

from typing import Protocol

from worker.request import Request


class SchedulingPolicy(Protocol):
    name: str

    def key(self, request: Request) -> tuple[int, ...]: ...


class FifoPolicy:
    """Admission order only; tiers are recorded but do not reorder anything."""

    name = "fifo"

    def key(self, request: Request) -> tuple[int, ...]:
        return (request.arrival_seq,)
