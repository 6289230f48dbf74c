"""What a machine of several GPUs gives N engine actors: the host RAM each engine's plan pins, and the
pinned host-to-GPU link per GPU while every GPU copies at once (``benchmarks/scale_bench.py --part multi``).

Host RAM is planned, not measured: each Ray engine actor opens its own ``Engine``, and each engine pins its
own RAM tier (nothing is shared between actors), so N engines hold N times what one engine's plan holds in
host RAM (``StreamPlan.host_parts``, the figure ``airquant plan`` prints). The plan is the engine's own
(``runner.placement_for``) for the job's batch size and context, made on this machine without opening an engine.

The link: one thread per GPU, each with its own 1 GiB pinned host buffer and device buffer, all copying
host-to-device at once after a barrier, repeated; the median per GPU beside the same copy on each GPU alone
(stream_bench's ``link_pinned_gbps`` is that alone figure on one GPU). GPUs behind one PCIe switch share its
uplink, which halves the together figure on some hosts.
"""

from __future__ import annotations

import logging
import statistics
import threading
from pathlib import Path

import psutil
import torch

from airquant.eval.perf import copy_seconds as link_copy_seconds
from airquant.eval.perf import link_buffers
from airquant.units import GB

log = logging.getLogger("scale_bench")
LINK_BYTES = 1 << 30
LINK_REPEATS = 10
BARRIER_TIMEOUT_S = 120.0  # a thread that fails breaks the barrier; the others must not wait forever


# -- host RAM per engine -----------------------------------------------------------------------
def planned_host_ram(store: Path, prompts: Path, batch_size: int, max_new_tokens: int, device: str,
                     engines: int) -> dict:
    """One engine's planned host RAM for this job, times ``engines``, against this machine's RAM (psutil)."""
    from transformers import AutoTokenizer

    from airquant.config import EngineConfig, GenerateConfig
    from airquant.engine.memory.planner import RAM_FRACTION
    from airquant.engine.runner import engine_dtype, placement_for, resolve_device
    from airquant.engine.skeleton import load_config
    from airquant.jobs.batch import BatchJob, longest_first, read_prompts
    from airquant.store.manifest import open_store

    job = BatchJob(prompts, prompts.with_suffix(".unused"), batch_size,
                   gen=GenerateConfig(max_new_tokens=max_new_tokens))
    # The context the Ray driver gives its engines: the longest prompt plus its new tokens.
    context, _ = longest_first(AutoTokenizer.from_pretrained(store / "tokenizer"), store, read_prompts(prompts), job)
    manifest, dev = open_store(store), resolve_device(device)
    cfg = EngineConfig(device=device, batch_size=batch_size, context=context)
    plan = placement_for(manifest, cfg, dev, load_config(store), engine_dtype(manifest, None, dev))
    parts = plan.host_parts(manifest.layer_bytes)
    per_engine = sum(parts.values())
    ram = psutil.virtual_memory()
    total = engines * per_engine
    return {
        "method": ("planned, not measured: runner.placement_for (the plan `airquant plan` prints) of one engine for "
                   f"this store at batch {batch_size}, context {context}, on this machine's budgets, summed over "
                   "StreamPlan.host_parts; times the engine count, against psutil's available RAM"),
        "shared": False,
        "note": ("each engine actor opens its own Engine and pins its own RAM tier; nothing is shared between "
                 f"engines. Each engine budgets {RAM_FRACTION:.0%} of the RAM available when it opens, so engines "
                 "opening together may together plan past what the machine has"),
        "batch_size": batch_size, "context": context, "engines": engines,
        "layers": {"vram": len(plan.vram_layers), "ram": len(plan.ram_layers), "disk": len(plan.disk_layers)},
        "per_engine_parts_bytes": parts, "per_engine_bytes": per_engine,
        "per_engine_budget_bytes": plan.ram_budget_bytes, "total_bytes": total,
        "machine_total_bytes": ram.total, "machine_available_bytes": ram.available,
        "ram_note": ("psutil's figures when planned; on a VM whose memory grows as it is used, MemTotal starts "
                     "low and they show less than the machine can give"),
        "verdict": "fits" if total <= ram.available else "does not fit",
    }


# -- the pinned link, every GPU at once ----------------------------------------------------------
def copy_seconds(devices: list[str], nbytes: int, repeats: int) -> dict[str, list[float]]:
    """Each repeat's host-to-device copy time per device, every device copying at once: one thread per
    device, a barrier before each repeat (one device: that device alone). CPU devices copy RAM to RAM (a
    test of the threads, not a link)."""
    barrier, times, errors = threading.Barrier(len(devices), timeout=BARRIER_TIMEOUT_S), {}, []

    def worker(name: str) -> None:
        try:
            device = torch.device(name)
            if device.type == "cuda":
                torch.cuda.set_device(device)  # this thread's events and copies on this GPU's stream
            src, dst = link_buffers(device, "h2d_pinned" if device.type == "cuda" else "cpu_memcpy", nbytes)
            times[name] = link_copy_seconds(dst, src, repeats, before=barrier.wait)
        except Exception as exc:  # re-raised below, in the caller's thread, once every thread has stopped
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(d,), name=f"link-{d}") for d in devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:  # the first error that is not another thread's broken barrier
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return times


def link_per_device(devices: list[str], nbytes: int = LINK_BYTES, repeats: int = LINK_REPEATS) -> dict:
    """Median GB/s per device copying alone and with all devices copying at once."""
    alone = {d: copy_seconds([d], nbytes, repeats)[d] for d in devices}
    together = copy_seconds(devices, nbytes, repeats)
    rows = {}
    for d in devices:
        a, t = nbytes / statistics.median(alone[d]) / GB, nbytes / statistics.median(together[d]) / GB
        rows[d] = {"alone_gbps": a, "together_gbps": t, "together_over_alone": t / a}
        log.info("link %s: %.1f GB/s alone, %.1f GB/s with %d devices copying", d, a, t, len(devices))
    kind = "h2d_pinned" if devices[0].startswith("cuda") else "cpu_memcpy"
    return {"nbytes": nbytes, "repeats": repeats, "kind": kind, "per_device": rows,
            "together_total_gbps": sum(r["together_gbps"] for r in rows.values()),
            "worst_together_over_alone": min(r["together_over_alone"] for r in rows.values())}


def link_part(quick: bool) -> dict:
    """The pinned link per GPU, all at once; a record of why when this machine has fewer than two GPUs."""
    gpus = torch.cuda.device_count()
    if quick or gpus < 2:
        return {"skipped": f"needs a machine of 2 or more GPUs; this one has {gpus}"
                           + ("; a --quick run copies nothing" if quick else "")}
    return link_per_device([f"cuda:{i}" for i in range(gpus)])
