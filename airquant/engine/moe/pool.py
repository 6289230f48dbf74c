"""Expert-aware streaming for Mixture-of-Experts layers at run time: route first, then move only the routed
experts (how big the pool is, and whether a run streams routed at all, ``moe.sizing`` decides; where
each expert's bytes are and which slot holds which, ``moe.layout`` keeps).

A MoE layer's dense part (attention, norms, router, shared experts) goes through the streamer's slots as
before; its experts stay in host memory. When the block calls its experts module, the routing of the batch
is known (``top_k_index``): the union of routed experts is copied, one range per expert from the arranged
RAM tier (``layout.HostArrangement``; else one per expert tensor, the manifest's byte ranges), into a device
**expert pool** of fixed-size slots, and the experts run from
there. The pool is the arena of the experts a call needs plus a **cache**: slots keep their (store shard,
layer, expert) key until the policy (LRU, or LFU with decay) evicts them, and a hit skips the copy.

Ordering on CUDA (the copy stream is the streamer's): a copy into a slot waits for the last gather that
read the slot (``free``); the gather waits for the copy into each slot it reads (``ready``). The gather
packs the routed experts into [U, ...] tensors on the compute stream, so the slots are free again as
soon as it ran: layer i+1's speculated experts copy while layer i's experts compute.

Speculative prefetch (at most ``SPECULATE_TOKENS`` tokens in the call): layer i+1's router is applied to
layer i's expert input to guess i+1's experts, whose copies start at once; a wrong guess costs bandwidth.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from airquant.engine import layer_graphs
from airquant.engine.moe import compute as expert_compute
from airquant.engine.moe import sizing
from airquant.engine.moe.direct import DirectReads, tiered_kernels
from airquant.engine.moe.layout import LayerExperts, SlotTable, image_parts, read_range
from airquant.engine.moe.sizing import SPECULATE_TOKENS, ExpertPlan, ExpertsError, fused_chunk_tokens
from airquant.layout import find_layout, swap_tensor
from airquant.quant import kernels
from airquant.store.manifest import Manifest, ShardEntry

log = logging.getLogger(__name__)
# True: a GPU run copies a call's expert slices from the RAM tier by one kernel (engine/uva_copy) where the probe
# passes. Off by default: on the H200 that kernel read the pinned tier at 13.5 GB/s (byte loads over the link;
# 1.6 ms for a Qwen3-30B-A3B layer's 8 experts, 0.39 ms at the copy engine's 55 GB/s), so it saves the per-slice
# copies' host time and loses it again on the link (benchmarks/moe_bench.py, case nocache_uva).
UVA_COPY = False
# True: a GPU run's few-row NF4 calls read their experts where they are, a VRAM hot set or the pinned RAM tier,
# by the routing on the device: no copy, no host sync (engine/moe/direct.py). H200, moe_bench, batch 1, same
# store and run: Qwen3-30B-A3B (4 GB cap) 0.088 s a step against the copy path's 0.115 without a cache and
# 0.146 with LFU; Mixtral-8x7B (15 GB) 0.088 s with the hot set against the LFU copy path's 0.101. Off with
# the fused kernels (``compute.FUSED``); tests set it on CPU, where the kernels run interpreted.
DIRECT = True


def router_weights(block, entry: ShardEntry, module: str) -> str | None:
    """The name of the router's [E, H] weight beside the experts module (None: not found, no speculation)."""
    parent = module.rpartition(".")[0]
    num = entry.experts["num"]
    for name, meta in entry.tensors.items():
        if name.startswith(f"{parent}.") and name.endswith("weight") and name.count(".") == parent.count(".") + 2 \
                and len(meta["shape"]) == 2 and meta["shape"][0] == num and meta.get("scheme", "dense") == "dense":
            return name
    return None


def load_router(entry: ShardEntry, store: Path, name: str, device: torch.device, dtype: torch.dtype):
    with safe_open(store / entry.file, "pt", device="cpu") as f:
        return f.get_tensor(name).to(device=device, dtype=dtype)


# -- wiring ---------------------------------------------------------------------------------------
def open_pool(store: Path, manifest: Manifest, streamer, routed: dict[int, set[str]], plan: ExpertPlan,
              model_layers, device: torch.device, dtype: torch.dtype) -> "ExpertPool":
    """The pool of a routed run over ``streamer``'s host tiers and copy stream, routers loaded to speculate.
    Direct reads (``DIRECT``) only for layers whose router has a row per stored expert, so every routed id
    has bytes (LongCat-Flash's identity experts have none)."""
    layers, routers, direct = {}, {}, set()
    for i in routed:
        entry = manifest.shards[f"layer.{i}"]
        layers[i] = LayerExperts.of(i, entry, streamer.layouts[i], store)
        name = router_weights(model_layers[i], entry, layers[i].module)
        if name is not None:
            direct.add(i)
            if plan.speculate:
                routers[i] = load_router(entry, store, name, device, dtype)
    return ExpertPool(layers, plan, device, dtype, streamer.ops, streamer.memory, streamer.host_image, routers,
                      direct=direct)


def open_pool_for(engine, routed: dict[int, set[str]]) -> "ExpertPool":
    """The pool of an ``Engine`` whose streamer leaves ``routed`` layers' experts behind, exactly as its plan
    sized it (``planner.plan``: the arena inside the VRAM budget, the staging inside the host budget).
    Nothing is re-decided here: a plan without a pool, or whose arena does not fit, is refused."""
    plan, manifest = engine.plan, engine.manifest
    sizing = plan.experts
    if sizing is None:
        raise ExpertsError("this run streams experts routed, but its plan has no expert pool (it was made with "
                           "--experts whole, or for another store); plan it with the run's own --experts flags "
                           "(or leave the plan to Engine.open).")
    if not plan.experts_fit:
        raise ExpertsError(f"the expert pool ({sizing.pool_bytes / 1e9:.2f} GB), gather "
                           f"({sizing.gather_bytes / 1e9:.2f} GB), stacked decode ({sizing.decode_bytes / 1e9:.2f} GB) "
                           f"and expert compute ({sizing.compute_bytes / 1e9:.2f} GB) do not fit the "
                           f"{plan.arena_room_bytes / 1e9:.2f} GB "
                           "the layer plan leaves; lower --expert-cache, raise --max-vram or use --experts whole.")
    log.info("%s", sizing.describe())
    layers = skeleton_layers(engine.model)
    return open_pool(engine.store, manifest, engine.streamer, routed, sizing, layers, engine.device, engine.dtype)


def skeleton_layers(model) -> list:
    return list(model.get_submodule(find_layout(model).stack))


def speculation_hook(pool: "ExpertPool", i: int, block) -> bool:
    """Guess layer i's experts before its attention (``DirectReads.speculate``), from a forward pre-hook on the
    block's input norm (inside the layer's call, so a captured graph holds it): the router ([E, H] weight beside
    the experts module) over ``post_attention_layernorm`` of the block's input. Whether the hook was set: only
    with direct reads that have speculative slots, on a block of that norm and router."""
    reads = getattr(pool, "direct", None)  # host experts (--experts cpu) have none
    if reads is None or not reads.spec_slots or i not in reads.eligible:
        return False
    layer = pool.layers[i]
    parent, _, experts = layer.module.rpartition(".")
    num = len(layer.ranges)
    gates = [m for name, m in block.get_submodule(parent).named_children() if name != experts
             and isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2
             and m.weight.shape[0] >= num]
    first, norm = getattr(block, "input_layernorm", None), getattr(block, "post_attention_layernorm", None)
    if len(gates) != 1 or not isinstance(first, torch.nn.Module) or not isinstance(norm, torch.nn.Module):
        return False
    gate = gates[0]

    def guess(_module, args):
        if args:
            reads.speculate(i, args[0], norm, gate.weight, layer.top_k)

    first.register_forward_pre_hook(guess)
    return True


class RoutedForward:
    """Stands in for an experts module's ``forward``: the pool brings the routed experts, then runs it."""

    def __init__(self, pool: "ExpertPool", index: int, module, forward):
        self.pool, self.index, self.module, self.forward = pool, index, module, forward

    def __call__(self, *args, **kwargs):
        return self.pool.run(self.index, self.module, self.forward, args, kwargs)


# -- the pool at run time ----------------------------------------------------------------------------
class ExpertPool:
    """Owns the device expert slots, their events, the host staging for disk reads and the counters.

    ``host_image(i)`` gives layer i's data section in host memory, or None when it is on disk only (the
    routed experts' ranges are then read from the shard file), and its ``HostArrangement`` (None: the bytes
    are in the file's order, one copy per expert tensor slice; else one copy per expert)."""

    def __init__(self, layers: dict[int, LayerExperts], plan: ExpertPlan, device: torch.device,
                 compute_dtype: torch.dtype, ops, memory, host_image, routers: dict[int, torch.Tensor],
                 direct: set[int] = frozenset()):
        self.layers, self.plan, self.device, self.compute_dtype = layers, plan, device, compute_dtype
        self.ops, self.host_image, self.routers = ops, host_image, routers
        # Direct reads: the copy path keeps the working slots, the hot set takes the cache slots; speculative
        # reads (sizing.spec_guesses: by default beside no cache) get the plan's spec_slots beyond its slots.
        reads = DIRECT and direct and (kernels.interpreting() or (ops is not None and kernels.triton_available()))
        rows = plan.slots + (plan.spec_slots if reads else 0)
        nbytes = rows * plan.slot_bytes
        self.mem = (ops.alloc(nbytes) if ops is not None else torch.empty(nbytes, dtype=torch.uint8)
                    ).view(rows, plan.slot_bytes)
        self.direct = None
        if reads:
            self.direct = DirectReads(layers, set(direct), self.mem, range(plan.work, plan.slots), device,
                                      host_image, plan.policy, spec_slots=range(plan.slots, rows))
        self.table = SlotTable(plan.work if self.direct is not None else plan.slots, plan.policy)
        self.ready: list[object] = [None] * plan.slots  # copy into the slot done (event)
        self.ready_up: list[object] = [None] * plan.slots  # its first part done (copied reads; else = ready)
        self.free: list[object] = [None] * plan.slots  # last gather out of the slot done (event)
        # Exactly the staging the plan counted in the host budget (ExpertPlan.staging: none unless a routed
        # layer is read from disk on a GPU; on CPU disk reads go straight into the slots).
        self._staging = [memory.empty(plan.slot_bytes) for _ in range(plan.staging)] if ops is not None else []
        self._staging_free: list[object] = [None] * len(self._staging)
        self._next_staging = 0
        # One kernel copies all of a call's slices from the pinned RAM tier (engine/uva_copy), where it can:
        # probed at the first copy from the RAM tier (filled as the first pass reads it); None: not yet.
        self.uva: bool | None = None if ops is not None and UVA_COPY else False
        self.guessed: dict[int, set[int]] = {}  # layer -> experts speculated for it, not yet routed
        self.current: int | None = None
        self.grouped = True  # grouped matmul over the packed experts (False: the module's own forward)
        self._fused_specs: dict[int, tuple | None] = {}
        self._parts: dict[int, tuple] = {}  # layer -> its expert image's two copies (copied reads)
        self._unplanned: set[int] = set()  # layers warned about: their prefill left the fused path of the plan
        self.stats = {"bytes_copied": 0, "copied": 0, "hits": 0, "routed": 0, "guessed": 0, "guess_used": 0,
                      "guess_bytes": 0, "copied_calls": 0}

    @property
    def bytes_copied(self) -> int:
        """Expert bytes over the link: the copy path's copies, and direct reads from the RAM tier."""
        return self.stats["bytes_copied"] + (self.direct.link_bytes() if self.direct is not None else 0)

    def staging_held(self) -> int:
        """Host bytes of the staging buffers (``Engine.host_memory``'s expert_staging)."""
        return sum(b.numel() for b in self._staging)

    def reset_stats(self) -> None:
        self.stats = dict.fromkeys(self.stats, 0)
        if self.direct is not None:
            self.direct.reset()

    def report(self) -> dict:
        """Counters since the last reset; with direct reads, their (token, expert) pairs count as routed and
        their hot-set reads as hits (the copy path counts a call's distinct experts: the same at batch 1;
        ``direct`` holds their own figures)."""
        s = dict(self.stats)
        if self.direct is not None:  # its counters read from the device once, here
            d = self.direct.report()
            s.update(routed=s["routed"] + d["direct_pairs"], hits=s["hits"] + d["direct_hits"],
                     bytes_copied=s["bytes_copied"] + d["direct_link_bytes"], direct=d)
        return {**s, "hit_rate": s["hits"] / s["routed"] if s["routed"] else None,
                "speculation_recall": s["guess_used"] / s["routed"] if s["guessed"] else None,
                "speculation_precision": s["guess_used"] / s["guessed"] if s["guessed"] else None}

    # -- one call of a layer's experts -------------------------------------------------------------
    def run(self, i: int, module, forward, args: tuple, kwargs: dict) -> torch.Tensor:
        """The experts module's ``forward`` on the batch, its routed experts brought into the pool first."""
        hidden = args[0] if args else next(iter(kwargs.values()))
        index = routing(args, kwargs)
        if index is None:
            if not expert_compute.dispatched(module):
                raise ExpertsError("an experts module was called without a routing index; "
                                   "use --experts whole for this model.")
            return self._run_dispatched(i, module, forward, hidden)
        layer = self.layers[i]
        if self.direct is not None and expert_compute.FUSED and len(args) == 3 and not kwargs and \
                hidden.numel() <= expert_compute.FUSED_TOKENS * hidden.shape[-1]:
            src, arranged = self.host_image(i)
            if src is not None and arranged is not None and self.direct.reachable(src):
                if self._copied(i, module, layer, index):  # it reads on the host: between two layer graphs
                    return layer_graphs.eager_island(self._run_copied, i, module, hidden, index, args[2])
                out = self.direct.run(i, module, hidden, index, args[2], src, arranged)
                if out is not None:
                    return out
        if self.plan.fused and len(args) == 3 and not kwargs and hidden.dim() == 2 and \
                hidden.shape[0] > expert_compute.FUSED_TOKENS:  # the plan left no room for the gather path
            out = self._run_fused_chunks(i, module, hidden, index, args[2])
            if out is not None:
                return out
            if i not in self._unplanned:
                self._unplanned.add(i)
                log.warning("layer %d: its prefill does not take the fused expert kernels the plan counted on; "
                            "it gathers and decodes its experts beyond the planned VRAM (--experts whole avoids "
                            "this)", i)
        guess = self._guess(i + 1, hidden) if self.plan.speculate else None
        # The one host read of a few-row call: its routing (and guess) at once; run_gemv takes the routing.
        # A larger call reads only its distinct experts (a long prefill's every id would be a long host list).
        few = index.numel() <= expert_compute.GEMV_TOKENS * len(layer.ranges)
        ids, guessed = _host_read(index if few else torch.unique(index), guess)
        num = len(layer.ranges)
        union = sorted({e for e in ids if e < num})
        absent = len(union) < len(set(ids))  # ids without stored bytes: the module's own forward handles them
        slots = self._acquire(i, layer, union)
        if guessed is not None:  # queued behind this layer's copies, before its gather waits on them
            self._speculate(i + 1, [e for e in guessed if e < num], keep=set(slots))
        fused = self._fused(i, module, hidden) if few and len(args) == 3 and not kwargs and not absent else None
        if fused is not None:
            return self._run_fused(fused, module, hidden, args[2], ids, dict(zip(union, slots)))
        packed = self._gather(layer, slots) if slots else _no_experts(layer, self.compute_dtype, self.device)
        row = {e: n for n, e in enumerate(union)}
        local = [row[e] for e in ids] if few and not absent else None  # ids -> rows of the packed tensors
        args, kwargs = _with_index(args, kwargs, packed_rows(index, num))
        grouped = expert_compute.grouped_forward(module) if self.grouped and len(args) == 3 and not kwargs \
            and not absent else None
        with packed_into(module, packed, len(union)):
            if grouped is None:
                return forward(*args, **kwargs)
            return expert_compute.run_grouped(module, grouped, *args, num=len(union),
                                               tokens=self.plan.call_tokens or None, ids=local)

    def _copied(self, i: int, module, layer: LayerExperts, index: torch.Tensor) -> bool:
        """Whether a direct-read call takes copied reads (``sizing.copy_reads``): decided by its shape, so a
        layer graph's key holds one way or the other."""
        if i not in self.direct.eligible or self.direct.matrices(i, module) is None:
            return False
        call = min(index.numel(), len(layer.ranges)) * layer.expert_bytes(0)
        return sizing.copy_reads(call, hot_set=bool(self.direct.hot_slots))

    def _run_copied(self, i: int, module, hidden: torch.Tensor, index: torch.Tensor,
                    weights: torch.Tensor) -> torch.Tensor:
        """A few-row call whose experts the copy engine brings into working slots (``sizing.COPY_READS_MIN_BYTES``
        says when and why), computed by the direct reads' tiered kernels through a table of those slots.

        The routing is read to the host (the call's one sync). Its experts are copied column by column of the
        top-k (column 0's experts first), each image in two parts (``layout.image_parts``): every expert's first
        part (the (gate/)up matrix, the code books), then each expert's down part. The up kernel waits for the
        first parts only and runs while the down parts arrive; each column's down projection waits for its own
        experts' and is summed in fp32, so only the last column's runs after the link. Counts as the copy path
        does: each distinct expert routed and copied (or found in a working slot)."""
        layer = self.layers[i]
        src, arranged = self.host_image(i)
        spec, up_m, down_m = self.direct.matrices(i, module)
        top_k = index.shape[-1]
        index, weights = index.reshape(-1, top_k), weights.reshape(-1, top_k)
        rows = index.tolist()  # the one host read of the call
        self.stats["copied_calls"] += 1
        order = list(dict.fromkeys(row[k] for k in range(top_k) for row in rows))  # column 0's experts first
        slots = self._acquire(i, layer, order, parts=self._image_parts(i, layer, spec, arranged))
        slot_of = dict(zip(order, slots))
        table = self._slot_table(len(layer.ranges), order, slots, fill=-1)  # -1: not in the pool (none read)
        tiers = self.direct.tiers(i, src, arranged, table=table, hits=self.direct.scratch_hits)
        up, down = tiered_kernels(spec.scheme)
        self._wait_ready(slots, up=True)
        h = expert_compute.activate(module, up(hidden.reshape(-1, hidden.shape[-1]), index, up_m, tiers),
                                    spec.gated).view(len(rows), top_k, -1)  # [T, k, I]
        out = None
        for k in range(top_k):
            self._wait_ready({slot_of[row[k]] for row in rows})
            part = down(h[:, k], index[:, k:k + 1], weights[:, k:k + 1], down_m, tiers, torch.float32)  # [T, H]
            out = part if out is None else out + part
        self._mark_read(slots)
        return out.to(hidden.dtype)

    def _image_parts(self, i: int, layer: LayerExperts, spec, arranged) -> tuple:
        """Layer i's expert image in its two copies (``layout.image_parts``), found once a layer."""
        if i not in self._parts:
            self._parts[i] = image_parts(layer, spec.down.name, arranged.image_bytes)
        return self._parts[i]

    def _fused(self, i: int, module, hidden: torch.Tensor) -> tuple | None:
        """Layer i's ``FusedExperts`` and its operands over the pool (decided once per layer), where its kernels
        can run on ``hidden``."""
        if hidden.numel() > expert_compute.FUSED_TOKENS * hidden.shape[-1]:
            return None
        return self._fused_spec(i, module, hidden)

    def _fused_spec(self, i: int, module, hidden: torch.Tensor) -> tuple | None:
        if not expert_compute.FUSED or not expert_compute.fused_runs_on(hidden):
            return None
        if i not in self._fused_specs:
            layer = self.layers[i]
            spec = expert_compute.fused_experts(module, layer.names, layer.dtypes, layer.offsets,
                                                schemes=expert_compute.FUSED_SCHEMES)
            self._fused_specs[i] = None if spec is None else (spec, spec.pool_operands(self.mem))
        return self._fused_specs[i]

    def _run_fused(self, fused: tuple, module, hidden: torch.Tensor, weights: torch.Tensor,
                   ids: list[int], slot_of: dict[int, int]) -> torch.Tensor:
        """A few-row call computed by the fused kernels straight from the slots: no gather, no per-expert
        Python; the slots are free for new copies once the kernels ran."""
        self._wait_ready(slot_of.values())
        # Each pair's slot, [T * k]: a pinned host tensor, so its copy to the device does not block.
        pairs = torch.tensor([slot_of[e] for e in ids], dtype=torch.int32, pin_memory=self.ops is not None)
        spec, operands = fused
        out = expert_compute.run_fused(spec, module, operands, hidden.reshape(-1, hidden.shape[-1]),
                                       pairs.to(self.device, non_blocking=True).view(weights.shape), weights,
                                       self.plan.slots)
        self._mark_read(slot_of.values())
        return out

    def _run_fused_chunks(self, i: int, module, hidden: torch.Tensor, index: torch.Tensor,
                          weights: torch.Tensor) -> torch.Tensor | None:
        """A many-row call (a prefill) by the fused grouped kernels straight from the slots, in chunks of tokens
        that route at most ``POOL_CHUNK_ROWS`` rows an expert on average (the widest grouped block: each block
        decodes its expert's tile again) and within the plan's ``call_tokens``: no gather into packed tensors
        and no stacked dense decode, whose device bytes a plan that counts on this (``ExpertPlan.fused``) gives
        to the decode. NF4 only (the other formats have no grouped kernel). None where the layer's kernels do
        not apply or the call routes an id without stored bytes (the caller's path runs it). Each chunk reads
        its distinct experts to the host (one sync; a call of one chunk, once), brings them into the pool and
        maps each pair to its slot on the device."""
        fused = self._fused_spec(i, module, hidden)
        if fused is None or fused[0].max_tokens is not None:  # NF4's grouped kernel; int2, GPTQ, AWQ have none
            return None
        layer = self.layers[i]
        num, top_k = len(layer.ranges), index.shape[-1]
        routed = torch.unique(index).tolist()  # sorted: one host read (a one-chunk call's only one)
        if routed and routed[-1] >= num:
            return None
        spec, operands = fused
        step = min(fused_chunk_tokens(num, top_k), self.plan.call_tokens or hidden.shape[0])
        outs = []
        for a in range(0, hidden.shape[0], step):
            part = index[a:a + step]
            union = routed if step >= hidden.shape[0] else torch.unique(part).tolist()
            slots = self._acquire(i, layer, union)
            lut = self._slot_table(num, union, slots, fill=0)
            self._wait_ready(slots)
            outs.append(expert_compute.run_fused(spec, module, operands, hidden[a:a + step], lut[part.long()],
                                                 weights[a:a + step], self.plan.slots, len(union)))
            self._mark_read(slots)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _slot_table(self, num: int, experts: list[int], slots: list[int], fill: int) -> torch.Tensor:
        """int32 ``[num]`` on the device: each of ``experts``' slot, ``fill`` for the others; built in pinned host
        memory, so its copy to the device does not block."""
        table = torch.full((num,), fill, dtype=torch.int32, pin_memory=self.ops is not None)
        table[torch.tensor(experts, dtype=torch.long)] = torch.tensor(slots, dtype=torch.int32)
        return table.to(self.device, non_blocking=True) if self.ops is not None else table

    def _wait_ready(self, slots, up: bool = False) -> None:
        """The compute stream waits for the copies into ``slots`` (no host block); ``up``: only for their first
        parts (copied reads: what the up projection reads)."""
        if self.ops is not None:
            ready = self.ready_up if up else self.ready
            for event in {id(ready[s]): ready[s] for s in slots if ready[s] is not None}.values():
                self.ops.wait(event)

    def _mark_read(self, slots) -> None:
        """``slots`` are free for new copies once what the compute stream has queued so far has run."""
        if self.ops is not None:
            mark = self.ops.mark()
            for s in slots:
                self.free[s] = mark

    def _run_dispatched(self, i: int, module, forward, hidden: torch.Tensor) -> torch.Tensor:
        """Llama 4: tokens spread over every expert ([E * T, H]); only experts with a non-zero row run."""
        layer = self.layers[i]
        num = len(layer.ranges)
        rows, routed = expert_compute.dispatched_rows(hidden, num)
        # Each token's rows are positive multiples of its hidden state: their sum routes like it.
        guess = self._guess(i + 1, rows.sum(dim=0)) if self.plan.speculate else None
        flags, guessed = _host_read(routed, guess)  # the one host sync of the call
        union = [e for e, hit in enumerate(flags) if hit]
        out = torch.zeros_like(rows)
        if not union:
            return out.reshape(hidden.shape)
        slots = self._acquire(i, layer, union)
        if guessed is not None:
            self._speculate(i + 1, guessed, keep=set(slots))
        packed = self._gather(layer, slots)
        # The routed experts' ids in order, on the device without host data: True flags sort first (stable).
        chosen = torch.argsort((~routed).to(torch.uint8), stable=True)[:len(union)]
        with packed_into(module, packed, len(union)):
            part = forward(rows.index_select(0, chosen).reshape(-1, hidden.shape[-1]))
        out.index_copy_(0, chosen, part.reshape(len(union), -1, part.shape[-1]).to(out.dtype))
        return out.reshape(hidden.shape)

    def _acquire(self, i: int, layer: LayerExperts, union: list[int], parts: tuple | None = None) -> list[int]:
        """Slots holding ``union``'s experts (in its order), the missing ones copied in (``parts``: in two parts,
        see ``_copy_cuda``)."""
        table = self.table
        table.tick += 1
        if i != self.current and self.plan.cache == 0:  # no cache: only this layer's (and speculated) stay
            for slot, key in enumerate(table.key_of):
                if key is not None and key[1] != i:
                    table.forget(slot)
        self.current = i
        guessed = self.guessed.pop(i, set())
        self.stats["guess_used"] += len(guessed & set(union))
        self.stats["routed"] += len(union)
        slots, keep, missing = {}, set(), []
        for e in union:
            slot = table.lookup((layer.key, i, e))
            if slot is None:
                missing.append(e)
            else:
                slots[e] = slot
                keep.add(slot)
        self.stats["hits"] += len(union) - len(missing)
        self._copy_in(i, layer, missing, keep, slots, parts)
        for slot in slots.values():
            table.touch(slot)
        return [slots[e] for e in union]

    def _copy_in(self, i: int, layer: LayerExperts, experts: list[int], keep: set[int], slots: dict,
                 parts: tuple | None = None) -> None:
        """Slots for ``experts`` (evicting by policy, never a slot in ``keep``) and their copies queued."""
        for e in experts:
            slot = self.table.victim(keep)
            self.table.assign(slot, (layer.key, i, e))
            keep.add(slot)
            slots[e] = slot
        if not experts:
            return
        src, arranged = self.host_image(i)
        targets = [(slots[e], e) for e in experts]
        if self.ops is None:
            for slot, e in targets:
                for start, end, off in _runs(layer, arranged, e, parts if src is not None else None):
                    self.mem[slot, off:off + end - start].copy_(src[start:end] if src is not None else
                                                                read_range(layer, start, end))
        else:
            self._copy_cuda(layer, targets, src, arranged, parts)
        moved = sum(layer.expert_bytes(e) for e in experts)
        self.stats["bytes_copied"] += moved
        self.stats["copied"] += len(experts)

    def _copy_cuda(self, layer: LayerExperts, targets: list[tuple[int, int]], src, arranged,
                   parts: tuple | None = None) -> None:
        """The copies of a call in one batch on the copy stream: one per expert from an arranged RAM tier (one
        per expert tensor slice from an unarranged one), one per expert from a staging buffer (disk), after
        the gathers that last read the slots. ``parts`` (copied reads, an arranged tier): each image's first
        part for every target, then each target's second part, an event after each (``ready_up``, ``ready``)."""
        stream = self.ops.stream
        with torch.cuda.stream(stream):
            for event in {id(self.free[s]): self.free[s] for s, _ in targets if self.free[s] is not None}.values():
                stream.wait_event(event)
            if parts is not None and src is not None and arranged is not None:
                self._copy_parts(targets, src, arranged, parts, stream)
                return
            staged = []
            if src is not None and self.uva is None:
                from airquant.engine.moe import uva_copy  # Triton: imported only where a GPU run copies this way

                self.uva = uva_copy.probe(src, self.device)
            by_uva = src is not None and self.uva
            if by_uva:
                self._copy_uva(layer, targets, src, arranged)
            mem = self.mem.view(-1)
            for slot, e in targets:
                if by_uva:
                    continue
                if src is not None:
                    at = slot * self.plan.slot_bytes
                    for start, end, off in _runs(layer, arranged, e):
                        mem[at + off:at + off + end - start].copy_(src[start:end], non_blocking=True)
                else:
                    k = self._fill_staging(layer, e)
                    self.mem[slot].copy_(self._staging[k], non_blocking=True)
                    staged.append(k)
            done = torch.cuda.Event()
            done.record(stream)
        for slot, _ in targets:
            self.ready[slot] = self.ready_up[slot] = done
        for k in staged:
            self._staging_free[k] = done

    def _copy_parts(self, targets: list[tuple[int, int]], src: torch.Tensor, arranged, parts: tuple,
                    stream) -> None:
        """``_copy_cuda``'s copies in two parts, on ``stream`` (current): the first parts, then each target's
        second part."""
        mem = self.mem.view(-1)
        first, second = parts

        def copy(slot: int, e: int, runs) -> None:
            at, start = slot * self.plan.slot_bytes, arranged.expert_start(e)
            for a, b in runs:
                mem[at + a:at + b].copy_(src[start + a:start + b], non_blocking=True)

        for slot, e in targets:
            copy(slot, e, first)
        up_done = torch.cuda.Event()
        up_done.record(stream)
        for slot, e in targets:
            copy(slot, e, second)
            done = torch.cuda.Event()
            done.record(stream)
            self.ready[slot], self.ready_up[slot] = done, up_done

    def _copy_uva(self, layer: LayerExperts, targets: list[tuple[int, int]], src: torch.Tensor,
                  arranged) -> None:
        """Every run of ``targets`` (slot, expert) by one kernel reading ``src`` (the RAM tier), on the
        current (copy) stream: a descriptor row (source, destination, bytes) per run, built on the host."""
        from airquant.engine.moe import uva_copy  # Triton: imported only where a GPU run copies this way

        rows = [(start, slot * self.plan.slot_bytes + off, end - start)
                for slot, e in targets for start, end, off in _runs(layer, arranged, e)]
        table = torch.tensor(rows, dtype=torch.int64).pin_memory()
        uva_copy.gather(src, self.mem.view(-1), table.to(self.device, non_blocking=True), max(r[2] for r in rows))

    def _fill_staging(self, layer: LayerExperts, e: int) -> int:
        if not self._staging:
            raise ExpertsError(f"layer {layer.index}'s experts are read from disk, but the plan gave the expert pool "
                               "no host staging buffer; open the engine with a plan of this run's tiers "
                               "(planner.plan, or leave the plan to Engine.open).")
        k = self._next_staging
        self._next_staging = (k + 1) % len(self._staging)
        if self._staging_free[k] is not None:
            self._staging_free[k].synchronize()  # its previous copy out has run
        buf = self._staging[k]
        for (start, end), off in zip(layer.ranges[e], layer.offsets):
            buf[off:off + end - start].copy_(read_range(layer, start, end))
        return k

    def _gather(self, layer: LayerExperts, slots: list[int]) -> dict[str, torch.Tensor]:
        """The routed experts packed into [U, ...] tensors (one device gather); the slots are free after it."""
        self._wait_ready(slots)
        # [U, slot_bytes] by one stack of the slots' rows: an index tensor made from the host list would be a
        # blocking host-to-device copy.
        rows = torch.stack([self.mem[s] for s in slots])
        self._mark_read(slots)
        out = {}
        for name, dtype, shape, off, (start, end), dense in zip(layer.names, layer.dtypes, layer.shapes,
                                                                layer.offsets, layer.ranges[0], layer.dense):
            t = rows[:, off:off + end - start].view(dtype).view(len(slots), *shape)
            out[name] = t.to(self.compute_dtype) if dense and dtype != self.compute_dtype else t
        return out

    def _guess(self, j: int, hidden: torch.Tensor) -> torch.Tensor | None:
        """Layer j's experts as its router picks them on this layer's expert input ([T, k], on the device),
        or None: too many tokens, not a routed MoE layer, or its bytes are not in host memory yet (no
        blocking read)."""
        router, layer = self.routers.get(j), self.layers.get(j)
        flat = hidden.reshape(-1, hidden.shape[-1])
        if flat.shape[0] > SPECULATE_TOKENS or router is None or layer is None or self.host_image(j)[0] is None:
            return None
        return (flat.to(router.dtype) @ router.t()).topk(min(len(layer.ranges), layer.top_k), dim=-1).indices

    def _speculate(self, j: int, guessed: list[int], keep: set[int]) -> None:
        """Start the copies of layer j's guessed experts (``_guess``, read to the host)."""
        layer = self.layers[j]
        guess = sorted(set(guessed))
        missing = [e for e in guess if self.table.lookup((layer.key, j, e)) is None]
        self.guessed[j] = set(guess)
        self.stats["guessed"] += len(guess)
        before = self.stats["bytes_copied"]
        slots: dict = {}
        self._copy_in(j, layer, missing, set(keep), slots)
        self.stats["guess_bytes"] += self.stats["bytes_copied"] - before
        for slot in slots.values():
            self.table.touch(slot)


def _runs(layer: LayerExperts, arranged, e: int, parts: tuple | None = None) -> list[tuple[int, int, int]]:
    """Expert e's copies out of host memory, (source start, source end, offset in its slot): one from an
    arranged RAM tier (``HostArrangement``; ``parts``: its image's two parts, ``layout.image_parts``), else one
    per tensor slice in the file's order."""
    if arranged is not None:
        start = arranged.expert_start(e)
        if parts is not None:
            return [(start + a, start + b, a) for a, b in (*parts[0], *parts[1])]
        return [(start, start + arranged.image_bytes, 0)]
    return [(start, end, off) for (start, end), off in zip(layer.ranges[e], layer.offsets)]


def _host_read(index: torch.Tensor, guess: torch.Tensor | None) -> tuple[list[int], list[int] | None]:
    """The call's routing ids (flat, in [T, k] order) and the speculated ids, read to the host in one copy:
    every read of device data stops the host until the compute queued before it has run."""
    flat = index.reshape(-1).long()
    if guess is None:
        return flat.tolist(), None
    both = torch.cat((flat, guess.reshape(-1).long())).tolist()
    return both[:flat.numel()], both[flat.numel():]


def packed_rows(index: torch.Tensor, num: int) -> torch.Tensor:
    """``index``'s expert ids as rows of the packed tensors (their rank among the routed experts, which the
    pool packs in id order), computed on the device: no tensor is made from host data (a blocking copy).
    An id from ``num`` up has no stored expert (LongCat-Flash's identity "zero" experts) and keeps its value,
    so the module's own forward treats it as it would unstreamed: every packed row is below ``num``."""
    stored = index < num
    present = torch.zeros(num + 1, dtype=index.dtype, device=index.device)
    present.index_fill_(0, torch.where(stored, index, num).reshape(-1), 1)
    rows = (present[:num].cumsum(0) - 1)[index.clamp(max=num - 1)]
    return torch.where(stored, rows, index)


def _no_experts(layer: LayerExperts, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Packed [0, ...] tensors: a call that routed every token to ids without stored experts."""
    return {name: torch.empty(0, *shape, dtype=dtype if dense else stored, device=device)
            for name, stored, shape, dense in zip(layer.names, layer.dtypes, layer.shapes, layer.dense)}


def routing(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The experts call's routing index: its second positional argument (every transformers 5 family),
    or the integer tensor among its keywords; None when it has none (Llama 4's dispatched tokens)."""
    if len(args) > 1:
        return args[1]
    for value in kwargs.values():
        if isinstance(value, torch.Tensor) and not value.is_floating_point():
            return value
    return None


@contextmanager
def packed_into(module, packed: dict[str, torch.Tensor], num: int):
    """The module computes from the call's packed [U, ...] tensors, and sees U experts (grouped_mm sizes
    its per-expert offsets by it, the eager loop its one_hot classes, Llama 4 its bmm batch)."""
    old = {name: swap_tensor(module, name, t) for name, t in packed.items()}
    count = getattr(module, "num_experts", None)
    if count is not None:
        module.num_experts = num
    try:
        yield
    finally:
        for name, t in old.items():
            swap_tensor(module, name, t)
        if count is not None:
            module.num_experts = count


def _with_index(args: tuple, kwargs: dict, index: torch.Tensor) -> tuple[tuple, dict]:
    if len(args) > 1:
        return (args[0], index, *args[2:]), kwargs
    key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and not v.is_floating_point())
    return args, {**kwargs, key: index}
