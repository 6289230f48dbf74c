"""Triton kernels (and bitsandbytes NF4) on CUDA against the torch reference path of the same module."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from airquant.quant import QuantSpec, make_linear, quantize_linear
from airquant.quant.rtn import awq_tensors, gptq_tensors, rtn_quantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _cuda_module(tensors: dict, meta: dict, in_f: int, out_f: int, dtype: torch.dtype) -> torch.nn.Module:
    module = make_linear(meta, in_f, out_f, False, compute_dtype=dtype)
    module.load_state_dict(tensors)
    return module.cuda()


def _torch_path(module, x, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv("AIRQUANT_NO_TRITON", "1")
        return module(x)


@pytest.mark.parametrize("out_f,in_f,outliers", [(256, 512, 0.035), (1000, 768, 0.035), (384, 1024, 0.0)])
@pytest.mark.parametrize("m", [1, 5, 64])
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-3), (torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
def test_int2_fused_kernel_matches_fp32_reference(out_f, in_f, outliers, m, dtype, tol):
    from airquant.quant.kernels.int2_triton import int2_matmul_triton

    torch.manual_seed(0)
    w = torch.randn(out_f, in_f) * 0.02
    tensors, meta = quantize_linear(QuantSpec(method="int2", outliers=outliers), w, act_scale=torch.rand(in_f))
    module = _cuda_module(tensors, meta, in_f, out_f, dtype)
    x = torch.randn(m, in_f, device="cuda").to(dtype)
    reference = x.float() @ module.dequantize().t()  # fp32 dequantized weight, fp32 matmul
    ow = module.outlier_weight if meta["n_outliers"] else None
    oi = module.outlier_idx if meta["n_outliers"] else None
    y = int2_matmul_triton(x, module.codes, module.scales, module.zeros, ow, oi, 32)
    assert y.dtype == dtype and y.shape == (m, out_f)
    assert rel_err(y, reference) <= tol
    torch.testing.assert_close(module(x), y)  # the module dispatches to the same kernel


@pytest.mark.parametrize("gemv", ["gluon-tma", "gluon-ldg", "triton"])
@pytest.mark.parametrize("out_f,in_f,group,outliers", [
    (128, 1024, 32, 0.035),  # whole row blocks and stages; TMA: four whole k-tiles
    (1000, 768, 32, 0.035),  # partial row block and partial stage; TMA: a partial row block
    (64, 512, 16, 0.0),  # one word per group, no outliers
    (64, 640, 16, 0.035),  # TMA: a partial k-tile (2.5 of 256 inputs), zero-filled past K
    (200, 2048, 64, 0.1),  # four words per group, outliers over two Gluon outlier programs (128 columns each)
    (256, 2176, 128, 0.035),  # eight words per group (8-word chunks), partial stage
])
@pytest.mark.parametrize("dtype,tol", [(torch.float16, 1e-3), (torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
def test_int2_gemv_kernels_match_fp32_reference(gemv, out_f, in_f, group, outliers, dtype, tol):
    """The batch-1 kernels: Gluon (lookup tables over x read by warp shuffles, fp32 throughout) with its
    weights through a TMA ring or plain loads, and Triton. The outlier rows are passed as stored (padded
    from 128 outliers up, int2.outlier_cols: the 200x2048 case): the kernels take len(outlier_idx) columns."""
    from airquant.quant.kernels.int2_triton import _gluon_gemv, int2_matmul_triton

    if gemv.startswith("gluon") and _gluon_gemv() is None:
        pytest.skip("this Triton has no triton.experimental.gluon")
    torch.manual_seed(1)
    w = torch.randn(out_f, in_f) * 0.02
    spec = QuantSpec(method="int2", group=group, outliers=outliers)
    tensors, meta = quantize_linear(spec, w, act_scale=torch.rand(in_f))
    module = _cuda_module(tensors, meta, in_f, out_f, dtype)
    x = torch.randn(1, in_f, device="cuda").to(dtype)
    reference = x.float() @ module.dequantize().t()
    ow = module.outlier_weight if meta["n_outliers"] else None
    oi = module.outlier_idx if meta["n_outliers"] else None
    if gemv == "triton":
        y = int2_matmul_triton(x, module.codes, module.scales, module.zeros, ow, oi, group, gemv="triton")
    else:
        from airquant.quant.kernels.int2_gluon import int2_gemv, tma_ok

        words = module.codes.view(torch.int32)
        path = gemv.split("-")[1]
        if path == "tma" and not tma_ok(words, module.scales, module.zeros, group):
            pytest.skip("the TMA path needs Hopper, group 16/32 and K % (8 * group) == 0")
        y = int2_gemv(x[0], words, module.scales, module.zeros, ow, oi, group, path=path)[None]
    assert y.dtype == dtype and y.shape == (1, out_f)
    assert rel_err(y, reference) <= tol


def test_int2_gemv_group_not_power_of_two_words():
    """Groups of 48 inputs (3 words) are outside the Gluon tile shapes: the automatic choice takes the
    Triton GEMV, and asking for Gluon by name says why it cannot."""
    from airquant.quant.kernels.int2_triton import _gluon_gemv, int2_matmul_triton

    torch.manual_seed(2)
    w = torch.randn(96, 480) * 0.02
    tensors, meta = quantize_linear(QuantSpec(method="int2", group=48, outliers=0.035), w, act_scale=torch.rand(480))
    module = _cuda_module(tensors, meta, 480, 96, torch.float16)
    x = torch.randn(1, 480, device="cuda").half()
    args = (module.codes, module.scales, module.zeros, module.outlier_weight, module.outlier_idx, 48)
    y = int2_matmul_triton(x, *args)
    assert rel_err(y, x.float() @ module.dequantize().t()) <= 1e-3
    if _gluon_gemv() is not None:
        with pytest.raises(ValueError, match="groups of 16"):
            int2_matmul_triton(x, *args, gemv="gluon")


@pytest.mark.parametrize("kind", ["gptq", "gptq_act_order", "gptq8", "awq"])
@pytest.mark.parametrize("m", [1, 16, 33])
def test_gptq_awq_kernel_matches_torch_path(kind, m, monkeypatch):
    torch.manual_seed(1)
    out_f, in_f = 512, 320  # 320 % 128 != 0: a partial last group
    w = torch.randn(out_f, in_f) * 0.02
    bits = 8 if kind == "gptq8" else 4
    perm = torch.randperm(in_f) if kind == "gptq_act_order" else None
    rtn = rtn_quantize(w, bits, 128, sym=False, perm=perm)
    if kind == "awq":
        tensors, meta = awq_tensors(rtn), {"scheme": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    else:
        tensors = gptq_tensors(rtn, bits)
        meta = {"scheme": "gptq", "bits": bits, "group_size": 128, "desc_act": perm is not None, "sym": False,
                "zero_offset": 1}
    module = _cuda_module(tensors, meta, in_f, out_f, torch.float16)
    x = torch.randn(m, in_f, device="cuda", dtype=torch.float16)
    assert rel_err(module(x), _torch_path(module, x, monkeypatch)) <= 1e-3


@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("m", [1, 17])
def test_gguf_kernel_matches_torch_path(ggml_type, m, monkeypatch):
    gguf = pytest.importorskip("gguf")
    from airquant.quant.gguf_keep import gguf_linear_tensors

    torch.manual_seed(2)
    w = (torch.randn(384, 576) * 0.02).numpy()
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[ggml_type])
    tensors, meta = gguf_linear_tensors(raw, ggml_type, (384, 576))
    module = _cuda_module(tensors, meta, 576, 384, torch.float16)
    x = torch.randn(m, 576, device="cuda", dtype=torch.float16)
    assert rel_err(module(x), _torch_path(module, x, monkeypatch)) <= 1e-3


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_on_cuda_matches_bitsandbytes(double_quant):
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(3)
    w = torch.randn(768, 576, dtype=torch.float16) * 0.02
    tensors, meta = quantize_linear(QuantSpec(method="nf4", double_quant=double_quant), w.cuda())
    module = _cuda_module({k: v.cpu() for k, v in tensors.items()}, meta, 576, 768, torch.float16)
    packed, state = bnb.functional.quantize_4bit(w.cuda(), blocksize=64, compress_statistics=double_quant,
                                                 quant_type="nf4")
    for m in (1, 9):
        x = torch.randn(m, 576, device="cuda", dtype=torch.float16)
        torch.testing.assert_close(module(x), bnb.matmul_4bit(x, packed.t(), state), rtol=0, atol=0)
