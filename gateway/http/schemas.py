"""Request bodies of the OpenAI-compatible endpoints (pydantic), with the vLLM extras.

Fields this server cannot honour are refused with a 400 naming them rather than silently
ignored (``n`` > 1, ``logprobs``, ``echo``, stop strings, penalties); fields it does not know
are ignored, as OpenAI-compatible servers do, so newer clients keep working. Types are strict,
as OpenAI's are: ``"max_tokens": true`` is not one token, nor ``"stream": 1`` a stream (an
integer is still a float).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from common.tiers import ALL_TIERS

Priority = Annotated[int, Field(ge=0, le=len(ALL_TIERS) - 1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or a list of text parts (image and audio parts are refused: this model reads text).
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _Sampling(BaseModel):
    """What both endpoints share: sampling, streaming, the tier and the vLLM extras."""

    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Field(ge=1, le=1)] = 1  # not Literal[1], which True matches
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    user: str | None = None
    # The tier as a number, 0 (P0) .. 3 (P3); the X-Priority header says the same and wins when both are given.
    priority: Priority | None = None
    # vLLM extras.
    top_k: Annotated[int, Field(ge=-1)] | None = None
    ignore_eos: bool = False
    # Accepted only at their neutral values (clients send them by default).
    presence_penalty: Literal[0, 0.0] | None = None
    frequency_penalty: Literal[0, 0.0] | None = None
    stop: None | Annotated[list[str], Field(max_length=0)] = None
    logprobs: Literal[False] | None = None

    def top_k_or_none(self) -> int | None:
        return None if self.top_k in (None, -1, 0) else self.top_k  # vLLM: -1 (and 0) mean "all tokens"

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    top_logprobs: Literal[0] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    # Text, or token ids; a batch of one is accepted in either form (a longer batch is refused: n=1 here).
    prompt: str | Annotated[list[StrictInt], Field(min_length=1)] | Annotated[list[str], Field(min_length=1, max_length=1)] \
        | Annotated[list[Annotated[list[StrictInt], Field(min_length=1)]], Field(min_length=1, max_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: Literal[False] = False
    suffix: None = None
    best_of: Literal[1] | None = None

    @model_validator(mode="after")
    def _unwrap(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            self.prompt = self.prompt[0]
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens
