"""Synthetic stores: byte counts of real shapes, tiny stores that run, the trimmed tokenizer."""

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from airquant.cli import main
from airquant.engine.runner import Engine
from airquant.errors import StoreError
from airquant.store.manifest import load_manifest, open_store
from airquant.store.synth import SynthSpec, synth

TOKENIZER_DIR = Path(__file__).parents[1] / "data" / "smollm2_tokenizer"
HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
needs_bnb = pytest.mark.skipif(not HAS_BNB, reason="NF4 weights need bitsandbytes (pip install bitsandbytes)")
TINY = (("hidden", 64), ("intermediate", 160), ("heads", 4), ("kv_heads", 2), ("vocab", 1000))
TINY_GPTQ = (("hidden", 128), ("intermediate", 256), ("heads", 4), ("kv_heads", 2), ("vocab", 1000))

# Llama-3-70B: 80 layers of q,o [8192 x 8192], k,v [1024 x 8192], gate,up,down [28672 x 8192]; vocab 128256.
H, I, KV, V, N = 8192, 28672, 1024, 128256, 80
LINEARS = [H * H, KV * H, KV * H, H * H, I * H, I * H, H * I]


def _nf4_bytes(numel: int) -> int:  # packed 4-bit codes + an fp32 absmax per 64 + a 16-entry fp32 code book
    return numel // 2 + 4 * math.ceil(numel / 64) + 16 * 4


@pytest.mark.parametrize("dtype, layer_data, head_data", [
    ("bfloat16", 2 * sum(LINEARS) + 2 * 2 * H, 2 * V * H),
    ("nf4", sum(_nf4_bytes(n) for n in LINEARS) + 2 * 2 * H,
     sum(_nf4_bytes(min(16384, V - r) * H) for r in range(0, V, 16384))),
])
def test_manifest_only_llama3_70b_bytes_match_the_shapes(tmp_path, real_tokenizer, dtype, layer_data, head_data):
    m = synth(SynthSpec("llama3-70b", dtype), tmp_path / dtype, manifest_only=True, tokenizer=real_tokenizer,
              progress=False)
    assert m.num_layers == N and m.synthetic and m.complete and m.source["manifest_only"]
    headers = {g: e.bytes - sum(math.prod(t["shape"]) * torch.empty(0, dtype=getattr(torch, t["dtype"])).itemsize
                                for t in e.tensors.values()) for g, e in m.shards.items()}
    assert all(8 < h < 8192 and h % 8 == 0 for h in headers.values())  # only the safetensors headers on top
    assert all(b - headers[f"layer.{i}"] == layer_data for i, b in enumerate(m.layer_bytes))
    assert m.shards["embed"].bytes - headers["embed"] == 2 * V * H
    assert m.shards["lm_head"].bytes - headers["lm_head"] == head_data
    assert m.shards["norm"].bytes - headers["norm"] == 2 * H
    assert not list(tmp_path.joinpath(dtype).glob("*.safetensors"))
    config = json.loads((tmp_path / dtype / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (H, N, V)
    with pytest.raises(StoreError, match="only a manifest"):
        open_store(tmp_path / dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("nf4", marks=needs_bnb), "gptq"])
def test_tiny_store_matches_its_manifest_only_twin_and_runs(tmp_path, real_tokenizer, dtype):
    # GPTQ groups are 128 input channels: its tiny shape has widths that are multiples of 128.
    overrides = TINY_GPTQ if dtype == "gptq" else TINY
    spec = SynthSpec("llama2-7b", dtype, layers=2, overrides=overrides)
    real = synth(spec, tmp_path / "real", tokenizer=real_tokenizer, progress=False)
    twin = synth(spec, tmp_path / "twin", manifest_only=True, tokenizer=real_tokenizer, progress=False)
    for group, entry in real.shards.items():
        assert (entry.bytes, entry.tensors, entry.modules) == (twin.shards[group].bytes, twin.shards[group].tensors,
                                                             twin.shards[group].modules)
        assert (tmp_path / "real" / entry.file).stat().st_size == entry.bytes
    if dtype == "nf4":
        assert set(real.shards["lm_head"].modules) == {"chunks.0"}
        assert all(m["scheme"] == "nf4" for m in real.shards["layer.0"].modules.values())
    if dtype == "gptq":
        assert real.quant["method"] == "gptq" and not real.shards["lm_head"].modules
        assert all(m["scheme"] == "gptq" and m["group_size"] == 128 for m in real.shards["layer.0"].modules.values())
    streamed = Engine.open(tmp_path / "real", device="cpu", max_ram_gb=0.0, host_embedding=True)
    resident = Engine.open(tmp_path / "real", device="cpu", resident=True)
    enc = streamed.encode(["The quick brown fox jumps over the lazy dog"])
    assert int(enc["input_ids"].max()) < 1000  # the trimmed tokenizer only makes valid rows
    a, b = streamed.forward(**enc), resident.forward(**enc)
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_synthetic_gptq_packing_is_the_round_to_nearest_reference():
    from airquant.quant.gptq import dequantize_gptq
    from airquant.quant.rtn import rtn_quantize
    from airquant.store.synth import _gptq_pack

    w = torch.randn(96, 384, dtype=torch.bfloat16) * 0.05
    packed = _gptq_pack(w)
    ref = rtn_quantize(w, 4, 128, sym=True).dequantize()
    got = dequantize_gptq(packed["qweight"], packed["qzeros"], packed["scales"], packed["g_idx"], bits=4,
                          zero_offset=1)
    assert torch.equal(got, ref)
    with pytest.raises(StoreError, match="divisible by 128"):
        _gptq_pack(torch.zeros(8, 100))


def test_resume_keeps_written_shards_and_refuses_other_settings(tmp_path, real_tokenizer):
    spec = SynthSpec("llama3-8b", "bfloat16", layers=3, overrides=TINY, seed=5)
    store = tmp_path / "s"
    first = synth(spec, store, tokenizer=real_tokenizer, progress=False)
    layer1 = load_file(store / "layer_0001.safetensors")
    (store / "layer_0001.safetensors").unlink()
    mtime = (store / "layer_0002.safetensors").stat().st_mtime_ns
    again = synth(spec, store, tokenizer=real_tokenizer, progress=False)
    assert again.total_bytes == first.total_bytes
    assert (store / "layer_0002.safetensors").stat().st_mtime_ns == mtime
    for name, t in load_file(store / "layer_0001.safetensors").items():  # seeded per shard: the same weights
        assert torch.equal(t, layer1[name])
    with pytest.raises(StoreError, match="left untouched"):
        synth(SynthSpec("llama3-8b", "bfloat16", layers=3, overrides=TINY, seed=6), store, tokenizer=real_tokenizer)


def test_cli_synth_manifest_only(tmp_path, capsys):
    store = tmp_path / "mo"
    assert main(["synth", "--shape", "llama2-13b", "--dtype", "bfloat16", "--store", str(store),
                 "--manifest-only", "--layers", "4", "--tokenizer", str(TOKENIZER_DIR)]) == 0
    assert "manifest only" in capsys.readouterr().out
    m = load_manifest(store)
    assert m.num_layers == 4 and m.source["synth"]["layers"] == 4
    assert main(["synth", "--shape", "llama2-13b", "--store", str(tmp_path / "x"), "--layers", "99"]) == 2
    assert "between 1 and 40" in capsys.readouterr().err


def test_exported_hf_folder_holds_the_same_model(tmp_path, real_tokenizer):
    from transformers import AutoModelForCausalLM

    from airquant.store.export import export_hf

    store = tmp_path / "s"
    synth(SynthSpec("llama3-8b", "bfloat16", layers=2, overrides=TINY), store, tokenizer=real_tokenizer,
          progress=False)
    folder = export_hf(store, tmp_path / "hf", max_file_bytes=400_000)
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1 and (folder / "tokenizer.json").is_file()
    engine = Engine.open(store, device="cpu", dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    enc = engine.encode(["A quick test of the exported weights"])
    with torch.no_grad():
        want = model(**enc).logits
    torch.testing.assert_close(engine.forward(**enc), want, rtol=1e-4, atol=1e-4)


# -- Mixture-of-Experts shapes ---------------------------------------------------------------------
# 4 experts, 2 per token; each family's own fields small too (MLA ranks, Qwen3's explicit head_dim), and
# DeepSeek's dense prefix cut to one layer so its second layer holds experts.
TINY_MOE = TINY + (("experts", 4), ("top_k", 2))
MOE_OVERRIDES = {
    "mixtral-8x7b": TINY_MOE,
    "qwen3-30b-a3b": TINY_MOE + (("head_dim", 16), ("moe_intermediate", 32)),
    "gpt-oss-120b": TINY_MOE + (("head_dim", 16),),
    "deepseek-v3": TINY_MOE + (("kv_heads", 4), ("moe_intermediate", 32), ("kv_lora_rank", 16), ("q_lora_rank", 32),
                               ("qk_nope_head_dim", 8), ("qk_rope_head_dim", 8), ("v_head_dim", 16), ("n_group", 1),
                               ("topk_group", 1), ("first_k_dense_replace", 1)),
}


def _data_bytes(store: Path, entry, start: int, end: int) -> bytes:
    with open(store / entry.file, "rb") as f:
        header = int.from_bytes(f.read(8), "little")
        f.seek(8 + header + start)
        return f.read(end - start)


@pytest.mark.parametrize("shape, dtype", [
    ("mixtral-8x7b", "bfloat16"), pytest.param("mixtral-8x7b", "nf4", marks=needs_bnb),
    pytest.param("qwen3-30b-a3b", "nf4", marks=needs_bnb), pytest.param("gpt-oss-120b", "nf4", marks=needs_bnb),
    ("deepseek-v3", "bfloat16"), ("qwen3-30b-a3b", "int2"), ("gpt-oss-120b", "int2"), ("qwen3-30b-a3b", "gptq"),
    ("mixtral-8x7b", "gptq"),
])
def test_tiny_moe_store_matches_its_manifest_only_twin_and_runs(tmp_path, real_tokenizer, shape, dtype):
    # GPTQ's groups of 128 input channels: every matrix's in_features a multiple of it
    over = MOE_OVERRIDES[shape] + ((("hidden", 128), ("intermediate", 256), ("moe_intermediate", 128),
                                    ("head_dim", 32)) if dtype == "gptq" else ())
    spec = SynthSpec(shape, dtype, layers=2, overrides=over)
    real = synth(spec, tmp_path / "real", tokenizer=real_tokenizer, progress=False)
    twin = synth(spec, tmp_path / "twin", manifest_only=True, tokenizer=real_tokenizer, progress=False)
    for group, entry in real.shards.items():
        other = twin.shards[group]
        assert (entry.bytes, entry.tensors, entry.modules, entry.experts) == \
            (other.bytes, other.tensors, other.modules, other.experts)
        assert (tmp_path / "real" / entry.file).stat().st_size == entry.bytes
    assert real.source["model_type"] == json.loads((tmp_path / "real" / "config.json").read_text())["model_type"]
    assert real.layout["stack"] == "model.layers" and set(real.shards["norm"].tensors) == {"weight"}
    moe = [real.shards[f"layer.{i}"] for i in range(2) if real.shards[f"layer.{i}"].experts]
    assert len(moe) == (1 if shape == "deepseek-v3" else 2)  # DeepSeek's first layer stays dense
    entry = moe[-1]
    assert (entry.experts["num"], entry.experts["top_k"], len(entry.experts["ranges"])) == (4, 2, 4)
    if dtype in ("nf4", "int2", "gptq"):
        experts = {m: meta for m, meta in entry.modules.items() if "experts" in meta}
        assert experts and all(m["scheme"] == dtype and m["experts"] == 4 for m in experts.values())
        assert all(m["transposed"] == (shape == "gpt-oss-120b") for m in experts.values())
        if dtype == "int2":  # --quant int2's defaults: group 32, 3.5 % of the input channels in fp16
            assert real.quant["method"] == "int2" and all(m["group"] == 32 and m["n_outliers"] == round(0.035 * k)
                                                          for m, k in ((m, m["shape"][1]) for m in experts.values()))
    else:  # expert 1's first range holds exactly expert 1's slice of the first fused tensor in the file
        name = entry.experts["tensors"][0]
        tensor = load_file(tmp_path / "real" / entry.file)[name]
        start, end = entry.experts["ranges"][1][0]
        want = tensor[1].contiguous().view(torch.uint8).numpy().tobytes()
        assert _data_bytes(tmp_path / "real", entry, start, end) == want
    streamed = Engine.open(tmp_path / "real", device="cpu", max_ram_gb=0.0)
    resident = Engine.open(tmp_path / "real", device="cpu", resident=True)
    enc = streamed.encode(["The quick brown fox jumps over the lazy dog"])
    a, b = streamed.forward(**enc), resident.forward(**enc)
    # Streamed experts run as grouped matmuls, resident ones expert by expert: bf16 sums in another order.
    assert torch.isfinite(a).all() and ((a.float() - b.float()).abs().max() / b.float().abs().max()).item() <= 2e-2


@pytest.mark.parametrize("dtype", ["bfloat16", "nf4"])
def test_manifest_only_mixtral_bytes_match_the_shapes(tmp_path, real_tokenizer, dtype):
    # Mixtral-8x7B: q,o [4096 x 4096], k,v [1024 x 4096], router [8 x 4096], 8 experts of gate_up [28672 x 4096]
    # and down [4096 x 14336]; vocab 32000.
    h, i, e, v = 4096, 14336, 8, 32000
    attn = [h * h, 1024 * h, 1024 * h, h * h]
    expert = 2 * 3 * i * h if dtype == "bfloat16" else _nf4_bytes(2 * i * h) + _nf4_bytes(h * i)
    rest = 2 * sum(attn) if dtype == "bfloat16" else sum(_nf4_bytes(n) for n in attn)
    m = synth(SynthSpec("mixtral-8x7b", dtype), tmp_path / dtype, manifest_only=True, tokenizer=real_tokenizer,
              progress=False)
    assert m.num_layers == 32 and m.source["model_type"] == "mixtral"
    for k in range(32):
        entry = m.shards[f"layer.{k}"]
        data = sum(math.prod(t["shape"]) * torch.empty(0, dtype=getattr(torch, t["dtype"])).itemsize
                   for t in entry.tensors.values())
        assert data == rest + e * expert + 2 * (e * h + 2 * h)  # router and the two norms stay bf16
        assert 8 < entry.bytes - data < 8192
        assert (entry.experts["num"], entry.experts["top_k"]) == (8, 2)
        assert [sum(b - a for a, b in r) for r in entry.experts["ranges"]] == [expert] * e
    assert m.shards["embed"].tensors["weight"]["shape"] == [v, h]


def test_manifest_only_deepseek_v3_keeps_its_dense_first_layers(tmp_path, real_tokenizer):
    m = synth(SynthSpec("deepseek-v3", "nf4", layers=5), tmp_path / "ds", manifest_only=True,
              tokenizer=real_tokenizer, progress=False)
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["first_k_dense_replace"], config["n_routed_experts"]) == (5, 3, 256)
    assert [bool(m.shards[f"layer.{k}"].experts) for k in range(5)] == [False, False, False, True, True]
    moe = m.shards["layer.3"]
    assert len(moe.experts["ranges"]) == 256 and moe.experts["top_k"] == 8
    assert "mlp.shared_experts.gate_proj" in moe.modules and "mlp.gate" not in moe.modules  # the router stays dense
    assert m.layer_bytes[3] > 15 * m.layer_bytes[0]  # 256 experts of 3 x 2048 x 7168 against one 18432-wide MLP


def test_cli_synth_moe_manifest_only_and_gptq_refusal(tmp_path, capsys):
    store = tmp_path / "q"
    assert main(["synth", "--shape", "qwen3-235b-a22b", "--dtype", "nf4", "--store", str(store), "--manifest-only",
                 "--layers", "2", "--tokenizer", str(TOKENIZER_DIR)]) == 0
    assert "qwen3-235b-a22b (nf4), 2 layers" in capsys.readouterr().out
    assert load_manifest(store).shards["layer.1"].experts["num"] == 128
    assert main(["synth", "--shape", "gpt-oss-120b", "--dtype", "gptq", "--store", str(tmp_path / "g"),
                 "--manifest-only"]) == 2
    err = capsys.readouterr().err
    assert "stores them transposed" in err and "--dtype nf4" in err and "qwen3-30b-a3b" in err
