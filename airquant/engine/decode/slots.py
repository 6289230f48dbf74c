"""The KV cache the decode loop owns: one region per slot, and attention over a ragged, packed batch.

A pass runs the model's own forward on one packed row ``[1, T]``: the decode tokens of running
sequences and chunks of prompts, each a *segment* (slot, first position, length, offset in the row).
The cache's ``update`` (called by every attention module) writes each segment's keys/values into its
slot; the ``airquant_ragged`` attention function registered with transformers then attends each
segment to its own slot only.

Plain cache: preallocated per-slot buffers ``[slots, Hkv, cap, D]`` per layer. Chosen over paged
blocks because the decode attention then reads ``buf[:, :, :L]``, a view (no gather, no block
table), and writing a step's tokens is one ``index_put``; paging would pack more short sequences in
the same memory, which matters only when the KV cache, not the weight pass, bounds the slots (the
TurboQuant cache below grows per sequence and already does not reserve ``cap``).
Grouped-query attention is computed with the query heads of a KV head folded into the query rows
(``[B, Hkv, G*L, D]``), so keys are never repeated per query head.

TurboQuant cache: one slot-batched ``SlotArena`` per layer (see ``tqslots``). Each slot is fed exactly
what one-at-a-time decoding feeds a batch-1 ``TQLayer`` (a whole prompt, then one token per step), so its
flush and calibration points, and thus its outputs, are those of generating the sequence alone; the
decode tokens of all slots are written, attended and flushed in one batch per layer.

Stacks that change what the cache returns before calling the attention function: multi-head latent
attention (MLA: DeepSeek-V2/V3, GLM-4-MoE-lite) caches a compressed latent and a shared rope key, ``[1, 1, T,
R]`` and ``[1, 1, T, Dr]``, and expands them (``kv_b_proj``) into keys and values of different widths;
DiffLlama attends twice, to each half of the value heads. The plain buffers take whatever shapes a layer's
first update has, and for such a stack (``SlotKV.prefix``) the update returns every slot's cached prefix
``[slots, Hkv, L, D]``: the model's own change then hands the attention ``[slots, H, L, D]`` keys and values,
the layout of the plain buffers, and the pass's context comes in the ``slot_kv`` keyword the loop passes (the
change drops the tag on the keys). MLA is known from its config (``caches_latents``); any other such stack is
found at its first pass: the attention function gets another value than the cache returned and raises
``CacheOutputChanged``, and the loop runs that pass again in prefix mode.

Attention sinks (gpt-oss): a learned logit per query head that takes part in the softmax and adds no value;
the attention function receives it as ``s_aux`` and applies it as transformers' eager attention does.

KV offload: the offloaded layers' buffers live in (pinned) host memory; a layer's used prefix is
copied to the device when the layer runs, its new tokens are written there and sent back to the host
copy without blocking, landing in it before that layer's next pass. A TurboQuant layer's
arena moves whole to the device before its update and back after its attention.

Static passes (for the layer graphs, ``engine/layer_graphs.py``): where the layer graphs run this cache's
decode passes (``graph_rows``: they set it), a pass of decode tokens only, of up to ``graph_rows`` rows, is
*static*: its slots, positions, row offsets and per-slot lengths go to one device tensor at fixed addresses
(``begin``), and each device layer writes and attends through them over ``static_span`` columns, the pass's
span rounded up to a bucket (``static_span``; a mask keeps each slot's own columns). The cache write and the
attention then have no Python value that changes from pass to pass, and a layer graph captures them too: a
layer is one graph instead of two around an eager island. Offloaded layers keep the island. A TurboQuant layer
is static too: ``begin`` reserves every arena's pages for the pass and rewrites their page tables in place (one
tensor each, as wide as a full slot), the rows' window positions and history and window lengths go to a second
device tensor, and the layer writes its rows' windows and attends every row at once over its whole window and
``tq_hist`` history tokens (the pass's longest history rounded up as ``static_span`` rounds), a mask keeping
each row's own; the flushes that move tokens from the windows to the histories wait for the end of the pass
(``end_pass``, which the loop calls), as each layer's would have come after its attention.
Such a graph reads the cache's buffers at their addresses: the runner lends the next loop's cache the same
buffers (``KVBuffers``), so that one replays the graphs instead of capturing its own.
"""

from __future__ import annotations

import bisect
import itertools
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from airquant.engine.decode.tqslots import PAGE_TOKENS, DecodePlan, SlotArena, decode_plan, keep_columns, table_width
from airquant.kv.attention import compressed_attention, keep_mask
from airquant.kv.cache import context_of, tag
from airquant.kv.config import KVConfig, KVConfigError
from airquant.kv.rotation import to_device

ATTN_NAME = "airquant_ragged"


# Decode passes under the layer graphs are static (False: the write and the attention stay an eager island
# between two graphs, as before; moe_bench's ``*_island`` cases measure the two side by side).
STATIC_PASSES = True
# Static passes lean: a pass of every slot in slot order reads its rows and places its outputs as views
# (``SlotKV.full``), and each layer reads its mask as an additive bias built once a pass (``SlotKV.static_bias``);
# off, each layer gathers and scatters its rows and builds a boolean mask, which sdpa converts again (moe_bench's
# ``*_indexstatic`` cases). An H100 (wave3_moe28, Qwen3-30B-A3B NF4 under 4 GB, batch 1): 667 fewer kernels and
# 1.3 ms less GPU time in a traced hot-set pass; no cache 0.0299-0.0319 s a step against 0.0327-0.0412, Mixtral's
# 0.1417 against 0.1492; the hot set 0.0140-0.0151 against 0.0126-0.0147 (unexplained: its host time rose).
LEAN_STATIC = True
_SERIALS = itertools.count()
LENT_SLOTS = 8  # the largest cache whose device buffers the layer graphs keep from one loop to the next
# Static passes attend over the span rounded up to a multiple of a quarter of its power of two, at least this
# (columns past a slot's length are masked): a layer graph per bucket, four buckets an octave, at most a
# quarter of the columns wasted.
STATIC_STEP = 256


def static_span(span: int, cap: int) -> int:
    """The columns a static pass attends over: ``span`` rounded up to its bucket, at most ``cap``."""
    step = max(STATIC_STEP, 1 << max(0, (span - 1).bit_length() - 3))
    return min(cap, -(-span // step) * step)


class KVBuffers:
    """The plain cache's device buffers and static tensor, kept by the layer graphs' runner from one decode loop
    to the next: a graph that captured a static pass's write and attention reads them at their addresses, so the
    next loop's cache, lent the same buffers, replays it instead of capturing its own (a capture pass and a
    warm-up pass per request otherwise).

    One cache holds them at a time: a cache that attaches while another is alive (two loops at once) gets its own
    buffers. Only caches of at most ``graph_rows`` slots take them (a larger batch decodes statically only at its
    tail), and of at most ``LENT_SLOTS`` (a larger one captures its own graphs: 32 slots of 8K tokens held after
    their loop would be 34 GB that nothing frees until the next loop). A cache of another batch, dtype or
    device, a TurboQuant or prefix cache, or a shorter buffer than a cache needs frees what it cannot use when
    it attaches, so the loop after another kind never finds the previous one's buffers still held
    (``Engine.release_kv`` frees them at once). A reused buffer is zeroed up to the new cache's length, as a new
    one is."""

    def __init__(self):
        self._bufs: dict[tuple[int, str], torch.Tensor] = {}
        self._static: torch.Tensor | None = None
        self.biases: dict[tuple, torch.Tensor] = {}  # SlotKV.static_bias: read by the graphs at their addresses too
        self._owner: weakref.ref | None = None

    def attach(self, kv: "SlotKV") -> bool:
        """Whether ``kv`` takes its device buffers from here (it does when no other live cache holds them)."""
        owner = self._owner() if self._owner is not None else None
        if owner is kv:
            return True
        if owner is not None:
            return False
        self._owner = weakref.ref(kv)
        if kv.tq or kv.prefix or kv.slots > min(kv.graph_rows, LENT_SLOTS):  # no static pass reads them, few of
            # its passes do, or a cache so large that keeping it after its loop would hold that memory
            self.clear()
            return False
        self._bufs = {key: b for key, b in self._bufs.items()
                      if b.shape[0] == kv.slots and b.shape[2] >= kv.cap and b.dtype == kv.dtype and
                      b.device == kv.device and key[0] not in kv.offload}
        if self._static is not None and (self._static.shape[1] != kv.slots or self._static.device != kv.device):
            self._static = None
        self.biases = {key: b for key, b in self.biases.items() if b.shape[0] == kv.slots and b.device == kv.device}
        return True

    def get(self, layer: int, which: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Layer ``layer``'s ``which`` ("k" or "v") buffer of ``shape`` ``[slots, H, cap, D]``, zeroed: the kept
        one's first ``cap`` columns where it matches, else a new one (the old freed first)."""
        buf = self._bufs.pop((layer, which), None)
        if buf is not None and buf.shape[:2] == shape[:2] and buf.shape[3] == shape[3] and \
                buf.shape[2] >= shape[2] and buf.dtype == dtype and buf.device == device:
            self._bufs[(layer, which)] = buf
            return buf[:, :, :shape[2]].zero_()
        del buf  # freed before the new one is made
        buf = self._bufs[(layer, which)] = torch.zeros(shape, dtype=dtype, device=device)
        return buf

    def static(self, slots: int, device: torch.device) -> torch.Tensor:
        if self._static is None or self._static.shape[1] != slots or self._static.device != device:
            self._static = torch.zeros(4, slots, dtype=torch.long, device=device)
        return self._static

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def clear(self) -> None:
        self._bufs.clear()
        self._static = None
        self.biases = {}
        self._owner = None


class CacheOutputChanged(Exception):
    """The model handed the attention function another value than the cache returned (the loop then
    switches its cache to ``prefix`` mode and runs the pass again); internal, never reaches a caller."""


def caches_latents(config) -> bool:
    """Whether the stack's attention caches a compressed latent and expands what the cache returns (MLA)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "kv_lora_rank", None) is not None


@dataclass(frozen=True)
class Segment:
    """Tokens of one sequence in a pass: positions ``start .. start+n`` of ``slot``, at ``offset`` in the row."""

    slot: int
    start: int
    n: int
    offset: int


@dataclass
class PassContext:
    """What the attention of one layer reads: the segments and the keys/values to attend to."""

    kv: "SlotKV"
    layer: int
    keys: torch.Tensor | None = None  # plain: [slots, Hkv, L, D] (device), L >= every segment's end
    values: torch.Tensor | None = None
    tq: SlotArena | None = None  # TurboQuant: this layer's arena
    row: tuple[torch.Tensor, torch.Tensor] | None = None  # TurboQuant: the pass's new keys/values [1, Hkv, T, D]
    returned: torch.Tensor | None = None  # the value update returned: the attention must get this one
    static: bool = False  # a static pass's device layer: the write and the attention read only device tensors


class SlotKV:
    """Per-slot KV for every layer; ``begin(segments)`` before a pass, ``free(slot)`` when a sequence ends."""

    is_compileable = False

    def __init__(self, num_layers: int, slots: int, cap: int, device: torch.device, dtype: torch.dtype, *,
                 kv: KVConfig | None = None, offload: set[int] | frozenset = frozenset(),
                 pin: bool = False, latent: bool = False, pool_tokens: int | None = None, copy_ops=None):
        if latent and kv is not None and kv.backend == "tq":
            raise KVConfigError("the TurboQuant cache compresses keys and values per head; an MLA stack (DeepSeek, "
                                "GLM-4-MoE-lite) caches one compressed latent per token: use kv backend 'none'")
        self.num_layers, self.slots, self.cap, self.prefix = num_layers, slots, cap, latent
        self.device, self.dtype, self.kv, self.offload, self.pin = device, dtype, kv, set(offload), pin
        self.tq = kv is not None and kv.backend == "tq"
        # TurboQuant: history pages each layer's arena allocates at once, for ``pool_tokens`` tokens over the slots
        # (the plan's reserve; None: grown as admissions need them). Growing a pool allocates it anew and copies
        # it: dozens of times a layer while a large batch fills its slots, each allocation a chance for the CUDA
        # allocator to free its cached blocks under the cap (a device-wide synchronization).
        per_slot = min(pool_tokens // slots, cap) if pool_tokens and self.tq else 0
        self.pool_pages = slots * -(-kv.schedule.quantized_count(per_slot) // PAGE_TOKENS) if per_slot else 0
        self._k: list[torch.Tensor | None] = [None] * num_layers
        self._v: list[torch.Tensor | None] = [None] * num_layers
        self._tq: list[SlotArena | None] = [None] * num_layers
        self._seen = [0] * slots  # tokens cached per slot (TurboQuant: checks the loop feeds them in order)
        self.plan: DecodePlan | None = None  # TurboQuant: the pass's decode tokens
        self._tq_reserve: list[tuple[int, int]] = []  # TurboQuant: (slot, history tokens) after the pass
        self.segments: list[Segment] = []
        self.decode_masks: dict[tuple, torch.Tensor] = {}
        self.single: Segment | None = None  # the pass's one decode token, when it is the pass's only row
        self.full = False  # every slot decodes, in slot order (``begin``)
        self._decode: tuple[torch.Tensor, ...] | None = None
        self._decode_host: tuple[torch.Tensor, torch.Tensor] | None = None  # slots, starts (CPU): host writes
        self._pending: dict[int, tuple] = {}  # offloaded layer -> new tokens on their way to the host copy
        # ``copy_ops`` (the streamer's ``CudaOps``): an offloaded layer's prefix is copied on the copy stream while
        # the layer before it runs (``_fetch_ahead``), in order with the layers' weights; without it (CPU, the
        # fallback path) each offloaded layer copies its own on the compute stream, where the copy engine runs it
        # after the next layers' weights and the layer waits for them
        self.ops = copy_ops
        self._ahead: dict[int, tuple] = {}  # offloaded layer -> what was copied ahead for this pass, its event
        self._offloaded_at: dict[int, object] = {}  # TurboQuant: offloaded layer -> its arena's copy to the host
        self._offloaded = sorted(self.offload)
        self.passes = 0  # ``begin`` calls: layer graphs' static inputs are refreshed once a pass
        self.recorder = None  # engine/layer_graphs: a capture's Recorder, or a warm-up's sync check
        self.graph_rows = 0  # engine/layer_graphs: decode passes of up to this many rows are static
        self.static = False  # this pass is static (``begin``)
        self.static_span = 0  # its attended columns
        self._static: torch.Tensor | None = None  # [4, slots]: slots, starts, offsets (rows), lengths (slots)
        self._tq_static: torch.Tensor | None = None  # TurboQuant [3, slots]: window position, history, window
        self.tq_hist = 0  # TurboQuant static passes: the history tokens attended
        self.layout = 0  # counts the changes of the buffers' and arenas' addresses (a new buffer, a grown pool)
        self._length: torch.Tensor | None = None  # static passes: tokens per slot after the pass (idle: 1)
        self.pool: KVBuffers | None = None  # the layer graphs' kept device buffers, where they lend them
        self._biases: dict[tuple, torch.Tensor] = {}  # static_bias's, where no pool lends them
        self.serial = next(_SERIALS)  # static_key of a cache with biases of its own: its graphs are its own
        # TurboQuant: every device arena's page table [layers, slots, pages] on the device and its host image (pinned
        # on CUDA), written in one copy a pass (``_upload_tables``); the event: that copy has read the image
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        self._tables_read = None

    # -- the pass ------------------------------------------------------------------------------
    def begin(self, segments: list[Segment]) -> None:
        self.segments = segments
        self.passes += 1
        self.decode_masks = {}  # (span, window) -> the pass's [S, L] decode mask, built by the first layer
        dec = [s for s in segments if s.n == 1]
        self.span = max(s.start + s.n for s in segments)
        self.static = STATIC_PASSES and bool(dec) and len(dec) == len(segments) <= self.graph_rows and \
            not self.prefix
        # One sequence decoding one token (batch 1): its token is written and attended by slices of its own slot,
        # with no index tensors, scatter or mask (~10 fewer ops a layer on the host, and sdpa without a mask).
        self.single = dec[0] if len(segments) == 1 and dec and not self.static else None
        # Every slot decoding, slot n's token at row offset n (a full continuous batch, batch 1 in a loop of one
        # slot): the row is already in slot order, so its tokens are read and its outputs placed as views (no
        # gather, zero fill or scatter). A static pass's layer graph captures that too: ``static_key`` holds it.
        self.full = (LEAN_STATIC or not self.static) and len(dec) == len(segments) == self.slots and all(
            s.slot == n and s.offset == n for n, s in enumerate(dec))
        self._decode = self._decode_host = None
        if self.static:
            self._static_begin(dec)
        elif dec:
            dev = self.device
            host = [torch.tensor([getattr(s, k) for s in dec]) for k in ("slot", "start", "offset")]
            self._decode = tuple(to_device(t, dev) for t in host)  # a pinned copy each: ``host`` stays as it is
            # where the host copies' new tokens land (``_land``)
            self._decode_host = tuple(host[:2]) if self.offload and dev.type != "cpu" else self._decode[:2]
        if self.tq:
            self._tq_begin(segments, dec)
        self._ahead.clear()  # a pass cut short leaves its copies (their memory held until they ran: copy_target)
        if self._offloaded:
            (self._fetch_arena_ahead if self.tq else self._fetch_ahead)(self._offloaded[0])

    def _fetch_ahead(self, j: int | None) -> None:
        """Offloaded layer ``j``'s prefix for this pass (its last pass's tokens landed first) copied to the device
        on the copy stream, to be waited for by its layer; nothing without ``ops`` or before its first pass."""
        if j is None or self.ops is None or self._k[j] is None:
            return
        self._land(j)
        (k_dev, _), (v_dev, done) = (self._copy_ahead(home[:, :, :self.span]) for home in (self._k[j], self._v[j]))
        self._ahead[j] = (k_dev, v_dev, self.span, done)

    def _copy_ahead(self, src: torch.Tensor) -> tuple[torch.Tensor, object]:
        """``src`` (host) copied into a new device tensor of its strides (a prefix: one block, one copy) on the copy
        stream; (the tensor, the copy's event)."""
        dst = self.ops.copy_target(src)  # never memory that queued compute still reads
        _, done = self.ops.copy(dst, src, None)
        return dst, done

    def _fetch_arena_ahead(self, j: int | None) -> None:
        """``_fetch_ahead`` for an offloaded TurboQuant arena: its pages for this pass reserved (grown in pinned host
        memory if need be, once its last copy to the host has landed), then the arena and its page table copied on
        the copy stream."""
        arena = self._tq[j] if j is not None else None
        if arena is None or self.ops is None:
            return
        landed = self._offloaded_at.pop(j, None)
        if landed is not None:
            self.ops.host_wait(landed)  # the host copy is read (or grown) here: long done, a pass ends in a sync
        self._reserve(arena)
        tensors = {}
        for name, t in arena.t.items():
            tensors[name], done = self._copy_ahead(t)
        table = arena.table_stale and arena.fits_table()
        if table:
            rows = arena.table_rows(arena.table_capacity)
            _, done = self.ops.copy(arena.fixed_table, rows.pin_memory() if self.pin else rows, None)
        self._ahead[j] = (tensors, table, done)

    def _next_offloaded(self, i: int) -> int | None:
        k = bisect.bisect_right(self._offloaded, i)
        return self._offloaded[k] if k < len(self._offloaded) else None

    def _reserve(self, arena: SlotArena) -> None:
        """``arena``'s pages for this pass (``layout`` counts a regrown pool: its addresses changed)."""
        pages = arena.pool_pages
        arena.reserve_all(self._tq_reserve)
        self.layout += arena.pool_pages != pages

    def _static_begin(self, dec: list[Segment]) -> None:
        """The pass's decode tokens in the static tensor (one copy), read through views at fixed addresses."""
        n, rows = self.slots, len(dec)
        if self._static is None:
            self._static = self.pool.static(n, self.device) if self.pool is not None else \
                torch.zeros(4, n, dtype=torch.long, device=self.device)
        # pinned, copied without a stream sync: a pass queued ahead (decode/loop.py QUEUE_AHEAD) is queued while
        # the pass before still runs (a pageable copy waited for it)
        host = torch.zeros(4, n, dtype=torch.long, pin_memory=self.device.type == "cuda")
        host[3] = 1  # an idle slot attends to its first column (a row of its padding query, never read)
        for r, s in enumerate(dec):
            host[0, r], host[1, r], host[2, r], host[3, s.slot] = s.slot, s.start, s.offset, s.start + 1
        self._static.copy_(host, non_blocking=True)
        self._decode = (self._static[0, :rows], self._static[1, :rows], self._static[2, :rows])
        self._length = self._static[3]
        # where offloaded layers' host copies land the tokens: this pass's own host tensor (the static one
        # changes before a layer lands them, at its next pass)
        self._decode_host = (host[0, :rows], host[1, :rows])
        self.static_span = static_span(self.span, self.cap)
        for (span, window, _), bias in self._bias_home().items():  # the graphs of this span read them
            if span == self.static_span:
                self._fill_bias(bias, window)
        if self.tq:
            count = self.kv.schedule.quantized_count
            if self._tq_static is None:
                self._tq_static = torch.zeros(3, n, dtype=torch.long, device=self.device)
            tq = torch.zeros(3, n, dtype=torch.long, pin_memory=self.device.type == "cuda")
            for r, s in enumerate(dec):
                hist = count(s.start)
                tq[0, r], tq[1, r], tq[2, r] = s.start - hist, hist, s.start + 1 - hist  # window: the new one's
            self._tq_static.copy_(tq, non_blocking=True)
            longest = int(tq[1].max())
            self.tq_hist = static_span(longest, count(self.cap)) if longest else 0

    def static_layer(self, i: int) -> bool:
        """Whether layer ``i`` writes and attends statically this pass: a static pass, its buffers (TurboQuant:
        its arena) on the device, made by its first update."""
        return self.static and i not in self.offload and (self._tq[i] if self.tq else self._k[i]) is not None

    def static_key(self, i: int) -> tuple | None:
        """What a static layer's graph reads besides its call's tensors (the buffers' and the static tensor's
        addresses and shapes, the attended columns); None where layer ``i`` is not static this pass."""
        if not self.static_layer(i):
            return None
        if self.tq:
            return (self.tq_hist, self._tq[i].static_key(), self._static.data_ptr(), self._tq_static.data_ptr())
        k, v = self._k[i], self._v[i]  # addresses and strides (a kept buffer's view: its own cap's strides)
        return (self.static_span, k.data_ptr(), k.stride(), v.data_ptr(), v.stride(), (*k.shape[:2], k.shape[3]),
                (*v.shape[:2], v.shape[3]), k.dtype, self._static.data_ptr(), self.full,
                None if self.pool is not None else self.serial)

    def static_bias(self, span: int, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        """A static pass's mask over ``span`` columns as an additive bias ``[slots, span]`` in ``dtype``: 0 on
        each slot's own columns (its length, its ``window``), -inf elsewhere. Built once a pass for every layer
        (``_static_begin`` refills those of its span), at an address the layer graphs read (lent with the buffers,
        or the cache's own: ``static_key`` then names the cache), each row 16 columns aligned (sdpa's
        memory-efficient kernel copies a bias that is not, at every call)."""
        home = self._bias_home()
        bias = home.get((span, window, dtype))
        if bias is None:  # inside a capture, its graph fills it at each replay as well
            bias = home[(span, window, dtype)] = torch.empty(self.slots, -(-span // 16) * 16, dtype=dtype,
                                                             device=self.device)
            self._fill_bias(bias, window)
        return bias[:, :span]

    def _bias_home(self) -> dict:
        return self.pool.biases if self.pool is not None else self._biases

    def _fill_bias(self, bias: torch.Tensor, window: int | None) -> None:
        cols = torch.arange(bias.shape[1], device=bias.device)
        length = self._length[:, None]
        keep = cols < length
        if window:
            keep &= cols > length - 1 - window
        bias.zero_().masked_fill_(~keep, float("-inf"))

    def _tq_begin(self, segments: list[Segment], dec: list[Segment]) -> None:
        count = self.kv.schedule.quantized_count
        for s in segments:
            # A TurboQuant prompt is prefilled whole (the scheduler's rule), then one token per pass.
            assert self._seen[s.slot] == s.start and (s.n == 1 or s.start == 0), "a TurboQuant slot is fed in order"
            self._seen[s.slot] += s.n
        # the history each slot holds after this pass (its flush included): pages every layer's arena reserves
        self._tq_reserve = [(s.slot, count(s.start + s.n)) for s in segments]
        # buckets: for the layers that attend eagerly (an offloaded one, or one without its arena yet)
        eager = not self.static or bool(self.offload) or any(a is None for a in self._tq)
        self.plan = decode_plan(self.kv, self.slots, [(s.slot, s.start, s.offset) for s in dec],
                                self.device, buckets=eager) if dec else None
        self._upload_tables()

    def _upload_tables(self) -> None:
        """Every device arena's pages for the pass reserved here, before its layers run, and the page tables that
        changed written in one copy. A table rebuilt inside a layer was a small host-to-device copy on the
        compute stream, which the copy engine ran only after the next layers' weights already queued on the copy
        stream: each layer then waited for the next one's copy, whose slot waited for that layer (H100, 70B NF4
        under 15 GB, 99 slots: a TurboQuant decode pass took its copies plus its compute, 0.92 s against plain's
        0.73 s, 240 weight copies and 380 small ones in three traced passes). Static passes' graphs read the
        tables in place."""
        stale = []
        for i, arena in enumerate(self._tq):
            if arena is not None and i not in self.offload:
                self._reserve(arena)
                if arena.table_stale and arena.fits_table() and self._tables is not None:
                    stale.append(i)
                elif arena.table_stale:
                    arena.table()  # a table of its own (a slot outgrew the fixed width): still before the layers
        if not stale:
            return
        dev, host = self._tables
        if self._tables_read is not None:
            self._tables_read.synchronize()  # the last pass's copy has read the image (long done: a pass syncs)
        for i in stale:
            host[i] = self._tq[i].table_rows(host.shape[2])
        cuda = dev.device.type == "cuda"
        for lo, hi in _runs(stale):  # only the tables written here: another layer's image may be older than its table
            dev[lo:hi].copy_(host[lo:hi], non_blocking=cuda)
        if cuda:
            self._tables_read = torch.cuda.Event()
            self._tables_read.record()
        for i in stale:
            self._tq[i].table_uploaded()

    def _table_view(self, i: int) -> torch.Tensor:
        """Layer ``i``'s fixed-width page table, a view of every layer's (allocated with the first arena)."""
        if self._tables is None:
            shape = (self.num_layers, self.slots, table_width(self.kv, self.cap))
            self._tables = (torch.zeros(shape, dtype=torch.long, device=self.device),
                            torch.zeros(shape, dtype=torch.long, pin_memory=self.device.type == "cuda"))
        return self._tables[0][i]

    def use_prefix(self) -> None:
        """From now on ``update`` returns every slot's cached prefix (the model changes what it returns)."""
        if self.tq:
            raise KVConfigError("the TurboQuant cache attends to the keys and values it stored; this model changes "
                                "the cache's values before its attention (DiffLlama's halves): use kv backend 'none'")
        self.prefix = True

    def free(self, slot: int) -> None:
        """A finished sequence's slot: its buffers are overwritten by the next one (its TurboQuant pages go back
        to each layer's pool)."""
        self._seen[slot] = 0
        for arena in self._tq:
            if arena is not None:
                arena.release(slot)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come from the loop (position_ids), never from the cache

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """``[1, Hkv, T, D]`` new keys/values of the packed row; returns keys tagged with the pass context
        (``prefix``: every slot's cached prefix ``[slots, Hkv, L, D]``, which the model changes)."""
        static = self.static_layer(layer_idx)
        if self.recorder is not None:
            if static:  # a layer graph's capture goes on through the write and the attention
                self.recorder.static_update(self.static_key(layer_idx))
            else:  # a layer graph's capture ends here: the write and the attention run eagerly
                self.recorder.island_begin(key, value, layer_idx, args, kwargs)
        if self.prefix:
            return self._plain_update(key, value, layer_idx)
        ctx = PassContext(self, layer_idx, returned=value, static=static)
        if self.tq:
            ctx.tq = self._tq_static_write(key, value, layer_idx) if static else self._tq_update(key, value, layer_idx)
            ctx.row = (key, value)
        else:
            ctx.keys, ctx.values = self._plain_update(key, value, layer_idx, static)
        return tag(key, ctx), value

    def addresses(self, i: int) -> tuple | None:
        """Where layer ``i``'s cache lives on the device now (its buffers, or its arena's tensors), None before its
        first update; with ``layout`` unchanged, still there."""
        if self.tq:
            return self._tq[i].static_key() if self._tq[i] is not None else None
        return (self._k[i].data_ptr(), self._v[i].data_ptr()) if self._k[i] is not None else None

    def _buffers(self, i: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s buffers, shaped by its first update (keys and values may differ in heads and width)."""
        if self._k[i] is None:
            self.layout += 1
            home = torch.device("cpu") if i in self.offload else self.device
            pin = self.pin and i in self.offload
            for bufs, x, which in ((self._k, key, "k"), (self._v, value, "v")):
                shape = (self.slots, x.shape[1], self.cap, x.shape[3])
                if i in self.offload:
                    # Token-major in host memory, seen as [slots, Hkv, cap, D]: a pass's prefix (``[:, :, :span]``)
                    # is one block, which crosses in one asynchronous copy. A strided prefix went through a
                    # pageable temporary (torch makes a non-contiguous source contiguous first), and a copy from
                    # pageable memory waits for everything queued on the GPU: the host stopped at every layer.
                    base = torch.zeros((self.cap, self.slots, x.shape[1], x.shape[3]), dtype=self.dtype,
                                       device=home, pin_memory=pin)
                    bufs[i] = base.permute(1, 2, 0, 3)
                elif self.pool is not None:
                    bufs[i] = self.pool.get(i, which, shape, self.dtype, home)
                else:
                    bufs[i] = torch.zeros(shape, dtype=self.dtype, device=home)
        return self._k[i], self._v[i]

    def _plain_update(self, key, value, i: int, static: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        k_home, v_home = self._buffers(i, key, value)
        rows = self._new_rows(key, value)
        if i not in self.offload:
            span = self.static_span if static else self.span
            k_dev, v_dev = k_home[:, :, :span], v_home[:, :, :span]
            _scatter(k_dev, v_dev, rows, self._decode)
            return k_dev, v_dev
        # The prefix in use goes to the device and the new tokens are written there; they reach the host copy
        # asynchronously and land in it before this layer's next pass reads it. Writing them to the host here
        # was a blocking device-to-host copy per layer, which stops the host from queueing ahead of the GPU (a
        # streamed 8B batch-1 step with its KV offloaded so ran at 0.83 of the H200's link, 0.99 on the device).
        ahead = self._ahead.pop(i, None)
        if ahead is not None and ahead[2] == self.span:
            k_dev, v_dev, _, done = ahead
            self.ops.wait(done)
        else:
            self._land(i)
            k_dev = k_home[:, :, : self.span].to(self.device, non_blocking=True, copy=True)
            v_dev = v_home[:, :, : self.span].to(self.device, non_blocking=True, copy=True)
        self._fetch_ahead(self._next_offloaded(i))
        _scatter(k_dev, v_dev, rows, self._decode)
        host = [(where, self._to_host(k), self._to_host(v)) for where, k, v in rows]
        event = torch.cuda.current_stream(self.device).record_event() if self.device.type == "cuda" else None
        self._pending[i] = (event, host, self._decode_host)
        return k_dev, v_dev

    def _new_rows(self, key: torch.Tensor, value: torch.Tensor) -> list[tuple]:
        """The pass's new keys/values by destination: ("decode", [nd, Hkv, D] rows at the decode slots' ends)
        and (a prompt chunk's Segment, its [Hkv, n, D] rows)."""
        if self.single is not None:  # a one-token segment: a slice write (``_scatter``)
            s = self.single
            return [(s, key[0, :, s.offset: s.offset + 1], value[0, :, s.offset: s.offset + 1])]
        if self.full:
            n = self.slots
            return [("decode", key[0, :, :n].transpose(0, 1), value[0, :, :n].transpose(0, 1))]
        rows = []
        if self._decode is not None:
            offsets = self._decode[2]
            rows.append(("decode", key[0, :, offsets].transpose(0, 1), value[0, :, offsets].transpose(0, 1)))
        rows += [(s, key[0, :, s.offset: s.offset + s.n], value[0, :, s.offset: s.offset + s.n])
                 for s in self.segments if s.n > 1]
        return rows

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        # Cast and pack on the device: a device-to-host copy_ that also converts would wait for the GPU.
        src = t.to(self.dtype).contiguous()
        return torch.empty(src.shape, dtype=self.dtype, pin_memory=self.pin).copy_(src, non_blocking=self.pin)

    def _land(self, i: int) -> None:
        """Write offloaded layer ``i``'s queued tokens into its host copy (their copies finished long ago: the
        layer ran through every other layer since)."""
        pending = self._pending.pop(i, None)
        if pending is None:
            return
        event, host, decode = pending
        if event is not None:
            event.synchronize()
        _scatter(self._k[i], self._v[i], host, decode)

    def _tq_update(self, key, value, i: int) -> SlotArena:
        """Prompts into their slots, decode tokens at the ends of their windows; the flush of the decode
        tokens' slots waits for the attention (it reads the history as it was before this token)."""
        arena = self._tq[i]
        if arena is None:
            arena = self._tq[i] = SlotArena(self.kv, i, self.slots, key.shape[1], key.shape[3], self.device,
                                            self.dtype, cap=self.cap,
                                            # an offloaded arena crosses the link whole each pass: grown as used
                                            pool_pages=self.pool_pages if i not in self.offload else 0,
                                            table=self._table_view(i))
        elif i in self.offload:
            ahead = self._ahead.pop(i, None)
            if ahead is not None:
                tensors, table, done = ahead
                self.ops.wait(done)
                arena.t = tensors
                if table:
                    arena.table_uploaded()
            else:
                landed = self._offloaded_at.pop(i, None)
                if landed is not None:  # its image is read after its last copy to the host, in stream order
                    self.ops.wait(landed)
                arena.prefetch()
            self._fetch_arena_ahead(self._next_offloaded(i))
        self._reserve(arena)
        for s in self.segments:
            if s.n > 1:
                arena.prefill(s.slot, key[:, :, s.offset: s.offset + s.n], value[:, :, s.offset: s.offset + s.n])
        if self.plan is not None:
            arena.write_decode(self.plan, key, value)
        return arena

    def _tq_static_write(self, key, value, i: int) -> SlotArena:
        """A static pass's decode tokens at the ends of their windows, through the static tensors (its pages were
        reserved by ``begin``)."""
        arena = self._tq[i]
        slots, offsets = self._decode[0], self._decode[2]
        write = self._tq_static[0, : slots.shape[0]]
        for name, x in (("win_k", key), ("win_v", value)):
            arena.t[name][slots, :, write] = x[0, :, offsets].transpose(0, 1).to(arena.t[name].dtype)
        return arena

    def end_pass(self) -> None:
        """After a pass's forward: a static pass's flushes (each static layer's, deferred from its attention)."""
        if not (self.tq and self.static) or self.plan is None or self.plan.flush is None:
            return
        for i, arena in enumerate(self._tq):
            if arena is not None and self.static_layer(i):
                arena.flush(self.plan)

    def arena(self, i: int) -> SlotArena | None:
        """Layer ``i``'s TurboQuant arena (None before its first pass, or with the plain cache)."""
        return self._tq[i]

    def after_attention(self, i: int) -> None:
        if not self.tq or self.static_layer(i):  # a static layer's flush waits for the end of the pass (end_pass)
            return
        if self.plan is not None:
            self._tq[i].flush(self.plan)
        if i in self.offload:
            if self.ops is not None:  # read again (copied ahead, or grown) once this copy has landed
                self._offloaded_at[i] = self._tq[i].offload_via(self.ops)
            else:
                self._tq[i].offload()

    def host_bytes(self) -> int:
        """Bytes the offloaded layers keep in host memory between their passes."""
        plain = sum(t.numel() * t.element_size() for i in self.offload for t in (self._k[i], self._v[i])
                    if t is not None)
        return plain + sum(self._tq[i].nbytes() for i in self.offload if self._tq[i] is not None)

    def nbytes(self) -> int:
        """Bytes of the cache's tensors (device and host)."""
        plain = sum(t.numel() * t.element_size() for t in self._k + self._v if t is not None)
        return plain + sum(arena.nbytes() for arena in self._tq if arena is not None)


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Ascending ``indices`` as [lo, hi) runs of consecutive ones."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _scatter(k_buf: torch.Tensor, v_buf: torch.Tensor, rows: list[tuple], decode) -> None:
    """``SlotKV._new_rows``' rows into ``[slots, Hkv, L, D]`` buffers; ``decode``: the decode tokens' (slots,
    starts) on the buffers' device."""
    for where, k, v in rows:
        if where == "decode":
            slots, starts = decode[0], decode[1]
            k_buf[slots, :, starts], v_buf[slots, :, starts] = k.to(k_buf.dtype), v.to(v_buf.dtype)
        else:
            k_buf[where.slot, :, where.start: where.start + where.n] = k
            v_buf[where.slot, :, where.start: where.start + where.n] = v


# -- attention ---------------------------------------------------------------------------------
def ragged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, slot_kv=None,
                     **kwargs):
    """``_ragged_attention``; where its layer call is being captured as a graph (engine/layer_graphs), the
    capture of the rest of the call starts at its return."""
    result = _ragged_attention(module, query, key, value, attention_mask, scaling, dropout, slot_kv=slot_kv,
                               **kwargs)
    ctx = context_of(key)
    if isinstance(ctx, PassContext) and ctx.kv.recorder is not None:
        if ctx.static:
            ctx.kv.recorder.static_end()
        else:
            ctx.kv.recorder.island_end(ragged_attention, module, query, key, value, (attention_mask,),
                                       dict(scaling=scaling, dropout=dropout, slot_kv=slot_kv, **kwargs), result)
    return result


def _ragged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, *, slot_kv=None,
                      **kwargs):
    """AttentionInterface signature: ``query`` ``[1, Hq, T, D]`` of the packed row -> ``([1, T, Hq, Dv], None)``;
    ``[B, Hq, T, D]``: a batch of rows (``slot_cache``, transformers' generate), attended as their packed row.

    ``slot_kv``: the loop's cache, passed when it is in prefix mode, whose ``key``/``value`` are then every
    slot's prefix as the model changed it ``[slots, H, L, D]``; ``s_aux`` (in ``kwargs``): per-head sink logits."""
    ctx = context_of(key)
    if slot_kv is not None and slot_kv.prefix:
        ctx = PassContext(slot_kv, module.layer_idx, keys=key, values=value)
    elif isinstance(ctx, PassContext) and changed(value, ctx.returned):
        raise CacheOutputChanged(f"layer {ctx.layer}")  # the loop runs the pass again in prefix mode
    if not isinstance(ctx, PassContext):  # another cache (a reference run): transformers' sdpa
        plain = key.as_subclass(torch.Tensor) if ctx is not None else key
        return sdpa_attention_forward(module, query, plain, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    rows = query.shape[0]
    if rows > 1:  # row b's tokens at offsets b * T of the packed row, as slot_cache wrote them
        query = query.transpose(0, 1).reshape(1, query.shape[1], rows * query.shape[2], query.shape[3])
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else implicit_window(module)
    tiles = getattr(key, "kv_tiles", 1)  # keys tiled over heads (JetMoE): query head h reads key head h mod Hkv
    if tiles > 1:  # reorder the query heads so that the G heads of a key head are adjacent, as below
        _, hq, t, dim = query.shape
        query = query.view(1, tiles, hq // tiles, t, dim).transpose(1, 2).reshape(1, hq, t, dim)
    sinks = kwargs.get("s_aux")
    if ctx.tq is not None:
        if sinks is not None:
            raise KVConfigError("the TurboQuant decode attention has no attention sinks (gpt-oss): use kv backend "
                                "'none'")
        out = _tq_attention(query, ctx, scale)
    else:
        assert sinks is None or tiles == 1, "sinks per query head are not reordered for tiled keys"
        out = _plain_attention(query, ctx, scale, window, sinks)
    ctx.kv.after_attention(ctx.layer)
    if tiles > 1:  # back to the model's head order, contiguous as JetMoE views it per expert
        out = out.view(1, hq // tiles, tiles, t, dim).transpose(1, 2).reshape(1, hq, t, dim)
        return out.transpose(1, 2).contiguous(), None
    # Contiguous, as transformers' own attention functions return it: AFMoE views the output as [B, T, H * D].
    out = out.transpose(1, 2).contiguous()  # [1, T, Hq, Dv]
    return out.view(rows, -1, *out.shape[2:]), None


def changed(value: torch.Tensor, returned: torch.Tensor) -> bool:
    """Whether the attention got other values than the cache returned, of the same shape: DiffLlama's halves of
    the value heads (new storage). A view of the same storage (AFMoE) or the keys when K = V (DeepSeek-V4: the
    cache was given one tensor twice) is the same; JetMoE tiles the values over its attention experts (another
    shape), which the keys' ``kv_tiles`` already mirror."""
    return value.shape == returned.shape and value.data_ptr() != returned.data_ptr()


def implicit_window(module) -> int | None:
    """The sliding window of an attention module that does not pass ``sliding_window`` to the attention
    function: transformers then applies it through the mask alone, which the loop does not use. PhiMoE
    masks every layer by ``config.sliding_window``; Qwen2-MoE keeps it on its sliding layers' modules."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    config = getattr(module, "config", None)
    if config is None or getattr(config, "layer_types", None):  # layer_types: the modules say which slide
        return None
    return getattr(config, "sliding_window", None)


def _plain_attention(query: torch.Tensor, ctx: PassContext, scale: float, window: int | None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    kv = ctx.kv
    _, hq, t, dim = query.shape
    keys, values = ctx.keys, ctx.values  # [S, Hkv, L, D], [S, Hkv, L, Dv]
    hkv, dv = keys.shape[1], values.shape[-1]
    g = hq // hkv
    sink = sinks.view(1, hkv, g, 1) if sinks is not None else None  # query head h = kv head * G + g
    one = kv.single
    if one is not None and sinks is None and keys.shape[2] == one.start + 1:
        # batch 1: the slot's own keys, the window as a slice; every column is kept, so no mask
        first = max(0, one.start + 1 - window) if window else 0
        q = query[0, :, one.offset].reshape(1, hkv, g, dim)  # [1, Hkv, G, D]: query head h = kv head * G + g
        o = F.scaled_dot_product_attention(q, keys[one.slot: one.slot + 1, :, first:],
                                           values[one.slot: one.slot + 1, :, first:], scale=scale)
        return o.reshape(1, hq, 1, dv)
    out = query.new_empty(1, hq, t, dv) if not kv.full else None  # [1, Hq, T, Dv]
    if kv._decode is not None:
        slots, starts, offsets = kv._decode
        if kv.full:  # row n is slot n's token
            q = query[0].transpose(0, 1).reshape(t, hkv, g, dim)  # [S, Hkv, G, D]
        else:
            q = query.new_zeros(keys.shape[0], hkv, g, dim)  # [S, Hkv, G, D]; rows of idle slots stay 0
            q[slots] = query[0, :, offsets].transpose(0, 1).reshape(-1, hkv, g, dim)
        lean = ctx.static and LEAN_STATIC and sink is None
        keep = kv.static_bias(keys.shape[2], window, q.dtype) if lean else \
            None if ctx.static else kv.decode_masks.get((keys.shape[2], window))
        if keep is None:  # built once per pass (every layer of a window reads the same columns), or by each
            # static layer from the static lengths (its graph builds it again at each replay)
            if ctx.static:
                length = kv._length
            else:
                length = torch.ones(keys.shape[0], dtype=torch.long, device=query.device)
                length[slots] = starts + 1
            cols = torch.arange(keys.shape[2], device=query.device)
            keep = cols < length[:, None]  # [S, L]
            if window:
                keep &= cols > (length[:, None] - 1 - window)
            if not ctx.static:
                kv.decode_masks[(keys.shape[2], window)] = keep
        o = _attend(q, keys, values, keep[:, None, None, :], scale, sink)
        if kv.full:
            return o.reshape(t, hq, dv).transpose(0, 1).unsqueeze(0)  # [1, Hq, T, Dv]
        out[0, :, offsets] = o[slots].reshape(-1, hq, dv).transpose(0, 1)
    for s in kv.segments:
        if s.n == 1:
            continue
        end = s.start + s.n
        q = query[:, :, s.offset: s.offset + s.n].reshape(1, hkv, g * s.n, dim)  # rows g-major
        rows = torch.arange(s.start, end, device=query.device)[:, None]
        cols = torch.arange(end, device=query.device)[None, :]
        keep = cols <= rows
        if window:
            keep &= cols > rows - window
        keep = keep.repeat(g, 1)[None, None]  # [1, 1, G*n, end]
        rows_sink = sink.expand(1, hkv, g, s.n).reshape(1, hkv, g * s.n, 1) if sink is not None else None
        o = _attend(q, keys[s.slot: s.slot + 1, :, :end], values[s.slot: s.slot + 1, :, :end], keep, scale, rows_sink)
        out[:, :, s.offset: s.offset + s.n] = o.reshape(1, hq, s.n, dv)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float,
            sink: torch.Tensor | None) -> torch.Tensor:
    """Scaled-dot-product attention with a boolean mask; ``sink`` (a logit per query row, ``[..., rows, 1]``)
    joins the softmax and adds no value, computed as gpt-oss's eager attention does (max subtracted)."""
    if sink is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))  # [B, H, rows, L]
    logits = torch.cat([scores, sink.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def _tq_attention(query: torch.Tensor, ctx: PassContext, scale: float) -> torch.Tensor:
    """Prompts (whole, nothing cached before them) attend causally to their own exact keys; the decode
    tokens of all slots in one call over the padded slot batch; a row's padding (``slot_cache``) gets zeros."""
    if ctx.static:
        return static_tq_attention(query, ctx, scale)
    plan = ctx.kv.plan
    if plan is not None and plan.packed and query.shape[2] == len(ctx.kv.segments) and \
            all(s.n == 1 for s in ctx.kv.segments):  # a decode-only pass: its output is the decode attention's
        return decode_attention(query, ctx.tq, plan, scale).unsqueeze(0)  # [1, Hq, T, D]
    out = torch.zeros_like(query)
    key, value = ctx.row
    g = query.shape[1] // key.shape[1]
    for s in ctx.kv.segments:
        if s.n == 1:
            continue
        rows = slice(s.offset, s.offset + s.n)
        keep = keep_mask(None, 1, s.n, s.n, query.device)
        out[:, :, rows] = F.scaled_dot_product_attention(
            query[:, :, rows], key[:, :, rows].repeat_interleave(g, 1), value[:, :, rows].repeat_interleave(g, 1),
            attn_mask=keep, scale=scale)
    if plan is not None:
        out[0, :, plan.offsets] = decode_attention(query, ctx.tq, plan, scale)
    return out


def decode_attention(query: torch.Tensor, arena: SlotArena, plan: DecodePlan, scale: float) -> torch.Tensor:
    """``[Hq, nd, D]``: the decode tokens of the packed row ``query`` ``[1, Hq, T, D]`` against their slots,
    one call per bucket of similar history lengths (``tqslots.Bucket``). Decode tokens first in the row
    (``plan.packed``) are read as a view, and a bucket of all of them (``whole``) is the output itself."""
    if plan.packed:
        q = query[0, :, :plan.offsets.shape[0]].transpose(0, 1).unsqueeze(2)  # [nd, Hq, 1, D], a view
    else:
        q = query[0, :, plan.offsets].transpose(0, 1).unsqueeze(2)  # [nd, Hq, 1, D]
    if plan.rows is not None and q.is_cuda:
        # One launch for every row, each reading only its own history's pages (the buckets: a launch each, and
        # each row read as far as its bucket's longest)
        from airquant.kv import triton_kernel

        keys, values, tq, paged = arena.rows_paged(plan)
        if triton_kernel.applicable(q, tq):
            part = triton_kernel.attention(q, keys, values, tq, plan.rows.keep, scale, paged=paged)
            return part[:, 0].transpose(0, 1).to(q.dtype)  # [n, 1, Hq, D] -> [Hq, n, D]
    out = None
    for bucket in plan.buckets:
        qb = q if bucket.whole else q[bucket.rows]
        if bucket.hist_len and q.is_cuda:
            # The Triton kernel reads the arena in place through its page table: no per-layer gathers of
            # windows, pages and statistics (measured on the H200 before: the GPU idled ~0.4 ms a layer
            # while the host gathered and launched).
            from airquant.kv import triton_kernel

            keys, values, tq, paged = arena.paged(plan, bucket)
            if triton_kernel.applicable(qb, tq):
                part = triton_kernel.attention(qb, keys, values, tq, bucket.keep, scale, paged=paged).transpose(1, 2)
                out = _bucket_out(out, q, bucket, part)
                continue
        keys, values, tq = arena.context(plan, bucket)
        if not bucket.hist_len:  # nothing quantized yet: exact attention over the (short) windows
            g = qb.shape[1] // keys.shape[1]
            part = F.scaled_dot_product_attention(qb, keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1),
                                                  attn_mask=bucket.keep, scale=scale)
        else:
            part = compressed_attention(qb, keys, values, tq, bucket.keep, scale).transpose(1, 2)
        out = _bucket_out(out, q, bucket, part)
    return out[:, :, 0].transpose(0, 1)


# A static pass's compressed attention launches the Triton kernel with these tiles: the autotuner times its
# configurations with synchronizing runs, which a graph capture cannot hold (and which would end static passes).
# BLOCK_N 64 and 4 warps won every H200 sweep of the autotuned list (kv/triton_kernel.py).
STATIC_TILES = {"block_n": 64, "num_warps": 4}


def static_tq_attention(query: torch.Tensor, ctx: PassContext, scale: float) -> torch.Tensor:
    """A static pass's decode tokens ``[1, Hq, T, D]`` against their slots, every row in one call: each window
    whole (``win_cap`` columns) and ``tq_hist`` history tokens, a mask built on the device from the rows' history
    and window lengths keeping each row's own columns ([sink | history | recent], as ``tqslots._buckets`` lays
    them out). Only device tensors at fixed addresses and the pass's ``tq_hist``: a layer graph captures it."""
    kv, arena = ctx.kv, ctx.tq
    slots, offsets = kv._decode[0], kv._decode[2]
    rows, h, width = slots.shape[0], kv.tq_hist, arena.win_cap
    sink = min(arena.kv.sink, width)
    keep = keep_columns(kv._tq_static[1, :rows, None], kv._tq_static[2, :rows, None], sink, width, h)
    q = query[0, :, offsets].transpose(0, 1).unsqueeze(2)  # [n, Hq, 1, D]
    part = None
    if h and q.is_cuda:
        from airquant.kv import triton_kernel

        keys, values, tq, paged = arena.static_paged(slots, h, kv._tq_static[1, :rows])
        if triton_kernel.applicable(q, tq):
            part = triton_kernel.attention(q, keys, values, tq, keep, scale, paged=paged, **STATIC_TILES)
    if part is None and h:
        keys, values, tq = arena.static_context(slots, h)
        part = compressed_attention(q, keys, values, tq, keep, scale, kernel=False)
    if part is None:  # nothing quantized yet: exact attention over the windows
        keys, values = arena.t["win_k"][slots], arena.t["win_v"][slots]
        g = q.shape[1] // keys.shape[1]
        part = F.scaled_dot_product_attention(q, keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1),
                                              attn_mask=keep, scale=scale).transpose(1, 2)
    out = torch.zeros_like(query)
    out[0, :, offsets] = part[:, 0].to(query.dtype).transpose(0, 1)  # [n, 1, Hq, D] -> [Hq, n, D]
    return out


def _bucket_out(out: torch.Tensor | None, q: torch.Tensor, bucket, part: torch.Tensor) -> torch.Tensor:
    """``part`` (``[n, Hq, 1, D]``, the bucket's rows) placed in the pass's ``[nd, Hq, 1, D]`` output."""
    if bucket.whole:
        return part.to(q.dtype)
    if out is None:
        out = torch.empty_like(q)
    out[bucket.rows] = part
    return out


def attention_backends():
    """Scaled-dot-product attention without its cuDNN backend, which PyTorch prefers on Hopper.

    cuDNN builds an execution plan for every new sequence length, tens of milliseconds of CPU at each
    decode step (the KV cache grows by one token). The stall holds back the next layer copies: on an
    H200 a streamed step of 8 bf16 layers took 123 ms instead of the 64 ms its copies need.
    """
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def register_ragged_attention() -> None:
    """The attention function and a mask builder that builds nothing (the loop passes its own 4D mask)."""
    AttentionInterface.register(ATTN_NAME, ragged_attention)
    AttentionMaskInterface.register(ATTN_NAME, lambda *args, **kwargs: None)
