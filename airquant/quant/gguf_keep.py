"""GGUF weights kept in their llama.cpp block form (`--quant gguf`, formerly "keep") and computed from it.

A kept linear stores one tensor, ``weight_blocks`` uint8 [out, (in / block) * type_size]: row n is the
row of GGUF blocks of output feature n exactly as in the file (GGUF blocks run along the input
dimension). ``module_meta`` records the ggml type by name. Fused MoE experts keep one such tensor per
expert, stacked [E, out, row_bytes] as ``airquant.quant.experts`` stores them; a parameter transformers
concatenates from several GGUF tensors along its output rows (``gate_up_proj`` from ``ffn_gate_exps``
and ``ffn_up_exps``) is the concatenation of their packed rows, since whole rows are whole blocks.
The dequantization below follows the block layouts of ggml-quants.c and reproduces
``gguf.quants.dequantize`` bit for bit (same fp32 operations in the same order), which the tests check.

llama.cpp's converter permutes the rows of the Q and K projections of llama models (per head, the
two rotary halves are interleaved). Since that is a permutation of whole output rows, the store can
undo it on the packed rows with ``llama_qk_row_permutation`` without dequantizing.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from airquant.errors import UnsupportedModelError
from airquant.quant.base import QuantLinear
from airquant.quant.kernels import gguf_matmul, use_triton

# ggml type name -> (ggml type id, weights per block, bytes per block), from ggml.h / GGML_QUANT_SIZES.
GGUF_TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 32, 18),
    "Q4_1": (3, 32, 20),
    "Q8_0": (8, 32, 34),
    "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210),
}
TRITON_GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # the rest run through the torch path, on device
# llama.cpp tensor names of a decoder block -> transformers module names relative to the layer.
GGUF_LLAMA_LINEARS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def keepable_type(ggml_type: int) -> str | None:
    """The name of a ggml type id whose blocks can be kept, None for the others (F32, F16, IQ*, ...)."""
    return next((name for name, (type_id, _, _) in GGUF_TYPES.items() if type_id == int(ggml_type)), None)


def ggml_type_name(ggml_type) -> str:
    """Normalise a ggml type given as name, id or ``gguf.GGMLQuantizationType`` to its name."""
    if isinstance(ggml_type, str):
        name = ggml_type.upper()
    else:
        name = getattr(ggml_type, "name", None) or {v[0]: k for k, v in GGUF_TYPES.items()}.get(int(ggml_type), "")
    if name not in GGUF_TYPES:
        raise UnsupportedModelError(
            f"GGUF type {ggml_type!r} cannot be kept packed; supported: {', '.join(GGUF_TYPES)}. "
            "Shard this model without --quant gguf to dequantize it instead"
        )
    return name


def llama_qk_row_permutation(n_rows: int, n_head: int) -> torch.Tensor:
    """int64 [n_rows] such that ``hf_rows = gguf_rows[perm]`` for llama's q_proj (n_head = heads) and
    k_proj (n_head = kv heads); the inverse of llama.cpp's convert permute, as transformers applies it."""
    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(-1)


def gguf_linear_tensors(
    raw_bytes: np.ndarray, ggml_type, shape: tuple[int, int], *, row_perm: torch.Tensor | None = None
) -> tuple[dict[str, torch.Tensor], dict]:
    """Wrap a GGUF tensor's raw block bytes as a kept linear.

    ``shape`` is the torch shape (out_features, in_features), i.e. the GGUF ``ne`` reversed;
    ``raw_bytes`` is the tensor's uint8 data (``GGUFReader`` gives it as [out, bytes_per_row]).
    """
    name = ggml_type_name(ggml_type)
    _, block, type_size = GGUF_TYPES[name]
    out_f, in_f = shape
    if in_f % block:
        raise UnsupportedModelError(f"GGUF {name} tensor of shape {shape}: in_features not a multiple of {block}")
    raw = np.ascontiguousarray(raw_bytes, dtype=np.uint8).reshape(out_f, in_f // block * type_size)
    blocks = torch.from_numpy(raw.copy())
    if row_perm is not None:
        blocks = blocks[row_perm].contiguous()
    return {"weight_blocks": blocks}, {"scheme": "gguf", "ggml_type": name}


def gguf_expert_tensors(
    parts: list[tuple[np.ndarray, tuple[int, int, int]]], ggml_type
) -> tuple[dict[str, torch.Tensor], dict]:
    """Keep a fused [E, out, in] expert parameter's GGUF blocks, in ``quantize_experts``' layout.

    ``parts`` are (raw bytes, [E, out_i, in] shape) of the GGUF tensors that make the parameter, in the
    order transformers concatenates them along ``out`` (one part for ``down_proj``; gate then up for
    ``gate_up_proj``), all of type ``ggml_type``. Expert e's rows are then one ``GGUFLinear``'s
    ``weight_blocks`` and dequantize to transformers' ``param[e]``.
    """
    num, _, in_f = parts[0][1]
    if any((shape[0], shape[2]) != (num, in_f) for _, shape in parts):
        raise UnsupportedModelError(f"GGUF expert tensors of shapes {[s for _, s in parts]} cannot be "
                                    "concatenated into one [E, out, in] parameter")
    stacked = []
    for raw, (_, out_i, _) in parts:
        tensors, meta = gguf_linear_tensors(raw, ggml_type, (num * out_i, in_f))
        stacked.append(tensors["weight_blocks"].reshape(num, out_i, -1))  # [E, out_i, row_bytes]
    blocks = torch.cat(stacked, dim=1) if len(stacked) > 1 else stacked[0]
    out_f = int(blocks.shape[1])
    return {"weight_blocks": blocks.contiguous()}, {**meta, "experts": int(num), "shape": [out_f, int(in_f)],
                                                     "transposed": False}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 stored in the last dim (2 bytes) -> fp32 with that dim dropped."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n]: all low nibbles first, then all high nibbles (ggml's 4-bit order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte 6-bit (scale, min) pairs of Q4_K/Q5_K into two [..., 8] float tensors."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _dequant_blocks(name: str, b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., type_size] blocks -> fp32 [..., block] weights."""
    if name == "Q4_0":
        return _f16(b[..., 0:2])[..., None] * (_nibbles(b[..., 2:]).to(torch.int8) - 8).float()
    if name == "Q4_1":
        return _f16(b[..., 0:2])[..., None] * _nibbles(b[..., 4:]).float() + _f16(b[..., 2:4])[..., None]
    if name == "Q8_0":
        return b[..., 2:].contiguous().view(torch.int8).float() * _f16(b[..., 0:2])[..., None]
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        sc, mn = _k_scale_min(b[..., 4:16])
        qs = b[..., 16:] if name == "Q4_K" else b[..., 48:]
        q = _nibbles(qs.reshape(*qs.shape[:-1], 4, 32)).reshape(*qs.shape[:-1], 8, 32)
        if name == "Q5_K":
            qh = b[..., 16:48]  # bit j of byte t is the 5th bit of weight 32*j + t
            high = (qh[..., None, :] >> torch.arange(8, dtype=torch.uint8, device=b.device)[:, None]) & 1
            q = q | (high << 4)
        out = (d * sc)[..., None] * q.float() - (dmin * mn)[..., None]
        return out.reshape(*b.shape[:-1], 256)
    if name == "Q6_K":
        ql, qh, scales, d = b[..., 0:128], b[..., 128:192], b[..., 192:208], _f16(b[..., 208:210])
        low = _nibbles(ql.reshape(*ql.shape[:-1], 2, 64)).reshape(*ql.shape[:-1], 8, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)[:, None]
        high = ((qh.reshape(*qh.shape[:-1], 2, 1, 32) >> shifts) & 3).reshape(*qh.shape[:-1], 8, 32)
        q = ((low | (high << 4)).to(torch.int8) - 32).reshape(*ql.shape[:-1], 16, 16).float()
        dl = d[..., None] * scales.contiguous().view(torch.int8).float()
        return (dl[..., None] * q).reshape(*b.shape[:-1], 256)
    raise UnsupportedModelError(f"GGUF type {name} has no dequantizer; supported: {', '.join(GGUF_TYPES)}")


def dequantize_gguf(weight_blocks: torch.Tensor, ggml_type, in_features: int) -> torch.Tensor:
    """fp32 [out, in] from kept block bytes (torch ops only, runs on the tensor's device)."""
    name = ggml_type_name(ggml_type)
    _, block, type_size = GGUF_TYPES[name]
    blocks = weight_blocks.reshape(weight_blocks.shape[0], in_features // block, type_size)
    return _dequant_blocks(name, blocks).reshape(weight_blocks.shape[0], in_features)


class GGUFLinear(QuantLinear):
    """y = x @ W.T + b with W kept as llama.cpp blocks."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, *, ggml_type: str, compute_dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.ggml_type = ggml_type_name(ggml_type)
        _, block, type_size = GGUF_TYPES[self.ggml_type]
        if in_features % block:
            raise UnsupportedModelError(f"GGUF {self.ggml_type}: in_features {in_features} not a multiple of {block}")
        self.in_features, self.out_features, self.compute_dtype = in_features, out_features, compute_dtype
        row_bytes = in_features // block * type_size
        self.register_buffer("weight_blocks", torch.empty((out_features, row_bytes), dtype=torch.uint8))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=compute_dtype), requires_grad=False) if bias else None

    def dequantize(self) -> torch.Tensor:
        return dequantize_gguf(self.weight_blocks, self.ggml_type, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        xc = x.to(self.compute_dtype)
        if self.ggml_type in TRITON_GGUF_TYPES and use_triton(x):
            y = gguf_matmul(xc, self.weight_blocks, self.ggml_type)
            y = y if bias is None else y + bias
        else:
            y = F.linear(xc, self.dequantize().to(self.compute_dtype), bias)
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, gguf {self.ggml_type}"


def gguf_layer_linears(reader, layer: int, n_head: int, n_kv_head: int) -> dict[str, tuple[dict, dict]]:
    """Kept-packed tensors of one llama decoder layer from a ``gguf.GGUFReader``, keyed by HF module name.

    Q/K rows are un-permuted (see module docstring); tensors of unsupported types are left out so
    the caller can dequantize them instead.
    """
    out = {}
    prefix = f"blk.{layer}."
    for t in reader.tensors:
        if not t.name.startswith(prefix) or not t.name.endswith(".weight"):
            continue
        gguf_name = t.name[len(prefix) : -len(".weight")]
        if gguf_name not in GGUF_LLAMA_LINEARS or t.tensor_type.name not in GGUF_TYPES:
            continue
        shape = (int(t.shape[1]), int(t.shape[0]))  # GGUF ne is (in, out)
        perm = None
        if gguf_name in ("attn_q", "attn_k"):
            perm = llama_qk_row_permutation(shape[0], n_head if gguf_name == "attn_q" else n_kv_head)
        out[GGUF_LLAMA_LINEARS[gguf_name]] = gguf_linear_tensors(t.data, t.tensor_type, shape, row_perm=perm)
    return out
