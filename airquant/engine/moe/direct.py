"""Direct expert reads: a few-row routed call's NF4, int2, GPTQ or AWQ experts are read by the fused kernel itself,
where they are, without a copy and without the routing ever reaching the host (quant/kernels/nf4_moe
``tiered_*``, int2_moe ``tiered_*_int2``, gptq_moe ``tiered_*_gptq``).

Why: Qwen3-30B-A3B at batch 1 moved 1.55 GB a step in 0.154 s where its bytes allow 0.028 s (H200,
benchmarks/moe_bench.py). The pool's path reads each call's routing to the host (a sync that stops the host
until the GPU has caught up), then books slots, queues a copy per expert and launches: the host and the GPU
take turns, ~3 ms a layer. Here the routing stays on the device and a layer's expert work is three launches
with no sync, so the host queues layer i+1 while the GPU still runs layer i.

Where an expert is read from (a per-layer ``table`` on the device): a VRAM **hot set** slot (the pool's cache
slots), else the pinned RAM tier over the link (unified virtual addressing). A hot-set hit costs nothing on the
link and nothing on the host. The kernel counts each layer's routed pairs per expert on the device; every
``REFRESH_PASSES`` passes the counts are read (one sync) into scores (``--expert-policy``: lfu decays the counts
so far and adds these, lru stamps each routed expert with the pass), and the hot set becomes the top-scoring
experts over all layers: experts that left are pointed back at the RAM tier first, then the new
ones are copied into the freed slots and pointed at, all in the compute stream's order (a kernel queued
before the refresh reads the old slots; one queued after, the new ones).

Applies where a layer's experts are NF4, int2, GPTQ or AWQ (``compute.fused_experts``; int2 rows in whole 16-code
words; gpt-oss's bias rows are read from the image too), its bytes are in the arranged RAM tier (``layout.HostArrangement``) and its router picks only stored
experts; other calls take the pool's copy path. Counters are per (token, expert) pair, which at batch 1 is per
expert, as the copy path counts.
"""

from __future__ import annotations

import functools
import logging

import torch

from airquant.engine import layer_graphs
from airquant.engine.decode import loop as decode_loop
from airquant.engine.moe import compute as expert_compute
from airquant.engine.moe import sizing
from airquant.engine.moe.layout import LayerExperts
from airquant.kv.rotation import to_device

log = logging.getLogger(__name__)
# Passes between two hot-set refreshes (each reads the counts: one host sync; the decode loop syncs once a pass
# anyway, for its tokens). Every pass: Mixtral-8x7B at batch 1 hit 69 % and ran 0.088 s a step; every 8 passes
# the hot set was still empty within moe_bench's measured steps (0.175 s); Qwen3-30B-A3B, host-bound, 0.145 s
# against 0.140 (H200, same run).
REFRESH_PASSES = 1
HOT_DECAY = 0.5  # weight of the scores so far at a refresh: what was hot 4 refreshes ago counts 1/16
# A refresh reads the counts as of the refresh before (copied to the host then, without a sync), not the counts
# so far (a sync: the host waits for the device). None: where the decode loop queues passes ahead
# (engine/decode/loop.py QUEUE_AHEAD), whose next pass a refresh's sync would keep from overlapping this one.
LATE_COUNTS: bool | None = None


# The buffers' dtypes the int2 tiered kernel reads (quant/int2.py writes these).
INT2_DTYPES = {"codes": torch.uint8, "scales": torch.float16, "zeros": torch.float16,
               "outlier_weight": torch.float16, "outlier_idx": torch.int32}


def _int2_images(spec) -> tuple | None:
    """(spec, up, down ``int2_moe.ImageMatrixInt2``) of an int2 experts module, or None: a matrix the tiered
    kernel does not take (``int2_moe.tiered_applies``) or a buffer of another dtype."""
    from airquant.quant.kernels import int2_moe

    if any(spec.dtypes.get(name, dtype) != dtype for name, dtype in INT2_DTYPES.items()) or \
            not all(int2_moe.tiered_int2_applies(m.n, m.k, spec.group) for m in (spec.up, spec.down)):
        return None
    return spec, *(int2_moe.ImageMatrixInt2(m.n, m.k, spec.group, m.n_out, m.cols,
                                             tuple(m.offsets.get(b) for b in int2_moe.BUFFERS), m.bias)
                   for m in (spec.up, spec.down))


# The buffers' dtypes the GPTQ tiered kernel reads (quant/gptq.py ``GPTQLinear``'s).
GPTQ_DTYPES = {"qweight": torch.int32, "qzeros": torch.int32, "scales": torch.float16, "g_idx": torch.int32}


def _gptq_images(spec) -> tuple | None:
    """(spec, up, down ``gptq_moe.ImageMatrixGPTQ``) of a GPTQ or AWQ experts module (AWQ: no ``g_idx``), or None:
    a matrix the tiered kernel does not take or a buffer of another dtype."""
    from airquant.quant.kernels import gptq_moe

    wanted = {k: v for k, v in GPTQ_DTYPES.items() if spec.scheme == "gptq" or k != "g_idx"}
    if any(spec.dtypes.get(name) != dtype for name, dtype in wanted.items()) or \
            not all(gptq_moe.tiered_gptq_applies(m.n, m.k, spec.bits) for m in (spec.up, spec.down)):
        return None
    return spec, *(gptq_moe.ImageMatrixGPTQ(m.n, m.k, spec.bits, spec.zero_offset,
                                             tuple(m.offsets.get(b) for b in gptq_moe.BUFFERS), m.bias,
                                             spec.awq_group(m))
                   for m in (spec.up, spec.down))


def tiered_kernels(scheme: str) -> tuple:
    """The (up, down) tiered GEMVs of an experts format (they take the same arguments)."""
    from airquant.quant.kernels import gptq_moe, int2_moe, nf4_moe

    if scheme == "nf4":
        return nf4_moe.tiered_up, nf4_moe.tiered_down
    if scheme == "int2":
        return int2_moe.tiered_up_int2, int2_moe.tiered_down_int2
    return gptq_moe.tiered_up_gptq, gptq_moe.tiered_down_gptq  # GPTQ and AWQ


class DirectReads:
    """Owns the device tables, counters and the hot set of direct reads for a pool's routed layers."""

    def __init__(self, layers: dict[int, LayerExperts], eligible: set[int], mem: torch.Tensor, hot_slots: range,
                 device: torch.device, host_image, policy: str = "lfu", spec_slots: range = range(0)):
        self.layers, self.eligible, self.mem, self.device = layers, eligible, mem, device
        self.policy = policy  # --expert-policy: lfu ranks by decayed counts, lru by the last pass that used one
        self.host_image = host_image  # i -> (layer i's RAM-tier bytes or None, its HostArrangement or None)
        self.hot_slots = hot_slots  # pool slots the hot set may use (the plan's cache slots)
        num = max((len(layer.ranges) for layer in layers.values()), default=0)
        rows = max(layers, default=-1) + 1
        self.table = torch.full((rows, num), -1, dtype=torch.int32, device=device)
        self.counts = torch.zeros((rows, num), dtype=torch.int32, device=device)
        self.hits = torch.zeros(rows, dtype=torch.int64, device=device)
        self.scratch_hits = torch.zeros(1, dtype=torch.int64, device=device)  # copied reads' (not counted)
        self.scores = torch.zeros((rows, num), dtype=torch.float64)
        self._stored: torch.Tensor | None = None  # [rows, num]: the eligible layers' stored experts (``_top``)
        self.hot: dict[tuple[int, int], int] = {}  # (layer, expert) -> slot
        self.routed = [0] * rows  # pairs computed by direct reads, per layer (known on the host: no sync)
        self.hot_bytes = 0  # copied into the hot set
        self.passes = 0
        self.first: int | None = None  # the lowest layer that ran direct: its calls count the passes
        self._matrices: dict[int, tuple | None] = {}
        self._books: dict[int, dict[str, torch.Tensor]] = {}
        self._reachable: bool | None = None if mem.is_cuda else True
        self._late: tuple | None = None  # LATE_COUNTS: the pinned counts of the last refresh and their copy's event
        # Speculative reads: pool slots of their own (never the copy path's nor the hot set's), the guesses of
        # the layer whose call has not run yet, the images copied per layer (counted on the device).
        self.spec_slots = spec_slots
        self._spec_ids = torch.tensor(list(spec_slots), dtype=torch.int32, device=device)
        self._pending: dict[int, tuple] = {}
        # counted on the device (a replayed graph runs no Python): calls guessed, images copied, per layer
        self.spec_calls = torch.zeros(rows, dtype=torch.int64, device=device)
        self.spec_copied = torch.zeros(rows, dtype=torch.int64, device=device)
        self._side = torch.cuda.Stream(device) if mem.is_cuda and spec_slots else None

    def reachable(self, src: torch.Tensor) -> bool:
        """Whether the GPU reads the RAM tier (``src``, a layer's pinned buffer) exactly: probed once, by the
        gather kernel against the copy engine (engine/uva_copy); where not, every call takes the copy path."""
        if self._reachable is None:
            from airquant.engine.moe import uva_copy

            self._reachable = uva_copy.probe(src, self.device)
        return self._reachable

    def matrices(self, i: int, module) -> tuple | None:
        """Layer i's (spec, up image matrix, down image matrix), or None: its experts module does not qualify."""
        if i not in self._matrices:
            from airquant.quant.kernels.nf4_moe import BIAS_KINDS, BUFFERS, ImageMatrix

            layer = self.layers[i]
            spec = expert_compute.fused_experts(module, layer.names, layer.dtypes, layer.offsets,
                                                schemes=expert_compute.FUSED_SCHEMES)
            if spec is None or any(m.bias is not None and m.bias[1] not in BIAS_KINDS for m in (spec.up, spec.down)):
                self._matrices[i] = None
            elif spec.scheme == "int2":
                self._matrices[i] = _int2_images(spec)
            elif spec.scheme in ("gptq", "awq"):
                self._matrices[i] = _gptq_images(spec)
            elif spec.up.k % 8 or spec.down.k % 8 or spec.blocksize % 8:
                self._matrices[i] = None
            else:
                def image(m):
                    return ImageMatrix(m.n, m.k, spec.blocksize, spec.double, tuple(m.offsets.get(b) for b in BUFFERS),
                                       m.bias)

                self._matrices[i] = (spec, image(spec.up), image(spec.down))
        return self._matrices[i]

    def run(self, i: int, module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
            src: torch.Tensor, arranged) -> torch.Tensor | None:
        """The experts call on ``hidden`` [T, H] routed by ``index``/``weights`` [T, k], read directly; None where
        the layer does not qualify (the caller's copy path runs it)."""
        found = self.matrices(i, module) if i in self.eligible else None
        if found is None:
            return None
        pending = self._join(i)  # before a refresh writes the table the speculation wrote
        work = functools.partial(self._host_part, i, index.numel())
        if not layer_graphs.host_work(work):  # a layer graph's runner runs it before each replay
            work()
        spec, up_m, down_m = found
        tiers = self.tiers(i, src, arranged)
        up, down = tiered_kernels(spec.scheme)
        flat = hidden.reshape(-1, hidden.shape[-1])
        h = expert_compute.activate(module, up(flat, index, up_m, tiers), spec.gated)  # [T * k, I]
        out = down(h, index, weights, down_m, tiers, hidden.dtype)  # [T, H]
        if pending is not None:
            self._settle(i, pending)
        return out

    def tiers(self, i: int, src: torch.Tensor, arranged, table: torch.Tensor | None = None,
              hits: torch.Tensor | None = None):
        """Layer i's ``Tiers`` for the tiered kernels: its RAM-tier bytes, the pool, its device code books (NF4),
        and a table and hit counter: the hot set's, or ``table``/``hits`` (copied reads: the call's working
        slots, whose reads are no hot-set hits)."""
        from airquant.quant.kernels import nf4_moe

        spec, up_m, down_m = self._matrices[i]
        if spec.scheme == "nf4" and i not in self._books:
            self._books[i] = self.code_books(src, arranged, (up_m, down_m))
        return nf4_moe.Tiers(src, arranged.experts_start, arranged.stride, self.mem,
                             self.table[i] if table is None else table, self.counts[i],
                             self.hits[i:i + 1] if hits is None else hits, **self._books.get(i, {}))

    # -- speculative reads -------------------------------------------------------------------------------
    def speculate(self, i: int, hidden: torch.Tensor, norm, gate: torch.Tensor, top_k: int) -> bool:
        """Guess layer i's experts from its input ``hidden`` (one token) before its attention runs: ``gate``
        ([E, H], the router's weight) over ``norm(hidden)`` (the norm the router's input takes), the ``top_k``
        largest logits; copy the guessed images that are not in the hot set into the speculative slots and point
        layer i's table at them. On a GPU all of it runs on a side stream beside the attention, with no host
        sync (engine/moe/uva_copy reads the RAM tier); the layer's call waits for it (``_join``) and points the
        table back after its kernels (``_settle``). A wrong guess costs link time the attention left idle; the
        routed experts are read as ever. Returns whether it speculated: only with speculative slots (the plan's
        ``spec_guesses``: the top that many are guessed, ``sizing.SPECULATE_GUESSES`` fewer) unless
        ``sizing.SPECULATE`` is False, where the layer has run by direct reads before (its images and
        reachability known)."""
        guesses = min(top_k, len(self.spec_slots), sizing.SPECULATE_GUESSES or top_k)
        if sizing.SPECULATE is False or not guesses or i not in self.eligible or self._matrices.get(i) is None or \
                hidden.numel() != hidden.shape[-1] or self._reachable is not True:
            return False
        src, arranged = self.host_image(i)
        if src is None or arranged is None:
            return False
        for j in list(self._pending):  # a guess whose call never came (an aborted forward): its table entries
            self._settle(j, self._join(j))  # would point at slots the next guesses overwrite
        if self._side is None:
            self._pending[i] = self._guess_and_copy(i, hidden, norm, gate, guesses, src, arranged)
            return True
        current = torch.cuda.current_stream(self.device)
        self._side.wait_stream(current)
        with torch.cuda.stream(self._side):
            guess, free = self._guess_and_copy(i, hidden, norm, gate, guesses, src, arranged)
            if not torch.cuda.is_current_stream_capturing():  # a graph's pool keeps them until it is freed
                for t in (guess, free):
                    t.record_stream(current)  # read by _settle on the compute stream
                hidden.record_stream(self._side)  # the compute stream's tensor, read here
        self._pending[i] = (guess, free)
        return True

    def _guess_and_copy(self, i: int, hidden: torch.Tensor, norm, gate: torch.Tensor, guesses: int, src, arranged):
        """The ``guesses`` largest logits' experts (on the device) and which of them were copied (not in the hot
        set), the table set. On a GPU three launches beside the norm and the logits (engine/moe/uva_copy
        ``spec_plan``, ``gather_images``); on the CPU the same in torch."""
        x = norm(hidden).reshape(1, -1)
        experts = len(arranged.expert_ranges)
        logits = (x.to(gate.dtype) @ gate.t()).reshape(-1)[:experts]
        slots = self._spec_ids[:guesses]
        if self.mem.is_cuda:
            from airquant.engine.moe import uva_copy

            guess = torch.empty(guesses, dtype=torch.int64, device=self.device)
            free = torch.empty(guesses, dtype=torch.int32, device=self.device)
            uva_copy.spec_plan(logits.contiguous(), self.table[i], slots, guess, free, self.spec_copied[i:i + 1],
                               self.spec_calls[i:i + 1])
            uva_copy.gather_images(src, self.mem, guess, free, slots, arranged.expert_start(0), arranged.stride,
                                   arranged.image_bytes, experts)
            return guess, free
        guess = logits.topk(guesses).indices
        held = self.table[i].index_select(0, guess)
        free = held < 0
        for e, slot, copy in zip(guess.tolist(), slots.tolist(), free.tolist()):
            if copy:
                at = arranged.expert_start(e)
                self.mem[slot, :arranged.image_bytes].copy_(src[at:at + arranged.image_bytes])
        self.table[i].index_put_((guess,), torch.where(free, slots, held))
        self.spec_copied[i:i + 1].add_(free.sum())
        self.spec_calls[i:i + 1].add_(1)
        return guess, free

    def _join(self, i: int) -> tuple | None:
        """Layer i's speculation, the compute stream made to wait for it (None: none)."""
        pending = self._pending.pop(i, None)
        if pending is not None and self._side is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
        return pending

    def _settle(self, i: int, pending: tuple) -> None:
        """After layer i's kernels: the entries the speculation set point back at the RAM tier (-1), on the compute
        stream, unless a hot-set refresh pointed one at its hot slot meanwhile; the slots are free for the next
        layer's guesses."""
        guess, free = pending
        slots = self._spec_ids[:guess.numel()]
        if self.table.is_cuda:
            from airquant.engine.moe import uva_copy

            uva_copy.spec_settle(self.table[i], guess, free, slots)
            return
        row = self.table[i]
        held = row.index_select(0, guess)
        row.index_put_((guess,), torch.where(free.bool() & (held == slots), torch.full_like(slots, -1), held))

    def code_books(self, src: torch.Tensor, arranged, matrices) -> dict[str, torch.Tensor]:  # NF4 only
        """The NF4 code books (``quant_map``, ``nested_quant_map``) every expert image of a layer's RAM-tier
        bytes holds, as device copies, where all images and ``matrices`` agree; else {} (each image's own).

        The kernel looks a code book up eight times a packed word; reading each image's copy from host memory
        costs the link (Qwen3-30B-A3B's down projection read host RAM at 15 GB/s against 31 with device
        copies: benchmarks/uva_bench.py, H200). bitsandbytes writes the same tables into every matrix; a
        store whose images differ keeps the images' own."""
        from airquant.quant.kernels.nf4_moe import BUFFERS

        experts = len(arranged.expert_ranges)
        images = src[arranged.experts_start:arranged.experts_start + experts * arranged.stride].view(experts, -1)
        books = {}
        for name, size in (("quant_map", 16), ("nested_quant_map", 256)):
            found = None
            for m in matrices:
                off = m.offsets[BUFFERS.index(name)]
                if off is None:
                    continue
                rows = images[:, off:off + 4 * size]
                if not bool((rows == rows[0]).all()) or (found is not None and not torch.equal(rows[0], found)):
                    return {}
                found = rows[0]
            if found is not None:
                book = found.clone().view(torch.float32)
                books[name] = to_device(book, self.device)
        return books

    def _host_part(self, i: int, pairs: int) -> None:
        """A call's host side: the pass count (the first direct layer's calls), the refresh, the pair count."""
        if self.first is None or i < self.first:
            self.first = i
        if i == self.first:
            self.passes += 1
            if self.hot_slots and self.passes % REFRESH_PASSES == 0:
                self.refresh()
        self.routed[i] += pairs

    def refresh(self) -> None:
        """The hot set becomes the top-scoring experts (decayed counts), in the compute stream's order."""
        counts = self._take_counts()
        if self.policy == "lru":  # the pass an expert was last routed in: the most recent ones stay
            self.scores = torch.where(counts > 0, float(self.passes), self.scores)
        else:
            self.scores.mul_(HOT_DECAY).add_(counts)
        want = self._top(len(self.hot_slots))
        leaving = {key: slot for key, slot in self.hot.items() if key not in want}
        if not leaving and len(want) == len(self.hot):
            return
        for key in leaving:
            del self.hot[key]
        free = sorted(set(self.hot_slots) - set(self.hot.values()))
        if leaving:  # pointed back at the RAM tier before their slots are overwritten
            self._write_table(list(leaving), [-1] * len(leaving))
        entering = [key for key in want if key not in self.hot]
        copied = []
        for key, slot in zip(entering, free):
            src, arranged = self.host_image(key[0])
            if src is None or arranged is None:
                continue
            start = arranged.expert_start(key[1])
            self.mem[slot, :arranged.image_bytes].copy_(src[start:start + arranged.image_bytes],
                                                        non_blocking=self.mem.is_cuda)
            self.hot[key] = slot
            self.hot_bytes += self.layers[key[0]].expert_bytes(key[1])
            copied.append((key, slot))
        if copied:
            self._write_table([k for k, _ in copied], [s for _, s in copied])

    def _take_counts(self) -> torch.Tensor:
        """The counts to score (float64, host) and zeroed on the device: those so far (one host sync), or with
        ``LATE_COUNTS`` on a GPU those the last refresh copied (their copy waited for; it ran a pass ago) while
        these are copied for the next."""
        late = LATE_COUNTS if LATE_COUNTS is not None else decode_loop.queues_ahead(self.counts.device)
        if not (late and self.counts.is_cuda):
            counts = self.counts.to("cpu", torch.float64)  # the one host sync of a refresh
            self.counts.zero_()
            return counts
        if self._late is None:
            self._late = (torch.zeros(self.counts.shape, dtype=self.counts.dtype, pin_memory=True), None)
        host, copied = self._late
        if copied is not None:
            copied.synchronize()
        counts = host.to(torch.float64)  # zeros at the first refresh
        host.copy_(self.counts, non_blocking=True)
        self.counts.zero_()
        done = torch.cuda.Event()
        done.record()
        self._late = (host, done)
        return counts

    def _top(self, n: int) -> set[tuple[int, int]]:
        """The ``n`` (layer, expert) keys of the highest positive scores among eligible layers' stored experts."""
        if n <= 0:
            return set()
        if self._stored is None:  # built once: a slice per layer cost ~0.4 ms of host time a refresh (H100 trace)
            self._stored = torch.zeros_like(self.scores, dtype=torch.bool)
            for i in self.eligible:
                self._stored[i, :len(self.layers[i].ranges)] = True
        flat = torch.where(self._stored, self.scores, 0.0).reshape(-1)
        top = torch.topk(flat, min(n, flat.numel()))
        num = self.scores.shape[1]
        picked = top.indices[top.values > 0]
        return set(zip((picked // num).tolist(), (picked % num).tolist()))

    def _write_table(self, keys: list[tuple[int, int]], slots: list[int]) -> None:
        """Table entries set on the compute stream (after every kernel queued so far)."""
        rows = torch.tensor([k[0] for k in keys], dtype=torch.int64)
        cols = torch.tensor([k[1] for k in keys], dtype=torch.int64)
        vals = torch.tensor(slots, dtype=torch.int32)
        if self.table.is_cuda:
            rows, cols, vals = (t.pin_memory().to(self.device, non_blocking=True) for t in (rows, cols, vals))
        self.table.index_put_((rows, cols), vals)

    # -- counters ---------------------------------------------------------------------------------------
    def report(self) -> dict:
        """Pairs computed by direct reads, those read from the hot set, and bytes read over the link."""
        hits = self.hits.tolist()
        routed = sum(self.routed)
        return {"direct_pairs": routed, "direct_hits": int(sum(hits)),
                "direct_link_bytes": self.link_bytes(hits), "hot_experts": len(self.hot),
                "hot_bytes_copied": self.hot_bytes, "spec_calls": int(self.spec_calls.sum()),
                "spec_bytes_copied": self._spec_bytes()}

    def link_bytes(self, hits: list[int] | None = None) -> int:
        """Bytes the kernels read from the RAM tier (missed pairs times their expert's bytes) and the hot
        set's copies."""
        hits = self.hits.tolist() if hits is None else hits  # a speculated expert's reads count as hits
        return self.hot_bytes + self._spec_bytes() + sum((self.routed[i] - hits[i]) * self.layers[i].expert_bytes(0)
                                                         for i in self.layers if self.routed[i])

    def _spec_bytes(self) -> int:
        """Bytes the speculative reads copied (their images, counted on the device)."""
        if not self.spec_slots:
            return 0
        copied = self.spec_copied.tolist()
        return sum(copied[i] * self.layers[i].expert_bytes(0) for i in self.layers if copied[i])

    def reset(self) -> None:
        self.hits.zero_()
        self.spec_copied.zero_()
        self.spec_calls.zero_()
        self.routed = [0] * len(self.routed)
        self.hot_bytes = 0
