"""The OpenAI-compatible server on loopback, with a bounded number of concurrent clients."""

import asyncio
import sys

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from airquant import Provider  # noqa: E402
from airquant.cli import main  # noqa: E402
from airquant.serve import BackgroundServer, create_app  # noqa: E402

PROMPTS = ["The quick brown fox", "Once upon a time", "Hi", "Water is"]
TIMEOUT = httpx.Timeout(60.0)


def cli_outputs(store, prompts, *extra):
    """What `airquant generate` prints for each prompt (one batch, as the server's concurrent requests)."""
    import contextlib
    import io

    out = io.StringIO()
    argv = ["generate", str(store), "--device", "cpu", *extra]
    for p in prompts:
        argv += ["--prompt", p]
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    text = out.getvalue()
    answers = []
    for i, p in enumerate(prompts):
        start = text.index(f"### {p}\n") + len(f"### {p}\n")
        end = text.index(f"### {prompts[i + 1]}\n", start) if i + 1 < len(prompts) else len(text)
        answers.append(text[start:end].removesuffix("\n"))
    return answers


async def _post_all(url, path, bodies):
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        return await asyncio.gather(*[client.post(path, json=b) for b in bodies])


@pytest.fixture(scope="module")
def served(tiny_store):
    with Provider(tiny_store, device="cpu", max_batch=4, batch_window_ms=200) as provider:
        with BackgroundServer(create_app(provider)) as url:
            yield provider, url


def test_concurrent_completions_equal_cli_greedy(served, tiny_store):
    provider, url = served
    bodies = [{"model": "x", "prompt": p, "max_tokens": 6, "temperature": 0} for p in PROMPTS]
    responses = asyncio.run(_post_all(url, "/v1/completions", bodies))
    assert [r.status_code for r in responses] == [200] * len(PROMPTS)
    got = [r.json()["choices"][0]["text"] for r in responses]
    assert got == cli_outputs(tiny_store, PROMPTS, "--max-new-tokens", "6")
    body = responses[0].json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] > 0
    metrics = httpx.get(f"{url}/stats", timeout=TIMEOUT).json()
    assert metrics["passes"] < metrics["new_tokens"]  # the concurrent requests shared weight passes
    for key in ("tokens_per_s", "queue_depth", "vram_allocated_gb", "mode", "scheme"):
        assert key in metrics


def test_chat_completions_equal_cli_chat(served, tiny_store):
    _, url = served
    bodies = [{"messages": [{"role": "user", "content": p}], "max_tokens": 5} for p in PROMPTS[:2]]
    responses = asyncio.run(_post_all(url, "/v1/chat/completions", bodies))
    got = [r.json()["choices"][0]["message"]["content"] for r in responses]
    assert got == cli_outputs(tiny_store, PROMPTS[:2], "--chat", "--max-new-tokens", "5")
    assert responses[0].json()["object"] == "chat.completion"


@pytest.mark.parametrize("path, body, status, message", [
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt: Field required"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": ["Hi", "Ho"], "stream": True}, 400, "stream=true takes one prompt"),
    ("/v1/completions", {"prompt": "Hi", "n": 2}, 400, "n=2"),
    ("/v1/completions", {"prompt": "word " * 300, "max_tokens": 4}, 400, "exceeds the context of 256 tokens"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("/v1/nothing", {}, 404, "Not Found"),
])
def test_bad_requests_get_json_errors(served, path, body, status, message):
    _, url = served
    r = httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT)
    assert r.status_code == status
    assert message in r.json()["error"]["message"]


def test_invalid_json_body(served):
    _, url = served
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"},
                   timeout=TIMEOUT)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_failing_generation_does_not_take_the_server_down(served, monkeypatch):
    provider, url = served
    model = provider.engine.model
    original = model.forward
    boom = provider.engine.prompt_ids("boom")

    def flaky(*args, input_ids, **kw):  # the decode loop's weight pass fails while it prefills "boom"
        row = input_ids[0].tolist()
        if any(row[i:i + len(boom)] == boom for i in range(len(row))):
            raise RuntimeError("simulated kernel failure")
        return original(*args, input_ids=input_ids, **kw)

    monkeypatch.setattr(model, "forward", flaky)  # an instance attribute: nn.Module.__call__ runs it
    failed_before = provider.metrics()["requests_failed"]
    # one after the other: a failing pass fails every sequence in it, so "Hi" must not share boom's pass
    bad = httpx.post(f"{url}/v1/completions", json={"prompt": "boom", "max_tokens": 3}, timeout=TIMEOUT)
    assert bad.status_code == 500 and "simulated kernel failure" in bad.json()["error"]["message"]
    assert bad.json()["error"]["type"] == "server_error"
    assert provider.metrics()["requests_failed"] == failed_before + 1
    good = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=TIMEOUT)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] > 0
    health = httpx.get(f"{url}/health", timeout=TIMEOUT)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert httpx.get(f"{url}/v1/models", timeout=TIMEOUT).json()["data"][0]["object"] == "model"


def test_serve_without_fastapi_names_the_install(tiny_store, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # makes `import fastapi` raise ImportError
    assert main(["serve", str(tiny_store), "--device", "cpu"]) == 2
    assert "pip install 'airquant[serve]'" in capsys.readouterr().err


@pytest.mark.slow
def test_default_model_server_equals_cli(default_store):
    prompts = ["What is the capital of France?", "Name a primary color.", "What is 2 + 2?"]
    with Provider(default_store, device="cpu", max_batch=len(prompts), batch_window_ms=500) as provider:
        with BackgroundServer(create_app(provider)) as url:
            bodies = [{"messages": [{"role": "user", "content": p}], "max_tokens": 12, "temperature": 0}
                      for p in prompts]
            responses = asyncio.run(_post_all(url, "/v1/chat/completions", bodies))
        metrics = provider.metrics()
        assert metrics["passes"] < metrics["new_tokens"]  # the three requests shared weight passes
    got = [r.json()["choices"][0]["message"]["content"] for r in responses]
    assert got == cli_outputs(default_store, prompts, "--chat", "--max-new-tokens", "12")
    assert "Paris" in got[0]
