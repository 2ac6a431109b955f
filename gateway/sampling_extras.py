"""vLLM's sampling extras on a submission: stop token ids, min_tokens and the three penalties.

They travel only when asked for (not at their defaults: common.client_messages.SAMPLING_EXTRAS), in the job's
payload, its idempotency fingerprint and its DispatchJob, so that every other job is stored, fingerprinted and sent
as before, and an older worker reads its frames.
"""

from __future__ import annotations

import math
from typing import Any

from common.client_messages import MAX_PENALTY, MAX_STOP_TOKEN_IDS, SAMPLING_EXTRAS
from common.errors import InvalidRequest
from common.protocol import SubmitRequest


def asked(req: SubmitRequest) -> dict[str, Any]:
    """The extras ``req`` asks for, by name (none at its default; 0 and 0.0 alike)."""
    return {name: getattr(req, name) for name, default in SAMPLING_EXTRAS.items() if getattr(req, name) != default}


def check(req: SubmitRequest) -> None:
    """InvalidRequest naming the first extra out of its range (the vocabulary is the workers' to judge)."""
    ids = req.stop_token_ids
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, not {len(ids)}", field="stop_token_ids")
    if any(t < 0 for t in ids):
        raise InvalidRequest("stop token ids must be integers >= 0", field="stop_token_ids")
    if not 0 <= req.min_tokens <= req.max_tokens:
        raise InvalidRequest(f"min_tokens must be in 0..max_tokens ({req.max_tokens})", field="min_tokens")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise InvalidRequest(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}", field=name)
    if not (math.isfinite(req.repetition_penalty) and 0 < req.repetition_penalty <= MAX_PENALTY):
        raise InvalidRequest(f"repetition_penalty must be in (0, {MAX_PENALTY:g}], got {req.repetition_penalty!r}",
                             field="repetition_penalty")
