"""What the TurboQuant split kernel compiles to, without a GPU: each history-tile variant's machine code for one
target, its registers, shared memory and the instructions of its history loop; then the Gluon history kernel's
(kv/gluon_kernel.py: one warp a program, so its loop's count is a tile's whole cost, against four warps' for the
split kernel's variants).

    python benchmarks/kernel_sass.py [--cap 90] [--block-n 32] [--dim 128] [--num-warps 4] [--out FILE]

Triton compiles offline (``triton.compile(ASTSource(...), target=GPUTarget("cuda", cap, 32))``) down to a cubin
with the ptxas in its wheel, and its ``nvdisasm`` lists the SASS. The kernel is compiled as the decode loop
launches it (bf16, K4/V2, the paged arena, a keep mask, each row its own history length) with the pointers
16-byte aligned and the strides divisible by 16, as Triton specializes them at the launch (without that, loads
of the packed bytes are not vectorized and BLOCK_N 32 takes 252 registers a thread instead of 128). The loops are
the backward branches of the listing; the largest is the history loop (one 32-token tile an iteration at
BLOCK_N 32), the next the window's. Instruction counts are static, per warp and iteration: a guide to where a
tile's time can go (layout conversions show as STS/LDS between BAR.SYNCs), not a timing; the GPU sweep
(kv_attention_speed.py --paged) gives those.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Pointer arguments of the split kernel by element type (X: the model's dtype); the rest are integers or constexprs.
POINTERS = {"Q": "X", "QR": "fp32", "KF": "X", "VF": "X", "KC": "u8", "KN": "fp16", "KR": "fp32", "VC": "u8",
            "VN": "fp16", "VR": "fp32", "KCent": "X", "VCent": "X", "KByte": "X", "VByte": "X", "KMean": "fp32",
            "VMeanRot": "fp32", "Keep": "i8", "OutM": "fp32", "OutL": "fp32", "OutAcc": "fp32", "Slots": "i64",
            "Table": "i64", "HistLen": "i64"}


def _signature(fn, pointers: dict, dtype: str, lengths: set) -> tuple[dict, dict]:
    """(signature, attributes) of a kernel compiled as launched: ``pointers``' element types (X: ``dtype``), the
    float ``scale``, other arguments int32; pointers and the strides Triton specializes at the launch (multiples of
    a page: every ``s_*`` but ``lengths``) 16-divisible."""
    sig = {p.name: "constexpr" if p.is_constexpr else
           ("*" + (dtype if pointers[p.name] == "X" else pointers[p.name]) if p.name in pointers
            else ("fp32" if p.name == "scale" else "i32")) for p in fn.params}
    aligned = {i for i, p in enumerate(fn.params) if sig[p.name].startswith("*") or
               (p.name.startswith("s_") and p.name not in lengths)}
    return sig, {(i,): [["tt.divisibility", 16]] for i in aligned}


def compile_split(variant: tuple[int, int], cap: int, block_n: int, dim: int, dtype: str = "bf16", warps: int = 4):
    """The split kernel as the decode loop launches it (see the module docstring), compiled for ``sm_{cap}``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from airquant.kv import triton_kernel as tq

    fn = tq._split_kernel
    sig, attrs = _signature(fn, POINTERS, dtype, set(tq.LENGTH_ARGS) | {"s_ec"})
    constexprs = {"D": dim, "BITS_K": 4, "BITS_V": 2, "DOT": {"bf16": 1, "fp16": 2}[dtype], "BLOCK_M": 16,
                  "BLOCK_N": block_n, "NORM8_K": False, "NORM8_V": False, "HAS_KMEAN": True, "HAS_VMEAN": True,
                  "HAS_KEEP": True, "PAGED": True, "PAGE": 256, "ROW_HIST": True, "COLS": variant[0],
                  "BYTES": variant[1]}
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", cap, 32),
                          options={"num_warps": warps, "num_stages": 1})


# The Gluon history kernel's pointer arguments (kv/gluon_kernel.py): codes read as 32-bit words, byte tables as
# 32-bit (keys: two centroids) and 64-bit (values: four) words.
GLUON_POINTERS = {**{k: v for k, v in POINTERS.items() if k not in ("KF", "VF", "KCent", "VCent")},
                  "KC": "i32", "VC": "i32", "KByte": "i32", "VByte": "i64"}


def compile_gluon_history(cap: int, block_n: int, dtype: str = "bf16"):
    """The Gluon history kernel as the decode loop would launch it (head size 128, the paged arena, a keep mask,
    each row its own history), one warp, compiled for ``sm_{cap}``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from airquant.kv import gluon_kernel as gk

    fn = gk._history_kernel
    sig, attrs = _signature(fn, GLUON_POINTERS, dtype, set(fn.do_not_specialize) | {"s_ec"})
    constexprs = {"DT": {"bf16": 1, "fp16": 2}[dtype], "BLOCK_N": block_n, "NORM8_K": False, "NORM8_V": False,
                  "HAS_KMEAN": True, "HAS_VMEAN": True, "HAS_KEEP": True, "PAGED": True, "PAGE": 256,
                  "ROW_HIST": True}
    return triton.compile(GluonASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", cap, 32),
                          options={"num_warps": 1})


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def listing(cubin: bytes) -> tuple[str, dict]:
    """(the SASS listing, {"registers", "local_bytes"}) of a cubin, by the wheel's nvdisasm and cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    regs, local = re.search(r"REG:(\d+)", usage), re.search(r"LOCAL:(\d+)", usage)
    return sass, {"registers": int(regs.group(1)) if regs else None, "local_bytes": int(local.group(1)) if local else None}


def loops(sass: str) -> list[dict]:
    """The listing's loops (a branch back to an earlier label), largest first: instructions and the opcodes' counts
    (predicates and modifiers dropped: ``@!P0 LDG.E.64`` counts as LDG)."""
    ins, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"^\s*\.(L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            at = int(m.group(1), 16)
            labels.update({p: at for p in pending})
            pending = []
            ins.append((at, m.group(2)))
    found = []
    for at, op in ins:
        target = re.search(r"BRA\s.*\.(L_x_\d+)", op)
        if target and labels.get(target.group(1), at + 1) < at:
            body = [o for x, o in ins if labels[target.group(1)] <= x <= at]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", o).split()[0].split(".")[0] for o in body)
            found.append({"instructions": len(body), "ops": dict(ops.most_common())})
    return sorted(found, key=lambda r: -r["instructions"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cap", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    p.add_argument("--block-n", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--num-warps", type=int, default=4, help="a tile's warps (each loop count is per warp)")
    p.add_argument("--out", default=None, help="JSON of every variant's figures")
    args = p.parse_args(argv)
    from airquant.kv import triton_kernel as tq

    rows = {}
    for variant in tq.VARIANTS:
        compiled = compile_split(variant, args.cap, args.block_n, args.dim, warps=args.num_warps)
        sass, usage = listing(compiled.asm["cubin"])
        found = loops(sass)
        hist = found[0] if found else {"instructions": 0, "ops": {}}
        name = f"v{variant[0]}{variant[1]}"
        rows[name] = {**usage, "shared_bytes": compiled.metadata.shared, "history_loop": hist,
                      "loops": [r["instructions"] for r in found]}
        top = ", ".join(f"{k} {v}" for k, v in list(hist["ops"].items())[:10])
        print(f"{name}: {usage['registers']} registers, {compiled.metadata.shared} B shared; history loop "
              f"{hist['instructions']} instructions ({hist['ops'].get('BAR', 0)} BAR): {top}", flush=True)
    try:
        compiled = compile_gluon_history(args.cap, args.block_n)
    except ImportError:  # a Triton without Gluon
        compiled = None
    if compiled is not None:
        sass, usage = listing(compiled.asm["cubin"])
        found = loops(sass)
        hist = found[0] if found else {"instructions": 0, "ops": {}}
        rows["gluon"] = {**usage, "shared_bytes": compiled.metadata.shared, "history_loop": hist, "num_warps": 1,
                         "loops": [r["instructions"] for r in found]}
        top = ", ".join(f"{k} {v}" for k, v in list(hist["ops"].items())[:10])
        print(f"gluon (one warp): {usage['registers']} registers, {compiled.metadata.shared} B shared; history loop "
              f"{hist['instructions']} instructions ({hist['ops'].get('BAR', 0)} BAR): {top}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"cap": args.cap, "block_n": args.block_n, "dim": args.dim,
                                              "num_warps": args.num_warps, "variants": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
