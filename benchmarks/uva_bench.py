#!/usr/bin/env python
"""How fast a kernel reads pinned host memory over the link, against the copy engine, in the same run.

Direct reads (engine/moe/direct.py) make the tiered NF4 kernel read each routed expert from the pinned RAM tier
itself. On the H200 that kernel read ~36 GB/s where the copy engine copies 55 (results/moe_bench.json): the
batch-1 no-cache rows sit at 1.46-1.50x their bytes' time on the link. This script finds where the gap is:

* ``copy``: the copy engine, pinned host -> device (1 GiB, median): the link.
* ``read``: a plain read kernel over the same pinned buffer (int32 words summed), swept over the bytes a
  program loads per step, warps, and the buffer's alignment (0 or 64 bytes past a 128-byte line): the most a
  kernel's own loads get from the link.
* ``tiered``: the tiered kernel (quant/kernels/nf4_moe, ``TIERED``) on expert images of real shapes
  (Qwen3-30B-A3B: 128 experts, top 8; Mixtral-8x7B: 8, top 2; gpt-oss-120b: 128, top 4; NF4, blocksize 64,
  double quant), every expert in host RAM, calls cycling over the experts so the L2 never holds them; swept
  over its ``TieredConfig`` (outputs per program, words per step, warps, loads a step ahead) and the code
  books read from device copies. Each config's output is checked against the default's. The same config
  reading every expert from device memory says how much of a call is compute. ``--host-memory`` makes the host
  buffer each way of ``HOST_MEMORY``: torch's pinned allocator, or registered as the engine's RAM tier is (its
  pages advised huge or not), since a kernel's reads of host memory go through the GPU's page tables.

Prints a table per part and writes ``results/uva_bench.json`` (``--results``): every row, and per model and
projection the fastest config beside the default. ``--quick``: tiny shapes, a few configs (a test of the
script; on the CPU under TRITON_INTERPRET=1).

    python benchmarks/uva_bench.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from airquant.eval.perf import measure_link_bandwidth  # noqa: E402
from airquant.quant.kernels import nf4_moe  # noqa: E402
from airquant.quant.kernels.nf4_moe import BUFFERS, ImageMatrix, TieredConfig, Tiers  # noqa: E402
from airquant.quant.nf4 import quantize_nf4  # noqa: E402

GB = 1e9
# model: (hidden, expert intermediate, experts, top k): the up matrix is gate and up together [2I, H]
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2),
          "gpt-oss-120b": (2880, 2880, 128, 4)}
QUICK_SHAPES = {"tiny": (64, 48, 8, 2)}
BLOCKSIZE = 64


@triton.jit
def _read_kernel(src_ptr, out_ptr, words, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program p sums the int32 words [p * CHUNK, (p + 1) * CHUNK) of ``src`` in steps of ``BLOCK`` words."""
    first = tl.program_id(0).to(tl.int64) * CHUNK
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for at in range(0, CHUNK, BLOCK):
        pos = first + at + offs
        acc += tl.load(src_ptr + pos, mask=pos < words, other=0) & 255  # no int32 overflow
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def timed(fn, reps: int, device: torch.device) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (after one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pinned(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


# How the host buffer of the tiered part is made: torch's pinned allocator (cudaHostAlloc); an ordinary
# allocation registered with cudaHostRegister, as the engine's RAM tier is (engine/cuda_ops.HostMemory); the same
# on 2 MB boundaries with its pages advised huge before the registration touches them.
HOST_MEMORY = ("pinned", "registered", "hugepages")


def host_buffer(kind: str, nbytes: int, device: torch.device):
    """(``nbytes`` of page-locked host memory made the ``kind`` way, the object that keeps it registered)."""
    if kind == "pinned" or device.type != "cuda":
        return pinned(nbytes, device), None
    from airquant.engine.cuda_ops import HostMemory

    memory = HostMemory(pinned=True)
    return memory.empty(nbytes, huge_pages=kind == "hugepages"), memory


def part_read(args, device, out: dict) -> None:
    nbytes = (1 << 16) if args.quick else (1 << 30)
    host = pinned(nbytes + 256, device)
    host.random_(0, 256)
    rows = []
    blocks = (64,) if args.quick else (256, 1024, 2048, 4096)
    warps = (4,) if args.quick else (4, 8)
    for shift, block, w in itertools.product((0, 64), blocks, warps):
        src = host[shift:shift + nbytes].view(torch.int32)
        chunk = block * (4 if args.quick else 16)  # words a program reads
        grid = (triton.cdiv(src.numel(), chunk),)
        sums = torch.empty(grid[0], dtype=torch.int32, device=device)
        s = timed(lambda: _read_kernel[grid](src, sums, src.numel(), CHUNK=chunk, BLOCK=block, num_warps=w),
                  args.reps, device)
        rows.append({"offset": shift, "block_bytes": 4 * block, "program_bytes": 4 * chunk, "warps": w,
                     "seconds": s, "gbps": nbytes / s / GB})
        print(f"read  offset {shift:3d}  {4 * block:6d} B/step  {4 * chunk:7d} B/program  {w} warps  "
              f"{nbytes / s / GB:6.1f} GB/s", flush=True)
    out["read"] = rows
    out["read_best_gbps"] = max(r["gbps"] for r in rows)


def image_of(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, ImageMatrix]:
    """One random ``[n, k]`` NF4 matrix (double quant) as image bytes (each buffer on a 128-byte line) and its
    ``ImageMatrix``."""
    parts = quantize_nf4(torch.randn(n, k, device=device), BLOCKSIZE, True)[0]
    offsets, at = {}, 0
    for name in BUFFERS:
        if name in parts:
            offsets[name] = at
            at += -(-parts[name].numel() * parts[name].element_size() // 128) * 128
    image = torch.zeros(at, dtype=torch.uint8, device=device)
    for name, off in offsets.items():
        raw = parts[name].contiguous().reshape(-1).view(torch.uint8)
        image[off:off + raw.numel()] = raw
    return image.cpu(), ImageMatrix(n, k, BLOCKSIZE, True, tuple(offsets.get(b) for b in BUFFERS))


class Experts:
    """A model's experts: every image in one pinned host buffer (up image then down image), the same bytes in
    a device pool, and the routings a run of calls cycles through."""

    def __init__(self, model: str, shape: tuple, device: torch.device, shift: int = 0, memory: str = "pinned"):
        hidden, inter, self.num, self.top = shape
        up, self.up = image_of(2 * inter, hidden, device)
        down, down_m = image_of(hidden, inter, device)
        self.down = ImageMatrix(down_m.n, down_m.k, BLOCKSIZE, True,
                                tuple(None if o is None else o + up.numel() for o in down_m.offsets))
        one = torch.cat([up, down])
        self.stride, self.start = one.numel(), shift
        self.host, self._owner = host_buffer(memory, shift + self.num * self.stride, device)
        self.host[shift:].view(self.num, self.stride).copy_(one)
        self.expert_bytes = self.stride
        self.pool = self.host[shift:].view(self.num, self.stride).to(device) if device.type == "cuda" or \
            self.num * self.stride < (1 << 28) else None
        self.device, self.model = device, model
        self.hidden, self.inter = hidden, inter
        order = torch.randperm(self.num, generator=torch.Generator().manual_seed(0))
        groups = max(self.num // self.top, 1)
        self.routings = [order[g * self.top:(g + 1) * self.top].reshape(1, self.top).to(device) for g in range(groups)]
        self.books = {"quant_map": self._book(self.up, "quant_map", 16),
                      "nested_quant_map": self._book(self.up, "nested_quant_map", 256)}

    def _book(self, m: ImageMatrix, name: str, size: int) -> torch.Tensor:
        off = m.offsets[BUFFERS.index(name)] + self.start
        return self.host[off:off + 4 * size].view(torch.float32).to(self.device)

    def tiers(self, where: str, tables: bool) -> Tiers:
        num, dev = self.num, self.device
        table = (torch.arange(num, dtype=torch.int32, device=dev) if where == "device" else
                 torch.full((num,), -1, dtype=torch.int32, device=dev))
        pool = self.pool if self.pool is not None else torch.zeros((1, self.stride), dtype=torch.uint8, device=dev)
        return Tiers(self.host, self.start, self.stride, pool, table, torch.zeros(num, dtype=torch.int32, device=dev),
                     torch.zeros(1, dtype=torch.int64, device=dev), **(self.books if tables else {}))


def run_calls(ex: Experts, tiers: Tiers, proj: str, calls: int) -> list[torch.Tensor]:
    """``calls`` calls of one projection at batch 1, each routed to the next group of experts."""
    outs = []
    for c in range(calls):
        ids = ex.routings[c % len(ex.routings)]
        if proj == "up":
            x = torch.ones(1, ex.hidden, device=ex.device, dtype=torch.bfloat16)
            outs.append(nf4_moe.tiered_up(x, ids, ex.up, tiers))
        else:
            h = torch.ones(ex.top, ex.inter, device=ex.device, dtype=torch.bfloat16)
            w = torch.full((1, ex.top), 1.0 / ex.top, device=ex.device)
            outs.append(nf4_moe.tiered_down(h, ids, w, ex.down, tiers, torch.bfloat16))
    return outs


def tiered_configs(quick: bool, proj: str, focus: str) -> list[tuple[TieredConfig, bool]]:
    """(config, code books from device copies) for projection ``proj``: the code's launch first. ``focus``:
    the launches the first sweep left in question (warps, prefetch, a program per pair); ``code``: the code's
    launch alone, with the code books from device copies (as direct reads run it)."""
    code = nf4_moe.TIERED[proj]
    if quick:
        return [(code, False), (TieredConfig(block_n=8, block_w=8, prefetch=True), True),
                (TieredConfig(block_n=8, split=True), True)]
    if focus == "code":
        return [(code, True)]
    if focus == "full":
        return [(code, False), (code, True)] + [
            (TieredConfig(block_n=n, block_w=w, warps=warps, prefetch=pre), True)
            for n, w, warps, pre in itertools.product((8, 16, 32, 64), (32, 64), (4, 8), (False, True))]
    if proj == "up":
        return [(nf4_moe.TIERED["up"], False), (nf4_moe.TIERED["up"], True), (TieredConfig(prefetch=True), True),
                (TieredConfig(block_n=16, warps=8), True)]
    return [(code, False)] + [(TieredConfig(block_n=n, warps=warps, prefetch=pre, split=split), True)
                              for n, warps, pre, split in itertools.product((16, 32), (4, 8), (False, True),
                                                                            (False, True))]


def part_tiered(args, device, out: dict) -> None:
    shapes = QUICK_SHAPES if args.quick else {m: SHAPES[m] for m in args.models.split(",")}
    rows, best, launch = [], {}, dict(nf4_moe.TIERED)
    kinds = args.host_memory.split(",")
    for model, shape, kind in ((m, sh, k) for m, sh in shapes.items() for k in kinds):
        for shift in ((0,) if args.quick or args.configs != "full" else (0, 64)):
            ex = Experts(model, shape, device, shift, kind)
            calls = len(ex.routings) if args.quick else max(len(ex.routings), 8)
            for proj in ("up", "down"):
                m = ex.up if proj == "up" else ex.down
                matrix_bytes = m.n * m.k // 2 + m.n * m.k // BLOCKSIZE  # packed nibbles and absmax codes
                moved = calls * ex.top * matrix_bytes
                configs = tiered_configs(args.quick, proj, args.configs)
                configs = configs if shift == 0 else configs[:1]
                want = None
                for config, tables in configs:
                    nf4_moe.TIERED = {**nf4_moe.TIERED, proj: config}
                    row = {"model": model, "proj": proj, "offset": shift, "host_memory": kind, **vars(config),
                           "tables": tables, "bytes": moved}
                    try:
                        host_tiers, dev_tiers = ex.tiers("host", tables), ex.tiers("device", tables)
                        got = run_calls(ex, host_tiers, proj, calls)
                        if want is None:
                            want = got
                        row["max_rel_diff"] = max(float((a.float() - b.float()).abs().max() / b.float().abs().max())
                                                  for a, b in zip(got, want))  # against the code's launch
                        s = timed(lambda: run_calls(ex, host_tiers, proj, calls), args.reps, device)
                        row.update(seconds=s, gbps=moved / s / GB)
                        if ex.pool is not None:
                            d = timed(lambda: run_calls(ex, dev_tiers, proj, calls), args.reps, device)
                            row.update(device_seconds=d, device_gbps=moved / d / GB)
                    except Exception as exc:  # a config Triton cannot build (shared memory, registers)
                        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    rows.append(row)
                    print(f"tiered {model:14s} {kind:10s} {proj:4s} off {shift:2d} "
                          f"n {config.block_n} w {config.block_w} "
                          f"warps {config.warps} pre {config.prefetch:d} split {config.split:d} tables {tables:d}  "
                          f"{row.get('gbps', 0):6.1f} GB/s host  {row.get('device_gbps', 0):7.1f} device  "
                          f"diff {row.get('max_rel_diff', float('nan')):.2g} {row.get('error', '')}", flush=True)
                nf4_moe.TIERED = dict(launch)
                mine = [r for r in rows if r["model"] == model and r["proj"] == proj and r["offset"] == shift
                        and r["host_memory"] == kind and "gbps" in r]
                if shift == 0 and mine:
                    top = max(mine, key=lambda r: r["gbps"])
                    name = f"{model} {proj}" if kind == "pinned" else f"{model} {proj} {kind}"
                    best[name] = {"default_gbps": mine[0]["gbps"], "best_gbps": top["gbps"],
                                  "best": {k: top.get(k) for k in ("block_n", "block_w", "warps", "prefetch", "split",
                                                                   "tables")}}
            ex = None  # its pinned buffer and pool freed before the next shape
            if device.type == "cuda":
                torch.cuda.empty_cache()
    out["tiered"] = rows
    out["tiered_best"] = best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["copy", "read", "tiered", "all"], nargs="+", default=["all"])
    p.add_argument("--models", default="qwen3-30b-a3b,mixtral-8x7b,gpt-oss-120b")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--configs", choices=["full", "focus", "code"], default="full",
                   help="tiered launches: the full sweep, the few the full one left in question, or the code's")
    p.add_argument("--host-memory", default="pinned",
                   help=f"tiered part: how its host buffer is made, comma-separated of {', '.join(HOST_MEMORY)}")
    p.add_argument("--quick", action="store_true", help="tiny shapes, two configs: a test of the script")
    p.add_argument("--results", default=None, help="folder of the results file (default: results/)")
    p.add_argument("--name", default="uva_bench", help="the results file's name, without .json")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.quick:
        raise SystemExit("uva_bench measures a GPU's reads of pinned host memory: run it on a CUDA machine "
                         "(or --quick under TRITON_INTERPRET=1 to test the script)")
    if args.quick:
        args.reps = 1
    unknown = set(args.host_memory.split(",")) - set(HOST_MEMORY)
    if unknown:
        p.error(f"--host-memory: unknown {', '.join(sorted(unknown))}; choose from {', '.join(HOST_MEMORY)}")
    path = Path(args.results or (REPO / "results")) / f"{args.name}.json"
    out = json.loads(path.read_text()) if path.exists() else {}
    out.update(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", quick=args.quick,
               versions={"torch": torch.__version__, "triton": triton.__version__})
    parts = {"copy", "read", "tiered"} if "all" in args.part else set(args.part)
    if "copy" in parts and device.type == "cuda":
        m = measure_link_bandwidth(device, kind="h2d_pinned", nbytes=1 << 30, repeats=10)
        out["link_pinned_gbps"] = m.gb_per_s
        print(f"copy engine, pinned host -> device: {m.gb_per_s:.1f} GB/s", flush=True)
    if "read" in parts:
        part_read(args, device, out)
    if "tiered" in parts:
        part_tiered(args, device, out)
    link = out.get("link_pinned_gbps")
    if link:
        if out.get("read_best_gbps"):
            out["read_over_link"] = out["read_best_gbps"] / link
        for key, b in out.get("tiered_best", {}).items():
            b["default_over_link"], b["best_over_link"] = b["default_gbps"] / link, b["best_gbps"] / link
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, indent=1, default=float))
    tmp.replace(path)
    print(json.dumps({k: out.get(k) for k in ("link_pinned_gbps", "read_best_gbps", "read_over_link",
                                               "tiered_best")}, indent=1, default=float))


if __name__ == "__main__":
    main()
