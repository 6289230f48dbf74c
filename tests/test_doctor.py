"""``airquant doctor``: the report on a CPU-only machine, with and without a store; the disk read test."""

from __future__ import annotations

import pytest
import torch

from airquant.cli import main
from airquant.cli.doctor_cmds import disk_read_speed, doctor_text


def test_doctor_without_a_store_says_cpu_and_lists_kernels(capsys):
    assert main(["doctor", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "GPU       : none (--device cpu): AirQuant runs on the CPU" in out
    assert "host RAM  :" in out and "GB available" in out
    assert "compute   : bfloat16 (cpu; store bfloat16)" in out and "tf32      : no GPU" in out
    for scheme in ("dense", "nf4", "int2", "gptq/awq", "gguf", "tq-attn"):
        assert f"kernel    : {scheme}" in out
    assert "store     : none given" in out and "link" not in out  # no GPU, no link to measure


def test_doctor_with_a_store_measures_disk_and_plans(tiny_store):
    text = doctor_text(tiny_store, device="cpu", max_ram=4)
    assert "disk      :" in text and str(tiny_store) in text
    assert "plan      :" in text and "choice    :" in text and "resident" in text
    assert "store     : none given" not in text


def test_doctor_plans_a_t4_sized_gpu_without_one(tiny_store):
    """--max-vram plans for a card of that size even on a CPU machine (the router's rule)."""
    text = doctor_text(tiny_store, device="cpu", max_vram=15, max_ram=12)
    assert "--max-vram 15 GiB" in text and "--max-ram 12 GiB" in text


def test_doctor_bounds_a_streamed_step_by_link_or_disk():
    """The prediction used to be the link's alone; a store read from disk every step is bound by the disk."""
    from types import SimpleNamespace

    from airquant.cli.doctor_cmds import bound_line
    from airquant.engine.memory.placement import StreamPlan

    gb = 10**9
    streamed = StreamPlan(tiers=["vram", "ram", "disk", "disk"], slot_bytes=gb, slots=2, fixed_bytes=0)
    route = SimpleNamespace(mode="streamed", plan=streamed, batch_size=1, hardware=SimpleNamespace(vram_bytes=15 * gb),
                            candidate=SimpleNamespace(manifest=SimpleNamespace(layer_bytes=[gb] * 4)))
    step = bound_line(route, None, disk_gbps=0.2)  # a Drive-mounted store; no GPU here to measure the link
    assert "bound by the disk (disk 2.00 GB at 0.20 GB/s = 10.000 s; link 3.00 GB at 12.50 GB/s (PCIe 3, assumed" \
        in step and "at most 0.10 tok/s at batch 1" in step
    assert "bound by the link" in bound_line(route, 1.0, disk_gbps=5.0)
    assert "bound by compute" in bound_line(SimpleNamespace(mode="resident"), 1.0, 5.0)


def test_disk_read_speed_reads_the_store_files(tmp_path):
    (tmp_path / "a.safetensors").write_bytes(b"\x01" * (3 << 20))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.safetensors").write_bytes(b"\x02" * (1 << 20))
    (tmp_path / "notes.txt").write_bytes(b"\x03" * (5 << 20))  # not a shard: not read
    gbps, nbytes, cold = disk_read_speed(tmp_path, seconds=60)
    assert nbytes == 4 << 20 and gbps > 0 and cold == hasattr(__import__("os"), "posix_fadvise")
    assert disk_read_speed(tmp_path / "sub" / "missing-none", seconds=1)[:2] == (0.0, 0)


def test_doctor_reports_a_missing_store(tmp_path, capsys):
    assert main(["doctor", str(tmp_path / "nope"), "--device", "cpu"]) == 2
    assert "airquant: error:" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_doctor_on_a_gpu_measures_the_link(tiny_store, monkeypatch):
    monkeypatch.setenv("AIRQUANT_FORCE_CAPABILITY", "7.5")
    text = doctor_text(tiny_store, device="cuda")
    assert "compute capability 7.5 (forced by AIRQUANT_FORCE_CAPABILITY" in text
    assert "link      : pinned host->GPU" in text and "VRAM      :" in text


def test_doctor_prints_the_plan_that_plan_prints_with_the_same_flags(tiny_store, capsys):
    """One planner, one set of flags: `doctor STORE FLAGS` shows exactly `plan STORE FLAGS`'s placement."""
    flags = ["--device", "cpu", "--max-ram", "4", "--batch", "3", "--context", "96", "--host-embedding"]
    assert main(["plan", str(tiny_store), *flags]) == 0
    planned = capsys.readouterr().out
    assert main(["doctor", str(tiny_store), *flags]) == 0
    doctor = capsys.readouterr().out
    body, step = doctor.split("plan      :\n", 1)[1].rsplit("\nstep      :", 1)
    assert [line.strip() for line in body.splitlines()] == [line.strip() for line in planned.splitlines()[:-1]]
    assert "bound by compute" in step  # resident on the CPU: nothing streamed
    assert "batch 3 x 96 tokens" in body
