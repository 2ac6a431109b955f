"""The frames a client sends, built from a caller's arguments and checked here: a wrong type, a number no frame can
carry or a frame too large is this call's InvalidRequest naming the argument, before anything is sent."""

from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import secrets
from collections.abc import Sequence

from common import protocol as P
from common import tracing
from common.errors import InvalidRequest
from common.keys import KeyFileError
from common.sockets import public_key
from gateway.sdk._frames import check_frame_size


def endpoint_list(endpoint: str | Sequence[str]) -> list[str]:
    """One endpoint, or several gateways of one cluster to fail over between (in order of preference)."""
    endpoints = [endpoint] if isinstance(endpoint, str) else list(endpoint)
    if not endpoints or not all(isinstance(e, str) and e for e in endpoints):
        raise InvalidRequest("endpoint must be a non-empty string or a non-empty list of them", field="endpoint")
    return endpoints


def plain_int(value):
    """``value`` as a plain int if it is an integer of any kind (numpy's, as a caller's array hands them out:
    msgpack cannot even send one); else ``value`` itself, for the type check to refuse (a bool, a float)."""
    if isinstance(value, bool):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


def plain_float(value):
    """``value`` as a plain float if it is a real number of a type other than int and bool (numpy's float32, say);
    else ``value`` itself, for the type check to take (an int) or refuse."""
    if isinstance(value, (bool, int, float)) or not isinstance(value, numbers.Real):
        return value
    try:
        return float(value)
    except (OverflowError, ValueError):
        return value


def client_settings(api_key, timeout_s, retries) -> tuple[str, float, int]:
    """A client's key, timeout and retries, checked: a timeout of 0 (or NaN) made every call fail as a silent
    gateway, and a missing key failed each call with an untyped protocol error."""
    timeout_s, retries = plain_float(plain_int(timeout_s)), plain_int(retries)
    if not isinstance(api_key, str) or not api_key:
        raise InvalidRequest("api_key must be a non-empty string", field="api_key")
    if type(timeout_s) not in (int, float) or not math.isfinite(timeout_s) or timeout_s <= 0:
        raise InvalidRequest(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}", field="timeout_s")
    if type(retries) is not int or retries < 0:
        raise InvalidRequest(f"retries must be an integer >= 0, got {retries!r}", field="retries")
    return api_key, float(timeout_s), retries


def server_key(value) -> bytes | None:
    """The gateways' CURVE public key a client was given (z85 text or bytes, or the path of their .key file), read
    once, as the client is made: a bad one was found only when a call opened a socket (a KeyFileError, or a
    TypeError for a number), and a file moved later failed each new thread's first call."""
    if value is None:
        return None
    if not isinstance(value, (str, bytes)):
        raise InvalidRequest(f"server_public_key must be the gateways' z85 public key or the path of their .key "
                             f"file, got {type(value).__name__}", field="server_public_key")
    try:
        return public_key(value)
    except KeyFileError as e:
        raise InvalidRequest(f"server_public_key: {e}", field="server_public_key") from None


def wait_limit(timeout) -> float | None:
    """A caller's ``timeout`` (seconds, or None for no limit), checked: NaN compares false with every clock reading,
    so a deadline of NaN never came and the call waited as long as the job took."""
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                or math.isnan(timeout)):
        raise InvalidRequest(f"timeout must be a number of seconds or None, got {timeout!r}", field="timeout")
    return timeout


def new_request_id() -> str:
    return secrets.token_hex(8)


def auto_idempotency_key() -> str:
    """A key per submit() call, so the SDK's own retries of that call can never admit the job twice."""
    return "sdk-" + secrets.token_hex(16)


INT64 = (-(2**63), 2**63)  # what a frame carries (msgpack): a larger int could not even be sent


def _kind_of(field: str, value) -> str:
    """A wrong value's type, as a refusal names it; of a list, its first item the field refuses (the list itself
    was fine: 'list' said nothing of [5, 6.0])."""
    if (refused := P.refused_item(P.SubmitRequest, field, value)) is not None:
        i, wanted = refused
        return f"item {i} is {type(value[i]).__name__} ({repr(value[i])[:40]}), not {wanted}"
    return type(value).__name__


def submit_request(*args, **kwargs) -> P.SubmitRequest:
    """sized_submit_request's frame alone (for those who need no size)."""
    return sized_submit_request(*args, **kwargs)[0]


def sized_submit_request(api_key: str, prompt, prompt_token_ids, max_tokens, temperature, top_p, top_k, seed, tier,
                         idempotency_key, ignore_eos, max_tokens_defaulted: bool = False, *,
                         stop_token_ids=None, min_tokens: int = 0, presence_penalty: float = 0.0,
                         frequency_penalty: float = 0.0,
                         repetition_penalty: float = 1.0, retry_key: bool = False) -> tuple[P.SubmitRequest, int]:
    """The frame and its frame_bytes (measured once: a million-id prompt takes ~70 ms of CPU to encode, and the
    question to the gateway about its size encoded it again), once each argument has the type the gateway's decoder
    takes (P.mistyped): a wrong one is InvalidRequest naming it. Ranges are the gateway's to judge, but for what
    64-bit frame fields can carry."""
    if prompt_token_ids is not None and not isinstance(prompt_token_ids, (str, bytes)):
        ids = list(prompt_token_ids)
        # numpy's integers as well; a bool stays a bool, which the decoder refuses.
        prompt_token_ids = [plain_int(t) for t in ids]
    if stop_token_ids is not None and not isinstance(stop_token_ids, (str, bytes)):
        stop_token_ids = [plain_int(t) for t in stop_token_ids]
    elif stop_token_ids is None:
        stop_token_ids = []
    max_tokens, top_k, seed = plain_int(max_tokens), plain_int(top_k), plain_int(seed)
    min_tokens = plain_int(min_tokens)
    temperature, top_p = plain_float(temperature), plain_float(top_p)
    penalties = dict(presence_penalty=plain_float(presence_penalty), frequency_penalty=plain_float(frequency_penalty),
                     repetition_penalty=plain_float(repetition_penalty))
    fields = dict(api_key=api_key, max_tokens=max_tokens, prompt=prompt, prompt_token_ids=prompt_token_ids,
                  temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, tier=tier,
                  idempotency_key=idempotency_key, ignore_eos=ignore_eos, max_tokens_defaulted=max_tokens_defaulted,
                  stop_token_ids=stop_token_ids, min_tokens=min_tokens, retry_key=retry_key, **penalties)
    wrong = P.mistyped(P.SubmitRequest, fields)
    if wrong is not None:
        raise InvalidRequest(f"{wrong} has the wrong type: {_kind_of(wrong, fields[wrong])}", field=wrong)
    for name, value, least in (("max_tokens", max_tokens, INT64[0]), ("top_k", top_k, INT64[0]), ("seed", seed, 0),
                               ("min_tokens", min_tokens, INT64[0])):
        if value is not None and not least <= value < INT64[1]:
            raise InvalidRequest(f"{name} must be in [{least}, 2**63), got {value!r}", field=name)
    if prompt_token_ids and not INT64[0] <= min(prompt_token_ids) <= max(prompt_token_ids) < INT64[1]:
        raise InvalidRequest("prompt_token_ids must fit in 64 bits", field="prompt_token_ids")
    if stop_token_ids and not INT64[0] <= min(stop_token_ids) <= max(stop_token_ids) < INT64[1]:
        raise InvalidRequest("stop_token_ids must fit in 64 bits", field="stop_token_ids")
    if len(stop_token_ids) > P.MAX_STOP_TOKEN_IDS:  # the gateway's bound, said before a large list is sent
        raise InvalidRequest(f"at most {P.MAX_STOP_TOKEN_IDS} stop token ids, not {len(stop_token_ids)}",
                             field="stop_token_ids")
    if prompt_token_ids is not None and len(prompt_token_ids) > P.MAX_LIST_LEN:
        raise InvalidRequest(f"prompt_token_ids has {len(prompt_token_ids)} ids; a request carries at most "
                             f"{P.MAX_LIST_LEN}", field="prompt_token_ids")
    req = P.SubmitRequest(**fields | dict(temperature=float(temperature), top_p=float(top_p))
                          | {name: float(v) for name, v in penalties.items()},
                          trace_context=tracing.carrier())
    return req, check_frame_size(req, ("prompt", "prompt_token_ids", "idempotency_key"))


def job_request(cls, api_key: str, job_id, **fields):
    """A request (``cls``) about the job ``job_id``, checked as submit_request checks a submission: a job id that is
    not a string, or one too long for a frame (the gateway's ZeroMQ drops the connection that carries it, and every
    stream on it), is this call's InvalidRequest, not a TimeoutError after every retry."""
    if not isinstance(job_id, str):
        raise InvalidRequest(f"job_id must be a string, got {type(job_id).__name__}", field="job_id")
    msg = cls(api_key, job_id, **fields)
    check_frame_size(msg, ("job_id",))
    return msg


def cancel_requests(api_key: str, job_id, stop_at) -> list[P.CancelRequest]:
    """The cancel call's frames, most asked first (as info's: a gateway older than ``stop_at`` refuses the first,
    and the plain cancel goes next)."""
    plain = job_request(P.CancelRequest, api_key, job_id)
    if stop_at is None:
        return [plain]
    stop_at = plain_int(stop_at)
    if type(stop_at) is not int or not 1 <= stop_at < INT64[1]:
        raise InvalidRequest(f"stop_at must be an integer >= 1, got {stop_at!r}", field="stop_at")
    return [dataclasses.replace(plain, stop_at=stop_at), plain]


def withdraw_request(api_key: str, idempotency_key: str) -> P.CancelRequest:
    """The cancel of whatever was submitted under ``idempotency_key`` (CancelRequest.idempotency_key)."""
    return P.CancelRequest(api_key, "", idempotency_key=idempotency_key)


def with_request_id(msg, request_id: str):
    return dataclasses.replace(msg, request_id=request_id)
