"""KV offload: a streamed layer's cache lives in pinned host memory between the layer's runs.

``LayerStreamer`` owns one :class:`KVOffload` when the plan offloads the cache. Before layer i runs,
its cache is copied to the device on the copy stream right after the layer's weights, into a
device buffer paired with the layer's weight slot: the compute waits for the same (later) event,
and the next copy into the slot waits for the same compute. After the layer ran, only what changed
goes back (non-blocking, on the copy stream, after the compute): the tokens the step appended, and
the small parts a step rewrites whole (the TurboQuant cache's exact window). The layer's cache
tensors then point at host memory again, so nothing of it stays on the device between steps.

Layout. Append-only tensors (a ``DynamicLayer``'s keys/values, the TurboQuant store's packed codes
and norms, all ``[B, H, T, ...]``) are kept token-major on the host, ``[T, B, H, ...]``: the prefix
in use and each step's new tokens are then contiguous and move in one copy each (a strided copy
between host and device goes through pageable temporaries), and growth keeps the prefix in place.
On the device, a ``DynamicLayer`` gets the token-major block as a ``[B, H, T, D]`` view, which its
``update`` only concatenates onto; the TurboQuant store gets its own layout with room to append in
place (one device-side copy), because its attention reads the packed history directly. A hybrid
stack's linear-attention / state-space / conv layers (``LinearAttentionLayer``) hold fixed-size states
that each step rewrites in place: they travel whole, both ways, every step (small beside the weights).

On CPU (``ops`` None) the same path runs with plain copies: "host" and "device" are both CPU memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from airquant.errors import AirQuantError

log = logging.getLogger(__name__)

ALIGN = 256  # bytes: every region of a device buffer starts aligned for any dtype and for fast copies
DEVICE_GROWTH = 1.25  # a device buffer that is too small grows to 1.25x what is needed now
APPEND_ROOM = 256  # tokens the TurboQuant store can append on the device without reallocating


class KVOffloadError(AirQuantError):
    """The cache cannot be offloaded as it is (an unsupported cache layer, a cache cut shorter)."""


# -- what a cache layer holds ------------------------------------------------------------------
@dataclass
class LayerState:
    """A cache layer's tensors: append-only ``[B, H, cap, ...]`` (first ``length`` in use) and whole ones."""

    append: dict[str, torch.Tensor]
    length: int
    whole: dict[str, torch.Tensor | None]


class _Plain:
    """transformers' ``DynamicLayer``: keys/values ``[B, H, T, D]``, grown by concatenation."""

    in_place = False  # update() concatenates onto the keys: a token-major view will do
    rewritten = False  # a whole part that changed is a new tensor: one still installed is unchanged

    @staticmethod
    def read(layer) -> LayerState:
        return LayerState({"keys": layer.keys, "values": layer.values}, layer.keys.shape[-2], {})

    @staticmethod
    def write(layer, state: LayerState) -> None:
        layer.keys, layer.values = state.append["keys"], state.append["values"]


class _TurboQuant:
    """airquant's ``TQLayer``: the packed history (append-only) and the exact window and statistics."""

    in_place = True  # the store appends into its tensors and the attention reads them in this layout
    rewritten = False

    @staticmethod
    def read(layer) -> LayerState:
        return LayerState(*layer.offload_state())

    @staticmethod
    def write(layer, state: LayerState) -> None:
        layer.load_state(state.append, state.whole)


class _Recurrent:
    """transformers' ``LinearAttentionLayer`` (a hybrid stack's linear-attention, state-space or conv
    layer): fixed-size conv / recurrent states, no tokens to append. A step rewrites them in place
    (``copy_`` keeps their address), so they go back whole after every run."""

    in_place = False
    rewritten = True

    @staticmethod
    def read(layer) -> LayerState:
        whole = {f"conv.{j}": t for j, t in layer.conv_states.items()}
        whole.update({f"recurrent.{j}": t for j, t in layer.recurrent_states.items()})
        return LayerState({}, 0, whole)

    @staticmethod
    def write(layer, state: LayerState) -> None:
        for name, t in state.whole.items():
            group, _, j = name.partition(".")
            (layer.conv_states if group == "conv" else layer.recurrent_states)[int(j)] = t


class _PlainAndRecurrent:
    """transformers' ``LinearAttentionAndFullAttentionLayer`` (Falcon-H1: attention and a Mamba state in
    one layer): keys/values as ``_Plain``, the states as ``_Recurrent`` (its only whole parts)."""

    in_place = False
    rewritten = True

    @staticmethod
    def read(layer) -> LayerState:
        return LayerState(_Plain.read(layer).append, layer.keys.shape[-2], _Recurrent.read(layer).whole)

    @staticmethod
    def write(layer, state: LayerState) -> None:
        _Plain.write(layer, state)
        _Recurrent.write(layer, state)


def _kind(layer):
    from transformers import cache_utils

    from airquant.kv.cache import TQLayer

    if isinstance(layer, TQLayer):
        return _TurboQuant
    # The linear-attention layer classes are newer than some transformers 5.x releases: look them up by name.
    names = {"DynamicLayer": _Plain, "LinearAttentionLayer": _Recurrent,
             "LinearAttentionAndFullAttentionLayer": _PlainAndRecurrent}
    kinds = {getattr(cache_utils, n): k for n, k in names.items() if hasattr(cache_utils, n)}
    if type(layer) in kinds:
        return kinds[type(layer)]
    raise KVOffloadError(f"KV offload supports transformers' DynamicLayer, LinearAttentionLayer (and both in one) and "
                         f"the TurboQuant ('tq') cache, not {type(layer).__name__}; use --no-kv-offload (or --kv tq).")


def _holds_state(layer) -> bool:
    """Whether a cache layer holds tensors yet (a layer without attention or state never does)."""
    from transformers import cache_utils

    # Both classes are newer than some transformers 5.x releases (5.17 has neither): absent, no layer is one.
    dummy = getattr(cache_utils, "DummyLayer", ())
    linear = getattr(cache_utils, "LinearAttentionCacheLayerMixin", ())
    if dummy and isinstance(layer, dummy):
        return False
    if linear and isinstance(layer, linear) and not hasattr(layer, "is_initialized"):
        return any(layer.is_conv_states_initialized.values()) or any(layer.is_recurrent_states_initialized.values())
    return layer.is_initialized


# -- host side ---------------------------------------------------------------------------------
@dataclass
class _HostPart:
    """One tensor in host memory: token-major ``[cap, *row]`` (append) or a whole tensor of ``shape``."""

    buf: torch.Tensor  # flat uint8
    dtype: torch.dtype
    row: tuple[int, ...] = ()  # append parts: [B, H, ...] of one token
    shape: tuple[int, ...] | None = None  # whole parts: the tensor's shape (None: the tensor is None)

    @property
    def row_bytes(self) -> int:
        return _numel(self.row) * self.dtype.itemsize

    def tokens(self, start: int, end: int) -> torch.Tensor:
        """Token-major ``[end - start, *row]`` view."""
        rb = self.row_bytes
        return self.buf[start * rb: end * rb].view(self.dtype).view(end - start, *self.row)

    def whole(self) -> torch.Tensor:
        return self.buf[: _numel(self.shape) * self.dtype.itemsize].view(self.dtype).view(self.shape)


@dataclass
class _Record:
    """What the host holds of one layer's cache."""

    kind: type
    length: int = 0  # tokens of the append parts on the host
    append: dict[str, _HostPart] = field(default_factory=dict)
    whole: dict[str, _HostPart] = field(default_factory=dict)
    installed: dict[str, torch.Tensor | None] = field(default_factory=dict)  # whole parts as brought in


@dataclass
class _Staged:
    """A layer's cache copied (or being copied) into a device buffer, not yet handed to the layer."""

    binding: int
    slot: int
    buf: torch.Tensor
    append: dict[str, tuple[int, int]]  # name -> (offset, bytes) of its token-major block
    whole: dict[str, int | None]  # name -> offset (None: the tensor is None)
    room: dict[str, int]  # in-place kinds: name -> offset of its [B, H, length + APPEND_ROOM, ...] tensor


class KVOffload:
    """Owns the host copies of the streamed layers' caches and the device buffers they pass through.

    ``bind(cache)`` before a generation, ``unbind()`` after; the streamer calls ``bring_in`` when it
    issues a layer's copy, ``enter`` before the layer runs and ``leave`` after it ran.
    """

    def __init__(self, layers: list[int], ops, memory, slots: int):
        self.layers = set(layers)
        self.ops, self.memory = ops, memory
        self._device: list[torch.Tensor | None] = [None] * max(slots, 1)
        self._records: dict[int, _Record] = {}
        self._pool: dict[tuple[int, str], torch.Tensor] = {}  # host buffers kept across generations
        self._staged: dict[int, _Staged] = {}
        self._last = None  # event of the last copy issued (the copy stream runs them in order)
        self.cache = None
        self._binding = 0
        self._tokens = 0

    # -- binding -----------------------------------------------------------------------------
    def bind(self, cache, tokens: int = 0) -> None:
        """Offload ``cache`` from now on; ``tokens`` (prompt + new) sizes the host buffers once."""
        self.unbind()
        self.cache, self._tokens = cache, tokens
        self._binding += 1

    def unbind(self) -> None:
        """Forget the cache (its layers keep pointing at host buffers that the next one reuses)."""
        self.cache = None
        self._records.clear()
        self._staged.clear()

    def _layer(self, i: int):
        if self.cache is None or i not in self.layers or i >= len(self.cache.layers):
            return None
        layer = self.cache.layers[i]
        return layer if _holds_state(layer) else None

    # -- host -> device ----------------------------------------------------------------------
    def bring_in(self, i: int, slot: int, after=None):
        """Copy layer i's cache into the device buffer of ``slot``; the event to wait for (None: nothing)."""
        rec = self._records.get(i)
        if self._layer(i) is None or rec is None:
            self._staged.pop(i, None)
            return None
        offset, append, whole, room = 0, {}, {}, {}
        for name, part in rec.append.items():
            append[name] = (offset, rec.length * part.row_bytes)
            offset += _aligned(append[name][1])
        for name, part in rec.whole.items():
            whole[name] = None if part.shape is None else offset
            offset += 0 if part.shape is None else _aligned(_numel(part.shape) * part.dtype.itemsize)
        if rec.kind.in_place:
            for name, part in rec.append.items():
                room[name] = offset
                offset += _aligned((rec.length + APPEND_ROOM) * part.row_bytes)
        buf = self._device_buffer(slot, offset)
        done = None
        for name, (off, nbytes) in append.items():
            done = self._copy(buf[off: off + nbytes], rec.append[name].buf[:nbytes], after) or done
        for name, off in whole.items():
            if off is not None:
                nbytes = _numel(rec.whole[name].shape) * rec.whole[name].dtype.itemsize
                done = self._copy(buf[off: off + nbytes], rec.whole[name].buf[:nbytes], after) or done
        self._staged[i] = _Staged(self._binding, slot, buf, append, whole, room)
        return done

    def ensure(self, i: int, slot: int, after=None):
        """``bring_in`` unless the copy already issued for this slot and this cache stands."""
        staged = self._staged.get(i)
        if staged is not None and staged.binding == self._binding and staged.slot == slot:
            return None
        return self.bring_in(i, slot, after)

    def enter(self, i: int) -> None:
        """Hand layer i its cache on the device (after the compute stream waited for the copy)."""
        staged = self._staged.pop(i, None)
        layer = self._layer(i)
        if staged is None or layer is None or staged.binding != self._binding:
            return
        rec = self._records[i]
        append = {}
        for name, (off, _) in staged.append.items():
            part = rec.append[name]
            append[name] = _view(staged.buf, off, part.dtype, (rec.length, *part.row)).movedim(0, 2)  # [B, H, T, ...]
            if rec.kind.in_place:
                room = _view(staged.buf, staged.room[name], part.dtype,
                             (*part.row[:2], rec.length + APPEND_ROOM, *part.row[2:]))
                room[:, :, : rec.length].copy_(append[name])
                append[name] = room
        whole = {name: None if off is None else _view(staged.buf, off, rec.whole[name].dtype, rec.whole[name].shape)
                 for name, off in staged.whole.items()}
        rec.installed = whole
        rec.kind.write(layer, LayerState(append, rec.length, whole))

    # -- device -> host ----------------------------------------------------------------------
    def leave(self, i: int) -> None:
        """Send back what layer i's run changed and point its cache at host memory again."""
        layer = self._layer(i)
        if layer is None:
            return
        rec = self._records.get(i) or self._records.setdefault(i, _Record(_kind(layer)))
        kind = rec.kind
        state = kind.read(layer)
        if state.length < rec.length:
            raise KVOffloadError(f"layer {i}: the cache went from {rec.length} to {state.length} tokens; an "
                                 "offloaded cache only grows (no cropping, beam search or assisted decoding).")
        outgoing: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host destination, device source)
        for name, t in state.append.items():
            part = self._append_part(i, rec, name, t, state.length)
            if state.length > rec.length:
                new = t[:, :, rec.length: state.length].movedim(2, 0).contiguous()  # [L, B, H, ...]
                outgoing.append((part.tokens(rec.length, state.length), new))
        for name, t in state.whole.items():
            if not kind.rewritten and name in rec.whole and t is rec.installed.get(name, _EMPTY):
                continue  # unchanged since it came in: the host copy stands
            part = self._whole_part(i, rec, name, t)
            if t is not None and t.numel():
                outgoing.append((part.whole(), t.contiguous()))
        self._send(outgoing)
        rec.length = state.length
        rec.installed = {}
        append = {name: rec.append[name].tokens(0, rec.length).movedim(0, 2) for name in state.append}
        whole = {name: None if p.shape is None else p.whole() for name, p in rec.whole.items()}
        kind.write(layer, LayerState(append, rec.length, whole))

    def _send(self, outgoing: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self.ops is None:
            for dst, src in outgoing:
                dst.copy_(src)
            return
        if not outgoing:
            return
        after = self.ops.mark()  # the layer's compute and the contiguous copies above
        for dst, src in outgoing:
            _, self._last = self.ops.copy(dst, src, after)
            self.ops.retire(src)

    def _append_part(self, i: int, rec: _Record, name: str, t: torch.Tensor, length: int) -> _HostPart:
        row = (*t.shape[:2], *t.shape[3:])
        part = rec.append.get(name)
        if part is None:
            part = rec.append[name] = _HostPart(self._pool.get((i, name), _EMPTY), t.dtype, row)
        assert part.row == row and part.dtype == t.dtype, f"layer {i} {name}: rows changed shape"
        tokens = max(length, self._tokens)
        if part.buf.numel() < length * part.row_bytes:
            # Doubling keeps growth amortized when a generation runs past the tokens it announced.
            grown = max(tokens, 2 * part.buf.numel() // max(part.row_bytes, 1))
            self._regrow(i, name, part, grown * part.row_bytes, keep=rec.length * part.row_bytes)
        return part

    def _whole_part(self, i: int, rec: _Record, name: str, t: torch.Tensor | None) -> _HostPart:
        part = rec.whole.get(name)
        if part is None:
            part = rec.whole[name] = _HostPart(self._pool.get((i, name), _EMPTY), torch.uint8)
        part.shape = None if t is None else tuple(t.shape)
        if t is not None:
            part.dtype = t.dtype
            nbytes = t.numel() * t.dtype.itemsize
            if part.buf.numel() < nbytes:
                self._regrow(i, name, part, max(nbytes, 2 * part.buf.numel()), keep=0)
        return part

    def _regrow(self, i: int, name: str, part: _HostPart, nbytes: int, keep: int) -> None:
        """Replace a host buffer by one of ``nbytes``, keeping its first ``keep`` bytes."""
        old, part.buf = part.buf, self.memory.empty(nbytes)
        if old.numel():
            if self._last is not None:
                self.ops.host_wait(self._last)  # a copy from or into the old buffer may still be queued
            part.buf[:keep].copy_(old[:keep])
            self.memory.free(old)
        self._pool[(i, name)] = part.buf

    # -- device buffers ----------------------------------------------------------------------
    def _device_buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._device[slot]
        if buf is not None and buf.numel() >= nbytes:
            return buf
        if buf is not None and self.ops is not None:
            self.ops.retire(buf)  # copies into it may still be queued
        size = int(nbytes * DEVICE_GROWTH) if buf is not None else nbytes
        self._device[slot] = self.ops.alloc(size) if self.ops is not None else torch.empty(size, dtype=torch.uint8)
        return self._device[slot]

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, after):
        if not dst.numel():
            return None
        if self.ops is None:
            dst.copy_(src)
            return None
        self._last = self.ops.copy(dst, src, after)[1]
        return self._last

    # -- reporting ---------------------------------------------------------------------------
    def host_bytes(self) -> int:
        """Host memory held for offloaded caches (allocated, slack included)."""
        return sum(b.numel() for b in self._pool.values())

    def device_bytes(self) -> int:
        """Device memory of the buffers caches pass through (one per weight slot)."""
        return sum(b.numel() for b in self._device if b is not None)

    def host_storages(self) -> set[int]:
        """Data pointers of the host buffers (to check what a cache's tensors point at)."""
        return {b.data_ptr() for b in self._pool.values()}


_EMPTY = torch.empty(0, dtype=torch.uint8)


def _view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return buf[offset: offset + _numel(shape) * dtype.itemsize].view(dtype).view(shape)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN
