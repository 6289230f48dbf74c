"""GGUF Mixture-of-Experts files: a tiny qwen3moe GGUF (Q8_0/Q4_0 expert blocks) sharded dequantized and with
``--quant keep`` streams the logits transformers' own GGUF loader gives; pre-quantized GPTQ experts shard through
the CLI stacked (their logits: tests/store/test_quantized_stores.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from airquant.cli import main
from airquant.engine.runner import Engine
from airquant.models import resolve
from airquant.quant import make_linear
from airquant.store.manifest import load_manifest

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

TOKENIZER_JSON = Path(__file__).parents[1] / "data" / "smollm2_tokenizer" / "tokenizer.json"
PROMPTS = ["The quick brown fox", "Once upon a time there lived"]
# transformers' qwen3moe GGUF loader reads no expert width from the file: moe_intermediate_size stays the
# config default, 768. Everything else is small.
VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERT_DIM, EXPERTS, TOP_K = 1024, 64, 4, 2, 16, 768, 4, 2
# (ffn_gate_exps, ffn_up_exps, ffn_down_exps) per layer
EXPERT_TYPES = [(Q.Q8_0, Q.Q8_0, Q.Q4_0), (Q.Q4_0, Q.Q4_0, Q.Q8_0)]


def _tokenizer_fields() -> tuple[list[str], list[str], list[int]]:
    """SmolLM2's byte-level BPE cut to its first VOCAB tokens (and the merges that stay inside them)."""
    tok = json.loads(TOKENIZER_JSON.read_text())
    vocab = tok["model"]["vocab"]
    tokens = [""] * VOCAB
    for text, i in vocab.items():
        if i < VOCAB:
            tokens[i] = text
    merges = [" ".join(m) for m in tok["model"]["merges"] if vocab.get("".join(m), VOCAB) < VOCAB]
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    return tokens, merges, [3 if i in special else 1 for i in range(VOCAB)]  # 3: CONTROL, 1: NORMAL


def write_tiny_moe_gguf(path: Path, expert_types=EXPERT_TYPES, seed: int = 0) -> Path:
    """A random 2-layer qwen3moe GGUF, 4 experts top-2, tied embeddings, as llama.cpp's converter lays it out."""
    tokens, merges, token_types = _tokenizer_fields()
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(len(expert_types))
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(128)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_expert_count(EXPERTS)
    w.add_expert_used_count(TOP_K)
    w.add_expert_feed_forward_length(EXPERT_DIM)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    rng = np.random.default_rng(seed)

    def add(name: str, shape: tuple[int, ...], qtype=Q.F32, std: float = 0.08) -> None:
        x = (rng.standard_normal(shape) * std).astype(np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, x)
        elif qtype == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)

    add("token_embd.weight", (VOCAB, HIDDEN), Q.F16)
    add("output_norm.weight", (HIDDEN,), std=1.0)
    for b, (gate, up, down) in enumerate(expert_types):
        p = f"blk.{b}."
        add(p + "attn_norm.weight", (HIDDEN,), std=1.0)
        add(p + "ffn_norm.weight", (HIDDEN,), std=1.0)
        add(p + "attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), Q.F16)
        add(p + "attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.F16)
        add(p + "attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.Q8_0)
        add(p + "attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), Q.Q4_0)
        add(p + "attn_q_norm.weight", (HEAD_DIM,), std=1.0)
        add(p + "attn_k_norm.weight", (HEAD_DIM,), std=1.0)
        add(p + "ffn_gate_inp.weight", (EXPERTS, HIDDEN), std=0.5)
        add(p + "ffn_gate_exps.weight", (EXPERTS, EXPERT_DIM, HIDDEN), gate)
        add(p + "ffn_up_exps.weight", (EXPERTS, EXPERT_DIM, HIDDEN), up)
        add(p + "ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_DIM), down, std=0.04)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory) -> Path:
    return write_tiny_moe_gguf(tmp_path_factory.mktemp("gguf") / "tiny-moe.gguf")


@pytest.fixture(scope="module")
def hf_model(moe_gguf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_gguf.parent, gguf_file=moe_gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def stores(moe_gguf, tmp_path_factory) -> dict[str, Path]:
    """The same file sharded through the CLI dequantized (fp32) and with --quant keep."""
    root = tmp_path_factory.mktemp("stores")
    out = {}
    for name, extra in (("dense", []), ("keep", ["--quant", "keep"])):
        out[name] = root / name
        argv = ["shard", str(moe_gguf), "--store", str(out[name]), "--dtype", "float32", "--quiet", *extra]
        assert main(argv) == 0
    return out


def _streamed_logits(store: Path) -> tuple[torch.Tensor, dict]:
    engine = Engine.open(store, device="cpu")
    enc = engine.encode(PROMPTS)
    return engine.forward(**enc), enc


def test_gguf_moe_config_is_what_the_file_says(moe_gguf):
    source = resolve(str(moe_gguf))
    assert source.config.model_type == "qwen3_moe"
    assert (source.config.num_experts, source.config.num_experts_per_tok) == (EXPERTS, TOP_K)
    assert source.config.moe_intermediate_size == EXPERT_DIM
    assert source.moe_info("layer.0").modules == ("mlp.experts",)


def test_dequantized_store_streams_transformers_gguf_logits(stores, hf_model):
    entry = load_manifest(stores["dense"]).shards["layer.0"]
    assert entry.tensors["mlp.experts.gate_up_proj"]["shape"] == [EXPERTS, 2 * EXPERT_DIM, HIDDEN]
    assert entry.tensors["mlp.experts.down_proj"]["shape"] == [EXPERTS, HIDDEN, EXPERT_DIM]
    got, enc = _streamed_logits(stores["dense"])
    position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = hf_model(**enc, position_ids=position_ids).logits
    mask = enc["attention_mask"].bool()
    assert _rel(got[mask], want[mask]) <= 1e-4


def test_keep_store_marks_experts_gguf_with_per_expert_ranges(stores):
    manifest = load_manifest(stores["keep"])
    for layer, (gate, _, down) in enumerate(EXPERT_TYPES):
        entry = manifest.shards[f"layer.{layer}"]
        for param, qtype, shape in (("gate_up_proj", gate, [2 * EXPERT_DIM, HIDDEN]),
                                    ("down_proj", down, [HIDDEN, EXPERT_DIM])):
            name = f"mlp.experts.{param}"
            assert entry.modules[name] == {"scheme": "gguf", "ggml_type": qtype.name, "experts": EXPERTS,
                                           "shape": shape, "transposed": False, "tensors": ["weight_blocks"]}
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            row_bytes = shape[1] // block * type_size
            assert entry.tensors[f"{name}.weight_blocks"] == {"dtype": "uint8", "scheme": "gguf",
                                                              "shape": [EXPERTS, shape[0], row_bytes]}
            assert name not in entry.tensors
        assert entry.modules["self_attn.v_proj"]["ggml_type"] == "Q8_0"
        assert entry.modules["self_attn.o_proj"]["ggml_type"] == "Q4_0"
        assert "self_attn.q_proj" not in entry.modules  # F16 in the file: stored dense
        assert entry.tensors["mlp.gate.weight"]["scheme"] == "dense"  # the router
        experts = entry.experts
        assert sorted(experts["tensors"]) == ["mlp.experts.down_proj.weight_blocks",
                                              "mlp.experts.gate_up_proj.weight_blocks"]
        per_expert = [entry.tensors[n]["shape"][1] * entry.tensors[n]["shape"][2] for n in experts["tensors"]]
        for ranges in experts["ranges"]:
            assert [end - start for start, end in ranges] == per_expert
        starts = sorted(r[0][0] for r in experts["ranges"])
        assert len(set(starts)) == EXPERTS


def test_kept_expert_dequantizes_to_transformers_weights(stores, hf_model):
    from safetensors.torch import load_file

    manifest = load_manifest(stores["keep"])
    for layer in range(len(EXPERT_TYPES)):
        entry = manifest.shards[f"layer.{layer}"]
        tensors = load_file(stores["keep"] / entry.file)
        experts = hf_model.model.layers[layer].mlp.experts
        for param in ("gate_up_proj", "down_proj"):
            meta = entry.modules[f"mlp.experts.{param}"]
            out_f, in_f = meta["shape"]
            one = make_linear(meta, in_f, out_f, False, compute_dtype=torch.float32)
            for e in range(EXPERTS):
                one.load_state_dict({"weight_blocks": tensors[f"mlp.experts.{param}.weight_blocks"][e]})
                assert torch.equal(one.dequantize(), getattr(experts, param)[e]), (layer, param, e)


def test_keep_store_streams_the_dequantized_logits(stores, hf_model):
    got, enc = _streamed_logits(stores["keep"])
    dense, _ = _streamed_logits(stores["dense"])
    position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = hf_model(**enc, position_ids=position_ids).logits
    mask = enc["attention_mask"].bool()
    assert _rel(got[mask], dense[mask]) <= 1e-4
    assert _rel(got[mask], want[mask]) <= 1e-4


def test_gate_and_up_of_different_types_are_stored_dequantized(tmp_path):
    from airquant.quant import QuantSpec
    from airquant.store.quantize import make_transform
    from airquant.store.split import split

    path = write_tiny_moe_gguf(tmp_path / "mixed.gguf", [(Q.Q8_0, Q.Q4_0, Q.Q4_0), (Q.Q4_0, Q.Q4_0, Q.Q8_0)])
    source = resolve(str(path))
    transform, quant = make_transform(source, QuantSpec(method="keep"))
    split(source, tmp_path / "store", dtype="float32", quant=quant, transform=transform, progress=False)
    shards = load_manifest(tmp_path / "store").shards
    assert "mlp.experts.gate_up_proj" not in shards["layer.0"].modules
    assert shards["layer.0"].tensors["mlp.experts.gate_up_proj"]["scheme"] == "dense"
    assert shards["layer.0"].modules["mlp.experts.down_proj"]["ggml_type"] == "Q4_0"
    assert shards["layer.1"].modules["mlp.experts.gate_up_proj"]["ggml_type"] == "Q4_0"


def test_gptq_experts_shard_stacked_through_the_cli(tmp_path, capsys, real_tokenizer):
    """transformers fuses per-expert linears on loading; their GPTQ tensors are stacked the same way (``w1`` and
    ``w3`` concatenated along the output, the experts stacked): ``airquant shard`` writes them packed."""
    from tests.quant.checkpoints import write_synthetic_gptq_moe_checkpoint

    ckpt = write_synthetic_gptq_moe_checkpoint(tmp_path / "mixtral-gptq", real_tokenizer, "mixtral", layers=2)
    store = tmp_path / "store"
    assert main(["shard", str(ckpt.path), "--store", str(store)]) == 0, capsys.readouterr().err
    meta = load_manifest(store).shards["layer.1"].modules["mlp.experts.gate_up_proj"]
    hidden, inter = ckpt.config["hidden_size"], ckpt.config["intermediate_size"]
    assert meta["scheme"] == "gptq" and meta["experts"] == ckpt.config["num_local_experts"]
    assert meta["shape"] == [2 * inter, hidden]


def test_store_written_with_keep_resumes_under_either_name(stores, moe_gguf, tmp_path):
    """Older stores record ``keep``, the former name of ``gguf``: sharding again with either name resumes."""
    import shutil

    store = tmp_path / "old"
    shutil.copytree(stores["keep"], store)
    record = json.loads((store / "manifest.json").read_text())
    record["quant"]["method"] = "keep"
    (store / "manifest.json").write_text(json.dumps(record))
    for name in ("keep", "gguf"):
        argv = ["shard", str(moe_gguf), "--store", str(store), "--dtype", "float32", "--quiet", "--quant", name]
        assert main(argv) == 0
        assert load_manifest(store).quant["method"] == "gguf"
    got, _ = _streamed_logits(store)
    want, _ = _streamed_logits(stores["keep"])
    assert torch.equal(got, want)
