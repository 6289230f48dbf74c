"""GGUF blocks kept packed: dequantization equals the gguf package bit for bit, and the llama Q/K row
un-permutation on packed rows equals transformers' GGUF loader on the real default model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from airquant.quant import make_linear
from airquant.quant.gguf_keep import (
    GGUF_TYPES,
    dequantize_gguf,
    gguf_expert_tensors,
    gguf_layer_linears,
    gguf_linear_tensors,
    keepable_type,
    llama_qk_row_permutation,
)

gguf = pytest.importorskip("gguf")


def test_block_table_matches_gguf():
    for name, (type_id, block, type_size) in GGUF_TYPES.items():
        qtype = gguf.GGMLQuantizationType[name]
        assert int(qtype) == type_id and gguf.GGML_QUANT_SIZES[qtype] == (block, type_size)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0"])
def test_dequantize_equals_gguf_on_quantized_blocks(name):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 320)) * rng.uniform(0.01, 2.0, (48, 1))).astype(np.float32)
    w[3, :32] = 0.0  # an all-zero block (d == 0)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[name])
    tensors, meta = gguf_linear_tensors(raw, name, (48, 320))
    assert meta == {"scheme": "gguf", "ggml_type": name}
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    assert torch.equal(dequantize_gguf(tensors["weight_blocks"], name, 320), torch.from_numpy(expected))


def _random_k_blocks(name: str, rows: int, blocks_per_row: int, rng) -> np.ndarray:
    """Random K-quant blocks with finite fp16 super-block scales (gguf can only dequantize these types)."""
    _, _, type_size = GGUF_TYPES[name]
    raw = rng.integers(0, 256, size=(rows, blocks_per_row, type_size), dtype=np.uint8)
    scale_offsets = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[name]
    for off in scale_offsets:
        d = rng.uniform(1e-3, 0.1, size=(rows, blocks_per_row)).astype(np.float16)
        raw[..., off : off + 2] = d.view(np.uint8).reshape(rows, blocks_per_row, 2)
    return raw.reshape(rows, blocks_per_row * type_size)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K"])
def test_dequantize_equals_gguf_on_k_quant_blocks(name):
    raw = _random_k_blocks(name, 16, 3, np.random.default_rng(1))
    tensors, _ = gguf_linear_tensors(raw, gguf.GGMLQuantizationType[name], (16, 768))
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    assert torch.equal(dequantize_gguf(tensors["weight_blocks"], name, 768), torch.from_numpy(expected))


def test_module_forward_and_row_permutation():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((24, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    perm = torch.randperm(24)
    tensors, meta = gguf_linear_tensors(raw, "Q8_0", (24, 64), row_perm=perm)
    module = make_linear(meta, 64, 24, False, compute_dtype=torch.float32)
    module.load_state_dict(tensors)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0))[perm]
    x = torch.randn(5, 64)
    torch.testing.assert_close(module(x), x @ dense.t(), rtol=1e-6, atol=1e-6)


def test_keepable_types():
    assert keepable_type(gguf.GGMLQuantizationType.Q4_K) == "Q4_K" and keepable_type(8) == "Q8_0"
    assert keepable_type(gguf.GGMLQuantizationType.F16) is None and keepable_type(0) is None  # F32


@pytest.mark.parametrize("name", ["Q4_0", "Q8_0"])
def test_expert_parts_concatenate_as_packed_rows(name):
    """gate [E, I, H] and up [E, I, H] kept as one [E, 2I, row_bytes]: expert e dequantizes to cat(gate[e], up[e])."""
    qtype = gguf.GGMLQuantizationType[name]
    rng = np.random.default_rng(3)
    gate, up = (rng.standard_normal((3, 40, 96)).astype(np.float32) for _ in range(2))
    raw = [gguf.quants.quantize(w, qtype) for w in (gate, up)]
    tensors, meta = gguf_expert_tensors([(r, (3, 40, 96)) for r in raw], name)
    assert meta == {"scheme": "gguf", "ggml_type": name, "experts": 3, "shape": [80, 96], "transposed": False}
    one = make_linear(meta, 96, 80, False, compute_dtype=torch.float32)
    for e in range(3):
        one.load_state_dict({"weight_blocks": tensors["weight_blocks"][e]})
        want = np.concatenate([gguf.quants.dequantize(r, qtype)[e] for r in raw])
        assert torch.equal(one.dequantize(), torch.from_numpy(want))


@pytest.mark.parametrize("n_rows,n_head", [(576, 9), (192, 3), (64, 4)])
def test_qk_permutation_matches_transformers(n_rows, n_head):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(n_rows * 2, dtype=np.float32).reshape(n_rows, 2)
    processor = LlamaTensorProcessor(config={"num_attention_heads": n_head, "num_key_value_heads": n_head})
    expected = processor.process(rows, "blk.0.attn_q.weight").weights
    assert np.array_equal(rows[llama_qk_row_permutation(n_rows, n_head).numpy()], expected)


@pytest.mark.slow
def test_real_default_model_layer0_matches_transformers(default_gguf, resident_default):
    model, _ = resident_default
    reader = gguf.GGUFReader(default_gguf)
    cfg = model.config
    kept = gguf_layer_linears(reader, 0, cfg.num_attention_heads, cfg.num_key_value_heads)
    assert set(kept) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    layer = model.model.layers[0]
    for name, (tensors, meta) in kept.items():
        assert meta["ggml_type"] == "Q4_1"
        linear = layer.get_submodule(name)
        module = make_linear(meta, linear.in_features, linear.out_features, False, compute_dtype=torch.float32)
        module.load_state_dict(tensors)
        assert torch.equal(module.dequantize(), linear.weight), name
