"""Request bodies of the OpenAI-compatible endpoints (pydantic), with the vLLM extras.

Fields that OpenAI's or vLLM's API defines and this server cannot honour (``logit_bias``, tools,
``response_format``, stop token ids, penalties, logprobs, guided decoding, ...) are refused with a
400 naming them, never ignored: an ignored one makes the answer silently not the one asked for.
Each is accepted at the value that asks for nothing, since clients send some by default (an
empty list, a zero penalty, ``null``). Fields nobody defines are ignored, as OpenAI-compatible
servers do, so newer clients keep working. ``null`` is the field's default, as in OpenAI's API.
Types are strict, as OpenAI's are: ``"max_tokens": true`` is not one token, nor ``"stream": 1``
a stream (an integer is still a float); so are the refused fields' (``"logit_bias": []`` is no object,
``"min_p": "0"`` no number).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictInt, field_validator, model_validator
from pydantic_core import PydanticCustomError

from common.tiers import ALL_TIERS
from gateway.http import shapes, stops
from gateway.http.unhonoured import (CHAT, COMPLETION, MESSAGE, SHARED, STREAM_OPTIONS, Unhonoured, first_unhonoured,
                                     json_kind)

# The max_tokens of a /v1/completions body that leaves the field out (OpenAI's, and vLLM's, default).
OPENAI_COMPLETION_MAX_TOKENS = 16

Priority = Annotated[int, Field(ge=0, le=len(ALL_TIERS) - 1)]


class _Body(BaseModel):
    # Unknown fields are kept (model_extra), to be checked against the unhonoured ones; null is the default.
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    # Whether it held anything as sent, a null included (which _null_is_the_default drops before the fields are
    # read): vLLM refuses such options without a stream, and {"include_usage": null} was served.
    _given: bool = PrivateAttr(default=False)

    @model_validator(mode="wrap")
    @classmethod
    def _note_given(cls, data: Any, handler: Callable[[Any], StreamOptions]) -> StreamOptions:
        options = handler(data)  # a wrap validator defined here sees the body before _Body's before-validator
        options._given = bool(data)
        return options


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or a list of text parts (image and audio parts are refused: this model reads text). Required
    # (ChatCompletionRequest.unhonoured, after any tool call the message carries, which is the better reason):
    # a message without content has nothing this server can put in a prompt.
    content: str | list[TextPart] | None = None
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shaped(cls, content: Any) -> Any:
        return shapes.message_content(content)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)  # as vLLM joins a message's text parts


class _Sampling(_Body):
    """What both endpoints share: sampling, streaming, the tier and the vLLM extras."""

    UNHONOURED: ClassVar[Unhonoured] = SHARED
    model: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    n: Annotated[int, Field(ge=1, le=1)] = 1  # not Literal[1], which True matches
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Any 64-bit integer, as vLLM takes (OpenAI: any integer); worker_seed is what the worker gets.
    seed: int | None = None
    user: str | None = None
    # The tier as a number, 0 (P0) .. 3 (P3); the X-Priority header says the same and wins when both are given.
    priority: Priority | None = None
    # vLLM extras.
    top_k: Annotated[int, Field(ge=-1)] | None = None
    ignore_eos: bool = False
    # The prompt's last so many tokens are served (after the chat template), as in vLLM.
    truncate_prompt_tokens: Annotated[int, Field(ge=1)] | None = None
    # Stop strings (gateway/http/stops.py): a string or up to MAX_STOPS of them.
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False  # vLLM's: the answer ends where the stop string does, not begins
    # vLLM's: ids that end the answer as EOS does, and the fewest tokens before any of them, EOS or a stop string
    # may end it. Bounds and the vocabulary are the gateway's to judge (400 naming the field).
    stop_token_ids: list[StrictInt] | None = None
    min_tokens: StrictInt = 0
    # OpenAI's penalties and vLLM's repetition_penalty; their ranges too are the gateway's to judge.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_typed(cls, stop: Any) -> Any:
        # pydantic's words for a union ("Input should be a valid string") name one member only.
        if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                                and all(isinstance(s, str) for s in stop))):
            shown = json_kind(stop) if not isinstance(stop, list) else "an array holding " + next(
                json_kind(s) for s in stop if not isinstance(s, str))
            raise PydanticCustomError("stop_type", f"must be a string or an array of strings, not {shown}")
        return stop

    @field_validator("stop")
    @classmethod
    def _stops_bounded(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = stops.stop_strings(stop)
        if len(strings) > stops.MAX_STOPS:
            raise PydanticCustomError("stop_count", f"at most {stops.MAX_STOPS} stop strings, not {len(strings)}")
        if any(not 0 < len(s) <= stops.MAX_STOP_CHARS for s in strings):
            raise PydanticCustomError("stop_length", f"each stop string must be 1 to {stops.MAX_STOP_CHARS} "
                                      "characters long")
        return stop

    @field_validator("seed")
    @classmethod
    def _seed_in_64_bits(cls, seed: int | None) -> int | None:
        if seed is not None and not -2**63 <= seed < 2**63:
            raise PydanticCustomError("seed_range", f"must be a 64-bit integer, in [{-2**63}, {2**63 - 1}]")
        return seed

    def worker_seed(self) -> int | None:
        """The seed the worker samples with: the client's mod 2**63, the worker's range (its generator takes 63
        bits, worker/sampler.py). A non-negative seed is itself, so the door and the SDK answer a seed alike; a
        negative one is seed + 2**63 (-1 is 2**63 - 1), the one collision a 64-bit seed in 63 bits must have."""
        return None if self.seed is None else self.seed % 2**63

    def top_k_or_none(self) -> int | None:
        return None if self.top_k in (None, -1, 0) else self.top_k  # vLLM: -1 (and 0) mean "all tokens"

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def unhonoured(self) -> tuple[str, str] | None:
        """(param, message) for the first field asking for what this server cannot do; None: none does."""
        # Options of a stream that is not one (as OpenAI and vLLM refuse them): ignored, the client that asked for
        # the usage chunk got a whole answer and no word that its option did nothing. {} asks for nothing.
        if not self.stream and self.stream_options is not None and self.stream_options._given:
            return "stream_options", "stream_options is only allowed when stream is true"
        if self.stream_options is not None and (
                found := first_unhonoured(self.stream_options.model_extra, STREAM_OPTIONS, "stream_options.")):
            return found
        return first_unhonoured(self.model_extra, self.UNHONOURED)


class ChatCompletionRequest(_Sampling):
    UNHONOURED: ClassVar[Unhonoured] = CHAT
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    # Handed to the chat template, as vLLM hands it (with enable_thinking, false for "none"): a template that reads
    # it (gpt-oss's, Qwen3's enable_thinking) renders the effort asked for; one that does not is the same prompt,
    # as in vLLM. The plain format (a tokenizer without a template) has no reasoning mode to set.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template gets beside the messages."""
        if self.reasoning_effort is None:
            return {}
        return {"reasoning_effort": self.reasoning_effort, "enable_thinking": self.reasoning_effort != "none"}

    def requested_max_tokens(self) -> int | None:
        """What the client asked for; None: the door sizes it (gateway/http/sizing.py)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_param(self) -> str:
        """The name the client gave the limit, for an error about it (OpenAI's newer name wins, as in vLLM)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def default_max_tokens(self, door_default: int) -> int:
        return door_default

    def unhonoured(self) -> tuple[str, str] | None:
        for i, m in enumerate(self.messages):
            if found := first_unhonoured(m.model_extra, MESSAGE, f"messages.{i}."):
                return found
            if m.content is None:
                return f"messages.{i}.content", f"messages.{i}.content is required (a string or text parts)"
        return super().unhonoured()


class CompletionRequest(_Sampling):
    UNHONOURED: ClassVar[Unhonoured] = COMPLETION
    # Text, or token ids; a batch of one is accepted in either form (a longer batch is refused: n=1 here).
    prompt: (str | Annotated[list[StrictInt], Field(min_length=1)]
             | Annotated[list[str], Field(min_length=1, max_length=1)]
             | Annotated[list[Annotated[list[StrictInt], Field(min_length=1)]], Field(min_length=1, max_length=1)])
    # Absent (or null): OpenAI's 16, at most the room the prompt leaves (gateway/http/sizing.py, max_tokens_for).
    max_tokens: Annotated[int, Field(ge=1)] | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shaped(cls, prompt: Any) -> Any:
        return shapes.completion_prompt(prompt)

    @model_validator(mode="after")
    def _unwrap(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], (str, list)):
            self.prompt = self.prompt[0]
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def max_tokens_param(self) -> str:
        return "max_tokens"

    def default_max_tokens(self, door_default: int) -> int:
        return OPENAI_COMPLETION_MAX_TOKENS
