"""The transformers model built on the meta device, with only the small resident parts made real.

Decoder layers stay on meta: a ``StreamedLayer`` wrapper runs each one with the tensors the
streamer hands it (``torch.func.functional_call``), so the module itself never owns weights and
nothing has to be evicted. The model's own forward (masking, rotary, Cache API) is used unchanged,
which is what makes streamed and resident logits agree.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from airquant.config import MLP_CHUNK_TOKENS
from airquant.engine import cuda_ops, embed_head
from airquant.engine.moe import compute as expert_compute
from airquant.engine.moe.pool import RoutedForward, speculation_hook
from airquant.engine.moe_router import fuse_routers
from airquant.engine.norms import fuse_rms_norms
from airquant.engine.rope import fuse_rope
from airquant.errors import StoreError
from airquant.layout import Layout, find_layout, meta_model, swap_tensor
from airquant.quant import make_linear
from airquant.quant.experts import ExpertWeights
from airquant.store import side_files
from airquant.store.integrity import check_file
from airquant.store.manifest import Manifest, ShardEntry, integrity_fix

log = logging.getLogger(__name__)


def load_config(store: Path):
    return side_files.read_config(store)


def build_skeleton(config, dtype: torch.dtype, manifest: Manifest | None = None) -> nn.Module:
    """The model on meta (buffers real), checked against the layout the store was written with."""
    model = meta_model(config, dtype)
    if manifest is not None and manifest.layout:
        stored, found = Layout.from_dict(manifest.layout), find_layout(model)
        if (stored.stack, stored.embed, stored.head) != (found.stack, found.embed, found.head):
            raise StoreError(f"this store was written for module paths {stored}, but transformers now builds "
                             f"{found}; re-run `airquant shard` with this transformers version.")
    chunk_mlp(model, MLP_CHUNK_TOKENS)
    fuse_rms_norms(model)
    fuse_rope(model)
    fuse_routers(model)
    return model


class _ChunkedMLP:
    """An MLP forward run over at most ``chunk`` tokens at a time: the MLP is per token, so this is
    the same computation, but gate/up intermediates exist for one chunk instead of the whole prefill
    (for a 70B model at 8K tokens, 1.4 GB per sequence instead of 0.35 GB per chunk)."""

    def __init__(self, forward, chunk: int):
        self.forward, self.chunk = forward, chunk

    def __call__(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if args or kwargs or flat.shape[0] <= self.chunk:  # an MLP of more inputs (Bloom's residual): whole
            return self.forward(x, *args, **kwargs)
        first = self._part(flat[: self.chunk], x.dim())
        if not isinstance(first, torch.Tensor):  # a block that also returns router logits: left whole
            return self.forward(x)
        out = first.new_empty(flat.shape[0], first.shape[-1])
        out[: self.chunk] = first
        for start in range(self.chunk, flat.shape[0], self.chunk):
            out[start : start + self.chunk] = self._part(flat[start : start + self.chunk], x.dim())
        return out.reshape(*x.shape[:-1], first.shape[-1])

    def _part(self, tokens: torch.Tensor, dims: int):
        """The forward on [n, H] tokens, given as [1, n, H] where the input was [B, S, H]: Mixture-of-Experts
        blocks unpack (batch, sequence, hidden) from their input."""
        out = self.forward(tokens.unsqueeze(0) if dims == 3 else tokens)
        return out.reshape(-1, out.shape[-1]) if isinstance(out, torch.Tensor) else out


def chunk_mlp(model: nn.Module, chunk: int) -> None:
    """Make every decoder layer's ``mlp`` run over ``chunk`` tokens at a time (layers without one: as is)."""
    for layer in decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if mlp is not None:
            mlp.forward = _ChunkedMLP(mlp.forward, chunk)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.get_submodule(find_layout(model).stack)


class DecodedExperts:
    """An experts module called without a routing index (Llama 4: its tokens spread over every expert)
    whose experts are quantized: ``expert_compute.run_dispatched`` decodes them a chunk at a time for its
    stacked matmuls. A call with a routing index runs the module's own forward."""

    def __init__(self, module: nn.Module, forward):
        self.module, self.forward = module, forward

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs:
            return expert_compute.run_dispatched(self.module, self.forward, args[0])
        return self.forward(*args, **kwargs)


def swap_quantized_modules(layer: nn.Module, entry: ShardEntry, compute_dtype: torch.dtype) -> None:
    """Replace the layer's quantized linears (and fused expert weights) by the modules their scheme
    (from the manifest) computes with."""
    if not entry.modules:
        return

    for name, meta in entry.modules.items():
        parent_name, _, child = name.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        with torch.device("meta"):
            if "experts" in meta:
                # Quantized experts are read one expert at a time: transformers' eager experts loop does that,
                # where the fused NF4 kernels (FusedWholeExperts) do not take the call.
                # A module without a config (Llama 4's) multiplies stacked tensors: decoded ones, by chunks.
                config = getattr(parent, "config", None)
                if config is not None:
                    config._experts_implementation = "eager"
                    if not isinstance(parent.forward, expert_compute.FusedWholeExperts):
                        parent.forward = expert_compute.FusedWholeExperts(parent, parent.forward)
                elif not isinstance(parent.forward, DecodedExperts):
                    parent.forward = DecodedExperts(parent, parent.forward)
                new = ExpertWeights(meta, compute_dtype=compute_dtype)
                del parent._parameters[child]
            else:
                old = getattr(parent, child)
                new = make_linear(meta, old.in_features, old.out_features, old.bias is not None,
                                  compute_dtype=compute_dtype)
        setattr(parent, child, new)


def _page_locked(table: torch.Tensor) -> tuple[torch.Tensor, cuda_ops.HostMemory | None]:
    """``table`` copied into host memory page-locked at its exact size (``cudaHostRegister``; torch's
    ``pin_memory`` rounds up to a power of two: a 2.1 GB table would lock 4 GB), and its owner; where the host
    refuses to lock it, ``table`` as it is (ids are then read to the host)."""
    memory = cuda_ops.HostMemory(pinned=True)
    flat = memory.empty(table.numel() * table.element_size(), pinned=False)
    locked = flat.view(table.dtype).view(table.shape)
    locked.copy_(table)
    if not memory.register(flat):
        log.info("the host embedding table stays pageable: the host did not lock %d bytes", flat.numel())
        return table, None
    return locked, memory


def load_fixed_parts(model: nn.Module, store: Path, manifest: Manifest, device: torch.device,
                     dtype: torch.dtype, *, host_embedding: bool = False, verify_reads: bool = True) -> None:
    """Embeddings, lm_head (tied, dense or quantized), the rest (final norm ...) and buffers, made real.

    ``host_embedding`` keeps an untied embedding table in host memory (``embed_head.HostEmbedding``); a tied
    table is the lm_head weight too and stays on ``device``.
    """
    layout = Layout.from_dict(manifest.layout)
    on_host = host_embedding and not manifest.tied_lm_head
    for group in ("embed", "norm", "lm_head"):
        if group not in manifest.shards:
            continue
        entry = manifest.shards[group]
        target = torch.device("cpu") if group == "embed" and on_host else device
        if verify_reads:  # checked once, at load (store/integrity.py)
            check_file(store / entry.file, entry.checksum, integrity_fix(store, manifest))
        tensors = _cast_dense(entry, load_file(store / entry.file, device=str(target)), dtype)
        if group == "embed" and on_host:
            embed = model.get_submodule(layout.embed)
            table, memory = tensors["weight"], None
            if device.type == "cuda":  # page-locked: ids on the GPU read their rows there (HostEmbedding)
                table, memory = _page_locked(table)
            host = embed_head.HostEmbedding(embed, table, device, dtype)
            host.host_memory = memory  # keeps the table registered while the module lives
            _set_module(model, layout.embed, host)
        elif group == "lm_head" and entry.modules:
            head = embed_head.quantized_head(entry, tensors, model.config.hidden_size, dtype)
            _set_module(model, layout.head, head)
        else:
            for name, tensor in tensors.items():
                path = layout.full_name(group, name)
                if swap_tensor(model, path, tensor) is None:
                    raise StoreError(f"the store holds {path}, which this model does not have; the store belongs to "
                                     "another model or transformers version. Re-run `airquant shard`.")
    if manifest.tied_lm_head:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    for module in model.modules():  # buffers computed at build time (rotary frequencies, scales)
        for name, buf in module._buffers.items():
            if buf is not None and not buf.is_meta:
                module._buffers[name] = buf.to(device)
    stack = find_layout(model).stack + "."
    leftovers = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
                 if t.is_meta and not n.startswith(stack)]
    if leftovers:
        raise StoreError(f"store {store} left these tensors unset: {leftovers[:5]}; the store is incomplete.")


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def _cast_dense(entry: ShardEntry, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Cast the dense floating tensors to the compute dtype; quantized payloads stay as stored."""
    dense = {k for k, m in entry.tensors.items() if m.get("scheme", "dense") == "dense"}
    return {k: (v.to(dtype) if k in dense and v.is_floating_point() else v) for k, v in tensors.items()}


class StreamedLayer(nn.Module):
    """Runs a meta decoder layer with weights fetched for this call only.

    The fetched tensors go into the layer's own parameter and buffer tables for the call and the meta ones come
    back after it: the tables are found once per set of names (``_tables``). That is what ``torch.func.
    functional_call`` does, less its per-call walk of every submodule and tie analysis: swapping a Qwen3-MoE NF4
    layer's 17 tensors in and out took 169 us that way and 11 us this way (this repo's CI CPU; 56 and 4 us for a
    Llama layer's 9). A layer with tied tensors, or a name that is neither a parameter nor a buffer, still goes
    through ``functional_call``."""

    def __init__(self, layer: nn.Module, index: int, streamer):
        super().__init__()
        self.layer = layer
        self.index = index
        self.streamer = streamer
        self._names: tuple[str, ...] | None = None  # the names _slots was resolved for
        self._slots: list[tuple[dict, str]] | None = None  # per name: (its module's table, its key); None: fallback
        self.graphs = None  # engine/layer_graphs.LayerGraphs: decode calls replayed from CUDA graphs

    def __getattr__(self, name: str):
        # Decoder stacks read attributes of their blocks (attention_type, layer_type, is_sliding ...)
        # to pick masks and caches: answer them from the wrapped block.
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["layer"], name)

    def forward(self, *args, **kwargs):
        tensors = self.streamer.fetch(self.index)
        try:
            slots = self._tables(tensors)
            if slots is None:
                return torch.func.functional_call(self.layer, tensors, args, kwargs, strict=False)
            if self.graphs is not None:  # a replayed call reads the weights where it was captured: no swap
                return self.graphs.run(self.index, self.layer, tensors,
                                       lambda *a, **k: self._call(slots, tensors, a, k), args, kwargs,
                                       self.streamer.fixed(self.index))
            return self._call(slots, tensors, args, kwargs)
        finally:
            self.streamer.release(self.index)

    def _call(self, slots: list[tuple[dict, str]], tensors: dict, args: tuple, kwargs: dict):
        """The layer with ``tensors`` in its tables for the call, the meta ones back after it."""
        old = [table[key] for table, key in slots]
        for (table, key), t in zip(slots, tensors.values()):
            table[key] = t
        try:
            return self.layer(*args, **kwargs)
        finally:
            for (table, key), t in zip(slots, old):
                table[key] = t

    def _tables(self, tensors: dict) -> list[tuple[dict, str]] | None:
        """Where each of ``tensors``' names lives (its module's ``_parameters`` or ``_buffers``), in their order;
        None where ``functional_call`` must run instead (tied tensors, or a name of neither table)."""
        names = tuple(tensors)
        if names == self._names:
            return self._slots
        self._names, self._slots = names, None
        seen: dict[int, str] = {}
        named = [*self.layer.named_parameters(remove_duplicate=False), *self.layer.named_buffers(remove_duplicate=False)]
        for name, t in named:
            if seen.setdefault(id(t), name) != name:  # tied: setting one name must set both (functional_call's rule)
                return None
        slots = []
        for name in names:
            path, _, key = name.rpartition(".")
            try:
                module = self.layer.get_submodule(path)
            except AttributeError:
                return None
            table = module._parameters if key in module._parameters else \
                module._buffers if key in module._buffers else None
            if table is None:
                return None
            slots.append((table, key))
        self._slots = slots
        return slots


def attach_streamer(model: nn.Module, streamer) -> None:
    layers = decoder_layers(model)
    for i in range(len(layers)):
        layers[i] = StreamedLayer(layers[i], i, streamer)


def attach_graphs(model: nn.Module, graphs) -> None:
    """Streamed layers' decode calls go through ``graphs`` (engine/layer_graphs.LayerGraphs; None: off)."""
    for layer in decoder_layers(model):
        if isinstance(layer, StreamedLayer):
            layer.graphs = graphs


def load_layers_resident(model: nn.Module, store: Path, manifest: Manifest, device: torch.device,
                         dtype: torch.dtype, *, verify_reads: bool = True) -> None:
    """Fill every decoder layer with its weights on ``device`` (the resident reference mode)."""
    for i, layer in enumerate(decoder_layers(model)):
        entry = manifest.shards[f"layer.{i}"]
        if verify_reads:  # checked once, at load (store/integrity.py)
            check_file(store / entry.file, entry.checksum, integrity_fix(store, manifest))
        tensors = _cast_dense(entry, load_file(store / entry.file, device=str(device)), dtype)
        layer.load_state_dict(tensors, assign=True, strict=True)


def attach_experts(model: nn.Module, pool) -> None:
    """Route-then-fetch for the pool's MoE layers: each one's experts module runs through the pool
    (``engine.moe.pool.RoutedForward``), which moves only the experts the batch routes to."""
    layers = decoder_layers(model)
    for i, layer in pool.layers.items():
        block = layers[i].layer if isinstance(layers[i], StreamedLayer) else layers[i]
        module = block.get_submodule(layer.module)
        module.forward = RoutedForward(pool, i, module, module.forward)
        speculation_hook(pool, i, block)  # sizing.spec_guesses: layer i's experts guessed before its attention
