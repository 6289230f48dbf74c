"""The host NF4 kernel (quant/kernels/nf4_cpu.c, through nf4_cpu.matmul) and its torch fallback against a float64
decode of the same bytes: random NF4 matrices, plain and double-quant absmax, shapes whose blocks lie in rows (the
vector path) and odd ones (blocks straddling rows, an odd row length: the generic path), 1 to 19 rows of x."""

from __future__ import annotations

import shutil

import pytest
import torch

from airquant.quant.kernels import nf4_cpu

CASES = [(64, 128, 64, True, 1), (33, 256, 64, False, 3), (17, 70, 64, True, 2), (5, 9, 64, False, 1),
         (128, 512, 128, True, 16), (40, 192, 32, False, 9), (300, 1024, 64, True, 19), (7, 64, 64, False, 8),
         (37, 384, 128, True, 1),  # batch 1 in the wide pass: rows in fours (AVX2: twos) and a remainder
         (12, 512, 256, False, 2),  # the wide pass's block index as a shift of 8
         (11, 384, 192, True, 3)]  # a blocksize of 64s that is no power of two: the narrow pass, not the wide


def _reference(x: torch.Tensor, bufs: dict, n: int, k: int, bs: int, double: bool) -> torch.Tensor:
    return x.double() @ nf4_cpu.decode(bufs, n, k, bs, double, torch.float64).t()


def _check(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32
    # fp32 sums of k products: a few ulps of the largest partial sums
    assert (got.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("n, k, bs, double, t", CASES)
def test_c_kernel_equals_a_float64_decode(n, k, bs, double, t):
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no gcc on PATH: the C kernel cannot be built here (matmul runs the torch fallback)")
    assert nf4_cpu.library() is not None, nf4_cpu.host_kernel()
    bufs = nf4_cpu.random_nf4(n, k, bs, double, seed=n)
    x = torch.randn(t, k)
    _check(nf4_cpu.matmul(x, bufs, n, k, bs, double), _reference(x, bufs, n, k, bs, double))


@pytest.mark.parametrize("n, k, bs, double, t", CASES[:4])
def test_torch_fallback_equals_a_float64_decode(n, k, bs, double, t):
    bufs = nf4_cpu.random_nf4(n, k, bs, double, seed=n)
    x = torch.randn(t, k)
    _check(nf4_cpu.matmul_torch(x, bufs, n, k, bs, double), _reference(x, bufs, n, k, bs, double))


def test_unaligned_views_of_a_byte_buffer():
    """An expert's tensors are views into a layer's host bytes at any offset: the kernel reads them as they are."""
    if nf4_cpu.library() is None:
        pytest.skip(f"the C kernel is not in use here: {nf4_cpu.host_kernel()}")
    bufs = nf4_cpu.random_nf4(48, 128, 64, False, seed=3)
    raw = torch.zeros(1 + bufs["absmax"].numel() * 4, dtype=torch.uint8)
    raw[1:] = bufs["absmax"].view(torch.uint8)
    shifted = {**bufs, "absmax": raw[1:]}  # fp32 absmax starting one byte into the buffer, as bytes
    x = torch.randn(2, 128)
    want = _reference(x, bufs, 48, 128, 64, False)
    _check(nf4_cpu.matmul(x, shifted, 48, 128, 64, False), want)


def test_measure_reports_both_figures():
    bw = nf4_cpu.measure(seconds=0.2, n=256, k=1024)
    assert bw.gemv_gbps > 0 and bw.copy_gbps > 0 and bw.threads >= 1 and bw.kernel
    assert "GB/s" in bw.describe()


@pytest.mark.parametrize("double", [False, True])
def test_one_call_for_several_experts_equals_each_alone(double):
    """``matmul_experts``: rows 0-2 through expert 2, row 3 through expert 0, rows 4-9 through expert 1 (a table of
    three experts' pointers, gathered per call) equal each expert's own product; the fallback gives the same."""
    n, k = 40, 192
    mats = [nf4_cpu.random_nf4(n, k, 64, double, seed=s) for s in range(3)]
    table = nf4_cpu.Matrices.of(mats)
    x = torch.randn(10, k)
    experts, rows = torch.tensor([2, 0, 1]), torch.tensor([0, 3, 4, 10])
    want = torch.cat([_reference(x[a:b], mats[e], n, k, 64, double)
                      for e, a, b in zip(experts.tolist(), rows[:-1].tolist(), rows[1:].tolist())])
    _check(nf4_cpu.matmul_experts(x, table, experts, rows, n, k, 64, double), want)


@pytest.mark.parametrize("n, k, bs, double", [(40, 192, 64, True), (17, 70, 64, False)])
def test_experts_with_many_rows_are_decoded_and_multiplied(n, k, bs, double, monkeypatch):
    """An expert with ``GEMM_ROWS`` rows or more goes through the C decode and torch's product (in row chunks of
    ``DECODE_BYTES``), the others through the kernel, in one call: every row equals a float64 decode's product,
    on a straddling shape too (blocks across rows, an odd row length)."""
    if nf4_cpu.library() is None:
        pytest.skip(f"the C kernel is not in use here: {nf4_cpu.host_kernel()}")
    monkeypatch.setattr(nf4_cpu, "DECODE_BYTES", 4 * k * 6)  # 6 rows decoded at a time: several chunks
    mats = [nf4_cpu.random_nf4(n, k, bs, double, seed=s) for s in range(3)]
    table = nf4_cpu.Matrices.of(mats)
    many = nf4_cpu.GEMM_ROWS
    experts, rows = torch.tensor([1, 2, 0]), torch.tensor([0, many + 3, many + 5, 2 * many + 5])
    x = torch.randn(int(rows[-1]), k)
    want = torch.cat([_reference(x[a:b], mats[e], n, k, bs, double)
                      for e, a, b in zip(experts.tolist(), rows[:-1].tolist(), rows[1:].tolist())])
    _check(nf4_cpu.matmul_experts(x, table, experts, rows, n, k, bs, double), want)
    whole = nf4_cpu.matmul_experts(x[:many + 3], table, experts[:1], rows[:2], n, k, bs, double)  # decoded only
    _check(whole, want[:many + 3])


def test_a_thread_count_that_is_not_a_number_is_named_with_its_fix(monkeypatch):
    from airquant.errors import AirQuantError

    monkeypatch.setenv(nf4_cpu.THREADS_ENV, "four")
    with pytest.raises(AirQuantError, match=r"AIRQUANT_CPU_THREADS='four' is not a whole number.*e\.g\. 4"):
        nf4_cpu.threads()
    monkeypatch.setenv(nf4_cpu.THREADS_ENV, "3")
    assert nf4_cpu.threads() == 3


def test_kernel_says_so_when_it_cannot_allocate_the_split_input():
    """Rows claimed past any memory: the kernel returns -1 before it reads x or writes out (was: an unchecked
    malloc, then a write through NULL)."""
    lib = nf4_cpu.library()
    if lib is None or lib.nf4_lanes() == 0:
        pytest.skip("needs the compiled kernel's vector path (gcc, AVX2 or AVX-512)")
    rows = torch.tensor([0, 1 << 40], dtype=torch.int64)  # x split: 2^40 x 128 fp32, 512 TiB
    table = torch.zeros((1, len(nf4_cpu.BUFFERS)), dtype=torch.int64)
    assert lib.nf4_experts(1, table.data_ptr(), rows.data_ptr(), None, 64, 128, 64, 1, None, None, 1) == -1


@pytest.mark.parametrize("lanes, flags", [(8, ["-mno-avx512f"]), (16, []), (16, ["-DNF4_PREFETCH=0"]),
                                          (16, ["-DNF4_DIVIDE"])])
def test_each_vector_width_equals_a_float64_decode(lanes, flags, monkeypatch, tmp_path):
    """The kernel built for AVX2 (8 lanes: -mno-avx512f) and for AVX-512 where this CPU has it (as shipped, with
    the wide pass's software prefetch, which reads past a matrix's end only as a hint; without it; with the block
    index by division, the sweep's baseline), each against the float64 decode: shapes that take the wide path
    (k % 128 == 0, power-of-two blocks of 64 or more), the narrow one (blocks of 32, or of 192) and the generic
    one, 1 to 9 rows of x."""
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no gcc on PATH")
    flags_line = nf4_cpu._cpu_flags()
    if ("avx512f" if lanes == 16 else "avx2") not in flags_line.split():
        pytest.skip(f"this CPU has no {'AVX-512' if lanes == 16 else 'AVX2'}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(nf4_cpu, "FLAGS", [*nf4_cpu.FLAGS, *flags])
    nf4_cpu.library.cache_clear()
    try:
        assert nf4_cpu.library() is not None and nf4_cpu.library().nf4_lanes() == lanes
        for n, k, bs, double, t in [(24, 256, 64, True, 1), (16, 512, 128, False, 4), (9, 384, 64, False, 9),
                                    (8, 192, 32, True, 3), (5, 64, 64, False, 2), (3, 70, 64, True, 1),
                                    (23, 256, 64, False, 1), (12, 512, 256, True, 2),  # batch 1: rows in fours
                                    (11, 384, 192, False, 3)]:  # or twos, a remainder; blocks of 256 and 192
            bufs = nf4_cpu.random_nf4(n, k, bs, double, seed=k + t)
            x = torch.randn(t, k)
            _check(nf4_cpu.matmul(x, bufs, n, k, bs, double), _reference(x, bufs, n, k, bs, double))
    finally:
        nf4_cpu.library.cache_clear()
