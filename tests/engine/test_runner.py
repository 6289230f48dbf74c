"""The streamed engine against the resident transformers model, loaded another way."""

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from airquant.engine.runner import Engine
from airquant.errors import PromptTooLongError, StoreError
from airquant.models import resolve
from airquant.store.split import split

PROMPTS = ["The quick brown fox", "Once upon a time in a land far far away there lived", "Hi"]


def _reference_logits(folder, tokenizer, prompts):
    """Each prompt alone (no padding) through the model transformers loads from the source folder."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(**tokenizer(p, return_tensors="pt")).logits[0] for p in prompts]


def _rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("max_ram_gb", [None, 0.0], ids=["ram-tier", "disk-tier"])
def test_streamed_logits_equal_transformers(tiny_store, tiny_llama, max_ram_gb):
    engine = Engine.open(tiny_store, device="cpu", max_ram_gb=max_ram_gb)
    enc = engine.encode(PROMPTS)
    logits = engine.forward(enc["input_ids"], enc["attention_mask"])
    refs = _reference_logits(tiny_llama, engine.tokenizer, PROMPTS)
    for row, mask, ref in zip(logits, enc["attention_mask"], refs):
        got = row[mask.bool()]  # left padding: real tokens are the last ones
        assert got.shape == ref.shape
        assert _rel_err(got, ref) <= 1e-4
    engine.close()


def test_streamed_and_resident_generate_same_tokens(tiny_store):
    streamed = Engine.open(tiny_store, device="cpu")
    resident = Engine.open(tiny_store, device="cpu", resident=True)
    a = streamed.generate(PROMPTS, max_new_tokens=12)
    b = resident.generate(PROMPTS, max_new_tokens=12)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert all(c.new_tokens > 0 for c in a)
    assert streamed.stats()["bytes_streamed"] == 0  # CPU: layers are used in place, nothing copied


def test_batched_greedy_equals_one_by_one(tiny_store, tiny_llama):
    engine = Engine.open(tiny_store, device="cpu")
    batched = engine.generate(PROMPTS, max_new_tokens=8)
    single = [engine.generate([p], max_new_tokens=8)[0] for p in PROMPTS]
    assert [c.token_ids for c in batched] == [c.token_ids for c in single]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    enc = engine.tokenizer(PROMPTS[1], return_tensors="pt")
    ref = model.generate(**enc, max_new_tokens=8, do_sample=False, eos_token_id=engine.eos_ids(),
                         pad_token_id=engine.tokenizer.pad_token_id)
    want = ref[0, enc["input_ids"].shape[1]:].tolist()
    stop = next((k for k, t in enumerate(want) if t in engine.eos_ids()), len(want))
    assert list(batched[1].token_ids) == want[:stop]


def test_sampling_is_seeded(tiny_store):
    engine = Engine.open(tiny_store, device="cpu")
    kw = dict(max_new_tokens=10, temperature=1.0, top_p=0.9)
    a = engine.generate(PROMPTS, seed=3, **kw)
    b = engine.generate(PROMPTS, seed=3, **kw)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


def test_kv_cache_makes_decode_one_pass_per_token(tiny_store):
    engine = Engine.open(tiny_store, device="cpu")
    calls = []
    original = engine.streamer.fetch
    engine.streamer.fetch = lambda i: calls.append(i) or original(i)
    out = engine.generate(["Hello there"], max_new_tokens=6)
    steps = 1 + (out[0].new_tokens - 1)  # prefill, then one pass per further token
    assert len(calls) == engine.manifest.num_layers * steps
    assert engine.last_timings["decode_steps"] == out[0].new_tokens - 1


def test_each_decode_pass_records_when_the_host_had_queued_it(tiny_store, monkeypatch):
    """``host_s``: per decode pass, the seconds until the forward returned, which is what tells a host-bound step
    (host_s near step_s) from a device-bound one in moe_bench's rows. Part of its pass, and it counts the
    host's own work: a forward slowed on the host shows in it."""
    from airquant.engine.decode import loop as decode_loop

    engine = Engine.open(tiny_store, device="cpu")
    forward = decode_loop.DecodeLoop._forward
    monkeypatch.setattr(decode_loop.DecodeLoop, "_forward",
                        lambda self, *a: (time.sleep(0.02), forward(self, *a))[1])
    out = engine.generate(["Hello there"], max_new_tokens=4, ignore_eos=True)
    timed = engine.last_timings
    assert len(timed["host_s"]) == len(timed["step_s"]) == out[0].new_tokens - 1 == 3
    assert all(0.02 <= host <= step for host, step in zip(timed["host_s"], timed["step_s"]))


def test_bf16_store_streamed_equals_resident(tmp_path, tiny_qwen2):
    store = tmp_path / "q"
    split(resolve(str(tiny_qwen2)), store, dtype="bfloat16", progress=False)
    s = Engine.open(store, device="cpu")
    r = Engine.open(store, device="cpu", resident=True)
    assert s.dtype == torch.bfloat16
    enc = s.encode(PROMPTS)
    assert torch.equal(s.forward(**enc), r.forward(**enc))
    assert [c.text for c in s.generate(PROMPTS, max_new_tokens=6)] == \
        [c.text for c in r.generate(PROMPTS, max_new_tokens=6)]


def test_compute_dtype_override(tiny_store):
    engine = Engine.open(tiny_store, device="cpu", dtype="bfloat16")
    enc = engine.encode(PROMPTS[:1])
    assert engine.forward(**enc).dtype == torch.bfloat16


def test_prompt_longer_than_context(tiny_store):
    engine = Engine.open(tiny_store, device="cpu")
    long_prompt = "word " * 300
    with pytest.raises(PromptTooLongError, match="exceeds the model's context of 256"):
        engine.generate([long_prompt], max_new_tokens=4)


def test_truncated_shard_fails_before_running(tmp_path, tiny_llama):
    store = tmp_path / "s"
    split(resolve(str(tiny_llama)), store, dtype="float32", progress=False)
    shard = store / "layer_0002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])
    with pytest.raises(StoreError, match="layer_0002.safetensors"):
        Engine.open(store, device="cpu")


def test_chat_without_template_is_clear(tiny_store):
    engine = Engine.open(tiny_store, device="cpu")
    engine.tokenizer.chat_template = None
    with pytest.raises(Exception, match="no chat template"):
        engine.generate(["hi"], chat=True)


@pytest.mark.slow
def test_default_model_answers_paris_streamed_and_resident(default_store):
    streamed = Engine.open(default_store, device="cpu")
    resident = Engine.open(default_store, device="cpu", resident=True)
    q = ["What is the capital of France?"]
    a = streamed.generate(q, chat=True, max_new_tokens=16)[0]
    b = resident.generate(q, chat=True, max_new_tokens=16)[0]
    assert "Paris" in a.text
    assert a.token_ids == b.token_ids


def test_max_vram_caps_the_allocator_inside_the_engines_passes_only(tiny_store, monkeypatch):
    """``--max-vram`` holds PyTorch's allocator to the budget while a pass runs and gives the previous cap back
    after; opening an engine sets nothing process-wide."""
    from airquant.engine import cuda_ops, runner
    from airquant.engine.memory.planner import GIB

    fractions = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: fractions.append(f))
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 0.75)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"total_memory": 8 * GIB}))
    with cuda_ops.vram_cap(torch.device("cuda", 0), 2 * GIB):
        assert fractions == [0.25]
    assert fractions == [0.25, 0.75]  # the previous cap is back
    with cuda_ops.vram_cap(torch.device("cpu"), 2 * GIB), cuda_ops.vram_cap(torch.device("cuda", 0), None):
        assert fractions == [0.25, 0.75]  # no GPU or no budget: nothing to cap

    entered = []

    def recorded(device, max_bytes):
        entered.append((device.type, max_bytes))
        return cuda_ops.vram_cap(device, max_bytes)

    monkeypatch.setattr(runner, "vram_cap", recorded)
    engine = Engine.open(tiny_store, device="cpu", max_vram_gb=1)
    assert entered == []
    engine.generate(["Hi there"], max_new_tokens=3, ignore_eos=True)
    assert entered == [("cpu", GIB)] * 3  # one per pass: prefill and two decode steps
    engine.forward(torch.tensor([[1, 2, 3]]))
    assert len(entered) == 4


def test_open_refuses_an_unknown_setting_and_applies_overrides_to_a_config(tiny_store):
    from airquant.config import EngineConfig

    with pytest.raises(TypeError, match="plan"):
        Engine.open(tiny_store, EngineConfig(device="cpu"), plan=None)
    engine = Engine.open(tiny_store, EngineConfig(device="cpu"), resident=True)
    try:
        assert engine.cfg.resident and engine.cfg.device == "cpu"
    finally:
        engine.close()
