"""The store/engine contract: tensors from quantize time load into a meta-built module by name,
and functional_call over them computes the same as the module's own dequantized weight."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from airquant.errors import UnsupportedModelError
from airquant.quant import SUPPORTED_SCHEMES, QuantSpec, make_linear, quantize_linear
from airquant.quant.gguf_keep import gguf_linear_tensors
from airquant.quant.rtn import awq_tensors, gptq_tensors, rtn_quantize

OUT, IN = 64, 256


def _weight() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(OUT, IN) * 0.05


def _quantized(kind: str, w: torch.Tensor) -> tuple[dict, dict]:
    if kind.startswith("spec:"):
        args = json.loads(kind[5:])
        return quantize_linear(QuantSpec(**args), w)
    if kind == "gptq":
        return gptq_tensors(rtn_quantize(w, 4, 128, sym=True), 4), {"scheme": "gptq", "bits": 4, "group_size": 128,
                                                                     "desc_act": False, "sym": True, "zero_offset": 1}
    if kind == "awq":
        return awq_tensors(rtn_quantize(w, 4, 128, sym=False)), {"scheme": "awq", "bits": 4, "group_size": 128,
                                                                  "version": "gemm"}
    gguf = pytest.importorskip("gguf")
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[kind])
    return gguf_linear_tensors(raw, kind, (OUT, IN))


KINDS = [
    'spec:{"method": "none"}',
    'spec:{"method": "nf4"}',
    'spec:{"method": "nf4", "double_quant": true}',
    'spec:{"method": "int2"}',
    'spec:{"method": "int2", "outliers": 0.0}',
    "gptq",
    "awq",
    "Q4_0",
    "Q4_1",
    "Q8_0",
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True])
def test_meta_module_takes_shard_tensors_by_name(kind, bias):
    if "nf4" in kind:
        pytest.importorskip("bitsandbytes")
    w = _weight()
    tensors, meta = _quantized(kind, w)
    json.dumps(meta)  # the manifest stores it as JSON
    assert meta["scheme"] in SUPPORTED_SCHEMES
    with torch.device("meta"):
        module = make_linear(meta, IN, OUT, bias, compute_dtype=torch.float32)
    state = module.state_dict()
    assert set(state) == set(tensors) | ({"bias"} if bias else set())
    for name, t in tensors.items():
        assert (state[name].shape, state[name].dtype) == (t.shape, t.dtype), name

    shard = dict(tensors)
    if bias:
        shard["bias"] = torch.randn(OUT)
    x = torch.randn(2, 5, IN)
    y = torch.func.functional_call(module, shard, (x,))

    resident = make_linear(meta, IN, OUT, bias, compute_dtype=torch.float32)
    resident.load_state_dict(shard, strict=True)
    reference_w = resident.weight if meta["scheme"] == "none" else resident.dequantize()
    expected = F.linear(x, reference_w.float(), shard.get("bias"))
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    # A sanity bound on the codes themselves: every scheme stays near the fp32 weight.
    assert ((reference_w.float() - w).norm() / w.norm()).item() < 0.4


def test_unknown_scheme_is_refused_with_the_supported_list():
    with pytest.raises(UnsupportedModelError, match="supported: none, nf4"):
        make_linear({"scheme": "hqq"}, 8, 8, False, compute_dtype=torch.float32)


def test_quant_spec_validates_and_keep_points_to_gguf():
    with pytest.raises(UnsupportedModelError):
        QuantSpec(method="int3")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        QuantSpec(method="nf4", blocksize=48)
    with pytest.raises(ValueError, match="gguf_linear_tensors"):
        quantize_linear(QuantSpec(method="keep"), torch.zeros(4, 32))
    with pytest.raises(ValueError, match="hessian"):
        quantize_linear(QuantSpec(method="int2", error_feedback=True), torch.zeros(4, 32))


def test_gguf_keep_rejects_unsupported_types():
    with pytest.raises(UnsupportedModelError, match="Q4_0"):
        gguf_linear_tensors(np.zeros((4, 8), np.uint8), "IQ2_XXS", (4, 256))
