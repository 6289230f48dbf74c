"""The streaming state: host tiers, device slots, the copy stream and the prefetch schedule.

Each layer shard is moved as one flat byte block (the safetensors data section, read straight into
a buffer) so packed 4-bit or 2-bit layers travel exactly as stored, and one large copy runs at the
link's speed. On CUDA, copies run on a dedicated stream into pre-allocated device slots, ordered
with events: layer i+1 is in flight while layer i computes. On CPU the "device" tensors are views
into the host buffer itself.

Ordering rules (what the events guarantee):

* compute of layer i waits for the copy into its slot (``copy_done``);
* a copy into a slot waits for the compute of the layer that used the slot before (``slot_free``);
* a disk read into a staging buffer waits for the copy out of it (``staging_free``, host side).

Slots, staging buffers and the RAM tier are allocated once; the steady state allocates nothing on
the device except dtype casts of dense tensors when the compute dtype differs from the store's.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from airquant.engine.cuda_ops import CudaOps, HostMemory
from airquant.engine.memory.placement import StreamPlan
from airquant.engine.moe.layout import HostArrangement
from airquant.errors import StoreError
from airquant.store.header import read_header
from airquant.store.integrity import CHUNK_BYTES, PendingCheck, ShardChecks
from airquant.store.manifest import Manifest, integrity_fix

log = logging.getLogger(__name__)
# The RAM tier's layers on 2 MB boundaries, their pages advised huge (``HostMemory.empty(huge_pages=True)``).
# The tiered expert kernels read the RAM tier through the GPU's page tables (direct reads). A Mixtral no-cache
# step (H100, wave3_moe19, one run): the kernel read it at 42 GB/s on 4 KB pages and 47.5 on huge pages (THP
# "madvise"), the step 0.162 s against 0.146; Qwen3-30B-A3B 0.0377 s against 0.0364. What it costs: up to 2 MB of
# unpinned slack a layer. Where THP is "never" the advice is ignored and the pages stay 4 KB.
# benchmarks/moe_bench.py's ``*_4k`` cases turn it off.
HUGE_PAGES = True


@dataclass(frozen=True)
class ShardLayout:
    """Where each tensor sits inside a shard's data section."""

    path: Path
    data_offset: int
    nbytes: int
    tensors: tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...]  # name, dtype, shape, start, end

    @property
    def aligned(self) -> bool:
        """Whether every tensor starts at a multiple of its element size (``views`` then copies none)."""
        return all(start % dtype.itemsize == 0 for _, dtype, _, start, _ in self.tensors)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, dtype, shape, start, end in self.tensors:
            raw = flat[start:end]
            if start % dtype.itemsize:  # safetensors sorts by alignment, so this is rare
                raw = raw.clone()
            out[name] = raw.view(dtype).view(shape)
        return out

    def without(self, names: set[str]) -> tuple["ShardLayout", "ShardLayout", tuple[tuple[int, int, int], ...]]:
        """The layout less ``names`` (a MoE layer's experts, moved by ``engine.experts``): (in place, at the
        same offsets; packed, as copied into a slot; the copy runs (source start, slot start, bytes))."""
        kept = [t for t in self.tensors if t[0] not in names]
        runs: list[list[int]] = []
        packed = []
        for name, dtype, shape, start, end in kept:
            if runs and start - (runs[-1][0] + runs[-1][2]) <= 64:  # alignment padding: copied along
                runs[-1][2] = end - runs[-1][0]
            else:
                runs.append([start, (runs[-1][1] + runs[-1][2] + 63) // 64 * 64 if runs else 0, end - start])
            shift = runs[-1][0] - runs[-1][1]
            packed.append((name, dtype, shape, start - shift, end - shift))
        nbytes = runs[-1][1] + runs[-1][2] if runs else 0
        in_place = ShardLayout(self.path, self.data_offset, self.nbytes, tuple(kept))
        return in_place, ShardLayout(self.path, self.data_offset, nbytes, tuple(packed)), \
            tuple(tuple(r) for r in runs)


def read_layout(path: Path) -> ShardLayout:
    header = read_header(path)
    return ShardLayout(path=path, data_offset=header.data_offset, nbytes=header.nbytes, tensors=header.tensors)


def read_into(layout: ShardLayout, flat: torch.Tensor, check: PendingCheck | None = None) -> None:
    """Read a shard's data section into the first ``layout.nbytes`` of a uint8 buffer.

    ``check`` hashes each chunk (on its own thread) while the next one is read, and raises
    ``ChecksumError`` before the bytes are used when they do not match the manifest."""
    view = memoryview(flat.numpy()).cast("B")[: layout.nbytes]
    with open(layout.path, "rb", buffering=0) as f:
        f.seek(layout.data_offset)
        got = 0
        while got < layout.nbytes:
            n = f.readinto(view[got:got + CHUNK_BYTES])
            if not n:
                raise StoreError(f"shard {layout.path} is truncated ({got} of {layout.nbytes} data bytes); "
                                 "re-run `airquant shard` on this store.")
            if check is not None:
                check.update(view[got:got + n])
            got += n
    if check is not None:
        check.finish()


@dataclass
class _InFlight:
    slot: int  # device slot (-1: used in place from host memory)
    done: object = None  # copy finished (event)
    started: object = None  # copy started (timing event, profiling only)
    in_use: bool = False  # fetched, not yet released
    staging: int | None = None  # staging buffer used in place (CPU, disk tier)


class LayerStreamer:
    """Owns every buffer, stream, event and read-ahead future used to bring layers to the device.

    ``ops`` is the device backend: ``CudaOps`` on CUDA; None on CPU, where layers are used in place
    from host memory. A profile of per-layer copy and compute times is kept when ``profile`` is set
    (CUDA timing events; read it after a synchronize).
    """

    def __init__(self, store: Path, manifest: Manifest, plan: StreamPlan, device: torch.device,
                 compute_dtype: torch.dtype, readahead: int = 2, ops=None, profile: bool = False,
                 verify_reads: bool = True, skip: dict[int, set[str]] | None = None):
        self.device, self.compute_dtype, self.plan = device, compute_dtype, plan
        self.n = manifest.num_layers
        entries = [manifest.shards[f"layer.{i}"] for i in range(self.n)]
        self.layouts = [read_layout(store / e.file) for e in entries]
        # ``skip``: per layer, tensors not moved with the layer (routed experts, engine.experts moves them).
        whole = [(lay, lay, ((0, 0, lay.nbytes),)) for lay in self.layouts]
        self.parts = [lay.without(skip[i]) if skip and skip.get(i) else whole[i] for i, lay in enumerate(self.layouts)]
        # RAM-tier layers whose experts stay behind are arranged after their checked read (moe/layout.py), so
        # the layer copy and each expert's copy are one range each: a RAM-tier buffer of such a layer is
        # arranged from the moment it is in ``_host`` (``arranged``).
        self.arrangements = {i: HostArrangement.of(lay.nbytes, self.parts[i][2], self.parts[i][1].nbytes,
                                                   entries[i].experts["ranges"])
                             for i, lay in enumerate(self.layouts)
                             if skip and skip.get(i) and entries[i].experts and plan.tiers[i] == "ram"
                             and skip[i] == set(entries[i].experts["tensors"])}
        # Disk-tier reads are checked every time, RAM-tier and resident layers once (their first read).
        self.checks = ShardChecks({i: (store / e.file, e.checksum) for i, e in enumerate(entries)},
                                  integrity_fix(store, manifest)) if verify_reads else None
        self.dense_names = [{k for k, m in e.tensors.items() if m.get("scheme", "dense") == "dense"} for e in entries]
        if ops is None and device.type == "cuda":
            ops = CudaOps(device, timing=profile)
        self.ops = ops
        self.memory = HostMemory(pinned=device.type == "cuda")
        self.bytes_copied = 0
        # Routed MoE layers whose dense part stays on the device (plan.dense_layers, on a GPU): copied once from the
        # RAM tier at their first fetch, then used in place like a resident layer; their experts stay in the tier.
        # RAM-tier layers only (as the planner picks them): a disk-tier layer is read through staging every pass.
        self.dense = {i for i in plan.dense_layers if plan.tiers[i] == "ram"} if ops is not None else set()
        self._dense: dict[int, dict[str, torch.Tensor]] = {}
        # Layers a pass copies through the device slots.
        self.streamed = [i for i in range(self.n) if plan.tiers[i] != "vram" and i not in self.dense]
        size = max((lay.nbytes for lay in self.layouts), default=0)
        slot_size = max((self.parts[i][1].nbytes for i in self.streamed), default=0)
        self._host: dict[int, torch.Tensor] = {}  # RAM tier, filled once (read-ahead thread) on first use
        self._vram: dict[int, dict[str, torch.Tensor]] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="airquant-read")
        self._readahead = max(1, readahead)
        self._reads: dict[int, tuple[Future, int | None]] = {}  # layer -> (read future, staging index)
        n_staging = self._readahead + 1 if plan.disk_layers else 0
        self._staging = [self._host_buffer(size) for _ in range(n_staging)]
        self._staging_owner: list[int | None] = [None] * n_staging  # layer whose bytes it holds or awaits
        self._staging_free: list[object] = [None] * n_staging  # event: the copy out of it has run
        self._slots = [ops.alloc(slot_size) for _ in range(max(plan.slots, 1))] if ops is not None and self.streamed else []
        self._slot_free: list[object] = [None] * len(self._slots)  # event: compute on its last layer done
        self._slot_order: deque[int] = deque(range(len(self._slots)))  # least recently used first
        self._inflight: dict[int, _InFlight] = {}
        self.profile: list[tuple[int, object, object, object, object]] = []  # layer, copy start/end, compute start/end
        self._profiling = profile and ops is not None
        self._compute_start: dict[int, object] = {}
        # (layer, its layout, buffer address) -> the layer's tensors as views of that buffer (device slot, RAM tier, staging):
        # made once, as the buffers live as long as the streamer (24 slices and views a Qwen3-MoE layer were
        # ~0.35 ms of a batch-1 step's host time per layer, under the profiler)
        self._views: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
        self._cast_needed: dict[tuple[int, int], bool] = {}  # (layer, tensors) -> whether _cast casts any
        self._orders()

    def _host_buffer(self, nbytes: int, pinned: bool | None = None, huge_pages: bool = False) -> torch.Tensor:
        # Page-locked memory is what lets host->device copies run at the link's full speed.
        return self.memory.empty(nbytes, pinned, huge_pages)

    # -- host side -------------------------------------------------------------------------
    def _host_flat(self, i: int) -> tuple[torch.Tensor, int | None]:
        """The layer's bytes in host memory, and the staging index holding them (disk tier)."""
        if i in self._host:
            self._reads.pop(i, None)  # a finished first read of a RAM-tier layer
            return self._host[i], None
        self._schedule_reads(i)
        if i not in self._reads:  # every staging buffer holds a layer read ahead: drop the oldest
            self._drop_oldest_read(keep=i)
            self._schedule_reads(i)
        future, k = self._reads.pop(i)
        future.result()
        if k is None:
            return self._host[i], None
        return self._staging[k], k

    def _schedule_reads(self, i: int) -> None:
        """Start reads for the next ``readahead`` streamed layers from ``i`` whose bytes are not in RAM."""
        if self._ram_only and len(self._host) == self._ram_count:  # the RAM tier is full: nothing is ever read again
            return
        wanted = [j for j in self._order[i] if j not in self._host]
        for j in wanted[: self._readahead]:
            if j in self._reads:
                continue
            if self.plan.tiers[j] == "ram":
                self._reads[j] = (self._pool.submit(self._read_ram, j), None)
                continue
            k = next((k for k, owner in enumerate(self._staging_owner) if owner is None), None)
            if k is None:
                return
            self._staging_owner[k] = j
            self._reads[j] = (self._pool.submit(self._read_staging, j, k, self._staging_free[k]), k)

    def _read_ram(self, j: int) -> None:
        arrangement = self.arrangements.get(j)
        buf = self._host_buffer(arrangement.nbytes if arrangement is not None else self.layouts[j].nbytes,
                                huge_pages=HUGE_PAGES)
        read_into(self.layouts[j], buf, self._check(j))
        if arrangement is not None:
            arrangement.arrange(buf)
        self._host[j] = buf

    def _read_staging(self, j: int, k: int, free_event) -> None:
        if free_event is not None:
            self.ops.host_wait(free_event)
        read_into(self.layouts[j], self._staging[k], self._check(j))

    def _check(self, j: int) -> PendingCheck | None:
        lay = self.layouts[j]
        return self.checks.begin(j, lay.data_offset, lay.nbytes) if self.checks is not None else None

    def _drop_oldest_read(self, keep: int) -> None:
        for j, (future, k) in list(self._reads.items()):
            if j != keep and k is not None:
                future.exception()  # wait; a failed read ahead is read again when needed
                del self._reads[j]
                self._staging_owner[k] = None
                return

    def _host_ready(self, j: int) -> bool:
        """Whether layer j's bytes are in host memory now (a copy issued for it would not block)."""
        if j in self._host:
            return True
        read = self._reads.get(j)
        return read is not None and read[0].done()

    def _cycle_from(self, i: int) -> list[int]:
        return [(i + d) % self.n for d in range(self.n)]

    def _orders(self) -> None:
        """Per layer i, the layers after it in pass order (i first, wrapping around) that leave VRAM (``_order``),
        and those of them that go through the slots (``_upcoming``, i left out): fixed for the streamer's life, and
        looked up at every layer call instead of rebuilt (two scans of every layer a call)."""
        self._order = [[j for j in self._cycle_from(i) if self.plan.tiers[j] != "vram"] for i in range(self.n)]
        self._upcoming = [[j for j in self._cycle_from(i)[1:] if self.plan.tiers[j] != "vram" and j not in self.dense]
                          for i in range(self.n)]
        self._ram_only = not any(t == "disk" for t in self.plan.tiers)
        self._ram_count = sum(t == "ram" for t in self.plan.tiers)

    # -- device side -----------------------------------------------------------------------
    def fetch(self, i: int) -> dict[str, torch.Tensor]:
        """Tensors of layer i on the compute device, valid until ``release(i)``."""
        if self.plan.tiers[i] == "vram":
            tensors = self._resident(i)
        elif i in self.dense:
            tensors = self._dense_part(i)
        elif self.ops is None:
            flat, k = self._host_flat(i)
            self._inflight[i] = _InFlight(slot=-1, in_use=True, staging=k)
            in_place = self.parts[i][1] if k is None and i in self.arrangements else self.parts[i][0]
            tensors = self._cast(i, self._views_of(i, in_place, flat))
        else:
            if i not in self._inflight:
                self._issue_copy(i)
            entry = self._inflight[i]
            entry.in_use = True
            self.ops.wait(entry.done)
            if self._profiling:
                self._compute_start[i] = self.ops.mark()
            tensors = self._cast(i, self._views_of(i, self.parts[i][1], self._slots[entry.slot]))
        self._prefetch_after(i)
        return tensors

    def fixed(self, i: int) -> bool:
        """Whether layer i's weights stay where they are from one call to the next, nothing copied or read into
        them before a call: resident, a dense part kept on the device, or (no copy engine: the CPU) used in place
        from the RAM tier. A pass graph (engine/layer_graphs) runs such layers' calls ahead of their fetch."""
        tier = self.plan.tiers[i]
        return tier == "vram" or i in self.dense or (self.ops is None and i in self._host and tier == "ram")

    def release(self, i: int) -> None:
        """Layer i's compute is enqueued (or it raised): its slot may be refilled after it."""
        entry = self._inflight.get(i)
        if entry is None or not entry.in_use:
            return
        del self._inflight[i]
        if self.ops is None:
            if entry.staging is not None:  # the layer was used in place from this staging buffer
                self._staging_owner[entry.staging] = None
            return
        free = self.ops.mark()
        self._slot_free[entry.slot] = free
        if self._profiling:
            self.profile.append((i, entry.started, entry.done, self._compute_start.pop(i), free))

    def reset(self) -> None:
        """Forget prefetches after an interrupted forward (an OOM, an exception in a layer).

        Copies already queued still run in stream order, and every later copy into a slot waits for
        the compute that used it, so dropping the bookkeeping is enough.
        """
        for i in [i for i, e in self._inflight.items() if not e.in_use]:
            del self._inflight[i]
        for j, (future, k) in list(self._reads.items()):
            future.exception()  # wait for the read; a failed one is read again when needed
            del self._reads[j]
            if k is not None:
                self._staging_owner[k] = None

    @property
    def arranged(self) -> set[int]:
        """The layers whose RAM-tier bytes are in memory, arranged (``arrangements``)."""
        return {i for i in self._host if i in self.arrangements}

    def host_image(self, i: int) -> tuple[torch.Tensor | None, HostArrangement | None]:
        """``host_bytes(i)``, and the arrangement its bytes are in (None: the file's order)."""
        flat = self.host_bytes(i)
        in_tier = flat is not None and self._host.get(i) is flat
        return flat, self.arrangements.get(i) if in_tier else None

    def host_bytes(self, i: int) -> torch.Tensor | None:
        """Layer i's data section in host memory now (RAM tier, or a staging buffer in use in place on
        CPU), or None: its bytes are on disk only."""
        if i in self._host:
            return self._host[i]
        entry = self._inflight.get(i)
        return self._staging[entry.staging] if entry is not None and entry.staging is not None else None

    def _resident(self, i: int) -> dict[str, torch.Tensor]:
        if i not in self._vram:
            flat = self._host_buffer(self.layouts[i].nbytes, pinned=False)
            read_into(self.layouts[i], flat, self._check(i))
            self._vram[i] = self._cast(i, self.layouts[i].views(flat.to(self.device)))
        return self._vram[i]

    def _dense_part(self, i: int) -> dict[str, torch.Tensor]:
        """Layer i's dense part on the device (``dense``): copied from the RAM tier at the first fetch, kept after."""
        tensors = self._dense.get(i)
        if tensors is None:
            flat, _ = self._host_flat(i)  # the RAM tier (``dense`` holds RAM-tier layers only): no staging buffer
            layout = self.parts[i][1]
            buf = self.ops.copy_target(flat[:layout.nbytes])  # never memory that queued compute still reads
            runs = ((0, 0, layout.nbytes),) if i in self.arrangements else self.parts[i][2]
            for src, dst, nbytes in runs:
                _, done = self.ops.copy(buf[dst:dst + nbytes], flat[src:src + nbytes], None)
            self.ops.wait(done)
            self.bytes_copied += layout.nbytes
            tensors = self._dense[i] = self._cast(i, self._views_of(i, layout, buf))
        return tensors

    def dense_bytes(self) -> int:
        """Device bytes of the dense parts kept (``dense``) so far: each is copied at its layer's first fetch."""
        return sum(self.parts[i][1].nbytes for i in self._dense)

    def _prefetch_after(self, i: int) -> None:
        if not self.streamed:
            return
        upcoming = self._upcoming[i]
        if upcoming:
            self._schedule_reads(upcoming[0])
        if self.ops is not None:
            # Only layers whose bytes are already in host memory: waiting here for a disk read would
            # hold back the launch of layer i's compute. The others are copied at their fetch.
            for j in upcoming[: len(self._slots) - 1]:
                if j in self._inflight:
                    continue
                if not self._host_ready(j) or not self._issue_copy(j, prefetch=True):
                    break

    def _free_slot(self, prefetch: bool) -> int | None:
        held = {e.slot for e in self._inflight.values()}
        for slot in self._slot_order:
            if slot not in held:
                return slot
        if prefetch:
            return None
        # Every slot holds a layer prefetched for a forward that was cut short: take the stalest one
        # that is not being computed with. The copy stream is in order, so reusing it is safe.
        for j, e in list(self._inflight.items()):
            if not e.in_use:
                del self._inflight[j]
                return e.slot
        raise AssertionError("every device slot is held by a layer still in use; release() was skipped")

    def _issue_copy(self, i: int, prefetch: bool = False) -> bool:
        slot = self._free_slot(prefetch)
        if slot is None:
            return False
        self._slot_order.remove(slot)
        self._slot_order.append(slot)
        flat, k = self._host_flat(i)
        started = None
        runs = ((0, 0, self.parts[i][1].nbytes),) if k is None and i in self.arrangements else self.parts[i][2]
        for n, (src, dst, nbytes) in enumerate(runs):  # one run unless experts stay behind, unarranged
            first, done = self.ops.copy(self._slots[slot][dst:dst + nbytes], flat[src:src + nbytes],
                                        self._slot_free[slot] if n == 0 else None)
            started = first if n == 0 else started
        nbytes = sum(run[2] for run in runs)
        if k is not None:  # the read thread may refill this staging buffer once the copy has run
            self._staging_free[k] = done
            self._staging_owner[k] = None
        self._inflight[i] = _InFlight(slot=slot, done=done, started=started)
        self.bytes_copied += nbytes
        return True

    def _views_of(self, i: int, layout: ShardLayout, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Layer i's tensors in ``flat`` by ``layout``: the same views each time the layer is in that buffer. A layout
        with a misaligned tensor (copied out of the bytes, ``ShardLayout.views``) makes them again each time."""
        key = (i, id(layout), flat.data_ptr())
        views = self._views.get(key)
        if views is None:
            views = layout.views(flat)
            if layout.aligned:
                self._views[key] = views
        return views

    def _cast(self, i: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The dense floating tensors in the compute dtype; ``tensors`` itself (the same dict as the last time the
        layer was in that buffer: ``_views_of``) where none needs it, so that a layer graph's key finds its
        weights unchanged without reading every tensor's address again."""
        dense, dtype = self.dense_names[i], self.compute_dtype
        key = (i, len(tensors))  # the layer's stored dtypes, per layout (whole, or less its experts)
        needed = self._cast_needed.get(key)
        if needed is None:
            needed = self._cast_needed[key] = any(k in dense and v.is_floating_point() and v.dtype != dtype
                                                for k, v in tensors.items())
        if not needed:
            return tensors
        return {k: (v.to(dtype) if k in dense and v.is_floating_point() and v.dtype != dtype else v)
                for k, v in tensors.items()}

    # -- reporting -------------------------------------------------------------------------
    def host_held(self, others: dict[str, int] | None = None) -> dict[str, int]:
        """Host bytes held now: the RAM tier, the staging buffers, ``others`` (buffers other owners hold in
        host memory: an offloaded KV cache, a routed run's expert staging), other pinned buffers and what
        torch's pinned allocator rounded up (a failed registration)."""
        parts = {"ram_tier": sum(b.numel() for b in self._host.values()),
                 "staging": sum(b.numel() for b in self._staging), **(others or {})}
        pinned = self.memory.pinned_bytes()
        other = pinned["registered"] + pinned["allocator"] - pinned["rounding"] - sum(parts.values())
        return {**parts, "other_pinned": max(other, 0) if self.memory.pinned else 0,
                "pinned_rounding": pinned["rounding"]}

    def take_profile(self) -> list[dict]:
        """Per-layer copy and compute milliseconds recorded since the last call (after a synchronize)."""
        rows = []
        for i, c0, c1, k0, k1 in self.profile:
            copy_ms = self.ops.elapsed_ms(c0, c1) if c0 is not None else float("nan")
            rows.append({"layer": i, "bytes": self.layouts[i].nbytes, "copy_ms": copy_ms,
                         "compute_ms": self.ops.elapsed_ms(k0, k1)})
        self.profile.clear()
        return rows

    def close(self) -> None:
        """Stop the read thread and unpin host memory (after the device has finished with it)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self.checks is not None:
            self.checks.close()
        if self.ops is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._views.clear()
        self._dense.clear()
        self.memory.close()
