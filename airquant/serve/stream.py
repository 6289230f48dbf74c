"""Server-Sent Events for ``"stream": true``: OpenAI chunk objects from ``Provider.stream`` events.

``Provider.stream(prompt, **settings)`` yields ``StreamEvent``s (``text`` is the UTF-8-safe delta since
the previous event, ``finish_reason`` and ``usage`` arrive on the last one); closing it early frees the
sequence's slot. Here each event becomes one ``data: {...}`` line and the stream ends with
``data: [DONE]``. Stop strings are the engine's detokenizer's (``engine/decode/text.py``): it holds back
text that could be the start of one and cuts the text at it, so the events' text and ``finish_reason``
are sent as they are.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Literal

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class ChunkFormat:
    """OpenAI's chunk objects for one streamed response (chat or plain completion)."""

    kind: Literal["chat", "completion"]
    model: str
    include_usage: bool = False
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))

    def _base(self, choices: list) -> dict:
        chat = self.kind == "chat"
        body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{self.id}",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = None  # OpenAI: null on every chunk but the extra last one
        return body

    def start(self) -> dict | None:
        """Chat streams open with the assistant's role and empty content."""
        if self.kind != "chat":
            return None
        return self._base([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}])

    def delta(self, text: str, finish_reason: str | None = None) -> dict:
        if self.kind == "chat":
            choice = {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._base([choice])

    def usage(self, usage: dict) -> dict:
        body = self._base([])
        body["usage"] = {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
        return body


async def sse_lines(first, events: AsyncIterator, fmt: ChunkFormat,
                    prompt_tokens: Callable[[], int]) -> AsyncIterator[str]:
    """SSE text for ``first`` (None: the provider yielded nothing) and the rest of ``events``; always
    closes ``events``, which frees the sequence's slot.

    ``prompt_tokens`` counts the prompt when the usage chunk is wanted but the stream ended without the
    provider's last event (which carries the usage).
    """
    sent_tokens, usage, event = 0, None, first
    try:
        opening = fmt.start()
        if opening is not None:
            yield sse(opening)
        while True:
            if event is None:  # ended without a finish reason: what was generated is the answer
                yield sse(fmt.delta("", "stop"))
                break
            sent_tokens += len(event.token_ids)
            usage = event.usage or usage
            if event.text:
                yield sse(fmt.delta(event.text))
            if event.finish_reason is not None:
                yield sse(fmt.delta("", event.finish_reason))
                break
            try:
                event = await anext(events, None)
            except Exception as exc:  # the status line is sent already: report in the stream, as OpenAI does
                log.exception("generation failed mid-stream")
                yield sse({"error": {"message": f"generation failed: {type(exc).__name__}: {exc}",
                                     "type": "server_error", "param": None, "code": 500}})
                yield DONE
                return
        if fmt.include_usage:
            if usage is None:
                prompt = prompt_tokens()
                usage = {"prompt_tokens": prompt, "completion_tokens": sent_tokens,
                         "total_tokens": prompt + sent_tokens}
            yield sse(fmt.usage(usage))
        yield DONE
    finally:
        await aclose(events)


async def aclose(events) -> None:
    """Close an async iterator early (async generators have ``aclose``; plain iterators need nothing)."""
    close = getattr(events, "aclose", None)
    if close is not None:
        await close()
