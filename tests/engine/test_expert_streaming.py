"""Expert-aware MoE streaming (engine/moe/pool.py): routed == whole-layer == resident, exact bytes, the cache.

Tiny MoE models of four families are sharded, then run three ways on the CPU: every layer streamed whole,
streamed with only the routed experts moved into the expert pool, and resident. The bytes the pool reports
are checked against the byte ranges of the experts the resident transformers model routes to (captured with
hooks, a computation that never touches the pool).
"""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from airquant.engine.moe.layout import LFU_DECAY, SlotTable
from airquant.engine.moe.sizing import ExpertsError, plan_experts
from airquant.engine.runner import Engine
from airquant.layout import expert_modules
from airquant.models import resolve
from airquant.quant import QuantSpec
from airquant.store.manifest import load_manifest
from airquant.store.quantize import make_transform
from airquant.store.split import split
from airquant.units import GIB
from tests.zoo import make_model

PROMPTS = ["The quick brown fox", "Once upon a time in a land far far away there lived", "Hi"]
FAMILIES = ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"]


def _store(tmp_path, tokenizer, model_type, method=None, seed=0, name="store", **over):
    folder = make_model(tmp_path / f"model-{name}", tokenizer, model_type, seed=seed, **over)
    source = resolve(str(folder))
    spec = None if method is None else (QuantSpec(method=method, group=16, outliers=0.0) if method == "int2"
                                        else QuantSpec(method=method))
    transform, record = make_transform(source, spec) if spec is not None else (None, None)
    split(source, tmp_path / name, dtype="float32", quant=record, transform=transform, progress=False)
    return folder, tmp_path / name


def _logits(engine: Engine) -> torch.Tensor:
    enc = engine.encode(PROMPTS)
    return engine.forward(enc["input_ids"], enc["attention_mask"])


def _greedy(engine: Engine, steps: int = 5) -> list[int]:
    """Greedy tokens by full forwards (independent of the decode loop in use)."""
    ids = engine.encode(PROMPTS[1:2])["input_ids"]
    for _ in range(steps):
        nxt = engine.forward(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0, -steps:].tolist()


MATRIX = [pytest.param(t, m, marks=() if (t, m) in (("mixtral", "nf4"), ("qwen3_moe", None)) else pytest.mark.slow)
          for t in FAMILIES for m in (None, "nf4", "int2")]


@pytest.mark.parametrize("model_type, method", MATRIX)
def test_routed_equals_whole_layer_and_resident(tmp_path, real_tokenizer, model_type, method):
    _, store = _store(tmp_path, real_tokenizer, model_type, method)
    _assert_routed_equals_whole_and_resident(store)


def _assert_routed_equals_whole_and_resident(store) -> None:
    runs = {}
    for name, kw in (("whole", dict(experts="whole")), ("routed", dict(experts="routed")),
                     ("routed_lru_nocache", dict(experts="routed", expert_cache_gb=0.0, expert_policy="lru",
                                                 expert_prefetch=False)),
                     ("resident", dict(resident=True))):
        engine = Engine.open(store, device="cpu", **kw)
        runs[name] = (_logits(engine), _greedy(engine))
        if name.startswith("routed"):
            assert engine.experts is not None and engine.experts.bytes_copied > 0
            # Every routed layer ran from the arranged RAM tier (one copy per expert, expert_layout).
            assert engine.streamer.arranged == set(engine.experts.layers)
        engine.close()
    ref_logits, ref_tokens = runs["whole"]
    for name in ("routed", "routed_lru_nocache", "resident"):
        logits, tokens = runs[name]
        assert (logits - ref_logits).abs().max().item() <= 1e-4 * ref_logits.abs().max().item()
        assert tokens == ref_tokens


@pytest.mark.parametrize("method", [None, pytest.param("nf4", marks=pytest.mark.slow),
                                    pytest.param("int2", marks=pytest.mark.slow)])
def test_zero_experts_pass_through_as_in_the_model(tmp_path, real_tokenizer, method):
    """LongCat-Flash's "zero" experts (router ids from n_routed_experts up, identity, no bytes in the store) are
    routed to by some tokens: routed == whole == resident, and the pool copies only the stored experts."""
    folder, store = _store(tmp_path, real_tokenizer, "longcat_flash", method)
    stored = load_manifest(store).shards["layer.0"].experts["num"]
    routed = _routed_by_reference(folder, real_tokenizer, PROMPTS[1])
    assert any(e >= stored for ids in routed.values() for e in ids), "no token was routed to a zero expert"
    _assert_routed_equals_whole_and_resident(store)


def test_a_call_routed_only_to_zero_experts(tmp_path, real_tokenizer):
    """A router biased to the zero experts sends every token there: the call moves no expert bytes."""
    folder = make_model(tmp_path / "model", real_tokenizer, "longcat_flash")
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            t[-2:] = 10.0  # both zero experts outrank every real one (scores are softmax probabilities)
    save_file(tensors, weights, metadata={"format": "pt"})
    split(resolve(str(folder)), tmp_path / "store", dtype="float32", progress=False)
    engine = Engine.open(tmp_path / "store", device="cpu", experts="routed", expert_prefetch=False)
    got = _logits(engine)
    assert engine.experts.bytes_copied == 0 and engine.experts.stats["routed"] == 0
    whole = Engine.open(tmp_path / "store", device="cpu", experts="whole")
    assert (got - _logits(whole)).abs().max().item() <= 1e-5
    engine.close()
    host = Engine.open(tmp_path / "store", device="cpu", experts="cpu")
    with pytest.raises(ExpertsError, match="zero-computation experts"):
        _logits(host)
    host.close()
    whole.close()


def _routed_by_reference(folder, tokenizer, prompt: str) -> dict[int, set[int]]:
    """Per layer, the experts the resident transformers model routes the prompt's tokens to."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    stack = model.model.layers
    routed: dict[int, set[int]] = {}
    hooks = []
    for i, block in enumerate(stack):
        for name in expert_modules(block):
            def grab(module, args, i=i):
                routed.setdefault(i, set()).update(torch.unique(args[1]).tolist())
            hooks.append(block.get_submodule(name).register_forward_pre_hook(grab))
    with torch.no_grad():
        model(**tokenizer(prompt, return_tensors="pt"))
    for h in hooks:
        h.remove()
    return routed


@pytest.mark.parametrize("model_type", [t if t == "mixtral" else pytest.param(t, marks=pytest.mark.slow)
                                        for t in FAMILIES])
def test_bytes_moved_at_batch_one_are_the_routed_experts_ranges(tmp_path, real_tokenizer, model_type):
    folder, store = _store(tmp_path, real_tokenizer, model_type, "nf4")
    engine = Engine.open(store, device="cpu", experts="routed", expert_cache_gb=0.0, expert_prefetch=False)
    prompt = "Hi"
    ids = engine.encode([prompt])["input_ids"]
    engine.reset_stats()
    engine.forward(ids)
    manifest = load_manifest(store)
    want = 0
    for i, experts in _routed_by_reference(folder, real_tokenizer, prompt).items():
        ranges = manifest.shards[f"layer.{i}"].experts["ranges"]
        want += sum(end - start for e in experts for start, end in ranges[e])
    assert want > 0 and engine.experts.bytes_copied == want
    engine.close()


def test_cache_never_serves_another_stores_expert(tmp_path, real_tokenizer):
    """Two stores of one shape, different weights, run through one pool: keys carry the shard's identity."""
    _, store_a = _store(tmp_path, real_tokenizer, "mixtral", seed=0, name="a")
    _, store_b = _store(tmp_path, real_tokenizer, "mixtral", seed=1, name="b")
    first = Engine.open(store_a, device="cpu", experts="routed", expert_cache_gb=1.0)
    _logits(first)
    second = Engine.open(store_b, device="cpu", experts="routed", expert_cache_gb=1.0)
    second.experts.table, second.experts.mem = first.experts.table, first.experts.mem  # the warm pool of store a
    got = _logits(second)
    assert second.experts.stats["hits"] == 0 or second.experts.stats["copied"] > 0
    whole = Engine.open(store_b, device="cpu", experts="whole")
    assert (got - _logits(whole)).abs().max().item() <= 1e-5
    for e in (first, second, whole):
        e.close()


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_eviction_and_a_cache_of_one_slot(tmp_path, real_tokenizer, policy):
    """A pool barely larger than one call: experts are evicted and copied again, outputs unchanged."""
    _, store = _store(tmp_path, real_tokenizer, "qwen3_moe", "nf4")
    whole = Engine.open(store, device="cpu", experts="whole")
    tiny = Engine.open(store, device="cpu", experts="routed", expert_policy=policy,
                       expert_cache_gb=tiny_slot(store) / GIB)
    assert tiny.experts.plan.cache == 1
    assert _greedy(tiny, 6) == _greedy(whole, 6)
    assert (_logits(tiny) - _logits(whole)).abs().max().item() <= 1e-5
    report = tiny.experts.report()
    assert report["copied"] > 0 and report["routed"] >= report["copied"] - report["guessed"]
    whole.close()
    tiny.close()


def tiny_slot(store) -> int:
    return plan_experts(load_manifest(store), None).slot_bytes


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_slot_table_evicts_by_policy_and_forgets_the_evicted_key(policy):
    table = SlotTable(2, policy)
    for key, uses in (("a", 3), ("b", 1)):
        slot = table.victim(set())
        table.assign(slot, key)
        for _ in range(uses):
            table.tick += 1
            table.touch(slot)
    table.tick += 1
    table.touch(table.lookup("b"))  # b is the most recent, a the most frequent
    victim = table.victim(set())
    assert table.key_of[victim] == ("a" if policy == "lru" else "b")
    table.assign(victim, "c")
    assert table.lookup("a" if policy == "lru" else "b") is None and table.lookup("c") == victim
    with pytest.raises(AssertionError):
        table.victim({0, 1})


class _ScanTable:
    """The eviction rule as a scan of every slot (what ``SlotTable``'s heap must choose alike)."""

    def __init__(self, slots: int, policy: str):
        self.policy, self.tick = policy, 0
        self.key_of, self.score, self.stamp = [None] * slots, [0.0] * slots, [0] * slots

    def decayed(self, s):
        return self.score[s] * LFU_DECAY ** (self.tick - self.stamp[s])

    def victim(self, keep):
        free = [s for s, k in enumerate(self.key_of) if k is None and s not in keep]
        if free:
            return free[0]
        rank = (lambda s: self.score[s]) if self.policy == "lru" else self.decayed
        return min((s for s in range(len(self.key_of)) if s not in keep), key=rank)

    def touch(self, s):
        self.score[s] = float(self.tick) if self.policy == "lru" else self.decayed(s) + 1.0
        self.stamp[s] = self.tick


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_slot_table_heap_evicts_as_a_scan_of_every_slot_would(policy):
    rng = random.Random(7)
    table, scan = SlotTable(12, policy), _ScanTable(12, policy)
    for _ in range(3000):
        table.tick += 1
        scan.tick = table.tick
        wanted = rng.sample(range(40), rng.randint(1, 5))
        keep = set()
        for key in wanted:
            slot = table.lookup(key)
            if slot is None:
                slot = table.victim(keep)
                assert slot == scan.victim(keep)
                table.assign(slot, key)
                scan.key_of[slot], scan.score[slot], scan.stamp[slot] = key, 0.0, table.tick
            keep.add(slot)
        for slot in keep:
            table.touch(slot)
            scan.touch(slot)
        if rng.random() < 0.05:  # a layer change of a pool without cache forgets slots
            slot = rng.randrange(12)
            table.forget(slot)
            scan.key_of[slot] = None


def test_routed_is_refused_where_it_cannot_apply(tiny_store):
    with pytest.raises(ExpertsError, match="no Mixture-of-Experts"):
        Engine.open(tiny_store, device="cpu", experts="routed")


def test_plan_sizes_work_cache_and_gather(tmp_path, real_tokenizer):
    _, store = _store(tmp_path, real_tokenizer, "mixtral", "nf4")
    manifest = load_manifest(store)
    base = plan_experts(manifest, None, speculate=False)
    assert (base.work, base.cache) == (4, 0) and base.gather_bytes == 4 * base.slot_bytes
    spec = plan_experts(manifest, None)
    assert spec.work == 4 + 4  # 8 tokens x 2 routed, capped at the 4 experts of a layer
    roomy = plan_experts(manifest, 100 * base.slot_bytes + base.compute_bytes + base.decode_bytes, speculate=False)
    assert roomy.cache == 3 * 4 - 4  # every other expert of the store, no more
    assert "routed; pool" in roomy.describe()


def test_plan_counts_the_slots_of_speculative_reads(tmp_path, real_tokenizer, monkeypatch):
    """Same-layer speculative reads (sizing.SPECULATE) copy a call's guesses into slots beyond the pool's: the
    plan counts them in its device bytes and leaves the cache that much less of the same spare VRAM; the
    engine's plan has them exactly when speculation is on."""
    from airquant.engine.moe import sizing

    _, store = _store(tmp_path, real_tokenizer, "qwen3_moe", "nf4")
    manifest = load_manifest(store)
    top_k = max(e.experts["top_k"] for e in manifest.shards.values() if e.experts)
    bare = plan_experts(manifest, None, speculate=False)
    spare = bare.arena_bytes + 5 * bare.slot_bytes  # a cache of a few slots, under its cap
    off = plan_experts(manifest, spare, speculate=False)
    monkeypatch.setattr(sizing, "SPECULATE", True)
    on = plan_experts(manifest, spare, speculate=False)
    monkeypatch.setattr(sizing, "SPECULATE_GUESSES", 1)
    one = plan_experts(manifest, spare, speculate=False)
    assert (off.spec_slots, on.spec_slots, one.spec_slots) == (0, top_k, 1)
    assert on.pool_bytes == (on.slots + top_k) * on.slot_bytes and on.arena_bytes <= spare
    assert on.cache < off.cache and one.cache >= on.cache
    assert f"speculative reads {top_k} slots" in on.describe() and "speculative reads" not in off.describe()
    for speculate, want in ((False, 0), (True, 1)):  # 1: SPECULATE_GUESSES
        monkeypatch.setattr(sizing, "SPECULATE", speculate)
        engine = Engine.open(store, device="cpu", experts="routed", resident_layers=0)
        assert engine.experts.plan.spec_slots == want
        engine.close()


def test_auto_speculation_takes_slots_only_beside_no_cache(tmp_path, real_tokenizer, monkeypatch):
    """By default (sizing.SPECULATE None) a GPU plan guesses only where its pool has no hot set (a cache of fewer
    experts than a token routes): as many of the top-k as ``SPECULATE_BYTES`` holds (none where one expert is
    larger), none beside a cache, none on the CPU, none where the spare VRAM has no room for their slots (the
    guesses' slots before a cache of one)."""
    from airquant.engine.moe import sizing

    _, store = _store(tmp_path, real_tokenizer, "qwen3_moe", "nf4")
    manifest = load_manifest(store)
    top_k = max(e.experts["top_k"] for e in manifest.shards.values() if e.experts)
    assert sizing.SPECULATE is None
    bare = plan_experts(manifest, None, cache_bytes=0)
    slot = bare.slot_bytes
    assert bare.spec_slots == top_k  # tiny experts: all k fit the bytes
    base = bare.arena_bytes - bare.spec_slots * slot  # the arena without them
    monkeypatch.setattr(sizing, "SPECULATE_BYTES", 2 * slot + 1)
    no_cache = plan_experts(manifest, None, cache_bytes=0)
    assert no_cache.spec_slots == min(top_k, 2) and no_cache.cache == 0
    assert f"speculative reads {no_cache.spec_slots} slots" in no_cache.describe()
    assert plan_experts(manifest, None, cache_bytes=top_k * slot).spec_slots == 0  # a hot set
    assert plan_experts(manifest, None, cache_bytes=(top_k - 1) * slot).spec_slots == min(top_k, 2)
    assert plan_experts(manifest, None, cache_bytes=0, device="cpu").spec_slots == 0
    roomy = plan_experts(manifest, base + (top_k + 3) * slot)  # the spare VRAM holds a cache: no guesses
    assert roomy.cache > 0 and roomy.spec_slots == 0
    tight = plan_experts(manifest, base + slot)  # no cache; room for one guess's slot, not two
    assert tight.cache == 0 and tight.spec_slots == 0 and tight.arena_bytes <= base + slot
    room = plan_experts(manifest, base + 2 * slot)
    assert room.cache == 0 and room.spec_slots == min(top_k, 2) and room.arena_bytes <= base + 2 * slot
    monkeypatch.setattr(sizing, "SPECULATE_BYTES", slot - 1)  # larger experts than the attention hides
    assert plan_experts(manifest, None, cache_bytes=0).spec_slots == 0
    monkeypatch.setattr(sizing, "SPECULATE_BYTES", 2 * slot)
    engine = Engine.open(store, device="cpu", experts="routed", resident_layers=0, expert_cache_gb=0.0)
    assert engine.experts.plan.cache == 0 and engine.experts.plan.spec_slots == 0  # the CPU planner's pool
    engine.close()


def test_plan_with_fused_prefill_holds_no_gather_and_no_stacked_decode(tmp_path, real_tokenizer, monkeypatch):
    """Where a GPU run's prefills take the fused grouped kernels from the slots (NF4 experts, Triton), the
    arena holds neither the gather nor the stacked decode, only a chunk's intermediates, and the cache gets
    those bytes; int2 experts (no grouped kernel) and a CPU run keep them."""
    from airquant.engine.moe import sizing
    from airquant.quant import kernels

    _, straddling = _store(tmp_path / "small", real_tokenizer, "qwen3_moe", "nf4")  # down: 32 inputs, 64-blocks
    _, store = _store(tmp_path, real_tokenizer, "qwen3_moe", "nf4", moe_intermediate_size=64)
    manifest = load_manifest(store)
    assert not sizing.fused_prefill(manifest, "cuda") or kernels.triton_available()  # no GPU here: off
    assert not sizing.fused_prefill(manifest, "cpu")
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    assert sizing.fused_prefill(manifest, "cuda")
    assert not sizing.fused_prefill(load_manifest(straddling), "cuda")  # the kernels need blocks inside rows
    entry = next(e for e in manifest.shards.values() if e.experts)
    num, top_k = entry.experts["num"], entry.experts["top_k"]
    plain = plan_experts(manifest, 200 * tiny_slot(store), speculate=False)
    fused = plan_experts(manifest, 200 * tiny_slot(store), speculate=False, fused=True)
    assert (fused.gather_bytes, fused.decode_bytes) == (0, 0) and plain.gather_bytes > 0 and plain.decode_bytes > 0
    assert fused.call_tokens == sizing.fused_chunk_tokens(num, top_k) == 128 * num // top_k  # tiny: not bound
    assert fused.arena_bytes <= plain.arena_bytes and fused.cache >= plain.cache
    assert "prefill by the fused kernels" in fused.describe() and "GB, stacked decode" not in fused.describe()
    monkeypatch.setattr(sizing.expert_compute, "FUSED", False)
    assert not sizing.fused_prefill(manifest, "cuda")
    monkeypatch.setattr(sizing.expert_compute, "FUSED", True)
    _, int2 = _store(tmp_path / "int2", real_tokenizer, "qwen3_moe", "int2")
    assert not sizing.fused_prefill(load_manifest(int2), "cuda")


def test_host_arrangement_makes_each_expert_and_the_layer_copy_one_range(tmp_path, real_tokenizer):
    """The arranged RAM tier holds each expert's pool-slot image in one range, and the layer copy's tensors
    packed as the device slot holds them: the same bytes the file-order copies would have moved."""
    from airquant.engine.moe.layout import HostArrangement, LayerExperts
    from airquant.engine.streamer import read_into, read_layout

    _, store = _store(tmp_path, real_tokenizer, "qwen3_moe", "nf4")
    manifest = load_manifest(store)
    entry = manifest.shards["layer.0"]
    layout = read_layout(store / entry.file)
    kept, packed, runs = layout.without(set(entry.experts["tensors"]))
    arrangement = HostArrangement.of(layout.nbytes, runs, packed.nbytes, entry.experts["ranges"])
    raw = torch.empty(layout.nbytes, dtype=torch.uint8)
    read_into(layout, raw)
    buf = torch.zeros(arrangement.nbytes, dtype=torch.uint8)
    buf[:layout.nbytes] = raw
    arrangement.arrange(buf)
    for name, view in packed.views(buf).items():
        assert torch.equal(view, kept.views(raw)[name]), name
    layer = LayerExperts.of(0, entry, layout, store)
    assert arrangement.offsets == layer.offsets
    for e, ranges in enumerate(layer.ranges):
        image = buf[arrangement.expert_start(e):arrangement.expert_start(e) + arrangement.image_bytes]
        for (start, end), off in zip(ranges, layer.offsets):
            assert torch.equal(image[off:off + end - start], raw[start:end])
    # What the arrangement costs in host RAM: the slot alignment of each expert's tensors, a few KB a layer.
    assert arrangement.nbytes <= layout.nbytes + (len(layer.ranges) + 1) * len(layer.offsets) * 64

