"""Quantized stores end to end: shard --quant / pre-quantized checkpoints -> stream -> logits."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from airquant.cli import main
from airquant.engine.runner import Engine
from airquant.errors import AirQuantError
from airquant.models import resolve
from airquant.store.manifest import load_manifest
from airquant.store.quantize import make_transform
from airquant.store.split import split

PROMPTS = ["The quick brown fox", "Once upon a time there lived"]


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _rel_to_reference(engine, source, ckpt) -> float:
    """The streamed logits of ``PROMPTS`` against a plain model of the checkpoint's architecture holding its
    exact dequantized weights (``ckpt.reference_state_dict``), as a relative difference."""
    ref = AutoModelForCausalLM.from_config(source.config.__class__(**{
        k: v for k, v in ckpt.config.items() if k != "quantization_config"}), dtype=torch.float32).eval()
    ref.load_state_dict(ckpt.reference_state_dict)
    enc = engine.encode(PROMPTS)
    position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = ref(**enc, position_ids=position_ids).logits
    mask = enc["attention_mask"].bool()
    return _rel(engine.forward(**enc)[mask], want[mask])


def test_nf4_store_equals_bitsandbytes_in_memory(tmp_path, tiny_llama):
    pytest.importorskip("bitsandbytes")
    from airquant.quant import QuantSpec, quantize_model_inplace

    spec = QuantSpec(method="nf4")
    source = resolve(str(tiny_llama))
    transform, quant = make_transform(source, spec)
    store = tmp_path / "nf4"
    split(source, store, dtype="float32", quant=quant, transform=transform, progress=False)
    m = load_manifest(store)
    entry = m.shards["layer.0"]
    assert entry.modules["self_attn.q_proj"]["scheme"] == "nf4"
    assert entry.tensors["self_attn.q_proj.weight_packed"]["scheme"] == "nf4"
    assert entry.tensors["input_layernorm.weight"]["scheme"] == "dense"
    assert "chunks.0" in m.shards["lm_head"].modules  # untied head stored as NF4 row chunks
    engine = Engine.open(store, device="cpu")
    enc = engine.encode(PROMPTS)
    got = engine.forward(**enc)
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    quantize_model_inplace(ref_model, spec)
    ref_head = ref_model.lm_head.weight
    from airquant.quant import make_linear, quantize_linear

    packed, meta = quantize_linear(spec, ref_head.detach())
    head = make_linear(meta, ref_head.shape[1], ref_head.shape[0], False, compute_dtype=torch.float32)
    head.load_state_dict(packed, assign=True)
    ref_model.lm_head = head
    position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = ref_model(**enc, position_ids=position_ids).logits
    mask = enc["attention_mask"].bool()
    assert _rel(got[mask], want[mask]) <= 1e-4
    resident = Engine.open(store, device="cpu", resident=True)
    assert [c.token_ids for c in engine.generate(PROMPTS, max_new_tokens=6)] == \
        [c.token_ids for c in resident.generate(PROMPTS, max_new_tokens=6)]


@pytest.mark.parametrize("method, desc_act", [("gptq", False), ("gptq", True), ("awq", False)])
def test_prequantized_checkpoint_streams_its_packed_tensors(tmp_path, real_tokenizer, method, desc_act):
    from tests.quant.checkpoints import tiny_llama_config, write_synthetic_gptq_checkpoint

    ckpt = write_synthetic_gptq_checkpoint(
        tmp_path / "ckpt", method=method, desc_act=desc_act,
        llama_config=tiny_llama_config(vocab_size=len(real_tokenizer)))
    real_tokenizer.save_pretrained(ckpt.path)
    source = resolve(str(ckpt.path))
    transform, quant = make_transform(source)
    assert quant["method"] == method
    store = tmp_path / "store"
    split(source, store, dtype="float32", quant=quant, transform=transform, progress=False)
    entry = load_manifest(store).shards["layer.1"]
    assert entry.modules["mlp.down_proj"]["scheme"] == method
    assert entry.tensors["mlp.down_proj.qweight"]["dtype"] == "int32"
    # the reference: a plain Llama holding the checkpoint's exact dequantized weights
    assert _rel_to_reference(Engine.open(store, device="cpu"), source, ckpt) <= 1e-4


MOE_SIZES = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32)


@pytest.mark.parametrize("model_type, method, desc_act", [("qwen3_moe", "gptq", False), ("qwen3_moe", "gptq", True),
                                                          ("mixtral", "gptq", False), ("qwen3_moe", "awq", False)])
def test_prequantized_moe_checkpoint_streams_its_stacked_experts(tmp_path, real_tokenizer, model_type, method,
                                                                  desc_act):
    """A hub GPTQ/AWQ MoE checkpoint (every expert's gate, up and down packed under its own name): each layer's
    experts are stored stacked as transformers fuses them (gate and up concatenated along the output), with a
    module meta of experts and shape, and the streamed model's logits equal a plain model holding the
    checkpoint's dequantized weights; routed experts decode as whole layers do."""
    from tests.quant.checkpoints import write_synthetic_gptq_moe_checkpoint

    ckpt = write_synthetic_gptq_moe_checkpoint(tmp_path / "ckpt", real_tokenizer, model_type, method=method,
                                               desc_act=desc_act, layers=2, **MOE_SIZES)
    source = resolve(str(ckpt.path))
    transform, quant = make_transform(source)
    store = tmp_path / "store"
    split(source, store, dtype="float32", quant=quant, transform=transform, progress=False)
    entry = load_manifest(store).shards["layer.1"]
    meta = entry.modules["mlp.experts.gate_up_proj"]
    experts = source.config.num_experts if model_type == "qwen3_moe" else source.config.num_local_experts
    inter = source.config.moe_intermediate_size if model_type == "qwen3_moe" else source.config.intermediate_size
    assert meta["scheme"] == method and meta["experts"] == experts and meta["shape"] == [2 * inter, 64]
    assert entry.modules["mlp.experts.down_proj"]["shape"] == [64, inter]
    assert entry.tensors["mlp.experts.gate_up_proj.qweight"]["shape"][0] == experts
    engine = Engine.open(store, device="cpu", experts="whole")
    assert _rel_to_reference(engine, source, ckpt) <= 1e-4
    whole = [c.token_ids for c in engine.generate(PROMPTS, max_new_tokens=5)]
    engine.close()
    engine = Engine.open(store, device="cpu", experts="routed", resident_layers=0)
    assert [c.token_ids for c in engine.generate(PROMPTS, max_new_tokens=5)] == whole
    engine.close()


def test_a_moe_checkpoint_whose_gate_and_up_groups_differ_is_refused(tmp_path, real_tokenizer):
    """Act-order groups that differ between an expert's gate and up linears cannot share one fused matrix's
    g_idx: the shard is refused with the fix, before anything is stored."""
    from tests.quant.checkpoints import write_synthetic_gptq_moe_checkpoint

    ckpt = write_synthetic_gptq_moe_checkpoint(tmp_path / "ckpt", real_tokenizer, "qwen3_moe", desc_act=True,
                                               shared_perm=False, layers=1, **MOE_SIZES)
    source = resolve(str(ckpt.path))
    transform, quant = make_transform(source)
    with pytest.raises(AirQuantError, match="different act-order groups.*--quant nf4"):
        split(source, tmp_path / "store", dtype="float32", quant=quant, transform=transform, progress=False)
    assert not (tmp_path / "store" / "manifest.json").exists()


def test_quantizing_a_prequantized_checkpoint_is_refused(tmp_path, real_tokenizer):
    from airquant.quant import QuantSpec
    from tests.quant.checkpoints import write_synthetic_gptq_checkpoint

    ckpt = write_synthetic_gptq_checkpoint(tmp_path / "ckpt")
    with pytest.raises(AirQuantError, match="already quantized"):
        make_transform(resolve(str(ckpt.path)), QuantSpec(method="nf4"))


def test_keep_needs_a_gguf_source(tiny_llama):
    from airquant.quant import QuantSpec

    with pytest.raises(AirQuantError, match="not a .gguf file"):
        make_transform(resolve(str(tiny_llama)), QuantSpec(method="keep"))


def test_int2_shard_through_the_cli(tmp_path, tiny_llama, capsys):
    calib = tmp_path / "calib.txt"
    calib.write_text("Some calibration text about ships, whales and the sea. " * 40)
    store = tmp_path / "int2"
    args = ["shard", str(tiny_llama), "--store", str(store), "--quant", "int2", "--dtype", "float32",
            "--calib", str(calib), "--quiet"]
    assert main(args) == 0
    m = load_manifest(store)
    meta = m.shards["layer.0"].modules["mlp.up_proj"]
    assert meta["scheme"] == "int2" and meta["n_outliers"] >= 1
    assert main(["generate", str(store), "--prompt", "Hello", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    no_calib = ["shard", str(tiny_llama), "--store", str(tmp_path / "other"), "--quant", "int2", "--quiet"]
    assert main(no_calib) == 2  # int2 without --calib: a clear error
    assert "--calib FILE" in capsys.readouterr().err


@pytest.mark.slow
def test_gguf_keep_matches_dequantized_model(tmp_path, default_gguf):
    from airquant.quant import QuantSpec

    source = resolve("default")
    transform, quant = make_transform(source, QuantSpec(method="keep"))
    split(source, tmp_path / "keep", dtype="float32", quant=quant, transform=transform, progress=False)
    split(source, tmp_path / "dense", dtype="float32", progress=False)
    entry = load_manifest(tmp_path / "keep").shards["layer.0"]
    assert entry.modules["self_attn.q_proj"]["scheme"] == "gguf"
    keep, dense = Engine.open(tmp_path / "keep", device="cpu"), Engine.open(tmp_path / "dense", device="cpu")
    enc = keep.encode(["The capital of France is", "Whales are"])
    mask = enc["attention_mask"].bool()
    assert _rel(keep.forward(**enc)[mask], dense.forward(**enc)[mask]) <= 1e-4
