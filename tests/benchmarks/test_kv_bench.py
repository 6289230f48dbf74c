"""benchmarks/kv_bench.py --quick: the whole flow on the CPU with tiny shapes, and the JSON it writes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kv_bench.py"
CACHES = {"none", "tq", "turboquant"}


def test_quick_run_writes_every_key(tmp_path):
    out = tmp_path / "kv_bench.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--batches", "8,32", "--trace", "--workdir",
                           str(tmp_path / "work"), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tq_over_fp16_step" in proc.stdout
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["synthetic"] is True and r["quick"] is True
    assert (r["context"], r["batch"]) == (300, 2)
    assert {"airquant", "torch", "transformers"} <= set(r["versions"])
    for key in ("step_s", "prefill_s", "cache_gb", "max_batch_70b_nf4_15gb", "kv_bytes_per_token_70b"):
        assert set(r[key]) == CACHES and all(v > 0 for v in r[key].values()), (key, r[key])
    for key in ("peak_vram_gb", "cache_vram_gb"):
        assert r[key] == dict.fromkeys(CACHES), key  # no VRAM on the CPU
    assert r["tq_over_fp16_step"] > 0 and r["turboquant_over_fp16_step"] > 0
    assert isinstance(r["targets"]["tq_over_fp16_step"]["met"], bool)
    # the further batch (32, cut to 3 by --quick) times plain and tq again on the same store, with the same bar
    assert r["batches"] == [2, 3] and set(r["details"]["by_batch"]["3"]) == {"none", "tq"}
    bs3 = r["details"]["by_batch"]["3"]
    assert r["tq_over_fp16_step_bs3"] == bs3["tq"]["step_s"] / bs3["none"]["step_s"]
    # --trace: where the time goes at every batch, plain and tq
    assert all(r["details"]["cases"][n]["trace"]["new_tokens"] > 0 and bs3[n]["trace"]["new_tokens"] > 0
               for n in ("none", "tq"))
    # ... traced after every row was timed (the profiler slows what runs after it in the process)
    timed = [c for c in (*r["details"]["cases"].values(), *bs3.values()) if "error" not in c]
    assert timed and not any(c["after_profiler"] for c in timed)
    # the host's share of each case's timed steps
    assert all(0 < r["details"]["cases"][n]["step_host_s"] for n in ("none", "tq"))
    # the layer graphs' counters of each timed generation: none on the CPU (no graphs there)
    assert all("layer_graphs" in c and c["layer_graphs"] is None for c in r["details"]["cases"].values()
               if "error" not in c)
    # ... of decode passes only: the prompts are prefilled before the profiler starts
    traces = [r["details"]["cases"][n]["trace"] for n in ("none", "tq")] + [bs3[n]["trace"] for n in ("none", "tq")]
    assert all(t["prefill_included"] is False and set(t["kinds"]) == {"decode"} for t in traces)
    assert r["targets"]["tq_over_fp16_step_bs3"]["target"] == r["targets"]["tq_over_fp16_step"]["target"] == 1.15
    # the compressed cache holds fewer bytes than the plain one, and lets a larger batch fit
    assert r["cache_gb"]["tq"] < r["cache_gb"]["none"]
    assert r["max_batch_70b_nf4_15gb"]["tq"] > r["max_batch_70b_nf4_15gb"]["none"]
    assert r["kv_bytes_per_token_70b"]["none"] == 2 * 80 * 8 * 128 * 2  # K and V, 80 layers x 8 heads x 128, bf16
    assert "derived" in r["details"]["batch_70b"]["turboquant"]
    # the step is the mean of the timed steps after the warm-up ones (graphs captured, kernels compiled)
    assert r["settings"]["prompt_len"] == 300 - 1 - 5 - 4 and r["settings"]["caches"]["tq"]["bits_v"] == 2
    assert r["settings"]["tq_history_kernel"] == "torch"  # what read the history: torch ops on the CPU
    tq = r["details"]["cases"]["tq"]
    assert tq["warmup_steps"] == 5 and len(tq["steps_s"]) == 5 + 4
    assert abs(tq["step_s"] - sum(tq["steps_s"][5:]) / 4) < 1e-12 and tq["step_median_s"] > 0
    assert not (tmp_path / "work" / "llama3-8b-bfloat16").exists()  # stores are dropped

    # --part batch redoes only the planner part, keeping the measured decode cases
    again = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--part", "batch", "--workdir",
                            str(tmp_path / "work"), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    r2 = json.loads(out.read_text())
    assert r2["step_s"] == r["step_s"] and r2["max_batch_70b_nf4_15gb"] == r["max_batch_70b_nf4_15gb"]
    assert r2["details"]["by_batch"] == r["details"]["by_batch"]
    assert "batch_rederived" in r2


def test_batch_part_without_an_earlier_run_says_what_to_do(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--part", "batch", "--out",
                           str(tmp_path / "none.json")], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "run the whole benchmark" in proc.stderr


def test_a_batch_given_twice_is_timed_once(tmp_path):
    """A further batch equal to an earlier one (``--quick`` caps 8,2 to 2,2) is left out: timing it again as a
    further batch recorded the first batch's rows over and lost ``by_batch`` (a KeyError)."""
    from benchmarks import kv_bench

    quick = kv_bench.parse_args(["--quick", "--batches", "8,2", "--workdir", str(tmp_path)])
    assert quick.batches == [2] and quick.batch == 2
    plain = kv_bench.parse_args(["--batches", "8,32,8,32", "--workdir", str(tmp_path)])
    assert plain.batches == [8, 32]


def test_the_history_kernel_recorded_is_the_one_the_calls_take(monkeypatch):
    """Gluon where it fits the GPU and head size and is preferred, the Triton split kernel where only that fits,
    torch ops on the CPU or where neither fits (a T4 at head size 128)."""
    from airquant.kv import triton_kernel
    from benchmarks import kv_bench

    pytest.importorskip("triton")
    cuda = torch.device("cuda")
    monkeypatch.delenv("AIRQUANT_TQ_HISTORY", raising=False)
    monkeypatch.setattr(triton_kernel, "HISTORY_KERNEL", "gluon")
    caps = {(9, 0): "gluon", (8, 0): "gluon", (7, 5): "torch"}
    for cap, kernel in caps.items():
        monkeypatch.setattr(kv_bench, "device_capability", lambda _d, cap=cap: cap)
        assert kv_bench.history_kernel(cuda, 128) == kernel
    assert kv_bench.history_kernel(cuda, 64) == "triton"  # a T4 at head size 64: the Triton kernel fits
    assert kv_bench.history_kernel(torch.device("cpu"), 128) == "torch"
    monkeypatch.setenv("AIRQUANT_TQ_HISTORY", "triton")
    monkeypatch.setattr(kv_bench, "device_capability", lambda _d: (9, 0))
    assert kv_bench.history_kernel(cuda, 128) == "triton"
    monkeypatch.delenv("AIRQUANT_TQ_HISTORY")
    assert kv_bench.history_kernel(cuda, 64) == "triton"  # the Gluon kernel is built for head size 128 only
