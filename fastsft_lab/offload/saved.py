"""Offloaded saved activations: a decoder layer that keeps every activation, in pinned host memory, double-buffered.

The memory plan's fifth choice (``offload_saved``, :mod:`.plan`): the layer runs as plain autograd -- nothing is
recomputed -- but what autograd saves for its backward goes to pinned host memory during the forward and comes back
ahead of the backward. Where the host link is fast enough (a copy no longer than the compute it hides behind: NVLink
C2C hosts, short sequences) it buys keep's speed at offload's memory; where it is not, the plan's cost model says so
and picks another choice.

How (``torch.autograd.graph.saved_tensors_hooks`` around one layer call, :meth:`SavedOffload.layer`):

* forward (pack): each saved tensor of the layer's own activations -- not its parameters or buffers, nothing under
  ``min_bytes`` -- is copied to pinned host memory on the copy stream, once per storage view (the normalised input
  that q, k, v and the LoRA adapters all save crosses the link once). At most two layers' stores are in flight (one
  without the double buffer): a layer waits for the stores of the layer two before it, so copies slower than the
  forward cannot pile up activations that are waiting to be freed;
* backward (unpack): the layer's first unpack brings all of its tensors back (unless prefetched) and, with the double
  buffer, issues the previous layer's reload at once, so that it runs under this layer's backward; each tensor is
  let go when its last saver has unpacked it (autograd frees it after its node's backward). At most two layers'
  activations are on the GPU at a time.

Stream ordering (CUDA; the streams and every operation through :class:`~.streams.StreamOps`, logged for
:func:`~.streams.check_stream_order` as the layer-input offload is):

* activation (written by compute) -> host (D2H on copy): ``copy.wait_stream(compute)`` before the copy; the
  activation is held (autograd may drop it right after packing) until ``compute.wait_event(stored)`` -- of the layer
  two back, before a layer runs (the bound on stores in flight), or of every layer, when the backward starts -- and
  only then let go, on the compute stream: its memory is reused in stream order, and the allocator's counters see
  the stores in flight (a block freed under ``record_stream`` would leave them while the copy still reads it, and
  the host running ahead of the GPU would pile such blocks up);
* host -> GPU tensor (H2D on copy, backward): the host copy was written by the same stream; the GPU tensor is
  allocated from the copy stream's pool (the stream that writes it first) and ``record_stream(compute)`` covers the
  backward's reads when autograd frees it;
* GPU tensor -> backward (compute): ``compute.wait_event(ready)`` before the layer's first unpack returns.

Exact: a saved tensor comes back with its values, dtype, shape and strides (a view into a larger storage comes back
contiguous, as ``torch.autograd.graph.save_on_cpu`` returns every tensor).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Container

import torch

from .._compat import tensor_version
from .streams import StreamOps

MIN_BYTES = 1 << 20          # saved tensors smaller than this stay on the device: the copy's fixed cost outweighs them


@dataclass
class SavedOffloadStats:
    layers: int = 0             # layer calls whose activations went to the host (forward)
    tensors: int = 0            # tensors copied to the host (each storage view once per layer call)
    bytes_stored: int = 0       # device->host bytes
    bytes_loaded: int = 0       # host->device bytes
    prefetches: int = 0         # layers reloaded ahead, under the next layer's backward
    prefetch_hits: int = 0      # layer backwards that found their activations already on their way
    kept: int = 0               # saved tensors left on the device (parameters, small tensors)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class _Saved:
    """One saved activation of one layer call: its host copy, and its device copy while the backward needs it."""

    __slots__ = ("group", "index", "host", "gpu", "dtype", "shape", "strides", "uses")

    def __init__(self, group: "_Group", index: int, host: torch.Tensor, t: torch.Tensor):
        self.group = group
        self.index = index
        self.host = host
        self.gpu: torch.Tensor | None = None
        self.dtype, self.shape, self.strides = t.dtype, tuple(t.shape), tuple(host.stride())
        self.uses = 0

    def key(self, what: str) -> tuple:
        return ("saved", what, self.group.seq, self.index)


class _Group:
    """The saved activations of one layer call, in forward order."""

    __slots__ = ("seq", "layer", "entries", "by_view", "sources", "state", "__weakref__")

    def __init__(self, seq: int, layer: int):
        self.seq = seq
        self.layer = layer
        self.entries: list[_Saved] = []
        self.by_view: dict[tuple, _Saved] = {}
        # the tensors copied, held until the layer call ends: a freed one's address could come back for another
        # tensor of the same shape within the call and be taken for the same view
        self.sources: list[torch.Tensor] = []
        self.state = "host"              # "host" -> "loading" (H2D issued) -> "ready" (compute waited for it)


class _Lazy:
    """A set of storage pointers made on the first membership test."""

    __slots__ = ("make", "got")

    def __init__(self, make: Callable[[], set[int]]):
        self.make: Callable[[], set[int]] = make
        self.got: set[int] | None = None

    def __contains__(self, ptr: int) -> bool:
        if self.got is None:
            self.got = self.make()
        return ptr in self.got


def _whole_storage(t: torch.Tensor) -> bool:
    """``t`` covers its storage exactly (dense, no offset): its strides can be allocated as they are."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


class SavedOffload:
    """The saved activations of offloaded layer calls, between their forward and their backward.

    Args:
        device: the compute device (CUDA: streams and events, pinned host memory; CPU: the same logic, synchronous).
        prefetch: reload the previous layer's activations when a layer's backward starts (the double buffer).
        min_bytes: saved tensors smaller than this stay on the device (the copy's fixed cost outweighs them).
        streams: the stream operations (default: a new :class:`StreamOps`; the memory plan shares its offload's).
    """

    def __init__(self, device: torch.device | str, *, prefetch: bool = True, min_bytes: int = MIN_BYTES,
                 streams: StreamOps | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.ops = streams if streams is not None else StreamOps(self.device)
        self.prefetch = prefetch
        self.min_bytes = min_bytes
        self.stats = SavedOffloadStats()
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._waiting: dict[int, weakref.ref] = {}        # seq -> group still on the host, for the prefetch
        # layer calls whose stores may still be running: (seq, [(activation key, activation)]), held until the
        # compute stream has waited for their copies
        self._storing: list[tuple[int, list]] = []

    @contextlib.contextmanager
    def layer(self, index: int, exclude: Any):
        """Offload what autograd saves inside the block (one layer call); ``exclude``: storage pointers to leave
        on the device (the layer's parameters and buffers), or a function giving them, called at the first saved
        tensor (where they are known only inside the layer's forward: FSDP2 gathers the weights there)."""
        if callable(exclude):
            exclude = _Lazy(exclude)
        group = _Group(next(self._seq), index)
        with self._lock:
            self._waiting[group.seq] = weakref.ref(group, functools.partial(self._forget, group.seq))
        self.stats.layers += 1
        self._throttle()
        try:
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, group, exclude),
                                                          self._unpack):
                yield group
        finally:
            changed = [t for t, (*_, version) in zip(group.sources, group.by_view) if tensor_version(t) != version]
            held = [(e.key("activation"), t) for e, t in zip(group.entries, group.sources)]
            group.sources = []
            group.by_view.clear()
            self.ops.record(("saved-stored", group.seq), "copy")
            self._storing.append((group.seq, held))
        if changed:
            raise RuntimeError(f"offload_saved: layer {index} changed a saved activation in place after autograd "
                               "saved it (plain autograd refuses that at backward); plan this layer as 'keep' or "
                               "'checkpoint'")

    def _throttle(self) -> None:
        """Before a layer runs: at most two layers' stores in flight (one without the double buffer). A stored
        activation's memory is reused only once its copy is done, so copies slower than the forward would otherwise
        pile up layer after layer; the wait is the exposed store time the plan's cost model charges."""
        self._release_stores(keep=(2 if self.prefetch else 1) - 1)

    def _release_stores(self, keep: int) -> None:
        """Let go of the activations of all but the last ``keep`` layer calls' stores, once the compute stream has
        waited for their copies (their memory then goes back to the compute stream's pool, in stream order)."""
        while len(self._storing) > keep:
            seq, held = self._storing.pop(0)
            self.ops.wait_event("compute", ("saved-stored", seq))
            self.ops.discard(("saved-stored", seq))
            for key, _ in held:
                self.ops.free("compute", key)
            held.clear()

    def _forget(self, seq: int, _ref=None) -> None:
        with self._lock:
            self._waiting.pop(seq, None)

    # -- forward ---------------------------------------------------------------------------------------------------
    def _pack(self, group: _Group, exclude: Container[int], t: torch.Tensor):
        if (t.device != self.device or t.layout != torch.strided or t.numel() * t.element_size() < self.min_bytes
                or t.untyped_storage().data_ptr() in exclude):
            self.stats.kept += 1
            # detached (autograd restores the grad_fn on unpack): a saved output returned as itself holds its own
            # grad_fn, a cycle through C++ that no garbage collection frees when the forward is not followed by a
            # backward (a loss computed under grad and dropped)
            return t.detach()
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, tensor_version(t))
        entry = group.by_view.get(view)
        if entry is None:
            entry = self._store(group, t)
            group.by_view[view] = entry
            group.sources.append(t.detach())     # its storage (and version counter), not its graph
        entry.uses += 1
        return entry

    def _store(self, group: _Group, t: torch.Tensor) -> _Saved:
        ops = self.ops
        if _whole_storage(t):
            host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, pin_memory=self.cuda)
        else:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.cuda)
        entry = _Saved(group, len(group.entries), host, t)
        group.entries.append(entry)
        src = entry.key("activation")
        ops.access("compute", src, "w")              # its producer ran on the compute stream
        ops.wait_stream("copy", "compute")
        ops.copy("copy", host, t, src, entry.key("host"), "d2h_saved", group.layer, group.seq)
        self.stats.tensors += 1
        self.stats.bytes_stored += host.numel() * host.element_size()
        return entry

    # -- backward --------------------------------------------------------------------------------------------------
    def _load(self, group: _Group, entries=None) -> None:
        """Issue the host->device copies of ``group`` (or of ``entries`` of it) and record their ready event."""
        ops = self.ops
        for e in entries if entries is not None else group.entries:
            if e.gpu is not None or e.uses <= 0 and entries is None:
                continue
            with ops.on_stream("copy"):
                e.gpu = torch.empty_strided(e.shape, e.strides, dtype=e.dtype, device=self.device)
            ops.copy("copy", e.gpu, e.host, e.key("host"), e.key("device"), "h2d_saved", group.layer, group.seq)
            ops.record_stream(e.gpu, e.key("device"), "compute")
            self.stats.bytes_loaded += e.host.numel() * e.host.element_size()
        ops.record(("saved-ready", group.seq), "copy")
        if group.state == "host":
            group.state = "loading"
        self._forget(group.seq)

    def _previous(self, seq: int) -> _Group | None:
        """The layer call whose backward comes next: the latest one before ``seq`` still on the host."""
        with self._lock:
            candidates = [(s, ref) for s, ref in self._waiting.items() if s < seq]
        for _, ref in sorted(candidates, key=lambda c: c[0], reverse=True):
            g = ref()
            if g is not None and g.state == "host":
                return g
        return None

    def _unpack(self, packed) -> torch.Tensor | None:
        if isinstance(packed, torch.Tensor):
            return packed
        entry: _Saved = packed
        group, ops = entry.group, self.ops
        if self._storing:                   # the backward has begun: every store is let go
            self._release_stores(keep=0)
        if group.state != "ready":
            if group.state == "host":
                self._load(group)
            else:
                self.stats.prefetch_hits += 1
            ops.wait_event("compute", ("saved-ready", group.seq))
            ops.discard(("saved-ready", group.seq))
            group.state = "ready"
            if self.prefetch:
                prev = self._previous(group.seq)
                if prev is not None:
                    self._load(prev)
                    self.stats.prefetches += 1
        if entry.gpu is None:               # a second backward through the graph (retain_graph=True)
            self._load(group, [entry])
            ops.wait_event("compute", ("saved-ready", group.seq))
            ops.discard(("saved-ready", group.seq))
        x = entry.gpu
        ops.access("compute", entry.key("device"), "r")     # the node's backward
        entry.uses -= 1
        if entry.uses <= 0:                 # the last saver has it: autograd frees it after its node's backward
            entry.gpu = None
            ops.free("copy", entry.key("device"))
        return x


__all__ = ["MIN_BYTES", "SavedOffload", "SavedOffloadStats"]
