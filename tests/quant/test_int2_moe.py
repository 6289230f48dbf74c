"""The fused int2 expert GEMV (quant/kernels/int2_moe ``up_int2``/``down_int2``): each pair's expert found by index in a
stacked operand or in pool slots, and the tiered GEMV of direct reads (``tiered_*_int2``: from a hot slot or a host
buffer by a device table, counting pairs and hits), against the products of each expert's ``Int2Linear.dequantize`` (codes,
group scales and zeros, fp16 outlier residuals), under Triton's interpreter (a process of its own:
``TRITON_INTERPRET=1`` must be set before Triton defines the kernels)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import os
import torch
from airquant.quant import make_linear, quantize_linear
from airquant.quant.kernels import int2_moe
from airquant.quant.spec import QuantSpec
from tests.quant.expert_images import check_counted, check_pair, direct_tiers, routed_products, slot_images

dev = os.environ.get("AQ_DEVICE", "cpu")
torch.manual_seed(0)
num, top, n, k = 5, 3, 40, 192  # 3.5 % of 192: 7 outlier channels; 80 outliers in the wide case
for outliers, bias in ((0.035, False), (0.0, True), (0.42, True)):
    spec = QuantSpec(method="int2", group=32, outliers=outliers)
    parts = [quantize_linear(spec, torch.randn(n, k) * (1 + torch.rand(k) * 4)) for _ in range(num)]
    meta = parts[0][1]
    stacked = {s: torch.stack([t[s] for t, _ in parts]) for s in parts[0][0]}
    dense = []
    for tensors, _ in parts:
        lin = make_linear(meta, k, n, False, compute_dtype=torch.float32)
        lin.load_state_dict(tensors, assign=True)
        dense.append(lin.dequantize())
    dense = torch.stack(dense)
    n_out = parts[0][0]["outlier_idx"].numel() if "outlier_idx" in parts[0][0] else 0
    cols = stacked["outlier_weight"].shape[-1] if n_out else 0
    rows = torch.randn(num, n) if bias else None
    b = rows if bias else torch.zeros(num, n)
    stack_op = int2_moe.stacked_operand_int2({s: t.to(dev) for s, t in stacked.items()}, n, k, 32, n_out, cols,
                                        rows.to(dev) if bias else None)
    order = [3, 0, 4, 1, 2]  # expert e in slot order[e]
    pool, offsets, dtypes, bias_at, slot_bytes = slot_images(stacked, rows if bias else None, order)
    pool_op = int2_moe.pool_operand_int2(pool.to(dev), offsets, dtypes, n, k, 32, n_out, cols,
                                    (bias_at, torch.float32) if bias else None)
    ids = torch.tensor([[2, 0, 4], [1, 2, 3]])
    x, h, w = torch.randn(2, k), torch.randn(6, k), torch.rand(2, top)
    want = routed_products(dense, b, ids, x, h, w)
    slots = torch.tensor(order)[ids]
    for op, route in ((stack_op, ids), (pool_op, slots)):
        check_pair(outliers, int2_moe.up_int2(x.to(dev), route.to(dev), op).cpu(),
                   int2_moe.down_int2(h.to(dev), route.to(dev), w.to(dev), op, torch.float32).cpu(), want)
    assert n_out == round(outliers * k)
    # direct reads: every expert's image in a host buffer, experts 1 and 3 also in hot slots
    tiers = direct_tiers(pool, order, dev)
    image = int2_moe.ImageMatrixInt2(n, k, 32, n_out, cols, tuple(offsets.get(b) for b in int2_moe.BUFFERS),
                                     (bias_at, torch.float32) if bias else None)
    check_pair("tiered", int2_moe.tiered_up_int2(x.to(dev), ids.to(dev), image, tiers).cpu(),
               int2_moe.tiered_down_int2(h.to(dev), ids.to(dev), w.to(dev), image, tiers, torch.float32).cpu(), want)
    check_counted(tiers, ids, num)
print("ok")
"""


def _run(env: dict) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_int2_gemv_equals_each_experts_dequantized_product():
    pytest.importorskip("triton")
    _run({**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)})


@pytest.mark.gpu
def test_cuda_int2_gemv_equals_each_experts_dequantized_product():
    _run({**os.environ, "AQ_DEVICE": "cuda", "PYTHONPATH": str(REPO)})
