"""The parts that are not streamed: the embedding table (on the device or in host RAM) and lm_head.

A 70B model's bf16 embedding and lm_head take 2.1 GB each, more than half a 4 GB card together.
``HostEmbedding`` keeps the table in host memory and moves only the gathered [B, S, H] rows;
``ChunkedHead`` runs an lm_head stored quantized in row chunks (see ``airquant.store.head``).
"""

from __future__ import annotations

import torch
from torch import nn

from airquant.quant import make_linear
from airquant.store.head import ordered_chunks
from airquant.store.manifest import ShardEntry


class HostEmbedding(nn.Module):
    """Embedding rows gathered on the host from a table that never goes to the device.

    The model's own embedding module runs on the host with the table (so scaled embeddings such as
    Gemma's keep their scale); only the gathered [B, S, H] rows move.
    """

    def __init__(self, embedding: nn.Module, table: torch.Tensor, device: torch.device, dtype: torch.dtype):
        super().__init__()
        # Plain attributes, not submodules, parameters or buffers: model.to() and state_dict() leave them alone.
        self.table, self.embedding = table, [embedding]
        self.host_buffers = {k: v.to(table.device) for k, v in embedding.named_buffers() if not v.is_meta}
        self.num_embeddings, self.embedding_dim = table.shape
        # transformers reads model.device and model.dtype from the first parameter, which is this one.
        self.anchor = nn.Parameter(torch.empty(0, device=device, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.to(self.table.device)
        rows = torch.func.functional_call(self.embedding[0], {"weight": self.table, **self.host_buffers}, (ids,))
        return rows.to(device=self.anchor.device, dtype=self.anchor.dtype)  # [B, S, H]

    @property
    def weight(self) -> torch.Tensor:
        return self.table

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, table on {self.table.device}"


class ChunkedHead(nn.Module):
    """lm_head as row chunks, each a quantized linear; logits are their concatenation."""

    def __init__(self, chunks: list[nn.Module], hidden: int, dtype: torch.dtype):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.vocab, self.hidden, self.dtype = sum(c.out_features for c in chunks), hidden, dtype

    @property
    def weight(self) -> torch.Tensor:
        """The head's shape and compute dtype, without values (a meta tensor ``[V, H]``): HY-V4's forward casts
        its hidden states to ``lm_head.weight.dtype``; code reading values from it fails loudly."""
        return torch.empty(self.vocab, self.hidden, dtype=self.dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, H] -> [B, S, V]
        return torch.cat([chunk(x) for chunk in self.chunks], dim=-1)


def quantized_head(entry: ShardEntry, tensors: dict[str, torch.Tensor], hidden: int,
                   dtype: torch.dtype) -> ChunkedHead:
    """Build the head from its shard's modules (meta from the manifest) and load the tensors as they are."""
    modules = []
    for _, meta in ordered_chunks(entry.modules):
        start, end = meta["rows"]
        with torch.device("meta"):
            modules.append(make_linear(meta, hidden, end - start, False, compute_dtype=dtype))
    head = ChunkedHead(modules, hidden, dtype)
    head.load_state_dict(tensors, assign=True, strict=True)
    return head
