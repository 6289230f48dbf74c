"""The parts that are not streamed: the embedding table (on the device or in host RAM) and lm_head.

A 70B model's bf16 embedding and lm_head take 2.1 GB each, more than half a 4 GB card together.
``HostEmbedding`` keeps the table in host memory and moves only the gathered [B, S, H] rows;
``ChunkedHead`` runs an lm_head stored quantized in row chunks (see ``airquant.store.head``).
"""

from __future__ import annotations

import torch
from torch import nn

from airquant.kv.rotation import to_device
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
        self._device_reads: bool | None = None  # ids on the GPU read their rows there (``_reads_on_device``)
        self.host_memory = None  # the owner of a table page-locked in place (engine/cuda_ops.HostMemory), if any

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.is_cuda and self._reads_on_device(input_ids.device):
            return self._gather_on_device(input_ids)
        ids = input_ids.to(self.table.device)  # ids on a GPU: a host read (the host waits for the device)
        rows = torch.func.functional_call(self.embedding[0], {"weight": self.table, **self.host_buffers}, (ids,))
        return to_device(rows, self.anchor.device).to(self.anchor.dtype)  # [B, S, H]

    def _reads_on_device(self, device: torch.device) -> bool:
        """Whether ids already on the GPU (a decode pass queued ahead: its tokens are the device's argmax) take
        their rows by a kernel reading the pinned table (unified virtual addressing), with no host read: a
        plain ``nn.Embedding`` (no scale, no max_norm) over a pinned contiguous table the GPU reads exactly
        (probed once, engine/moe/uva_copy)."""
        if self._device_reads is None:
            from airquant.engine.moe import uva_copy

            embedding = self.embedding[0]
            plain = type(embedding) is nn.Embedding and embedding.max_norm is None
            locked = self.host_memory is not None or self.table.is_pinned()
            self._device_reads = plain and locked and self.table.is_contiguous() and \
                uva_copy.probe(self.table.view(-1).view(torch.uint8), device)
        return self._device_reads

    def _gather_on_device(self, input_ids: torch.Tensor) -> torch.Tensor:
        from airquant.engine.moe import uva_copy

        # a token past the table (a head with more rows than the embedding) would read past it: the last row
        ids = input_ids.reshape(-1).long().clamp(0, self.num_embeddings - 1)
        row = self.embedding_dim * self.table.element_size()
        out = torch.empty((ids.numel(), row), dtype=torch.uint8, device=input_ids.device)
        places = torch.arange(ids.numel(), device=ids.device) * row
        slices = torch.stack((ids * row, places, torch.full_like(places, row)), dim=1)
        uva_copy.gather(self.table.view(-1).view(torch.uint8), out, slices, row)
        rows = out.view(self.table.dtype).view(*input_ids.shape, self.embedding_dim)
        return rows.to(self.anchor.dtype)

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
