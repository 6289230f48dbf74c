"""What `airquant shard --quant ...` asks for, and the module metadata the manifest records.

``QuantSpec`` maps one-to-one to the CLI flags. ``module_meta`` (a JSON-able dict with a ``scheme`` key)
is what quantize time hands to the manifest and what ``make_linear`` reads back: the scheme of a
tensor is always read from there, never guessed from a file or tensor name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from airquant.errors import UnsupportedModelError
from airquant.quant.schemes import SUPPORTED_SCHEMES, canonical_name, scheme_of, shard_methods

__all__ = ["QuantSpec", "SUPPORTED_SCHEMES", "check_scheme"]


@dataclass(frozen=True)
class QuantSpec:
    """Quantization requested for the decoder-layer linears of a store."""

    # "gguf" keeps a GGUF file's own blocks; "keep", its former name, is read as "gguf".
    method: Literal["none", "nf4", "int2", "gguf", "keep"] = "none"
    blocksize: int = 64  # nf4: weights per absmax
    double_quant: bool = False  # nf4: 8-bit absmax with a nested fp32 absmax per 256
    group: int = 32  # int2: input weights per (scale, zero)
    outliers: float = 0.035  # int2: fraction of input channels kept in fp16
    calib: str | None = None  # int2: calibration text file for act_scale
    # int2 option: GPTQ-style error feedback onto the Lloyd-Max grid (needs a Hessian per linear).
    error_feedback: bool = False

    def __post_init__(self) -> None:
        if self.method not in shard_methods():
            raise UnsupportedModelError(
                f"quant method {self.method!r} is not supported; choose one of {', '.join(shard_methods())}"
            )
        object.__setattr__(self, "method", canonical_name(self.method))  # frozen: normalise the alias once
        if self.blocksize not in (64, 128, 256, 512, 1024, 2048, 4096):
            raise ValueError(f"nf4 blocksize {self.blocksize} must be a power of two in 64..4096 (bitsandbytes)")
        if self.group <= 0 or self.group % 16:
            raise ValueError(f"int2 group {self.group} must be a positive multiple of 16")
        if not 0.0 <= self.outliers < 1.0:
            raise ValueError(f"int2 outliers fraction {self.outliers} must be in [0, 1)")


def check_scheme(module_meta: dict) -> str:
    """Return the scheme named by ``module_meta``; raise naming the supported ones otherwise."""
    return scheme_of(module_meta).name
