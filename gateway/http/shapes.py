"""The shapes a completion's prompt and a chat message's content may take, checked before pydantic's union of
them: its words for a union name one member only ("Input should be a valid string", said of an array of token ids,
of a batch of two prompts and of an image part alike), so a client could not tell what it sent wrong."""

from __future__ import annotations

from typing import Any

from pydantic_core import PydanticCustomError

from gateway.http.unhonoured import json_kind


def _refused(kind: str, message: str) -> PydanticCustomError:
    # The message is a template to pydantic: the words below hold no braces.
    return PydanticCustomError(kind, message)


def _not_ids(values: list) -> str | None:
    """The JSON kind of the first value that is not a token id (an integer; a boolean is none), or None."""
    return next((json_kind(v) for v in values if type(v) is not int), None)


def completion_prompt(prompt: Any) -> Any:
    """A string, an array of token ids, or a batch of one of either: as sent; else the refusal that says why."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list):
        raise _refused("prompt_type", f"must be a string or an array of token ids, not {json_kind(prompt)}")
    if not prompt:
        raise _refused("prompt_empty", "must not be empty")
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        if len(prompt) > 1:
            raise _refused("prompt_batch", f"a batch of {len(prompt)} prompts: this server takes one prompt per "
                           "request (n=1); send each as a request of its own")
        inner = prompt[0]
        if isinstance(inner, list):
            if not inner:
                raise _refused("prompt_empty", "must not be empty")
            if (odd := _not_ids(inner)) is not None:
                raise _refused("prompt_type", "must be a string, an array of token ids (integers) or a batch of one "
                               f"of either, not a batch holding an array holding {odd}")
        return prompt
    if (odd := _not_ids(prompt)) is not None:
        raise _refused("prompt_type", "must be a string, an array of token ids (integers) or a batch of one of "
                       f"either, not an array holding {odd}")
    return prompt


def message_content(content: Any) -> Any:
    """A string or an array of text parts (or null, which the request refuses later with a better reason): as
    sent; else the refusal that says why (an image or audio part: this model reads text)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refused("content_type", f"must be a string or an array of text parts, not {json_kind(content)}")
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise _refused("content_part", f"part {i} is {json_kind(part)}: each part must be an object with "
                           "\"type\": \"text\" and its \"text\"")
        kind = part.get("type")
        if kind is None:
            raise _refused("content_part", f"part {i} has no type: each part must be an object with \"type\": "
                           "\"text\" and its \"text\"")
        if kind != "text":
            shown = repr(kind) if isinstance(kind, str) else json_kind(kind)
            raise _refused("content_part", f"part {i} is of type {shown}: this model reads text only (parts of "
                           "type 'text')")
        if not isinstance(part.get("text"), str):
            raise _refused("content_part", f"part {i}: a text part's text must be a string, not "
                           f"{json_kind(part.get('text'))}")
    return content
