"""The OpenAI-compatible server on loopback, with a bounded number of concurrent clients."""

import asyncio
import json
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


@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions", {"prompt": "Hi", "seed": 2**64, "temperature": 0.5}, "seed: Input should be less than"),
    ("/v1/completions", {"prompt": "Hi", "seed": -(2**63) - 1, "temperature": 0.5}, "seed: Input should be greater"),
    ("/v1/completions", {"prompt": "Hi \ud800 there"}, "prompt: Value error, prompt holds a lone surrogate"),
    ("/v1/completions", {"prompt": ["Hi", "\udfff"]}, "prompt: Value error, prompt holds a lone surrogate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud83d"}]},
     "messages.0.content: Value error, content holds a lone surrogate"),
    ("/v1/completions", {"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, "stop: Value error, at most 4 stop"),
    ("/v1/completions", {"prompt": "Hi", "stop": "x" * 257}, "at most 256 characters"),
    ("/v1/completions", {"prompt": ["Hi"] * 65, "max_tokens": 1}, "65 prompts in one request; the server takes at "
                                                                    "most 64 (--max-prompts)"),
    ("/v1/completions", {"prompt": ["Hi", "Ho"], "max_tokens": 20000}, "--max-request-tokens"),
    ("/v1/completions", {"prompt": "word " * 40000, "max_tokens": 1}, "would queue 4000"),
])
def test_values_that_gave_500_or_cost_everyone_are_400s_naming_the_field(served, path, body, message):
    """A seed torch cannot take, a lone surrogate (valid JSON, not text), 200 000 stop strings, 1 032 prompts:
    each was a 500 or slowed every request; now a 400 that names the field (ASCII JSON: the surrogate as
    an escape, as a client would send it)."""
    _, url = served
    r = httpx.post(f"{url}{path}", content=json.dumps(body).encode(), timeout=TIMEOUT,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200


def test_a_tiny_temperature_does_not_fail_its_pass_mates(served):
    """temperature 1e-300 is valid for the schema; it made the whole pass raise, and every request in that
    pass got 500. Now it is greedy, and the requests sharing its pass are answered as usual."""
    _, url = served
    bodies = [{"prompt": "Water is", "max_tokens": 5, "temperature": 1e-300},
              {"prompt": "Water is", "max_tokens": 5, "temperature": 0},
              {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0.7, "seed": 2**64 - 1}]
    responses = asyncio.run(_post_all(url, "/v1/completions", bodies))
    assert [r.status_code for r in responses] == [200] * 3, [r.text for r in responses]
    texts = [r.json()["choices"][0]["text"] for r in responses]
    assert texts[0] == texts[1]


def test_a_sequence_that_fails_alone_fails_only_its_request(served, monkeypatch):
    """A sequence's own step (sampling, text) raising: its request gets 500, a request in the same pass 200."""
    provider, url = served
    loop = provider._loop  # the worker's decode loop: its sampling fails for "boom" only
    original = loop._sample
    boom = tuple(provider.engine.prompt_ids("boom"))

    def flaky(seq, logits):
        if seq.request.prompt_ids == boom:
            raise RuntimeError("simulated sampling failure")
        return original(seq, logits)

    monkeypatch.setattr(loop, "_sample", flaky)
    bodies = [{"prompt": "boom", "max_tokens": 4, "temperature": 0.5},
              {"prompt": "Hi", "max_tokens": 4, "temperature": 0.5, "seed": 1}]
    bad, good = asyncio.run(_post_all(url, "/v1/completions", bodies))
    assert bad.status_code == 500 and "simulated sampling failure" in bad.json()["error"]["message"]
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] > 0


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
