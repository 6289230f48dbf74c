"""lm_head stored quantized in row chunks.

A multi-token matmul against a quantized weight dequantizes the whole weight first (bitsandbytes does
so above one token). For a 128K-vocabulary head that is a 2 GB temporary; cutting the head into row
chunks, each its own quantized linear, bounds it to one chunk. The chunks are the shard's modules
``chunks.K`` whose meta records the rows ``[start, end)`` they cover.
"""

from __future__ import annotations

import torch

from airquant.quant import quantize_linear

# 16384 rows x 8192 columns of bf16 = 268 MB: the largest temporary a quantized head then needs.
HEAD_CHUNK_ROWS = 16384


def head_chunk_rows(vocab: int, chunk_rows: int = HEAD_CHUNK_ROWS) -> list[tuple[int, int]]:
    return [(start, min(start + chunk_rows, vocab)) for start in range(0, vocab, chunk_rows)]


def quantize_head(weight: torch.Tensor, spec, chunk_rows: int = HEAD_CHUNK_ROWS) -> tuple[dict, dict]:
    """(tensors, modules) of an [V, H] head quantized per row chunk with ``airquant.quant.quantize_linear``."""
    tensors: dict[str, torch.Tensor] = {}
    modules: dict[str, dict] = {}
    for k, (start, end) in enumerate(head_chunk_rows(weight.shape[0], chunk_rows)):
        part, meta = quantize_linear(spec, weight[start:end].contiguous())
        name = f"chunks.{k}"
        tensors.update({f"{name}.{suffix}": t.contiguous() for suffix, t in part.items()})
        modules[name] = {**meta, "rows": [start, end], "tensors": sorted(part)}
    return tensors, modules


def ordered_chunks(modules: dict[str, dict]) -> list[tuple[str, dict]]:
    """The head's chunk modules in row order (validated to cover the rows without gaps)."""
    chunks = sorted(modules.items(), key=lambda kv: kv[1]["rows"][0])
    edge = 0
    for k, (name, meta) in enumerate(chunks):
        start, end = meta["rows"]
        assert name == f"chunks.{k}" and start == edge and end > start, \
            f"lm_head chunk {name} covers rows {start}-{end}; expected chunks.{k} from row {edge}"
        edge = end
    return chunks
