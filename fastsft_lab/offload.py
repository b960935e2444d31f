"""Optimization 2: CPU-offloaded gradient checkpointing with double-buffered, prefetched reloads.

Gradient checkpointing keeps only each decoder layer's *input* and recomputes the layer in backward. Offloading
moves that input to pinned CPU memory in forward and reloads it in backward, so the GPU holds no activations
between the forward and the backward of a layer (``layers x tokens x hidden`` bytes freed: 6.7 GB for Qwen3-14B
at 16k tokens and 40 layers).

The reload is where time goes. With ONE GPU staging buffer the reload of layer k-1 cannot start before the
backward of layer k (which reads that buffer) is finished, so the copy stream and the compute stream take turns::

    compute  | bwd L9 |        | bwd L8 |        | bwd L7 |
    copy     |        | h2d L8 |        | h2d L7 |            <- every reload is exposed

With TWO buffers (slot = layer parity, one "free" and one "ready" event per slot) the reload of layer k-1 runs
while layer k computes; with ``prefetch`` it is issued the moment layer k's backward starts, before its kernels::

    compute  | bwd L9 | bwd L8 | bwd L7 |
    copy     | h2d L8 | h2d L7 | h2d L6 |                    <- hidden behind compute

The function plugs into transformers' own extension point: ``GradientCheckpointingLayer.__call__`` calls
``self._gradient_checkpointing_func(partial(super().__call__, **kwargs), *args)``; we set that attribute (and
``gradient_checkpointing = True``) on each decoder layer, so it works under PEFT/QLoRA wrappers and keeps every
kwarg (rotary cos/sin, masks, optimization 1's ``packed_metadata``) for the recompute untouched.

Design (one :class:`OffloadManager` per model; the pinned pool survives toggles and steps):

* forward: the layer runs with grad mode on but keeps nothing (a ``saved_tensors_hooks`` pair drops what
  autograd would save, as torch's non-reentrant checkpoint does), so it runs the very kernels standard
  checkpointing runs; its input is copied into a slot of a pinned CPU :class:`PinnedPool` on a dedicated copy
  stream (``non_blocking``; the compute stream is not blocked, and ``record_stream`` stops the caching allocator
  from reusing the input's memory before the copy has read it).
* backward: the input is copied host->device into a staging buffer (allocated on the copy stream, which writes it
  first) on the copy stream, the compute stream waits on that slot's "ready" event, the layer is recomputed with
  grad (RNG and autocast state restored as ``torch.utils.checkpoint`` does) and back-propagated; then the slot's
  "free" event is recorded. :class:`OffloadManager` lists every cross-stream hazard and what orders it.
* On a CPU there are no streams: the very same code runs synchronously (the pool is ordinary memory), so CPU tests
  exercise the bookkeeping (slots, registry, prefetch, fallback), and the stream operations it issues are logged
  and checked for ordering by :func:`fastsft_lab.timeline.check_stream_order`.

The backward has the semantics of *reentrant* checkpointing (``torch.utils.checkpoint(use_reentrant=True)``): the
layer's parameter gradients are accumulated into ``.grad`` by a nested ``torch.autograd.backward`` in the backward
of the layer. Unlike torch's reentrant checkpoint, gradients reach LoRA parameters even when the layer input does not
require grad (a zero-size dummy input keeps the output in the graph). Not supported (clear errors): backward twice
through the same graph (``retain_graph=True``) and ``torch.autograd.grad`` w.r.t. parameters inside a layer.
Side outputs captured by hooks during a layer's forward (e.g. router logits for an auxiliary loss) cannot get a
gradient: back-propagating through one raises a clear error (with ``forward_grad=False`` they silently carry none,
as with reentrant checkpointing).

Use with TRL/Trainer: leave ``gradient_checkpointing=False`` in the trainer arguments (the trainer would call
``model.gradient_checkpointing_enable()`` and overwrite the layer functions) and call
:func:`enable_offloaded_checkpointing` on the model yourself.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import json
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .models import base_model, decoder_layers

_MISSING = object()
_GC_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func")


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def _round_up(n: int, multiple: int) -> int:
    return ((n + multiple - 1) // multiple) * multiple


# --- Host side: the pinned pool ---------------------------------------------------------------------------------
class PinnedPool:
    """Reusable host slots for offloaded layer inputs (pinned when CUDA is in use, ordinary memory on a CPU run).

    Slot ``i`` is normally taken by the ``i``-th offloaded layer of a step (lowest free slot first), so with fixed
    shapes every step reuses exactly the same pinned memory: no per-step pinned allocation. A slot grows when a
    larger input arrives (packed lengths vary) and never shrinks until :meth:`clear`.

    Capacities are rounded up to a power of two: PyTorch's caching host allocator rounds pinned blocks that way
    anyway, so :attr:`nbytes` is the true host cost, and doubling keeps growth rare.
    """

    def __init__(self, pin: bool):
        self.pin = pin
        self._slots: list[torch.Tensor] = []      # flat uint8 buffers
        self._events: list[Any] = []              # CUDA: "the D2H into this slot is done" (None on a CPU)
        self._free: list[int] = []                # heap of free slot indices
        self._gens: list[int] = []                # per slot: how many times its memory was (re)allocated
        self._lock = threading.Lock()
        self.allocations = 0                      # host allocations made so far (tests assert it stays flat)

    @property
    def nbytes(self) -> int:
        """Host bytes held by the pool (pinned when ``pin``)."""
        return sum(s.numel() for s in self._slots)

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def in_use(self) -> int:
        return len(self._slots) - len(self._free)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(_pow2_ceil(nbytes), dtype=torch.uint8, pin_memory=self.pin)

    def acquire(self, nbytes: int) -> int:
        """A free slot of at least ``nbytes`` (lowest index first; grown or created when needed)."""
        with self._lock:
            if self._free:
                idx = heapq.heappop(self._free)
                if self._slots[idx].numel() < nbytes:
                    # The old block may still be read by an in-flight copy: the caching host allocator keeps it
                    # until the copy's recorded event completes, so dropping our reference here is safe.
                    self._slots[idx] = self._allocate(nbytes)
                    self._gens[idx] += 1
                return idx
            self._slots.append(self._allocate(nbytes))
            self._events.append(torch.cuda.Event() if self.pin else None)
            self._gens.append(0)
            return len(self._slots) - 1

    def release(self, idx: int) -> None:
        with self._lock:
            if idx in self._free or idx >= len(self._slots):
                raise RuntimeError(f"pinned pool slot {idx} released twice")
            heapq.heappush(self._free, idx)

    def view(self, idx: int, nbytes: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        return self._slots[idx][:nbytes].view(dtype).view(shape)

    def event(self, idx: int):
        return self._events[idx]

    def generation(self, idx: int) -> int:
        """Bumped whenever slot ``idx`` gets new memory (names the buffer in the stream-order log)."""
        return self._gens[idx]

    def clear(self) -> None:
        """Drop every slot (only when nothing is pending)."""
        with self._lock:
            if self.in_use:
                raise RuntimeError(f"cannot clear the pinned pool: {self.in_use} slot(s) hold inputs not yet "
                                   "back-propagated")
            self._slots.clear()
            self._events.clear()
            self._free.clear()
            self._gens.clear()


# --- Timeline recording (optional, for the notebook's pictures) -------------------------------------------------
class _Trace:
    """Start/end marks of copies and layer computes on their streams (CUDA events, or perf_counter on a CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._records: list[tuple] = []
        if self.cuda:
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record(torch.cuda.current_stream(device))
        else:
            import time

            self._clock = time.perf_counter
            self._t0 = self._clock()

    def mark(self, stream=None):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
            return ev
        return self._clock()

    def add(self, kind: str, lane: str, layer: int, seq: int, start, end) -> None:
        self._records.append((kind, lane, layer, seq, start, end))

    def events(self) -> list[dict]:
        """Intervals in ms from the trace start: ``{kind, lane, layer, seq, start_ms, end_ms}``."""
        if self.cuda:
            torch.cuda.synchronize(self.device)

            def ms(x):
                return self._t0.elapsed_time(x)
        else:
            def ms(x):
                return (x - self._t0) * 1e3
        return [{"kind": k, "lane": lane, "layer": layer, "seq": seq, "start_ms": round(ms(s), 4),
                 "end_ms": round(ms(e), 4)} for k, lane, layer, seq, s, e in self._records]


# --- The manager ------------------------------------------------------------------------------------------------
class _Entry:
    """One offloaded layer input waiting for its backward."""

    __slots__ = ("seq", "layer", "slot", "pool_gen", "nbytes", "dtype", "shape", "consumed", "reference",
                 "_finalizer", "__weakref__")

    def __init__(self, seq: int, layer: int, slot: int, nbytes: int, dtype: torch.dtype, shape, pool: PinnedPool):
        self.seq = seq
        self.layer = layer
        self.slot = slot
        self.pool_gen = pool.generation(slot)
        self.nbytes = nbytes
        self.dtype = dtype
        self.shape = tuple(shape)
        self.consumed = False
        self.reference: torch.Tensor | None = None   # verify mode only: a device copy of the input, for comparison
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
    fallbacks: int = 0          # times the second staging buffer could not be allocated

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class OffloadManager:
    """Offloaded checkpointing state of one model: pinned pool, copy stream, staging buffers, pending registry.

    Stream ordering (CUDA; "compute" is the stream autograd runs the layer on, "copy" the manager's own stream).
    Every cross-stream hazard and the operation that orders it:

    * forward, layer input ``x`` (written by compute) -> pool slot (D2H on copy): ``copy.wait_stream(compute)``
      before the copy; ``x.record_stream(copy)`` so the allocator does not hand ``x``'s memory to compute
      kernels before the copy has read it; the slot's pool event is recorded after the copy.
    * pool slot -> staging slot (H2D on copy, backward): waits for the slot's "free" event (the last backward
      that read the staging slot) and for the pool event (the D2H). The pool slot is written again only by a
      later D2H on the same copy stream (or, with ``serial_forward_copies``, on compute after
      ``compute.wait_stream(copy)``).
    * staging slot -> recompute (compute): ``compute.wait_event(ready)`` before the recompute; after the layer's
      nested backward has been issued (autograd's saved views of the input are read until then) the slot's
      "free" event is recorded on compute.
    * staging buffer memory: allocated ON THE COPY STREAM, the stream that writes it first, so the caching
      allocator's per-stream ordering covers the memory's previous users; ``record_stream(compute)`` so that when
      it is freed (growth, toggle off) its reuse waits for the compute stream's reads. (Allocated on the compute
      stream instead, the first H2D could overwrite memory whose previous compute-stream users -- the loss and
      LM-head backward, still queued when the CPU reaches the first layer -- had not run yet: the bug the first
      H200 run showed as wrong gradients at real size only.)

    Every one of these operations goes through ``_wait_stream`` / ``_record`` / ``_wait_event`` / ``_copy`` /
    ``_access`` / ``_free_buffer``, which also append to :attr:`stream_log` when it is a list. The CPU runs the
    very same sequence (its copies are synchronous), so :func:`fastsft_lab.timeline.check_stream_order` can check
    on a CPU, in a model of CUDA stream semantics, that every conflicting pair of accesses is ordered, for any
    forward/backward pattern the tests drive.

    Args:
        device: the compute device (CUDA: streams and events; CPU: the same logic, synchronous).
        buffers: GPU staging buffers for reloads: ``1`` (copy and compute take turns) or ``2`` (double buffer).
        prefetch: with 2 buffers, issue the reload of the next layer as soon as a layer's backward starts.
        preserve_rng_state: restore the RNG state for the recompute (as ``torch.utils.checkpoint``; needed for
            dropout, costs a few microseconds per layer).
        serial_forward_copies: copy forward inputs on the compute stream instead of the copy stream (models a
            design that also serialises the forward copies; used by the regime sweep only).
        forward_grad: run the offloaded forward with grad mode ON (saved tensors discarded by a
            ``saved_tensors_hooks`` pair, as torch's non-reentrant checkpoint does), so it dispatches exactly the
            kernels standard checkpointing and plain training run (SDPA's backend choice and kernel variant, e.g.
            whether it computes the log-sum-exp, can depend on whether inputs require grad). ``False``: under
            ``no_grad`` (torch's reentrant checkpoint; fewer autograd nodes, possibly different kernels).
        verify: debug only. Keep a device copy of every offloaded input and compare it bitwise with the staged
            input when the recompute reads it and again when the layer's backward is done (no host sync until
            :meth:`verify_report`). Costs the GPU memory the offload saves.
    """

    _STAGING_ALLOC_STREAM = "copy"   # tests set "compute" to model the pre-fix allocation (and see the race)

    def __init__(self, device: torch.device | str, buffers: int = 2, prefetch: bool | None = None, *,
                 preserve_rng_state: bool = True, serial_forward_copies: bool = False, forward_grad: bool = True,
                 verify: bool = False, pool: PinnedPool | None = None):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = self.device.type == "cuda"
        self.pool = pool if pool is not None else PinnedPool(pin=self.cuda)
        self.copy_stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self.stats = OffloadStats()
        self.preserve_rng_state = preserve_rng_state
        self.serial_forward_copies = serial_forward_copies
        self.forward_grad = forward_grad
        self.verify = verify
        self.stream_log: list | None = None              # set to [] to record the stream-order log
        self._verify_log: list = []
        self._staging: list[torch.Tensor | None] = [None, None]
        self._staging_gen = [0, 0]                        # bumped per allocation: names the buffer in the log
        self._owner: list[int | None] = [None, None]     # seq of the entry whose input sits in each slot
        self._ready = [torch.cuda.Event(), torch.cuda.Event()] if self.cuda else [None, None]
        self._free = [torch.cuda.Event(), torch.cuda.Event()] if self.cuda else [None, None]
        self._pending: dict[int, weakref.ref] = {}        # seq -> entry, in forward (registry) order
        self._seq = 0
        self._lock = threading.Lock()
        self._trace: _Trace | None = None
        self.configure(buffers, prefetch)

    # -- configuration
    def configure(self, buffers: int, prefetch: bool | None = None) -> None:
        if buffers not in (1, 2):
            raise ValueError(f"buffers must be 1 (single staging buffer) or 2 (double buffer), got {buffers!r}")
        if prefetch is None:
            prefetch = buffers == 2
        if prefetch and buffers == 1:
            raise ValueError("prefetch needs buffers=2: with one staging buffer the next reload would overwrite "
                             "the input of the layer being back-propagated")
        self.buffers = buffers
        self.prefetch = bool(prefetch)
        self.active_buffers = buffers   # drops to 1 if the second buffer cannot be allocated
        self._single_slot = 0           # the slot used with one active buffer (the surviving one after a fallback)
        self._owner = [None, None]

    # -- introspection
    @property
    def pending(self) -> int:
        """Offloaded inputs whose backward has not run yet (0 after every complete backward)."""
        return sum(1 for ref in self._pending.values() if ref() is not None)

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
        for slot in (0, 1):
            if self._staging[slot] is not None:
                self._free_buffer(self._STAGING_ALLOC_STREAM, self._staging_key(slot))
        self._staging = [None, None]
        self._owner = [None, None]

    @contextlib.contextmanager
    def tracing(self):
        """Record copy and compute intervals of what runs inside; yields a trace with ``.events()``."""
        trace = _Trace(self.device)
        self._trace = trace
        try:
            yield trace
        finally:
            self._trace = None

    def verify_report(self) -> dict:
        """Verify mode: bitwise comparison of every staged input with the device copy taken in forward (syncs).

        Returns ``{"checked": n, "ok": bool, "mismatched": [{"layer", "seq", "phase", "mismatched_bytes"}]}``;
        ``phase`` is ``"reload"`` (when the recompute reads it) or ``"after_backward"`` (when the slot is freed).
        """
        rows = [{"layer": layer, "seq": seq, "phase": phase, "mismatched_bytes": int(n)}
                for layer, seq, phase, n in self._verify_log]
        self._verify_log = []
        bad = [r for r in rows if r["mismatched_bytes"]]
        return {"checked": len(rows), "ok": not bad, "mismatched": bad}

    # -- stream operations: each one issued for real on CUDA, and logged (CPU and CUDA) when stream_log is a list
    def _log(self, *op) -> None:
        if self.stream_log is not None:
            self.stream_log.append(op)

    def _stream(self, name: str):
        if name == "copy":
            return self.copy_stream
        stream = torch.cuda.current_stream(self.device)
        if stream == self.copy_stream:   # a "compute" lookup inside a copy-stream context would be a silent bug
            raise RuntimeError("internal: compute stream looked up while the copy stream is current")
        return stream

    def _on_stream(self, name: str):
        return torch.cuda.stream(self._stream(name)) if self.cuda else contextlib.nullcontext()

    def _wait_stream(self, waiter: str, waitee: str) -> None:
        self._log("wait_stream", waiter, waitee)
        if self.cuda:
            self._stream(waiter).wait_stream(self._stream(waitee))

    def _event(self, key: tuple):
        kind, idx = key
        return {"ready": self._ready, "free": self._free}[kind][idx] if kind != "pool" else self.pool.event(idx)

    def _record(self, key: tuple, stream: str) -> None:
        self._log("record", key, stream)
        if self.cuda:
            self._event(key).record(self._stream(stream))

    def _wait_event(self, stream: str, key: tuple) -> None:
        self._log("wait_event", stream, key)
        if self.cuda:
            self._stream(stream).wait_event(self._event(key))

    def _access(self, stream: str, buf: tuple, mode: str) -> None:
        """Log only: kernels issued on ``stream`` up to here read (``r``) or write (``w``) ``buf``."""
        self._log("access", stream, buf, mode)

    def _record_stream(self, tensor: torch.Tensor, buf: tuple, stream: str) -> None:
        self._log("record_stream", buf, stream)
        if self.cuda:
            tensor.record_stream(self._stream(stream))

    def _free_buffer(self, stream: str, buf: tuple) -> None:
        """Log only: ``buf``'s memory goes back to the caching allocator, for reuse by ``stream``."""
        self._log("free", stream, buf)

    def _copy(self, stream: str, dst: torch.Tensor, src: torch.Tensor, reads: tuple, writes: tuple,
              kind: str, entry: _Entry) -> None:
        self._access(stream, reads, "r")
        self._access(stream, writes, "w")
        trace = self._trace
        if self.cuda:
            s = self._stream(stream)
            t0 = trace.mark(s) if trace else None
            with torch.cuda.stream(s):
                dst.copy_(src, non_blocking=True)
            if trace:
                trace.add(kind, stream, entry.layer, entry.seq, t0, trace.mark(s))
        else:
            t0 = trace.mark() if trace else None
            dst.copy_(src)
            if trace:
                trace.add(kind, stream, entry.layer, entry.seq, t0, trace.mark())

    def _staging_key(self, slot: int) -> tuple:
        return ("staging", slot, self._staging_gen[slot])

    def _verify(self, entry: _Entry, x: torch.Tensor, phase: str) -> None:
        if entry.reference is None:
            return
        a, b = x.reshape(-1).view(torch.uint8), entry.reference.reshape(-1).view(torch.uint8)
        self._verify_log.append((entry.layer, entry.seq, phase, (a != b).sum()))   # stays on the device

    # -- forward: offload
    def save(self, x: torch.Tensor, layer: int) -> _Entry:
        """Copy ``x`` into a pool slot (async on CUDA) and register it; ``x`` may be freed right after."""
        if x.device != self.device:
            raise ValueError(f"layer input is on {x.device}, but offloaded checkpointing was enabled for "
                             f"{self.device}")
        src = x if x.is_contiguous() else x.contiguous()   # the pool holds a contiguous copy
        nbytes = src.numel() * src.element_size()
        slot = self.pool.acquire(nbytes)
        with self._lock:
            seq = self._seq
            self._seq += 1
        entry = _Entry(seq, layer, slot, nbytes, src.dtype, src.shape, self.pool)
        dst = self.pool.view(slot, nbytes, src.dtype, src.shape)
        inp, pbuf = ("input", seq), ("pool", slot, entry.pool_gen)
        self._access("compute", inp, "w")          # the kernels that produced x were issued on the compute stream
        if self.verify:
            entry.reference = src.clone()          # on the compute stream, after the producer
        if self.serial_forward_copies:
            self._wait_stream("compute", "copy")   # a pending reload may still read this pool slot
            self._copy("compute", dst, src, inp, pbuf, "d2h", entry)
            self._record(("pool", slot), "compute")
        else:
            # The copy stream must see the input as produced by the compute stream ...
            self._wait_stream("copy", "compute")
            self._copy("copy", dst, src, inp, pbuf, "d2h", entry)
            self._record(("pool", slot), "copy")
            # ... and the caching allocator must not hand the input's memory to the compute stream before the
            # copy has read it (the layer's output is allocated right after). ``src`` is the tensor whose storage
            # the copy reads (x itself, or its contiguous copy).
            self._record_stream(src, inp, "copy")
        self._free_buffer("compute", inp)          # from here on the caller may drop x
        self.stats.saves += 1
        with self._lock:
            self._pending[seq] = weakref.ref(entry, functools.partial(self._forget, seq))
        return entry

    def _forget(self, seq: int, _ref=None) -> None:
        self._pending.pop(seq, None)

    # -- backward: reload
    def _slot_of(self, entry: _Entry) -> int:
        return entry.seq % 2 if self.active_buffers == 2 else self._single_slot

    def _next_pending(self, seq: int) -> _Entry | None:
        """The entry whose backward comes next: the latest registered input before ``seq`` not yet consumed."""
        best, best_seq = None, -1
        for s, ref in list(self._pending.items()):
            if best_seq < s < seq:
                e = ref()
                if e is not None and not e.consumed:
                    best, best_seq = e, s
        return best

    def _allocate_staging(self, nbytes: int) -> torch.Tensor:
        # Separate method so tests can inject an out-of-memory failure.
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _staging_buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self._staging[slot]
        if buf is None or buf.numel() < nbytes:
            alloc = self._STAGING_ALLOC_STREAM
            other = "compute" if alloc == "copy" else "copy"
            if buf is not None:
                self._free_buffer(alloc, self._staging_key(slot))
            self._staging[slot] = None          # let the old block go before allocating the larger one
            self._owner[slot] = None
            del buf
            # 2 MiB granularity on a GPU: a few more bytes now save a re-allocation when lengths creep up.
            with self._on_stream(alloc):
                buf = self._allocate_staging(_round_up(nbytes, (2 << 20) if self.cuda else 64))
            self._staging_gen[slot] += 1
            key = self._staging_key(slot)
            # The allocator hands out memory whose previous users, on the allocating stream, may still be queued:
            # safe for that stream only. Allocated on the copy stream, the first write (the H2D) is ordered after
            # them by stream order.
            self._access(alloc, key, "w")
            # Read (or written) by the other stream too: its pending uses must finish before the memory is reused.
            self._record_stream(buf, key, other)
            self._staging[slot] = buf
        return buf

    def _fall_back_to_one_buffer(self, err: BaseException, keep: int) -> None:
        failed = 1 - keep
        self.active_buffers = 1
        self._single_slot = keep
        if self._staging[failed] is not None:
            self._free_buffer(self._STAGING_ALLOC_STREAM, self._staging_key(failed))
        self._staging[failed] = None
        self._owner[failed] = None
        self.stats.fallbacks += 1
        warnings.warn(
            "offloaded checkpointing: not enough GPU memory for the second staging buffer "
            f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); falling back to ONE buffer "
            "(reloads no longer overlap the backward compute; results are unchanged).",
            RuntimeWarning, stacklevel=3,
        )

    def _load(self, entry: _Entry, slot: int) -> None:
        """Issue the host->device copy of ``entry`` into staging ``slot`` (waits for the slot to be free)."""
        buf = self._staging_buffer(slot, entry.nbytes)
        dst = buf[:entry.nbytes].view(entry.dtype).view(entry.shape)
        src = self.pool.view(entry.slot, entry.nbytes, entry.dtype, entry.shape)
        self._wait_event("copy", ("free", slot))          # the previous user of the slot is done with it
        self._wait_event("copy", ("pool", entry.slot))    # the D2H into the pool slot is done
        self._copy("copy", dst, src, ("pool", entry.slot, entry.pool_gen), self._staging_key(slot), "h2d", entry)
        self._record(("ready", slot), "copy")
        self._owner[slot] = entry.seq
        self.stats.reloads += 1

    def _load_with_fallback(self, entry: _Entry, slot: int, *, prefetch: bool) -> bool:
        """Load, surviving an out-of-memory on the second buffer. Returns whether ``entry`` was loaded.

        "The second buffer" is whichever slot is allocated second: with an even number of layers the first
        backward uses slot 1, so slot 0 is the one that may not fit.
        """
        try:
            self._load(entry, slot)
            return True
        except torch.cuda.OutOfMemoryError as err:
            other = 1 - slot
            if self.active_buffers == 2 and self._staging[other] is not None:
                self._fall_back_to_one_buffer(err, keep=other)
                if prefetch:
                    return False   # no prefetch this time: the layer's own backward reloads it (into `other`)
                self._load(entry, other)
                return True
            if prefetch:
                return False
            raise   # not even one staging buffer fits: a genuine out-of-memory

    def begin_backward(self, entry: _Entry) -> tuple[torch.Tensor, int]:
        """Make ``entry``'s input available on the compute stream (reloading it if needed); prefetch the next."""
        if entry.consumed:
            raise RuntimeError(
                "offloaded checkpointing: this layer's input was already consumed by a backward. Backward twice "
                "through the same graph (retain_graph=True) is not supported; use standard checkpointing.")
        slot = self._slot_of(entry)
        if self._owner[slot] == entry.seq:
            self.stats.prefetch_hits += 1
        else:
            self._load_with_fallback(entry, slot, prefetch=False)
            slot = self._slot_of(entry)   # may have fallen back to the other slot
        if self.prefetch and self.active_buffers == 2:
            nxt = self._next_pending(entry.seq)
            if nxt is not None:
                nslot = self._slot_of(nxt)
                if nslot != slot and self._owner[nslot] != nxt.seq:
                    if self._load_with_fallback(nxt, nslot, prefetch=True):
                        self.stats.prefetches += 1
        self._wait_event("compute", ("ready", slot))
        buf = self._staging[slot]
        x = buf[:entry.nbytes].view(entry.dtype).view(entry.shape)
        self._access("compute", self._staging_key(slot), "r")     # the recompute
        if self.verify:
            self._verify(entry, x, "reload")
        entry.consumed = True
        with self._lock:
            self._pending.pop(entry.seq, None)
        entry.release()   # the pool slot may be refilled: later copies into it are ordered after this reload
        return x, slot

    def end_backward(self, slot: int, entry: _Entry | None = None) -> None:
        """The layer's backward has been issued: the staging slot may be overwritten once it completes."""
        # autograd's saved views of the input are read by the nested backward, all of it issued by now
        self._access("compute", self._staging_key(slot), "r")
        if entry is not None and entry.reference is not None:
            buf = self._staging[slot]
            self._verify(entry, buf[:entry.nbytes].view(entry.dtype).view(entry.shape), "after_backward")
            entry.reference = None
        self._record(("free", slot), "compute")
        self._owner[slot] = None


# --- The checkpoint function ------------------------------------------------------------------------------------
def _autocast_state(device_type: str) -> tuple[dict | None, dict]:
    dev = None
    if device_type != "cpu" and torch.amp.is_autocast_available(device_type):
        dev = {"enabled": torch.is_autocast_enabled(device_type), "dtype": torch.get_autocast_dtype(device_type),
               "cache_enabled": torch.is_autocast_cache_enabled()}
    cpu = {"enabled": torch.is_autocast_enabled("cpu"), "dtype": torch.get_autocast_dtype("cpu"),
           "cache_enabled": torch.is_autocast_cache_enabled()}
    return dev, cpu


@dataclass
class _Call:
    """Everything the recompute needs, except the offloaded input (which lives in the pinned pool)."""

    manager: OffloadManager
    fn: Callable
    fn_args: tuple
    leaves: list
    spec: Any
    offload_leaf: int | None
    grad_leaves: list[int]
    entry: _Entry | None
    trace_layer: int
    cpu_rng: torch.Tensor | None = None
    dev_rng: torch.Tensor | None = None
    autocast: tuple = field(default_factory=tuple)


def _discard_saved(t: torch.Tensor) -> None:
    return None


def _never_unpacked(_handle) -> torch.Tensor:
    raise RuntimeError(
        "offloaded checkpointing: something computed inside an offloaded layer's forward is being back-propagated "
        "outside of it -- typically router logits captured for an auxiliary loss (output_router_logits=True). The "
        "offloaded forward keeps no activations, so such side outputs cannot get a gradient: turn the auxiliary "
        "loss off or detach it, use standard checkpointing, or enable with forward_grad=False (the forward then "
        "runs under no_grad and side outputs silently carry no gradient, as with reentrant checkpointing).")


def _saved_hooks_allowed() -> bool:
    probe = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return probe() if probe is not None else True


def _recompute_and_backward(call: _Call, leaves: list, grad_outputs: tuple) -> list[torch.Tensor]:
    """Recompute the layer with grad from ``leaves`` (the staged input in place) and back-propagate through it."""
    manager = call.manager
    # Detached leaves that require grad: their .grad is what we return. The same tensor object in two places
    # maps to one detached tensor, so its gradient is summed as in the original graph.
    detached: dict[int, torch.Tensor] = {}
    for i in call.grad_leaves:
        t = leaves[i]
        d = detached.get(id(t))
        if d is None:
            d = t.detach().requires_grad_(True)
            detached[id(t)] = d
        leaves[i] = d
    grad_leaf_tensors = [leaves[i] for i in call.grad_leaves]
    args, kwargs = pytree.tree_unflatten(leaves, call.spec)
    dev_type = manager.device.type
    rng_devices = [manager.device] if (manager.cuda and call.dev_rng is not None) else []
    dev_autocast, cpu_autocast = call.autocast
    with torch.random.fork_rng(devices=rng_devices, enabled=manager.preserve_rng_state,
                               device_type=dev_type if dev_type != "cpu" else "cuda"):
        if manager.preserve_rng_state:
            torch.set_rng_state(call.cpu_rng)
            if rng_devices:
                torch.cuda.set_rng_state(call.dev_rng, manager.device)
        dev_ctx = torch.autocast(dev_type, **dev_autocast) if dev_autocast else contextlib.nullcontext()
        with torch.enable_grad(), dev_ctx, torch.autocast("cpu", **cpu_autocast):
            out = call.fn(*call.fn_args, *args, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    pairs = [(o, g) for o, g in zip(outs, grad_outputs)
             if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return grad_leaf_tensors


class _OffloadedLayer(torch.autograd.Function):
    """Forward: run the layer keeping nothing, offload its input. Backward: reload, recompute, back-propagate."""

    @staticmethod
    def forward(ctx, call: _Call, dummy: torch.Tensor, *grad_tensors: torch.Tensor):
        ctx.set_materialize_grads(False)
        manager = call.manager
        leaves = list(call.leaves)
        if call.offload_leaf is not None:
            call.entry = manager.save(call.leaves[call.offload_leaf], call.trace_layer)
            call.leaves[call.offload_leaf] = None   # keep no reference: the GPU copy is freed after this layer
        grad_mode = manager.forward_grad and _saved_hooks_allowed()
        if grad_mode:
            # Same requires_grad flags as in the original graph (detached: this graph is thrown away).
            detached: dict[int, torch.Tensor] = {}
            for i in call.grad_leaves:
                t = leaves[i]
                leaves[i] = detached.setdefault(id(t), t.detach().requires_grad_(True))
        args, kwargs = pytree.tree_unflatten(leaves, call.spec)
        del leaves
        trace = manager._trace
        t0 = trace.mark() if trace else None
        if grad_mode:
            # Grad mode ON, as in standard (non-reentrant) checkpointing and in plain training: kernels whose choice
            # can depend on it (SDPA's backend and variant: with or without the log-sum-exp) are the same ones, so
            # the offloaded forward computes the same bits. Nothing is kept: every tensor autograd would save is
            # dropped by the pack hook, and the outputs are detached from this throw-away graph.
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_discard_saved, _never_unpacked):
                out = call.fn(*call.fn_args, *args, **kwargs)
            out = pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), out)
        else:
            out = call.fn(*call.fn_args, *args, **kwargs)   # grad mode is off inside Function.forward
        if trace:
            trace.add("fwd", "compute", call.trace_layer, call.entry.seq if call.entry else -1, t0, trace.mark())
        del args, kwargs
        ctx.call = call
        return out

    @staticmethod
    def backward(ctx, *grad_outputs):
        call: _Call | None = ctx.call
        if call is None:
            raise RuntimeError(
                "offloaded checkpointing: backward ran twice through the same layer (retain_graph=True is not "
                "supported); use standard checkpointing for double backward.")
        ctx.call = None
        manager = call.manager
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "offloaded checkpointing is not compatible with torch.autograd.grad() or backward(inputs=...): "
                "parameter gradients are accumulated into .grad by a nested backward. Use loss.backward().")
        leaves = list(call.leaves)
        slot = None
        if call.entry is not None:
            x, slot = manager.begin_backward(call.entry)
            leaves[call.offload_leaf] = x
        trace = manager._trace
        t0 = trace.mark() if trace else None
        try:
            grad_leaf_tensors = _recompute_and_backward(call, leaves, grad_outputs)
        finally:
            if slot is not None:
                # After the layer's nested backward has been issued (it reads autograd's saved views of the staged
                # input) -- and also when it failed, so that the slot's next copy waits for whatever was issued.
                manager.end_backward(slot, call.entry)
        del leaves
        if trace:
            trace.add("bwd", "compute", call.trace_layer, call.entry.seq if call.entry else -1, t0, trace.mark())
        seen: set[int] = set()
        grads = []
        for d in grad_leaf_tensors:
            # a tensor that appears twice gets its summed gradient once (autograd adds the None of the other)
            grads.append(None if id(d) in seen else d.grad)
            seen.add(id(d))
        return (None, None, *grads)


def offloaded_checkpoint(function: Callable, *args, manager: OffloadManager, layer_index: int = -1,
                         module: nn.Module | None = None, preserve_rng_state: bool | None = None,
                         **checkpoint_kwargs) -> Any:
    """Checkpoint ``function(*args)`` with its first positional tensor offloaded to the manager's pinned pool.

    A drop-in for ``torch.utils.checkpoint.checkpoint`` as transformers calls it
    (``function = partial(layer.__call__, **kwargs)``); ``checkpoint_kwargs`` such as ``use_reentrant`` are
    accepted and ignored. Without grad (eval, ``torch.no_grad``) the function just runs: nothing is offloaded.

    Args:
        function: the layer call; a ``functools.partial`` whose keyword tensors that require grad get gradients.
        manager: the :class:`OffloadManager` holding the pool and buffers.
        layer_index: the decoder layer's index (for traces).
        module: the layer, to tell whether it has trainable parameters (LoRA) when no input requires grad.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    fn, fn_args, keywords = function, (), {}
    if isinstance(function, functools.partial):
        fn, fn_args, keywords = function.func, function.args, dict(function.keywords)
    leaves, spec = pytree.tree_flatten((list(args), keywords))
    grad_leaves = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    params_need_grad = module is None or any(p.requires_grad for p in module.parameters())
    if not grad_leaves and not params_need_grad:
        return function(*args)   # nothing in this layer needs a gradient: no graph, nothing to offload
    offload_leaf = None
    if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point() \
            and args[0].device == manager.device and args[0].numel() > 0:
        offload_leaf = 0   # args are flattened first: leaf 0 is the first positional argument (hidden_states)
    preserve = manager.preserve_rng_state if preserve_rng_state is None else preserve_rng_state
    call = _Call(manager=manager, fn=fn, fn_args=fn_args, leaves=leaves, spec=spec, offload_leaf=offload_leaf,
                 grad_leaves=grad_leaves, entry=None, trace_layer=layer_index,
                 autocast=_autocast_state(manager.device.type))
    if preserve:
        call.cpu_rng = torch.get_rng_state()
        if manager.cuda:
            call.dev_rng = torch.cuda.get_rng_state(manager.device)
    # A zero-size dummy that requires grad keeps the output in the graph when no input requires grad (the first
    # layer under LoRA): the backward still runs and reaches the adapters inside. Reentrant torch checkpoint
    # silently drops those gradients.
    dummy = torch.empty((0,), requires_grad=True)
    grad_tensors = [leaves[i] for i in grad_leaves]
    del args
    return _OffloadedLayer.apply(call, dummy, *grad_tensors)


class _LayerCheckpointFunc:
    """What a decoder layer's ``_gradient_checkpointing_func`` is set to: the offloaded checkpoint of that layer."""

    def __init__(self, manager: OffloadManager, layer_index: int, layer: nn.Module):
        self.manager = manager
        self.layer_index = layer_index
        self._layer = weakref.ref(layer)

    def __call__(self, function: Callable, *args, **checkpoint_kwargs):
        return offloaded_checkpoint(function, *args, manager=self.manager, layer_index=self.layer_index,
                                    module=self._layer(), **checkpoint_kwargs)

    def __repr__(self) -> str:
        m = self.manager
        return (f"OffloadedCheckpoint(layer={self.layer_index}, buffers={m.buffers}, prefetch={m.prefetch}, "
                f"device={m.device})")


# --- Switch on / off on a live model ------------------------------------------------------------------------------
_MANAGERS: "weakref.WeakKeyDictionary[nn.Module, OffloadManager]" = weakref.WeakKeyDictionary()
_ORIGINALS: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()


def _snapshot(module: nn.Module) -> tuple:
    return tuple(module.__dict__.get(name, _MISSING) for name in _GC_ATTRS)


def _restore(module: nn.Module, saved: tuple) -> None:
    for name, value in zip(_GC_ATTRS, saved):
        if value is _MISSING:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = value


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    raise ValueError("the model has no parameters on a real device")


def enable_offloaded_checkpointing(model: nn.Module, buffers: int = 2, prefetch: bool | None = None, *,
                                   preserve_rng_state: bool = True, serial_forward_copies: bool = False,
                                   forward_grad: bool = True, verify: bool = False,
                                   device: torch.device | str | None = None) -> OffloadManager:
    """Checkpoint every decoder layer with its input offloaded to pinned CPU memory.

    Args:
        model: a transformers causal LM, possibly PEFT-wrapped (QLoRA works: only the layer input is copied).
        buffers: GPU staging buffers for the reloads. ``1`` is the single-buffer "before" (reload of layer k-1
            waits for layer k's backward); ``2`` (default) overlaps it, for one extra buffer of
            ``tokens x hidden x 2`` bytes (84 MB for Qwen3-14B at 8k tokens).
        prefetch: issue the reload of layer k-1 as soon as layer k's backward starts (default: on with 2
            buffers; not allowed with 1).
        preserve_rng_state: restore the RNG state for the recompute (dropout-exact, like torch checkpoint).
        serial_forward_copies: do the forward device->host copies on the compute stream (sweep only).
        forward_grad: run the offloaded forward with grad mode on, nothing saved (default; the same kernels as
            standard checkpointing) or, ``False``, under ``no_grad`` (see :class:`OffloadManager`).
        verify: debug only: check bitwise that every reloaded input equals what the forward produced
            (:meth:`OffloadManager.verify_report`); keeps a device copy of every layer input.
        device: compute device (default: the model's).

    Returns:
        The model's :class:`OffloadManager` (``.memory()``, ``.stats``, ``.tracing()``). The pinned pool is kept
        across disable/enable of the same model, so toggling does not re-allocate host memory.

    Calling it again on an enabled model reconfigures it; :func:`disable_offloaded_checkpointing` restores what
    was there before the first call (standard checkpointing or none).
    """
    key = base_model(model)
    layers = decoder_layers(model)
    dev = torch.device(device) if device is not None else _model_device(model)
    manager = _MANAGERS.get(key)
    if manager is None or manager.device.type != dev.type:
        manager = OffloadManager(dev, buffers, prefetch, preserve_rng_state=preserve_rng_state,
                                 serial_forward_copies=serial_forward_copies, forward_grad=forward_grad,
                                 verify=verify)
        _MANAGERS[key] = manager
    else:
        manager.configure(buffers, prefetch)
        manager.preserve_rng_state = preserve_rng_state
        manager.serial_forward_copies = serial_forward_copies
        manager.forward_grad = forward_grad
        manager.verify = verify
    if key not in _ORIGINALS:
        _ORIGINALS[key] = [(layer, _snapshot(layer)) for layer in layers]
    for i, layer in enumerate(layers):
        if not hasattr(layer, "gradient_checkpointing"):
            raise ValueError(f"decoder layer {i} ({type(layer).__name__}) is not a transformers "
                             "GradientCheckpointingLayer: offloaded checkpointing plugs in through that class")
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = _LayerCheckpointFunc(manager, i, layer)
    return manager


def disable_offloaded_checkpointing(model: nn.Module, *, release_pool: bool = False) -> None:
    """Restore each decoder layer's checkpointing attributes exactly as they were before enabling.

    Frees the GPU staging buffers; the pinned pool is kept for the next enable unless ``release_pool``.
    A no-op on a model that is not enabled.
    """
    key = base_model(model)
    originals = _ORIGINALS.pop(key, None)
    if originals is not None:
        for layer, saved in originals:
            _restore(layer, saved)
    manager = _MANAGERS.get(key)
    if manager is not None:
        manager.release_staging()
        if release_pool:
            # Inputs still pending (a graph not yet back-propagated) keep this manager alive through their
            # autograd context; the pool memory goes when they do.
            if manager.pending == 0:
                manager.pool.clear()
            del _MANAGERS[key]


def is_offloaded(model: nn.Module) -> bool:
    """Whether offloaded checkpointing is enabled on ``model``."""
    return base_model(model) in _ORIGINALS


def offload_manager(model: nn.Module) -> OffloadManager | None:
    """The model's manager (kept across disable/enable), or None."""
    return _MANAGERS.get(base_model(model))


# --- Baselines, with the same exact way back ----------------------------------------------------------------------
class _CheckpointingSwitch:
    """Turn transformers' own checkpointing on and off with an exact restore (layers and input-grad hooks)."""

    def __init__(self, model: nn.Module, offload: bool = False):
        self.model = model
        self.offload = offload
        self._saved: list | None = None
        self._hooks_before: Any = _MISSING

    def enable(self, model: nn.Module | None = None) -> None:
        inner = base_model(self.model)
        self._saved = [(m, _snapshot(m)) for m in inner.modules() if hasattr(m, "gradient_checkpointing")]
        self._hooks_before = inner.__dict__.get("_require_grads_hooks", _MISSING)
        self._hook_before = inner.__dict__.get("_require_grads_hook", _MISSING)
        kwargs: dict[str, Any] = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
        if self.offload:
            kwargs["offload"] = True
        inner.gradient_checkpointing_enable(**kwargs)

    def disable(self, model: nn.Module | None = None) -> None:
        if self._saved is None:
            return
        inner = base_model(self.model)
        for m, saved in self._saved:
            _restore(m, saved)
        # gradient_checkpointing_enable() registers an embedding hook that makes the first layer input require
        # grad (for reentrant checkpointing under PEFT); remove it unless it was there before.
        hooks = inner.__dict__.get("_require_grads_hooks", _MISSING)
        if hooks is not self._hooks_before and hooks is not _MISSING:
            for h in hooks:
                h.remove()
        for name, before in (("_require_grads_hooks", self._hooks_before), ("_require_grads_hook", self._hook_before)):
            if before is _MISSING:
                inner.__dict__.pop(name, None)
            else:
                inner.__dict__[name] = before
        self._saved = None


def enable_standard_checkpointing(model: nn.Module, *, offload: bool = False) -> Callable[[], None]:
    """transformers' non-reentrant checkpointing (``offload=True``: its ``save_on_cpu`` offload option).

    Returns a function that restores the model exactly as it was.
    """
    switch = _CheckpointingSwitch(model, offload=offload)
    switch.enable()
    return switch.disable


# --- Benchmark: variants, guards, measurements ------------------------------------------------------------------
VARIANT_KEYS = ("standard", "none", "hf_offload", "save_on_cpu", "offload1", "offload1_serial", "offload2",
                "offload2p")
_OFFLOAD_MODES = {"offload1": (1, False, False), "offload1_serial": (1, False, True), "offload2": (2, False, False),
                  "offload2p": (2, True, False)}


class _SaveOnCpuStep:
    """Standard checkpointing with the whole forward under ``save_on_cpu(pin_memory=True)`` (the issue's peer)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.switch = _CheckpointingSwitch(model)
        self.device = device
        self.ctx = None

    def enable(self, model: nn.Module) -> None:
        self.switch.enable()
        self.ctx = torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda",
                                                    device_type=self.device.type)
        self.ctx.__enter__()

    def disable(self, model: nn.Module) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(None, None, None)
            self.ctx = None
        self.switch.disable()


class _OffloadToggle:
    """enable/disable of one offload mode for the harness; keeps the manager's memory figures of the last step."""

    def __init__(self, buffers: int, prefetch: bool, serial: bool):
        self.buffers, self.prefetch, self.serial = buffers, prefetch, serial
        self.last_memory: dict = {}
        self.last_stats: dict = {}

    def enable(self, model: nn.Module) -> None:
        enable_offloaded_checkpointing(model, self.buffers, self.prefetch, serial_forward_copies=self.serial)

    def disable(self, model: nn.Module) -> None:
        manager = offload_manager(model)
        if manager is not None:
            mem = manager.memory()
            if mem["staging_bytes"]:
                self.last_memory = mem
            self.last_stats = manager.stats.as_dict()
        disable_offloaded_checkpointing(model)


def make_variants(model: nn.Module, keys: Sequence[str] = VARIANT_KEYS, device: torch.device | None = None):
    """Harness variants for offloaded checkpointing and its baselines, each with a note of what it is and costs.

    Returns ``(variants, toggles)`` where ``toggles[name]`` is the enable/disable object (offload modes expose
    ``last_memory``).
    """
    from .bench import Variant

    device = device or _model_device(model)
    out, objs = [], {}
    for key in keys:
        if key == "standard":
            sw = _CheckpointingSwitch(model)
            v = Variant(
                "checkpointing (standard)", {"checkpointing": "standard", "offload_buffers": 0, "prefetch": False},
                enable=sw.enable, disable=sw.disable,
                note="transformers gradient_checkpointing_enable(use_reentrant=False): each layer's input stays on "
                     "the GPU (layers x tokens x hidden x 2 bytes), the layer is recomputed in backward (about one "
                     "extra forward per step). The baseline every offload mode is compared against.")
        elif key == "none":
            sw = None
            v = Variant(
                "no checkpointing", {"checkpointing": "none", "offload_buffers": 0, "prefetch": False},
                note="stock transformers, every activation kept on the GPU: the reference no optimization touches; "
                     "no recompute (fastest when it fits), the most memory.")
        elif key == "hf_offload":
            sw = _CheckpointingSwitch(model, offload=True)
            v = Variant(
                "transformers offload=True", {"checkpointing": "hf_offload", "offload_buffers": 0, "prefetch": False},
                enable=sw.enable, disable=sw.disable,
                note="transformers 5.17 gradient_checkpointing_enable(offload=True): each layer's torch checkpoint "
                     "runs inside torch.autograd.graph.save_on_cpu(pin_memory=True), so what checkpoint saves (the "
                     "layer input) goes to a freshly allocated pinned tensor (PyTorch's caching host allocator) by a "
                     "copy on the compute stream, and comes back by .to(device, non_blocking=True) on the compute "
                     "stream when the recompute asks for it: no copy overlaps compute (its docstring: 'the step gets "
                     "slower'). On a CPU-only machine it raises (pin_memory=True without an accelerator).")
        elif key == "save_on_cpu":
            sw = _SaveOnCpuStep(model, device)
            v = Variant(
                "save_on_cpu(step) + ckpt", {"checkpointing": "save_on_cpu_step", "offload_buffers": 0,
                                             "prefetch": False},
                enable=sw.enable, disable=sw.disable,
                note="standard checkpointing with the whole forward inside torch.autograd.graph.save_on_cpu("
                     "pin_memory=True) (the issue's measurement): besides the layer inputs, every tensor autograd "
                     "saves outside the checkpointed layers goes to pinned host memory and back on the compute "
                     "stream: the float32 log-softmax of the logits, packed twice because log_softmax and nll_loss both "
                     "save it (2 x tokens x vocab x 4 bytes: 40 GB at 32k tokens with Qwen3's 152k vocabulary, before "
                     "the pinned allocator's power-of-two rounding), the LM head weight, the final norm's inputs. "
                     "Host memory grows with tokens x vocab.")
        elif key in _OFFLOAD_MODES:
            buffers, prefetch, serial = _OFFLOAD_MODES[key]
            sw = _OffloadToggle(buffers, prefetch, serial)
            name = {"offload1": "offload x1 (single buffer)", "offload1_serial": "offload x1, serial fwd copies",
                    "offload2": "offload x2 (double buffer)", "offload2p": "offload x2 + prefetch"}[key]
            what = {
                "offload1": "ONE GPU staging buffer: the reload of layer k-1 waits for layer k's backward to finish "
                            "with the buffer, so copy and compute take turns (the 'before').",
                "offload1_serial": "one staging buffer AND the forward copies on the compute stream: a design that "
                                   "serialises every copy (models the published 'before').",
                "offload2": "TWO staging buffers (slot = layer parity, free/ready event per slot): the reload of "
                            "layer k-1 overlaps layer k's backward; issued when autograd reaches layer k-1.",
                "offload2p": "TWO staging buffers + prefetch: the reload of layer k-1 is issued as soon as layer k's "
                             "backward starts, before its kernels.",
            }[key]
            v = Variant(
                name, {"checkpointing": "offload", "offload_buffers": buffers, "prefetch": prefetch,
                       "serial_forward_copies": serial},
                enable=sw.enable, disable=sw.disable,
                note=f"fastsft_lab.offload: {what} Layer inputs go to a pinned pool reused across steps on a copy "
                     "stream (compute not blocked); only each staging buffer (tokens x hidden x 2 bytes) stays on "
                     "the GPU.")
        else:
            raise ValueError(f"unknown variant {key!r}; known: {', '.join(VARIANT_KEYS)}")
        out.append(v)
        objs[v.name] = sw
    return out, objs


def host_memory_available() -> int | None:
    """Bytes of host memory this process can still use: MemAvailable, capped by a cgroup limit if one is set."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_path) as f:
                raw = f.read().strip()
            if raw == "max" or int(raw) > 1 << 60:
                continue
            with open(usage_path) as f:
                left = int(raw) - int(f.read().strip())
            avail = left if avail is None else min(avail, left)
        except (OSError, ValueError):
            continue
    return avail


def estimate_host_bytes(key: str, *, num_layers: int, tokens: int, hidden: int, vocab: int,
                        dtype_bytes: int = 2) -> int:
    """Pinned host bytes a variant needs for one step (caching-allocator power-of-two rounding included)."""
    layer_inputs = num_layers * _pow2_ceil(tokens * hidden * dtype_bytes)
    if key in _OFFLOAD_MODES or key == "hf_offload":
        return layer_inputs
    if key == "save_on_cpu":
        # the float32 log-softmax of the logits, packed twice (saved by log_softmax and by nll_loss), the LM head
        # weight, the final norm's float32 inputs (pow, mul) and the LM head input
        return (layer_inputs + 2 * _pow2_ceil(tokens * vocab * 4) + _pow2_ceil(vocab * hidden * dtype_bytes)
                + 3 * _pow2_ceil(tokens * hidden * 4) + _pow2_ceil(tokens * hidden * dtype_bytes))
    return 0


def _empty_host_cache() -> None:
    for name in ("_host_emptyCache", "_cuda_hostEmptyCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - best effort
                pass
            return


def measure_bandwidth(device: torch.device | str, nbytes: int = 256 << 20, reps: int = 5) -> dict:
    """Pinned host<->device copy bandwidth (GB/s) with CUDA events; on a CPU, a plain memcpy (labelled so)."""
    device = torch.device(device)
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        out = {"bytes": nbytes, "reps": reps, "method": "pinned copies, CUDA events, current stream"}
        for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            dst.copy_(src, non_blocking=True)   # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            out[f"{name}_gbps"] = round(nbytes * reps / (start.elapsed_time(end) / 1e3) / 1e9, 2)
        del host, dev
        return out
    import time

    nbytes = min(nbytes, 64 << 20)
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    t = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    gbps = round(nbytes * reps / (time.perf_counter() - t) / 1e9, 2)
    return {"bytes": nbytes, "reps": reps, "method": "CPU memcpy (no host-device link on this machine)",
            "h2d_gbps": gbps, "d2h_gbps": gbps}


def trace_step(model: nn.Module, batch, variant, *, optimizer=None) -> list[dict]:
    """One untimed forward+backward of an offload variant with copy/compute intervals recorded."""
    variant.enable(model)
    try:
        manager = offload_manager(model)
        if manager is None:
            raise ValueError(f"variant {variant.name!r} does not enable offloaded checkpointing")
        with manager.tracing() as trace:
            out = model(**variant.inputs(batch, None))
            out.loss.backward()
        events = trace.events()
    finally:
        variant.disable(model)
        model.zero_grad(set_to_none=True)
    return events


def _as_tuple(value, default) -> tuple:
    if value is None:
        return tuple(default)
    if isinstance(value, (list, tuple)):
        return tuple(value)
    return (value,)


def _scenario_defaults(device: torch.device, smoke: bool) -> dict:
    if smoke:
        return dict(preset="tiny-qwen3", num_layers=None, quant="nf4", lora_rank=8, attn="sdpa",
                    dtype=torch.float32 if device.type == "cpu" else torch.bfloat16,
                    tokens=(256, 512), row_tokens=256, steps=3, warmup=1, mix="short",
                    plan={256: VARIANT_KEYS[:3] + ("save_on_cpu", "offload1", "offload2", "offload2p")},
                    full_plan=("standard", "offload1", "offload2", "offload2p"), traced=("offload1", "offload2p"),
                    sweep_presets=("tiny-qwen3",), sweep_tokens=(256, 512), sweep_row_tokens=128,
                    sweep_layers=3, sweep_steps=2)
    return dict(preset="qwen3-14b", num_layers=10, quant="nf4", lora_rank=16, attn="sdpa", dtype=torch.bfloat16,
                tokens=(8192, 16384, 32768), row_tokens=8192, steps=5, warmup=2, mix="realistic",
                plan={8192: ("standard", "none", "hf_offload", "save_on_cpu", "offload1", "offload2", "offload2p"),
                      16384: ("standard", "hf_offload", "save_on_cpu", "offload1", "offload2p")},
                full_plan=("standard", "offload1", "offload2p"), traced=("offload1", "offload2", "offload2p"),
                sweep_presets=("qwen3-0.6b", "qwen3-14b"), sweep_tokens=(4096, 16384), sweep_row_tokens=2048,
                sweep_layers=4, sweep_steps=4)


def vram_saved_estimate(num_layers: int, tokens: int, hidden: int, dtype_bytes: int, staging: int) -> dict:
    """GPU bytes of layer inputs that checkpointing keeps and offloading frees (minus its staging buffers)."""
    per_layer = tokens * hidden * dtype_bytes
    return {"layers": num_layers, "layer_input_bytes": per_layer,
            "checkpoint_inputs_bytes": num_layers * per_layer,
            "offload2_staging_bytes": staging, "net_saved_bytes": num_layers * per_layer - staging}


def _gain(slow: float | None, fast: float | None) -> float | None:
    """``slow / fast - 1`` (how much faster ``fast`` is), rounded; None when either time is missing."""
    return round(slow / fast - 1, 4) if slow and fast else None


def _derived(rows: list[dict], device: torch.device | None = None) -> dict:
    by = {r["name"]: r for r in rows}

    def step(name):
        r = by.get(name)
        return r["step_ms"]["median"] if r and "step_ms" in r else None

    def peak(name):
        r = by.get(name)
        return r.get("peak_mem_bytes") if r else None

    std, x1, x2p = step("checkpointing (standard)"), step("offload x1 (single buffer)"), step("offload x2 + prefetch")
    x2, soc = step("offload x2 (double buffer)"), step("save_on_cpu(step) + ckpt")
    hf = step("transformers offload=True")
    d: dict[str, Any] = {k: v for k, v in (("double_prefetch_vs_single_gain", _gain(x1, x2p)),
                                           ("double_vs_single_gain", _gain(x1, x2)),
                                           ("offload2p_vs_standard_overhead", _gain(x2p, std))) if v is not None}
    if std and x2p:
        d["target_within_3pct_of_standard"] = x2p <= std * 1.03
    if soc and x2p:
        d["offload2p_speedup_vs_save_on_cpu_step"] = round(soc / x2p, 3)
        d["target_1p5x_vs_save_on_cpu"] = soc / x2p >= 1.5
    if hf and x2p:
        d["offload2p_speedup_vs_transformers_offload"] = round(hf / x2p, 3)
    if peak("checkpointing (standard)") and peak("offload x2 + prefetch"):
        d["peak_saved_vs_standard_bytes"] = peak("checkpointing (standard)") - peak("offload x2 + prefetch")
        d["target_peak_below_standard"] = d["peak_saved_vs_standard_bytes"] > 0
    second = by.get("offload x2 + prefetch", {}).get("offload_memory", {}).get("staging_bytes_per_buffer")
    if second:
        d["second_buffer_bytes"] = second
        d["target_second_buffer_le_0p5GB"] = second <= 0.5e9
    if device is not None and device.type != "cuda":
        # a CPU run has no streams and no GPU memory: the issue's targets are not evaluated there
        d = {k: v for k, v in d.items() if not k.startswith("target_")}
        d["note"] = "CPU smoke run: targets are evaluated on a GPU only"
    return d


def plot_offload_result(result: dict, path: str) -> str:
    """Step time against standard checkpointing (ratio labels) and peak GPU memory, one bar per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["variants"] if "step_ms" in r]
    if not rows:
        raise ValueError("nothing to plot: no variant has a step time")
    base = rows[0]["step_ms"]["median"]
    names = [r["name"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    ms = [r["step_ms"]["median"] for r in rows]
    bars = a1.bar(range(len(rows)), ms, color=["#777" if i == 0 else "#4C72B0" for i in range(len(rows))],
                  yerr=[[m - r["step_ms"]["p20"] for m, r in zip(ms, rows)],
                        [r["step_ms"]["p80"] - m for m, r in zip(ms, rows)]], capsize=3)
    for bar, m in zip(bars, ms):
        a1.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{m / base:.2f}x", ha="center", va="bottom",
                fontsize=8)
    a1.set_ylabel(f"step ms (ratio to {names[0]}; lower is better)")
    peaks = [r.get("peak_mem_bytes") for r in rows]
    if any(peaks):
        gib = [(p or 0) / 2**30 for p in peaks]
        pb = a2.bar(range(len(rows)), gib, color="#DD8452")
        for bar, g in zip(pb, gib):
            a2.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{g:.2f}", ha="center", va="bottom",
                    fontsize=8)
        a2.set_ylabel("peak GPU memory GiB (allocated)")
    else:
        a2.text(0.5, 0.5, "peak GPU memory: n/a on a CPU run", ha="center", va="center", transform=a2.transAxes)
    for ax in (a1, a2):
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    env = result.get("env", {})
    where = env.get("gpu_name") or f"CPU ({env.get('cpu_count')} cores)"
    cfg = result.get("config", {})
    fig.suptitle(f"offloaded checkpointing: {cfg.get('model')} x{cfg.get('num_layers')} layers | "
                 f"{cfg.get('tokens_per_step')} tokens/step | {where}", fontsize=9)
    fig.tight_layout()
    from .bench import save_figure

    save_figure(fig, path)
    return path


def _run_config(model, device, *, cfg: dict, tokens: int, keys: Sequence[str], steps: int, warmup: int,
                progress: bool, count_syncs: bool, traced: Sequence[str], host_fraction: float) -> tuple[dict, dict]:
    from .bench import make_result, run_variants
    from .data import benchmark_batches

    mcfg = base_model(model).config
    hidden, vocab, layers = mcfg.hidden_size, mcfg.vocab_size, mcfg.num_hidden_layers
    row = min(cfg["row_tokens"], tokens)
    batches = benchmark_batches(tokens_per_step=tokens, row_tokens=row, steps=max(2, min(steps, 4)),
                                vocab_size=vocab, mix=cfg["mix"])
    batches = [b.to(device) for b in batches]
    dtype_bytes = torch.finfo(cfg["dtype"]).bits // 8
    avail = host_memory_available() if device.type == "cuda" else None
    run_keys, skipped = [], []
    for key in keys:
        need = estimate_host_bytes(key, num_layers=layers, tokens=tokens, hidden=hidden, vocab=vocab,
                                   dtype_bytes=dtype_bytes)
        if device.type == "cpu" and key == "hf_offload":
            skipped.append((key, need, "transformers 5.17 offload=True raises on a CPU-only machine "
                                       "(save_on_cpu(pin_memory=True) without an accelerator); GPU runs only"))
        elif avail is not None and need > host_fraction * avail:
            skipped.append((key, need, f"host-memory guard: needs about {need / 2**30:.1f} GiB pinned, more than "
                                       f"{host_fraction:.0%} of the {avail / 2**30:.1f} GiB available"))
        else:
            run_keys.append(key)
    variants, toggles = make_variants(model, run_keys, device)
    rows = run_variants(model, batches, variants, steps=steps, warmup=warmup, count_syncs=count_syncs,
                        progress=progress, label=f"offload {tokens} tok")
    timelines: dict[str, list] = {}
    for v, r in zip(variants, rows):
        key = run_keys[variants.index(v)]
        r["host_bytes_estimate"] = estimate_host_bytes(key, num_layers=layers, tokens=tokens, hidden=hidden,
                                                       vocab=vocab, dtype_bytes=dtype_bytes)
        obj = toggles[v.name]
        if isinstance(obj, _OffloadToggle):
            r["offload_memory"] = obj.last_memory
            r["offload_stats_last_step"] = obj.last_stats
            if key in traced and "error" not in r:
                events = trace_step(model, batches[0], v)
                timelines[v.name] = events
                from .timeline import copy_overlap

                r["copy_overlap"] = copy_overlap(events)
    for key, need, reason in skipped:
        name = make_variants(model, [key], device)[0][0].name
        rows.append({"name": name, "toggles": {"checkpointing": key}, "error": f"skipped: {reason}",
                     "skipped": True, "host_bytes_estimate": need})
    staging = next((r.get("offload_memory", {}).get("staging_bytes") for r in rows
                    if r["name"] == "offload x2 + prefetch" and r.get("offload_memory")), 0) or 0
    config = {"model": cfg["preset"], "num_layers": layers, "hidden_size": hidden, "vocab_size": vocab,
              "quant": cfg["quant"], "lora_rank": cfg["lora_rank"], "attn_implementation": cfg["attn"],
              "dtype": str(cfg["dtype"]).replace("torch.", ""), "tokens_per_step": tokens, "row_tokens": row,
              "rows": tokens // row, "steps": steps, "warmup": warmup, "length_mix": cfg["mix"],
              "layer_input_bytes": tokens * hidden * dtype_bytes, "host_memory_available_bytes": avail,
              "vram_saved_estimate_at_40_layers": vram_saved_estimate(40, tokens, hidden, dtype_bytes, staging),
              "bandwidth": cfg.get("bandwidth"), "cpu_threads": cfg.get("cpu_threads")}
    notes = ("Variants interleaved step by step on the same batches; first row (standard checkpointing) is 1.00x. "
             "copy_overlap: from CUDA events recorded on the copy and compute streams in one extra traced step "
             "(fastsft_lab.timeline.copy_overlap). Peak memory: torch.cuda.max_memory_allocated per step.")
    if device.type == "cpu":
        notes += " CPU smoke run: no streams, every copy is synchronous: timings say nothing about overlap."
    result = make_result("offload", config, rows, device, notes)
    result["derived"] = _derived(rows, device)
    timeline_doc = {"scenario": "offload_timeline", "env": result["env"], "config": config, "timelines": timelines,
                    "overlap": {k: r.get("copy_overlap") for k, r in ((r["name"], r) for r in rows)
                                if r.get("copy_overlap")}}
    return result, timeline_doc


def _run_sweep(device, *, cfg: dict, out_dir: str, steps: int, warmup: int, progress: bool) -> dict:
    """Where does the second buffer matter? Widths x tokens at reduced depth; gain of x2+prefetch over x1."""
    from .bench import make_result, run_variants
    from .data import benchmark_batches
    from .models import LoraSettings, build_model
    from .timeline import copy_overlap

    keys = ("standard", "offload1", "offload1_serial", "offload2p")
    rows: list[dict] = []
    points: list[dict] = []
    for preset in cfg["sweep_presets"]:
        model = build_model(preset, device=device, dtype=cfg["dtype"], quant=cfg["quant"],
                            lora=LoraSettings(rank=cfg["lora_rank"]), num_layers=cfg["sweep_layers"],
                            attn_implementation=cfg["attn"])
        mcfg = base_model(model).config
        for tokens in cfg["sweep_tokens"]:
            row = min(cfg["sweep_row_tokens"], tokens)
            batches = [b.to(device) for b in benchmark_batches(tokens_per_step=tokens, row_tokens=row, steps=2,
                                                               vocab_size=mcfg.vocab_size, mix=cfg["mix"])]
            variants, _ = make_variants(model, keys, device)
            res = run_variants(model, batches, variants, steps=steps, warmup=warmup, count_syncs=False,
                               progress=progress, label=f"sweep {preset} {tokens}")
            point = {"preset": preset, "hidden_size": mcfg.hidden_size, "tokens": tokens, "row_tokens": row,
                     "num_layers": mcfg.num_hidden_layers}
            for v, r in zip(variants, res):
                r = dict(r)
                r["name"] = f"{preset} {tokens}: {v.name}"
                r["sweep_point"] = dict(point)
                if v.name in ("offload x1 (single buffer)", "offload x2 + prefetch") and "error" not in r:
                    ov = copy_overlap(trace_step(model, batches[0], v))
                    r["copy_overlap"] = ov
                    if v.name == "offload x2 + prefetch":
                        # copy/compute ratio in backward: total reload time / total layer recompute+backward time
                        point["h2d_ms_total"] = ov["h2d_ms"]
                        point["bwd_ms_total"] = ov["bwd_ms"]
                        if ov["bwd_ms"] > 0:
                            point["copy_to_backward_ratio"] = round(ov["h2d_ms"] / ov["bwd_ms"], 4)
                rows.append(r)
            by = {r["name"].split(": ", 1)[1]: r for r in rows if r.get("sweep_point", {}).get("preset") == preset
                  and r["sweep_point"]["tokens"] == tokens}

            def ms(n):
                return by.get(n, {}).get("step_ms", {}).get("median")
            x1, x1s, x2p, std = (ms("offload x1 (single buffer)"), ms("offload x1, serial fwd copies"),
                                 ms("offload x2 + prefetch"), ms("checkpointing (standard)"))
            for key, value in (("gain_x2p_vs_x1", _gain(x1, x2p)), ("gain_x2p_vs_x1_serial", _gain(x1s, x2p)),
                               ("x2p_vs_standard", _gain(x2p, std))):
                if value is not None:
                    point[key] = value
            points.append(point)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    config = {"model": "sweep", "presets": list(cfg["sweep_presets"]), "tokens": list(cfg["sweep_tokens"]),
              "row_tokens": cfg["sweep_row_tokens"], "num_layers": cfg["sweep_layers"], "steps": steps,
              "warmup": warmup, "quant": cfg["quant"], "lora_rank": cfg["lora_rank"]}
    result = make_result("offload_sweep", config, rows, device,
                         "Regime sweep: the second buffer hides the reloads, so its gain over one buffer grows with "
                         "the copy-to-compute ratio (narrower layers, shorter rows, slower links).")
    result["points"] = points
    return result


def _run_vram_check(device, *, cfg: dict, out_dir: str, layers: int, tokens: int, progress: bool) -> dict:
    """Peak memory of standard checkpointing vs offload x2 + prefetch at full depth (e.g. all 40 layers)."""
    import os

    from .bench import format_table, make_result, run_variants, write_json
    from .data import benchmark_batches
    from .models import LoraSettings, build_model

    model = build_model(cfg["preset"], device=device, dtype=cfg["dtype"], quant=cfg["quant"],
                        lora=LoraSettings(rank=cfg["lora_rank"]) if cfg["lora_rank"] else None,
                        num_layers=layers, attn_implementation=cfg["attn"])
    mcfg = base_model(model).config
    row = min(cfg["row_tokens"], tokens)
    batches = [b.to(device) for b in benchmark_batches(tokens_per_step=tokens, row_tokens=row, steps=1,
                                                       vocab_size=mcfg.vocab_size, mix=cfg["mix"])]
    variants, toggles = make_variants(model, ("standard", "offload2p"), device)
    rows = run_variants(model, batches, variants, steps=1, warmup=1, count_syncs=False, progress=progress,
                        label=f"vram {layers} layers")
    for v, r in zip(variants, rows):
        if isinstance(toggles[v.name], _OffloadToggle):
            r["offload_memory"] = toggles[v.name].last_memory
    dtype_bytes = torch.finfo(cfg["dtype"]).bits // 8
    config = {"model": cfg["preset"], "num_layers": layers, "tokens_per_step": tokens, "row_tokens": row,
              "quant": cfg["quant"], "lora_rank": cfg["lora_rank"], "steps": 1, "warmup": 1,
              "vram_saved_estimate": vram_saved_estimate(layers, tokens, mcfg.hidden_size, dtype_bytes, 0)}
    result = make_result("offload_vram", config, rows, device,
                         "Peak memory at full depth: one warm-up and one measured step per variant.")
    peaks = [r.get("peak_mem_bytes") for r in rows]
    if all(peaks):
        result["derived"] = {"peak_saved_bytes": peaks[0] - peaks[1]}
    write_json(result, os.path.join(out_dir, f"offload-vram-{cfg['preset']}-{layers}L-{tokens}.json"))
    print(format_table(result))
    disable_offloaded_checkpointing(model, release_pool=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def plot_sweep(result: dict, path: str) -> str:
    """Gain of double buffer + prefetch over one buffer vs the measured copy/backward ratio, with the model curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .timeline import simulate_schedule, span_ms

    fig, ax = plt.subplots(figsize=(7, 4.2))
    rs = [i / 100 for i in range(0, 101, 2)]
    L = 10
    model_gain = []
    for r in rs:
        one = span_ms(simulate_schedule(L, fwd_ms=0.5, bwd_ms=1.0, copy_ms=r, buffers=1))
        two = span_ms(simulate_schedule(L, fwd_ms=0.5, bwd_ms=1.0, copy_ms=r, buffers=2))
        model_gain.append((one / two - 1) * 100)
    ax.plot(rs, model_gain, color="gray", ls="--", label="schedule model (10 layers, fwd = bwd/2)")
    for p in result.get("points", []):
        if "copy_to_backward_ratio" in p and "gain_x2p_vs_x1" in p:
            ax.scatter([p["copy_to_backward_ratio"]], [p["gain_x2p_vs_x1"] * 100], color="#4C72B0")
            ax.annotate(f"{p['preset']} {p['tokens']}", (p["copy_to_backward_ratio"], p["gain_x2p_vs_x1"] * 100),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("reload copy time / layer backward time")
    ax.set_ylabel("step-time gain of 2 buffers + prefetch over 1 buffer (%)")
    ax.axhline(6.7, color="#C44E52", lw=0.8, ls=":", label="published +6.7% (14B)")
    ax.legend(fontsize=8)
    ax.set_title("Where the second buffer matters", fontsize=9)
    fig.tight_layout()
    from .bench import save_figure

    save_figure(fig, path)
    return path


# --- Checks a notebook or a user can run on their own model ------------------------------------------------------
def _grads_of_step(model: nn.Module, inputs: dict, seed: int) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**inputs).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def compare_grads(ref: tuple[torch.Tensor, dict], got: tuple[torch.Tensor, dict], *, rtol: float,
                  atol: float) -> dict:
    """Per-tensor comparison of two ``(loss, {name: grad})`` results: ``|a - b| <= atol + rtol * max|a|``.

    Returns ``{"ok", "bitwise_equal", "max_abs_diff", "n_tensors", "n_failing", "failing" (up to 8 names, worst
    first), "missing" (names with a gradient on one side only), "worst": {"name", "max_abs_diff", "scale",
    "allowed"}}``. ``worst`` is the tensor with the largest diff relative to what it is allowed, so a failure
    report names the tensor, its max |diff| and its scale (a near-zero tensor shows as scale ~0).
    """
    (la, ga), (lb, gb) = ref, got
    missing = sorted(set(ga) ^ set(gb))
    rows = []
    for name, a, b in [("loss", la, lb)] + [(n, ga[n], gb[n]) for n in ga if n in gb]:
        a, b = a.detach().float(), b.detach().float()
        diff = float((a - b).abs().max()) if a.numel() else 0.0
        scale = float(a.abs().max()) if a.numel() else 0.0
        rows.append((name, diff, scale, atol + rtol * scale))

    def severity(r) -> float:
        _, diff, _, allowed = r
        if diff != diff:        # NaN
            return float("inf")
        if diff == 0:
            return 0.0
        return diff / allowed if allowed > 0 else float("inf")

    failing = sorted((r for r in rows if not r[1] <= r[3]), key=severity, reverse=True)
    worst = max(rows, key=severity)
    return {"ok": not failing and not missing,
            "bitwise_equal": not missing and all(r[1] == 0 for r in rows),
            "max_abs_diff": max(r[1] for r in rows), "n_tensors": len(rows), "n_failing": len(failing),
            "failing": [r[0] for r in failing[:8]], "missing": missing[:8],
            "worst": {"name": worst[0], "max_abs_diff": worst[1], "scale": worst[2], "allowed": worst[3]}}


def _mode_name(buffers: int, prefetch: bool) -> str:
    return f"offload x{buffers}{' + prefetch' if prefetch else ''}"


def check_equivalence(model: nn.Module, inputs: dict, *, modes: Sequence[tuple[int, bool]] = ((1, False), (2, False),
                      (2, True)), rtol: float | None = None, atol: float | None = None, seed: int = 0,
                      forward_grad: bool = True) -> dict:
    """Loss and gradients of every offload mode against standard checkpointing and against no checkpointing.

    Tolerances default to exact in float32 on a CPU, and otherwise to bf16 noise on the scale of each tensor
    (``|a - b| <= atol + rtol * max|a|``; GPU attention backward kernels may accumulate in a different order from
    run to run).

    Returns:
        ``{"standard_vs_no_checkpointing": bool, "tolerance": {...}, "reports": {"standard_vs_no_checkpointing":
        report}, "offload x1": {"vs_standard": bool, "vs_no_checkpointing": bool, "max_abs_diff": float,
        "report": {"vs_standard": report, "vs_no_checkpointing": report}}, ...}`` with one entry per mode; each
        ``report`` is :func:`compare_grads`'s (worst tensor, its max |diff| and scale). :func:`format_equivalence`
        prints it.
    """
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    exact = dtype == torch.float32 and _model_device(model).type == "cpu"
    rtol = rtol if rtol is not None else (0.0 if exact else 2e-2)
    atol = atol if atol is not None else (0.0 if exact else 1e-6)
    if is_offloaded(model):
        raise RuntimeError("turn offloaded checkpointing off before check_equivalence (it toggles it itself)")
    model.train()

    reference = _grads_of_step(model, inputs, seed)
    restore = enable_standard_checkpointing(model)
    try:
        standard = _grads_of_step(model, inputs, seed)
    finally:
        restore()
    std_rep = compare_grads(reference, standard, rtol=rtol, atol=atol)
    out: dict[str, Any] = {"standard_vs_no_checkpointing": std_rep["ok"],
                           "tolerance": {"rtol": rtol, "atol": atol, "exact": exact},
                           "reports": {"standard_vs_no_checkpointing": std_rep}}
    for buffers, prefetch in modes:
        enable_offloaded_checkpointing(model, buffers, prefetch, forward_grad=forward_grad)
        try:
            got = _grads_of_step(model, inputs, seed)
        finally:
            disable_offloaded_checkpointing(model)
        vs_std = compare_grads(standard, got, rtol=rtol, atol=atol)
        vs_ref = compare_grads(reference, got, rtol=rtol, atol=atol)
        out[_mode_name(buffers, prefetch)] = {
            "vs_standard": vs_std["ok"], "vs_no_checkpointing": vs_ref["ok"], "max_abs_diff": vs_std["max_abs_diff"],
            "report": {"vs_standard": vs_std, "vs_no_checkpointing": vs_ref}}
    return out


def _format_report(rep: dict) -> str:
    if rep["bitwise_equal"]:
        return f"bitwise equal ({rep['n_tensors']} tensors incl. the loss)"
    w = rep["worst"]
    text = (f"{'bitwise equal' if rep['bitwise_equal'] else 'max |diff| ' + format(rep['max_abs_diff'], '.3g')}; "
            f"worst {w['name']}: |diff| {w['max_abs_diff']:.3g}, scale {w['scale']:.3g}, allowed {w['allowed']:.3g}")
    if rep["n_failing"]:
        text += f"; {rep['n_failing']}/{rep['n_tensors']} tensors outside tolerance"
    if rep["missing"]:
        text += f"; gradient on one side only: {', '.join(rep['missing'])}"
    return text


def format_equivalence(eq: dict) -> str:
    """:func:`check_equivalence`'s result as text: verdicts, then the worst tensor of every comparison."""
    lines = [f"standard checkpointing == no checkpointing: {eq['standard_vs_no_checkpointing']}"]
    modes = [k for k in eq if k.startswith("offload")]
    for k in modes:
        lines.append(f"{k:22s} == standard: {eq[k]['vs_standard']}   == no checkpointing: "
                     f"{eq[k]['vs_no_checkpointing']}")
    tol = eq.get("tolerance", {})
    lines.append(f"per tensor |a - b| <= {tol.get('atol')} + {tol.get('rtol')} * max|a|"
                 + (" (exact)" if tol.get("exact") else ""))
    lines.append(f"  standard vs none: {_format_report(eq['reports']['standard_vs_no_checkpointing'])}")
    for k in modes:
        for against in ("vs_standard", "vs_no_checkpointing"):
            lines.append(f"  {k} {against.replace('_', ' ')}: {_format_report(eq[k]['report'][against])}")
    return "\n".join(lines)


def check_transport(model: nn.Module, inputs: dict, *, modes: Sequence[tuple[int, bool]] = ((1, False), (2, False),
                    (2, True)), seed: int = 0, forward_grad: bool = True) -> dict:
    """Where would a difference come from? Checks the offload's two halves separately, bitwise (debug; syncs).

    * forward: the layer inputs the offloaded forward produces (and copies to the host) against the layer inputs
      of a plain forward (no checkpointing, grad on): equal bits mean the offloaded forward runs the same kernels.
    * transport: with :class:`OffloadManager`'s ``verify`` mode, every staged input is compared with a device copy
      taken in forward, when the recompute reads it and again after the layer's backward (a stream-ordering or
      memory-lifetime race shows up here).

    Returns ``{mode: {"forward_inputs_bitwise_equal", "forward_inputs_max_abs_diff", "first_differing_layer",
    "loss_abs_diff", "transport_ok", "checked", "mismatched"}}``.
    """
    if is_offloaded(model):
        raise RuntimeError("turn offloaded checkpointing off before check_transport (it toggles it itself)")
    model.train()
    layers = decoder_layers(model)
    captured: dict[int, torch.Tensor] = {}

    def capture(i):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            if i not in captured and isinstance(x, torch.Tensor):
                captured[i] = x.detach().clone()
        return hook

    handles = [layer.register_forward_pre_hook(capture(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        ref_loss = model(**inputs).loss.detach()
    finally:
        for h in handles:
            h.remove()
    out: dict[str, Any] = {}
    for buffers, prefetch in modes:
        manager = enable_offloaded_checkpointing(model, buffers, prefetch, forward_grad=forward_grad, verify=True)
        try:
            model.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            loss = model(**inputs).loss
            entries = sorted((e for e in (r() for r in list(manager._pending.values())) if e is not None),
                             key=lambda e: e.seq)
            diffs = []
            for e in entries:
                ref = captured.get(e.layer)
                if ref is None or e.reference is None or ref.shape != e.reference.shape:
                    continue
                diffs.append((e.layer, float((e.reference.float() - ref.float()).abs().max()),
                              torch.equal(e.reference, ref)))
            loss.backward()
            rep = manager.verify_report()
            model.zero_grad(set_to_none=True)
        finally:
            manager.verify = False
            disable_offloaded_checkpointing(model)
        differing = [layer for layer, _, same in diffs if not same]
        out[_mode_name(buffers, prefetch)] = {
            "forward_inputs_bitwise_equal": bool(diffs) and not differing,
            "forward_inputs_max_abs_diff": max((d for _, d, _ in diffs), default=0.0),
            "first_differing_layer": min(differing) if differing else None,
            "loss_abs_diff": float((loss.detach().float() - ref_loss.float()).abs()),
            "transport_ok": rep["ok"], "checked": rep["checked"], "mismatched": rep["mismatched"][:8]}
    return out


def check_no_leak(model: nn.Module, inputs: dict, *, steps: int = 10, buffers: int = 2,
                  prefetch: bool | None = None) -> dict:
    """Run ``steps`` training steps with offload on; report whether pool, staging and registry stay flat."""
    disable_offloaded_checkpointing(model, release_pool=True)
    manager = enable_offloaded_checkpointing(model, buffers, prefetch)
    cuda = manager.cuda
    seen, alloc, registry_empty = [], [], True
    try:
        for _ in range(steps):
            model(**inputs).loss.backward()
            model.zero_grad(set_to_none=True)
            registry_empty &= manager.pending == 0 and manager.pool.in_use == 0
            seen.append((manager.pool.allocations, manager.pool.nbytes, tuple(manager.staging_bytes)))
            if cuda:
                torch.cuda.synchronize(manager.device)
                alloc.append(torch.cuda.memory_allocated(manager.device))
    finally:
        disable_offloaded_checkpointing(model, release_pool=True)
    return {"pool_flat_after_step_1": len(set(seen[1:])) <= 1, "registry_empty_after_each_backward": registry_empty,
            "gpu_allocated_flat": (len(set(alloc[1:])) <= 1) if cuda else None,
            "pool_bytes": seen[-1][1], "pool_allocations": seen[-1][0], "staging_bytes": list(seen[-1][2])}


# --- Reading results back (the notebook shows the H200 run from benchmarks/results) -------------------------------
def default_results_dir() -> str:
    """``benchmarks/results`` of the repository this package sits in."""
    import pathlib

    return str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results")


def load_results(root: str | None = None, *, device_type: str = "cuda") -> dict:
    """This scenario's JSON files found under ``root`` (recursively), newest run first, for one device type.

    Returns ``{"offload": [...by tokens], "timeline": [...], "sweep": [...], "vram": [...], "root": root}``;
    lists are empty when nothing was found (e.g. before the GPU run).
    """
    import glob
    import os

    root = root or default_results_dir()
    kinds = {"offload": "offload", "offload_timeline": "timeline", "offload_sweep": "sweep", "offload_vram": "vram"}
    out: dict[str, Any] = {v: [] for v in kinds.values()}
    out["root"] = root
    docs = []
    for path in glob.glob(os.path.join(root, "**", "offload*.json"), recursive=True):
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if doc.get("scenario") in kinds and doc.get("env", {}).get("device") == device_type:
            doc["_path"] = path
            docs.append(doc)
    # per kind, keep the newest run only (by the env date; one folder per run)
    for kind in kinds:
        mine = [d for d in docs if d["scenario"] == kind]
        if not mine:
            continue
        newest = max(mine, key=lambda d: (d["env"].get("date", ""), d["_path"]))
        folder = os.path.dirname(newest["_path"])
        out[kinds[kind]] = [d for d in mine if os.path.dirname(d["_path"]) == folder]
    for k in ("offload", "timeline"):
        out[k].sort(key=lambda d: d["config"].get("tokens_per_step", 0))
    return out


def results_table(results: Sequence[dict]) -> str:
    """Step time (ratio to standard checkpointing) and peak memory of every variant, one column per token count."""
    if not results:
        return "(no results)"
    names: list[str] = []
    for r in results:
        for v in r["variants"]:
            if v["name"] not in names:
                names.append(v["name"])
    cols = [r["config"]["tokens_per_step"] for r in results]
    head = f"{'variant':32s}" + "".join(f"{str(t) + ' tokens':>30s}" for t in cols)
    lines = [head, "-" * len(head)]
    for n in names:
        cells = []
        for r in results:
            by = {v["name"]: v for v in r["variants"]}
            v = by.get(n)
            std = by.get("checkpointing (standard)", {}).get("step_ms", {}).get("median")
            if v is None:
                cells.append("-")
            elif "step_ms" not in v:
                cells.append("skipped" if v.get("skipped") else "error")
            else:
                ms = v["step_ms"]["median"]
                peak = v.get("peak_mem_bytes")
                ratio = f" {ms / std:.2f}x" if std else ""
                cells.append(f"{ms:7.0f} ms{ratio} {peak / 2**30:5.1f} GiB" if peak else f"{ms:7.1f} ms{ratio}")
        lines.append(f"{n:32s}" + "".join(f"{c:>30s}" for c in cells))
    return "\n".join(lines)


def plot_across_tokens(results: Sequence[dict], path: str | None = None):
    """Step time relative to standard checkpointing and peak GPU memory, grouped by tokens per step."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["checkpointing (standard)", "no checkpointing", "transformers offload=True",
             "save_on_cpu(step) + ckpt", "offload x1 (single buffer)", "offload x2 (double buffer)",
             "offload x2 + prefetch"]
    present = [n for n in names if any(v["name"] == n and "step_ms" in v for r in results for v in r["variants"])]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.4))
    width = 0.8 / max(1, len(present))
    for j, n in enumerate(present):
        xs, ratios, peaks = [], [], []
        for i, r in enumerate(results):
            by = {v["name"]: v for v in r["variants"]}
            std = by.get("checkpointing (standard)", {}).get("step_ms", {}).get("median")
            v = by.get(n)
            if v is None or "step_ms" not in v or not std:
                continue
            xs.append(i + (j - (len(present) - 1) / 2) * width)
            ratios.append(v["step_ms"]["median"] / std)
            peaks.append((v.get("peak_mem_bytes") or 0) / 2**30)
        bars = a1.bar(xs, ratios, width=width, label=n)
        for b, rt in zip(bars, ratios):
            a1.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{rt:.2f}", ha="center", va="bottom", fontsize=6)
        a2.bar(xs, peaks, width=width, label=n)
    for ax in (a1, a2):
        ax.set_xticks(range(len(results)))
        ax.set_xticklabels([f"{r['config']['tokens_per_step']} tokens" for r in results])
    a1.axhline(1.0, color="gray", lw=0.8, ls="--")
    a1.set_ylabel("step time / standard checkpointing (lower is better)")
    a2.set_ylabel("peak GPU memory GiB")
    a1.legend(fontsize=7)
    env = results[0].get("env", {}) if results else {}
    cfg = results[0].get("config", {}) if results else {}
    fig.suptitle(f"{cfg.get('model')} x{cfg.get('num_layers')} layers, {cfg.get('quant')} + LoRA "
                 f"r{cfg.get('lora_rank')} | {env.get('gpu_name') or 'CPU'}", fontsize=9)
    fig.tight_layout()
    if path is not None:
        from .bench import save_figure

        save_figure(fig, path)
    return fig


def bench_scenario(*, device, smoke: bool, out_dir: str, steps: int | None = None, warmup: int | None = None,
                   progress: bool = True, **options) -> list[dict]:
    """Benchmark offloaded checkpointing (1 buffer, 2 buffers, 2 + prefetch) against its baselines.

    GPU default (about 3 min on an H200): Qwen3-14B width, 10 layers, NF4 + LoRA r16, sdpa; rows of 8192 tokens;
    warm-up 2, 5 measured steps; 8k: every variant (incl. no checkpointing and x2 without prefetch); 16k: standard,
    transformers offload, save_on_cpu(step), x1, x2 + prefetch; 32k: standard, x1, x2 + prefetch; one extra traced
    step per offload mode for the copy/compute timeline; host syncs counted at 8k only. CPU/smoke: tiny-qwen3,
    seconds.

    Options (``--set offload.KEY=VALUE``): ``preset``, ``num_layers``, ``tokens`` (list), ``row_tokens``,
    ``variants`` (list of keys from ``VARIANT_KEYS``, applied to every token count), ``full_plan`` (keys for token
    counts without an explicit plan), ``quant`` (``nf4``/``none``), ``lora_rank``, ``host_fraction`` (0.5: the share
    of available host memory a variant may pin), ``count_syncs`` (first config only by default), ``sweep`` (bool),
    ``sweep_presets``, ``sweep_tokens``, ``sweep_row_tokens``, ``sweep_layers``, ``sweep_steps``, ``sweep_only``,
    ``vram_layers`` (e.g. 40: also measure peak memory of standard vs offload x2 + prefetch at that depth, one
    step each, at ``vram_tokens`` = 16384).
    """
    import os

    device = torch.device(device)
    cfg = _scenario_defaults(device, smoke)
    for k in ("preset", "num_layers", "row_tokens", "lora_rank", "mix", "sweep_row_tokens", "sweep_layers",
              "sweep_steps"):
        if k in options:
            cfg[k] = options.pop(k)
    if "quant" in options:
        q = options.pop("quant")
        cfg["quant"] = None if q in (None, "none", False) else q
    for k in ("tokens", "sweep_presets", "sweep_tokens", "full_plan", "traced"):
        if k in options:
            cfg[k] = _as_tuple(options.pop(k), ())
    if "variants" in options:
        keys = _as_tuple(options.pop("variants"), ())
        cfg["plan"] = {t: keys for t in cfg["tokens"]}
    sweep = bool(options.pop("sweep", False))
    sweep_only = bool(options.pop("sweep_only", False))
    host_fraction = float(options.pop("host_fraction", 0.5))
    count_syncs_opt = options.pop("count_syncs", None)
    vram_layers = options.pop("vram_layers", None)
    vram_tokens = options.pop("vram_tokens", 256 if smoke else 16384)
    if options:
        raise ValueError(f"unknown offload scenario option(s): {', '.join(options)}")
    steps = steps or cfg["steps"]
    warmup = cfg["warmup"] if warmup is None else warmup
    os.makedirs(out_dir, exist_ok=True)

    threads = torch.get_num_threads()
    if device.type == "cpu" and smoke:
        # Tiny models gain nothing from intra-op threads, and on a shared 2-core machine they oversubscribe it
        # (timings swing 10x); one thread keeps the smoke run short and steady. Restored at the end.
        torch.set_num_threads(1)
    try:
        return _bench(device, smoke, cfg, out_dir, steps, warmup, progress, sweep, sweep_only, host_fraction,
                      count_syncs_opt, vram_layers, vram_tokens)
    finally:
        torch.set_num_threads(threads)


def _bench(device, smoke, cfg, out_dir, steps, warmup, progress, sweep, sweep_only, host_fraction,
           count_syncs_opt, vram_layers=None, vram_tokens=16384) -> list[dict]:
    import os

    from .bench import format_table, write_json
    from .models import LoraSettings, build_model
    from .timeline import plot_timelines

    bandwidth = measure_bandwidth(device)
    cfg["bandwidth"] = bandwidth
    cfg["cpu_threads"] = torch.get_num_threads() if device.type == "cpu" else None
    print(f"  host<->device copies: {bandwidth['h2d_gbps']} GB/s H2D, {bandwidth['d2h_gbps']} GB/s D2H "
          f"({bandwidth['method']})")
    results: list[dict] = []
    if not sweep_only:
        model = build_model(cfg["preset"], device=device, dtype=cfg["dtype"], quant=cfg["quant"],
                            lora=LoraSettings(rank=cfg["lora_rank"]) if cfg["lora_rank"] else None,
                            num_layers=cfg["num_layers"], attn_implementation=cfg["attn"])
        for i, tokens in enumerate(cfg["tokens"]):
            keys = cfg["plan"].get(tokens, cfg["full_plan"])
            count = bool(count_syncs_opt) if count_syncs_opt is not None else (i == 0)
            result, tl = _run_config(model, device, cfg=cfg, tokens=tokens, keys=keys, steps=steps, warmup=warmup,
                                     progress=progress, count_syncs=count, traced=cfg["traced"],
                                     host_fraction=host_fraction)
            tag = f"{cfg['preset']}-{tokens}"
            result["files"] = {"json": write_json(result, os.path.join(out_dir, f"offload-{tag}.json")),
                               "png": plot_offload_result(result, os.path.join(out_dir, f"offload-{tag}.png"))}
            if tl["timelines"]:
                write_json(tl, os.path.join(out_dir, f"offload-timeline-{tag}.json"))
                where = "CUDA events" if device.type == "cuda" else "CPU, synchronous: no overlap possible"
                plot_timelines(tl["timelines"], os.path.join(out_dir, f"offload-timeline-{tag}.png"),
                               suptitle=f"measured one step, {tokens} tokens ({where})")
            print(format_table(result))
            if result["derived"]:
                print("  derived:", json.dumps(result["derived"], default=str))
            results.append(result)
            # release pinned memory between token counts (our pool, and the peers' cached pinned blocks)
            disable_offloaded_checkpointing(model, release_pool=True)
            _empty_host_cache()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if vram_layers:
        results.append(_run_vram_check(device, cfg=cfg, out_dir=out_dir, layers=int(vram_layers),
                                       tokens=int(vram_tokens), progress=progress))
    if sweep or sweep_only:
        sres = _run_sweep(device, cfg=cfg, out_dir=out_dir, steps=cfg["sweep_steps"], warmup=1, progress=progress)
        sres["files"] = {"json": write_json(sres, os.path.join(out_dir, "offload-sweep.json")),
                         "png": plot_sweep(sres, os.path.join(out_dir, "offload-sweep.png"))}
        for p in sres["points"]:
            print("  sweep:", json.dumps(p))
        results.append(sres)
    return results


__all__ = [
    "PinnedPool", "OffloadManager", "OffloadStats", "offloaded_checkpoint", "enable_offloaded_checkpointing",
    "disable_offloaded_checkpointing", "is_offloaded", "offload_manager", "enable_standard_checkpointing",
    "VARIANT_KEYS", "make_variants", "measure_bandwidth", "host_memory_available", "estimate_host_bytes",
    "trace_step", "plot_offload_result", "plot_sweep", "plot_across_tokens", "load_results", "results_table",
    "default_results_dir", "vram_saved_estimate", "check_equivalence", "compare_grads", "format_equivalence",
    "check_transport", "check_no_leak", "bench_scenario",
]
