"""kv_attention_speed --paged: the sweep runs end to end (Triton's interpreter on the CPU, fp16, small arena) and
records every launch setting beside the sdpa row and the bytes floor; the GPU gives the times."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

DRY_RUN = """
import argparse, json, torch
import tests.kv.interpreted_tq_kernel  # the interpreter's scalar fix
import benchmarks.kv_attention_speed as bench
bench.PROGRAMS, bench.TILES = (264, 1056), ((32, 4, 1),)
args = argparse.Namespace(kv_heads=2, head_dim=64, tokens=300, batches=[2, 3], group_sizes=[2], sweep="full")
print(json.dumps(bench.paged_sweep(args, device="cpu", dtype=torch.float16)))
"""


def test_paged_sweep_records_each_launch_setting_beside_sdpa_and_the_floor():
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    run = subprocess.run([sys.executable, "-c", DRY_RUN], env=env, cwd=root, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["settings"]["copy_gbps"] > 0 and set(out["rows"]) == {"b2_g2", "b3_g2"}
    for row in out["rows"].values():
        kernels = row["kernels"]
        assert set(kernels) == {f"v{c}{v}_p{p}_n32_w4_s1_r0" for c, v in ("00", "10", "01") for p in (264, 1056)}
        assert row["tq_bytes"] < row["fp16_cache_bytes"] and row["tq_floor_ms"] > 0
        # every setting computes the same attention (splits and variants change no result beyond fp16 rounding)
        assert all(k["max_abs_diff"] < 1e-2 for k in kernels.values())
        assert row["best"] in kernels and row["best_ms"] == min(k["ms"] for k in kernels.values())
        assert row["before_ms"] == kernels["v00_p1056_n32_w4_s1_r0"]["ms"]
