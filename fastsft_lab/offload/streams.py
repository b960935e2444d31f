"""The stream operations of offloaded checkpointing: issued on CUDA, logged for the stream-order model.

Two streams: ``"compute"`` (the current stream, where autograd runs the layers) and ``"copy"`` (a side stream for
the host<->device copies). Every cross-stream operation the manager issues goes through :class:`StreamOps`:
``wait_stream``, ``record``/``wait_event`` (events by key: ``("ready", slot)``, ``("free", slot)``,
``("pool", idx)``), ``copy``, ``record_stream``, ``allocate``, and the log-only ``access``/``free`` that say which
buffer a stream reads or writes and when its memory goes back to the allocator. On a CPU nothing is issued (the
copies are synchronous), but the very same sequence is logged, so :func:`check_stream_order` can check on a CPU, in
a model of CUDA stream semantics, that every conflicting pair of accesses is ordered.

This is also the seam where benchmarks and tests change behaviour without touching the manager: a subclass may
issue the forward copies on the compute stream (``d2h_stream``), allocate staging buffers elsewhere
(``staging_alloc_stream``), leave an operation out, fail an allocation, or look at what is saved and staged
(``saved`` / ``staged``, used by :func:`fastsft_lab.evidence.check_transport`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Sequence

import torch


class Trace:
    """Start/end marks of copies and layer computes on their streams (CUDA events, or perf_counter on a CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._records: list[tuple] = []
        self._t0: Any
        if self.cuda:
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record(torch.cuda.current_stream(device))
        else:
            self._t0 = time.perf_counter()

    def mark(self, stream=None):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
            return ev
        return time.perf_counter()

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


class StreamOps:
    """Issue (on CUDA) and log the manager's stream operations. See the module docstring.

    Attributes:
        d2h_stream: the stream of the forward device->host copies (``"copy"``: they overlap compute).
        staging_alloc_stream: the stream whose allocator pool the staging buffers come from. ``"copy"``, the stream
            that writes them first, so that the caching allocator's per-stream ordering covers the memory's previous
            users (allocated on the compute stream, the first reload could overwrite memory still used by queued
            compute kernels: the loss and LM-head backward).
        log: set to a list to record every operation (tests); None records nothing.
        trace: a :class:`Trace` while :meth:`OffloadManager.tracing` is active.
    """

    d2h_stream = "copy"
    staging_alloc_stream = "copy"

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device=device) if self.cuda else None
        self.log: list | None = None
        self.trace: Trace | None = None
        self._events: dict[tuple, Any] = {}

    def _log(self, *op) -> None:
        if self.log is not None:
            self.log.append(op)

    def stream(self, name: str):
        if name == "copy":
            return self.copy_stream
        stream = torch.cuda.current_stream(self.device)
        if stream == self.copy_stream:   # a "compute" lookup inside a copy-stream context would be a silent bug
            raise RuntimeError("internal: compute stream looked up while the copy stream is current")
        return stream

    def on_stream(self, name: str):
        return torch.cuda.stream(self.stream(name)) if self.cuda else contextlib.nullcontext()

    def wait_stream(self, waiter: str, waitee: str) -> None:
        self._log("wait_stream", waiter, waitee)
        if self.cuda:
            self.stream(waiter).wait_stream(self.stream(waitee))

    def record(self, key: tuple, stream: str) -> None:
        self._log("record", key, stream)
        if self.cuda:
            ev = self._events.get(key)
            if ev is None:
                ev = self._events[key] = torch.cuda.Event()
            ev.record(self.stream(stream))

    def wait_event(self, stream: str, key: tuple) -> None:
        self._log("wait_event", stream, key)
        if self.cuda and key in self._events:   # waiting on an event never recorded is a no-op, as in CUDA
            self.stream(stream).wait_event(self._events[key])

    def discard(self, key: tuple) -> None:
        """Forget event ``key`` once nothing will wait on it again (keys that name one layer call, not a slot)."""
        self._events.pop(key, None)

    def access(self, stream: str, buf: tuple, mode: str) -> None:
        """Log only: kernels issued on ``stream`` up to here read (``r``) or write (``w``) ``buf``."""
        self._log("access", stream, buf, mode)

    def record_stream(self, tensor: torch.Tensor, buf: tuple, stream: str) -> None:
        self._log("record_stream", buf, stream)
        if self.cuda:
            tensor.record_stream(self.stream(stream))

    def free(self, stream: str, buf: tuple) -> None:
        """Log only: ``buf``'s memory goes back to the caching allocator, for reuse by ``stream``."""
        self._log("free", stream, buf)

    def allocate(self, nbytes: int, stream: str) -> torch.Tensor:
        """A device buffer of ``nbytes`` from ``stream``'s allocator pool (tests substitute a failing one)."""
        with self.on_stream(stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy(self, stream: str, dst: torch.Tensor, src: torch.Tensor, reads: tuple, writes: tuple, kind: str,
             layer: int, seq: int) -> None:
        """``dst.copy_(src)`` on ``stream`` (non-blocking on CUDA), marked in the trace when one is active."""
        self.access(stream, reads, "r")
        self.access(stream, writes, "w")
        trace = self.trace
        s = self.stream(stream) if self.cuda else None
        t0 = trace.mark(s) if trace else None
        if self.cuda:
            with torch.cuda.stream(s):
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)
        if trace:
            trace.add(kind, stream, layer, seq, t0, trace.mark(s))

    # -- observation points (no-ops here; evidence.check_transport's subclass compares what passes through)
    def saved(self, entry, src: torch.Tensor) -> None:
        """``src`` (on the compute stream) is the input being offloaded for ``entry``."""

    def staged(self, entry, x: torch.Tensor, phase: str) -> None:
        """``x`` is ``entry``'s reloaded input, as the recompute reads it (``"reload"``) or after the layer's
        backward was issued (``"after_backward"``)."""


# --- Stream-order model: is every cross-stream hazard ordered? --------------------------------------------------
def check_stream_order(ops: Sequence[tuple]) -> list[str]:
    """Check a log of stream operations (:attr:`StreamOps.log`) for races.

    A happens-before model of CUDA streams with vector clocks. Operations, in the order the host issued them:

    * ``("wait_stream", a, b)``: stream ``a`` waits for everything issued on ``b`` so far;
    * ``("record", event, s)`` / ``("wait_event", s, event)``: a wait orders ``s`` after the event's most recent
      record *at the time of the wait* (a later re-record does not matter; an event never recorded is a no-op);
    * ``("access", s, buffer, "r" | "w")``: kernels issued on ``s`` read or write ``buffer``;
    * ``("record_stream", buffer, s)``: the caching allocator will not reuse ``buffer``'s memory before the work
      issued on ``s`` up to its free has completed;
    * ``("free", s, buffer)``: ``buffer``'s memory goes back to the allocator's pool of stream ``s``; it may be
      handed to the next allocation on ``s`` at once, so any access on another stream that is neither ordered
      before the free nor covered by ``record_stream`` is a hazard; any later access is a use after free.

    A problem is reported for every pair of accesses to one buffer on different streams, at least one a write,
    where the earlier-issued one does not happen before the later one, and for every unsafe free.

    Returns:
        Human-readable problems (empty: every hazard in the log is ordered).
    """
    clocks: dict[str, dict[str, int]] = {}
    events: dict = {}
    history: dict = {}
    protected: dict = {}
    freed: dict = {}
    problems: list[str] = []

    def clock(s: str) -> dict[str, int]:
        return clocks.setdefault(s, {})

    def tick(s: str) -> int:
        c = clock(s)
        c[s] = c.get(s, 0) + 1
        return c[s]

    def join(s: str, other: dict[str, int]) -> None:
        c = clock(s)
        for k, v in other.items():
            if v > c.get(k, 0):
                c[k] = v

    for i, op in enumerate(ops):
        kind = op[0]
        if kind == "wait_stream":
            _, a, b = op
            join(a, dict(clock(b)))
            tick(a)
        elif kind == "record":
            _, ev, s = op
            tick(s)
            events[ev] = dict(clock(s))
        elif kind == "wait_event":
            _, s, ev = op
            if ev in events:
                join(s, events[ev])
            tick(s)
        elif kind == "record_stream":
            _, buf, s = op
            protected.setdefault(buf, set()).add(s)
        elif kind == "access":
            _, s, buf, mode = op
            n = tick(s)
            if buf in freed:
                problems.append(f"op {i}: {s} {'writes' if mode == 'w' else 'reads'} {buf} after it was freed "
                                f"(op {freed[buf]})")
            for ps, pn, pmode, pi in history.get(buf, ()):
                if ps != s and "w" in (mode, pmode) and clock(s).get(ps, 0) < pn:
                    problems.append(f"op {i}: {s} {'writes' if mode == 'w' else 'reads'} {buf} while op {pi} "
                                    f"({ps} {'write' if pmode == 'w' else 'read'}) may not have run yet")
            history.setdefault(buf, []).append((s, n, mode, i))
        elif kind == "free":
            _, s, buf = op
            tick(s)
            for ps, pn, pmode, pi in history.get(buf, ()):
                if ps != s and ps not in protected.get(buf, ()) and clock(s).get(ps, 0) < pn:
                    problems.append(f"op {i}: {buf} freed for reuse on {s} while op {pi} ({ps} "
                                    f"{'write' if pmode == 'w' else 'read'}) may not have run yet and no "
                                    f"record_stream({ps}) protects it")
            freed[buf] = i
        else:
            raise ValueError(f"unknown stream operation {op!r}")
    return problems


__all__ = ["StreamOps", "Trace", "check_stream_order"]
