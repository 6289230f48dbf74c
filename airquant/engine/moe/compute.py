"""How the expert pool runs a call's routed experts once they are packed as ``[U, ...]`` tensors, and the
device memory that takes (``ExpertPlan.decode_bytes`` / ``compute_bytes`` are sized by the functions here).

Grouped: transformers 5's fused experts modules (``@use_experts_implementation``) have a grouped-matmul
forward (``grouped_mm``: ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` where present, a
per-expert loop inside transformers otherwise). Quantized experts are first decoded all at once into
stacked dense weights (``ExpertWeights.stacked``), in chunks of at most ``GROUPED_BYTES``, instead of the
eager loop's one decode and two small matmuls per expert: at batch 64, Qwen3-30B-A3B routes all 128
experts of a layer and the per-expert launches, not the math, set the step time.

Few rows (``run_gemv``): when no routed expert of a call has more than ``GEMV_TOKENS`` rows (decode at small
batch: Mixtral at batch 1 multiplies one token by each of 2 experts), decoding them to dense weights writes
and reads back 2 B per weight (Mixtral: 704 MB a layer) to multiply a row or two. Each expert's projections
instead run ``bitsandbytes.matmul_4bit`` on its packed NF4 bytes (``ExpertWeights.matmul``), then the
module's gating and the routing weights, as transformers' grouped forward applies them. Nothing is decoded,
so the plan's decode bytes are an upper bound the path never allocates.

Memory: a chunk's stacked weights (``GROUPED_BYTES``), the temporaries of decoding them (at most
``DECODE_TEMP_BYTES``: larger decodes go in slices of experts) and the intermediates of one grouped call
(gate/up outputs, activations, the hidden rows of every routed (token, expert) pair: at most
``COMPUTE_BYTES``, a long prefill runs in token chunks). Each is bounded whatever the batch.

Dispatched: Llama 4's experts module takes its tokens already spread over every expert, ``[E * T, H]``,
each row scaled by its routing score, which is exactly 0 for an expert the token was not routed to; a
bias-free GLU expert maps a zero row to a zero row, so only experts with a non-zero row need to run.
"""

from __future__ import annotations

import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from airquant.layout import swap_tensor
from airquant.quant import kernels
from airquant.quant.experts import ExpertWeights
from airquant.quant.gptq import AWQLinear, GPTQLinear
from airquant.quant.int2 import Int2Linear
from airquant.quant.nf4 import NF4Linear

log = logging.getLogger(__name__)
GROUPED_BYTES = 1 << 30  # stacked dense expert weights decoded at once; more experts run in further chunks
DECODE_TEMP_BYTES = 128 << 20  # decode temporaries beside them, at most (one expert's where that is more)
COMPUTE_BYTES = 128 << 20  # intermediates of one grouped call, at most (one token's where that is more)
# Temporaries a stacked NF4 decode allocates per dense element beside its output (quant/nf4.py): on CUDA
# bitsandbytes writes the compute dtype directly and only the absmax is decoded in torch (double quant:
# int64 codes and three fp32 copies, 16 B per 64-element block); on CPU the torch decode holds int64 nibble
# indices (8 B), fp32 values (4 B) and the absmax repeated per element (4 B). An expert-by-expert decode
# (other schemes) is given the same allowance for its own temporaries.
DECODE_TEMP_PER_ELEM = {"cuda": 0.5, "cpu": 16.5}
# Rows an expert may have for the call to run by ``run_gemv``. Why 4: bitsandbytes 0.50's CUDA ``gemm_4bit``
# always runs its fused 4-bit kernel up to 4 rows (``_GEMM_4BIT_CUSTOM_FLOOR_M``; older releases: the GEMV
# kernel for 1 row, a dequantize per expert above); from 5 rows on H100/H200 it mostly dequantizes and runs
# ``F.linear`` per expert, the stacked path's work in more launches. 0 turns the path off.
GEMV_TOKENS = 4
# NF4, int2, GPTQ and AWQ experts computed by the fused kernels (``run_fused``: two launches a call, straight from the
# packed bytes: a routed pool's slots or a whole layer's buffers) where a Triton kernel can run (CUDA, or its
# interpreter in tests); False: the per-expert paths (``run_gemv``, the stacked decode, transformers' eager loop).
FUSED = True
# Tokens a routed call may have for the fused kernels (its host list of slots, one per pair, is built per call).
FUSED_TOKENS = 8
# Formats the routed pool's and a whole layer's fused calls take (the host kernel: NF4 only).
FUSED_SCHEMES = ("nf4", "int2", "gptq", "awq")
# Routed rows per expert, on average, up to which a whole layer's call takes the fused kernels. Each 16-row
# block of the grouped kernel decodes its expert's tile again: at 16 rows an expert (Qwen3-30B-A3B, batch 256)
# that is 0.92 of the link, at ~124 (Mixtral, batch 498) it decoded every expert 8 times over, 2.33 s a step
# against 0.48 s for one bitsandbytes decode and a grouped matmul per expert (H200, moe_bench max_batch_device).
FUSED_WHOLE_ROWS = 32
# Routed many-row calls (prefills) of NF4 experts by the grouped kernel from the pool's slots in chunks
# (pool._run_fused_chunks), and a GPU plan without the gather and the stacked decode for them
# (sizing.fused_prefill); False: gathered into packed tensors and decoded stacked (the A/B).
FUSED_PREFILL = True
# Rows an expert may have on average in one chunk of a routed many-row call run by the fused grouped kernels from
# the pool's slots (pool._run_fused_chunks): the widest grouped block (quant/kernels/nf4_moe ``BLOCK_M_WIDE``), so
# that each block decodes its expert's tile about once.
POOL_CHUNK_ROWS = 128
# Per routed (token, expert) row of transformers' grouped forward: int64 expert ids, sort order, its inverse,
# the token ids and this module's masks; the dense rows are counted by ``ExpertMatrices.token_bytes``.
ROW_INDEX_BYTES = 48


@dataclass(frozen=True)
class ExpertMatrices:
    """One expert's matrices (``(out, in)`` each, or a dense tensor's two dims: the count is symmetric) and
    which of them are quantized, decoded stacked (``dequantize_stacked``) or expert by expert."""

    shapes: tuple[tuple[int, int], ...]
    top_k: int
    quantized: tuple[bool, ...]
    stacks: tuple[bool, ...]

    def row_elems(self) -> int:
        """Elements one routed (token, expert) row of transformers' grouped forward holds at most: its input
        row, the gate/up output, the activation and product (``H + 2I + 2I`` for a gated expert); later, the
        down output and its weighted, reordered and summed copies (``4H``); one hidden row more of slack.
        H is the dim every matrix shares; without one, twice the sum of all dims."""
        common = set(self.shapes[0]).intersection(*map(set, self.shapes[1:])) if self.shapes else set()
        if len(self.shapes) < 2 or len(common) != 1:
            return 2 * sum(a + b for a, b in self.shapes)
        hidden = common.pop()
        others = [b if a == hidden else a for a, b in self.shapes]
        return max(hidden + sum(others) + min(others), 4 * hidden) + hidden

    def token_bytes(self, width: int) -> int:
        """Device bytes of one token's ``top_k`` rows in a grouped call."""
        return self.top_k * (self.row_elems() * width + ROW_INDEX_BYTES)

    def call_tokens(self, width: int, cap: int | None = None) -> int:
        """Tokens one grouped call takes: its intermediates within ``COMPUTE_BYTES``, and no more than ``cap``
        (the tokens a call of the experts module ever gets, where that is bounded)."""
        tokens = max(1, COMPUTE_BYTES // self.token_bytes(width))
        return tokens if cap is None else max(1, min(tokens, cap))

    def compute_bytes(self, width: int, cap: int | None = None) -> int:
        return self.call_tokens(width, cap) * self.token_bytes(width)

    @property
    def all_quantized(self) -> bool:
        return bool(self.quantized) and all(self.quantized)

    def fused_bytes(self, width: int, tokens: int) -> int:
        """Device bytes of one fused call of ``tokens`` tokens over the pool (``run_fused``, grouped): per
        (token, expert) pair its (gate/)up row and the activation's temporaries (twice the first matrix's
        outputs), the down product's fp32 row and its weighted sum (twice the last matrix's outputs in fp32),
        and the sorted pairs' indices (``ROW_INDEX_BYTES``)."""
        first, last = self.shapes[0][0], self.shapes[-1][0]
        return tokens * self.top_k * (2 * first * width + 2 * last * 4 + ROW_INDEX_BYTES)

    def fused_call_tokens(self, width: int) -> int:
        """Tokens one fused call takes within ``COMPUTE_BYTES`` (``fused_bytes``)."""
        return max(1, COMPUTE_BYTES // max(1, self.fused_bytes(width, 1)))

    def chunk_experts(self, width: int) -> int:
        """Experts whose stacked dense weights are decoded at once (``GROUPED_BYTES``)."""
        per = sum(a * b for (a, b), q in zip(self.shapes, self.quantized) if q) * width
        return max(1, GROUPED_BYTES // max(per, 1))

    def decode_bytes(self, num: int, width: int, device: str) -> int:
        """Device bytes of decoding ``num`` experts' quantized matrices: the largest chunk's stacked weights,
        and beside them the largest decode's temporaries."""
        n = min(num, self.chunk_experts(width))
        out = sum(n * a * b * width for (a, b), q in zip(self.shapes, self.quantized) if q)
        temps = [decode_temp(a * b, n, width, s, device) for (a, b), q, s in zip(self.shapes, self.quantized,
                                                                               self.stacks) if q]
        return out + max(temps, default=0)


def decode_slice(elems: int, n: int, width: int, stacks: bool, device: str) -> int:
    """Experts of ``n`` decoded per call into their stacked tensor: all at once where the decode's temporaries
    fit ``DECODE_TEMP_BYTES``, else slices (each decoded, then copied in) whose temporaries do (one expert at
    least; an expert-by-expert scheme always slices)."""
    per_elem = DECODE_TEMP_PER_ELEM.get(device, DECODE_TEMP_PER_ELEM["cpu"])
    step = max(1, min(n, int(DECODE_TEMP_BYTES // ((per_elem + 2 * width) * elems))))
    # A slice's output is a temporary too (copied in after): slicing pays only where it lowers the peak.
    if stacks and per_elem * n * elems <= max(DECODE_TEMP_BYTES, (per_elem + 2 * width) * step * elems):
        return n
    return step


def decode_temp(elems: int, n: int, width: int, stacks: bool, device: str) -> int:
    """Temporaries of decoding ``n`` experts' ``elems``-element matrix beside their stacked output: the
    decode's own, and where sliced, each slice's output before its copy (twice: an expert-by-expert decode
    stacks its list)."""
    per_elem = DECODE_TEMP_PER_ELEM.get(device, DECODE_TEMP_PER_ELEM["cpu"])
    s = decode_slice(elems, n, width, stacks, device)
    if s == n and stacks:
        return math.ceil(per_elem * n * elems)
    return math.ceil(s * elems * (per_elem + 2 * width))


def grouped_forward(module):
    """transformers' grouped-matmul experts forward for ``module``, or None (not a fused experts module of
    a transformers version that has one: the module's own forward then runs)."""
    if not hasattr(module, "is_transposed") or not hasattr(module, "has_bias"):
        return None
    try:
        from transformers.integrations import moe
    except ImportError:
        return None
    table = getattr(moe, "ALL_EXPERTS_FUNCTIONS", None)
    fn = table.get("grouped_mm") if table is not None else None
    return fn or getattr(moe, "grouped_mm_experts_forward", None)


def quantized_children(module) -> dict[str, ExpertWeights]:
    return {name: child for name, child in module.named_children() if isinstance(child, ExpertWeights)}


def matrices_of(module, num: int, top_k: int) -> ExpertMatrices:
    """The ``ExpertMatrices`` of a (packed) experts module: quantized children and dense [num, a, b] tensors."""
    quantized = quantized_children(module)
    shapes, flags, stacks = [], [], []
    for child in quantized.values():
        shapes.append((child.out_features, child.in_features))
        flags.append(True)
        stacks.append(hasattr(child.one[0], "dequantize_stacked"))
    for _, t in module.named_parameters(recurse=False):
        if t.dim() == 3 and t.shape[0] == num:
            shapes.append((int(t.shape[1]), int(t.shape[2])))
            flags.append(False)
            stacks.append(False)
    return ExpertMatrices(tuple(shapes), top_k, tuple(flags), tuple(stacks))


def run_grouped(module, fn, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                num: int, tokens: int | None = None, ids: list[int] | None = None) -> torch.Tensor:
    """The experts module on ``hidden`` [T, H] routed by ``index``/``weights`` [T, k] (rows of the ``num``
    packed experts), its quantized weights decoded as stacked dense tensors chunk by chunk, its tokens run
    at most ``tokens`` (the plan's ``call_tokens``) at a time, and within ``COMPUTE_BYTES``. ``ids``: the
    caller's host copy of ``index`` (flat), so that ``run_gemv`` need not read it again."""
    out = run_gemv(module, hidden, index, weights, num, ids=ids)
    if out is not None:
        return out
    quantized = quantized_children(module)
    shape = matrices_of(module, num, index.shape[-1])
    width = hidden.element_size()
    tokens = shape.call_tokens(width, tokens)
    chunk = shape.chunk_experts(width) if quantized else num
    if chunk >= num:
        with _decoded(module, quantized, 0, num, num):
            return _by_tokens(module, fn, hidden, index, weights, tokens)
    out = torch.zeros_like(hidden)
    for start in range(0, num, chunk):
        stop = min(start + chunk, num)
        inside = (index >= start) & (index < stop)  # [T, k]
        rows = inside.any(dim=-1).nonzero().flatten()
        if rows.numel() == 0:
            continue
        with _decoded(module, quantized, start, stop, num):
            for a in range(0, rows.numel(), tokens):
                part_rows = rows[a:a + tokens]
                mask = inside[part_rows]
                # Rows routed partly outside the chunk: those slots point at its first expert with weight 0.
                local = torch.where(mask, index[part_rows] - start, torch.zeros_like(index[part_rows]))
                part = fn(module, hidden[part_rows], local, weights[part_rows] * mask)
                out.index_add_(0, part_rows, part.to(out.dtype))
    return out


def gemv_projections(module) -> tuple[ExpertWeights, ExpertWeights] | None:
    """The (up or gate/up, down) experts of a module ``run_gemv`` reproduces transformers' grouped forward for:
    no bias, post-expert norm or expert parallelism, exactly those two quantized matrices and no dense expert
    tensor, each multiplied from its packed bytes (``ExpertWeights.multiplies_packed``); else None."""
    if GEMV_TOKENS <= 0 or any(getattr(module, flag, False) for flag in
                               ("has_bias", "has_post_expert_norm", "_is_expert_parallel")):
        return None
    first = "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"
    quantized = quantized_children(module)
    if set(quantized) != {first, "down_proj"} or next(module.parameters(recurse=False), None) is not None:
        return None
    if not all(child.multiplies_packed() for child in quantized.values()):
        return None
    return quantized[first], quantized["down_proj"]


def run_gemv(module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
             num: int, ids: list[int] | None = None) -> torch.Tensor | None:
    """transformers' grouped experts forward on ``hidden`` [T, H] routed by ``index``/``weights`` [T, k] to the
    ``num`` packed experts, each expert's projections by ``ExpertWeights.matmul`` on its packed bytes; None
    (nothing computed) where a routed expert has more than ``GEMV_TOKENS`` rows or the module does not qualify
    (``gemv_projections``). ``ids``: ``index`` flat, already on the host (read here otherwise)."""
    if hidden.dim() != 2 or index.dim() != 2 or weights.shape != index.shape:
        return None
    if index.numel() > GEMV_TOKENS * num:  # some expert has more rows: no need to look (no host sync)
        return None
    projections = gemv_projections(module)
    if projections is None:
        return None
    if ids is None:
        ids = index.reshape(-1).tolist()  # [S = T * k]; small: at most GEMV_TOKENS * num
    counts = [ids.count(e) for e in range(num)]
    if max(counts) > GEMV_TOKENS or sum(counts) != len(ids):  # the latter: an id outside the packed experts
        return None
    up, down = projections
    gate = getattr(module, "_apply_gate", None)
    # Rows grouped by expert, as the grouped forward sorts (stable, like the host's counts): sorted on the
    # device, since a tensor made from a host list is a blocking copy on a GPU.
    perm = torch.argsort(index.reshape(-1), stable=True)
    inv = torch.argsort(perm)
    rows = hidden[perm // index.shape[1]]  # [S, H] in expert order
    outs, at = [], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        h = up.matmul(e, rows[at:at + n])  # [n, 2I] or [n, I]
        if getattr(module, "has_gate", True):
            h = gate(h) if gate is not None else _default_gate(module, h)
        else:
            h = module.act_fn(h)
        outs.append(down.matmul(e, h))  # [n, H]
        at += n
    weighted = torch.cat(outs) * weights.reshape(-1)[perm].unsqueeze(-1)  # [S, H]
    # The grouped forward's order and sum: back to (token, slot) order, then the k slots of a token summed.
    total = weighted[inv].view(hidden.shape[0], index.shape[1], -1).sum(dim=1)
    return total.to(hidden.dtype)


@dataclass(frozen=True)
class FusedMatrix:
    """One quantized expert matrix as the fused kernels read it: its ``[n, k]`` shape, and inside a pool slot
    the byte offset of each of its buffers and of its dense bias (offset, dtype), if any; int2: its outlier
    channels and the stored width of their rows."""

    name: str  # the experts module's child ("gate_up_proj", "up_proj", "down_proj")
    n: int
    k: int
    offsets: dict
    bias: tuple[int, torch.dtype] | None
    n_out: int = 0
    cols: int = 0


@dataclass(frozen=True)
class FusedExperts:
    """A quantized experts module whose calls ``run_fused`` computes in two kernel launches from the packed
    bytes: NF4 (quant/kernels/nf4_moe: one blocksize and double-quant setting), int2 (quant/kernels/int2_moe:
    one group; calls of up to ``int2_moe.GEMV_ROWS`` tokens), GPTQ or AWQ (quant/kernels/gptq_moe: one bit width and
    zero offset, or one group; calls of up to ``gptq_moe.GEMV_ROWS`` tokens) (gate/)up and down matrices, optional per-expert
    biases; ``dtypes`` of each buffer."""

    up: FusedMatrix
    down: FusedMatrix
    blocksize: int
    double: bool
    gated: bool
    dtypes: dict
    scheme: str = "nf4"
    group: int = 0  # int2, AWQ
    bits: int = 0  # GPTQ
    zero_offset: int = 0  # GPTQ: what its stored zeros lack (1 in the v1 "gptq" format)

    def pool_operands(self, pool: torch.Tensor) -> tuple:
        """The two matrices' operands over an expert pool's slots (an expert's index is its slot)."""
        if self.scheme in ("gptq", "awq"):
            from airquant.quant.kernels import gptq_moe

            return tuple(gptq_moe.pool_operand_gptq(pool, m.offsets, self.dtypes, m.n, m.k, self.bits,
                                                    self.zero_offset, m.bias, self.awq_group(m))
                         for m in (self.up, self.down))
        if self.scheme == "int2":
            from airquant.quant.kernels import int2_moe

            return tuple(int2_moe.pool_operand_int2(pool, m.offsets, self.dtypes, m.n, m.k, self.group, m.n_out,
                                                    m.cols, m.bias) for m in (self.up, self.down))
        from airquant.quant.kernels.nf4_moe import pool_operand

        return tuple(pool_operand(pool, m.offsets, self.dtypes, m.n, m.k, self.blocksize, self.double, m.bias)
                     for m in (self.up, self.down))

    def module_operands(self, module) -> tuple:
        """The two matrices' operands over the module's own stacked ``[E, ...]`` buffers (a whole layer)."""
        from airquant.quant.kernels import gptq_moe, int2_moe
        from airquant.quant.kernels.nf4_moe import stacked_operand

        ops = []
        for m in (self.up, self.down):
            child = getattr(module, m.name)
            bias = getattr(module, f"{m.name}_bias", None) if m.bias is not None else None
            buffers = {s: getattr(child, s) for s in child.suffixes}
            if self.scheme in ("gptq", "awq"):
                ops.append(gptq_moe.stacked_operand_gptq(buffers, m.n, m.k, self.bits, self.zero_offset, bias,
                                                         self.awq_group(m)))
            elif self.scheme == "int2":
                ops.append(int2_moe.stacked_operand_int2(buffers, m.n, m.k, self.group, m.n_out, m.cols, bias))
            else:
                ops.append(stacked_operand(buffers, m.n, m.k, self.blocksize, self.double, bias))
        return tuple(ops)

    @property
    def max_tokens(self) -> int | None:
        """Tokens a call may have for ``run_fused`` (None: any; int2, GPTQ and AWQ have no grouped kernel)."""
        if self.scheme == "int2":
            from airquant.quant.kernels import int2_moe

            return int2_moe.GEMV_ROWS
        if self.scheme in ("gptq", "awq"):
            from airquant.quant.kernels import gptq_moe

            return gptq_moe.GEMV_ROWS
        return None

    def awq_group(self, m: FusedMatrix) -> int:
        """AWQ: matrix ``m``'s group for the GPTQ/AWQ kernels (the whole row for a group size <= 0); else 0."""
        if self.scheme != "awq":
            return 0
        from airquant.quant.kernels import gptq_moe

        return gptq_moe.awq_group(self.group, m.k)


def fused_experts(module, names: tuple[str, ...] | None = None, dtypes: tuple | None = None,
                  offsets: tuple[int, ...] | None = None, straddling: bool = False,
                  schemes: tuple[str, ...] = ("nf4",)) -> FusedExperts | None:
    """The ``FusedExperts`` of a quantized experts module, or None: the fused kernels do not apply (a scheme
    not in ``schemes``: "nf4", "int2", "gptq", "awq"; a block straddling two rows, a post-expert norm, expert parallelism,
    another quantized or dense tensor). With ``names``/``dtypes``/``offsets`` (a routed layer's slot: tensors
    relative to the module) the slot must hold exactly those matrices and biases, and their offsets are
    recorded. ``straddling``: NF4 blocks may straddle rows (the host kernel, quant/kernels/nf4_cpu, takes any
    layout; the Triton kernels do not). The host kernel takes NF4 only (the default); direct reads and the
    pool's and a whole layer's fused calls ask for ``FUSED_SCHEMES``."""
    if any(getattr(module, flag, False) for flag in ("has_post_expert_norm", "_is_expert_parallel")):
        return None
    gated = getattr(module, "has_gate", True)
    first = "gate_up_proj" if gated else "up_proj"
    quantized = quantized_children(module)
    biased = bool(getattr(module, "has_bias", False))
    dense = {n for n, t in module.named_parameters(recurse=False)}
    if set(quantized) != {first, "down_proj"} or dense - ({f"{first}_bias", "down_proj_bias"} if biased else set()):
        return None
    templates = [quantized[first].one[0], quantized["down_proj"].one[0]]
    if "int2" in schemes and all(isinstance(t, Int2Linear) for t in templates):
        if len({t.group for t in templates}) != 1 or any(t.in_features % 4 for t in templates):
            return None
        scheme = "int2"
    elif "gptq" in schemes and all(isinstance(t, GPTQLinear) for t in templates):
        if len({(t.bits, t.zero_offset) for t in templates}) != 1:
            return None
        scheme = "gptq"
    elif "awq" in schemes and all(isinstance(t, AWQLinear) for t in templates):
        if len({t.group_size for t in templates}) != 1:
            return None
        scheme = "awq"
    elif "nf4" in schemes and all(isinstance(t, NF4Linear) and (straddling or t.in_features % t.blocksize == 0)
                                  for t in templates) and len({(t.blocksize, t.double_quant) for t in templates}) == 1:
        scheme = "nf4"
    else:
        return None
    where = dict(zip(names, zip(offsets, dtypes))) if names is not None else {}
    matrices, used, kinds = [], set(), {}
    for name, t in zip((first, "down_proj"), templates):
        child = quantized[name]
        kinds.update({s: getattr(child, s).dtype for s in child.suffixes})
        bufs = {s: where[f"{name}.{s}"][0] for s in child.suffixes if f"{name}.{s}" in where}
        bias = where.get(f"{name}_bias") if biased and names is not None else ((0, None) if biased else None)
        used |= {f"{name}.{s}" for s in child.suffixes} | ({f"{name}_bias"} if biased else set())
        outliers = scheme == "int2" and t.n_outliers
        matrices.append(FusedMatrix(name, t.out_features, t.in_features, bufs, bias,
                                    n_out=t.n_outliers if outliers else 0,
                                    cols=int(child.outlier_weight.shape[-1]) if outliers else 0))
    if names is not None and used != set(names):
        return None
    if scheme == "int2":
        return FusedExperts(matrices[0], matrices[1], 0, False, gated, kinds, scheme="int2", group=templates[0].group)
    if scheme == "gptq":
        return FusedExperts(matrices[0], matrices[1], 0, False, gated, kinds, scheme="gptq", bits=templates[0].bits,
                            zero_offset=templates[0].zero_offset)
    if scheme == "awq":
        return FusedExperts(matrices[0], matrices[1], 0, False, gated, kinds, scheme="awq", bits=4,
                            group=templates[0].group_size)
    return FusedExperts(matrices[0], matrices[1], templates[0].blocksize, templates[0].double_quant, gated, kinds)


def run_fused(spec: FusedExperts, module, operands: tuple, hidden: torch.Tensor, ids: torch.Tensor,
              weights: torch.Tensor, experts: int, routed: int | None = None) -> torch.Tensor:
    """transformers' grouped experts forward on ``hidden`` [T, H] for the pairs (token, k) whose experts are
    ``ids`` [T, k] (indices into ``operands``' ``experts``: pool slots or the module's experts), weighted by
    ``weights`` [T, k]: the (gate/)up matrix of every pair in one launch, the module's own gating, then the
    down matrix, weighting and sum in another (GEMV for few tokens; above, pairs sorted into per-expert blocks
    of a grouped tensor-core product, on the device, as wide as the routed experts' rows on average: ``routed``
    experts of ``experts``, where the caller knows how many)."""
    up_op, down_op = operands
    if spec.scheme in ("gptq", "awq"):
        from airquant.quant.kernels import gptq_moe

        h = activate(module, gptq_moe.up_gptq(hidden, ids, up_op), spec.gated)  # [T * k, I]
        return gptq_moe.down_gptq(h, ids, weights, down_op, hidden.dtype)  # [T, H]
    if spec.scheme == "int2":
        from airquant.quant.kernels import int2_moe

        h = activate(module, int2_moe.up_int2(hidden, ids, up_op), spec.gated)  # [T * k, I]
        return int2_moe.down_int2(h, ids, weights, down_op, hidden.dtype)  # [T, H]
    from airquant.quant.kernels import nf4_moe

    sorted_pairs = None if hidden.shape[0] <= nf4_moe.GEMV_ROWS else nf4_moe.sort_pairs(
        ids, experts, nf4_moe.block_rows(ids.numel() / max(1, min(routed or experts, ids.numel()))))
    h = activate(module, nf4_moe.up(hidden, ids, up_op, sorted_pairs), spec.gated)  # [T * k, I]
    return nf4_moe.down(h, ids, weights, down_op, hidden.dtype, sorted_pairs)  # [T, H]


class FusedWholeExperts:
    """Stands in for a whole streamed layer's quantized experts ``forward``: calls with a routing index run by
    ``run_fused`` on the module's stacked NF4 buffers where the kernels can run (CUDA; the interpreter in
    tests) and the call routes at most ``FUSED_WHOLE_ROWS`` rows an expert on average; other calls, other devices and modules the kernels do not take: the module's own
    forward (transformers' eager loop, one expert decoded at a time)."""

    def __init__(self, module, forward):
        self.module, self.forward, self._spec = module, forward, False

    def __call__(self, *args, **kwargs):
        if FUSED and len(args) == 3 and not kwargs and args[1].dim() == 2 and fused_runs_on(args[0]):
            if self._spec is False:
                self._spec = fused_experts(self.module, schemes=FUSED_SCHEMES)
            experts = getattr(self.module, self._spec.down.name).num_experts if self._spec is not None else 0
            if self._spec is not None and args[1].numel() <= FUSED_WHOLE_ROWS * experts and \
                    (self._spec.max_tokens is None or args[1].shape[0] <= self._spec.max_tokens):
                hidden, index, weights = args
                return run_fused(self._spec, self.module, self._spec.module_operands(self.module),
                                 hidden.reshape(-1, hidden.shape[-1]), index, weights, experts)
        return self.forward(*args, **kwargs)


def fused_runs_on(x: torch.Tensor) -> bool:
    """Whether the fused kernels can run on ``x``'s device and dtype (Triton on CUDA, or its interpreter)."""
    return kernels.use_triton(x) or kernels.interpreting()


def activate(module, h: torch.Tensor, gated: bool) -> torch.Tensor:
    """The module's own activation of its (gate/)up output ``h``: transformers' ``_apply_gate`` (SiLU-GLU,
    gpt-oss's clamped swiglu), its default gating where it has none, or ``act_fn`` for an ungated expert."""
    if not gated:
        return module.act_fn(h)
    gate = getattr(module, "_apply_gate", None)
    return gate(h) if gate is not None else _default_gate(module, h)


def _default_gate(module, h: torch.Tensor) -> torch.Tensor:
    """transformers' default gating where the module has no ``_apply_gate`` (releases before it existed)."""
    gate, up = h.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def _by_tokens(module, fn, hidden, index, weights, tokens: int) -> torch.Tensor:
    """``fn`` over at most ``tokens`` tokens at a time: an expert's output row depends on its token only."""
    total = hidden.shape[0]
    if total <= tokens:
        return fn(module, hidden, index, weights)
    out = None
    for a in range(0, total, tokens):
        part = fn(module, hidden[a:a + tokens], index[a:a + tokens], weights[a:a + tokens])
        if out is None:
            out = part.new_empty((total, *part.shape[1:]))
        out[a:a + tokens] = part
    return out


def decode_stacked(child: ExpertWeights, start: int, stop: int) -> torch.Tensor:
    """Experts ``start .. stop`` of ``child`` as one stacked dense tensor, decoded in slices whose temporaries
    stay within ``DECODE_TEMP_BYTES`` (``decode_slice``)."""
    n, width = stop - start, torch.empty((), dtype=child.compute_dtype).element_size()
    device = getattr(child, child.suffixes[0]).device.type
    stacks = hasattr(child.one[0], "dequantize_stacked")
    step = decode_slice(child.out_features * child.in_features, n, width, stacks, device)
    if step >= n:
        return child.stacked(start, stop)
    first = child.stacked(start, start + step)
    out = first.new_empty((n, *first.shape[1:]))
    out[:step] = first
    del first
    for a in range(start + step, stop, step):
        out[a - start:min(a + step, stop) - start] = child.stacked(a, min(a + step, stop))
    return out


@contextmanager
def _decoded(module, quantized: dict[str, ExpertWeights], start: int, stop: int, total: int):
    """Experts ``start .. stop`` of the ``total`` packed ones: quantized weights decoded, the dense packed
    tensors (biases: gpt-oss) sliced to them, so that an index counts from ``start``."""
    if not quantized:
        yield
        return
    dense = {name: decode_stacked(child, start, stop) for name, child in quantized.items()}
    sliced = {}
    if stop - start < total:
        tensors = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        sliced = {name: swap_tensor(module, name, t[start:stop]) for name, t in tensors
                  if t.dim() and t.shape[0] == total}
    num = getattr(module, "num_experts", None)
    for name in dense:
        del module._modules[name]
        setattr(module, name, dense[name])  # a plain attribute: the forward reads self.gate_up_proj etc.
    if num is not None:
        module.num_experts = stop - start
    try:
        yield
    finally:
        for name, child in quantized.items():
            delattr(module, name)
            module._modules[name] = child
        for name, t in sliced.items():
            swap_tensor(module, name, t)
        if num is not None:
            module.num_experts = num


def dispatched(module) -> bool:
    """An experts module called with its tokens spread over every expert (Llama 4), which skipping
    unrouted experts leaves exact: no bias, so a zero row stays zero."""
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    return hasattr(module, "gate_up_proj") and not any("bias" in n for n in names)


def run_dispatched(module, forward, hidden: torch.Tensor) -> torch.Tensor:
    """A dispatched experts module (Llama 4: ``hidden`` [E * T, H], every token spread over its E experts)
    whose experts are quantized: decoded as stacked dense tensors ``chunk_experts`` at a time, each chunk's
    rows through the module's own forward (which multiplies stacked tensors: torch.bmm); without quantized
    experts, the forward as is. E is ``num_experts`` (the routed pool sets it to the packed count)."""
    quantized = quantized_children(module)
    if not quantized:
        return forward(hidden)
    num = getattr(module, "num_experts", None) or next(iter(quantized.values())).num_experts
    rows = hidden.reshape(num, -1, hidden.shape[-1])
    chunk = matrices_of(module, num, 1).chunk_experts(hidden.element_size())
    parts = []
    for start in range(0, num, chunk):
        stop = min(start + chunk, num)
        with _decoded(module, quantized, start, stop, num):
            parts.append(forward(rows[start:stop].reshape(-1, hidden.shape[-1])))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def dispatched_rows(hidden: torch.Tensor, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden`` [E * T, H] as [E, T, H], and which experts have a non-zero row ([E] bool, on the device:
    the caller reads it to the host with whatever else it needs, in one copy)."""
    rows = hidden.reshape(num, -1, hidden.shape[-1])
    return rows, rows.ne(0).flatten(1).any(dim=1)
