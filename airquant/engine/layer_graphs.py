"""CUDA graphs of streamed decoder layers for decode passes (one token per sequence, up to ``max_rows`` rows).

Why: a Qwen3-30B-A3B batch-1 step with direct expert reads ran 0.086 s while the GPU was busy ~11 ms of it
(H200, ``moe_bench --trace``): ~64 kernel launches and ~225 torch ops a layer, each paid for on the host (an
RMSNorm is 8 ops, bitsandbytes' Python wraps each 4-bit GEMV, rope, router). A graph replays a layer's
launches in one call.

How: a layer's call is captured as graphs split around its eager *islands*. The cache's write and attention
on the device are captured too: the runner marks the cache (``SlotKV.graph_rows``), whose decode passes then
keep their slots, positions and lengths in device tensors at fixed addresses and attend over a bucketed span
(``SlotKV`` static passes; a TurboQuant arena's pages are reserved and its flushes run by the cache outside
the layer calls); the layer's key then holds the cache buffers' (arena's) addresses and the bucket, so a layer
is one graph. Where the write and the attention read lengths and slots on the host (offloaded layers) they run
eagerly between two graphs: ``SlotKV.update`` ends the first
capture and ``ragged_attention`` starts the second. A part that reads on the host (the host expert path) is
another island (``eager_island``): a graph follows it. Everything else of a decode call has static shapes for
a given number of rows: norms, projections, rope, router, and the direct-read expert kernels (they find each
expert through a table on the device). A graph reads fixed addresses, so it is keyed by the layer, the
addresses of the weights the streamer fetched for it (its device slot), the cache's (static layers) and the
call's shapes. The runner keeps the plain cache's device buffers from one loop to the next (``KVBuffers``) and
lends them to the next loop's cache, whose static layers then replay the same graphs; a cache with other
buffers (another batch, two loops at once) is captured for its own, and the graphs of a finished cache whose
buffers nobody holds are dropped when another cache comes. The layer is captured with static twins of the call's
tensors, shared by every layer: before a replay, a tensor is copied into its twin unless that twin got the same
tensor earlier in the same pass (the rope tables passed to every layer of a pass are copied once).

Host work of a layer call that is not GPU work (direct reads' pass count, hot-set refresh, counters) is
declared with ``host_work``: recorded at the warm-up call and run by the runner before each replay.

A key's first call runs eagerly (warm-up: lazy initialisation, kernel compiles), with synchronizing ops
reported outside the island (``torch.cuda.set_sync_debug_mode``); a key whose warm-up synchronized twice (the
experts' copy path reads its routing on the host; a one-time probe syncs once) is never captured, and a key whose
warm-up synchronized twice inside the static cache write or attention turns static passes off (once: it warms up
again, as a table a kernel makes at its first launch syncs once). The second
call is captured; later ones replay. A capture that fails anyway marks its key eager and the call runs again
eagerly (its cache write rewrites the same rows).

Layers whose code between the cache update and the attention call is known to be empty are captured
(``CAPTURED_LAYERS``): an op there would run once at capture and never again.

Pass graphs (``PASS_GRAPHS``): where every layer call of a decode pass replayed a one-graph entry (no island),
each layer's weights stay where they are between passes (``fixed``: resident, a dense part kept on the device;
nothing copied before the call) and each layer got the previous one's output and the first call's other
arguments, the next pass is captured as one graph: the first layer's call runs every layer's call in one
capture, and later passes replay it there. The other layers' calls then only check that they got what the
graph computed (the previous output, the same arguments, the same weights dict) and return their output: a
host cost of a few microseconds a layer instead of a key, its twins and a graph launch (a host-bound step's
whole difference: Qwen3-30B-A3B's hot-set step on the H200 waited on the host between layers, wave3_moe14).
A call that differs from what the graph ran (another weights dict, other arguments) runs as before, from its own
input: its cache write rewrites the rows the graph wrote. ``PASS_GRAPH_PARTS`` captures a pass in that many graphs,
split at layer boundaries and replayed in order, so the GPU starts on the first while the host launches the next.
"""

from __future__ import annotations

import logging
import threading
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree

from airquant.engine.decode.slots import KVBuffers, SlotKV
from airquant.kv.cache import context_of

log = logging.getLogger(__name__)

# Decoder layer classes whose attention calls the attention function right after the cache update: the island
# replays exactly those two calls. Each is decoded with emulated graphs against eager in
# tests/engine/test_layer_graphs.py (the three MoE ones on CUDA too); add a class with its test.
CAPTURED_LAYERS = frozenset({"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                             "Qwen3MoeDecoderLayer", "MixtralDecoderLayer", "GptOssDecoderLayer"})
_SIMPLE = (bool, int, float, str, type(None))
# Keys a layer may have: one per device slot it lands in, row count and (static passes) attended bucket; a layer
# whose weights move every call (dense tensors cast at fetch: a float32 store run in bf16) would add one a call:
# past the limit it runs eagerly. A key unused for STALE_PASSES passes gives its place to a new one (a long
# decode crosses buckets, a server sees every row count).
KEYS_PER_LAYER = 32
# Decode passes of up to this many rows replay graphs where every layer is dense and stays in VRAM
# (``runner.graph_rows``; elsewhere the expert kernels' limit, 8): there the host bounds a pass.
RESIDENT_ROWS = 32
STALE_PASSES = 64
# A layer's graph ends by writing its output into the static twin of its own first input (the hidden states, the
# same twin for every layer of that shape): the next layer's graph then finds its input there, and the host copies
# nothing between two layers. Each such copy was a torch call and a cudaMemcpyAsync a layer, host time a
# host-bound decode step pays (the H200 machine's Qwen3-30B-A3B hot-set step, wave3_moe14).
CARRY = True
# Whole decode passes captured in one graph (module docstring), and how many such graphs are kept (one per
# attended bucket and row count in use; the least recently replayed goes first).
PASS_GRAPHS = True
PASSES_KEPT = 8
# The graphs a pass graph is captured in, split at layer boundaries (1: one graph). A pass is ~1 500 nodes for
# Qwen3-30B-A3B at batch 1 and its cudaGraphLaunch took 1.57 ms of host time before the GPU ran its first kernel
# (H100 trace, wave3_moe33: ~12 % of the 12.0 ms hot-set step idle); in parts the GPU runs the first while the host
# launches the next. Measured (H100, wave3_moe35, each case in its own process): no difference past the runs'
# spread: the hot-set step 0.0119 and 0.0106 s in one graph against 0.0105 and 0.0110 in 4; no cache 0.0291
# against 0.0289. Kept at 1 (fewer graphs to capture and keep).
PASS_GRAPH_PARTS = 1
_local = threading.local()  # .mode: None, "warmup" or "runner"; .work: the warm-up's host work


def host_work(fn) -> bool:
    """Run ``fn`` (host-side work of a layer call: counters, a refresh that may synchronize) unless the graph
    runner owns it. Returns True where the caller must not run it: at warm-up it is run here, outside the sync
    check, and recorded; in a captured or replayed call the runner runs the recorded work itself."""
    mode = getattr(_local, "mode", None)
    if mode is None:
        return False
    if mode == "warmup":
        _local.work.append(fn)
        with _syncs_allowed():
            fn()
    return True


def eager_island(fn, *args):
    """``fn(*args)`` (one tensor out), run eagerly between two graphs of a captured layer call: a part of the call
    that reads on the host (the host expert path: ``engine/moe/host.py``). Outside a graph runner it is just
    the call. At warm-up its syncs are not held against the layer; at capture the graph so far ends, ``fn`` runs,
    and its result is the tensor the next graph reads; each replay runs ``fn`` again on the same arguments (the
    previous graph's outputs, at fixed addresses) and copies its result there."""
    recorder = getattr(_local, "recorder", None)
    if recorder is None:
        return fn(*args)
    return recorder.eager(fn, args)


class _recording:
    """``_local.recorder`` (a warm-up's sync check or a capture's ``Recorder``) for one layer call."""

    def __init__(self, recorder):
        self.recorder = recorder

    def __enter__(self):
        self.saved = getattr(_local, "recorder", None)
        _local.recorder = self.recorder

    def __exit__(self, *exc):
        _local.recorder = self.saved


class _syncs_allowed:
    def __enter__(self):
        self.mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
        if self.mode:
            torch.cuda.set_sync_debug_mode(0)

    def __exit__(self, *exc):
        if self.mode:
            torch.cuda.set_sync_debug_mode(self.mode)


class _mode:
    def __init__(self, mode: str | None, work: list | None = None):
        self.mode, self.work = mode, work

    def __enter__(self):
        self.saved = getattr(_local, "mode", None), getattr(_local, "work", None)
        _local.mode, _local.work = self.mode, self.work

    def __exit__(self, *exc):
        _local.mode, _local.work = self.saved


class Unsupported(Exception):
    """The layer call cannot be captured as a graph (it runs eagerly)."""


# -- backends: CUDA graphs, or an emulation on any device for the tests ----------------------------------------
class _PoolKeeper:
    """The memory pool handle every capture shares, renewed once every graph captured into it is gone.

    Why: the CUDA caching allocator keeps a handle's private pool only while a graph captured into it lives (its
    use count); a capture into a handle whose graphs were all destroyed fails (``TORCH_INTERNAL_ASSERT(
    it->second->use_count > 0)``). The graphs of one cache go when another cache comes (``_new_cache``): on
    2026-12-05 (H100, kv_bench) every layer of the TurboQuant rows that followed the plain rows in one engine
    failed its capture so and decoded without graphs. ``new``: a fresh handle (a factory)."""

    def __init__(self, new):
        self.new, self.handle, self.alive, self.used = new, new(), 0, False

    def take(self):
        """The handle for the next capture (a fresh one where the current one's graphs are all gone)."""
        if self.used and self.alive == 0:
            self.handle, self.used = self.new(), False
        return self.handle

    def captured(self, graph) -> None:
        """``graph``'s capture began in the handle: it holds the pool until it is destroyed."""
        self.used = True
        self.alive += 1
        weakref.finalize(graph, self._gone)

    def _gone(self) -> None:
        self.alive -= 1


class CudaBackend:
    """Graphs captured on a side stream into one memory pool shared by every layer's graphs (they replay one at a
    time, on the compute stream; the handle renewed once its graphs are all gone, ``_PoolKeeper``);
    ``thread_local``: the streamer's threads may use CUDA during a capture."""

    runs_at_capture = False  # the call's work runs at the replay that follows the capture

    def __init__(self, device: torch.device):
        self.pool = _PoolKeeper(torch.cuda.graph_pool_handle)
        self.side = torch.cuda.Stream(device)
        self.main: torch.cuda.Stream | None = None
        # cuBLAS sets up a handle and workspace per stream at its first use: done here, not inside a capture
        self.side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self.side):
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                a = torch.ones(8, 8, device=device, dtype=dtype)
                a @ a
        torch.cuda.current_stream(device).wait_stream(self.side)

    def begin(self):
        graph = torch.cuda.CUDAGraph()
        self.main = torch.cuda.current_stream()
        self.side.wait_stream(self.main)
        torch.cuda.set_stream(self.side)
        try:
            graph.capture_begin(pool=self.pool.take(), capture_error_mode="thread_local")
        except BaseException:
            torch.cuda.set_stream(self.main)
            raise
        self.pool.captured(graph)
        return graph

    def end(self, graph) -> None:
        try:
            graph.capture_end()
        finally:
            torch.cuda.set_stream(self.main)

    @staticmethod
    def replay(graph) -> None:
        graph.replay()

    @staticmethod
    def warmup():
        """Syncs in the warm-up call are reported as warnings (checked by the runner)."""
        return _SyncCheck()


class _SyncCheck:
    """Synchronizing ops of a warm-up call reported as warnings, except in its island (``island_begin`` to
    ``island_end``: set on the cache as its recorder), which stays eager."""

    def island_begin(self, *args) -> None:
        torch.cuda.set_sync_debug_mode(0)

    def island_end(self, *args) -> None:
        torch.cuda.set_sync_debug_mode("warn")

    def static_update(self, key) -> None:
        self._mark = len(self.seen)  # a static write and attention are part of the graph: their syncs count

    def static_end(self) -> None:
        if len(self.seen) > self._mark and any(_is_sync(w) for w in self.seen[self._mark:]):
            self.static_synced = True

    def eager(self, fn, args: tuple):
        self.island_begin()
        try:
            return fn(*args)
        finally:
            self.island_end()

    def __enter__(self):
        self.static_synced, self._mark = False, 0
        self.caught = warnings.catch_warnings(record=True)
        self.seen = self.caught.__enter__()
        warnings.simplefilter("always")
        self.saved = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self.saved)
        self.caught.__exit__(*exc)
        for w in self.seen:  # the call's other warnings, as they would have been given
            if not _is_sync(w):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    @property
    def synced(self) -> bool:
        return any(_is_sync(w) for w in self.seen)


def _is_sync(w) -> bool:
    return "synchronizing" in str(w.message)


class EmulatedGraph(torch.utils._python_dispatch.TorchDispatchMode):
    """What a CUDA graph keeps of a capture, emulated: the ops and the tensors they read and wrote, replayed on
    those same tensors (a new result is copied into the tensor the capture returned). A host read of a tensor
    inside the capture raises, as it does under CUDA stream capture."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    HOST_READ = "emulated graph capture: a host read of a tensor (operation not permitted when stream is capturing)"

    def __enter__(self):
        # ``tolist`` of a CPU tensor reads its memory without an op the mode sees (a copy path's routing read ran
        # in captures and replayed its first call's routing); on CUDA it is a device-to-host copy, refused
        self._tolist = torch.Tensor.tolist

        def refused(*_args, **_kwargs):
            raise RuntimeError(self.HOST_READ)

        torch.Tensor.tolist = refused
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            raise RuntimeError(self.HOST_READ)
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for old, fresh in zip(pytree.tree_leaves(out), pytree.tree_leaves(new)):
                if isinstance(old, torch.Tensor) and old is not fresh and \
                        old.untyped_storage().data_ptr() != fresh.untyped_storage().data_ptr():
                    old.copy_(fresh)


class _EmulatedPool:
    """A graph pool handle as the CUDA caching allocator keeps it: alive while a graph captured into it is; a
    capture into one whose graphs were all destroyed fails as the allocator's does."""

    def __init__(self):
        self.graphs = weakref.WeakSet()
        self.used = False

    def capture(self, graph) -> None:
        if self.used and not len(self.graphs):
            raise RuntimeError("it->second->use_count > 0 INTERNAL ASSERT FAILED (emulated CUDACachingAllocator): "
                               "a capture into a graph pool whose graphs were all destroyed")
        self.used = True
        self.graphs.add(graph)


class EmulatedBackend:
    """Layer graphs on the CPU for the tests: the same split, keys, twins and islands as on CUDA."""

    # The emulated capture runs the ops it records, so it is the call's one run, as the replay after a CUDA capture
    # is (a second run would read a twin the first wrote: the output CARRY leaves in the input's twin).
    runs_at_capture = True

    def __init__(self):
        self.pool = _PoolKeeper(_EmulatedPool)

    def begin(self):
        graph = EmulatedGraph()
        self.pool.take().capture(graph)  # as the allocator: no capture into a pool whose graphs all died
        self.pool.captured(graph)
        graph.__enter__()
        return graph

    @staticmethod
    def end(graph) -> None:
        graph.__exit__(None, None, None)

    @staticmethod
    def replay(graph) -> None:
        graph.replay()

    @staticmethod
    def warmup():
        return _NoCheck()


class _NoCheck:
    synced = static_synced = False

    def island_begin(self, *args) -> None:
        pass

    def island_end(self, *args) -> None:
        pass

    def static_update(self, key) -> None:
        pass

    def static_end(self) -> None:
        pass

    @staticmethod
    def eager(fn, args: tuple):
        return fn(*args)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


# -- one captured layer call ------------------------------------------------------------------------------
@dataclass
class _Island:
    """The eager part between a layer's two graphs: the cache update and the attention, replayed on the first
    graph's keys/values/query with the pass's cache; its output is copied where the second graph reads it."""

    layer_idx: int
    key: torch.Tensor
    value: torch.Tensor
    update_args: tuple
    update_kwargs: dict
    attention: tuple | None = None  # (fn, module, query, args after key/value, kwargs)
    out: torch.Tensor | None = None

    def run(self, kv) -> None:
        key, value = kv.update(self.key, self.value, self.layer_idx, *self.update_args, **self.update_kwargs)
        fn, module, query, rest, kwargs = self.attention
        self.out.copy_(fn(module, query, key, value, *rest, **kwargs)[0])


@dataclass
class _EagerIsland:
    """An ``eager_island`` of a captured call: ``fn`` run again on the same arguments, its result copied into
    ``out`` (the tensor the next graph reads)."""

    fn: object
    args: tuple
    out: torch.Tensor

    def run(self, kv) -> None:
        self.out.copy_(self.fn(*self.args))


@dataclass
class _Entry:
    graphs: list  # one more than the islands: graph, island, graph, ...
    twins: list  # per leaf of the call: its static twin, or None (not a tensor)
    islands: list  # _Island (the cache update and attention) and _EagerIsland, in call order
    output: object
    work: list = field(default_factory=list)
    carry: torch.Tensor | None = None  # the twin its graph writes the output into (CARRY), the next call's input


@dataclass
class _Step:
    """One replayed layer call of a traced pass: what a pass graph runs for it and checks it against."""

    index: int
    key: tuple
    entry: _Entry
    weights: dict
    call: object


@dataclass
class _Trace:
    """The layer calls of one decode pass so far (``kv``'s pass ``passes``), while each qualifies for a pass graph:
    a replay of a one-graph entry whose weights are fixed, given the previous call's output and the first call's
    other arguments (``args``, ``kwargs``)."""

    kv: weakref.ref
    passes: int
    args: tuple | None  # ids: the call's objects live through its pass, and the trace holds no cache
    kwargs: tuple | None
    steps: list
    ok: bool = True
    replayed: bool = False  # the pass ran as a pass graph: it leaves the stable trace as it is


@dataclass
class _PassEntry:
    """A decode pass in one graph (or ``PASS_GRAPH_PARTS`` graphs, in order): its steps, the output of each (the
    graphs' tensors), the first call's twins, and the cache buffers its static writes read (their addresses, checked
    before a replay)."""

    graphs: list
    steps: list
    outputs: list
    twins: list
    buffers: tuple
    keys: frozenset
    trace: _Trace  # the stable trace its steps are (another with the same keys is adopted)
    checked: tuple | None = None  # (the cache, its ``layout``) whose buffers were last found at ``buffers``
    used: int = 0  # the runner's call count at its last replay (its steps' keys are not stale before)


@dataclass
class _Replaying:
    """A pass graph replayed this pass: the calls after the first are checked against it, ``pos`` the last one."""

    entry: _PassEntry
    args: tuple  # the first call's other arguments and keywords, as ``_Trace`` keeps them
    kwargs: tuple
    pos: int = 0


class Recorder:
    """Set on the cache (``SlotKV.recorder``) while a layer call is captured: the cache update ends the first
    graph and the attention's return starts the second."""

    def __init__(self, backend, static=None):
        self.backend = backend
        self.graphs: list = []
        self.islands: list = []  # in call order; an _Island waits for its attention until island_end
        self.capturing = False
        self.static = static  # the key's ``SlotKV.static_key``: a static cache update must match it
        self.updates = 0
        self.in_static = False

    @property
    def pending(self) -> bool:
        """A cache update's island is waiting for its attention."""
        return bool(self.islands) and isinstance(self.islands[-1], _Island) and self.islands[-1].attention is None

    def begin(self) -> None:
        self.graphs.append(self.backend.begin())
        self.capturing = True

    def end(self) -> None:
        self.capturing = False
        self.backend.end(self.graphs[-1])
        if not self.backend.runs_at_capture:  # a CUDA capture records without running: the graph runs once now
            self.backend.replay(self.graphs[-1])

    def abort(self) -> None:
        if self.capturing:
            self.capturing = False
            try:
                self.backend.end(self.graphs[-1])
            except Exception:  # noqa: BLE001 - the capture is already invalid; its error was raised
                pass

    def static_update(self, key) -> None:
        """A static cache update: captured with the rest, on the buffers the call's key names."""
        self.in_static = True  # a failure from here to static_end is the static write's or attention's
        self.updates += 1
        if self.updates > 1 or not self.capturing or self.pending:
            raise Unsupported("more than one cache update in a layer call")
        if key is None or key != self.static:
            raise Unsupported("the cache update's buffers are not those of the call's key")

    def static_end(self) -> None:
        self.in_static = False  # the capture goes on

    def island_begin(self, key, value, layer_idx: int, args: tuple, kwargs: dict) -> None:
        self.updates += 1
        if self.updates > 1 or not self.capturing:
            raise Unsupported("more than one cache update in a layer call")
        self.end()
        self.islands.append(_Island(layer_idx, key, value, args, kwargs))

    def island_end(self, fn, module, query, key, value, rest: tuple, kwargs: dict, result) -> None:
        island = self.islands[-1] if self.pending else None
        ctx = context_of(key)
        if island is None or value is not island.value or ctx is None or \
                getattr(ctx, "layer", None) != island.layer_idx or key.data_ptr() != island.key.data_ptr():
            raise Unsupported("the attention did not read what the cache update returned")
        island.attention = (fn, module, query, rest, kwargs)
        island.out = result[0]
        self.begin()

    def eager(self, fn, args: tuple):
        """``eager_island`` inside a capture: the graph so far ends, ``fn`` runs, the next graph starts."""
        if not self.capturing or self.pending:
            raise Unsupported("an eager island inside another island")
        self.end()
        out = fn(*args)
        if not isinstance(out, torch.Tensor):
            raise Unsupported(f"an eager island returned {type(out).__name__}, not one tensor")
        self.islands.append(_EagerIsland(fn, args, out))
        self.begin()
        return out


class _PassRecorder(Recorder):
    """``Recorder`` of a pass graph's capture: one static cache update a layer (``layer`` sets the key it must
    match), no island."""

    def layer(self, static) -> None:
        self.static, self.updates = static, 0

    def island_begin(self, *args) -> None:
        raise Unsupported("a cache update outside the graph in a pass graph")

    def eager(self, fn, args: tuple):
        raise Unsupported("an eager island in a pass graph")


def _flatten(args: tuple, kwargs: dict) -> tuple[list, tuple] | None:
    """A layer call's arguments as leaves and a hashable spec (a decoder layer's: tensors, flags, the cache, and
    tuples of tensors such as the rope tables); None for deeper nesting (the call runs eagerly). A call's key
    took 33 us with torch's pytree on this repo's CPU, 7.8 us with this."""
    leaves, shape = [], []
    for v in (*args, *kwargs.values()):
        if type(v) is tuple or type(v) is list:
            if any(type(x) in (tuple, list, dict) for x in v):
                return None
            shape.append(len(v) if type(v) is tuple else -2 - len(v))
            leaves.extend(v)
        elif type(v) is dict:
            return None
        else:
            shape.append(-1)
            leaves.append(v)
    return leaves, (len(args), tuple(kwargs), tuple(shape))


def _ids(args: tuple | None, kwargs: dict | None) -> tuple[tuple, tuple]:
    """A call's arguments after the first and its keywords as object ids: two calls of one pass with equal ids got
    the same objects (they live through the pass)."""
    if args is None:
        return (), ()
    return tuple(map(id, args[1:])), tuple(zip(kwargs, map(id, kwargs.values())))


def _run_work(steps: list) -> None:
    """The host work of every step of a pass graph, in pass order, before its capture or replay."""
    for step in steps:
        for fn in step.entry.work:
            fn()


def _unflatten(leaves: list, spec: tuple) -> tuple[tuple, dict]:
    nargs, names, shape = spec
    values, n = [], 0
    for size in shape:
        if size == -1:
            values.append(leaves[n])
            n += 1
        elif size >= 0:
            values.append(tuple(leaves[n:n + size]))
            n += size
        else:
            values.append(list(leaves[n:n - 2 - size]))
            n += -2 - size
    return tuple(values[:nargs]), dict(zip(names, values[nargs:]))


class LayerGraphs:
    """The graphs of a model's streamed layers (``skeleton.StreamedLayer`` calls ``run``)."""

    def __init__(self, backend, max_rows: int):
        self.backend = backend
        # Decode passes of up to this many rows are captured: the engine gives the fused and direct expert
        # kernels' limit (engine/moe/compute.FUSED_TOKENS); larger calls read their routing on the host anyway.
        self.max_rows = max_rows
        self._entries: dict[tuple, _Entry] = {}
        self._work: dict[tuple, list] = {}  # warmed-up keys -> their host work
        self._eager: set[tuple] = set()  # keys that synchronize or failed to capture
        self._synced: dict[tuple, int] = {}  # warm-ups that synchronized, per key
        self._static_synced: dict[tuple, int] = {}  # warm-ups that synchronized in the static write or attention
        self._twins: dict[tuple, torch.Tensor] = {}  # (leaf position, shape, dtype) -> static twin
        # id(twin) -> (the tensor it got, the cache (weakly) and its pass then): inference tensors have no
        # version counter, and a graph's output is the same tensor every pass, so "the same tensor" holds within
        # one pass only
        self._held: dict[int, tuple] = {}
        self._keys: dict[int, dict] = {}  # layer -> the keys it was called with -> the call count at their last use
        self._calls = 0  # layer calls so far (for the keys' last use)
        self._weights: dict[int, tuple[dict, tuple]] = {}  # layer -> (its last weights dict, their addresses)
        self._full: set[int] = set()  # layers whose keys reached the limit (logged once)
        self._kv: weakref.ref | None = None  # the cache of the last call
        self.buffers = KVBuffers()  # the plain cache's device buffers, lent from one loop's cache to the next
        # Static passes (the cache write and attention in the graphs) until one fails: a static key's capture
        # failed or its warm-up synchronized in the write or attention. Then every cache keeps the island.
        self.static_ok = True
        self._trace: _Trace | None = None  # the pass being traced for a pass graph
        self._stable: _Trace | None = None  # the last pass traced whole, every call qualifying
        self._passes: dict[tuple, _PassEntry] = {}  # its first call's key -> pass graph (oldest replay first)
        self._no_pass: set[tuple] = set()  # first keys whose pass capture failed
        self._replaying: _Replaying | None = None
        self.stats = {"replays": 0, "captures": 0, "eager": 0, "failed": 0, "input_copies": 0, "pass_replays": 0,
                      "pass_captures": 0, "pass_calls": 0, "pass_breaks": 0}

    @classmethod
    def for_device(cls, device: torch.device, enabled: bool, max_rows: int) -> "LayerGraphs | None":
        """CUDA graphs on a CUDA device where ``enabled`` (``--cuda-graphs``), else None."""
        if not enabled or device.type != "cuda":
            return None
        return cls(CudaBackend(device), max_rows)

    def run(self, index: int, layer, weights: dict, call, args: tuple, kwargs: dict, fixed: bool = False):
        """``call(*args, **kwargs)`` (the layer with ``weights`` in place), replayed from graphs where it can;
        ``fixed``: the weights stay where they are from one call to the next, with nothing copied before a call
        (``LayerStreamer.fixed``), which a pass graph needs."""
        if self._replaying is not None:
            out = self._pass_next(index, weights, args, kwargs)
            if out is not None:
                return out
        flat = _flatten(args, kwargs)
        if flat is None:
            return call(*args, **kwargs)
        leaves, spec = flat
        kv = next((x for x in leaves if isinstance(x, SlotKV)), None)
        if kv is None or type(layer).__name__ not in CAPTURED_LAYERS:
            return call(*args, **kwargs)
        kv.graph_rows = self.max_rows if self.static_ok else 0  # its next decode passes are static (SlotKV.begin)
        if kv.pool is None and self.buffers.attach(kv):  # before its first update makes its buffers
            kv.pool = self.buffers
        if kv.prefix or not 0 < len(kv.segments) <= self.max_rows or any(s.n != 1 for s in kv.segments):
            return call(*args, **kwargs)
        if self._kv is None or self._kv() is not kv:
            self._new_cache(kv)
        sig = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                sig.append((tuple(x.shape), x.dtype, x.device))
            elif isinstance(x, _SIMPLE):
                sig.append(x)
            elif x is kv:
                sig.append(SlotKV)
            else:
                return call(*args, **kwargs)
        static = kv.static_key(index)
        last = self._weights.get(index)
        if last is None or last[0] is not weights:  # the streamer hands the same dict while the buffer is the same
            last = self._weights[index] = (weights, tuple(t.data_ptr() for t in weights.values()))
        key = (index, spec, tuple(sig), last[1], static)
        self._calls += 1
        seen = self._keys.setdefault(index, {})
        entry = self._entries.get(key)
        if entry is not None:
            seen[key] = self._calls
            if PASS_GRAPHS:
                out = self._trace_step(kv, _Step(index, key, entry, weights, call), leaves, spec, args, kwargs, fixed)
                if out is not None:
                    return out
            return self._replay(entry, leaves, kv)
        self._spoil(kv)
        if key not in seen and len(seen) >= KEYS_PER_LAYER and not self._drop_stale(seen):
            if index not in self._full:
                log.info("layer %d: its weights or shapes change from call to call; it runs without a graph", index)
                self._full.add(index)
            self.stats["eager"] += 1
            return call(*args, **kwargs)
        seen[key] = self._calls
        if key in self._eager:
            self.stats["eager"] += 1
            return call(*args, **kwargs)
        if key not in self._work:
            work: list = []
            with self.backend.warmup() as check, _mode("warmup", work), _recording(check):
                kv.recorder = check
                try:
                    out = call(*args, **kwargs)
                finally:
                    kv.recorder = None
            if check.static_synced and self.static_ok:
                # Twice for the same key turns static passes off; once may be a first call's lazy set-up (a table
                # made and copied at a kernel's first launch), so the key warms up again at its next call.
                self._static_synced[key] = self._static_synced.get(key, 0) + 1
                if self._static_synced[key] < 2:
                    return out
                self._static_off(index, "its cache write or attention synchronized at two warm-ups")
            if check.synced:
                self._synced[key] = self._synced.get(key, 0) + 1
                if self._synced[key] >= 2:
                    log.info("layer %d: its decode call synchronizes with the GPU; it runs without a graph",
                             index)
                    self._eager.add(key)
            else:
                self._work[key] = work
            return out
        return self._capture(key, call, leaves, spec, kv)

    def _drop_stale(self, seen: dict) -> bool:
        """Forget the keys of a layer (``seen``) unused for ``STALE_PASSES`` passes (a pass calls every layer once,
        so as many layer calls times the layers with keys); whether any went."""
        oldest = self._calls - STALE_PASSES * max(1, len(self._keys))
        fresh = set().union(*(p.keys for p in self._passes.values() if p.used >= oldest))  # replayed in a pass graph
        stale = [k for k, last in seen.items() if last < oldest and k not in fresh]
        for key in stale:
            self._forget(key)
        return bool(stale)

    def _forget(self, key: tuple) -> None:
        for first in [k for k, p in self._passes.items() if key in p.keys]:
            del self._passes[first]
        self._stable = self._trace = self._replaying = None
        self._entries.pop(key, None)
        self._work.pop(key, None)
        self._eager.discard(key)
        self._synced.pop(key, None)
        self._static_synced.pop(key, None)
        self._keys.get(key[0], {}).pop(key, None)

    def _static_off(self, index: int, why: str) -> None:
        """No more static passes (from the next pass on): layers keep the cache write and attention as an
        island, as before they were captured (their graphs then key on no cache buffer)."""
        if self.static_ok:
            self.static_ok = False
            self.buffers.clear()
            log.warning("layer %d: its decode call with the cache write and attention could not be captured (%s); "
                        "the layer graphs leave them between two graphs from the next pass on", index, why)

    def _new_cache(self, kv) -> None:
        """Another cache's calls from now on: the static layers' keys that name other buffers than this cache's
        go (their graphs read those caches' buffers); those it shares (lent by ``buffers``) stay."""
        self._kv = weakref.ref(kv)
        live = {t.data_ptr() for t in kv._k if t is not None}
        for key in [k for keys in self._keys.values() for k in keys if k[-1] is not None and k[-1][1] not in live]:
            self._forget(key)

    def _twin(self, position: int, x: torch.Tensor) -> torch.Tensor:
        slot = (position, tuple(x.shape), x.dtype, x.device)
        twin = self._twins.get(slot)
        if twin is None:
            twin = self._twins[slot] = torch.empty_like(x, memory_format=torch.contiguous_format)
        return twin

    def _load(self, twins: list, leaves: list, kv) -> None:
        for twin, x in zip(twins, leaves):
            if twin is None:
                continue
            held = self._held.get(id(twin))
            if held is None or held[0] is not x or held[1]() is not kv or held[2] != kv.passes:
                twin.copy_(x)
                self.stats["input_copies"] += 1
                self._held[id(twin)] = (x, weakref.ref(kv), kv.passes)  # weak: a finished loop's cache is freed

    def _carried(self, entry: _Entry, kv) -> None:
        """``entry``'s graph has just written its output into its carry twin: a next call given that output as its
        first input reads it there (``_load`` copies nothing)."""
        if entry.carry is not None:
            self._held[id(entry.carry)] = (entry.output, weakref.ref(kv), kv.passes)

    def _capture(self, key: tuple, call, leaves: list, spec, kv):
        twins = [self._twin(n, x) if isinstance(x, torch.Tensor) else None for n, x in enumerate(leaves)]
        self._load(twins, leaves, kv)
        static = [t if t is not None else x for t, x in zip(twins, leaves)]
        c_args, c_kwargs = _unflatten(static, spec)
        work = self._work.pop(key)
        for fn in work:
            fn()
        recorder = Recorder(self.backend, key[-1])
        kv.recorder = recorder
        try:
            with _mode("runner"), _recording(recorder):
                recorder.begin()
                out = call(*c_args, **c_kwargs)
                if recorder.pending:
                    raise Unsupported("the cache update was not followed by the attention")
                carry = twins[0] if CARRY and isinstance(out, torch.Tensor) and twins and twins[0] is not None \
                    and (out.shape, out.dtype, out.device) == (twins[0].shape, twins[0].dtype, twins[0].device) \
                    else None
                if carry is not None:
                    carry.copy_(out)  # captured: the graph's last op
                recorder.end()
        except BaseException as err:  # noqa: BLE001 - any capture failure: the call runs eagerly instead
            recorder.abort()
            if not isinstance(err, Exception):  # an interrupt: nothing is kept
                raise
            kv.recorder = None
            self._eager.add(key)
            self.stats["failed"] += 1
            if recorder.in_static:
                self._static_off(key[0], f"{type(err).__name__}: {err}")
            self._held.clear()
            log.warning("layer %d: its decode call could not be captured as a CUDA graph (%s: %s); it runs "
                        "without one", key[0], type(err).__name__, err)
            args, kwargs = _unflatten(leaves, spec)
            with _mode("runner"):  # its host work ran above
                return call(*args, **kwargs)
        finally:
            kv.recorder = None
        entry = self._entries[key] = _Entry(recorder.graphs, twins, recorder.islands, out, work, carry)
        self._carried(entry, kv)
        self.stats["captures"] += 1
        return out

    # -- pass graphs ----------------------------------------------------------------------------------
    def _spoil(self, kv) -> None:
        """A call of ``kv``'s pass that a pass graph cannot hold (warm-up, capture, eager)."""
        if self._first_call(kv):
            self._new_trace(kv, None, None)
        self._trace.ok = False

    def _first_call(self, kv) -> bool:
        """Whether a call is its pass's first one (the trace is of another pass or another cache)."""
        t = self._trace
        return t is None or t.passes != kv.passes or t.kv() is not kv

    def _new_trace(self, kv, args, kwargs) -> _Trace:
        """A new pass: the one traced so far becomes the stable one where it qualified whole."""
        t = self._trace
        if t is not None and not t.replayed:
            self._stable = t if t.ok and t.steps else None
        self._trace = _Trace(weakref.ref(kv), kv.passes, *_ids(args, kwargs), [])
        return self._trace

    def _trace_step(self, kv, step: _Step, leaves: list, spec, args: tuple, kwargs: dict, fixed: bool):
        """Trace a replayed call; at a pass's first call, its pass graph's replay (captured first if new), whose
        output for this call is returned (None: the call replays its own graph)."""
        entry = step.entry
        ok = fixed and len(entry.graphs) == 1 and not entry.islands and isinstance(entry.output, torch.Tensor) \
            and bool(args) and isinstance(args[0], torch.Tensor)
        if self._first_call(kv):
            t = self._new_trace(kv, args, kwargs)
            st = self._stable
            if ok and st is not None and st.steps[0].key == step.key and st.steps[0].weights is step.weights:
                found = self._passes.get(step.key)
                if found is not None and self._matches(found, st, kv):
                    self._passes[step.key] = self._passes.pop(step.key)  # the most recently used last
                    return self._replay_pass(found, leaves, kv, args, kwargs)
                if found is None and step.key not in self._no_pass:
                    out = self._capture_pass(st.steps, leaves, spec, kv, args, kwargs)
                    if out is not None:
                        return out
        else:
            t = self._trace
            ok = ok and t.ok and args[0] is t.steps[-1].entry.output and _ids(args, kwargs) == (t.args, t.kwargs)
        if t.ok and ok:
            t.steps.append(step)
        else:
            t.ok = False
        return None

    def _matches(self, entry: _PassEntry, st: _Trace, kv) -> bool:
        """Whether ``entry`` runs the stable trace's steps on ``kv``'s buffers (each checked once, not every pass)."""
        if entry.trace is not st:
            if [s.key for s in entry.steps] != [s.key for s in st.steps] or \
                    any(a.weights is not b.weights for a, b in zip(entry.steps, st.steps)):
                return False
            entry.trace = st
        if entry.checked is None or entry.checked[0]() is not kv or entry.checked[1] != kv.layout:
            if self._buffers_of(kv, st.steps) != entry.buffers:
                return False
            entry.checked = (weakref.ref(kv), kv.layout)
        return True

    @staticmethod
    def _buffers_of(kv, steps: list) -> tuple:
        """The addresses of the cache buffers (arenas) and static tensors the steps' static writes read."""
        return (kv._static.data_ptr() if kv._static is not None else None,
                kv._tq_static.data_ptr() if kv._tq_static is not None else None,
                *(kv.addresses(s.index) for s in steps))

    def _capture_pass(self, steps: list, leaves: list, spec, kv, args: tuple, kwargs: dict):
        """Every step's call in one capture, from this call's inputs (in the first step's twins), each step's
        output the next one's input; the first step's output (None: the capture failed, the call goes on alone)."""
        first = steps[0]
        twins = first.entry.twins
        self._load(twins, leaves, kv)
        static = [t if t is not None else x for t, x in zip(twins, leaves)]
        c_args, c_kwargs = _unflatten(static, spec)
        _run_work(steps)
        recorder = _PassRecorder(self.backend)
        kv.recorder = recorder
        outputs = []
        try:
            with _mode("runner"), _recording(recorder):
                recorder.begin()
                hidden = c_args[0]
                per = -(-len(steps) // max(PASS_GRAPH_PARTS, 1))  # layers a graph
                for n, step in enumerate(steps):
                    if n and n % per == 0:  # the next part: its first layer reads the last one's output
                        recorder.end()
                        recorder.begin()
                    recorder.layer(step.key[-1])
                    out = step.call(hidden, *c_args[1:], **c_kwargs)
                    if recorder.pending or not isinstance(out, torch.Tensor) or \
                            (out.shape, out.dtype) != (step.entry.output.shape, step.entry.output.dtype):
                        raise Unsupported("a layer of the pass returned another output than its own graph")
                    outputs.append(out)
                    hidden = out
                recorder.end()
        except BaseException as err:  # noqa: BLE001 - the pass's calls run as before (their host work ran here)
            recorder.abort()
            if not isinstance(err, Exception):
                raise
            self._no_pass.add(first.key)
            self._held.clear()
            self._trace.ok = False
            log.warning("a decode pass could not be captured as one CUDA graph (%s: %s); its layers replay their "
                        "own graphs", type(err).__name__, err)
            return None
        finally:
            kv.recorder = None
        entry = _PassEntry(list(recorder.graphs), list(steps), outputs, twins, self._buffers_of(kv, steps),
                           frozenset(s.key for s in steps), self._stable, (weakref.ref(kv), kv.layout))
        self._passes[first.key] = entry
        while len(self._passes) > PASSES_KEPT:
            del self._passes[next(iter(self._passes))]
        self.stats["pass_captures"] += 1
        return self._replayed(entry, args, kwargs)

    def _replay_pass(self, entry: _PassEntry, leaves: list, kv, args: tuple, kwargs: dict):
        _run_work(entry.steps)
        self._load(entry.twins, leaves, kv)
        for graph in entry.graphs:
            self.backend.replay(graph)
        self.stats["pass_replays"] += 1
        return self._replayed(entry, args, kwargs)

    def _replayed(self, entry: _PassEntry, args: tuple, kwargs: dict):
        """The pass graph has run (or is queued): the first call's output; its steps' keys count as used."""
        self._trace.ok, self._trace.replayed = False, True  # this pass is not traced: the stable one stays
        self._calls += len(entry.steps) - 1  # the first call was counted by run
        entry.used = self._calls
        self.stats["pass_calls"] += 1
        self._replaying = _Replaying(entry, *_ids(args, kwargs)) if len(entry.steps) > 1 else None
        return entry.outputs[0]

    def _pass_next(self, index: int, weights: dict, args: tuple, kwargs: dict):
        """A call after the first of a pass replayed as one graph: its output there, where it got what the graph
        ran for it; else None (it runs on its own, and the next pass is traced again)."""
        r = self._replaying
        pos = r.pos + 1
        step = r.entry.steps[pos]
        if step.index == index and step.weights is weights and args and args[0] is r.entry.outputs[r.pos] and \
                _ids(args, kwargs) == (r.args, r.kwargs):
            r.pos = pos
            self.stats["pass_calls"] += 1
            if pos == len(r.entry.steps) - 1:
                self._replaying = None
            return r.entry.outputs[pos]
        self._replaying = self._stable = None
        self.stats["pass_breaks"] += 1
        return None

    def _replay(self, entry: _Entry, leaves: list, kv):
        for fn in entry.work:
            fn()
        self._load(entry.twins, leaves, kv)
        replay = self.backend.replay
        replay(entry.graphs[0])
        for island, graph in zip(entry.islands, entry.graphs[1:]):
            island.run(kv)
            replay(graph)
        self._carried(entry, kv)
        self.stats["replays"] += 1
        return entry.output

    def clear(self) -> None:
        """Drop every graph (their memory pool goes with the last reference)."""
        self._entries.clear()
        self._weights.clear()
        self._work.clear()
        self._eager.clear()
        self._synced.clear()
        self._static_synced.clear()
        self._keys.clear()
        self._twins.clear()
        self._held.clear()
        self._kv = None
        self.buffers.clear()
        self._full.clear()
        self._passes.clear()
        self._no_pass.clear()
        self._stable = self._trace = self._replaying = None
