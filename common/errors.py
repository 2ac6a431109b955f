"""Typed errors that callers of the engine, the gateway and the SDK can catch."""

from __future__ import annotations


class ServingError(Exception):
    """Base of every error this project raises on purpose."""


class InvalidRequest(ServingError, ValueError):
    """The request can never be served as given; nothing was stored or allocated."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        # The offending request field, so clients can point at it without parsing text.
        self.field = field


class DuplicateRequest(InvalidRequest):
    """A request with this id is already known to the engine."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in use", field="request_id")
        self.request_id = request_id
