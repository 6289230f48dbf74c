"""The TurboQuant Triton kernels on the CPU, through Triton's interpreter: the flat kernel and the paged one
(the decode loop's arena read in place through its page table) equal the torch ops. The GPU tests
(test_triton_gpu.py) run the compiled kernels; these run the same kernel code on any machine."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_flat_and_paged_kernels_equal_the_torch_ops():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = Path(__file__).with_name("interpreted_tq_kernel.py")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    # fp16 products gather from fp16 centroid tables: the same bits as fp32 tables converted in the kernel
    half = results.pop("half")
    assert half["half_buckets"] >= 2 and half["half_tables"] and half["half_same"] and half["half_err"] < 2e-3, half
    for name, r in results.items():
        assert r["buckets"] >= 2, (name, r)  # several history lengths, each its own launch
        assert r["interleaved"], name  # slots' pages are not contiguous runs of the pool
        assert r["flat"] < 1e-5, (name, r)
        assert r["paged"] < 1e-5, (name, r)
        # a static pass (every row at once, whole windows, a history span past the longest, the mask from the
        # rows' lengths): the same rows as the bucketed calls, and the paged kernel equal to its torch ops
        assert r["static_vs_buckets"] < 1e-5 and r["static"] < 1e-5, (name, r)
        # each row reading only its own history (Paged.lengths): the same bits as reading every row as far as the
        # longest (the columns past a row's own are masked), in a static pass and in one launch for every row
        assert r["static_own_same"] and r["rows_same"] and r["rows"] < 1e-5, (name, r)
        assert len(set(r["rows_lengths"])) > 1, (name, r)  # rows of different lengths
    assert {name.split("/")[1] for name in results} == {"00", "10", "01"}  # every variant ran
    assert 0 in results["k4v2/00"]["rows_lengths"]  # a row with no history yet: its window alone, in the same launch
