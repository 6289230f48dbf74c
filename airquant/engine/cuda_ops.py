"""The device side of the streamer: exact-size page-locked host memory and the CUDA copy stream.

``LayerStreamer`` talks to the device only through ``CudaOps``' few methods, so tests can drive the
same ordering logic on CPU tensors with a simulated copy stream.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import sys
import weakref

import torch

log = logging.getLogger(__name__)
PAGE = 4096
HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and arm64 (4 KB base pages)
MADV_HUGEPAGE = 14  # linux/mman.h


def advise_huge_pages(buf: torch.Tensor) -> bool:
    """Ask Linux to back ``buf``'s untouched pages with transparent huge pages (``madvise(MADV_HUGEPAGE)``; what
    it gets depends on ``/sys/kernel/mm/transparent_hugepage``); whether the call was accepted."""
    if not sys.platform.startswith("linux") or buf.numel() == 0:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.madvise(ctypes.c_void_p(buf.data_ptr()), ctypes.c_size_t(buf.numel() * buf.element_size()),
                        MADV_HUGEPAGE) == 0


class HostMemory:
    """Host buffers, page-locked on CUDA at their exact size.

    ``pin_memory=True`` goes through torch's caching host allocator, which rounds every block up to a
    power of two (a 481 MB layer pins 512 MB, a 1.1 GB one 2 GB); registering an ordinary allocation
    with ``cudaHostRegister`` pins exactly what the RAM budget counted. Registration is undone when
    the owner is closed or collected.
    """

    def __init__(self, pinned: bool):
        self.pinned = pinned
        self._registered: list[torch.Tensor] = []
        # Buffers from torch's pinned allocator after a failed registration, with the rounded bytes it holds.
        self._rounded: list[tuple[torch.Tensor, int]] = []
        self._finalizer = weakref.finalize(self, _unregister, self._registered)

    def empty(self, nbytes: int, pinned: bool | None = None, huge_pages: bool = False) -> torch.Tensor:
        """``nbytes`` host bytes starting on a page, page-locked when ``pinned`` (default: the owner's).

        On a page, so the offsets the layouts align (engine/moe/sizing ``ALIGN``) are aligned in memory too:
        a large allocation's address is only 64-byte aligned, and a kernel reading host RAM over the link
        loses ~15 % on rows that straddle 128-byte lines. ``huge_pages``: on a 2 MB boundary, its pages
        advised huge before the registration touches them (``advise_huge_pages``)."""
        pinned = self.pinned if pinned is None else pinned
        align = HUGE_PAGE if huge_pages else PAGE
        raw = torch.empty(nbytes + align, dtype=torch.uint8)
        skip = -raw.data_ptr() % align
        buf = raw[skip:skip + nbytes]
        if huge_pages:
            advise_huge_pages(buf)
        if not pinned or nbytes == 0 or (err := self._register(buf)) == 0:
            return buf
        del buf, raw
        held = pinned_allocator_bytes(nbytes)
        log.warning("cudaHostRegister of %d bytes failed (error %d); using torch's pinned allocator, which "
                    "holds %d bytes for it (rounded up to a power of two)", nbytes, err, held)
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._rounded.append((buf, held))
        return buf

    def register(self, buf: torch.Tensor) -> bool:
        """Page-lock ``buf`` (a host buffer of its own, from ``empty(..., pinned=False)``) at its exact size and
        keep it registered until ``free`` or ``close``; False where the host refuses (nothing registered)."""
        return self._register(buf) == 0

    def _register(self, buf: torch.Tensor) -> int:
        """``cudaHostRegister`` of ``buf``: its error code, 0 where registered (kept in ``_registered``)."""
        cudart = torch.cuda.cudart()
        err = int(getattr(code := cudart.cudaHostRegister(buf.data_ptr(), buf.numel() * buf.element_size(), 0),
                          "value", code))
        if err == 0:
            self._registered.append(buf)
        elif hasattr(cudart, "cudaGetLastError"):  # do not leave the error for the next kernel launch check
            cudart.cudaGetLastError()
        return err

    def free(self, buf: torch.Tensor) -> None:
        """Unpin a buffer from ``empty`` that is being replaced (its last copy must have run)."""
        for k, registered in enumerate(self._registered):
            if registered is buf:
                torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
                del self._registered[k]
                return
        self._rounded = [(b, held) for b, held in self._rounded if b is not buf]

    def pinned_bytes(self) -> dict[str, int]:
        """Page-locked host memory held now: registered at its exact size, and what torch's pinned
        allocator holds for the buffers it took over (rounded; ``rounding`` is the excess)."""
        exact = sum(b.numel() for b in self._registered)
        rounded = sum(held for _, held in self._rounded)
        return {"registered": exact, "allocator": rounded,
                "rounding": rounded - sum(b.numel() for b, _ in self._rounded)}

    def close(self) -> None:
        self._rounded.clear()
        self._finalizer()


def pinned_allocator_bytes(nbytes: int) -> int:
    """What torch's caching host allocator (``pin_memory=True``) holds for ``nbytes``: the next power of two
    (CachingHostAllocator's ``PowerOf2Ceil``; pytorch/pytorch#150517)."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes > 0 else 0


def _unregister(buffers: list[torch.Tensor]) -> None:
    if not buffers:
        return
    cudart = torch.cuda.cudart()
    for buf in buffers:
        cudart.cudaHostUnregister(buf.data_ptr())
    buffers.clear()


class CudaOps:
    """The device calls the streamer makes: one copy stream, events, asynchronous copies.

    Tests substitute an object with the same methods that runs them on CPU tensors, eagerly or
    lazily, to check the ordering rules without a GPU.
    """

    def __init__(self, device: torch.device, timing: bool = False):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.out_stream: torch.cuda.Stream | None = None  # device-to-host copies (``copy_out``), made at first use
        self.timing = timing

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy_target(self, like: torch.Tensor) -> torch.Tensor:
        """A new device tensor like ``like`` (its shape, dtype and strides) for copies on the copy stream to fill.
        The caching allocator hands a block the host freed on the compute stream straight back to that stream's
        next allocation, though kernels queued before the free may still read it; a copy on another stream would
        overwrite it under them (PyTorch's CUDA semantics: a side stream must wait for the work it may race). So
        the copy stream waits here for what the compute stream has queued so far, and the tensor is marked as
        used by the copy stream (not handed out again before the copies into it ran, even if never read). A
        block of the compute stream's own pool: allocating it in the copy stream's would keep those bytes from
        the compute stream's allocations under a tight VRAM cap. Under a graph capture (where no caller makes
        one today) nothing waits: an event recorded in the capture would pull the copy stream into it."""
        dst = torch.empty_like(like, device=self.device)
        dst.record_stream(self.stream)
        if not torch.cuda.is_current_stream_capturing():
            self.stream.wait_event(self.mark())
        return dst

    def _event(self):
        return torch.cuda.Event(enable_timing=self.timing)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after) -> tuple[object, object]:
        """Copy ``src`` (pinned host) into ``dst`` on the copy stream once ``after`` has fired.

        Returns (start, done) events; ``start`` is None unless timing is on."""
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            start = None
            if self.timing:
                start = self._event()
                start.record(self.stream)
            dst.copy_(src, non_blocking=True)
            done = self._event()
            done.record(self.stream)
        return start, done

    def copy_out(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], after) -> object:
        """Copy each (``dst`` pinned host, ``src`` device) pair on a stream of its own once ``after`` (an event of
        the compute stream) has fired: the link's other direction, beside the copy stream's weights and never in
        the compute stream's order. Returns the event of the last copy; ``src`` stays allocated until it ran."""
        if self.out_stream is None:
            self.out_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self.out_stream):
            self.out_stream.wait_event(after)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
                src.record_stream(self.out_stream)
            done = self._event()
            done.record(self.out_stream)
        return done

    def wait(self, event) -> None:
        """Make the compute stream wait for ``event`` (no host block)."""
        torch.cuda.current_stream(self.device).wait_event(event)

    def mark(self):
        """An event on the compute stream: everything enqueued so far has run when it fires."""
        event = self._event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def host_wait(self, event) -> None:
        event.synchronize()

    @staticmethod
    def elapsed_ms(start, end) -> float:
        return start.elapsed_time(end)


@contextlib.contextmanager
def vram_cap(device: torch.device, max_bytes: int | None):
    """PyTorch's allocator held to ``max_bytes`` of ``device`` while the block runs, the previous cap restored
    after: ``--max-vram`` makes a pass run out of memory rather than take more, without capping the rest of
    the process (another engine, a reference model) outside the engine's passes."""
    if device.type != "cuda" or not max_bytes:
        yield
        return
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # absent from older torch: uncapped
    previous = getter(device) if getter is not None else 1.0
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, max_bytes / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(previous, device)
