"""SSE streaming: chunk formatting (unit), and streamed == non-streamed through a real Provider, stop strings too."""

import asyncio
import json
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from airquant import Provider  # noqa: E402
from airquant.serve import BackgroundServer, create_app  # noqa: E402
from airquant.serve.stream import ChunkFormat, sse_lines  # noqa: E402

TIMEOUT = httpx.Timeout(120.0)
needs_stream = pytest.mark.skipif(not hasattr(Provider, "stream"),
                                  reason="waiting for Provider.stream (the decode-loop issue adds it)")


class Events:
    """A test double of Provider.stream's iterator, for the chunk format alone; records that it was closed."""

    def __init__(self, texts, usage, finish_reason="length"):
        self.items = [SimpleNamespace(text=t, token_ids=[i], finish_reason=None, usage=None)
                      for i, t in enumerate(texts)]
        self.items[-1].finish_reason, self.items[-1].usage = finish_reason, usage
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    async def aclose(self):
        self.closed = True


def _run(fmt, texts, usage=None, finish_reason="length"):
    events = Events(texts, usage or {"prompt_tokens": 5, "completion_tokens": len(texts),
                                     "total_tokens": 5 + len(texts)}, finish_reason)

    async def collect():
        first = await anext(events)
        return [line async for line in sse_lines(first, events, fmt, lambda: 5)]

    lines = asyncio.run(collect())
    assert all(line.startswith("data: ") and line.endswith("\n\n") for line in lines)
    return [line[6:-2] for line in lines], events


def test_chat_chunks_role_deltas_finish_usage_done():
    lines, events = _run(ChunkFormat("chat", "m", include_usage=True), ["Par", "is", "."])
    assert lines[-1] == "[DONE]" and events.closed
    chunks = [json.loads(x) for x in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "Paris."
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 8
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1


def test_completion_chunks_send_the_engines_text_and_finish_reason():
    """The detokenizer held " STO" back and cut at "STOP": the events carry the cut text and "stop", sent as is."""
    lines, events = _run(ChunkFormat("completion", "m", include_usage=True), ["one ", "two", "", " "],
                         finish_reason="stop")
    chunks = [json.loads(x) for x in lines[:-1]]
    assert [c["choices"][0]["text"] for c in chunks if c["choices"]] == ["one ", "two", " ", ""]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    # generated tokens up to the stop string's (OpenAI counts them), from the provider's last event
    assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert events.closed


# -- through a real provider --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tiny_store):
    with Provider(tiny_store, device="cpu", max_batch=1, batch_window_ms=0) as provider:
        with BackgroundServer(create_app(provider)) as url:
            yield provider, url


def _read_sse(response) -> list[str]:
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


@needs_stream
@pytest.mark.parametrize("path, body, text_of", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}]},
     lambda c: c["choices"][0]["delta"].get("content", "")),
    ("/v1/completions", {"prompt": "The quick brown fox"}, lambda c: c["choices"][0]["text"]),
])
def test_streamed_equals_non_streamed_greedy(served, path, body, text_of):
    _, url = served
    body = {**body, "max_tokens": 12, "temperature": 0}
    plain = httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT).json()
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        data = _read_sse(r)
    assert data[-1] == "[DONE]" and "[DONE]" not in data[:-1]
    chunks = [json.loads(d) for d in data[:-1]]
    streamed = "".join(text_of(c) for c in chunks if c["choices"])
    expected = plain["choices"][0]["message"]["content"] if "messages" in body else plain["choices"][0]["text"]
    assert streamed == expected
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == \
        plain["choices"][0]["finish_reason"]
    assert chunks[-1]["usage"] == plain["usage"]


@needs_stream
def test_stop_strings_streamed_equal_non_streamed(served):
    """A stop string from the middle of the answer: both paths end there with "stop" and the same text."""
    _, url = served
    body = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}
    full = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json()["choices"][0]["text"]
    stop = full[4:7]
    assert stop and stop not in full[:6]
    plain = httpx.post(f"{url}/v1/completions", json={**body, "stop": [stop]}, timeout=TIMEOUT).json()
    assert plain["choices"][0]["text"] == full[: full.index(stop)] and plain["choices"][0]["finish_reason"] == "stop"
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stop": stop, "stream": True},
                      timeout=TIMEOUT) as r:
        chunks = [json.loads(d) for d in _read_sse(r)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


@needs_stream
def test_disconnect_mid_stream_frees_the_slot(served):
    """max_batch 1: had the abandoned stream kept its slot, the next request would wait for all its tokens."""
    provider, url = served
    body = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
    full = httpx.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT).json()
    assert full["usage"]["completion_tokens"] == 200  # precondition: no early EOS on this prompt
    before = provider.metrics()["new_tokens"]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # the stream is running
    after = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=TIMEOUT)
    assert after.status_code == 200
    assert provider.metrics()["new_tokens"] - before < 200 + 3  # the abandoned sequence stopped early
    assert provider.metrics()["queue_depth"] == 0
