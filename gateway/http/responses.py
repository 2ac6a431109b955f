"""OpenAI response objects: whole completions, streamed chunks (SSE) and usage."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gateway.sdk import JobResult

DONE_EVENT = b"data: [DONE]\n\n"
# An SSE comment (a line that starts with a colon): every SSE client skips it, as the openai client does, yet a proxy
# between the door and the client sees bytes and does not cut the stream as idle.
KEEPALIVE = b": keep-alive\n\n"


@dataclass(frozen=True)
class Reply:
    """What every response of one request shares."""

    chat: bool  # chat.completion(.chunk) or text_completion
    id: str
    created: int
    model: str
    prompt_tokens: int

    @classmethod
    def for_job(cls, chat: bool, job_id: str, created: int, model: str, prompt_tokens: int) -> Reply:
        return cls(chat, ("chatcmpl-" if chat else "cmpl-") + job_id, created, model, prompt_tokens)

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens}

    def _object(self, chunk: bool) -> str:
        if not self.chat:
            return "text_completion"
        return "chat.completion.chunk" if chunk else "chat.completion"

    def _head(self, chunk: bool) -> dict:
        return {"id": self.id, "object": self._object(chunk), "created": self.created, "model": self.model}

    def whole(self, result: JobResult) -> dict:
        return self.answer(result.text, len(result.token_ids), finish_reason(result.finish_reason))

    def answer(self, text: str, completion_tokens: int, finish: str) -> dict:
        """A whole completion (OpenAI's ``finish``: ``stop`` or ``length``)."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return self._head(False) | {"choices": [choice], "usage": self.usage(completion_tokens)}

    def chunk(self, text: str | None, finish: str | None = None, *, role: bool = False,
              with_usage_field: bool = False) -> bytes:
        """One SSE event with one choice: ``text`` (None: no content, as in the last chunk of a chat)."""
        if self.chat:
            delta: dict = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        body = self._head(True) | {"choices": [choice]}
        if with_usage_field:
            body["usage"] = None  # OpenAI: every chunk carries the field when usage was asked for
        return event(body)

    def usage_chunk(self, completion_tokens: int) -> bytes:
        return event(self._head(True) | {"choices": [], "usage": self.usage(completion_tokens)})


def finish_reason(ours: str | None) -> str:
    """OpenAI's vocabulary: ``stop`` (EOS or a stop token) or ``length``."""
    return "length" if ours == "length" else "stop"


def event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


async def keepalives_until(task: asyncio.Future, interval_s: float) -> AsyncIterator[bytes]:
    """KEEPALIVE once every ``interval_s`` until ``task`` is done (0: none, only the wait). Sent between whole events
    (the stream's own generator yields them), a comment never falls inside one. ``task`` is left running when the
    caller stops early: the caller cancels it."""
    while not (await asyncio.wait({task}, timeout=interval_s or None))[0]:
        yield KEEPALIVE
