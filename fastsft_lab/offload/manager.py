"""The offload manager: pinned pool, staging slots, the registry of inputs waiting for their backward.

Stream ordering (CUDA; "compute" is the stream autograd runs the layer on, "copy" the manager's own stream). Every
cross-stream hazard and the operation that orders it:

* forward, layer input ``x`` (written by compute) -> pool slot (D2H on copy): ``copy.wait_stream(compute)``
  before the copy; ``x.record_stream(copy)`` so the allocator does not hand ``x``'s memory to compute kernels
  before the copy has read it; the slot's pool event is recorded after the copy.
* pool slot -> staging slot (H2D on copy, backward): waits for the slot's "free" event (the last backward that
  read the staging slot) and for the pool event (the D2H). The pool slot is written again only by a later D2H on
  the copy stream.
* staging slot -> recompute (compute): ``compute.wait_event(ready)`` before the recompute; after the layer's
  nested backward has been issued (autograd's saved views of the input are read until then) the slot's "free"
  event is recorded on compute.
* staging buffer memory: allocated from the copy stream's pool (the stream that writes it first, see
  :class:`~.streams.StreamOps`), and ``record_stream(compute)`` so that when it is freed (growth, toggle off) its
  reuse waits for the compute stream's reads.

Every one of these goes through :class:`~.streams.StreamOps`; which slot an input uses is :class:`~.policy.SlotPolicy`.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref
from dataclasses import dataclass

import torch

from .._util import round_up
from .policy import SlotPolicy
from .pool import PinnedPool
from .streams import StreamOps, Trace


class Entry:
    """One offloaded layer input waiting for its backward."""

    __slots__ = ("seq", "layer", "slot", "pool_gen", "nbytes", "dtype", "shape", "consumed", "_finalizer",
                 "__weakref__")

    def __init__(self, seq: int, layer: int, slot: int, nbytes: int, dtype: torch.dtype, shape, pool: PinnedPool):
        self.seq = seq
        self.layer = layer
        self.slot = slot
        self.pool_gen = pool.generation(slot)
        self.nbytes = nbytes
        self.dtype = dtype
        self.shape = tuple(shape)
        self.consumed = False
        # If the graph is dropped without a backward (an exception, an eval with grad on), the entry dies with
        # the autograd context that holds it, and its pool slot goes back to the pool.
        self._finalizer = weakref.finalize(self, pool.release, slot)

    def release(self) -> None:
        self._finalizer()


@dataclass
class OffloadStats:
    saves: int = 0              # layer inputs offloaded (forward)
    reloads: int = 0            # host->device copies issued (backward)
    prefetches: int = 0         # reloads issued ahead, for the next layer
    prefetch_hits: int = 0      # backwards that found their input already staged
    fallbacks: int = 0          # times a staging buffer could not be allocated and its slot was dropped
    bytes_saved: int = 0        # device->host bytes copied (forward)
    bytes_reloaded: int = 0     # host->device bytes copied (backward)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class OffloadManager:
    """Offloaded checkpointing state of one model (see the module docstring for the stream ordering).

    Args:
        device: the compute device (CUDA: streams and events; CPU: the same logic, synchronous).
        buffers: GPU staging buffers for reloads: ``1`` (copy and compute take turns) or ``2`` (double buffer).
        prefetch: with 2 buffers, issue the reload of the next layer as soon as a layer's backward starts.
        preserve_rng_state: restore the RNG state for the recompute (as ``torch.utils.checkpoint``; needed for
            dropout, costs a few microseconds per layer).
        forward_grad: run the offloaded forward with grad mode ON (saved tensors discarded by a
            ``saved_tensors_hooks`` pair, as torch's non-reentrant checkpoint does), so it dispatches exactly the
            kernels standard checkpointing and plain training run (SDPA's backend choice and kernel variant can
            depend on whether inputs require grad). ``False``: under ``no_grad`` (torch's reentrant checkpoint).
        streams: the stream-operations object (default ``StreamOps(device)``); benchmarks and tests pass their own.
        pool: share a pinned pool (default: a new one).
    """

    def __init__(self, device: torch.device | str, buffers: int = 2, prefetch: bool | None = None, *,
                 preserve_rng_state: bool = True, forward_grad: bool = True, streams: StreamOps | None = None,
                 pool: PinnedPool | None = None):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = self.device.type == "cuda"
        self.ops = streams if streams is not None else StreamOps(self.device)
        self.pool = pool if pool is not None else PinnedPool(pin=self.cuda)
        self.stats = OffloadStats()
        self.preserve_rng_state = preserve_rng_state
        self.forward_grad = forward_grad
        self._pending: dict[int, weakref.ref] = {}        # seq -> entry, in forward (registry) order
        self._seq = 0
        self._lock = threading.Lock()
        self._staging: list[torch.Tensor | None] = []
        self._staging_gen: list[int] = []                 # bumped per allocation: names the buffer in the log
        self._owner: list[int | None] = []                # seq of the entry whose input sits in each slot
        self.configure(buffers, prefetch)

    # -- configuration
    def configure(self, buffers: int, prefetch: bool | None = None) -> None:
        """``buffers`` staging buffers (1 or 2; checked by the switch, :func:`~.switch.check_buffers`) and prefetch
        (default: on with two)."""
        if prefetch is None:
            prefetch = buffers == 2
        self.release_staging()
        self.buffers = buffers
        self.prefetch = prefetch
        self.policy = SlotPolicy(buffers)
        grow = buffers - len(self._staging)
        if grow > 0:
            self._staging += [None] * grow
            self._staging_gen += [0] * grow
        self._owner = [None] * len(self._staging)

    @property
    def stream_log(self) -> list | None:
        """The stream-operation log (set to ``[]`` to record; see :func:`~.streams.check_stream_order`)."""
        return self.ops.log

    @stream_log.setter
    def stream_log(self, value: list | None) -> None:
        self.ops.log = value

    @property
    def active_buffers(self) -> int:
        return self.policy.active

    # -- introspection
    @property
    def pending(self) -> int:
        """Offloaded inputs whose backward has not run yet (0 after every complete backward)."""
        return sum(1 for ref in self._pending.values() if ref() is not None)

    def pending_entries(self) -> list[Entry]:
        """The inputs waiting for their backward, in forward order."""
        return sorted((e for e in (r() for r in list(self._pending.values())) if e is not None), key=lambda e: e.seq)

    @property
    def staging_bytes(self) -> list[int]:
        return [0 if b is None else b.numel() for b in self._staging]

    def memory(self) -> dict:
        staging = self.staging_bytes
        return {"pool_bytes": self.pool.nbytes, "pool_slots": self.pool.num_slots,
                "pool_allocations": self.pool.allocations, "pinned": self.pool.pin,
                "staging_buffers": sum(1 for b in staging if b), "staging_bytes": sum(staging),
                "staging_bytes_per_buffer": max(staging) if any(staging) else 0}

    def release_staging(self) -> None:
        """Free the GPU staging buffers (they are re-created, from the allocator's cache, on the next reload)."""
        for slot, buf in enumerate(self._staging):
            if buf is not None:
                self.ops.free(self.ops.staging_alloc_stream, self._staging_key(slot))
        self._staging = [None] * len(self._staging)
        self._owner = [None] * len(self._staging)

    @contextlib.contextmanager
    def tracing(self):
        """Record copy and compute intervals of what runs inside; yields a trace with ``.events()``."""
        trace = Trace(self.device)
        self.ops.trace = trace
        try:
            yield trace
        finally:
            self.ops.trace = None

    def _staging_key(self, slot: int) -> tuple:
        return ("staging", slot, self._staging_gen[slot])

    # -- forward: offload
    def save(self, x: torch.Tensor, layer: int) -> Entry:
        """Copy ``x`` into a pool slot (async on CUDA) and register it; ``x`` may be freed right after."""
        if x.device != self.device:
            raise ValueError(f"layer input is on {x.device}, but offloaded checkpointing was enabled for "
                             f"{self.device}")
        ops = self.ops
        src = x if x.is_contiguous() else x.contiguous()   # the pool holds a contiguous copy
        nbytes = src.numel() * src.element_size()
        slot = self.pool.acquire(nbytes)
        with self._lock:
            seq = self._seq
            self._seq += 1
        entry = Entry(seq, layer, slot, nbytes, src.dtype, src.shape, self.pool)
        dst = self.pool.view(slot, nbytes, src.dtype, src.shape)
        inp, pbuf = ("input", seq), ("pool", slot, entry.pool_gen)
        ops.access("compute", inp, "w")          # the kernels that produced x were issued on the compute stream
        ops.saved(entry, src)
        stream = ops.d2h_stream
        if stream == "copy":
            ops.wait_stream("copy", "compute")   # the copy stream must see the input as the compute stream made it
        else:
            ops.wait_stream(stream, "copy")      # a pending reload may still read this pool slot
        ops.copy(stream, dst, src, inp, pbuf, "d2h", layer, seq)
        ops.record(("pool", slot), stream)
        if stream != "compute":
            # the caching allocator must not hand the input's memory to the compute stream before the copy has read
            # it (the layer's output is allocated right after); ``src`` is the tensor the copy reads
            ops.record_stream(src, inp, stream)
        ops.free("compute", inp)                 # from here on the caller may drop x
        self.stats.saves += 1
        self.stats.bytes_saved += nbytes
        with self._lock:
            self._pending[seq] = weakref.ref(entry, functools.partial(self._forget, seq))
        return entry

    def _forget(self, seq: int, _ref=None) -> None:
        self._pending.pop(seq, None)

    # -- backward: reload
    def _next_pending(self, seq: int) -> Entry | None:
        """The entry whose backward comes next: the latest registered input before ``seq`` not yet consumed."""
        best, best_seq = None, -1
        for s, ref in list(self._pending.items()):
            if best_seq < s < seq:
                e = ref()
                if e is not None and not e.consumed:
                    best, best_seq = e, s
        return best

    def _staging_buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._staging[slot]
        if buf is None or buf.numel() < nbytes:
            ops = self.ops
            alloc = ops.staging_alloc_stream
            other = "compute" if alloc == "copy" else "copy"
            if buf is not None:
                ops.free(alloc, self._staging_key(slot))
            self._staging[slot] = None          # let the old block go before allocating the larger one
            self._owner[slot] = None
            del buf
            # 2 MiB granularity on a GPU: a few more bytes now save a re-allocation when lengths creep up.
            buf = ops.allocate(round_up(nbytes, (2 << 20) if self.cuda else 64), alloc)
            self._staging_gen[slot] += 1
            key = self._staging_key(slot)
            # The allocator hands out memory whose previous users, on the allocating stream, may still be queued:
            # safe for that stream only; the first write (the H2D, on the copy stream) is ordered after them.
            ops.access(alloc, key, "w")
            # Read (or written) by the other stream too: its pending uses must finish before the memory is reused.
            ops.record_stream(buf, key, other)
            self._staging[slot] = buf
        return buf

    def _drop_slot(self, slot: int, err: BaseException) -> None:
        """A staging buffer did not fit: carry on with the other slots (fewer overlapped reloads, same results)."""
        self.policy.drop(slot)
        if self._staging[slot] is not None:
            self.ops.free(self.ops.staging_alloc_stream, self._staging_key(slot))
        self._staging[slot] = None
        self._owner[slot] = None
        self.stats.fallbacks += 1
        left = self.policy.active
        warnings.warn(
            f"offloaded checkpointing: not enough GPU memory for staging buffer {slot} "
            f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); falling back to "
            f"{'ONE buffer' if left == 1 else f'{left} buffers'} (reloads no longer overlap the backward compute; "
            "results are unchanged).", RuntimeWarning, stacklevel=3)

    def _load(self, entry: Entry, slot: int) -> None:
        """Issue the host->device copy of ``entry`` into staging ``slot`` (waits for the slot to be free)."""
        ops = self.ops
        buf = self._staging_buffer(slot, entry.nbytes)
        dst = buf[:entry.nbytes].view(entry.dtype).view(entry.shape)
        src = self.pool.view(entry.slot, entry.nbytes, entry.dtype, entry.shape)
        ops.wait_event("copy", ("free", slot))          # the previous user of the slot is done with it
        ops.wait_event("copy", ("pool", entry.slot))    # the D2H into the pool slot is done
        ops.copy("copy", dst, src, ("pool", entry.slot, entry.pool_gen), self._staging_key(slot), "h2d",
                 entry.layer, entry.seq)
        ops.record(("ready", slot), "copy")
        self._owner[slot] = entry.seq
        self.stats.reloads += 1
        self.stats.bytes_reloaded += entry.nbytes

    def _load_with_fallback(self, entry: Entry, slot: int, *, prefetch: bool) -> bool:
        """Load, surviving an out-of-memory while another slot's buffer exists. Returns whether it was loaded.

        "The second buffer" is whichever slot is allocated second: with an even number of layers the first
        backward uses slot 1, so slot 0 is the one that may not fit.
        """
        try:
            self._load(entry, slot)
            return True
        except torch.cuda.OutOfMemoryError as err:
            others = [s for s in self.policy.slots if s != slot and self._staging[s] is not None]
            if others:
                self._drop_slot(slot, err)
                if prefetch:
                    return False   # no prefetch this time: the layer's own backward reloads it
                self._load(entry, self.policy.slot_of(entry.seq))
                return True
            if prefetch:
                return False
            raise   # not even one staging buffer fits: a genuine out-of-memory

    def begin_backward(self, entry: Entry) -> tuple[torch.Tensor, int]:
        """Make ``entry``'s input available on the compute stream (reloading it if needed); prefetch the next."""
        if entry.consumed:
            raise RuntimeError(
                "offloaded checkpointing: this layer's input was already consumed by a backward. Backward twice "
                "through the same graph (retain_graph=True) is not supported; use standard checkpointing.")
        ops, policy = self.ops, self.policy
        slot = policy.slot_of(entry.seq)
        if self._owner[slot] == entry.seq:
            self.stats.prefetch_hits += 1
        else:
            self._load_with_fallback(entry, slot, prefetch=False)
            slot = policy.slot_of(entry.seq)   # may have changed if a slot was dropped
        if self.prefetch and policy.can_prefetch():
            nxt = self._next_pending(entry.seq)
            if nxt is not None:
                nslot = policy.slot_of(nxt.seq)
                if nslot != slot and self._owner[nslot] != nxt.seq:
                    if self._load_with_fallback(nxt, nslot, prefetch=True):
                        self.stats.prefetches += 1
        ops.wait_event("compute", ("ready", slot))
        x = self._staging[slot][:entry.nbytes].view(entry.dtype).view(entry.shape)
        ops.access("compute", self._staging_key(slot), "r")     # the recompute
        ops.staged(entry, x, "reload")
        entry.consumed = True
        with self._lock:
            self._pending.pop(entry.seq, None)
        entry.release()   # the pool slot may be refilled: later copies into it are ordered after this reload
        return x, slot

    def end_backward(self, slot: int, entry: Entry | None = None) -> None:
        """The layer's backward has been issued: the staging slot may be overwritten once it completes."""
        ops = self.ops
        # autograd's saved views of the input are read by the nested backward, all of it issued by now
        ops.access("compute", self._staging_key(slot), "r")
        if entry is not None:
            ops.staged(entry, self._staging[slot][:entry.nbytes].view(entry.dtype).view(entry.shape),
                       "after_backward")
        ops.record(("free", slot), "compute")
        self._owner[slot] = None


__all__ = ["OffloadManager", "OffloadStats", "Entry"]
