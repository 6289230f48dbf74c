"""GPTQ / AWQ modules read the published on-disk layouts.

The reference packers below are written the way AutoGPTQ's ``QuantLinear.pack`` and AutoAWQ's
``WQLinear_GEMM.from_linear`` loop over words (numpy uint32, one shift at a time), independently
of the vectorised packers in airquant.quant.rtn; dequantization is checked against
(q - zero) * scale computed per element in float64 from the integers before packing.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from airquant.quant import make_linear
from airquant.quant.gptq import dequantize_awq, dequantize_gptq
from airquant.quant.prequant import detect
from airquant.quant.rtn import awq_tensors, gptq_tensors, rtn_quantize
from tests.quant.checkpoints import tiny_llama_config, write_synthetic_gptq_checkpoint

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]


def autogptq_pack(q: np.ndarray, zeros: np.ndarray, bits: int, zero_offset: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """q [out, in], zeros [G, out] -> (qweight [in*bits/32, out], qzeros [G, out*bits/32]) as int32."""
    intweight = q.T.astype(np.uint32)
    per = 32 // bits
    qweight = np.zeros((intweight.shape[0] // per, intweight.shape[1]), dtype=np.uint32)
    i, row = 0, 0
    while row < qweight.shape[0]:
        for j in range(i, i + per):
            qweight[row] |= intweight[j] << np.uint32(bits * (j - i))
        i += per
        row += 1
    z = (zeros - zero_offset).astype(np.uint32)
    qzeros = np.zeros((z.shape[0], z.shape[1] // per), dtype=np.uint32)
    i, col = 0, 0
    while col < qzeros.shape[1]:
        for j in range(i, i + per):
            qzeros[:, col] |= z[:, j] << np.uint32(bits * (j - i))
        i += per
        col += 1
    return qweight.view(np.int32), qzeros.view(np.int32)


def autoawq_pack(q: np.ndarray, zeros: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q [out, in], zeros [G, out] -> (qweight [in, out/8], qzeros [G, out/8]) in AWQ's column order."""
    def pack(intweight: np.ndarray) -> np.ndarray:
        packed = np.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=np.uint32)
        for col in range(intweight.shape[1] // 8):
            for i in range(8):
                packed[:, col] |= intweight[:, col * 8 + AWQ_ORDER_MAP[i]].astype(np.uint32) << np.uint32(i * 4)
        return packed.view(np.int32)

    return pack(q.T), pack(zeros)


def reference_weight(q, zeros, scales, g_idx) -> torch.Tensor:
    """float64 [out, in]: W[n, k] = (q[n, k] - zeros[g_idx[k], n]) * scales[g_idx[k], n], element by element."""
    out_f, in_f = q.shape
    w = np.empty((out_f, in_f))
    s = scales.astype(np.float64)
    for k in range(in_f):
        g = g_idx[k]
        w[:, k] = (q[:, k].astype(np.int64) - zeros[g]) * s[g]
    return torch.from_numpy(w)


CASES = [  # (bits, group_size, in_features, act_order): 160 % 64 != 0 leaves a partial last group
    (4, 64, 160, False),
    (4, 64, 160, True),
    (4, 128, 256, True),
    (4, -1, 96, False),
    (8, 32, 96, True),
    (2, 32, 128, False),
]


@pytest.mark.parametrize("bits,group_size,in_f,act_order", CASES)
@pytest.mark.parametrize("zero_offset", [1, 0])
def test_gptq_layout(bits, group_size, in_f, act_order, zero_offset):
    torch.manual_seed(bits * 1000 + in_f)
    out_f = 64
    w = torch.randn(out_f, in_f)
    rtn = rtn_quantize(w, bits, group_size, sym=False, perm=torch.randperm(in_f) if act_order else None)
    q, zeros, g_idx = rtn.q.numpy(), rtn.zeros.numpy(), rtn.g_idx.numpy()
    qweight, qzeros = autogptq_pack(q, zeros, bits, zero_offset)

    ours = gptq_tensors(rtn, bits, zero_offset=zero_offset)
    assert np.array_equal(ours["qweight"].numpy(), qweight) and np.array_equal(ours["qzeros"].numpy(), qzeros)

    ref = reference_weight(q, zeros, rtn.scales.numpy(), g_idx)
    deq = dequantize_gptq(torch.from_numpy(qweight), torch.from_numpy(qzeros), rtn.scales, rtn.g_idx, bits, zero_offset)
    assert torch.equal(deq.double(), ref)

    meta = {"scheme": "gptq", "bits": bits, "group_size": group_size, "desc_act": act_order, "sym": False,
            "zero_offset": zero_offset}
    module = make_linear(meta, in_f, out_f, True, compute_dtype=torch.float32)
    bias = torch.randn(out_f)
    module.load_state_dict({**ours, "bias": bias})
    x = torch.randn(3, in_f)
    torch.testing.assert_close(module(x).double(), x.double() @ ref.t() + bias.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("group_size,in_f", [(64, 160), (128, 256), (32, 96)])
def test_awq_gemm_layout(group_size, in_f):
    torch.manual_seed(in_f)
    out_f = 48
    w = torch.randn(out_f, in_f)
    rtn = rtn_quantize(w, 4, group_size, sym=False)
    q, zeros = rtn.q.numpy(), rtn.zeros.numpy()
    qweight, qzeros = autoawq_pack(q, zeros)

    ours = awq_tensors(rtn)
    assert np.array_equal(ours["qweight"].numpy(), qweight) and np.array_equal(ours["qzeros"].numpy(), qzeros)

    ref = reference_weight(q, zeros, rtn.scales.numpy(), rtn.g_idx.numpy())
    deq = dequantize_awq(torch.from_numpy(qweight), torch.from_numpy(qzeros), rtn.scales, group_size)
    assert torch.equal(deq.double(), ref)

    module = make_linear({"scheme": "awq", "bits": 4, "group_size": group_size, "version": "gemm"},
                         in_f, out_f, False, compute_dtype=torch.float32)
    module.load_state_dict(ours)
    x = torch.randn(2, in_f)
    torch.testing.assert_close(module(x).double(), x.double() @ ref.t(), rtol=1e-5, atol=1e-5)


def test_rtn_grid_is_close_to_the_weight():
    torch.manual_seed(0)
    w = torch.randn(32, 256)
    for sym in (True, False):
        err = (rtn_quantize(w, 4, 64, sym=sym).dequantize() - w).norm() / w.norm()
        assert err < 0.12, (sym, err)


@pytest.mark.parametrize("method,desc_act", [("gptq", True), ("awq", False)])
def test_synthetic_checkpoint_folder(tmp_path, method, desc_act):
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    ckpt = write_synthetic_gptq_checkpoint(tmp_path / method, method=method, group_size=64, desc_act=desc_act)
    config = json.loads((ckpt.path / "config.json").read_text())
    found = detect(config)
    assert found["method"] == method

    tensors = load_file(str(ckpt.path / "model.safetensors"))
    model = LlamaForCausalLM(LlamaConfig(**tiny_llama_config())).eval()
    model.load_state_dict(ckpt.reference_state_dict, strict=True)
    prefix = "model.layers.1.mlp.down_proj"
    down = model.get_submodule(prefix)
    module = make_linear(found["module_meta"], down.in_features, down.out_features, False, compute_dtype=torch.float32)
    module.load_state_dict({k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")})
    x = torch.randn(4, down.in_features)
    torch.testing.assert_close(module(x), down(x), rtol=1e-5, atol=1e-5)


def test_against_gptqmodel_if_installed():
    """gptqmodel packs an RTN grid with its own packer (its in-memory v2 layout: zeros without the
    v1 offset); our GPTQ linear must read those tensors back exactly and agree with its forward."""
    gptqmodel = pytest.importorskip("gptqmodel")
    try:
        from gptqmodel.nn_modules.qlinear.torch import TorchLinear as Peer  # gptqmodel >= 7
    except ImportError:
        try:
            from gptqmodel.nn_modules.qlinear.torch import TorchQuantLinear as Peer
        except ImportError as exc:
            pytest.skip(f"gptqmodel {getattr(gptqmodel, '__version__', '?')} API differs: {exc}")
    torch.manual_seed(0)
    out_f, in_f, gs = 64, 256, 64  # its packer wants both dims divisible by 32
    rtn = rtn_quantize(torch.randn(out_f, in_f), 4, gs, sym=False, perm=torch.randperm(in_f))
    linear = torch.nn.Linear(in_f, out_f, bias=False)
    linear.weight.data = rtn.dequantize()
    peer = Peer(bits=4, group_size=gs, sym=False, desc_act=True, in_features=in_f, out_features=out_f, bias=False)
    peer.pack(linear, rtn.scales.float().t(), rtn.zeros.float().t(), rtn.g_idx)
    written = {k: v.clone() for k, v in peer.state_dict().items() if k in ("qweight", "qzeros", "scales", "g_idx")}
    ours = make_linear({"scheme": "gptq", "bits": 4, "group_size": gs, "desc_act": True, "sym": False,
                        "zero_offset": 0}, in_f, out_f, False, compute_dtype=torch.float32)
    ours.load_state_dict(written)
    x = torch.randn(3, in_f)
    torch.testing.assert_close(ours(x), x @ rtn.dequantize().t(), rtol=1e-5, atol=1e-4)
    peer.post_init()
    torch.testing.assert_close(ours(x), peer(x.half()).float(), rtol=2e-2, atol=5e-2)


def test_against_gptqmodel_awq_packer_if_installed():
    """The same for AWQ GEMM: gptqmodel's AwqTorchLinear packs (interleaved columns), we read it back."""
    pytest.importorskip("gptqmodel")
    try:
        from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear
    except ImportError as exc:
        pytest.skip(f"this gptqmodel has no AwqTorchLinear: {exc}")
    torch.manual_seed(1)
    out_f, in_f, gs = 64, 256, 64
    rtn = rtn_quantize(torch.randn(out_f, in_f), 4, gs, sym=False)
    linear = torch.nn.Linear(in_f, out_f, bias=False)
    linear.weight.data = rtn.dequantize()
    peer = AwqTorchLinear(bits=4, group_size=gs, sym=False, desc_act=False, in_features=in_f, out_features=out_f,
                          bias=False)
    peer.pack(linear, rtn.scales.float().t(), rtn.zeros.float().t())
    written = {k: v.clone() for k, v in peer.state_dict().items() if k in ("qweight", "qzeros", "scales")}
    ours = make_linear({"scheme": "awq", "bits": 4, "group_size": gs, "version": "gemm"}, in_f, out_f, False,
                       compute_dtype=torch.float32)
    ours.load_state_dict(written)
    x = torch.randn(3, in_f)
    torch.testing.assert_close(ours(x), x @ rtn.dequantize().t(), rtol=1e-5, atol=1e-4)
    peer.post_init()
    torch.testing.assert_close(ours(x), peer(x.half()).float(), rtol=2e-2, atol=5e-2)
