"""Every Triton/Gluon kernel compiles, without a GPU, for the GPUs AirQuant targets: T4 (sm_75), A100 (sm_80),
consumer Ampere/Ada (sm_86/89) and Hopper (sm_90), with fp16, bf16 (where the target has it) and fp32 inputs.

Triton's offline compilation (``triton.compile(ASTSource(...), target=GPUTarget("cuda", cap, 32))``) runs the
whole pipeline down to a cubin with the ptxas bundled in the triton wheel, so an instruction a target lacks
(griddepcontrol before sm_90, say) fails here as it would at the first launch on that GPU. Each compiled
kernel is also checked for TF32 products (AirQuant asks for IEEE fp32 or half-precision products, never TF32)
and against the target's shared memory per block (autotuned kernels: at least one config must fit, as the
autotuner drops those that do not launch). Paths a target cannot take (the TMA GEMV before Hopper, bf16
before Ampere, the TurboQuant attention kernel at head sizes whose rotation does not fit shared memory) are not
compiled for it: the capability rule sends those calls elsewhere (tests/engine/test_capability.py), and
test_tq_attention_shared_memory_rule checks that rule against the compiled kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from airquant.engine import norm_kernel, rope_kernel  # noqa: E402
from airquant.engine.moe import uva_copy  # noqa: E402
from airquant.kv import triton_kernel as tq  # noqa: E402
from airquant.quant import kernels  # noqa: E402
from airquant.quant.kernels import (  # noqa: E402
    SHARED_PER_BLOCK,  # noqa: E402
    int2_gluon,
    int2_triton,
    nf4_moe,
    packed_triton,
)

pytestmark = pytest.mark.slow  # ~300 compiles, 0.3-1 s each

TARGETS = (75, 80, 86, 89, 90)
MAX_SHARED = {cap: SHARED_PER_BLOCK[divmod(cap, 10)] for cap in TARGETS}
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Kernel:
    """A kernel to compile: its pointer types (``X`` stands for the input dtype), constexprs (may depend on
    the input dtype), launch options, and the oldest capability whose path uses it."""

    name: str
    fn: Callable[[], object]  # the kernel object (autotune/heuristics wrappers are unwrapped)
    pointers: dict[str, str]
    constexprs: Callable[[str], dict] = lambda x: {}
    options: dict = field(default_factory=lambda: {"num_warps": 4})
    min_cap: int = 75
    gluon: bool = False
    configs: Callable[[], list] | None = None  # the autotune list, where the kernel is autotuned


def _jit(obj) -> JITFunction:
    while not isinstance(obj, JITFunction):
        obj = obj.fn
    return obj


def _first(configs) -> tuple[dict, dict]:
    c = configs[0]
    return dict(c.kwargs), {"num_warps": c.num_warps, "num_stages": c.num_stages}


_GEMV_TILE, _GEMV_OPT = _first(int2_triton._gemv_configs())
_GEMM_TILE, _GEMM_OPT = _first(int2_triton._gemm_configs())
_PACKED_TILE, _PACKED_OPT = _first(packed_triton._configs())
_SPLITK_TILE, _SPLITK_OPT = _first(packed_triton._small_m_configs())
_INT2_PTRS = {"x_ptr": "X", "words_ptr": "i32", "scales_ptr": "fp16", "zeros_ptr": "fp16", "ow_ptr": "fp16",
              "oi_ptr": "i32"}
# Centroid tables come in the products' dtype (the model's; fp32 products read fp32 ones): triton_kernel.attention.
_Q = {"Q": "X", "QR": "fp32", "KF": "X", "VF": "X", "KC": "u8", "VC": "u8", "KR": "fp32", "VR": "fp32",
      "KCent": "X", "VCent": "X", "KMean": "fp32", "VMeanRot": "fp32", "Keep": "i8",
      "OutM": "fp32", "OutL": "fp32", "OutAcc": "fp32"}
_DOT = {"fp32": 0, "bf16": 1, "fp16": 2}  # triton_kernel._product's operand codes for that model dtype


def _packed(fmt: int, split: bool, **extra) -> Kernel:
    gguf = fmt >= packed_triton.FMT_Q4_0
    word = "u8" if gguf else "i32"
    tile, opt = (_SPLITK_TILE, _SPLITK_OPT) if split else (_PACKED_TILE, _PACKED_OPT)
    name = ["gptq", "awq", "q4_0", "q4_1", "q8_0"][fmt] + ("_splitk" if split else "")
    ts = {2: 18, 3: 20, 4: 34}.get(fmt, 0)
    return Kernel(
        f"packed_{name}", lambda: packed_triton._packed_gemm_kernel,
        {"x_ptr": "X", "y_ptr": "fp32" if split else "X", "w_ptr": word, "z_ptr": word,
         "s_ptr": "u8" if gguf else "fp16", "g_ptr": word},
        lambda x: {"FMT": fmt, "BITS": extra.get("bits", 4), "ZERO_OFFSET": 0, "TS": ts, "IEEE": x == "fp32",
                   **tile},
        opt, configs=packed_triton._small_m_configs if split else packed_triton._configs)


def _tq_split(bits_k: int, bits_v: int, norm8: bool, dim: int = 64, paged: bool = False,
              variant: tuple[int, int] = (0, 0), block_n: int = 64, maxnreg: int | None = None) -> Kernel:
    """The split kernel at head size 64 (every target launches it; 128 is checked by the shared-memory rule);
    ``paged``: reading the decode loop's arena through its page table, with a mask and each row's own history
    length (as the loop launches it); ``variant``: the history tiles' (COLS, BYTES) (``tq.VARIANTS``);
    ``maxnreg``: ptxas' cap on registers a thread."""
    norms = "u8" if norm8 else "fp16"
    tag = ("" if variant == (0, 0) else f"_v{variant[0]}{variant[1]}") + ("" if block_n == 64 else f"_n{block_n}")
    tag += "" if maxnreg is None else f"_r{maxnreg}"
    return Kernel(
        f"tq_split_k{bits_k}v{bits_v}{'_norm8' if norm8 else ''}{'_paged' if paged else ''}{tag}",
        lambda: tq._split_kernel,
        {**_Q, "KN": norms, "VN": norms, "KByte": _Q["KCent"], "VByte": _Q["VCent"], "Slots": "i64",
         "Table": "i64", "Keep": "i8", "HistLen": "i64" if paged else "fp32"},
        lambda x: {"D": dim, "BITS_K": bits_k, "BITS_V": bits_v, "DOT": _DOT[x], "BLOCK_M": 16, "BLOCK_N": block_n,
                   "NORM8_K": norm8, "NORM8_V": norm8, "HAS_KMEAN": True, "HAS_VMEAN": True, "HAS_KEEP": paged,
                   "PAGED": paged, "PAGE": 64, "ROW_HIST": paged, "COLS": variant[0], "BYTES": variant[1]},
        {"num_warps": 4, "num_stages": 1, **({} if maxnreg is None else {"maxnreg": maxnreg})},
        configs=lambda: tq._split_tuned.configs)


_NF4 = {"x_ptr": "X", "out_ptr": "X", "bias_ptr": "X", "weights_ptr": "X", "w_ptr": "u8", "a_ptr": "u8",
        "na_ptr": "fp32", "nqm_ptr": "fp32", "noff_ptr": "fp32", "qm_ptr": "fp32"}


def _nf4_moe(grouped: bool, down: bool, block_m: int = nf4_moe.BLOCK_M) -> Kernel:
    """The fused routed-expert kernels (double-quant NF4, blocksize 64, Qwen3-30B-A3B's down projection K); the
    grouped one at each block width a call may take (``nf4_moe.block_rows``)."""
    fixed = {"K": 768, "TOP_K": 8, "DOWN": down, "HAS_BIAS": True, "DOUBLE": True, "BS": 64, "BLOCK_N": 64}
    if grouped:
        return Kernel(f"nf4_moe_grouped_{'down' if down else 'up'}_m{block_m}", lambda: nf4_moe._grouped_kernel,
                      {**_NF4, "out_ptr": "fp32" if down else "X", "rows_ptr": "i64", "experts_ptr": "i64"},
                      lambda x: {**fixed, "IEEE": x == "fp32", "BLOCK_M": block_m, "BLOCK_K": 64},
                      {"num_warps": 4, "num_stages": nf4_moe.GROUPED_STAGES})
    return Kernel(f"nf4_moe_gemv_{'down' if down else 'up'}", lambda: nf4_moe._gemv_kernel,
                  {**_NF4, "ids_ptr": "i32"}, lambda x: {**fixed, "BLOCK_N": 32, "BLOCK_K": 256})


KERNELS = [
    _nf4_moe(False, False), _nf4_moe(False, True),
    *(_nf4_moe(True, down, m) for m in (nf4_moe.BLOCK_M, *nf4_moe.BLOCK_M_WIDE) for down in (False, True)),
    Kernel("rope", lambda: rope_kernel.rope_kernel, dict.fromkeys(("q_ptr", "k_ptr", "qo_ptr", "ko_ptr", "cos_ptr",
                                                                   "sin_ptr"), "X"),
           lambda x: {"D": 128, "BLOCK": 128}, {"num_warps": 1}),
    Kernel("rms_norm", lambda: norm_kernel.rms_norm_kernel, {"x_ptr": "X", "w_ptr": "X", "out_ptr": "X"},
           lambda x: {"BLOCK": 2048}, {"num_warps": 8}),
    Kernel("uva_gather", lambda: uva_copy._gather_kernel, {"src_ptr": "u8", "dst_ptr": "u8", "table_ptr": "i64"},
           lambda x: {"CHUNK": uva_copy.CHUNK, "BLOCK": uva_copy.BLOCK}),
    *(Kernel(f"uva_gather_images{'_words' if words else ''}", lambda: uva_copy._gather_images_kernel,
             {"src_ptr": "u8", "dst_ptr": "u8", "guess_ptr": "i64", "free_ptr": "i32", "slots_ptr": "i32"},
             lambda x, u=4 if words else 1: {"ROUNDS": 4, "WORDS": u == 4, "CHUNK": uva_copy.IMAGE_CHUNK // u,
                                             "BLOCK": uva_copy.IMAGE_BLOCK // u},
             {"num_warps": uva_copy.IMAGE_WARPS}) for words in (False, True)),
    Kernel("spec_plan", lambda: uva_copy._spec_plan_kernel,
           {"logits_ptr": "X", "table_ptr": "i32", "slots_ptr": "i32", "guess_ptr": "i64", "free_ptr": "i32",
            "copied_ptr": "i64", "calls_ptr": "i64"}, lambda x: {"K": 8, "BLOCK_E": 128}, {"num_warps": 1}),
    Kernel("spec_settle", lambda: uva_copy._spec_settle_kernel,
           {"table_ptr": "i32", "guess_ptr": "i64", "free_ptr": "i32", "slots_ptr": "i32"}, lambda x: {"K": 8},
           {"num_warps": 1}),
    Kernel("int2_gemv", lambda: int2_triton._int2_gemv_kernel, {**_INT2_PTRS, "y_ptr": "fp32"},
           lambda x: {"GROUP": 64, "BLOCK_O": 32, "EVEN_K": True, **_GEMV_TILE}, _GEMV_OPT,
           configs=int2_triton._gemv_configs),
    Kernel("int2_gemm", lambda: int2_triton._int2_gemm_kernel, {**_INT2_PTRS, "y_ptr": "X"},
           lambda x: {"GROUP": 64, "IEEE": x == "fp32", "BLOCK_O": 32, **_GEMM_TILE}, _GEMM_OPT,
           configs=int2_triton._gemm_configs),
    _packed(packed_triton.FMT_GPTQ, False), _packed(packed_triton.FMT_GPTQ, True, bits=8),
    _packed(packed_triton.FMT_AWQ, False), _packed(packed_triton.FMT_Q4_0, False),
    _packed(packed_triton.FMT_Q4_1, True), _packed(packed_triton.FMT_Q8_0, False),
    Kernel("int2_gluon_prep", lambda: int2_gluon._prep_kernel,
           {"x_ptr": "X", "tab_ptr": "fp32", "xs_ptr": "fp32", "cnt_ptr": "fp32"},
           lambda x: {"GS": 32, "PS": 64, "BP": 128, "PDL": False}),
    Kernel("int2_gluon_ldg", lambda: int2_gluon._gemv_kernel,
           {**_INT2_PTRS, "tab_ptr": "fp32", "xs_ptr": "fp32", "part_ptr": "fp32"},
           lambda x: {"WPG": 2, "GPS": 2, "R": int2_gluon.R, "NW": int2_gluon.NW, "D": int2_gluon.D, "EVEN": True},
           {"num_warps": int2_gluon.NW}, gluon=True),
    Kernel("int2_gluon_reduce", lambda: int2_gluon._reduce_kernel, {"part_ptr": "fp32", "y_ptr": "X"},
           lambda x: {"BLOCK_N": 256, "BLOCK_S": 16}),
    Kernel("int2_gluon_prep_pdl", lambda: int2_gluon._prep_kernel,
           {"x_ptr": "X", "tab_ptr": "fp32", "xs_ptr": "fp32", "cnt_ptr": "i32"},
           lambda x: {"GS": 32, "PS": 64, "BP": 128, "PDL": True}, min_cap=90),
    Kernel("int2_gluon_tma", lambda: int2_gluon._gemv_tma_kernel, {}, options={"num_warps": int2_gluon.TNW},
           min_cap=90, gluon=True),
    _tq_split(4, 2, False), _tq_split(3, 3, True), _tq_split(2, 4, False), _tq_split(4, 2, False, paged=True),
    _tq_split(4, 2, False, paged=True, variant=(1, 0)), _tq_split(4, 2, False, paged=True, variant=(0, 1)),
    _tq_split(3, 3, True, variant=(0, 1)), _tq_split(2, 4, False, variant=(0, 1)),
    _tq_split(4, 2, False, paged=True, variant=(0, 1), block_n=16, maxnreg=128),
    Kernel("tq_merge", lambda: tq._merge_kernel, {"OutM": "fp32", "OutL": "fp32", "OutAcc": "fp32", "Out": "X",
                                                  "RotV": "fp32"},
           lambda x: {"D": 64, "BLOCK_M": 16}),
]


def _tma_signature(x: str) -> tuple[dict, dict]:
    """Descriptor types of the TMA GEMV as _int2_gemv_tma builds them (groups of 32)."""
    from triton.experimental.gluon import language as gl

    bn, gt = int2_gluon.TR * 16 * int2_gluon.TNW, int2_gluon.TW_ // 2
    words = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=32, rank=2)
    table = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    scales = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    types = {"t_desc": f"tensordesc<fp32[32, 64],{table!r}>", "w_desc": f"tensordesc<i32[{bn}, 16],{words!r}>",
             "s_desc": f"tensordesc<fp16[{bn}, {gt}],{scales!r}>", "z_desc": f"tensordesc<fp16[{bn}, {gt}],{scales!r}>",
             "xs_ptr": "*fp32", "part_ptr": "*fp32", "cnt_ptr": "*i32", "y_ptr": f"*{x}", "x_ptr": f"*{x}",
             "ow_ptr": "*fp16", "oi_ptr": "*i32"}
    return types, {"WPG": 2, "R": int2_gluon.TR, "NW": int2_gluon.TNW, "STAGES": int2_gluon.TSTAGES}


def compile_kernel(kernel: Kernel, cap: int, x: str):
    fn = _jit(kernel.fn())
    if kernel.name == "int2_gluon_tma":
        types, constexprs = _tma_signature(x)
    else:
        types = {k: "*" + (x if v == "X" else v) for k, v in kernel.pointers.items()}
        constexprs = kernel.constexprs(x)
    signature = {p.name: "constexpr" if p.is_constexpr else types.get(p.name, "i32") for p in fn.params}
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    assert not missing, f"{kernel.name}: constexprs not given: {missing}"
    # Pointers 16-byte aligned, as torch allocates them: the vectorized loads of the real launch.
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(fn.params) if signature[p.name][0] == "*"}
    source = (GluonASTSource if kernel.gluon else ASTSource)(fn, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", cap, 32), options=kernel.options)


def _matrix():
    for kernel in KERNELS:
        for cap in TARGETS:
            for x in DTYPES:
                supported = cap >= kernel.min_cap and kernels.dtype_supported(DTYPES[x], divmod(cap, 10))
                if supported:
                    yield pytest.param(kernel, cap, x, id=f"{kernel.name}-sm_{cap}-{x}")


@pytest.mark.parametrize("kernel,cap,x", list(_matrix()))
def test_kernel_compiles_for_target(kernel, cap, x):
    compiled = compile_kernel(kernel, cap, x)
    assert compiled.asm["cubin"], f"{kernel.name}: no cubin for sm_{cap}"
    if kernel.configs is None:  # autotuned kernels: test_an_autotune_config_fits_every_target
        assert compiled.metadata.shared <= MAX_SHARED[cap], (
            f"{kernel.name} needs {compiled.metadata.shared} bytes of shared memory; sm_{cap} has {MAX_SHARED[cap]}")
    assert "tf32" not in compiled.asm["ptx"], f"{kernel.name} asks for TF32 products on sm_{cap} ({x} inputs)"


# The two smallest shared memories among the targets: a config that fits them fits sm_80/89/90.
@pytest.mark.parametrize("cap", (75, 86))
def test_an_autotune_config_fits_every_target(cap):
    """Autotuning drops configs that exceed a GPU's shared memory; each autotuned kernel must keep at least one
    (fp16 inputs, the T4's dtype)."""
    tuned = {}  # one kernel per (kernel, autotune list): the formats of one kernel tile alike
    for k in KERNELS:
        if k.configs is not None:
            tuned.setdefault((k.fn(), k.configs), k)
    for base in tuned.values():
        variants = (Kernel(base.name, base.fn, base.pointers,
                           lambda x, c=c, base=base: {**base.constexprs(x), **c.kwargs},
                           {"num_warps": c.num_warps, "num_stages": c.num_stages}) for c in base.configs())
        # lazily, up to the first that fits: the large FMA tiles of sm_75 take seconds each to compile
        assert any(compile_kernel(k, cap, "fp16").metadata.shared <= MAX_SHARED[cap] for k in variants), (
            f"{base.name}: no autotune config fits sm_{cap}'s shared memory")


@pytest.mark.parametrize("dim", (64, 128))
def test_tq_attention_shared_memory_rule(dim):
    """triton_kernel.shared_bytes bounds what the split and merge kernels need, and triton_kernel.fits (what
    ``applicable`` asks) admits it exactly where that fits: D 128 is too big for a T4's 64 KB, so the T4
    takes the torch ops there; D 64 runs everywhere."""
    splits = [_tq_split(4, 2, False, dim, variant=v) for v in tq.VARIANTS]
    merge = next(k for k in KERNELS if k.name == "tq_merge")
    merge = Kernel(merge.name, merge.fn, merge.pointers, lambda x: {"D": dim, "BLOCK_M": 16})
    for cap in TARGETS:
        shared = max(compile_kernel(k, cap, "fp16").metadata.shared for k in (*splits, merge))
        assert shared <= tq.shared_bytes(dim), (dim, cap, shared)
        assert tq.fits(dim, divmod(cap, 10)) == (tq.shared_bytes(dim) <= MAX_SHARED[cap])
        if tq.fits(dim, divmod(cap, 10)):
            assert shared <= MAX_SHARED[cap]
    assert tq.fits(64, (7, 5)) and not tq.fits(128, (7, 5)) and tq.fits(128, (8, 6)) and tq.fits(128, (9, 0))


def test_the_matrix_covers_every_kernel_and_target():
    """The first three targets get every non-Hopper kernel in fp16 and fp32; bf16 starts at sm_80."""
    ids = {(k.name, cap, x) for k, cap, x in (p.values for p in _matrix())}
    for kernel in KERNELS:
        if kernel.min_cap == 75:
            assert {(kernel.name, cap, "fp16") for cap in TARGETS} <= ids
            assert (kernel.name, 75, "bf16") not in ids and (kernel.name, 80, "bf16") in ids
    assert ("int2_gluon_tma", 90, "bf16") in ids and ("int2_gluon_tma", 89, "fp16") not in ids
