"""The decode loop's TurboQuant cache: one slot-batched arena per layer, decode tokens handled in one batch.

Per layer, every slot's state lives in shared tensors with the slot as the batch dimension:
  ``win_k`` / ``win_v``   ``[slots, Hkv, sink + window + block - 1, D]``: the exact tokens (sink + recent)
  ``k_codes`` ... ``v_norms``  ``[pages, Hkv, PAGE_TOKENS, ...]``: the packed histories, in pages; each slot
      holds the pages of its own length (``pages[slot]``, ``table()``), returned to the pool when it ends
  ``k_mean`` ... ``v_ref``  ``[slots, Hkv, 1(, D)]``: the per-slot statistics fixed at its first flush
A decode pass then costs per layer one write of the new tokens, a few attention calls (one per bucket of
decode tokens whose histories have about the same length: each reads its slots' pages, padded only to the
bucket's longest, never to the longest slot's) and, every ``block`` steps of a slot, one batched flush: not
one ``TQLayer.update`` and one attention call per slot (measured on an H200 at batch 32: 91 decode tok/s
through ~1000 small per-slot calls per step, against 505 with one batched cache).

Every slot goes through exactly what a batch-1 ``TQLayer`` fed one prompt then one token per step goes
through (same flush points, same calibration tokens, same codes), so greedy outputs equal one-at-a-time
decoding. Why the flush is uniform: a slot flushes in a decode step only when its movable count reaches a
multiple of ``block``; its window then holds ``sink + window - 1 + block`` tokens and ``block`` leave, so
every slot flushing in a pass moves the same tokens of its window (only the history offsets differ).

Lengths are the same in every layer (one schedule), so a pass's masks and index tensors are built once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from airquant.kv.cache import CompressedContext, layer_codecs
from airquant.kv.codec import NORM_DTYPE, Encoded
from airquant.kv.config import KVConfig
from airquant.kv.paging import SPLIT_QUANTUM, Paged
from airquant.kv.rotation import to_device
from airquant.kv.store import History, statistics

__all__ = ["PAGE_TOKENS", "Bucket", "DecodePlan", "SlotArena", "decode_plan", "keep_columns", "table_width"]


# Tokens per history page: a multiple of the Triton kernel's splits (kv.paging.SPLIT_QUANTUM), and small
# enough that a slot's unused tail (< one page per layer) stays small next to its history.
PAGE_TOKENS = 64
assert PAGE_TOKENS % SPLIT_QUANTUM == 0  # the kernel reads the pages in place, a split never straddles one


@dataclass(frozen=True)
class Bucket:
    """Decode tokens whose histories have about the same length (page counts in one power-of-two range):
    attended together, each bucket padded only to its own longest history."""

    rows: torch.Tensor  # indices into the pass's decode tokens
    slots: torch.Tensor  # their slots
    hist_len: int
    keep: torch.Tensor  # [n, 1, 1, Wmax + hist_len]: columns [sink | history | recent] each token attends
    whole: bool = False  # rows are every decode token of the pass, in order (no gather, no scatter)


@dataclass(frozen=True)
class DecodePlan:
    """The decode tokens of one pass, as every layer's arena reads them (built once per pass).

    ``slots``/``offsets``/``write``: slot, offset in the packed row and window position of each decode
    token; ``buckets``: the tokens grouped by history length (``Bucket``); ``flush``/``flush_at``: slots that
    move ``block`` tokens to their history after the attention, and where in the history they go;
    ``calibrate``: those of them flushing for the first time."""

    slots: torch.Tensor
    offsets: torch.Tensor
    write: torch.Tensor
    buckets: tuple[Bucket, ...]
    win_len: int  # Wmax
    hist_len: int  # Hmax
    flush: torch.Tensor | None
    flush_at: torch.Tensor | None
    calibrate: torch.Tensor | None
    packed: bool = False  # the decode tokens are the packed row's first ones, in order (offsets 0 .. n - 1)
    # Every decode token at once for the Triton kernel (``buckets`` asked, some history): the rows' own history
    # lengths ``hist`` [n] and the columns each attends, at Hmax (``keep_columns``); one launch, each row reading
    # only its own pages (``Paged.lengths``), where the buckets take a launch each
    rows: Bucket | None = None
    hist: torch.Tensor | None = None


def on_device(values, device, dtype=torch.long) -> torch.Tensor:
    """A small host list (or CPU tensor) on ``device`` without waiting for the GPU: ``torch.tensor(..., device=
    cuda)`` copies from pageable memory and synchronizes the stream, which per layer keeps the host from queueing
    ahead of the GPU (the TurboQuant arena's page table is rebuilt in every layer of a pass that adds pages)."""
    return to_device(values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype), device)


def decode_plan(kv: KVConfig, slots: int, decode: list[tuple[int, int, int]], device,
                buckets: bool = True) -> DecodePlan:
    """``decode``: (slot, start, offset) of each decode token (``start`` tokens already cached); ``buckets``
    False: none (a static pass attends every row at once, ``SlotKV``)."""
    sched = kv.schedule
    hist = [sched.quantized_count(start) for _, start, _ in decode]
    win = [start + 1 - h for (_, start, _), h in zip(decode, hist)]  # the new token included
    w_max = max(win)
    moving = [(slot, h) for (slot, start, _), h in zip(decode, hist) if sched.quantized_count(start + 1) > h]

    def tensor(values):
        return on_device(values, device)

    slots = tensor([d[0] for d in decode])
    rows = None
    if buckets and max(hist):
        keep = keep_columns(torch.tensor(hist)[:, None], torch.tensor(win)[:, None], min(kv.sink, w_max), w_max,
                            max(hist))
        rows = Bucket(tensor(range(len(decode))), slots, max(hist), on_device(keep, device), whole=True)
    return DecodePlan(
        slots=slots, offsets=tensor([d[2] for d in decode]),
        write=tensor([w - 1 for w in win]),
        buckets=_buckets(kv, [d[0] for d in decode], hist, win, w_max, device) if buckets else (),
        win_len=w_max,
        hist_len=max(hist), flush=tensor([m[0] for m in moving]) if moving else None,
        flush_at=tensor([m[1] for m in moving]) if moving else None,
        calibrate=tensor([m[0] for m in moving if m[1] == 0]) if any(m[1] == 0 for m in moving) else None,
        packed=[d[2] for d in decode] == list(range(len(decode))), rows=rows,
        hist=tensor(hist) if rows is not None else None)


def _buckets(kv: KVConfig, slots: list[int], hist: list[int], win: list[int], w_max: int,
             device) -> tuple[Bucket, ...]:
    """The decode tokens grouped by the power of two above their history's page count: every bucket reads
    at most twice its histories' pages, a few calls per layer (log2 of the longest history's pages)."""
    groups: dict[int, list[int]] = {}
    for n, h in enumerate(hist):
        pages = -(-h // PAGE_TOKENS)
        groups.setdefault(1 << (pages - 1).bit_length() if pages else 0, []).append(n)
    sink = min(kv.sink, w_max)
    out = []
    for _, rows in sorted(groups.items()):
        h_max = max(hist[n] for n in rows)
        keep = keep_columns(torch.tensor([hist[n] for n in rows])[:, None], torch.tensor([win[n] for n in rows])[:, None],
                            sink, w_max, h_max)
        out.append(Bucket(on_device(rows, device), on_device([slots[n] for n in rows], device), h_max,
                          on_device(keep, device), whole=rows == list(range(len(hist)))))
    return tuple(out)


def table_width(kv: KVConfig, cap: int) -> int:
    """Pages of a full slot of ``cap`` tokens: the width of a fixed page table."""
    return max(1, -(-kv.schedule.quantized_count(cap) // PAGE_TOKENS))


def keep_columns(hist: torch.Tensor, win: torch.Tensor, sink: int, width: int, hist_len: int) -> torch.Tensor:
    """``[n, 1, 1, width + hist_len]``: the columns each decode row attends, laid out [sink | history | recent],
    from its history and window lengths ``hist``/``win`` (``[n, 1]``, on any device: a static pass builds it on
    the GPU from its device tensors), every window ``width`` columns wide and every history ``hist_len``."""
    cols = torch.arange(width + hist_len, device=hist.device)[None, :]
    keep = (cols < win.clamp(max=sink)) | ((cols >= sink) & (cols < sink + hist)) | \
        ((cols >= sink + hist_len) & (cols < hist_len + win))
    return keep[:, None, None, :]


class SlotArena:
    """One layer's TurboQuant cache for every slot of the loop (see the module docstring)."""

    def __init__(self, kv: KVConfig, layer_idx: int, slots: int, kv_heads: int, head_dim: int, device, dtype,
                 cap: int | None = None, pool_pages: int = 0, table: torch.Tensor | None = None):
        self.kv, self.slots, self.heads, self.dim = kv, slots, kv_heads, head_dim
        self.k_codec, self.v_codec = layer_codecs(kv, layer_idx, head_dim)
        for codec in (self.k_codec, self.v_codec):  # uploaded now, not by a later pass's first flush or history read
            codec.preload(device, (dtype, torch.float32))  # inside its layer (a copy waiting behind weight copies)
        self.device = device
        self.win_cap = kv.sink + kv.window + kv.block - 1
        zeros = torch.zeros
        self.t: dict[str, torch.Tensor] = {
            "win_k": zeros(slots, kv_heads, self.win_cap, head_dim, dtype=dtype, device=device),
            "win_v": zeros(slots, kv_heads, self.win_cap, head_dim, dtype=dtype, device=device),
        }
        # ``pool_pages``: the pool allocated at once (what the plan's reserve holds), so that the pages a ramp of
        # admissions takes never regrow it; past them it grows by an eighth (``reserve``).
        self.t.update(self._pages(pool_pages))
        self.pages: list[list[int]] = [[] for _ in range(slots)]  # each slot's history pages, in order
        self._room = [0] * slots  # history tokens each slot's pages hold
        self._free: list[int] = list(range(pool_pages - 1, -1, -1))  # popped lowest first
        self.grown = 0  # times the pool was regrown (each a new allocation and a copy of every page)
        self.home: dict[str, torch.Tensor] | None = None  # an offloaded arena's kept host image (``offload_via``)
        self._table: torch.Tensor | None = None  # [slots, most pages] on the device; None: rebuild
        # ``cap`` (tokens a slot holds): the page table is one tensor as wide as a full slot, rewritten in place, so
        # a graph that read it reads the next pass's pages at the same address (static passes, ``SlotKV``);
        # ``table``: that tensor, given (``table_width`` wide): a view of every layer's tables, which ``SlotKV``
        # uploads in one copy a pass (``table_rows``, ``table_uploaded``)
        self._fixed = None
        if cap:
            self._fixed = table if table is not None else \
                torch.zeros(slots, table_width(kv, cap), dtype=torch.long, device=device)
        for name, center in (("k_mean", kv.center_k), ("v_mean", kv.center_v)):
            if center:
                self.t[name] = zeros(slots, kv_heads, 1, head_dim, device=device)
        if kv.norm_bits == 8:
            self.t["k_ref"] = zeros(slots, kv_heads, 1, device=device)
            self.t["v_ref"] = zeros(slots, kv_heads, 1, device=device)

    def _pages(self, count: int, device=None) -> dict[str, torch.Tensor]:
        """``count`` history pages ``[pages, Hkv, PAGE_TOKENS, ...]`` (codes and norms of keys and values)."""
        device = torch.device(device or self.device)
        norm = NORM_DTYPE if self.kv.norm_bits == 16 else torch.uint8
        shape = (count, self.heads, PAGE_TOKENS)
        # an offloaded arena grown in host memory: pinned, so that its copies to the GPU stay asynchronous
        kw = {"device": device, "pin_memory": device.type == "cpu" and self.pin_host}
        return {"k_codes": torch.zeros(*shape, self.k_codec.width, dtype=torch.uint8, **kw),
                "k_norms": torch.zeros(shape, dtype=norm, **kw),
                "v_codes": torch.zeros(*shape, self.v_codec.width, dtype=torch.uint8, **kw),
                "v_norms": torch.zeros(shape, dtype=norm, **kw)}

    @property
    def pin_host(self) -> bool:
        """Host copies of this arena (an offloaded one's) are pinned: the arena lives on a GPU."""
        return torch.device(self.device).type == "cuda"

    @property
    def pool_pages(self) -> int:
        return self.t["k_codes"].shape[0]

    def reserve(self, slot: int, tokens: int) -> None:
        """Pages for ``tokens`` history tokens of ``slot`` (its own length: no slot is padded to another's)."""
        missing = -(-tokens // PAGE_TOKENS) - len(self.pages[slot])
        if missing <= 0:
            return
        if len(self._free) < missing:
            # Grown by an eighth at least: amortized O(1) copies, at most 1/8 of the pages unused.
            self._grow(max(missing - len(self._free), -(-self.pool_pages // 8)))
        self.pages[slot] += [self._free.pop() for _ in range(missing)]
        self._room[slot] = len(self.pages[slot]) * PAGE_TOKENS
        self._table = None

    def reserve_all(self, targets: list[tuple[int, int]]) -> None:
        """``reserve`` for each (slot, tokens) of a pass; a slot its pages already hold costs one comparison (a
        pass of 99 slots called ``reserve`` 99 times a layer: ~0.25 ms of host time a layer on this repo's CPU)."""
        room = self._room
        for slot, tokens in targets:
            if tokens > room[slot]:
                self.reserve(slot, tokens)

    def _grow(self, count: int) -> None:
        old, used = self.pool_pages, self.t["k_codes"].device
        grown = self._pages(old + count, used)
        for name, t in grown.items():
            t[:old] = self.t[name]
        self.t.update(grown)
        self._free += range(old + count - 1, old - 1, -1)  # popped lowest first
        self.grown += 1

    def release(self, slot: int) -> None:
        """A finished sequence's pages go back to the pool (the next sequence in the slot takes its own)."""
        self._free += reversed(self.pages[slot])
        self.pages[slot] = []
        self._room[slot] = 0
        self._table = None

    def table(self) -> torch.Tensor:
        """``[slots, pages]``: page of each slot's j-th ``PAGE_TOKENS`` history tokens (0 past its end); as wide
        as the most pages a slot holds, or (``cap``) a full slot's, the same tensor rewritten in place."""
        if self._table is None:
            fixed = self._fixed if self.fits_table() else None
            rows = self.table_rows(fixed.shape[1] if fixed is not None else max(1, max(map(len, self.pages))))
            if fixed is not None:
                cuda = fixed.device.type == "cuda"
                fixed.copy_(rows.pin_memory() if cuda else rows, non_blocking=cuda)
                self._table = fixed
            else:
                self._table = on_device(rows, self.device)
        return self._table

    @property
    def table_stale(self) -> bool:
        """Pages were reserved or released since the table was last written."""
        return self._table is None

    def fits_table(self) -> bool:
        """Whether every slot's pages fit the fixed-width table (``cap``; always, unless a slot outgrew it)."""
        return self._fixed is not None and max(map(len, self.pages)) <= self._fixed.shape[1]

    def table_rows(self, width: int) -> torch.Tensor:
        """The page table on the host, ``[slots, width]`` (long)."""
        return torch.tensor([p + [0] * (width - len(p)) for p in self.pages], dtype=torch.long)

    @property
    def fixed_table(self) -> torch.Tensor | None:
        """The fixed-width table on the device (``cap``), or None."""
        return self._fixed

    @property
    def table_capacity(self) -> int:
        """Pages a slot's row of the fixed-width table holds (0 without one)."""
        return self._fixed.shape[1] if self._fixed is not None else 0

    def table_uploaded(self) -> None:
        """The caller wrote ``table_rows`` into the fixed-width table (``SlotKV``'s one upload a pass)."""
        self._table = self._fixed

    def static_key(self) -> tuple:
        """The addresses a static pass's graph reads here (windows, page pools, statistics, page table)."""
        return (*(self.t[name].data_ptr() for name in sorted(self.t)), self.table().data_ptr(), self.win_cap)

    def _stat(self, name: str, rows) -> torch.Tensor | None:
        t = self.t.get(name)
        return None if t is None else t[rows]

    # -- writes ---------------------------------------------------------------------------------
    def prefill(self, slot: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A whole prompt ``[1, Hkv, n, D]`` into an empty slot, as ``TQLayer.update`` does with it."""
        n, sink = keys.shape[2], self.kv.sink
        target = self.kv.schedule.quantized_count(n)
        if target:
            self._calibrate(slice(slot, slot + 1), keys[:, :, sink:], values[:, :, sink:])
            # both made on the device: a copy from the host inside a layer waits behind the layer copies
            at = torch.zeros(1, dtype=torch.long, device=keys.device)
            row = torch.full((1,), slot, dtype=torch.long, device=keys.device)
            self._append(row, keys[:, :, sink: sink + target],
                         values[:, :, sink: sink + target], at=at)
        for name, x in (("win_k", keys), ("win_v", values)):
            kept = torch.cat([x[0, :, :sink], x[0, :, sink + target:]], dim=1)
            self.t[name][slot, :, : kept.shape[1]] = kept.to(self.t[name].dtype)

    def write_decode(self, plan: DecodePlan, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The decode tokens of the packed row ``[1, Hkv, T, D]`` at the end of their slots' windows."""
        for name, x in (("win_k", keys), ("win_v", values)):
            self.t[name][plan.slots, :, plan.write] = x[0, :, plan.offsets].transpose(0, 1).to(self.t[name].dtype)

    def flush(self, plan: DecodePlan) -> None:
        """After the attention: the slots at a flush point move their oldest ``block`` recent tokens to the
        history (calibrating first if it is their first flush) and shift their windows."""
        if plan.flush is None:
            return
        sink, block, full = self.kv.sink, self.kv.block, self.win_cap
        if plan.calibrate is not None:
            rows = plan.calibrate
            self._calibrate(rows, self.t["win_k"][rows, :, sink:full], self.t["win_v"][rows, :, sink:full])
        rows = plan.flush
        moving_k = self.t["win_k"][rows, :, sink: sink + block]
        moving_v = self.t["win_v"][rows, :, sink: sink + block]
        self._append(rows, moving_k, moving_v, at=plan.flush_at)
        for name in ("win_k", "win_v"):
            self.t[name][rows, :, sink: full - block] = self.t[name][rows, :, sink + block: full]

    def _calibrate(self, rows, keys: torch.Tensor, values: torch.Tensor) -> None:
        """``PackedStore.calibrate`` for the slots ``rows`` from their exact tokens ``[r, Hkv, n, D]``."""
        stats = statistics(self.k_codec, self.v_codec, keys, values, self.kv.center_k, self.kv.center_v)
        for name, value in stats.items():
            if value is not None:
                self.t[name][rows] = value

    def _append(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, at: torch.Tensor) -> None:
        """Encode ``[r, Hkv, n, D]`` with the slots' statistics; write at history positions ``at + i`` of
        each row's slot (its pages, reserved before)."""
        n = keys.shape[2]
        k = self.k_codec.encode(keys, self._stat("k_mean", rows), self._stat("k_ref", rows))
        v = self.v_codec.encode(values, self._stat("v_mean", rows), self._stat("v_ref", rows))
        pos = at[:, None] + torch.arange(n, device=at.device)  # [r, n]
        page = self.table().to(pos.device)[rows[:, None], pos // PAGE_TOKENS]  # [r, n]
        within = pos % PAGE_TOKENS
        for name, x in (("k_codes", k.codes), ("k_norms", k.norms), ("v_codes", v.codes), ("v_norms", v.norms)):
            # Advanced indices around a slice put their dims first: the target reads [r, n, Hkv(, W)].
            self.t[name][page, :, within] = x.transpose(1, 2)

    # -- reads ----------------------------------------------------------------------------------
    def context(self, plan: DecodePlan, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor, CompressedContext]:
        """Exact keys/values ``[n, Hkv, Wmax, D]`` of ``bucket``'s decode tokens and their histories, padded to
        the bucket's longest (its slots' pages gathered: no slot is read past its bucket's length)."""
        return self._gathered(bucket.slots, bucket.hist_len, plan.win_len)

    def static_context(self, slots: torch.Tensor, hist_len: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                        CompressedContext]:
        """``context`` of a static pass: every row, each window whole (``win_cap``), ``hist_len`` history tokens."""
        return self._gathered(slots, hist_len, self.win_cap)

    def static_paged(self, slots: torch.Tensor, hist_len: int, lengths: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, CompressedContext, Paged]:
        """``paged`` of a static pass: every row, each window whole (``win_cap``), ``hist_len`` history tokens
        (``lengths``: each row's own, ``Paged.lengths``)."""
        return self._paged(slots, hist_len, self.win_cap, lengths)

    def rows_paged(self, plan: DecodePlan) -> tuple[torch.Tensor, torch.Tensor, CompressedContext, Paged]:
        """``paged`` for every decode token of ``plan`` at once (``plan.rows``), each reading its own history."""
        return self._paged(plan.slots, plan.hist_len, plan.win_len, plan.hist)

    def _gathered(self, slots: torch.Tensor, h: int, win_len: int):
        t = self.t
        pages = self.table()[slots, : -(-h // PAGE_TOKENS)]  # [n, p]

        def history(name: str) -> torch.Tensor:
            x = t[name][pages].transpose(1, 2)  # [n, Hkv, p, PAGE(, W)]
            return x.reshape(x.shape[0], x.shape[1], -1, *x.shape[4:])[:, :, :h]

        def stat(name: str) -> torch.Tensor | None:
            return None if name not in t else t[name][slots]

        hist = History(k=Encoded(codes=history("k_codes"), norms=history("k_norms")),
                       v=Encoded(codes=history("v_codes"), norms=history("v_norms")), k_mean=stat("k_mean"),
                       v_mean=stat("v_mean"), k_ref=stat("k_ref"), v_ref=stat("v_ref"), length=h)
        return t["win_k"][slots, :, :win_len], t["win_v"][slots, :, :win_len], self._context(hist, win_len)

    def paged(self, plan: DecodePlan, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor, CompressedContext, Paged]:
        """What :func:`airquant.kv.triton_kernel.attention` reads in place for ``bucket`` (``Paged``): every
        slot's window, the page pools and every slot's statistics, no copy; ``context`` is the gathering
        equivalent the torch ops read."""
        return self._paged(bucket.slots, bucket.hist_len, plan.win_len)

    def _paged(self, slots: torch.Tensor, hist_len: int, win_len: int, lengths: torch.Tensor | None = None):
        t = self.t
        hist = History(k=Encoded(codes=t["k_codes"], norms=t["k_norms"]),
                       v=Encoded(codes=t["v_codes"], norms=t["v_norms"]), k_mean=t.get("k_mean"),
                       v_mean=t.get("v_mean"), k_ref=t.get("k_ref"), v_ref=t.get("v_ref"), length=hist_len)
        return t["win_k"], t["win_v"], self._context(hist, win_len), Paged(slots, self.table(), win_len, PAGE_TOKENS,
                                                                         lengths)

    def _context(self, hist: History, win_len: int) -> CompressedContext:
        ctx = CompressedContext(hist, self.k_codec, self.v_codec, sink=min(self.kv.sink, win_len))
        ctx.receipt.consumed = True  # no TQLayer checks it; the loop's attention always reads the history
        return ctx

    def history_of(self, slot: int, name: str, length: int, tensors: dict | None = None) -> torch.Tensor:
        """``[Hkv, length(, W)]``: slot's first ``length`` history entries of ``name`` (tests, inspection)."""
        pages = (tensors or self.t)[name][self.pages[slot]]  # [p, Hkv, PAGE(, W)]
        return pages.transpose(0, 1).reshape(self.heads, -1, *pages.shape[3:])[:, :length]

    # -- KV offload -----------------------------------------------------------------------------
    def offload(self) -> None:
        self.t = {name: t.to("cpu", non_blocking=True) for name, t in self.t.items()}

    def offload_via(self, ops) -> object:
        """The arena copied into its host image on ``ops``' device-to-host stream (``CudaOps.copy_out``) after what
        the compute stream has queued (its attention and flush), and read from there until its next pass: the
        image is allocated at the first offload and kept (a tensor only anew where the pool grew), where
        ``offload`` allocated every tensor every pass. Returns the copy's event: the image is read or grown
        only after it."""
        home = self.home if self.home is not None else {}
        pairs = []
        for name, t in self.t.items():
            h = home.get(name)
            if h is None or h.shape != t.shape or h.dtype != t.dtype:
                h = home[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin_host)
            if h is not t:
                pairs.append((h, t))
        self.home = self.t = home  # one dict: a pool grown on the host (``_grow``) grows the image
        return ops.copy_out(pairs, ops.mark())

    def prefetch(self) -> None:
        self.t = {name: t.to(self.device, non_blocking=True) for name, t in self.t.items()}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.t.values())
