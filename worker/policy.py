"""Orderings of requests. A policy is a sort key: lower keys are served first
and, among running requests, give way last."""

from __future__ import annotations

from typing import Protocol

from worker.request import Request


class SchedulingPolicy(Protocol):
    name: str
    preempts: bool  # whether a waiting request may preempt running ones for its tier

    def key(self, request: Request) -> tuple[int, ...]: ...


class FifoPolicy:
    """Admission order only; tiers are recorded but reorder nothing and preempt nothing."""

    name = "fifo"
    preempts = False

    def key(self, request: Request) -> tuple[int, ...]:
        return (request.arrival_seq,)


class PriorityPolicy:
    """Tier first; within a tier, requests already started (suspended) before new ones, then
    original admission order, which a preempted request keeps."""

    name = "priority"
    preempts = True

    def key(self, request: Request) -> tuple[int, ...]:
        return (request.tier.rank, 0 if request.started else 1, request.arrival_seq)


POLICIES = {"fifo": FifoPolicy, "priority": PriorityPolicy}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}") from None
