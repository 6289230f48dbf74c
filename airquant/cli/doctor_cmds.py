"""``airquant doctor [STORE]``: what this runtime gives AirQuant, measured, and what AirQuant will do with it.

GPU, compute capability, VRAM, host RAM, the pinned host->GPU link (measured, under a second), the host's NF4
GEMV and memory-copy bandwidths with the kernel and threads in use (about a second; saved with the link's figure
for ``--experts auto``, expert_plan.figures_for), the disk read
speed of the store's folder (page cache dropped first), the compute dtype and kernel path of each scheme
(the capability rule of airquant.engine.capability) and, given a store, the plan ``airquant plan`` would make.
On a machine without a GPU it says so and reports the CPU side. The first cell after setup of notebook 01 runs
it, so a Colab user sees at once what the runtime is (a T4: fp16 compute, PCIe 3).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from airquant.cli.run_cmds import add_plan_flags, route_for_flags, runs_line
from airquant.engine.moe.sizing import save_figures
from airquant.units import GB

READ_CHUNK = 16 << 20
READ_SECONDS = 1.0  # the disk read test stops after this long (or at the end of the store's shards)
HOST_SECONDS = 0.8  # the host GEMV and copy tests together (plus ~0.2 s to set up their 64 MB)


def disk_read_speed(folder: Path, seconds: float = READ_SECONDS) -> tuple[float, int, bool]:
    """(GB/s, bytes read, cold) reading the folder's largest files for up to ``seconds``. Each file's pages are
    dropped from the page cache first (posix_fadvise DONTNEED: clean pages of any file one can read), so the
    figure is the disk's, not RAM's; ``cold`` is False where the OS has no such call."""
    files = sorted((p for p in folder.rglob("*.safetensors") if p.is_file()), key=lambda p: -p.stat().st_size)
    cold = hasattr(os, "posix_fadvise")
    buf, done, start = bytearray(READ_CHUNK), 0, time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            if cold:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
                while (n := f.readinto(buf)) and time.perf_counter() - start < seconds:
                    done += n
        finally:
            os.close(fd)
        if time.perf_counter() - start >= seconds:
            break
    elapsed = time.perf_counter() - start
    return (done / elapsed / GB if done and elapsed > 0 else 0.0), done, cold


def _head_dim(store: Path) -> int:
    cfg = json.loads((store / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def hardware_lines(device: str = "auto") -> tuple[list[str], "object", float | None]:
    """The GPU/RAM/link lines, the torch device they describe and the measured link (GB/s; None: no GPU)."""
    import psutil  # lazy: --help startup

    from airquant.engine.runner import resolve_device
    from airquant.eval.perf import measure_link_bandwidth  # lazy: --help startup
    from airquant.quant.kernels import FORCE_ENV, device_capability, forced_capability  # lazy: --help startup

    dev = resolve_device(device)
    mem = psutil.virtual_memory()
    ram = f"host RAM  : {mem.total / GB:.1f} GB total, {mem.available / GB:.1f} GB available"
    host = host_line()
    if dev.type != "cuda":
        why = "--device cpu" if device == "cpu" else "torch sees no CUDA GPU"
        return [f"GPU       : none ({why}): AirQuant runs on the CPU here; the kernels and the streamed "
                "engine's overlap need a CUDA GPU", ram, host], dev, None
    props = torch.cuda.get_device_properties(dev)
    cap = device_capability(dev)
    forced = f" (forced by {FORCE_ENV}; the GPU is sm_{props.major}{props.minor})" if forced_capability() else ""
    free, total = torch.cuda.mem_get_info(dev)
    link = measure_link_bandwidth(dev, nbytes=128 << 20, repeats=5)
    save_figures(link_gbps=link.gb_per_s)
    return [f"GPU       : {props.name}, compute capability {cap[0]}.{cap[1]}{forced}",
            f"VRAM      : {total / GB:.1f} GB total, {free / GB:.1f} GB free",
            ram,
            f"link      : pinned host->GPU {link.gb_per_s:.1f} GB/s (measured, {link.nbytes >> 20} MiB copies)",
            host], dev, link.gb_per_s


def host_line() -> str:
    """The host NF4 GEMV and memory-copy bandwidths (about a second), saved for ``--experts auto``'s rule."""
    from airquant.quant.kernels import nf4_cpu  # lazy: --help startup

    bw = nf4_cpu.measure(HOST_SECONDS)
    save_figures(host_gemv_gbps=bw.gemv_gbps, host_copy_gbps=bw.copy_gbps)
    return bw.describe()


def plan_args(device: str = "auto", max_vram: float | None = None, max_ram: float | None = None) -> argparse.Namespace:
    """``airquant plan``'s flags with their defaults and these values (``doctor_text`` called from Python)."""
    p = argparse.ArgumentParser(prog="airquant doctor")
    add_plan_flags(p)
    given = ["--device", device, *(["--max-vram", str(max_vram)] if max_vram is not None else []),
             *(["--max-ram", str(max_ram)] if max_ram is not None else [])]
    return p.parse_args(given)


def bound_line(route, link_gbps: float | None, disk_gbps: float) -> str:
    """The decode step's lower bound under ``route``'s plan: the slower of the link and the disk.

    A plan for a GPU made where there is none (``--max-vram`` on a laptop, for a T4) takes PCIe 3's link."""
    from airquant.engine.memory.step_bound import PCIE3_GBPS, step_bound  # lazy: --help startup

    if route.mode == "resident":
        return "step      : resident: every layer is loaded once; a decode step is bound by compute"
    note = ""
    if link_gbps is None and route.hardware.vram_bytes is not None:
        link_gbps, note = PCIE3_GBPS, " (PCIe 3, assumed: no GPU here to measure)"
    bound = step_bound(route.plan, route.candidate.manifest.layer_bytes, link_gbps=link_gbps, disk_gbps=disk_gbps)
    return bound.describe(route.batch_size, note)


def store_lines(store: Path, args: argparse.Namespace, link_gbps: float | None = None) -> list[str]:
    """Disk read speed of the store's folder, the plan ``airquant plan STORE`` makes with the same flags, and the
    decode step that plan allows (the slowest of link and disk)."""
    gbps, nbytes, cold = disk_read_speed(store)
    lines = [f"disk      : {gbps:.2f} GB/s reading {nbytes / GB:.2f} GB of {store}"
             + ("" if cold else " (page cache not dropped: may be RAM speed)")]
    route, engine = route_for_flags([store], args)
    runs = runs_line(route, args)
    return lines + ["plan      :"] + [f"  {line}" for line in route.describe(engine).splitlines()] + \
        ([f"  {runs}"] if runs else []) + [bound_line(route, link_gbps, gbps)]


def doctor_text(store: str | Path | None = None, device: str = "auto", max_vram: float | None = None,
                max_ram: float | None = None, args: argparse.Namespace | None = None) -> str:
    """The whole report (what ``airquant doctor`` prints and notebook 01 shows). ``args``: the plan's flags
    (``plan_args``; ``airquant doctor`` passes its own), else plan's defaults with ``device``/``max_*``."""
    from airquant.engine.capability import capability_plan
    from airquant.quant.kernels import device_capability  # lazy: --help startup
    from airquant.store.manifest import open_store  # lazy: --help startup

    args = args if args is not None else plan_args(device, max_vram, max_ram)
    lines, dev, link_gbps = hardware_lines(args.device)
    cap = device_capability(dev)
    if store is None:
        plan = capability_plan(cap, "bfloat16")
        lines += [*plan.describe(), "store     : none given (airquant doctor STORE adds its disk speed and plan)"]
        return "\n".join(lines)
    store = Path(store)
    manifest = open_store(store)
    lines += capability_plan(cap, manifest.dtype, head_dim=_head_dim(store)).describe()
    return "\n".join(lines + store_lines(store, args, link_gbps))


def cmd_doctor(args) -> int:
    print(doctor_text(args.store, args=args))
    return 0


def add_doctor_parser(sub) -> None:
    p = sub.add_parser("doctor", help="GPU, capability, VRAM, RAM, link and disk speed; dtype and kernels; the plan")
    p.add_argument("store", nargs="?", default=None, metavar="STORE",
                   help="a store to measure and plan for (with plan's flags: the plan `airquant plan` prints)")
    add_plan_flags(p)
    p.set_defaults(func=cmd_doctor)
