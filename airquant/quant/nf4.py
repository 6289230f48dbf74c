"""NF4 through bitsandbytes: quantize once at shard time, keep the packed bytes, rebuild the QuantState per call.

The module holds every piece of bitsandbytes' ``QuantState`` as a registered buffer so that
``torch.func.functional_call`` can hand it the shard's tensors; ``forward`` rebuilds the
``QuantState`` from those buffers (cheap: no tensor work) and calls ``bitsandbytes.matmul_4bit``,
which runs on CPU (bnb >= 0.46) and CUDA. The bytes are never dequantized on the host.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from airquant.errors import DependencyError
from airquant.quant.base import QuantLinear

# bitsandbytes quantizes the fp32 absmax of double quant in blocks of 256 (quantize_blockwise default);
# its CPU and CUDA gemm kernels only accept that nested blocksize.
NESTED_BLOCKSIZE = 256


def _bnb():
    try:
        import bitsandbytes
        import bitsandbytes.functional
    except ImportError as exc:
        raise DependencyError(
            "NF4 needs bitsandbytes: pip install 'bitsandbytes>=0.46' (CPU and CUDA wheels both work)"
        ) from exc
    return bitsandbytes


def quantize_nf4(weight: torch.Tensor, blocksize: int, double_quant: bool) -> tuple[dict[str, torch.Tensor], dict]:
    """Quantize an [out, in] weight with ``bitsandbytes.functional.quantize_4bit`` (nf4)."""
    bnb = _bnb()
    packed, state = bnb.functional.quantize_4bit(
        weight.contiguous(), blocksize=blocksize, compress_statistics=double_quant, quant_type="nf4"
    )
    tensors = {"weight_packed": packed, "absmax": state.absmax, "quant_map": state.code}
    if double_quant:
        tensors["nested_absmax"] = state.state2.absmax
        tensors["nested_quant_map"] = state.state2.code
        tensors["nested_offset"] = state.offset.reshape(())
    meta = {"scheme": "nf4", "blocksize": blocksize, "double_quant": double_quant}
    return {k: v.contiguous() for k, v in tensors.items()}, meta


class NF4Linear(QuantLinear):
    """y = x @ W.T + b with W stored as bitsandbytes NF4 (packed uint8 + absmax [+ nested absmax])."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        *,
        blocksize: int,
        double_quant: bool,
        compute_dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.blocksize, self.double_quant, self.compute_dtype = blocksize, double_quant, compute_dtype
        numel = in_features * out_features
        n_absmax = math.ceil(numel / blocksize)
        self.register_buffer("weight_packed", torch.empty(((numel + 1) // 2, 1), dtype=torch.uint8))
        self.register_buffer("quant_map", torch.empty(16, dtype=torch.float32))
        if double_quant:
            self.register_buffer("absmax", torch.empty(n_absmax, dtype=torch.uint8))
            n_nested = math.ceil(n_absmax / NESTED_BLOCKSIZE)
            self.register_buffer("nested_absmax", torch.empty(n_nested, dtype=torch.float32))
            self.register_buffer("nested_quant_map", torch.empty(256, dtype=torch.float32))
            self.register_buffer("nested_offset", torch.empty((), dtype=torch.float32))
        else:
            self.register_buffer("absmax", torch.empty(n_absmax, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=compute_dtype), requires_grad=False) if bias else None

    def quant_state(self):
        """The bitsandbytes QuantState these buffers describe."""
        functional = _bnb().functional
        state2, offset = None, None
        if self.double_quant:
            state2 = functional.QuantState(
                absmax=self.nested_absmax,
                code=self.nested_quant_map,
                blocksize=NESTED_BLOCKSIZE,
                dtype=torch.float32,
            )
            offset = self.nested_offset
        return functional.QuantState(
            absmax=self.absmax,
            shape=torch.Size((self.out_features, self.in_features)),
            code=self.quant_map,
            blocksize=self.blocksize,
            quant_type="nf4",
            dtype=self.compute_dtype,
            offset=offset,
            state2=state2,
        )

    def multiplies_packed(self) -> bool:
        """Whether ``forward`` runs bitsandbytes' ``matmul_4bit`` on the packed bytes on every device: no NF4 block
        straddles two rows (``in_features % blocksize == 0``). Else the CPU path decodes the weight first and
        bitsandbytes' CUDA kernel falls back to a dequantize (with a warning). Routed experts with few rows are
        multiplied this way instead of decoded (engine/moe/compute.py: ``run_gemv``)."""
        return self.in_features % self.blocksize == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bnb = _bnb()
        bias = None if self.bias is None else self.bias.to(self.compute_dtype)
        xc = x.to(self.compute_dtype)
        if x.device.type == "cpu" and self.in_features % self.blocksize:
            # bitsandbytes 0.50.2's native CPU nf4 kernels index absmax per row and return wrong values
            # when a block straddles two rows (in_features % blocksize != 0); CUDA is unaffected.
            out = torch.nn.functional.linear(xc, self.dequantize(), bias)
        else:
            out = bnb.matmul_4bit(xc, self.weight_packed, self.quant_state(), bias=bias)
        return out.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        """[out, in] weight in compute_dtype: bitsandbytes' kernel on CUDA, torch ops from the buffers elsewhere
        (bitsandbytes' CPU decode shares the straddling-block fault of its CPU matmul)."""
        state = self.quant_state()
        if self.weight_packed.is_cuda:
            return _bnb().functional.dequantize_4bit(self.weight_packed, state).reshape(
                self.out_features, self.in_features)
        absmax = state.absmax
        if self.double_quant:
            absmax = _bnb().functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
        packed = self.weight_packed.reshape(-1)
        nibbles = torch.stack([packed >> 4, packed & 0x0F], dim=1).reshape(-1)  # first weight in the high nibble
        numel = self.in_features * self.out_features
        values = self.quant_map[nibbles[:numel].long()] * absmax.float().repeat_interleave(self.blocksize)[:numel]
        return values.reshape(self.out_features, self.in_features).to(self.compute_dtype)

    def dequantize_stacked(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[E, out, in] ``dtype`` weights of E matrices of this shape whose buffers are stacked on a leading dim
        (quantized experts): one pass of batched ops instead of E decodes. The nested absmax is decoded in
        torch (each expert has its own nested state); on CUDA one bitsandbytes decode then covers every
        expert when no NF4 block straddles two of them, written in ``dtype`` directly (no fp32 copy of the
        experts beside it: engine/moe/compute.py plans the decode's device memory on that)."""
        packed = tensors["weight_packed"]
        num, numel = packed.shape[0], self.in_features * self.out_features
        if packed.is_cuda and numel % self.blocksize == 0:
            absmax = nf4_stacked_absmax(tensors, self.double_quant, torch.float32)
            functional = _bnb().functional
            state = functional.QuantState(absmax=absmax.reshape(-1), shape=torch.Size((num * numel,)),
                                          code=tensors["quant_map"][0].float(), blocksize=self.blocksize,
                                          quant_type="nf4", dtype=dtype)
            return functional.dequantize_4bit(packed.reshape(-1), state).reshape(num, self.out_features,
                                                                                  self.in_features)
        return decode_nf4_stacked(tensors, self.out_features, self.in_features, self.blocksize, self.double_quant,
                              torch.float32).to(dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, nf4 blocksize={self.blocksize}, "
            f"double_quant={self.double_quant}, bias={self.bias is not None}"
        )



def nf4_stacked_absmax(tensors: dict[str, torch.Tensor], double: bool, dtype: torch.dtype) -> torch.Tensor:
    """[E, blocks] absmax of E stacked NF4 matrices in ``dtype``: double quant's codes decoded through each
    matrix's own nested code book, nested absmax and offset."""
    absmax = tensors["absmax"]
    if double:
        num = absmax.shape[0]
        nested = tensors["nested_absmax"].to(dtype).repeat_interleave(NESTED_BLOCKSIZE, dim=1)
        absmax = (torch.gather(tensors["nested_quant_map"].to(dtype), 1, absmax.long())
                  * nested[:, : absmax.shape[1]] + tensors["nested_offset"].to(dtype).reshape(num, 1))
    return absmax.to(dtype)


def decode_nf4_stacked(tensors: dict[str, torch.Tensor], out_features: int, in_features: int, blocksize: int,
                   double: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[E, out, in] of E stacked NF4 matrices (bitsandbytes' layout: the first weight in a byte's high nibble;
    blocks may straddle rows), computed in ``dtype`` by torch ops: the CPU decode of ``dequantize_stacked``,
    and the host kernel's reference and fallback (quant/kernels/nf4_cpu) in fp32 or float64."""
    flat = tensors["weight_packed"].reshape(tensors["weight_packed"].shape[0], -1)
    num, numel = flat.shape[0], out_features * in_features
    nibbles = torch.stack([flat >> 4, flat & 0x0F], dim=2).reshape(num, -1)[:, :numel].long()
    values = torch.gather(tensors["quant_map"].to(dtype), 1, nibbles)
    values *= nf4_stacked_absmax(tensors, double, dtype).repeat_interleave(blocksize, dim=1)[:, :numel]
    return values.reshape(num, out_features, in_features)
