"""max_tokens for a request that sets none: the room its prompt leaves, sized by the gateway's limits."""

from __future__ import annotations

from common.tiers import parse_tier
from gateway.http import errors

# How long the door sizes defaulted max_tokens by a gateway's limits before asking again; limits that moved
# meanwhile cost a refused submission and one retry (gateway/http/submission.py, Submitter.submit).
LIMITS_MAX_AGE_S = 5.0


def max_tokens_for(cap: int, prompt_len: int, tier: str | None, limits: dict[str, int] | None,
                   max_tokens_limit: int | None, prompt_param: str) -> int:
    """max_tokens for a request that sets none: the room its prompt leaves in the largest prompt + max_tokens
    its tier admits (``limits``, from the gateway's info), at most ``cap`` (the door's default_max_tokens, or
    OpenAI's 16 for a completion without the field: the room alone would reserve, and count in every wait
    estimate, the whole context for each such request) and the gateway's max_tokens_limit. So such a request is
    refused only for its prompt, never for a max_tokens the client did not send. ``limits`` None (an older
    gateway): ``cap``, as before."""
    if limits is None:
        return cap
    # No tier asked: the gateway takes the tenant's highest, which it says by saying only the tenant's tiers.
    tier = tier or min(limits, key=lambda t: parse_tier(t).rank, default=None)
    if tier not in limits:  # a tier the tenant may not use: the gateway answers 403, whatever the max_tokens
        return cap
    room = limits[tier] - prompt_len
    if room < 1:
        raise errors.invalid(f"the prompt ({prompt_len} tokens) leaves no room for a completion: a {tier} request "
                             f"holds at most {limits[tier]} tokens, prompt and completion together", prompt_param)
    return min(cap, room, max_tokens_limit or cap)
