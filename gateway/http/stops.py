"""Stop strings (OpenAI's ``stop``): the answer ends where the first of them begins in the generated text (where
it ends, with vLLM's ``include_stop_str_in_output``), and ``finish_reason`` is ``stop``.

The door finds them, not the worker: it decodes the job's tokens one at a time (gateway/detokenize.py, as the
gateway decodes them), so it knows which token completed a stop string, and ``usage.completion_tokens`` counts
the tokens up to and including that one, as vLLM counts them. A stream holds back the text that may be the start
of a stop string (at most the longest one's length less a character) until the next tokens say whether it is.
The job goes on generating until the door ends it there (the SDK's ``cancel(stop_at=...)``): it is stored done,
finish_reason ``stop``, with the tokens its answer holds (cancelled where its worker is older); what it made past
the stop is never sent.

A job's stop token ids end it on the worker; the door leaves that token's text out of the answer (it still counts
in ``completion_tokens``), as vLLM does. With vLLM's ``min_tokens``, a stop string ending in the text of the
first ``min_tokens - 1`` tokens does not count (the worker never draws a stop id nor EOS that early).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway.detokenize import IncrementalText
from gateway.http.responses import finish_reason

MAX_STOPS = 4  # OpenAI's bound
MAX_STOP_CHARS = 1000


def scan_for(body, tokenizer) -> StopScan | None:
    """The scan a request's answer needs: it has stop strings, or stop token ids (whose text is cut); else None."""
    strings = stop_strings(body.stop)
    if not strings and not body.stop_token_ids:
        return None
    return StopScan(strings, tokenizer, body.include_stop_str_in_output, body.min_tokens, body.stop_token_ids or ())


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """The request's stop strings (none for null or [])."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


class StopScan:
    """The text of one job's tokens, fed as they come, cut at the first stop string."""

    def __init__(self, stops: Sequence[str], tokenizer, include: bool = False, min_tokens: int = 0,
                 stop_token_ids: Sequence[int] = ()) -> None:
        self._stops = tuple(stops)
        self._include = include  # vLLM's include_stop_str_in_output: the answer ends where the stop string does
        # vLLM's min_tokens: a stop string counts only once it ends in the text of this many tokens or later.
        self._min_tokens = min_tokens
        # The job's stop token ids: the worker ends the job at one, and (as in vLLM) its text is not the answer's
        # unless include_stop_str_in_output.
        self._end_ids = frozenset(stop_token_ids)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._decoded = IncrementalText(tokenizer)
        # Text not yet released: at most the hold and one token's piece, since a stop string completed by the next
        # token begins in it or after it. Each token's search thus reads a bounded string, however many tokens a
        # chunk brings (a retry's replay brings all of a finished job's at once): linear time.
        self._pending = ""
        self._released: list[str] = []
        self.tokens = 0  # tokens fed, up to the one that completed a stop string
        self.stopped = False

    def feed(self, token_ids: Sequence[int]) -> str:
        """The text that may be sent now: never a stop string nor anything after one, nor (while none is found)
        text that may begin one."""
        out = []
        for token in token_ids:
            if self.stopped:
                break
            self.tokens += 1
            self._decoded.extend([token])
            # A stop id drawn (never before min_tokens) is the job's last token.
            ends = token in self._end_ids and self.tokens >= self._min_tokens and not self._include
            piece = "" if ends else self._decoded.pieces[-1]
            if not piece:
                continue  # the middle of a character: no text yet
            pending = self._pending + piece
            # Only a stop string that ends in this token's piece: one that ended earlier was found then (or came
            # before min_tokens, and does not count).
            fresh = len(pending) - len(piece)
            found = [] if self.tokens < self._min_tokens else [
                (at, i) for i, s in enumerate(self._stops) if (at := pending.find(s, max(0, fresh - len(s) + 1))) >= 0]
            if found:  # the first to begin; of two beginning there, the first listed
                at, i = min(found)
                pending, self.stopped = pending[:at + (len(self._stops[i]) if self._include else 0)], True
            keep = 0 if self.stopped else min(self._hold, len(pending))
            out.append(pending[:len(pending) - keep])
            self._pending = pending[len(pending) - keep:]
        text = "".join(out)
        self._released.append(text)
        return text

    def flush(self) -> str:
        """The rest of the text, once the job has ended without a stop string."""
        return self._release(len(self._pending))

    @property
    def text(self) -> str:
        """Everything released."""
        return "".join(self._released)

    def _release(self, n: int) -> str:
        out, self._pending = self._pending[:n], self._pending[n:]
        self._released.append(out)
        return out


async def until_stop(job, stop: StopScan, cancel: Callable[..., None]) -> tuple[str, int, str]:
    """A whole answer with stop strings: (text, completion tokens, finish reason). Read as a stream, so that the
    job ends (``cancel(stop_at=...)``) as soon as a stop string ends its answer, not after its last token."""
    chunks = job.stream()
    try:
        async for chunk in chunks:
            stop.feed(chunk.token_ids)
            if stop.stopped:
                cancel(stop_at=stop.tokens)
                return stop.text, stop.tokens, "stop"
    finally:
        await chunks.aclose()
    result = await job.result()  # raises if the job expired or failed, as without stop strings
    stop.flush()
    return stop.text, stop.tokens, finish_reason(result.finish_reason)
