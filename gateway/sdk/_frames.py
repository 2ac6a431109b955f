"""Frame sizes: what a request takes in a frame, and what each gateway said of the sizes it takes (a gateway may
take less than the protocol allows, and drops the connection that brings more)."""

from __future__ import annotations

from common import protocol as P
from common.errors import InvalidRequest, ServingError
from gateway.sdk._results import refused_as_unknown

# What a request id adds to a frame, at most: the key, the string and their headers.
_REQUEST_ID_BYTES = len("request_id") + P.MAX_REQUEST_ID_LEN + 8


def frame_bytes(msg) -> int:
    """The most bytes ``msg`` takes in a frame, whatever request id it is sent with."""
    return len(P.encode(msg)) + _REQUEST_ID_BYTES


def _largest(msg, fields: tuple[str, ...]) -> str:
    return max(fields, key=lambda f: len(getattr(msg, f) or ""))


def check_frame_size(msg, fields: tuple[str, ...]) -> int:
    """``msg``'s frame_bytes; InvalidRequest naming the largest of ``fields`` if ``msg`` would not fit in one
    frame. A gateway cannot read such a frame far enough to find its request id (over the size limit ZeroMQ even
    drops the connection), so its refusal could reach no caller: better refused here, where it is this call's alone.
    """
    size = frame_bytes(msg)
    if size > P.MAX_MESSAGE_BYTES:
        raise InvalidRequest(f"the request is {size} bytes; a frame carries at most {P.MAX_MESSAGE_BYTES} "
                             f"(its {_largest(msg, fields)} is the largest part)", field=_largest(msg, fields))
    return size


# A gateway may take smaller frames than the protocol's (its client_max_message_bytes), and drops the connection
# that brings a larger one, with every stream on it (each must resubscribe). A frame over UNASKED_BYTES is announced
# first (InfoRequest.frame_bytes), once per size a gateway has not yet taken. The first question to a gateway is about
# ASK_OVER_BYTES at least, so one that takes that many is asked about nothing smaller; one that does not is asked
# about each larger size it has not taken (a limit below 16 KiB dropped the connection for frames under it, unasked).
# Frames of UNASKED_BYTES or less go unasked: a gateway that takes no more than that serves almost no prompt, and
# asking about every first frame would cost every client a round trip.
ASK_OVER_BYTES = 16 * 2**10
UNASKED_BYTES = 2**10
_PARTS = {P.SubmitRequest: ("prompt", "prompt_token_ids", "idempotency_key"), P.StatusRequest: ("job_id",),
          P.CancelRequest: ("job_id",)}


class FrameSizes:
    """What each gateway said of the frame sizes it takes: the largest it took, the smallest it refused."""

    def __init__(self) -> None:
        self.taken: dict[str, int] = {}
        self.refused: dict[str, int] = {}

    def forget(self, endpoint: str) -> None:
        """What the gateway at ``endpoint`` said holds no longer: its connection dropped, and the gateway that
        answers there now may be another (restarted with another client_max_message_bytes)."""
        self.taken.pop(endpoint, None)
        self.refused.pop(endpoint, None)

    @staticmethod
    def concerns(msg) -> bool:
        """Is ``msg`` of a kind asked about (those that carry a caller's arbitrary prompt or job id)?"""
        return type(msg) in _PARTS

    def question(self, endpoint: str, msg, size: int) -> P.InfoRequest | None:
        """The question to ask the gateway at ``endpoint`` before sending it ``msg`` (of frame_bytes ``size``), or
        None if ``msg`` needs none."""
        if type(msg) not in _PARTS or size <= max(UNASKED_BYTES, self.taken.get(endpoint, 0)):
            return None
        ask = max(size, ASK_OVER_BYTES)
        return P.InfoRequest(msg.api_key, frame_bytes=ask if ask < self.refused.get(endpoint, ask + 1) else size)

    def answered(self, endpoint: str, msg, size: int, ask: P.InfoRequest, e: ServingError | None) -> None:
        """Note the gateway's answer ``e`` (None: it takes ``ask``'s size), and raise what the caller gets: too big
        there (InvalidRequest naming the request's largest part), or ``e`` itself; nothing where the gateway is
        older than the question (the frame is then sent as before) or refused only a question larger than
        ``msg`` (the next is about ``size`` itself)."""
        if e is None or refused_as_unknown(e):
            self.taken[endpoint] = max(ask.frame_bytes, self.taken.get(endpoint, 0))
            return
        if not (isinstance(e, InvalidRequest) and e.field == "frame_bytes"):
            raise e
        self.refused[endpoint] = min(ask.frame_bytes, self.refused.get(endpoint, ask.frame_bytes))
        if ask.frame_bytes > size:
            return
        part = _largest(msg, _PARTS[type(msg)])
        raise InvalidRequest(f"the request is {size} bytes, too large for gateway {endpoint} (its {part} is the "
                             f"largest part): {e}", field=part) from None
