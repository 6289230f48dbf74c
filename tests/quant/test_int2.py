"""int2 Lloyd-Max: each step against a brute-force float64 reference, then the module end to end."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from airquant.quant import QuantSpec, make_linear, quantize_linear
from airquant.quant.int2 import LLOYD_MAX_4, assign_codes, fit_scale_zero, pack_codes, select_outliers, unpack_codes


def _module(tensors, meta, in_f, out_f):
    module = make_linear(meta, in_f, out_f, False, compute_dtype=torch.float32)
    module.load_state_dict(tensors)
    return module


def test_pack_roundtrip_and_bit_order():
    codes = torch.randint(0, 4, (5, 64), dtype=torch.uint8)
    packed = pack_codes(codes)
    assert packed.shape == (5, 16)
    assert torch.equal(unpack_codes(packed), codes)
    # channel k sits at bits 2*(k % 4) of byte k // 4
    assert int(packed[2, 3]) == sum(int(codes[2, 12 + j]) << (2 * j) for j in range(4))


def test_lloyd_max_levels_are_the_gaussian_optimum():
    """Centroid condition: each level is the conditional mean of N(0,1) over its cell (to 4 decimals)."""
    levels = torch.tensor(LLOYD_MAX_4, dtype=torch.float64)
    edges = torch.cat([torch.tensor([-torch.inf]), (levels[1:] + levels[:-1]) / 2, torch.tensor([torch.inf])])
    normal = torch.distributions.Normal(0.0, 1.0)
    pdf = lambda t: torch.exp(-0.5 * t.clamp(-40, 40) ** 2) / (2 * torch.pi) ** 0.5  # noqa: E731
    for i in range(4):
        a, b = edges[i].double(), edges[i + 1].double()
        mass = normal.cdf(b.float()).double() - normal.cdf(a.float()).double()
        assert abs((pdf(a) - pdf(b)) / mass - levels[i]) < 2e-4


def test_assignment_and_ols_against_brute_force():
    torch.manual_seed(0)
    w = torch.randn(6, 4, 32) * torch.rand(6, 4, 1) + torch.randn(6, 4, 1) * 0.1
    mask = torch.ones_like(w)
    codes = assign_codes(w, mask)
    scale, zero = fit_scale_zero(w, codes, mask)
    levels = torch.tensor(LLOYD_MAX_4, dtype=torch.float64)
    for r in range(6):
        for g in range(4):
            x = w[r, g].double()
            z = (x - x.mean()) / x.std(unbiased=False)
            expected = (z[:, None] - levels[None, :]).abs().argmin(1)
            assert torch.equal(codes[r, g].long(), expected)
            design = torch.stack([levels[expected], torch.ones(32, dtype=torch.float64)], 1)
            sol = torch.linalg.lstsq(design, x[:, None]).solution[:, 0]
            assert abs(scale[r, g] - sol[0]) < 1e-5 and abs(zero[r, g] - sol[1]) < 1e-5


def test_outlier_channels_are_left_out_of_the_group_fit():
    torch.manual_seed(1)
    w = torch.randn(8, 64)
    w[:, 5] *= 40.0  # a dominant input channel in group 0
    tensors, meta = quantize_linear(QuantSpec(method="int2", outliers=1 / 64), w)
    assert meta["n_outliers"] == 1 and tensors["outlier_idx"].tolist() == [5]
    # Group 0 fitted without column 5 must equal a fit over the 31 remaining columns alone.
    rest = torch.cat([w[:, :5], w[:, 6:32]], 1)[:, None, :]
    ones = torch.ones_like(rest)
    s_ref, z_ref = fit_scale_zero(rest, assign_codes(rest, ones), ones)
    torch.testing.assert_close(tensors["scales"][:, 0], s_ref[:, 0].half())
    torch.testing.assert_close(tensors["zeros"][:, 0], z_ref[:, 0].half())
    # The stored residual restores the outlier column to fp16 precision.
    w_hat = _module(tensors, meta, 64, 8).dequantize()
    torch.testing.assert_close(w_hat[:, 5], w[:, 5], rtol=2e-3, atol=1e-3)


def test_outlier_ranking_uses_activation_scale():
    w = torch.ones(4, 10)
    act = torch.arange(10, dtype=torch.float32)
    assert select_outliers(w, act, 0.2).tolist() == [8, 9]
    w[:, 0] = 100.0
    assert select_outliers(w, None, 0.1).tolist() == [0]


def test_module_forward_matches_reference_and_error_is_lloyd_max_like():
    torch.manual_seed(2)
    w, x = torch.randn(96, 256), torch.randn(4, 256)
    tensors, meta = quantize_linear(QuantSpec(method="int2", outliers=0.0), w)
    module = _module(tensors, meta, 256, 96)
    torch.testing.assert_close(module(x), x @ module.dequantize().t(), rtol=1e-5, atol=1e-5)
    # Gaussian weights: relative MSE near the 4-level Lloyd-Max distortion 0.1175 (a bit better: OLS refits).
    mse = ((module.dequantize() - w) ** 2).mean() / (w**2).mean()
    assert 0.08 < mse < 0.1175
    bits = sum(t.numel() * t.element_size() * 8 for t in tensors.values()) / w.numel()
    assert bits == 2 + 32 / 32  # 2-bit codes + fp16 scale and zero per 32 weights


def test_error_feedback_lowers_output_error():
    torch.manual_seed(3)
    in_f, out_f, n = 128, 64, 2048
    mix = torch.randn(in_f, in_f) / in_f**0.5 + torch.eye(in_f)  # correlated inputs, as in real layers
    x = torch.randn(n, in_f) @ mix
    w = torch.randn(out_f, in_f)
    hessian = x.t() @ x / n
    act = x.abs().mean(0)
    plain, meta = quantize_linear(QuantSpec(method="int2", outliers=0.05), w, act_scale=act)
    fed, meta_fb = quantize_linear(QuantSpec(method="int2", outliers=0.05, error_feedback=True), w,
                                   act_scale=act, hessian=hessian)
    assert meta_fb["error_feedback"] and set(fed) == set(plain)
    exact = x @ w.t()
    err_plain = (x @ _module(plain, meta, in_f, out_f).dequantize().t() - exact).norm()
    err_fed = (x @ _module(fed, meta_fb, in_f, out_f).dequantize().t() - exact).norm()
    assert err_fed < 0.85 * err_plain


def _restore(model, originals: dict) -> None:
    for name, module in originals.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, module)


@pytest.mark.slow
def test_calibrated_outliers_rescue_the_real_model(resident_default):
    """On SmolLM2-135M, 3.5 % calibrated fp16 channels keep 2-bit layers usable where plain 2-bit is not.

    Only layers 0-3 are quantized (and restored afterwards) to keep the test short on shared CPUs.
    """
    from airquant.quant import calibrate_act_scales, quantize_model_inplace
    from airquant.quant.swap import decoder_linears

    model, tokenizer = resident_default
    calib = open("/work/shared/data/wikitext2_valid_tokenized_unk.txt").read()
    scales = calibrate_act_scales(model, tokenizer, calib, n_tokens=256)
    assert len(scales) == 7 * model.config.num_hidden_layers
    assert all(s.shape == (model.get_submodule(n).in_features,) and (s > 0).all() for n, s in scales.items())
    ids = tokenizer("The tower is 324 metres tall, about the same height as an 81-storey building, and the "
                    "tallest structure in Paris. Its base is square, measuring 125 metres on each side.",
                    return_tensors="pt").input_ids
    with torch.no_grad():
        reference = model(ids).logits[0]
    names = [n for n in decoder_linears(model) if int(n.split("layers.")[1].split(".")[0]) < 4]
    originals = {n: model.get_submodule(n) for n in names}
    cos = {}
    try:
        for frac in (0.0, 0.035):
            quantize_model_inplace(model, QuantSpec(method="int2", outliers=frac), act_scales=scales,
                                   include=originals.__contains__)
            with torch.no_grad():
                cos[frac] = F.cosine_similarity(model(ids).logits[0], reference, dim=-1).mean().item()
            _restore(model, originals)
    finally:
        _restore(model, originals)
    assert cos[0.035] > cos[0.0] + 0.2 and cos[0.035] > 0.85, cos


def test_outlier_rows_are_padded_and_old_unpadded_stores_still_load():
    torch.manual_seed(5)
    w, x = torch.randn(24, 4096), torch.randn(3, 4096)
    tensors, meta = quantize_linear(QuantSpec(method="int2", outliers=0.035), w)  # 143 outlier channels
    n = meta["n_outliers"]
    assert n == 143 and meta["outlier_cols"] == 144
    assert tensors["outlier_weight"].shape == (24, 144) and tensors["outlier_idx"].shape == (143,)
    assert not tensors["outlier_weight"][:, n:].any()  # the padding is zeros
    padded = _module(tensors, meta, 4096, 24)
    # A store written before the padding: rows of n_out columns and no "outlier_cols" in its meta.
    old_meta = {k: v for k, v in meta.items() if k != "outlier_cols"}
    old = _module({**tensors, "outlier_weight": tensors["outlier_weight"][:, :n].contiguous()}, old_meta, 4096, 24)
    assert old.outlier_weight.shape == (24, n)
    torch.testing.assert_close(padded.dequantize(), old.dequantize(), rtol=0, atol=0)
    torch.testing.assert_close(padded(x), old(x), rtol=0, atol=0)
    cols = tensors["outlier_idx"].long()  # the outlier columns carry their residuals: W to fp16 precision
    assert (padded.dequantize()[:, cols] - w[:, cols]).abs().max() < 1e-2
    with pytest.raises(ValueError, match="outlier_cols=8 is less than n_outliers=143"):
        make_linear({**meta, "outlier_cols": 8}, 4096, 24, False, compute_dtype=torch.float32)
    # below 128 outliers the rows stay unpadded: 18 channels of 512
    small, small_meta = quantize_linear(QuantSpec(method="int2", outliers=0.035), torch.randn(8, 512))
    assert small_meta["outlier_cols"] == small_meta["n_outliers"] == 18
    assert small["outlier_weight"].shape == (8, 18)
