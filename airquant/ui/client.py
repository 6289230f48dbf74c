"""The Chat tab's OpenAI client: ``POST /v1/chat/completions`` with ``"stream": true`` over loopback.

The UI is a client of the server like any other (same key, same queue, same SSE), so what it shows is
what an API user gets.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import AsyncIterator

import httpx

from airquant.errors import AirQuantError


class ChatStreamError(AirQuantError):
    """The server answered the UI's request with an error."""


@dataclass
class ChatProgress:
    text: str  # the answer so far
    completion_tokens: int = 0
    seconds: float = 0.0  # since the first token arrived
    done: bool = False

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds > 0 else 0.0


def history_messages(message: str, history: list) -> list[dict]:
    """Gradio's history (OpenAI-style dicts; content may be a list of parts) plus the new user message."""
    out = []
    for turn in history:
        content = turn.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...] or a list of strings
            content = "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
        if turn.get("role") in ("user", "assistant", "system") and isinstance(content, str):
            out.append({"role": turn["role"], "content": content})
    return out + [{"role": "user", "content": message}]


async def stream_chat(base_url: str, api_key: str | None, messages: list[dict],
                      settings: dict) -> AsyncIterator[ChatProgress]:
    """The answer as it grows, one ``ChatProgress`` per SSE chunk; the last has ``done`` and the usage."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True}, **settings}
    progress, first = ChatProgress(text=""), None
    timeout = httpx.Timeout(connect=10.0, read=None, write=30.0, pool=30.0)  # a streamed model may be slow
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=headers) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")
                raise ChatStreamError(f"the server answered {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise ChatStreamError(chunk["error"]["message"])
                for choice in chunk.get("choices", []):
                    progress.text += choice.get("delta", {}).get("content", "") or ""
                    progress.completion_tokens += 1 if choice.get("delta", {}).get("content") else 0
                if chunk.get("usage"):
                    progress.completion_tokens = chunk["usage"]["completion_tokens"]
                first = first or time.perf_counter()
                progress.seconds = time.perf_counter() - first
                yield progress
    progress.done = True
    yield progress
