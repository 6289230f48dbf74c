"""The CUDA streaming path (copy stream, device slots, events) against the resident model on the GPU."""

import pytest
import torch

from airquant.engine.runner import Engine

pytestmark = pytest.mark.gpu
PROMPTS = ["The quick brown fox", "Once upon a time in a land far far away there lived", "Hi"]


@pytest.mark.parametrize("kw", [
    dict(resident_layers=0),
    dict(resident_layers=0, max_ram_gb=0.0),
    dict(resident_layers=1, slots=3),
    dict(resident_layers=0, max_ram_gb=0.0002),
    dict(),
], ids=["ram", "disk", "vram1-slots3", "ram+disk", "auto"])
def test_cuda_streamed_equals_resident(tiny_store, kw):
    from airquant.config import EngineConfig

    streamed = Engine.open(tiny_store, EngineConfig(device="cuda", **kw))
    resident = Engine.open(tiny_store, device="cuda", resident=True)
    enc = streamed.encode(PROMPTS)
    for _ in range(3):  # repeated passes reuse slots and staging buffers
        a = streamed.forward(**enc)
        b = resident.forward(**enc)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    ga = streamed.generate(PROMPTS, max_new_tokens=10)
    gb = resident.generate(PROMPTS, max_new_tokens=10)
    assert [c.token_ids for c in ga] == [c.token_ids for c in gb]
    if kw.get("resident_layers") == 0:
        assert streamed.stats()["bytes_streamed"] > 0
    streamed.close()


@pytest.mark.parametrize("model_type, quant", [
    ("gemma2", None), ("mixtral", None), ("mixtral", "nf4"), ("gpt_oss", "nf4"), ("deepseek_v3", "nf4"),
    ("qwen3_next", None), ("lfm2", None),
])
def test_cuda_streams_model_types_like_resident(tmp_path, real_tokenizer, model_type, quant):
    """Generic stacks on the CUDA path: buffers moved to the device, experts (fused or NF4) on the GPU."""
    from airquant.models import resolve
    from airquant.quant import QuantSpec
    from airquant.store.quantize import make_transform
    from airquant.store.split import split
    from tests.zoo import make_model

    source = resolve(str(make_model(tmp_path / "model", real_tokenizer, model_type)))
    transform, record = make_transform(source, QuantSpec(method=quant)) if quant else (None, None)
    split(source, tmp_path / "store", dtype="float32", quant=record, transform=transform, progress=False)
    streamed = Engine.open(tmp_path / "store", device="cuda", resident_layers=0, host_embedding=True)
    resident = Engine.open(tmp_path / "store", device="cuda", resident=True)
    enc = streamed.encode(PROMPTS)
    torch.testing.assert_close(streamed.forward(**enc), resident.forward(**enc), rtol=1e-4, atol=1e-4)
    ga = streamed.generate(PROMPTS, max_new_tokens=8)
    gb = resident.generate(PROMPTS, max_new_tokens=8)
    assert [c.token_ids for c in ga] == [c.token_ids for c in gb]
    assert streamed.stats()["bytes_streamed"] > 0
    streamed.close()


def _loop_outputs(engine, job, slots: int, context: int, kv, budget: int) -> list[list[int]]:
    """Each (prompt, new tokens) of ``job`` through one decode loop of ``slots`` slots: the tokens each got."""
    from airquant.engine.decode import Request

    loop = engine.decode_loop(slots, context=context, kv=kv, token_budget=budget)
    seqs = [loop.submit(Request(tuple(engine.prompt_ids(p)), n, ignore_eos=True)) for p, n in job]
    while not loop.idle:
        loop.step()
    return [s.out for s in seqs]


def test_cuda_turboquant_loop_batches_like_one_at_a_time(tiny_store):
    """The decode loop's slot-batched TurboQuant arena on CUDA (the Triton attention kernel over every slot
    with a per-slot mask) gives each request the tokens it gets alone in a one-slot loop."""
    from airquant.kv import KVConfig

    tq = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4)
    engine = Engine.open(tiny_store, device="cuda")
    words = "the quick brown fox jumps over a lazy dog while seven wise owls watch".split()
    job = [(" ".join(words[: 2 + (k * 5) % len(words)]), 6 + (k * 3) % 9) for k in range(6)]

    assert _loop_outputs(engine, job, 3, 96, tq, 64) == _loop_outputs(engine, job, 1, 96, tq, 64)
    engine.close()


def test_cuda_turboquant_rows_of_many_lengths_attend_in_one_launch(tiny_store, monkeypatch):
    """Twelve slots (past the static passes' 8 rows) of very different lengths: every decode row of a pass in one
    kernel launch, each reading only its own history's pages (``Paged.lengths``), and each request gets the tokens
    it gets alone."""
    from airquant.kv import KVConfig, triton_kernel

    launches = {"rows": 0}
    real = triton_kernel.attention

    def spy(*args, paged=None, **kw):
        launches["rows"] += paged is not None and paged.lengths is not None
        return real(*args, paged=paged, **kw)

    monkeypatch.setattr(triton_kernel, "attention", spy)
    tq = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4)
    engine = Engine.open(tiny_store, device="cuda")
    words = "the quick brown fox jumps over a lazy dog while seven wise owls watch".split()
    job = [(" ".join(words * (1 + k % 4))[: 8 + 37 * k], 5 + k % 4) for k in range(12)]

    many = _loop_outputs(engine, job, 12, 160, tq, 512)
    assert launches["rows"] > 0
    assert many == _loop_outputs(engine, job, 1, 160, tq, 512)
    engine.close()


def test_cuda_streamed_turboquant_loop_uploads_nothing_inside_a_layer(tiny_store, monkeypatch):
    """Every layer streamed, twelve TurboQuant slots admitted over several passes (pages reserved and released):
    no host tensor is pinned for the device while a layer runs (a page table or a prefill index copied on the
    compute stream waits behind the next layers' weight copies, and the layers then ran one after another's
    copy: H100, 2026-12-05), and each request gets the tokens it gets alone."""
    from airquant.engine import skeleton
    from airquant.engine.decode import Request
    from airquant.kv import KVConfig

    tq = KVConfig(backend="tq", bits_k=4, bits_v=2, window=8, block=4)
    engine = Engine.open(tiny_store, device="cuda", resident_layers=0)
    words = "the quick brown fox jumps over a lazy dog while seven wise owls watch".split()
    job = [(" ".join(words * (1 + k % 4))[: 8 + 37 * k], 5 + k % 4) for k in range(12)]
    alone = _loop_outputs(engine, job, 1, 160, tq, 512)

    inside = {"layer": False, "pinned": 0, "passes": 0, "calls": 0}
    pin = torch.Tensor.pin_memory

    def counted_pin(self, *args, **kw):
        inside["pinned"] += inside["layer"] and inside["passes"] > 1  # the first pass makes the arenas
        return pin(self, *args, **kw)

    def enter(*_):
        inside["layer"], inside["calls"] = True, inside["calls"] + 1

    layers = skeleton.decoder_layers(engine.model)
    hooks = [m.register_forward_pre_hook(enter) for m in layers]
    hooks += [m.register_forward_hook(lambda *_: inside.__setitem__("layer", False)) for m in layers]
    monkeypatch.setattr(torch.Tensor, "pin_memory", counted_pin)
    loop = engine.decode_loop(12, context=160, kv=tq, token_budget=96)  # a few prompts a pass: a ramp
    seqs = [loop.submit(Request(tuple(engine.prompt_ids(p)), n, ignore_eos=True)) for p, n in job]
    while not loop.idle:
        inside["passes"] += 1
        loop.step()
    for h in hooks:
        h.remove()
    assert inside["calls"] >= len(layers) * inside["passes"] and inside["passes"] > 3 and inside["pinned"] == 0, inside
    assert [s.out for s in seqs] == alone
    engine.close()


@pytest.mark.parametrize("order", [[0, 1, 2, 3, 4, 5], [5, 2, 4, 0, 3, 1]], ids=["fifo", "shuffled"])
def test_cuda_loop_with_kv_offload_equals_the_cache_on_the_device(tiny_store, order):
    """KV offload in the decode loop on CUDA: pinned host copies, the prefix copied in per layer and the new
    tokens sent back asynchronously (landing before the layer's next pass). Continuous batching with requests
    arriving while others decode gives each request the tokens of the loop with its cache on the device."""
    from airquant.engine.decode import Request

    engine = Engine.open(tiny_store, device="cuda")
    words = "the quick brown fox jumps over a lazy dog while seven wise owls watch".split()
    job = [(" ".join(words[: 2 + (k * 5) % len(words)]) * (1 + k % 2), 5 + (k * 3) % 9) for k in range(6)]

    def run(offload):
        loop = engine.decode_loop(3, context=96, token_budget=8,
                                  offload=set(range(engine.config.num_hidden_layers)) if offload else set())
        seqs = {k: loop.submit(Request(tuple(engine.prompt_ids(job[k][0])), job[k][1], ignore_eos=True))
                for k in order[:2]}
        loop.step()
        seqs.update({k: loop.submit(Request(tuple(engine.prompt_ids(job[k][0])), job[k][1], ignore_eos=True))
                     for k in order[2:]})
        while not loop.idle:
            loop.step()
        return [seqs[k].out for k in range(len(job))]

    assert run(True) == run(False)
    engine.close()
