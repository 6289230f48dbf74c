"""Routed experts computed on the host CPU (``--experts cpu``, or ``auto`` where ``expert_plan.host_cost`` says the
host reads them faster than the link moves them).

The streamer leaves a streamed MoE layer's experts out of its copies, as for the device pool (engine/experts);
when the block calls its experts module, the routed rows' hidden states, routing ids and weights go to the host
in one copy (a few KB at batch 1), each routed expert is computed from the RAM tier's bytes, the weighted sum
goes back. Attention, norms, router and shared experts stay on the GPU; the streamer's copies of the next layers
run on meanwhile (the copy engine does not need this thread).

Compute: NF4 experts of the shape the fused kernels take (``expert_compute.fused_experts``: an NF4 (gate/)up and
down matrix, optional biases, the module's gating) by the host kernel ``quant/kernels/nf4_cpu`` straight from the
packed bytes, in fp32; any other experts (dense bf16/fp16/fp32, int2, GPTQ) by transformers' own grouped forward
on host tensors of the routed experts (dense ones in fp32). Either way the values are the GPU path's within fp32
rounding of the same decoded weights. An expert's tensors come only from ``LayerExperts.host_views``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from airquant.engine import layer_graphs
from airquant.engine.moe import compute as expert_compute
from airquant.engine.moe.layout import LayerExperts
from airquant.engine.moe.pool import packed_into, packed_rows
from airquant.engine.moe.sizing import ExpertsError
from airquant.quant.kernels import nf4_cpu

log = logging.getLogger(__name__)
# A call whose routed experts get this many rows each on average (a prefill's) runs on the compute device: the
# routed experts' bytes are copied there and the module's own (grouped) forward computes them, as a whole-layer
# pass would. Only where the device is another than the host (DEVICE_TYPES), and where those bytes are at most
# DEVICE_BYTES (the plan keeps no room for them; an out-of-memory falls back to the host for that call).
DEVICE_ROWS = 16
DEVICE_BYTES = 1 << 30
DEVICE_TYPES = ("cuda",)


def open_host_experts(engine, routed: dict[int, set[str]]) -> "HostExperts":
    """The host experts of an ``Engine`` whose streamer leaves ``routed`` layers' experts behind."""
    layers = {i: LayerExperts.of(i, engine.manifest.shards[f"layer.{i}"], engine.streamer.layouts[i], engine.store)
              for i in routed}
    log.info("experts   : routed, computed on the host CPU (%s, %d threads)", nf4_cpu.host_kernel(),
             nf4_cpu.threads())
    return HostExperts(layers, engine.streamer.host_image, engine.device)


class HostExperts:
    """Owns the host path's per-layer specs and counters; ``run`` stands in for an experts module's call
    (``skeleton.attach_experts`` wires it as it wires the device pool). ``host_image(i)``: layer i's data
    section in host memory, or None (then ``host_views`` reads the shard), and its arrangement."""

    def __init__(self, layers: dict[int, LayerExperts], host_image, device: torch.device):
        self.layers, self.host_image, self.device = layers, host_image, device
        self._specs: dict[int, expert_compute.FusedExperts | None] = {}
        # (layer, its host buffer's address) -> the layer's operands: made once, while the buffer holds the layer
        self._operands_of: dict[tuple[int, int], HostOperands] = {}
        self._bytes_of: dict[int, list[int]] = {}  # layer -> its experts' stored bytes (``_sizes``)
        # experts: computed (per call, summed); kernel_experts: of them by the NF4 kernel (the rest: grouped)
        # host_s: whole calls; of it to_host_s (the rows' copy: waits for the GPU's work before it), kernel_s (the
        # NF4 kernel calls) and back_s (the sums' way back)
        # device_calls: calls of many rows an expert computed on the device instead (DEVICE_ROWS)
        self.stats = {"calls": 0, "experts": 0, "kernel_experts": 0, "pairs": 0, "bytes_read": 0, "host_s": 0.0,
                      "to_host_s": 0.0, "kernel_s": 0.0, "back_s": 0.0, "device_calls": 0}

    @property
    def bytes_copied(self) -> int:
        return 0  # nothing crosses the link but the rows and their sums

    def staging_held(self) -> int:
        return 0

    def reset_stats(self) -> None:
        self.stats = {k: 0.0 if k.endswith("_s") else 0 for k in self.stats}

    def report(self) -> dict:
        return {**self.stats, "where": "host", "kernel": nf4_cpu.host_kernel(), "threads": nf4_cpu.threads()}

    def run(self, i: int, module, forward, args: tuple, kwargs: dict) -> torch.Tensor:
        """The experts module's output for ``hidden`` [T, H] routed by ``index``/``weights`` [T, k], computed here."""
        if len(args) != 3 or kwargs or args[1].is_floating_point():
            raise ExpertsError("--experts cpu needs an experts module called as (hidden, routing index, routing "
                               "weights); this model's is not (Llama 4's dispatched experts): use --experts routed.")
        # In a captured decode call this runs between two graphs (it reads the rows on the host): the layer's
        # other parts replay from CUDA graphs.
        return layer_graphs.eager_island(self._run, i, module, forward, *args)

    def _run(self, i: int, module, forward, hidden: torch.Tensor, index: torch.Tensor,
             weights: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self._on_device(i, module, forward, hidden, index, weights)
        if out is not None:
            self.stats["device_calls"] += 1
            self.stats["host_s"] += time.perf_counter() - start
            return out
        flat = hidden.reshape(-1, hidden.shape[-1])
        top_k = index.shape[-1]
        # One copy to the host: rows, ids (exact as fp32 below 2^24) and weights side by side.
        both = torch.cat((flat.float(), index.reshape(flat.shape[0], top_k).float(),
                          weights.reshape(flat.shape[0], top_k).float()), dim=1).cpu()
        x, ids, w = both.split((flat.shape[1], top_k, top_k), dim=1)  # [T, H], [T, k], [T, k]
        landed = time.perf_counter()
        out = self._compute(i, module, forward, x.contiguous(), ids.long(), w)  # [T, H] fp32
        computed = time.perf_counter()
        out = out.to(hidden.dtype)
        if self.device.type == "cuda":
            out = out.pin_memory().to(self.device, non_blocking=True)
        end = time.perf_counter()
        self.stats["calls"] += 1
        self.stats["host_s"] += end - start
        self.stats["to_host_s"] += landed - start
        self.stats["back_s"] += end - computed
        return out.view(hidden.shape)

    def _on_device(self, i: int, module, forward, hidden: torch.Tensor, index: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor | None:
        """The call computed on the compute device (see ``DEVICE_ROWS``), or None: it stays on the host."""
        if self.device.type not in DEVICE_TYPES or index.numel() < DEVICE_ROWS:
            return None
        layer = self.layers[i]
        experts = torch.unique(index).tolist()  # a host read, as the host path's copy of the rows is
        if experts[-1] >= len(layer.ranges) or index.numel() < DEVICE_ROWS * len(experts) or \
                sum(layer.expert_bytes(e) for e in experts) > DEVICE_BYTES:
            return None  # ids without stored weights: the host path says why
        src, arranged = self.host_image(i)
        try:
            out = _grouped(module, forward, layer, hidden, index, weights, experts, src, arranged, device=self.device)
        except torch.OutOfMemoryError:
            log.warning("layer %d: no room on the device for a call's %d routed experts; computed on the host",
                        i, len(experts))
            return None
        return out.to(hidden.dtype).view(hidden.shape)

    def _compute(self, i: int, module, forward, x: torch.Tensor, ids: torch.Tensor,
                 w: torch.Tensor) -> torch.Tensor:
        layer, (src, arranged) = self.layers[i], self.host_image(i)
        flat = ids.reshape(-1)  # [P = T * k]
        pairs = flat.tolist()
        if max(pairs) >= len(layer.ranges):
            raise ExpertsError(f"layer {i} routed a token to expert {max(pairs)}, which holds no weights in the "
                               f"store ({len(layer.ranges)} stored: LongCat-Flash's zero-computation experts are "
                               "such ids); --experts cpu does not compute them: use --experts routed or whole.")
        spec = self._spec(i, module)
        sizes = self._sizes(i)
        self.stats["pairs"] += len(pairs)
        if spec is not None and ids.shape[0] == 1 and len(set(pairs)) == len(pairs):
            # One token (a batch-1 decode step), its k experts each once: the pairs are already one row an
            # expert, in the order the sum below wants; no sort, no scatter back.
            self.stats["experts"] += len(pairs)
            self.stats["bytes_read"] += sum(sizes[e] for e in pairs)
            return self._one_token(i, module, spec, src, arranged, x, flat, w)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
        routed = experts.tolist()
        self.stats["experts"] += len(routed)
        self.stats["bytes_read"] += sum(sizes[e] for e in routed)
        if spec is None:
            return _grouped(module, forward, layer, x, ids, w, routed, src, arranged)
        self.stats["kernel_experts"] += experts.numel()
        ops, rows_of = self._operands(i, spec, src, arranged, experts)
        rows = torch.cat((counts.new_zeros(1), counts.cumsum(0)))  # [u + 1]: each expert's pairs
        # [P]: each sorted pair's row in the operands (for biases; searchsorted, as repeat_interleave took ~5 ms
        # for a few elements on a busy 2-core host)
        pair_rows = rows_of[torch.searchsorted(experts, flat[order])] if ops.up_bias is not None or \
            ops.down_bias is not None else None
        y = self._products(module, spec, ops, x[order // ids.shape[1]], rows_of, rows, pair_rows)  # [P, H]
        out = torch.empty_like(y)
        out[order] = y * w.reshape(-1)[order].unsqueeze(-1)  # back to (token, slot) order
        return out.view(*ids.shape, -1).sum(dim=1)  # [T, H]: a token's k weighted rows summed

    def _one_token(self, i: int, module, spec: expert_compute.FusedExperts, src: torch.Tensor | None, arranged,
                   x: torch.Tensor, experts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """``_compute`` for one token whose ``k`` routed experts (``experts`` [k], in routing order) are distinct:
        row j of each product is pair j's, so the k rows are weighted and summed as they come."""
        self.stats["kernel_experts"] += experts.numel()
        ops, rows_of = self._operands(i, spec, src, arranged, experts)
        k = experts.numel()
        y = self._products(module, spec, ops, x.expand(k, -1), rows_of, torch.arange(k + 1), rows_of)  # [k, H]
        return (y * w.reshape(k, 1)).sum(dim=0, keepdim=True)  # [1, H]

    def _products(self, module, spec: expert_compute.FusedExperts, ops: "HostOperands", x: torch.Tensor,
                  rows_of: torch.Tensor, rows: torch.Tensor, pair_rows: torch.Tensor | None) -> torch.Tensor:
        """``[P, H]``: the P rows of ``x`` (grouped by expert: ``rows`` [u + 1] offsets, ``rows_of`` [u] each
        group's expert row in ``ops``) through the (gate/)up matrix, the module's gating and the down matrix;
        ``pair_rows`` [P]: each row's expert row, for the biases (None without biases)."""
        kernel = time.perf_counter()
        h = nf4_cpu.matmul_experts(x, ops.up, rows_of, rows, spec.up.n, spec.up.k, spec.blocksize,
                                   spec.double)  # [P, N]
        self.stats["kernel_s"] += time.perf_counter() - kernel
        if ops.up_bias is not None:
            h += ops.up_bias[pair_rows]
        h = expert_compute.activate(module, h, spec.gated)  # [P, I]
        kernel = time.perf_counter()
        y = nf4_cpu.matmul_experts(h, ops.down, rows_of, rows, spec.down.n, spec.down.k, spec.blocksize,
                                   spec.double)  # [P, H]
        self.stats["kernel_s"] += time.perf_counter() - kernel
        if ops.down_bias is not None:
            y += ops.down_bias[pair_rows]
        return y

    def _sizes(self, i: int) -> list[int]:
        """Layer i's experts' stored bytes, by expert (made once per layer)."""
        sizes = self._bytes_of.get(i)
        if sizes is None:
            layer = self.layers[i]
            sizes = self._bytes_of[i] = [layer.expert_bytes(e) for e in range(len(layer.ranges))]
        return sizes

    def _operands(self, i: int, spec: expert_compute.FusedExperts, src: torch.Tensor | None, arranged,
                  experts: torch.Tensor) -> tuple["HostOperands", torch.Tensor]:
        """The call's operands and, per routed expert, its row in them: every expert of the layer's host bytes,
        made once per layer and buffer (``src``); from the shard (no ``src``): the routed ones, read now."""
        layer = self.layers[i]
        if src is None:
            return HostOperands.of(spec, [layer.host_views(None, e) for e in experts.tolist()]), \
                torch.arange(experts.numel())
        key = (i, src.data_ptr())
        if key not in self._operands_of:
            self._operands_of = {k: v for k, v in self._operands_of.items() if k[0] != i}  # the layer's old buffer
            self._operands_of[key] = HostOperands.of(spec, [layer.host_views(src, e, arranged)
                                                                    for e in range(len(layer.ranges))])
        return self._operands_of[key], experts

    def _spec(self, i: int, module) -> expert_compute.FusedExperts | None:
        """Layer i's NF4 experts as the host kernel takes them (decided once per layer), or None."""
        if i not in self._specs:
            spec = expert_compute.fused_experts(module, straddling=True)
            layer = self.layers[i]
            names = {f"{m.name}.{s}" for m in (spec.up, spec.down) for s in
                     expert_compute.quantized_children(module)[m.name].suffixes} if spec is not None else set()
            biases = {f"{m.name}_bias" for m in (spec.up, spec.down) if m.bias is not None} if spec else set()
            self._specs[i] = spec if spec is not None and names | biases == set(layer.names) else None
        return self._specs[i]


@dataclass(frozen=True)
class HostOperands:
    """A layer's NF4 experts as the host kernel reads them: the (gate/)up and down matrices of each expert and
    their biases, fp32 ``[experts, n]`` (gpt-oss), indexed by a row per expert."""

    up: nf4_cpu.Matrices
    down: nf4_cpu.Matrices
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None

    @classmethod
    def of(cls, spec: expert_compute.FusedExperts, views: list[dict[str, torch.Tensor]]) -> "HostOperands":
        parts = []
        for m in (spec.up, spec.down):
            prefix = f"{m.name}."
            parts.append(nf4_cpu.Matrices.of([{n[len(prefix):]: t for n, t in v.items() if n.startswith(prefix)}
                                              for v in views]))
        biases = [torch.stack([v[f"{m.name}_bias"] for v in views]).float() if m.bias is not None else None
                  for m in (spec.up, spec.down)]
        return cls(parts[0], parts[1], *biases)


def _grouped(module, forward, layer: LayerExperts, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
             experts: list[int], src: torch.Tensor | None, arranged, device: torch.device | None = None) -> torch.Tensor:
    """Experts the host kernel does not take, or a call of many rows an expert (``device``: computed there, on the
    rows where they are): transformers' grouped forward (or the module's own) on ``[U, ...]`` tensors of the
    routed experts, dense ones in fp32 on the host (the device: its compute dtype, the rows'); quantized ones
    decode to their compute dtype, which the rows then take."""
    quantized = expert_compute.quantized_children(module)
    dtype = next(iter(quantized.values())).compute_dtype if quantized else \
        (x.dtype if device is not None else torch.float32)
    views = {e: layer.host_views(src, e, arranged) for e in experts}
    packed = {}
    for name, dense in zip(layer.names, layer.dense):
        t = torch.stack([views[e][name] for e in experts])
        t = t.to(device) if device is not None else t
        packed[name] = t.to(dtype) if dense else t
    local = packed_rows(ids, len(layer.ranges))  # ``experts`` are the sorted routed ids, as the pool packs them
    fn = expert_compute.grouped_forward(module)
    with packed_into(module, packed, len(experts)):
        if fn is None:
            out = forward(x.to(dtype), local, w.to(dtype))
        else:
            out = expert_compute.run_grouped(module, fn, x.to(dtype), local, w.to(dtype), num=len(experts))
    return out.float()
