#!/usr/bin/env python
"""A T4's limits emulated on the H200: what a Colab T4 user would get, as a MODEL, not a T4 measurement.

The profile: GPU capped to 15 GB (``set_per_process_memory_fraction``), the whole process's host RAM kept
under 12 GB (``--max-ram`` is what the process leaves of 12 GB; the planner fits the host embeddings, the
staging buffers and the pinned layer tier inside it), ``AIRQUANT_FORCE_CAPABILITY=7.5`` so the capability rule picks what a T4 runs (fp16 compute for
bf16 stores, no TMA/Gluon-Hopper paths, the TurboQuant attention kernel only where a T4's 64 KB of shared
memory fits), the store on disk. The H200 still computes far faster than a T4 and its host's page cache is not
capped, so step times here are not a T4's: the T4 step time is *predicted* from the bytes a decode step moves, as
the slowest of ``streamed bytes / link`` (once with the link measured here, once with PCIe 3's 12.5 GB/s, a T4's
link) and ``disk-tier bytes / the store folder's measured read speed`` (``airquant.engine.memory.step_bound``; the
layers the 12 GB RAM tier cannot hold are read from disk every step). That is a lower bound on a T4's step
(compute is left out); each row names what bounds it. A Colab store on Drive reads far slower than a local disk:
measure its folder with ``airquant doctor STORE``.

Parts (each one command; runtimes on one H200):

* ``link`` (~5 s): pinned host->GPU bandwidth, 1 GiB copies.
* ``ppl`` (~1 min): the default model (SmolLM2-135M, bf16 store) at the reference settings (WikiText-2,
  8192 tokens, window 1024, stride 512), streamed in the profile: fp16 compute (the rule's choice under 7.5)
  against bf16 compute (the H200's own) -> ``fp16_ppl_over_bf16`` (target <= 1.005).
* ``70b`` (~4 min with ``--store``; + ~3 min to write the store): a Llama-3-70B-shaped NF4 store (37 GB,
  ``airquant synth --shape llama3-70b --dtype nf4``), batch 1 and 32 decode steps in the profile -> bytes per
  step, predicted T4 tok/s at batch 1 and 32, peak VRAM (<= 15 GB) and host RAM (<= 12 GB). A warm-up on a
  two-layer store of the same shapes (~30 s with writing it) runs first, so the RSS the ``--max-ram`` rule reads
  already holds the libraries a decode step loads. Each batch row has ``host_ram``: the RSS the rule read, what
  the plan counted by part, what the engine's buffers held, the peak RSS split into anonymous / file-backed /
  shared memory (``/proc/self/status``) and the unplanned rest.

    python benchmarks/t4_profile.py --part link && python benchmarks/t4_profile.py --part ppl \
        && python benchmarks/t4_profile.py --part 70b --store /path/to/llama3-70b-nf4

``--quick`` runs every part on the CPU with tiny sizes (a test of the script). Writes results/t4_profile.json.
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from airquant.cli.doctor_cmds import disk_read_speed  # noqa: E402
from airquant.config import GenerateConfig  # noqa: E402
from airquant.engine.memory.step_bound import StepBound, step_bound  # noqa: E402
from airquant.engine.runner import Engine  # noqa: E402
from airquant.eval.perf import RssSampler  # noqa: E402
from airquant.quant.kernels import FORCE_ENV  # noqa: E402
from airquant.store.synth import SynthSpec, synth  # noqa: E402
from benchmarks.stream_bench import (  # noqa: E402
    GB,
    Bench,
    bench_device,
    cap_gpu,
    decode_step,
    free_gpu,
    open_engine,
    part_link,  # noqa: E402
    prompt_ids,
    versions,
)

log = logging.getLogger("t4_profile")
T4 = {"vram_gb": 15.0, "ram_gb": 12.0, "capability": "7.5", "pcie3_gbps": 12.5}
TARGETS = {"fp16_ppl_over_bf16": 1.005, "t4_70b_peak_vram_gb": 15.0, "t4_70b_peak_host_ram_gb": 12.0}  # maxima
REFERENCE = {"limit_tokens": 8192, "max_length": 1024, "stride": 512}
QUICK_PPL = {"limit_tokens": 256, "max_length": 64, "stride": 32}
QUICK_70B = (("hidden", 256), ("intermediate", 512), ("heads", 4), ("kv_heads", 2), ("vocab", 4096))


def predicted(row: dict, batch: int, link_gbps: float, disk_gbps: float | None) -> tuple[float | None, str]:
    """(tok/s, what bounds the step): the step takes at least the slower of its link and disk bytes (None and
    "compute" when the step streams nothing)."""
    bound = StepBound(link_bytes=row["bytes_per_step"], disk_bytes=row["disk_bytes_per_step"], link_gbps=link_gbps,
                      disk_gbps=disk_gbps)
    return (batch / bound.seconds if bound.seconds else None), bound.bound


def part_ppl(b: Bench) -> None:
    """fp16 (the rule's choice on a T4) against bf16 perplexity of the default model, streamed in the profile."""
    from airquant.config import EngineConfig
    from airquant.eval.perplexity import run_perplexity
    from airquant.models import resolve
    from airquant.store.split import split

    store = Path(b.args.workdir) / "default-bfloat16"
    if not (store / "manifest.json").is_file():
        split(resolve("default"), store, dtype="bfloat16", progress=False)
    settings = QUICK_PPL if b.quick else REFERENCE
    ppl = {}
    for name, forced in (("float16", T4["capability"]), ("bfloat16", None)):
        os.environ.pop(FORCE_ENV, None) if forced is None else os.environ.__setitem__(FORCE_ENV, forced)
        cuda = b.device.type == "cuda"
        # On the GPU the fp16 run takes the rule's dtype (no --dtype); the CPU has no capability to force.
        cfg = EngineConfig(device=b.device.type, dtype=None if cuda else name, max_vram_gb=T4["vram_gb"] if cuda
                           else None, max_ram_gb=T4["ram_gb"])
        engine = Engine.open(store, cfg)
        assert str(engine.dtype) == f"torch.{name}", (engine.dtype, name)
        ppl[name] = run_perplexity(engine, **settings).ppl
        engine.close()
    os.environ[FORCE_ENV] = T4["capability"]
    b.results.update(ppl_fp16=ppl["float16"], ppl_bf16=ppl["bfloat16"],
                     fp16_ppl_over_bf16=ppl["float16"] / ppl["bfloat16"], ppl_settings=settings)
    log.info("ppl fp16 %.4f, bf16 %.4f", ppl["float16"], ppl["bfloat16"])


def part_70b(b: Bench) -> None:
    """Batch 1 and 32 decode steps of a 70B-shaped NF4 store in the profile; T4 tok/s predicted from bytes."""
    a = b.args
    store = Path(a.store) if a.store else Path(a.workdir) / "llama3-70b-nf4"
    if not (store / "manifest.json").is_file():
        start = time.perf_counter()
        write_store(b, store, layers=2 if b.quick else None, overrides=QUICK_70B if b.quick else ())
        log.info("store %s written in %.0f s", store, time.perf_counter() - start)
    warm = warm_runtime(b)
    link = b.results.get("link_pinned_gbps")
    disk_gbps, disk_read, _ = disk_read_speed(store, seconds=5.0)
    b.results["t4_70b_disk_gbps"] = disk_gbps
    log.info("disk: %.2f GB/s reading %.2f GB of %s", disk_gbps, disk_read / GB, store)
    rows = {}
    for batch in (1, 32):
        with RssSampler(interval_s=0.01) as rss:
            row = batch_row(b, store, batch, rss)
        row["peak_host_ram_gb"] = rss.peak / GB
        host = row["host_ram"]
        host.update(peak_gb=rss.peak / GB, peak_parts_gb=_gb(rss.peak_parts),
                    marks_gb={k: _gb(v) for k, v in rss.marks},
                    unplanned_gb=rss.peak / GB - host["rss_at_budget_gb"] - host["planned_total_gb"])
        row["t4_pcie3_tok_s"], row["t4_pcie3_bound"] = predicted(row, batch, T4["pcie3_gbps"], disk_gbps)
        if link:
            row["t4_link_tok_s"], row["t4_link_bound"] = predicted(row, batch, link, disk_gbps)
        rows[str(batch)] = row
    b.results.update(
        t4_70b_bytes_per_step=rows["1"]["bytes_per_step"],
        t4_70b_disk_bytes_per_step=rows["1"]["disk_bytes_per_step"], t4_70b_bound_bs1_pcie3=rows["1"]["t4_pcie3_bound"],
        t4_70b_pred_tok_s_bs1_pcie3=rows["1"]["t4_pcie3_tok_s"], t4_70b_pred_tok_s_bs32_pcie3=rows["32"]["t4_pcie3_tok_s"],
        t4_70b_pred_tok_s_bs1_link=rows["1"].get("t4_link_tok_s"), t4_70b_pred_tok_s_bs32_link=rows["32"].get("t4_link_tok_s"),
        t4_70b_peak_vram_gb=max(r["peak_reserved_gb"] or 0 for r in rows.values()),
        t4_70b_peak_host_ram_gb=max(r["peak_host_ram_gb"] for r in rows.values()),
        t4_70b_dtype=rows["1"]["dtype"])
    b.results.setdefault("details", {})["70b"] = {"store": store.name, "warmup": warm, "by_batch": rows}


def write_store(b: Bench, store: Path, layers: int | None, overrides: tuple) -> None:
    from transformers import AutoTokenizer  # the synthetic store's tokenizer: the default model's, in tests/

    spec = SynthSpec("llama3-70b", "nf4", layers=layers, overrides=overrides)
    synth(spec, store, device=b.device.type, progress=layers is None,
          tokenizer=AutoTokenizer.from_pretrained(REPO / "tests" / "data" / "smollm2_tokenizer"))


def warm_runtime(b: Bench) -> dict:
    """Run what the 70B rows run (NF4 GEMV at batch 1, dequantize + cuBLAS at batch 32, SDPA, the chunked
    NF4 head, a resident and a disk-streamed layer) first, on a two-layer store of the same shapes (~3.6 GB,
    ~15 s to write on the device). The CUDA modules, cuBLAS kernels, bitsandbytes and Triton they load stay
    in the process; loaded after ``ram_budget_gib`` read the RSS, they were RAM the budget did not leave
    room for. Returns the RSS the warm-up added."""
    store = Path(b.args.workdir) / "warm-llama3-70b-nf4-2l"
    if not (store / "manifest.json").is_file():
        write_store(b, store, layers=2, overrides=QUICK_70B if b.quick else ())
    before = settled_rss()
    for batch in (1, 32):
        engine = open_engine(b, store, T4["vram_gb"] if b.device.type == "cuda" else None, max_ram_gb=0.0,
                             host_embedding=True, batch_size=batch, context=b.args.prompt_len + 4,
                             verify_reads=False, resident_layers=1)
        try:
            ids = prompt_ids(min(engine.config.vocab_size, len(engine.tokenizer)), batch, b.args.prompt_len)
            engine.generate_requests([engine.request(row, GenerateConfig(max_new_tokens=2, ignore_eos=True))
                                      for row in ids.tolist()])
        finally:
            engine.close()
            free_gpu()
    after = settled_rss()
    log.info("warm-up: the runtime took %.2f GB of host RAM (RSS %.2f -> %.2f GB)", (after - before) / GB,
             before / GB, after / GB)
    return {"store": store.name, "rss_before_gb": before / GB, "rss_after_gb": after / GB,
            "rss_gain_gb": (after - before) / GB}


def settled_rss() -> int:
    """RSS once collected garbage and the C heap's free pages are given back (what the process holds)."""
    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
    return psutil.Process().memory_info().rss


def ram_budget_gib(rss: int) -> float:
    """``--max-ram`` (GiB) that keeps the whole process under a T4 host's 12 GB: 12 GB less what the process
    holds already (``rss``: Python, torch, the CUDA context, the libraries the warm-up loaded) and 0.5 GB of
    slack. The planner fits the host-side embedding table, the read-ahead staging buffers and the pinned
    layer tier inside it."""
    free = T4["ram_gb"] * GB - rss - 0.5 * GB
    return max(free, 0.0) / (1 << 30)


def _gb(parts: dict[str, int]) -> dict[str, float]:
    return {k: round(v / GB, 4) for k, v in parts.items()}


def host_ram(engine, rss_at_budget: int) -> dict:
    """What the plan counted in host RAM, what the engine's buffers hold, and the pinned allocator's figures."""
    planned = engine.plan.host_parts(engine.manifest.layer_bytes)
    out = {"rss_at_budget_gb": rss_at_budget / GB, "planned_gb": _gb(planned),
           "planned_total_gb": sum(planned.values()) / GB, "held_gb": _gb(engine.host_memory()),
           "ram_budget_gb": engine.plan.ram_budget_bytes / GB}
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if engine.device.type == "cuda" and stats is not None:  # torch's pinned allocator (pin_memory=True)
        try:
            out["pinned_allocator"] = {k: v for k, v in stats().items() if k.endswith((".current", ".peak"))}
        except RuntimeError as err:  # a torch without the allocator's statistics
            out["pinned_allocator"] = {"error": str(err)[:200]}
    return out


def batch_row(b: Bench, store: Path, batch: int, rss: RssSampler) -> dict:
    """One batch's decode steps in the profile. If the planner's placement (leading layers resident in VRAM)
    runs out of memory under the cap, the OOM is recorded and the batch re-measured with every layer
    streamed (``resident_layers=0``): a T4 user's fallback, which moves more bytes per step, so the
    prediction stays conservative."""
    errors = []
    for resident in (None, 0):
        engine = None
        rss_at_budget = settled_rss()
        rss.mark(f"budget (resident_layers={resident})")
        ram_gb = ram_budget_gib(rss_at_budget)
        try:
            engine = open_engine(b, store, T4["vram_gb"] if b.device.type == "cuda" else None,
                                 max_ram_gb=ram_gb, host_embedding=True, batch_size=batch,
                                 context=b.args.prompt_len + b.args.steps + 3, verify_reads=False,
                                 resident_layers=resident)
            rss.mark("opened")
            row = decode_step(b, engine, batch, f"70b-nf4-bs{batch}")
            rss.mark("stepped")
            row.update(disk_bytes_per_step=step_bound(engine.plan, engine.manifest.layer_bytes, link_gbps=None,
                                                      disk_gbps=None).disk_bytes)
            row.update(dtype=str(engine.dtype).removeprefix("torch."), resident_layers_forced=resident,
                       max_ram_gb=round(ram_gb * (1 << 30) / GB, 2), host_ram=host_ram(engine, rss_at_budget),
                       plan=engine.plan.describe(engine.manifest.layer_bytes), errors=errors)
            return row
        except torch.cuda.OutOfMemoryError as err:
            log.warning("batch %d with resident_layers=%s: CUDA OOM (%s); retrying with every layer streamed",
                        batch, resident, str(err).splitlines()[0])
            errors.append({"resident_layers": resident, "error": str(err).splitlines()[0][:400]})
        finally:
            if engine is not None:
                engine.close()
            free_gpu()
    raise RuntimeError(f"batch {batch}: out of memory even with every layer streamed: {errors}")


def check_targets(results: dict) -> list[str]:
    return [f"{k} = {results[k]:.4g} > {v}" for k, v in TARGETS.items() if results.get(k) is not None
            and results[k] > v]


def print_table(results: dict) -> None:
    print("T4 profile on this GPU (predictions: the slower of link and disk bytes, not T4 measurements)")
    for key in ("link_pinned_gbps", "ppl_fp16", "ppl_bf16", "fp16_ppl_over_bf16", "t4_70b_bytes_per_step",
                "t4_70b_disk_bytes_per_step", "t4_70b_disk_gbps",
                "t4_70b_pred_tok_s_bs1_pcie3", "t4_70b_pred_tok_s_bs32_pcie3", "t4_70b_pred_tok_s_bs1_link",
                "t4_70b_pred_tok_s_bs32_link", "t4_70b_peak_vram_gb", "t4_70b_peak_host_ram_gb"):
        if results.get(key) is not None:
            print(f"  {key:<32} {results[key]:.4g}")
    if results.get("t4_70b_bound_bs1_pcie3"):
        print(f"  {'t4_70b_bound_bs1_pcie3':<32} {results['t4_70b_bound_bs1_pcie3']}")
    for batch, row in results.get("details", {}).get("70b", {}).get("by_batch", {}).items():
        h = row.get("host_ram")
        if h and "peak_gb" in h:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in h["planned_gb"].items() if v)
            rss = ", ".join(f"{k} {v:.2f}" for k, v in h["peak_parts_gb"].items() if k != "rss")
            print(f"  host RAM bs{batch}: peak {h['peak_gb']:.2f} GB = RSS at budget {h['rss_at_budget_gb']:.2f} "
                  f"+ planned {h['planned_total_gb']:.2f} ({parts}) + unplanned {h['unplanned_gb']:.2f}; "
                  f"at the peak {rss}")
    for miss in check_targets(results):
        print(f"  MISSED: {miss}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["link", "ppl", "70b", "all"], default="all")
    p.add_argument("--store", default=None, help="an existing llama3-70b NF4 store to reuse (70b part)")
    p.add_argument("--workdir", default=str(REPO / "bench-work"), help="where stores are written")
    p.add_argument("--out", default=None, help="results JSON (default results/t4_profile.json; --quick: WORKDIR)")
    p.add_argument("--quick", action="store_true", help="tiny sizes on the CPU: tests the script")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--steps", type=int, default=2, help="timed decode steps per batch (after one warm-up step)")
    p.add_argument("--prompt-len", type=int, default=128)
    args = p.parse_args(argv)
    if args.quick:
        args.prompt_len, args.steps = min(args.prompt_len, 16), min(args.steps, 2)
    if args.out is None:
        args.out = str((Path(args.workdir) / "results" if args.quick else REPO / "results") / "t4_profile.json")
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    os.environ[FORCE_ENV] = T4["capability"]  # the capability rule plans as a T4 (CUDA devices only)
    device = bench_device(args)
    out = Path(args.out)
    b = Bench(args, device, results=json.loads(out.read_text()) if out.is_file() else {})
    b.results.update(device=torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", quick=args.quick,
                     profile=T4, versions=versions(), model_note="T4 figures are predictions from bytes moved "
                     "(the slower of link and disk: a lower bound on step time), not T4 measurements")
    cap_gpu(T4["vram_gb"] if device.type == "cuda" else None)
    for part in (["link", "ppl", "70b"] if args.part == "all" else [args.part]):
        start = time.perf_counter()
        {"link": part_link, "ppl": part_ppl, "70b": part_70b}[part](b)
        log.info("part %s: %.0f s", part, time.perf_counter() - start)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(b.results, indent=1, default=float))
        tmp.replace(out)
    print_table(b.results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
