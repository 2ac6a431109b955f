"""The request fields OpenAI's or vLLM's API defines and this server cannot honour, each with its JSON type and the
value that asks for nothing (gateway/http/schemas.py says why they are refused, never ignored)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


class Kind(NamedTuple):
    """A field's JSON type as OpenAI's (or vLLM's) API defines it: a value of another type is refused as such, even
    one that looks like nothing (``"logit_bias": []``, ``"min_p": "0"``), as OpenAI and vLLM refuse it."""
    name: str
    check: Callable[[Any], bool]


def _of(*types: type) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, types) and not (isinstance(value, bool) and bool not in types)


NUMBER = Kind("a number", _of(int, float))
INTEGER = Kind("an integer", _of(int))
BOOLEAN = Kind("a boolean", _of(bool))
STRING = Kind("a string", _of(str))
OBJECT = Kind("an object", _of(dict))
ARRAY = Kind("an array", _of(list))
CHOICE = Kind("a string or an object", _of(str, dict))
ANY = Kind("anything", lambda value: True)  # for a field only null asks nothing of: any other value is refused


def json_kind(value: Any) -> str:
    """The JSON type of a parsed value, as a refusal names it."""
    if value is None:
        return "null"
    for types, name in ((bool, "a boolean"), (int, "an integer"), (float, "a number"), (str, "a string"),
                        (list, "an array"), (dict, "an object")):
        if isinstance(value, types):
            return name
    return type(value).__name__


def _equal(neutral: Any) -> Callable[[Any], bool]:
    return lambda value: value == neutral  # after the kind's check: 0 == 0.0 for a number, [] != {} anyway


def _never(value: Any) -> bool:
    return False


def _text_format(value: Any) -> bool:
    return value.get("type") == "text"


# name: (its kind, whether a value of that kind asks for nothing, that value as the refusal names it, or None where
# only null does). null always asks for nothing.
# Not here, for it cannot change the answer: spaces_between_special_tokens, which only a slow tokenizer's decoding
# reads (in vLLM too), where the gateway decodes with the fast one and skips special tokens (gateway/detokenize.py).
Unhonoured = dict[str, tuple[Kind, Callable[[Any], bool], str | None]]
NULL_ONLY = (ANY, _never, None)
SHARED: Unhonoured = {
    "logit_bias": (OBJECT, _equal({}), "{}"),
    "echo": (BOOLEAN, _equal(False), "false"),
    # vLLM's extra sampling parameters.
    "min_p": (NUMBER, _equal(0), "0"),
    "bad_words": (ARRAY, _equal([]), "[]"),
    "use_beam_search": (BOOLEAN, _equal(False), "false"),
    "skip_special_tokens": (BOOLEAN, _equal(True), "true"),
    "guided_json": NULL_ONLY,
    "guided_regex": NULL_ONLY,
    "guided_choice": NULL_ONLY,
    "guided_grammar": NULL_ONLY,
    "structured_outputs": NULL_ONLY,
    "response_format": (OBJECT, _text_format, '{"type": "text"}'),
    "allowed_token_ids": NULL_ONLY,  # vLLM refuses [] itself
    "logits_processors": (ARRAY, _equal([]), "[]"),
    "prompt_logprobs": NULL_ONLY,  # 0 still asks for the prompt's own tokens' log probabilities
    # Parameters of the server's custom extensions, which this server has none of.
    "vllm_xargs": (OBJECT, _equal({}), "{}"),
}
CHAT: Unhonoured = {
    **SHARED,
    "logprobs": (BOOLEAN, _equal(False), "false"),
    "top_logprobs": (INTEGER, _equal(0), "0"),
    "tools": (ARRAY, _equal([]), "[]"),
    "functions": (ARRAY, _equal([]), "[]"),
    "tool_choice": (CHOICE, lambda v: v in ("none", "auto"), '"none"'),
    "function_call": (CHOICE, lambda v: v in ("none", "auto"), '"none"'),
    "modalities": (ARRAY, _equal(["text"]), '["text"]'),
    "audio": NULL_ONLY,
    "add_generation_prompt": (BOOLEAN, _equal(True), "true"),
    "continue_final_message": (BOOLEAN, _equal(False), "false"),
    "chat_template": NULL_ONLY,
    "chat_template_kwargs": (OBJECT, _equal({}), "{}"),
    "add_special_tokens": (BOOLEAN, _equal(False), "false"),
    "documents": (ARRAY, _equal([]), "[]"),  # the chat template's RAG documents
    "structural_tag": NULL_ONLY,
}
COMPLETION: Unhonoured = {
    **SHARED,
    # An integer here, and every one asks for log probabilities (0: the chosen tokens'); false is no integer (vLLM
    # reads it as 0).
    "logprobs": (INTEGER, _never, None),
    "suffix": (STRING, _equal(""), '""'),
    "best_of": (INTEGER, _equal(1), "1"),
    "add_special_tokens": (BOOLEAN, _equal(True), "true"),
    "prompt_embeds": NULL_ONLY,
}
STREAM_OPTIONS: Unhonoured = {
    "continuous_usage_stats": (BOOLEAN, _equal(False), "false"),  # vLLM: usage in every chunk
}
MESSAGE: Unhonoured = {
    "tool_calls": (ARRAY, _equal([]), "[]"),
    "function_call": NULL_ONLY,
}


def first_unhonoured(fields: dict[str, Any] | None, table: Unhonoured, where: str = "") -> tuple[str, str] | None:
    """(param, message) for the first field of ``fields`` of the wrong type, or asking for what ``table`` says
    cannot be done."""
    for name, value in (fields or {}).items():
        if name not in table or value is None:
            continue
        kind, asks_nothing, shown = table[name]
        if not kind.check(value):
            return where + name, f"{where + name} must be {kind.name}, not {json_kind(value)}"
        if not asks_nothing(value):
            only = f"{shown} or null" if shown is not None else "null"
            return where + name, f"{where + name} is not supported by this server (only {only})"
    return None
