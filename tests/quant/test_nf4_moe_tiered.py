"""The tiered NF4 GEMV (quant/kernels/nf4_moe ``tiered_up``/``tiered_down``): each pair's expert read from a pool
slot or from a host buffer by a device table, against the decoded weights' products, under Triton's interpreter
(a process of its own: ``TRITON_INTERPRET=1`` must be set before Triton defines the kernels). The CUDA run with a
pinned host buffer: tests/engine/test_expert_fused.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def expert_images(num: int, n: int, k: int, blocksize: int, double: bool, bias: torch.dtype | None = None):
    """``num`` random ``[n, k]`` NF4 matrices as expert images (each buffer 64-byte aligned, in ``BUFFERS``
    order, then a random ``[n]`` bias row of dtype ``bias`` if given), their decoded fp32 weights ``[num, n, k]``
    (and the biases as fp32 ``[num, n]``, else None) and the ``ImageMatrix`` describing an image."""
    from airquant.quant.kernels.nf4_moe import BUFFERS, ImageMatrix
    from airquant.quant.nf4 import decode_nf4_stacked, quantize_nf4

    torch.manual_seed(0)
    parts = [quantize_nf4(torch.randn(n, k), blocksize, double)[0] for _ in range(num)]
    offsets, at = {}, 0
    for name in BUFFERS:
        if name in parts[0]:
            offsets[name] = at
            at += -(-parts[0][name].numel() * parts[0][name].element_size() // 64) * 64
    rows = torch.randn(num, n).to(bias) if bias is not None else None
    bias_at = at
    if bias is not None:
        at += -(-n * rows.element_size() // 64) * 64
    images = torch.zeros(num, at, dtype=torch.uint8)
    for e, tensors in enumerate(parts):
        for name, off in offsets.items():
            raw = tensors[name].contiguous().reshape(-1).view(torch.uint8)
            images[e, off:off + raw.numel()] = raw
        if bias is not None:
            images[e, bias_at:bias_at + n * rows.element_size()] = rows[e].view(torch.uint8)
    stacked = {name: torch.stack([t[name] for t in parts]) for name in parts[0]}
    dense = decode_nf4_stacked(stacked, n, k, blocksize, double)
    matrix = ImageMatrix(n, k, blocksize, double, tuple(offsets.get(b) for b in BUFFERS),
                         (bias_at, bias) if bias is not None else None)
    return images, dense, rows.float() if rows is not None else None, matrix


SCRIPT = """
import torch
from airquant.quant.kernels import nf4_moe
from tests.quant.test_nf4_moe_tiered import expert_images
from airquant.quant.kernels.nf4_moe import BUFFERS, TieredConfig
# the default launch; 16-word steps (K = 192 is 24 words: a masked tail) with loads a step ahead and the code
# books from device copies; the down projection a program per pair, summed after
CONFIGS = ((TieredConfig(), False), (TieredConfig(block_n=8, block_w=16, warps=2, prefetch=True), True),
           (TieredConfig(block_n=16, split=True), False))
for (double, bias), (config, tables) in [(c, f) for c in ((False, None), (True, None), (True, torch.bfloat16),
                                                          (False, torch.float32)) for f in CONFIGS]:
    nf4_moe.TIERED = {"up": config, "down": config}
    num, top = 6, 3
    images, dense, rows, m = expert_images(num, 40, 192, 64, double, bias)
    b = rows if rows is not None else torch.zeros(num, 40)
    stride, start = images.shape[1] + 64, 128  # host images apart from each other, after other bytes
    host = torch.full((start + num * stride,), 7, dtype=torch.uint8)
    for e in range(num):
        host[start + e * stride:start + e * stride + images.shape[1]] = images[e]
    pool = torch.full((4, images.shape[1] + 192), 9, dtype=torch.uint8)
    table = torch.full((num,), -1, dtype=torch.int32)
    for slot, e in ((1, 2), (3, 4)):  # experts 2 and 4 in the pool; what the host holds for them is wrong
        pool[slot, :images.shape[1]] = images[e]
        table[e] = slot
        host[start + e * stride:start + e * stride + images.shape[1]] = 0
    counts, hits = torch.zeros(num, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    books = {}
    if tables:  # the code books of image 0 (every image has the same ones); the images' own copies spoilt
        for name, key in (("quant_map", "quant_map"), ("nested_quant_map", "nested_quant_map")):
            off = m.offsets[BUFFERS.index(name)]
            if off is not None:
                size = 16 if name == "quant_map" else 256
                books[key] = images[0, off:off + 4 * size].view(torch.float32).clone()
                for e in range(num):
                    host[start + e * stride + off:start + e * stride + off + 4 * size] = 0
                pool[:, off:off + 4 * size] = 0
    tiers = nf4_moe.Tiers(host, start, stride, pool, table, counts, hits, **books)
    ids = torch.tensor([[2, 0, 5], [4, 2, 1]])
    x = torch.randn(2, 192)
    up = nf4_moe.tiered_up(x, ids, m, tiers)
    want = torch.stack([dense[ids.reshape(-1)[p]] @ x[p // top] + b[ids.reshape(-1)[p]] for p in range(6)])
    assert (up - want).abs().max() <= 1e-5 * want.abs().max(), (up - want).abs().max()
    h, w = torch.randn(6, 192), torch.rand(2, top)
    down = nf4_moe.tiered_down(h, ids, w, m, tiers, torch.float32)
    want = torch.stack([sum(w[t, j] * (dense[ids[t, j]] @ h[t * top + j] + b[ids[t, j]]) for j in range(top))
                        for t in range(2)])
    assert (down - want).abs().max() <= 1e-5 * want.abs().max(), (down - want).abs().max()
    assert counts.tolist() == [1, 1, 2, 0, 1, 1] and hits.item() == 3, (counts, hits)
print("ok")
"""


def test_tiered_gemv_reads_each_expert_where_the_table_says():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
