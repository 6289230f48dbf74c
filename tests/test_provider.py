"""The provider: concurrent calls batched into shared weight passes, answers equal the engine's."""

import asyncio
import queue
import threading
import time
from concurrent.futures import CancelledError

import pytest
import torch

from airquant import Provider
from airquant.config import EngineConfig
from airquant.engine.memory.router import Hardware, StreamingNotAllowedError, plan_route, workload_for
from airquant.engine.runner import Engine, placement_for
from airquant.errors import AirQuantError, PromptTooLongError
from airquant.jobs.provider import ProviderClosedError, QueueFullError, RequestCancelledError
from airquant.units import GIB

PROMPTS = ["The quick brown fox", "Once upon a time in a land far far away there lived", "Hi", "Tell me",
           "A B C D", "Water is"]


def _wl(**fields):
    """A Workload whose KV cache stays on the device unless a test asks otherwise."""
    return workload_for(EngineConfig(kv_offload=False), **fields)


def texts(engine, prompts, **kw) -> list[str]:
    """The engine's completions' texts: what the provider's calls return."""
    return [c.text for c in engine.generate(prompts, **kw)]


@pytest.fixture(scope="module")
def reference(tiny_store):
    engine = Engine.open(tiny_store, device="cpu", resident=True)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def provider(tiny_store):
    with Provider(tiny_store, device="cpu", max_batch=8, batch_window_ms=200) as p:
        yield p


def test_concurrent_calls_share_weight_passes(provider, reference):
    before = provider.metrics()

    async def calls():
        return await asyncio.gather(*[provider.generate(p, max_new_tokens=6) for p in PROMPTS])

    got = asyncio.run(calls())
    assert got == [texts(reference, [p], max_new_tokens=6)[0] for p in PROMPTS]
    after = provider.metrics()
    assert after["prompts"] - before["prompts"] == len(PROMPTS)
    assert after["passes"] - before["passes"] < 6 * len(PROMPTS) / 2  # requests shared weight passes
    assert after["queue_depth"] == 0 and after["tokens_per_s"] > 0


def test_settings_are_not_mixed_in_one_batch(provider, reference):
    async def calls():
        return await asyncio.gather(provider.generate(PROMPTS[0], max_new_tokens=3),
                                    provider.generate(PROMPTS[1], max_new_tokens=5),
                                    provider.generate(PROMPTS[2], max_new_tokens=3))

    got = asyncio.run(calls())
    assert got[0] == texts(reference, [PROMPTS[0]], max_new_tokens=3)[0]
    assert got[1] == texts(reference, [PROMPTS[1]], max_new_tokens=5)[0]
    assert got[2] == texts(reference, [PROMPTS[2]], max_new_tokens=3)[0]


def test_batch_job_sync_facade_and_chat(provider, reference):
    assert provider.sync.generate_batch(PROMPTS[:3], max_new_tokens=4) == texts(reference, PROMPTS[:3],
                                                                                max_new_tokens=4)
    chat = provider.sync.generate([{"role": "user", "content": "Hi"}], max_new_tokens=4)
    assert chat == texts(reference, ["Hi"], chat=True, max_new_tokens=4)[0]
    assert provider.sync.generate_batch([]) == []


def test_one_bad_prompt_fails_alone(provider, reference):
    async def calls():
        return await asyncio.gather(provider.generate("word " * 300, max_new_tokens=4),
                                    provider.generate(PROMPTS[0], max_new_tokens=4), return_exceptions=True)

    bad, good = asyncio.run(calls())
    assert isinstance(bad, PromptTooLongError)
    assert good == texts(reference, [PROMPTS[0]], max_new_tokens=4)[0]


def _closes(provider) -> bool:
    """Whether close() returns; run on a helper thread so a hang fails the test instead of stalling the run
    (a minute is a watchdog for "never", not a speed limit: close() takes at most one batch window)."""
    closer = threading.Thread(target=provider.close, daemon=True)
    closer.start()
    closer.join(60)
    return not closer.is_alive()


def test_close_returns_after_a_prompt_too_long_error(tiny_store, reference):
    # a long batch window: the failing caller closes while the worker still waits in it, where the stop
    # sentinel used to be taken for "nothing queued" and dropped
    p = Provider(tiny_store, device="cpu", max_batch=2, batch_window_ms=500)
    with pytest.raises(PromptTooLongError):
        p.sync.generate("word " * 300, max_new_tokens=4)
    assert p.sync.generate(PROMPTS[0], max_new_tokens=4) == texts(reference, [PROMPTS[0]], max_new_tokens=4)[0]
    with pytest.raises(PromptTooLongError):
        p.sync.generate("word " * 300, max_new_tokens=4)
    assert _closes(p) and not p.alive


def test_a_batch_with_one_bad_prompt_fails_without_leaving_sequences_behind(tiny_store, reference):
    with Provider(tiny_store, device="cpu", max_batch=4, batch_window_ms=0) as p:
        with pytest.raises(PromptTooLongError):
            p.sync.generate_batch([PROMPTS[0], "word " * 300], max_new_tokens=4)
        # the good prompt submitted before the bad one was withdrawn: nothing ownerless runs in the loop
        assert p.sync.generate(PROMPTS[1], max_new_tokens=4) == texts(reference, [PROMPTS[1]],
                                                                      max_new_tokens=4)[0]
        assert p.alive and p.metrics()["running"] == 0
        assert _closes(p)


def test_a_failing_stream_consumer_fails_only_its_request(tiny_store, reference):
    def gone(event):  # a streaming client whose event loop has closed
        raise RuntimeError("Event loop is closed")

    with Provider(tiny_store, device="cpu", max_batch=2, batch_window_ms=0) as p:
        failed = p.submit(["Hi"], batch_job=False, on_event=gone, max_new_tokens=4)
        with pytest.raises(RuntimeError, match="Event loop is closed"):
            failed.result(timeout=60)
        assert p.sync.generate(PROMPTS[0], max_new_tokens=4) == texts(reference, [PROMPTS[0]],
                                                                      max_new_tokens=4)[0]
        assert p.metrics()["running"] == 0
        assert _closes(p)


def test_max_queue_counts_prompts_waiting_in_the_loop_for_a_slot(tiny_store):
    """One slot, max_queue 1: one prompt runs, one waits, a third is refused, also once the waiting one has
    left the provider's queue for the decode loop (it still waits there for the slot)."""
    passes, go = queue.Queue(), threading.Semaphore(0)

    def paced(event):  # on the worker: it holds in each pass's delivery until the test lets it go on
        passes.put(event)
        go.acquire()

    with Provider(tiny_store, device="cpu", max_batch=1, max_queue=1, batch_window_ms=0) as p:
        running = p.submit(["Once upon a time"], batch_job=False, on_event=paced, max_new_tokens=60,
                           ignore_eos=True)
        try:
            passes.get(timeout=60)  # the worker holds in pass 1, "Once upon a time" has the slot
            waiting = p.submit(["Hi"], batch_job=False, max_new_tokens=2)
            go.release()
            passes.get(timeout=60)  # in pass 2: the worker took "Hi" from its queue into the loop before it
            assert p.metrics()["queue_depth"] == 1
            with pytest.raises(QueueFullError, match="1 prompts are already waiting"):
                p.submit(["Tell me"], batch_job=False, max_new_tokens=2)
        finally:
            go.release(100)  # more than the passes left: the worker runs freely again
        assert running.result(timeout=60)[0].new_tokens == 60 and waiting.result(timeout=60)[0].new_tokens >= 1
        assert p.metrics()["queue_depth"] == 0


def test_unknown_setting_is_refused(provider):
    with pytest.raises(TypeError, match="max_tokens"):
        provider.sync.generate("Hi", max_tokens=3)
    with pytest.raises(TypeError, match="unknown Provider setting"):
        Provider("unused", bogus=1)


def test_closed_provider_refuses(tiny_store):
    p = Provider(tiny_store, device="cpu")
    p.close()
    with pytest.raises(ProviderClosedError):
        p.sync.generate("Hi")


@pytest.fixture(scope="module")
def six_layer_store(tmp_path_factory, real_tokenizer):
    """A 6-layer model: enough layers that a RAM budget can hold some, not all, of them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from airquant.models import resolve
    from airquant.store.split import split

    torch.manual_seed(1)
    config = AutoConfig.for_model("llama", vocab_size=len(real_tokenizer), hidden_size=64, intermediate_size=1024,
                                  num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, eos_token_id=real_tokenizer.eos_token_id)
    folder = tmp_path_factory.mktemp("six") / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    real_tokenizer.save_pretrained(folder)
    store = folder.parent / "store"
    split(resolve(str(folder)), store, dtype="float32", progress=False)
    return store


def _streaming_only_ram_gb(store, max_batch):
    """A RAM budget that holds the streamed floor plus one layer, but not every layer."""
    roomy = plan_route([store], Hardware(None, 64 * GIB), _wl(batch_size=max_batch, mode="resident"))
    c = roomy.candidate
    return (sum(c.fixed_bytes()) + roomy.reserve_bytes + 4.5 * max(c.layer_bytes)) / GIB


def test_streaming_is_kept_off_interactive_calls(six_layer_store):
    ram = _streaming_only_ram_gb(six_layer_store, max_batch=2)
    reference = Engine.open(six_layer_store, device="cpu", resident=True)
    with Provider(six_layer_store, device="cpu", max_batch=2, max_ram_gb=ram, kv="none") as p:
        assert (p.route.mode, p.interactive) == ("streamed", False)
        assert p.route.plan.disk_layers  # some layers really come from disk
        with pytest.raises(StreamingNotAllowedError, match="generate_batch"):
            p.sync.generate("Hi")
        got = asyncio.run(p.generate_batch(PROMPTS[:3], max_new_tokens=4))
        assert got == texts(reference, PROMPTS[:3], max_new_tokens=4)
        # the engine's own planner, given the route's settings and budgets, places layers as the router did
        cfg = p.route.engine_config(EngineConfig(device="cpu"))
        again = placement_for(p.engine.manifest, cfg, torch.device("cpu"), p.engine.config, p.engine.dtype,
                              hardware=p.route.hardware)
        assert again.tiers == p.route.plan.tiers
    with Provider(six_layer_store, device="cpu", max_batch=2, max_ram_gb=ram, allow_streaming=True) as p:
        assert p.interactive and p.sync.generate("Hi", max_new_tokens=4) == texts(reference, 
            ["Hi"], max_new_tokens=4)[0]


def test_turboquant_kv_is_passed_to_the_engine(tiny_store, reference):
    with Provider(tiny_store, device="cpu", kv="tq") as p:
        assert p.route.kv == "tq" and p.route.kv_config().backend == "tq"
        got = p.sync.generate_batch(PROMPTS[:2], max_new_tokens=4)
    # short sequences stay inside the exact window, so the compressed cache changes nothing yet
    assert got == texts(reference, PROMPTS[:2], max_new_tokens=4)


def test_server_refuses_to_stream_unless_allowed(six_layer_store, capsys):
    pytest.importorskip("fastapi")
    from airquant.cli import main

    ram = _streaming_only_ram_gb(six_layer_store, max_batch=2)
    argv = ["serve", str(six_layer_store), "--device", "cpu", "--max-ram", str(ram), "--max-batch", "2", "--kv", "none"]
    assert main(argv) == 2  # refused before loading anything
    assert "--allow-streaming" in capsys.readouterr().err


def test_stream_yields_the_generated_text(provider, reference):
    async def collect():
        return [e async for e in provider.stream(PROMPTS[1], max_new_tokens=8)]

    events = asyncio.run(collect())
    want = reference.generate([PROMPTS[1]], max_new_tokens=8)[0]
    assert "".join(e.text for e in events) == want.text
    assert [t for e in events for t in e.token_ids] == list(want.token_ids)
    assert all(e.finish_reason is None and e.usage is None for e in events[:-1])
    last = events[-1]
    assert last.finish_reason in ("stop", "length")
    assert last.usage == {"prompt_tokens": want.prompt_tokens, "completion_tokens": want.new_tokens,
                          "total_tokens": want.prompt_tokens + want.new_tokens}


def test_closing_a_stream_early_frees_its_slot(tiny_store):
    with Provider(tiny_store, device="cpu", max_batch=1, batch_window_ms=0) as p:
        async def go():
            stream = p.stream("Once upon a time", max_new_tokens=200, ignore_eos=True)
            first = await stream.__anext__()
            await stream.aclose()  # the client went away
            # the only slot is free again: a new request runs to its end
            return first, await asyncio.wait_for(p.generate("Hi", max_new_tokens=3), timeout=60)

        first, text = asyncio.run(go())
        assert first.token_ids and isinstance(text, str)
        assert p.metrics()["new_tokens"] < 50  # the closed stream did not run to its 200 tokens
        assert p.metrics()["running"] == 0


def test_per_request_stop_strings(provider, reference):
    full = texts(reference, ["The quick brown fox"], max_new_tokens=10, ignore_eos=True)[0]
    stop = full[4:7]
    got = provider.sync.complete("The quick brown fox", max_new_tokens=10, ignore_eos=True, stop=[stop])
    assert got.text == full[: full.index(stop)] and got.finish_reason == "stop"


def test_stop_strings_are_capped(provider):
    """Every stop string is searched at every token of a pass others share: 200 000 of them cost 1.2 s of CPU
    per token for everyone (issue #35, item 5). At most 4 (OpenAI's limit) of 256 characters."""
    for stop in (["a"] * 5, ["x" * 257]):
        with pytest.raises(AirQuantError, match="at most 4 of 256 characters"):
            provider.sync.generate("Hi", stop=stop)
    assert provider.sync.generate("Hi", max_new_tokens=2, stop=["a", "b", "c", "d" * 256]) is not None


def test_cancel_stops_a_request_whose_caller_left(tiny_store):
    """``Provider.cancel`` (the server calls it when a non-streaming client disconnects) frees the slots at
    the next pass; the future ends, so nothing is left waiting."""
    with Provider(tiny_store, device="cpu", max_batch=1, batch_window_ms=0) as p:
        step = p._loop.step  # the worker's decode loop, slowed so that 200 tokens take 4 s
        p._loop.step = lambda: time.sleep(0.02) or step()
        future = p.submit(["Hi"], batch_job=False, max_new_tokens=200, ignore_eos=True)
        while p.metrics()["running"] == 0:
            time.sleep(0.01)
        p.cancel(future)
        with pytest.raises((RequestCancelledError, CancelledError)):
            future.result(timeout=30)
        assert p.metrics()["running"] == 0 and p.metrics()["new_tokens"] < 200
        assert p.sync.generate("Hi", max_new_tokens=2) is not None
