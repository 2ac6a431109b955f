"""From an OpenAI request to prompt token ids, with the model's own tokenizer.

The front door tokenizes (the gateway then only checks the ids), because it must count the
prompt's tokens for ``usage`` and render chat messages, and both need the tokenizer the model
was trained with. Chat messages use the tokenizer's chat template when it has one. When it
has none, the documented plain format below is used (one line per message, then the
assistant's turn, a message's ``name`` in brackets after its role), tokenized as plain text:

    system: You are terse.
    user (ann): Hello!
    assistant:

A message of text parts is their texts joined by newlines, as vLLM joins them.

Text is encoded exactly as the gateway encodes a text prompt (``tokenizer(text).input_ids``),
so the same text gives the same ids on either path.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from common import tokenizer_digest
from gateway.http import errors
from gateway.http.errors import HttpError
from gateway.http.schemas import Message

log = logging.getLogger("gateway.http")

PLAIN_ROLE_SEPARATOR = ": "
PLAIN_ASSISTANT_TURN = "assistant:"


def plain_chat_text(messages: Sequence[Message]) -> str:
    lines = [f"{m.role}{f' ({m.name})' if m.name else ''}{PLAIN_ROLE_SEPARATOR}{m.text()}" for m in messages]
    return "\n".join(lines + [PLAIN_ASSISTANT_TURN])


def template_message(m: Message) -> dict[str, str]:
    """A message as a chat template reads it: its ``name`` too where it has one, as vLLM passes it (templates that
    name participants show it; the others ignore it)."""
    return {"role": m.role, "content": m.text()} | ({"name": m.name} if m.name else {})


class Prompts:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        # What the gateways' tokenizer must be (checked per request in app.py, and by /health).
        self.digest = tokenizer_digest.digest(tokenizer)
        self._told: set[str] = set()

    def mismatch(self, cluster_digest: str | None) -> HttpError | None:
        """The error to answer with while the cluster's tokenizer (its digest, as a gateway says it) is not this
        door's: every prompt would be ids another model's tokenizer made, run to completion and returned as
        nonsense. None when they agree, or while no gateway knows the cluster's."""
        if cluster_digest is None or cluster_digest == self.digest:
            return None
        message = (f"this server's tokenizer differs from the cluster's ({self.digest[:19]} vs {cluster_digest[:19]}):"
                   " its operator must give the front door (--tokenizer) the model directory the workers serve")
        if cluster_digest not in self._told:
            self._told.add(cluster_digest)  # once per digest a gateway says: a log line per request would flood
            log.error("%s", message)
        return HttpError(503, "server_error", message, code="tokenizer_mismatch")

    @classmethod
    def load(cls, name_or_path: str) -> Prompts:
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(name_or_path))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text).input_ids)

    def chat(self, messages: Sequence[Message], template_kwargs: dict | None = None) -> list[int]:
        """``template_kwargs``: variables the template gets beside the messages (reasoning_effort: schemas.py)."""
        if not self.has_chat_template:
            return self.encode(plain_chat_text(messages))
        # Rendered to text first: the template already holds the special tokens (BOS, role markers), so the
        # text is encoded without adding them again.
        try:
            text = self.tokenizer.apply_chat_template([template_message(m) for m in messages],
                                                      tokenize=False, add_generation_prompt=True,
                                                      **(template_kwargs or {}))
        except Exception as e:
            if _refused_by_template(e):
                # The template judged the conversation (Llama-2/Mistral templates refuse roles that do not
                # alternate, or a role they lack): the client's input, which was a plain-text 500.
                raise errors.invalid(f"the model's chat template refused these messages: {e}", "messages") from None
            # The template itself (its syntax, an include it lacks, a filter applied to the wrong type): every chat
            # request fails alike until it is mended. A server fault, in OpenAI's shape (it was a plain-text 500 that
            # no client could read), naming the template for the operator's sake.
            log.error("the model's chat template cannot be used: %s", e)
            raise HttpError(500, "server_error", f"the model's chat template cannot be used: {type(e).__name__}: {e}",
                            code="chat_template_error") from None
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)


def _refused_by_template(e: Exception) -> bool:
    """An error the template raised while rendering (its raise_exception, an undefined field of a message), not
    one in the template itself (a syntax error fails every request alike: the server's fault, not the client's)."""
    import jinja2  # there is a template, so transformers has rendered it with jinja2

    return isinstance(e, jinja2.TemplateError) and not isinstance(e, (jinja2.TemplateSyntaxError,
                                                                      jinja2.TemplateNotFound))


def model_name(tokenizer: str, served_model_name: str) -> str:
    return served_model_name or Path(tokenizer.rstrip("/")).name or tokenizer
