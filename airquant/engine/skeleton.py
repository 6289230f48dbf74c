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

from airquant.errors import StoreError
from airquant.store.manifest import Manifest, ShardEntry

log = logging.getLogger(__name__)


def load_config(store: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(store)


def build_skeleton(config, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    from airquant.engine.plan import MLP_CHUNK_TOKENS

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    chunk_mlp(model, MLP_CHUNK_TOKENS)
    return model


class _ChunkedMLP:
    """An MLP forward run over at most ``chunk`` tokens at a time: the MLP is per token, so this is
    the same computation, but gate/up intermediates exist for one chunk instead of the whole prefill
    (for a 70B model at 8K tokens, 1.4 GB per sequence instead of 0.35 GB per chunk)."""

    def __init__(self, forward, chunk: int):
        self.forward, self.chunk = forward, chunk

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] <= self.chunk:
            return self.forward(x)
        first = self.forward(flat[: self.chunk])
        if not isinstance(first, torch.Tensor):  # a block that also returns router logits: left whole
            return self.forward(x)
        out = first.new_empty(flat.shape[0], first.shape[-1])
        out[: self.chunk] = first
        for start in range(self.chunk, flat.shape[0], self.chunk):
            out[start : start + self.chunk] = self.forward(flat[start : start + self.chunk])
        return out.reshape(*x.shape[:-1], first.shape[-1])


def chunk_mlp(model: nn.Module, chunk: int) -> None:
    """Make every decoder layer's ``mlp`` run over ``chunk`` tokens at a time (layers without one: as is)."""
    for layer in decoder_layers(model):
        mlp = getattr(layer, "mlp", None)
        if mlp is not None:
            mlp.forward = _ChunkedMLP(mlp.forward, chunk)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.model.layers


def swap_quantized_modules(layer: nn.Module, entry: ShardEntry, compute_dtype: torch.dtype) -> None:
    """Replace the layer's quantized linears by the modules their scheme (from the manifest) computes with."""
    if not entry.modules:
        return
    from airquant.quant import make_linear

    for name, meta in entry.modules.items():
        parent_name, _, child = name.rpartition(".")
        parent = layer.get_submodule(parent_name) if parent_name else layer
        old = getattr(parent, child)
        with torch.device("meta"):
            new = make_linear(meta, old.in_features, old.out_features, old.bias is not None,
                              compute_dtype=compute_dtype)
        setattr(parent, child, new)


def load_fixed_parts(model: nn.Module, store: Path, manifest: Manifest, device: torch.device,
                     dtype: torch.dtype, *, host_embedding: bool = False) -> None:
    """Embeddings, final norm, lm_head (tied, dense or quantized) and rotary buffers, made real.

    ``host_embedding`` keeps an untied embedding table in host memory (``fixed.HostEmbedding``); a tied
    table is the lm_head weight too and stays on ``device``.
    """
    from airquant.engine import fixed

    inner = model.model
    on_host = host_embedding and not manifest.tied_lm_head
    for group in ("embed", "norm", "lm_head"):
        if group not in manifest.shards:
            continue
        entry = manifest.shards[group]
        target = torch.device("cpu") if group == "embed" and on_host else device
        tensors = _cast_dense(entry, load_file(store / entry.file, device=str(target)), dtype)
        if group == "embed" and on_host:
            inner.embed_tokens = fixed.HostEmbedding(tensors["weight"], device, dtype)
        elif group == "lm_head" and entry.modules:
            model.lm_head = fixed.quantized_head(entry, tensors, model.config.hidden_size, dtype)
        else:
            module = {"embed": inner.embed_tokens, "norm": inner.norm, "lm_head": model.lm_head}[group]
            module.load_state_dict(tensors, assign=True, strict=True)
    if manifest.tied_lm_head:
        model.lm_head.weight = inner.embed_tokens.weight
    rotary = inner.rotary_emb
    with torch.device(device):  # the inv_freq buffers are computed in __init__, not loaded
        inner.rotary_emb = type(rotary)(config=model.config)
    leftovers = [n for n, t in list(model.named_parameters()) + list(model.named_buffers())
                 if t.is_meta and not n.startswith("model.layers.")]
    if leftovers:
        raise StoreError(f"store {store} left these tensors unset: {leftovers[:5]}; the store is incomplete.")


def _cast_dense(entry: ShardEntry, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Cast the dense floating tensors to the compute dtype; quantized payloads stay as stored."""
    dense = {k for k, m in entry.tensors.items() if m.get("scheme", "dense") == "dense"}
    return {k: (v.to(dtype) if k in dense and v.is_floating_point() else v) for k, v in tensors.items()}


class StreamedLayer(nn.Module):
    """Runs a meta decoder layer with weights fetched for this call only."""

    def __init__(self, layer: nn.Module, index: int, streamer):
        super().__init__()
        self.layer = layer
        self.index = index
        self.streamer = streamer
        # Some decoder stacks (Qwen2, Mistral) pick their mask by the layer's attention type.
        if hasattr(layer, "attention_type"):
            self.attention_type = layer.attention_type

    def forward(self, *args, **kwargs):
        tensors = self.streamer.fetch(self.index)
        try:
            out = torch.func.functional_call(self.layer, tensors, args, kwargs, strict=False)
        except BaseException:
            self.streamer.release(self.index, ran=False)
            raise
        self.streamer.release(self.index)
        return out


def attach_streamer(model: nn.Module, streamer) -> None:
    layers = decoder_layers(model)
    for i in range(len(layers)):
        layers[i] = StreamedLayer(layers[i], i, streamer)


def load_layers_resident(model: nn.Module, store: Path, manifest: Manifest, device: torch.device,
                         dtype: torch.dtype) -> None:
    """Fill every decoder layer with its weights on ``device`` (the resident reference mode)."""
    for i, layer in enumerate(decoder_layers(model)):
        entry = manifest.shards[f"layer.{i}"]
        tensors = _cast_dense(entry, load_file(store / entry.file, device=str(device)), dtype)
        layer.load_state_dict(tensors, assign=True, strict=True)
