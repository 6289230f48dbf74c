"""The fused GPTQ and AWQ expert GEMV (quant/kernels/gptq_moe ``up_gptq``/``down_gptq``): each pair's expert found by index in
a stacked operand or in pool slots, and the tiered GEMV of direct reads (``tiered_*_gptq``: from a hot slot or a
host buffer by a device table, counting pairs and hits), against the products of each expert's ``dequantize_gptq`` (codes, act-order
groups, packed zeros, scales), under Triton's interpreter (a process of its own: ``TRITON_INTERPRET=1`` must be
set before Triton defines the kernels)."""

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
from airquant.quant.gptq import dequantize_awq, dequantize_gptq
from airquant.quant.kernels import gptq_moe
from airquant.quant.rtn import awq_tensors, gptq_tensors, rtn_quantize
from tests.quant.expert_images import check_counted, check_pair, direct_tiers, routed_products, slot_images

dev = os.environ.get("AQ_DEVICE", "cpu")
torch.manual_seed(0)
num, top, n, k = 5, 3, 48, 96
for awq, bits, act_order, bias, zero_offset in ((0, 4, False, False, 1), (0, 4, True, True, 1), (0, 8, True, False, 0),
                                                (0, 2, False, True, 1), (32, 4, False, True, 0), (96, 4, False, False, 0)):
    parts = []
    for _ in range(num):
        perm = torch.randperm(k) if act_order else None
        rtn = rtn_quantize(torch.randn(n, k), bits, awq or 32, sym=False, perm=perm)
        parts.append(awq_tensors(rtn) if awq else gptq_tensors(rtn, bits, zero_offset=zero_offset))
    dense = torch.stack([dequantize_awq(t["qweight"], t["qzeros"], t["scales"], awq) if awq else
                         dequantize_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, zero_offset)
                         for t in parts])
    stacked = {s: torch.stack([t[s] for t in parts]) for s in gptq_moe.BUFFERS if s in parts[0]}
    rows = torch.randn(num, n) if bias else None
    b = rows if bias else torch.zeros(num, n)
    stack_op = gptq_moe.stacked_operand_gptq({s: t.to(dev) for s, t in stacked.items()}, n, k, bits, zero_offset,
                                             rows.to(dev) if bias else None, awq)
    order = [3, 0, 4, 1, 2]  # expert e in slot order[e]
    pool, offsets, dtypes, bias_at, slot_bytes = slot_images(stacked, rows if bias else None, order)
    pool_op = gptq_moe.pool_operand_gptq(pool.to(dev), offsets, dtypes, n, k, bits, zero_offset,
                                         (bias_at, torch.float32) if bias else None, awq)
    ids = torch.tensor([[2, 0, 4], [1, 2, 3]])
    x, h, w = torch.randn(2, k), torch.randn(6, k), torch.rand(2, top)
    want = routed_products(dense, b, ids, x, h, w)
    slots = torch.tensor(order)[ids]
    for op, route in ((stack_op, ids), (pool_op, slots)):
        check_pair((awq, bits), gptq_moe.up_gptq(x.to(dev), route.to(dev), op).cpu(),
                   gptq_moe.down_gptq(h.to(dev), route.to(dev), w.to(dev), op, torch.float32).cpu(), want)
    # direct reads: every expert's image in a host buffer, experts 1 and 3 also in hot slots
    tiers = direct_tiers(pool, order, dev)
    image = gptq_moe.ImageMatrixGPTQ(n, k, bits, zero_offset, tuple(offsets.get(b) for b in gptq_moe.BUFFERS),
                                     (bias_at, torch.float32) if bias else None, awq)
    check_pair(("tiered", awq, bits), gptq_moe.tiered_up_gptq(x.to(dev), ids.to(dev), image, tiers).cpu(),
               gptq_moe.tiered_down_gptq(h.to(dev), ids.to(dev), w.to(dev), image, tiers, torch.float32).cpu(), want)
    check_counted(tiers, ids, num)
print("ok")
"""


def _run(env: dict) -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_gptq_gemv_equals_each_experts_dequantized_product():
    pytest.importorskip("triton")
    _run({**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)})


@pytest.mark.gpu
def test_cuda_gptq_gemv_equals_each_experts_dequantized_product():
    _run({**os.environ, "AQ_DEVICE": "cuda", "PYTHONPATH": str(REPO)})
