"""NF4 matrices times a few rows on the host CPU, from their packed bytes: the routed-experts host path
(``engine.moe.host``) and ``airquant doctor``'s host GEMV figure.

The kernel is ``nf4_cpu.c``, compiled at first use with ``gcc -O3 -march=native -fopenmp`` into a per-user cache
(``cache_dir``; the file name carries a hash of the source, the compiler and this CPU's flags, and is written
under a temporary name then renamed, so parallel processes never load a half-written library), and called
through ctypes on the tensors' data pointers. gcc is there wherever Triton runs; no wheel is carried. Where it
is missing or the build fails (said once in the log), ``matmul`` decodes the matrix in torch and multiplies
(``matmul_torch``): the same values, more memory traffic. ``AIRQUANT_NO_CPU_KERNEL=1`` forces that path (A/B).

Many rows an expert (a prefill's routed rows): an expert with ``GEMM_ROWS`` rows or more in a call is decoded to
fp32 by the C file's ``nf4_decode`` and multiplied by torch's BLAS, the others by the kernel in the same call. The
kernel decodes each byte once per 4 rows, the decode once: 128 experts of 1536 x 2048 at 128 rows each (a 2048-token
prefill of Qwen3-30B-A3B) took 5.5 s by the kernel alone and 2.4 s so on one Zen core of this repo's CI machine
(32 rows: 0.77 against 0.81 s, the crossing).

Threads: ``AIRQUANT_CPU_THREADS``, else the physical cores less one (less two from 8 cores on), so the
streamer's read-ahead and copy threads always have a core.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from airquant.errors import AirQuantError
from airquant.quant.nf4 import decode_nf4_stacked
from airquant.units import GB

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("nf4_cpu.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
OFF_ENV = "AIRQUANT_NO_CPU_KERNEL"
# An expert with at least this many rows in a call is decoded (C, fp32) and multiplied by torch's BLAS instead of the
# kernel, which decodes each byte once per 4 rows: a prefill's routed rows (measured in the module docstring).
GEMM_ROWS = 32
DECODE_BYTES = 32 << 20  # fp32 rows decoded at a time for that product
THREADS_ENV = "AIRQUANT_CPU_THREADS"
ROUNDS = 5  # turns of products and copies ``measure`` takes the medians of


def threads() -> int:
    """Threads the host kernel runs on (see the module docstring)."""
    given = os.environ.get(THREADS_ENV)
    if given:
        try:
            return max(1, int(given))
        except ValueError:
            raise AirQuantError(f"{THREADS_ENV}={given!r} is not a whole number of threads; set it to e.g. 4, "
                                "or unset it to use the host's physical cores less one or two") from None
    cores = _physical_cores()
    return max(1, cores - (2 if cores >= 8 else 1))


@functools.cache  # psutil reads /proc each call: once per process, not per product
def _physical_cores() -> int:
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "airquant" / "kernels"


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith("flags")), "")


def _build(gcc: str) -> Path:
    source = SOURCE.read_bytes()
    version = subprocess.run([gcc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(source + version.encode() + _cpu_flags().encode() + " ".join(FLAGS).encode()).hexdigest()
    path = cache_dir() / f"nf4_cpu-{key[:16]}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run([gcc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, check=True)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (``host_kernel`` says why; logged once)."""
    if os.environ.get(OFF_ENV):
        return None
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        log.warning("host NF4 kernel: no gcc on PATH; the torch fallback (decode, then matmul) runs instead")
        return None
    try:
        lib = ctypes.CDLL(str(_build(gcc)))
    except (subprocess.CalledProcessError, OSError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("host NF4 kernel: building %s failed (%s); the torch fallback runs instead", SOURCE,
                    detail.strip()[-500:])
        return None
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.nf4_experts.argtypes = [i64, ptr, ptr, ptr, i64, i64, i64, ctypes.c_int, ptr, ptr, ctypes.c_int]
    lib.nf4_experts.restype = ctypes.c_int
    lib.nf4_decode.argtypes = [ptr, i64, i64, i64, i64, ctypes.c_int, ptr, ctypes.c_int]
    lib.nf4_decode.restype = None
    lib.host_copy.argtypes = [ptr, ptr, i64, ctypes.c_int]
    lib.nf4_lanes.restype = ctypes.c_int
    return lib


def host_kernel() -> str:
    """Which host kernel ``matmul`` runs, for ``airquant doctor`` and the log."""
    lib = library()
    if lib is None:
        why = f"{OFF_ENV} set" if os.environ.get(OFF_ENV) else "gcc missing or the build failed"
        return f"torch decode + matmul ({why})"
    isa = {16: "AVX-512", 8: "AVX2"}.get(lib.nf4_lanes(), "generic C")
    return f"C ({isa}, OpenMP)"


# The order of an expert's buffer pointers in the kernel's table (nf4_cpu.c: W, ABSMAX, ...).
BUFFERS = ("weight_packed", "absmax", "nested_absmax", "nested_quant_map", "nested_offset", "quant_map")


@dataclass(frozen=True)
class Matrices:
    """One NF4 matrix of each of several experts, as the kernel takes them: each one's buffers (``bufs``: host
    tensors, kept alive here) and a table of their data pointers, ``[experts, len(BUFFERS)]`` int64. Built once
    per layer's bytes, so a call gathers rows of the table instead of making tensors per expert."""

    bufs: tuple[dict[str, torch.Tensor], ...]
    ptrs: torch.Tensor

    @classmethod
    def of(cls, bufs: list[dict[str, torch.Tensor]]) -> "Matrices":
        kept = tuple({name: t.contiguous() for name, t in b.items()} for b in bufs)
        table = [[b[name].data_ptr() if name in b else 0 for name in BUFFERS] for b in kept]
        return cls(kept, torch.tensor(table, dtype=torch.int64).reshape(len(kept), len(BUFFERS)))


def matmul(x: torch.Tensor, bufs: dict[str, torch.Tensor], n: int, k: int, blocksize: int,
           double: bool, n_threads: int | None = None) -> torch.Tensor:
    """``[T, n]`` fp32: ``x`` ``[T, k]`` times the NF4 matrix ``[n, k]`` (transposed) held by ``bufs``
    (``weight_packed``, ``absmax``, ``quant_map``; with double quant ``nested_absmax``, ``nested_quant_map``,
    ``nested_offset``: host tensors, any alignment); on ``n_threads`` (None: ``threads()``)."""
    rows = torch.tensor([0, x.shape[0]], dtype=torch.int64)
    return matmul_experts(x, Matrices.of([bufs]), torch.zeros(1, dtype=torch.int64), rows, n, k, blocksize, double,
                          n_threads)


def matmul_experts(x: torch.Tensor, mats: Matrices, experts: torch.Tensor, rows: torch.Tensor, n: int, k: int,
                   blocksize: int, double: bool, n_threads: int | None = None) -> torch.Tensor:
    """``[R, n]`` fp32: rows ``rows[j] .. rows[j + 1]`` of ``x`` ``[R, k]`` times the matrix of ``mats``'s expert
    ``experts[j]`` (``experts`` ``[u]``, ``rows`` ``[u + 1]`` int64): every expert of a call in one kernel call,
    on ``n_threads`` (None: ``threads()``)."""
    x = x.to(torch.float32).contiguous()
    n_threads = n_threads or threads()
    lib = library()
    if lib is None:
        out = torch.empty((x.shape[0], n), dtype=torch.float32)
        for j, e in enumerate(experts.tolist()):
            a, b = int(rows[j]), int(rows[j + 1])
            out[a:b] = matmul_torch(x[a:b], mats.bufs[e], n, k, blocksize, double)
        return out
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    table = mats.ptrs.index_select(0, experts).contiguous()
    rows = rows.to(torch.int64).contiguous()
    if x.shape[0] < GEMM_ROWS:  # no expert can have GEMM_ROWS rows (a decode call): the kernel takes them all
        many, skip = None, None
    else:
        counts = rows[1:] - rows[:-1]
        many = counts >= GEMM_ROWS  # [u]: experts whose rows go through a decode and a BLAS product
        skip = many.to(torch.uint8).contiguous()
    if many is None or not bool(many.all()):
        ran = lib.nf4_experts(experts.numel(), table.data_ptr(), rows.data_ptr(),
                              skip.data_ptr() if skip is not None else None, n, k, blocksize, int(double),
                              x.data_ptr(), out.data_ptr(), n_threads)
        if ran < 0:
            raise MemoryError(f"host NF4 kernel: no memory for the {x.shape[0]} x {k} rows of this call's input")
    for j in torch.nonzero(many).flatten().tolist() if many is not None else ():
        _decoded_product(lib, table[j], x, out, int(rows[j]), int(rows[j + 1]), n, k, blocksize, double, n_threads)
    return out


def _decoded_product(lib, ptrs: torch.Tensor, x: torch.Tensor, out: torch.Tensor, a: int, b: int, n: int, k: int,
                     blocksize: int, double: bool, n_threads: int) -> None:
    """``out[a:b] = x[a:b] @ W'`` for one expert (``ptrs``: its row of the pointer table), W decoded by the C
    kernel ``DECODE_BYTES`` of fp32 at a time and multiplied by torch's BLAS."""
    step = max(1, min(n, DECODE_BYTES // (4 * k)))
    w = torch.empty((step, k), dtype=torch.float32)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        lib.nf4_decode(ptrs.data_ptr(), r0, r1, k, blocksize, int(double), w.data_ptr(), n_threads)
        if r0 == 0 and r1 == n:
            torch.mm(x[a:b], w.t(), out=out[a:b])
        else:
            out[a:b, r0:r1] = x[a:b] @ w[:r1 - r0].t()


def decode(bufs: dict[str, torch.Tensor], n: int, k: int, blocksize: int, double: bool,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[n, k]`` matrix of one expert's NF4 ``bufs`` (bitsandbytes' layout and double-quant absmax), decoded
    in ``dtype`` (fp32: the kernel's values; float64: a reference) by ``nf4.decode_nf4_stacked`` as a stack of one."""
    one = {name: t.reshape(1, -1) for name, t in bufs.items()}
    return decode_nf4_stacked(one, n, k, blocksize, double, dtype)[0]


def matmul_torch(x: torch.Tensor, bufs: dict[str, torch.Tensor], n: int, k: int, blocksize: int,
                 double: bool) -> torch.Tensor:
    """``matmul`` by a torch decode of the whole matrix, then one product (the fallback)."""
    return x.to(torch.float32) @ decode(bufs, n, k, blocksize, double).t()


# -- measured figures (airquant doctor, the experts planner) ---------------------------------------------
@dataclass(frozen=True)
class HostBandwidth:
    """The host's figures the experts rule weighs: packed NF4 bytes a second the kernel reads at batch 1, and a
    plain copy's bytes read a second on the same threads (the memory's own pace)."""

    gemv_gbps: float
    copy_gbps: float
    kernel: str
    threads: int

    @property
    def efficiency(self) -> float:
        return self.gemv_gbps / self.copy_gbps if self.copy_gbps else 0.0

    def describe(self) -> str:
        return (f"host      : NF4 GEMV {self.gemv_gbps:.1f} GB/s of packed bytes, memory copy {self.copy_gbps:.1f} "
                f"GB/s read ({self.efficiency:.2f} of it); kernel {self.kernel}, {self.threads} thread"
                + ("s" if self.threads > 1 else ""))


def random_nf4(n: int, k: int, blocksize: int = 64, double: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """NF4 buffers of a random ``[n, k]`` matrix in bitsandbytes' layout (no bitsandbytes needed)."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-n * k // blocksize)
    quant_map = torch.sort(torch.rand(16, generator=g) * 2 - 1).values
    bufs = {"weight_packed": torch.randint(0, 256, ((n * k + 1) // 2, 1), dtype=torch.uint8, generator=g),
            "quant_map": quant_map}
    if double:
        bufs["absmax"] = torch.randint(0, 256, (blocks,), dtype=torch.uint8, generator=g)
        bufs["nested_absmax"] = torch.rand(-(-blocks // 256), generator=g) + 0.5
        bufs["nested_quant_map"] = torch.sort(torch.rand(256, generator=g) * 2 - 1).values
        bufs["nested_offset"] = torch.tensor(0.3)
    else:
        bufs["absmax"] = torch.rand(blocks, generator=g) + 0.1
    return bufs


def measure(seconds: float = 1.0, n: int = 4096, k: int = 4096, n_threads: int | None = None) -> HostBandwidth:
    """``HostBandwidth`` in about ``seconds``: batch-1 products over enough distinct matrices (64 MB of packed
    bytes) that the caches do not hold them, and copies of as many bytes, in ``ROUNDS`` turns (medians); on
    ``n_threads`` (None: ``threads()``, what the host path runs on)."""
    n_threads = n_threads or threads()
    copies = max(1, (64 << 20) // (n * k // 2))
    # The bytes' values do not change the kernel's pace (every nibble and code indexes its table): one fill, and
    # the tables of one random matrix shared by all.
    tables = random_nf4(1, 64, double=True)
    blocks = n * k // 64
    mats = [{**tables, "weight_packed": torch.full((n * k // 2, 1), 0x5A, dtype=torch.uint8),
             "absmax": torch.full((blocks,), 7, dtype=torch.uint8),
             "nested_absmax": torch.ones(-(-blocks // 256))} for _ in range(copies)]
    x = torch.randn(1, k)
    per = mats[0]["weight_packed"].numel() + mats[0]["absmax"].numel()
    # Each matrix's pointer table built once, as the host path builds a layer's (``Matrices``): the figure is the
    # kernel's and the call's, not that of ``matmul``'s per-call table (20-30 us a call, ~10 % of a 8 MB product
    # at 40 GB/s).
    one, rows = torch.zeros(1, dtype=torch.int64), torch.tensor([0, 1], dtype=torch.int64)
    built = [Matrices.of([m]) for m in mats]
    products = [lambda t=t: matmul_experts(x, t, one, rows, n, k, 64, True, n_threads) for t in built]
    src = torch.randint(0, 256, (per * copies,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    lib = library()
    if lib is not None:
        copy = [lambda: lib.host_copy(dst.data_ptr(), src.data_ptr(), src.numel(), n_threads)]
    else:
        copy = [lambda: dst.copy_(src)]
    # Products and copies in turns, the median of each: a shared host's neighbours move either figure by 20-40 %
    # for a while (H200 host, 14 threads: copies of 64-95 GB/s within minutes), so taking both in turns keeps
    # a burst from landing on one of them alone.
    gemv, copied = [], []
    for _ in range(ROUNDS):
        gemv.append(_rate(products, per, seconds / (2 * ROUNDS)))
        copied.append(_rate(copy, src.numel(), seconds / (2 * ROUNDS)))
    return HostBandwidth(statistics.median(gemv) / GB, statistics.median(copied) / GB, host_kernel(), n_threads)


def _rate(calls: list, nbytes: int, seconds: float) -> float:
    """Bytes a second of ``calls`` (each reading ``nbytes``) run in turn: one warm-up call, then as many as fit
    in ``seconds`` (two at least)."""
    calls[0]()
    done, start = 0, time.perf_counter()
    while True:
        calls[done % len(calls)]()
        done += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and done >= 2:
            return done * nbytes / elapsed
