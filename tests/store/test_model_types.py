"""Every tested model type: sharded from a checkpoint transformers saved, streamed, compared with transformers.

The reference is the model ``AutoModelForCausalLM.from_pretrained`` loads from the same folder, run
resident: streamed logits must match it and greedy decoding must pick the same tokens.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from airquant.engine.runner import Engine
from airquant.errors import UnsupportedModelError
from airquant.models import resolve
from airquant.quant import QuantSpec
from airquant.store.quantize import make_transform
from airquant.store.split import split
from tests.zoo import (
    ENCODER_DECODER,
    HYBRID_TYPES,
    MODEL_TYPES,
    MOE_TYPES,
    NEW_MOE_TYPES,
    NOT_TESTED,
    SSM_TYPES,
    TESTED,
    catalogue,
    make_model,
)

PROMPTS = ["The quick brown fox", "Once upon a time in a land far far away there lived", "Hi"]


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _shard(tmp_path, tokenizer, model_type, dtype="float32", spec=None):
    folder = make_model(tmp_path / "model", tokenizer, model_type)
    source = resolve(str(folder))
    transform, record = make_transform(source, spec) if spec is not None else (None, None)
    split(source, tmp_path / "store", dtype=dtype, quant=record, transform=transform, progress=False)
    return folder, tmp_path / "store"


def _check_against(engine: Engine, reference, tokenizer, tol: float) -> None:
    enc = engine.encode(PROMPTS)
    logits = engine.forward(enc["input_ids"], enc["attention_mask"])
    with torch.no_grad():
        for row, mask, prompt in zip(logits, enc["attention_mask"], PROMPTS):
            ref = reference(**tokenizer(prompt, return_tensors="pt")).logits[0]
            assert _rel_err(row[mask.bool()], ref) <= tol


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_streamed_equals_transformers(tmp_path, real_tokenizer, model_type):
    folder, store = _shard(tmp_path, real_tokenizer, model_type)
    engine = Engine.open(store, device="cpu")
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _check_against(engine, reference, real_tokenizer, 1e-4)
    got = engine.generate(PROMPTS[1:2], max_new_tokens=8)[0].token_ids
    enc = real_tokenizer(PROMPTS[1], return_tensors="pt")
    want = reference.generate(**enc, max_new_tokens=8, do_sample=False, eos_token_id=engine.eos_ids(),
                              pad_token_id=real_tokenizer.pad_token_id)[0, enc["input_ids"].shape[1]:].tolist()
    assert list(got) == want[:len(got)] and len(got) > 0
    engine.close()


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "mixtral", "gpt_oss"])
def test_bfloat16_store_streams_like_transformers_bfloat16(tmp_path, real_tokenizer, model_type):
    folder, store = _shard(tmp_path, real_tokenizer, model_type, dtype="bfloat16")
    engine = Engine.open(store, device="cpu")
    assert engine.dtype == torch.bfloat16
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    _check_against(engine, reference, real_tokenizer, 2e-2)  # bf16 rounding of weights and activations


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_moe_manifest_records_expert_byte_ranges(tmp_path, real_tokenizer, model_type):
    folder, store = _shard(tmp_path, real_tokenizer, model_type)
    manifest = json.loads((store / "manifest.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    layers = [v for k, v in manifest["shards"].items() if k.startswith("layer.") and v["experts"]]
    assert layers, "no layer recorded experts"
    for entry in layers:
        experts = entry["experts"]
        assert experts["num"] == 4 and experts["top_k"] == config["num_experts_per_tok"]
        path = store / entry["file"]
        raw = path.read_bytes()
        data_start = 8 + int.from_bytes(raw[:8], "little")
        with safe_open(path, "pt") as f:
            for e, ranges in enumerate(experts["ranges"]):
                assert len(ranges) == len(experts["tensors"])
                for (start, end), name in zip(ranges, experts["tensors"]):
                    want = f.get_tensor(name)[e].contiguous().view(torch.uint8).flatten()
                    got = torch.frombuffer(bytearray(raw[data_start + start:data_start + end]), dtype=torch.uint8)
                    assert torch.equal(got, want)


def _fake_quantized_reference(folder, spec: QuantSpec):
    """The resident transformers model with every quantized weight replaced by its dequantized value.

    The weights are written into transformers' own modules, so the streamed path (packed experts decoded
    per routed expert inside the streamed layer) is compared with the dense model run another way.
    bitsandbytes' CPU ``dequantize_4bit`` is wrong when a block straddles two rows (in_features < 64),
    so decoding goes through the linear modules' torch ``dequantize``.
    """
    from airquant.layout import find_layout, linear_modules, moe_counts
    from airquant.quant import make_linear, quantize_linear
    from airquant.store.quantize import expert_params

    def fake(w: torch.Tensor) -> torch.Tensor:
        tensors, meta = quantize_linear(spec, w)
        with torch.device("meta"):
            module = make_linear(meta, w.shape[1], w.shape[0], False, compute_dtype=torch.float32)
        module.load_state_dict(tensors, assign=True)
        return module.dequantize().float()

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    stack = model.get_submodule(find_layout(model).stack)
    experts = (moe_counts(model.config) or (0,))[0]  # the config's own count (Aria keeps 8 whatever SMALL says)
    with torch.no_grad():
        for block in stack:
            for name in linear_modules(block, model.config):
                linear = block.get_submodule(name)
                linear.weight.copy_(fake(linear.weight))
            for name, transposed in expert_params(block, experts).items():
                param = block.get_parameter(name)
                for e in range(param.shape[0]):
                    w = param[e].t() if transposed else param[e]
                    param[e].copy_(fake(w.contiguous()).t() if transposed else fake(w))
        head = model.get_output_embeddings().weight  # the store keeps an untied head quantized too
        head.copy_(fake(head))
    return model


@pytest.mark.parametrize("method", ["nf4", "int2"])
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3",
                                        "qwen3_next", "lfm2", "nemotron_h", "jamba",
                                        *NEW_MOE_TYPES])
def test_quantized_moe_streams_like_the_model_quantized_in_memory(tmp_path, real_tokenizer, model_type, method):
    """MoE experts, and the linears of hybrid blocks (their conv / A_log / dt tensors stay dense)."""
    spec = QuantSpec(method=method, group=16, outliers=0.0) if method == "int2" else QuantSpec(method=method)
    folder, store = _shard(tmp_path, real_tokenizer, model_type, spec=spec)
    manifest = json.loads((store / "manifest.json").read_text())
    modules = {m: meta for e in manifest["shards"].values() for m, meta in e["modules"].items()}
    if model_type in MOE_TYPES + NEW_MOE_TYPES:
        assert any("experts" in meta for meta in modules.values()), "no expert tensor was quantized"
    dense = {n for e in manifest["shards"].values() for n, t in e["tensors"].items() if t["scheme"] == "dense"}
    assert modules and not any(m.endswith(("conv1d", "conv", "A_log", "dt_bias")) for m in modules)
    if model_type in HYBRID_TYPES + SSM_TYPES:
        assert any(n.endswith(("A_log", "conv1d.weight", "conv.weight")) for n in dense)
    engine = Engine.open(store, device="cpu")
    _check_against(engine, _fake_quantized_reference(folder, spec), real_tokenizer, 1e-4)
    resident = Engine.open(store, device="cpu", resident=True)
    enc = engine.encode(PROMPTS)
    # Streamed MoE layers run their routed experts as grouped matmuls, the resident model expert by expert:
    # the same products, summed in another order.
    streamed = engine.forward(enc["input_ids"], enc["attention_mask"])
    assert _rel_err(streamed, resident.forward(enc["input_ids"], enc["attention_mask"])) <= 1e-5


def test_zoo_lists_every_decoder_only_type_of_transformers():
    """Each decoder-only causal-LM type of the installed transformers is tested or left out with a reason: a
    transformers upgrade that brings a type fails here until tests/zoo.py names it."""
    from transformers import AutoConfig

    unlisted = sorted(t for t in catalogue() if t not in TESTED and t not in NOT_TESTED)
    assert not unlisted, f"transformers has causal-LM types tests/zoo.py neither tests nor leaves out: {unlisted}"
    assert not TESTED & set(NOT_TESTED)
    assert set(NOT_TESTED) <= set(catalogue()), "a left-out type is no longer in transformers' causal-LM mapping"
    assert all(AutoConfig.for_model(t).is_encoder_decoder for t in ENCODER_DECODER)


@pytest.mark.parametrize("config, says", [
    ({"model_type": "t5", "num_layers": 2, "vocab_size": 64}, "encoder-decoder"),
    ({"model_type": "not_a_model_type"}, "transformers cannot read"),
])
def test_unsupported_type_is_refused_and_nothing_is_written(tmp_path, capsys, config, says):
    from airquant.cli import main

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    store = tmp_path / "store"
    assert main(["shard", str(folder), "--store", str(store)]) == 2
    err = capsys.readouterr().err
    assert says in err and config["model_type"] in err
    assert not store.exists() or not any(store.iterdir())
    with pytest.raises(UnsupportedModelError, match=says):
        resolve(str(folder))


def test_readme_lists_the_tested_types():
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    models = (root / "docs" / "MODELS.md").read_text()
    listed = re.search(r"<!-- model-types:begin -->\n```text\n(.*?)\n```\n<!-- model-types:end -->", models, re.S)
    generated = subprocess.run([sys.executable, "-m", "tests.zoo"], cwd=root, capture_output=True, text=True,
                               check=True).stdout.strip()
    assert listed and listed.group(1) == generated, ("docs/MODELS.md's model list is stale: regenerate it "
                                                     "(python -m tests.zoo)")
    assert f"({len(TESTED)} model types tested)" in readme.split("\n\n")[1], "README's first paragraph: the type count"


def test_info_shows_the_experts_of_a_moe_store(tmp_path, real_tokenizer, capsys):
    from airquant.cli import main

    _, store = _shard(tmp_path, real_tokenizer, "mixtral")
    assert main(["info", "--store", str(store)]) == 0
    out = capsys.readouterr().out
    assert "3 MoE layers, 4 experts each, 2 routed per token" in out
