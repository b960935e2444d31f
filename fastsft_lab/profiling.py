"""Measuring what the optimizations change: host syncs, phase times, memory and profiler traces.

``SyncCounter`` counts operations that force a device->host synchronisation: the CPU stops issuing kernels until
the GPU has caught up, so the launch queue drains and the GPU idles while Python runs. It works on the CPU too
(it counts the operations that *would* sync on a GPU), so CPU tests can assert "zero syncs here":

* through a ``TorchDispatchMode``: ``.item()``/``bool()``/``int()`` (``_local_scalar_dense``), ``nonzero``,
  ``torch.where(cond)``, boolean-mask indexing, ``masked_select``, ``unique``, ``bincount`` (CUDA reads the
  maximum back), ``repeat_interleave`` without ``output_size``, ``equal``, device->host copies;
* through Python-level hooks: ``.tolist()``, ``.numpy()``, ``.cpu()`` and printing a tensor (one sync each,
  however many elements they read).

Only tensors on the counter's compute device count (CUDA in a GPU run, the CPU in a CPU run), so host-side
bookkeeping done with Python integers is free, as it is on a GPU. On CUDA, ``cross_check=True`` also turns on
``torch.cuda.set_sync_debug_mode("warn")`` and records how many syncs CUDA itself reported.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ._compat import (ATEN_INDEX_PUT_IMPL, ATEN_LOCAL_SCALAR_DENSE, ATEN_TO_COPY, ATEN_UNIQUE, ATEN_UNSAFE_INDEX,
                      TorchDispatchMode)
from ._util import percentiles  # the one implementation, torch-free (the Unsloth peer imports it too)

aten = torch.ops.aten

_ACTIVE: list["SyncCounter"] = []
_PATCHED: dict[str, Callable] = {}
_SUPPRESS = [0]  # >0 while inside a counted Python-level call (printing, tolist)

# aten overload packets that always sync (their output size or value depends on device data)
_ALWAYS_SYNC = {
    ATEN_LOCAL_SCALAR_DENSE: "item",
    aten.nonzero: "nonzero",
    aten.masked_select: "masked_select",
    **{op: "unique" for op in ATEN_UNIQUE},
    aten.unique_dim: "unique",
    aten.unique_consecutive: "unique",
    aten.bincount: "bincount",
    aten.equal: "equal",
    aten.is_nonzero: "item",
    aten.allclose: "item",
}
for _name in ("nonzero_numpy", "argwhere"):
    if hasattr(aten, _name):
        _ALWAYS_SYNC[getattr(aten, _name)] = "nonzero"


def _is_bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class SyncCountingMode(TorchDispatchMode):
    """The dispatch mode behind :class:`SyncCounter` (flex attention steps outside it: see the flex backend)."""

    def __init__(self, counter: "SyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = self._classify(func, args, kwargs)
        if kind is not None:
            self.counter._record(kind)
        return func(*args, **kwargs)

    def _classify(self, func, args, kwargs) -> str | None:
        packet = func.overloadpacket
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if packet in _ALWAYS_SYNC:
            if first is not None and self.counter._on_device(first):
                # item() on a tensor the dispatcher itself made from a host scalar is not a sync
                return _ALWAYS_SYNC[packet]
            return None
        if packet in (aten.index, ATEN_UNSAFE_INDEX) and first is not None and self.counter._on_device(first):
            return "bool_index" if _is_bool_index(args[1] if len(args) > 1 else kwargs.get("indices")) else None
        if packet in (aten.index_put, aten.index_put_, ATEN_INDEX_PUT_IMPL) and first is not None:
            if self.counter._on_device(first) and _is_bool_index(args[1] if len(args) > 1 else None):
                return "bool_index"
            return None
        if packet is aten.repeat_interleave and first is not None and self.counter._on_device(first):
            if func is aten.repeat_interleave.Tensor or (len(args) > 1 and isinstance(args[1], torch.Tensor)):
                if kwargs.get("output_size") is None:
                    return "repeat_interleave"
            return None
        if packet is ATEN_TO_COPY and first is not None:
            dst = kwargs.get("device")
            if dst is not None and torch.device(dst).type == "cpu" and first.device.type != "cpu" \
                    and self.counter._on_device(first):
                return "device_to_host"
            return None
        if packet is aten.copy_ and len(args) > 1 and isinstance(args[1], torch.Tensor):
            dst, src = args[0], args[1]
            if dst.device.type == "cpu" and src.device.type != "cpu" and self.counter._on_device(src):
                non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
                if non_blocking and dst.is_pinned():
                    return None  # an async copy into pinned memory (offloading): the host does not wait
                return "device_to_host"
        return None


def _wrap_python(name: str, kind: str):
    original = getattr(torch.Tensor, name)

    def wrapper(self, *args, **kwargs):
        if _ACTIVE and not _SUPPRESS[0] and isinstance(self, torch.Tensor):
            for counter in _ACTIVE:
                if counter._on_device(self):
                    counter._record(kind)
            _SUPPRESS[0] += 1
            try:
                return original(self, *args, **kwargs)
            finally:
                _SUPPRESS[0] -= 1
        return original(self, *args, **kwargs)

    wrapper.__name__ = name
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return original, wrapper


_PY_HOOKS = {"tolist": "tolist", "numpy": "numpy", "cpu": "device_to_host", "__repr__": "print",
             "__str__": "print", "__format__": "print"}


def _install_python_hooks() -> None:
    for name, kind in _PY_HOOKS.items():
        original, wrapper = _wrap_python(name, kind)
        _PATCHED[name] = original
        setattr(torch.Tensor, name, wrapper)


def _remove_python_hooks() -> None:
    for name, original in _PATCHED.items():
        setattr(torch.Tensor, name, original)
    _PATCHED.clear()


@dataclass
class SyncReport:
    total: int
    by_kind: dict
    by_module: dict
    cuda_reported: int | None = None


def cuda_sync_warnings(records: list) -> list:
    """The warnings in ``records`` that are syncs CUDA's sync debug mode reported.

    A sync reads "called a synchronizing CUDA operation"; the one-time notice that the debug mode
    is a prototype also says "Synchronization" and is not a sync.
    """
    return [w for w in records if "called a synchronizing CUDA operation" in str(w.message)]


class SyncCounter:
    """Count host syncs inside a ``with`` block, optionally per module.

    Args:
        device: the compute device whose tensors count (default: CUDA if available, else CPU).
        modules: optional ``{name: module}`` to attribute counts to (innermost active module wins);
            see :meth:`for_decoder_layers`.
        cross_check: on CUDA, also count the syncs ``torch.cuda.set_sync_debug_mode('warn')`` reports.
        locate: also count each sync by ``(module, site, kind)`` in :attr:`sites`, ``site`` being the innermost
            Python frame outside torch and this module (``"transformers/models/.../modeling_x.py:123"``): the line
            that asked the device for an answer.

    Example::

        with SyncCounter.for_decoder_layers(model) as syncs:
            model(**batch)
        assert syncs.in_modules == 0
    """

    def __init__(self, device: torch.device | str | None = None, modules: dict[str, nn.Module] | None = None,
                 cross_check: bool = False, locate: bool = False):
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.modules = modules or {}
        self.cross_check = cross_check and self.device.type == "cuda"
        self.by_kind: Counter = Counter()
        self.by_module: Counter = Counter()
        self.cuda_reported: int | None = None
        self.cuda_messages: list[str] = []      # where CUDA saw each sync (file:line of the Python frame)
        self.locate = locate
        self.sites: Counter = Counter()          # with locate: {(module, "file:line", kind): count}
        self._stack: list[str] = []
        self._hooks: list = []
        self._mode: SyncCountingMode | None = None
        self._warn_ctx: warnings.catch_warnings | None = None
        self._warn_log: list | None = None
        self._prev_debug_mode: int | None = None

    # -- construction helpers
    @classmethod
    def for_decoder_layers(cls, model: nn.Module, **kwargs) -> "SyncCounter":
        from .structure import decoder_layers

        layers = decoder_layers(model)
        return cls(modules={f"layer{i}": layer for i, layer in enumerate(layers)}, **kwargs)

    # -- results
    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    @property
    def in_modules(self) -> int:
        return sum(v for k, v in self.by_module.items() if k != "<outside>")

    def per_module(self) -> dict[str, int]:
        return {name: self.by_module.get(name, 0) for name in self.modules}

    def report(self) -> SyncReport:
        return SyncReport(self.total, dict(self.by_kind), dict(self.by_module), self.cuda_reported)

    def reset(self) -> None:
        self.by_kind.clear()
        self.by_module.clear()
        self.sites.clear()

    # -- internals
    def _on_device(self, t: torch.Tensor) -> bool:
        dev = t.device
        if dev.type == "meta":
            return False
        return dev.type == self.device.type

    def _record(self, kind: str) -> None:
        if _SUPPRESS[0]:
            return
        self.by_kind[kind] += 1
        module = self._stack[-1] if self._stack else "<outside>"
        self.by_module[module] += 1
        if self.locate:
            self.sites[(module, caller_site(), kind)] += 1

    def _push(self, name):
        def hook(module, args, kwargs=None):
            self._stack.append(name)
        return hook

    def _pop(self, name):
        def hook(module, args, *rest):
            if self._stack and self._stack[-1] == name:
                self._stack.pop()
            elif name in self._stack:
                self._stack.remove(name)
        return hook

    def __enter__(self) -> "SyncCounter":
        for name, module in self.modules.items():
            self._hooks.append(module.register_forward_pre_hook(self._push(name)))
            self._hooks.append(module.register_forward_hook(self._pop(name), always_call=True))
        if not _ACTIVE:
            _install_python_hooks()
        _ACTIVE.append(self)
        self._mode = SyncCountingMode(self)
        self._mode.__enter__()
        if self.cross_check:
            ctx = warnings.catch_warnings(record=True)
            self._warn_log = ctx.__enter__()
            self._warn_ctx = ctx
            warnings.simplefilter("always")
            self._prev_debug_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        if self.cross_check:
            torch.cuda.set_sync_debug_mode(self._prev_debug_mode)
            if self._warn_ctx is not None:
                self._warn_ctx.__exit__(*exc)
            synced = cuda_sync_warnings(self._warn_log)
            self.cuda_reported = len(synced)
            self.cuda_messages = [f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:160]}" for w in synced]
        self._mode.__exit__(*exc)
        _ACTIVE.remove(self)
        if not _ACTIVE:
            _remove_python_hooks()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._stack.clear()


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_STDLIB_DIR = os.path.dirname(contextlib.__file__) + os.sep


def short_path(filename: str) -> str:
    """``filename`` from its package on (``transformers/models/...``, ``fastsft_lab/...``) where it is installed or
    in a working tree; else as it is."""
    for marker in ("site-packages" + os.sep, "dist-packages" + os.sep):
        if marker in filename:
            return filename.split(marker, 1)[1]
    cwd = os.getcwd() + os.sep
    return filename[len(cwd):] if filename.startswith(cwd) else filename


def caller_site() -> str:
    """``"file:line"`` of the innermost Python frame outside torch, this module and the standard library, marked
    ``(in backward)`` when autograd's engine runs it (a backward op of C++ has no frame of its own: the line is then
    the one that called ``backward``)."""
    from ._compat import in_backward

    where = " (in backward)" if in_backward() else ""
    frame: Any = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        stdlib = name.startswith(_STDLIB_DIR) and "-packages" + os.sep not in name    # a package can live below it
        if not (stdlib or name.startswith((_TORCH_DIR, "<")) or name == __file__):
            return f"{short_path(name)}:{frame.f_lineno}{where}"
        frame = frame.f_back
    return "<no Python frame>" + where


def count_syncs(fn: Callable[[], object], device=None) -> int:
    """Host syncs that ``fn()`` performs."""
    with SyncCounter(device=device) as c:
        fn()
    return c.total


# --- Phase timers -----------------------------------------------------------------------------------------------
class PhaseTimer:
    """Time named phases of a step: CUDA events on a GPU (no sync inside the step), perf_counter on a CPU.

    Example::

        timer = PhaseTimer(device)
        with timer.phase("forward"):
            loss = model(**batch).loss
        with timer.phase("backward"):
            loss.backward()
        times_ms = timer.collect()   # one sync, at the end
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else (
            torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        self._events: list[tuple[str, Any, Any]] = []  # CUDA events, or perf_counter floats on a CPU

    @contextlib.contextmanager
    def phase(self, name: str):
        if self.device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self._events.append((name, start, end))
        else:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._events.append((name, t0, time.perf_counter()))

    def collect(self) -> dict[str, float]:
        """Milliseconds per phase (summed when a phase repeats); clears the timer."""
        out: dict[str, float] = defaultdict(float)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            for name, s, e in self._events:
                out[name] += s.elapsed_time(e)
        else:
            for name, s, e in self._events:
                out[name] += (e - s) * 1e3
        self._events.clear()
        return dict(out)


def reset_peak_memory(device: torch.device | str | None = None) -> None:
    device = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device | str | None = None) -> int | None:
    """Peak allocated bytes on a CUDA device since the last reset (None on CPU)."""
    device = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        return int(torch.cuda.max_memory_allocated(device))
    return None


def current_memory(device: torch.device | str | None = None) -> int | None:
    """Bytes the CUDA caching allocator holds allocated now (None on CPU); a host-side counter, no sync."""
    device = torch.device(device) if device is not None else None
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        return int(torch.cuda.memory_allocated(device))
    return None


def time_ms(fn: Callable[[], object], device: torch.device | str, warmup: int, reps: int) -> dict:
    """median/p20/p80 milliseconds of ``fn`` over ``reps`` calls after ``warmup`` (a :class:`PhaseTimer` per call:
    CUDA events on a GPU, one sync at the end; perf_counter on a CPU)."""
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    timer = PhaseTimer(device)
    for i in range(reps):
        with timer.phase(str(i)):
            fn()
    return percentiles(timer.collect().values())


SYNC_OP_NAMES = ("aten::nonzero", "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal",
                  "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::bincount")


@contextlib.contextmanager
def _native_stderr_silenced():
    """File descriptor 2 sent to /dev/null (what C++ writes there: kineto's start/stop notices in some torch
    builds); Python's own stderr keeps working through its buffer."""
    try:
        fd = os.dup(2)
    except OSError:          # no descriptor 2 (an embedded interpreter): nothing to silence
        yield
        return
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)
        os.close(devnull)


@contextlib.contextmanager
def quiet_profiler(**kwargs):
    """``torch.profiler.profile(**kwargs)`` whose start and stop print nothing (the CPU build's kineto writes a
    ``profiler_start`` / ``profiler_stop`` notice to the process's stderr, into every notebook output, and torch's
    profiler warns on stop that it keeps one cycle's events); what the profiled code prints is untouched."""
    import warnings

    from torch.profiler import profile as torch_profile

    @contextlib.contextmanager
    def quiet():
        with _native_stderr_silenced(), warnings.catch_warnings():
            # torch's notice that a profile without a schedule keeps one cycle's events: one cycle is all we take
            warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
            yield

    prof = torch_profile(**kwargs)
    with quiet():
        prof.__enter__()
    try:
        yield prof
    finally:
        with quiet():
            prof.__exit__(None, None, None)


def host_device_timeline(fn: Callable[[], object], device: torch.device | str, *,
                         wait_labels: Sequence[str] = ()) -> dict:
    """Profile one call of ``fn`` and return its host ops and (on CUDA) GPU kernels as ms intervals.

    Returns ``{"host": [(name, start_ms, end_ms, syncs)], "gpu": [(name, start_ms, end_ms)], "host_syncs": n}``;
    ``syncs`` marks host ops that wait for the device (a ``nonzero``, ``item``, ``.tolist()`` copy or stream sync
    anywhere below them, or a ``record_function`` range named in ``wait_labels``). On a CPU there is no GPU lane: the marks show where a GPU run would stall.
    """
    from torch.profiler import ProfilerActivity

    device = torch.device(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with quiet_profiler(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.events()

    def waits(evt) -> bool:
        if evt.name in SYNC_OP_NAMES or evt.name in wait_labels:
            return True
        if evt.name.startswith("cudaMemcpy") and "Async" not in evt.name:
            return True
        if device.type == "cpu" and evt.name == "aten::_grouped_mm":
            return False  # the CPU kernel reads its offsets from host memory; the CUDA kernel reads them on device
        if device.type == "cpu" and evt.name == "aten::_assert_async":
            return False  # the CPU kernel reads the flag on the host; the CUDA kernel asserts on the device
        return any(waits(c) for c in evt.cpu_children)

    host = [e for e in events if e.cpu_parent is None and e.device_type == torch.autograd.DeviceType.CPU
            and not e.name.startswith(("ProfilerStep", "cudaDeviceSynchronize"))]
    gpu = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    if not host:
        return {"host": [], "gpu": [], "host_syncs": 0}
    t0 = min([e.time_range.start for e in host] + [e.time_range.start for e in gpu])
    to_ms = lambda t: (t - t0) / 1e3  # noqa: E731
    host_rows = [(e.name, to_ms(e.time_range.start), to_ms(e.time_range.end), waits(e)) for e in host]
    gpu_rows = [(e.name, to_ms(e.time_range.start), to_ms(e.time_range.end)) for e in gpu]
    return {"host": host_rows, "gpu": gpu_rows, "host_syncs": sum(1 for r in host_rows if r[3])}


# --- torch.profiler wrapper ---------------------------------------------------------------------------------------
@dataclass
class ProfileResult:
    table: str
    trace_path: str | None
    top_ops: list = field(default_factory=list)           # [{"name", "calls", "self_ms"}]: GPU kernels (CUDA), else
                                                          # host ops; each counted once (no op and its kernel both)
    ops_per_step: list = field(default_factory=list)      # [{"name", "ms"}]: aten ops' self device (CPU: host) ms
    kernels_per_step: list = field(default_factory=list)  # [{"name", "ms"}]: GPU kernels and copies (CUDA only)
    device_busy_ms: float | None = None                   # the kernels' ms per step (CUDA only)
    queue_full_ms: float | None = None                    # per step, the CPU blocked on a full launch queue (CUDA)


# CUPTI's "Command Buffer Full": the CPU could not queue a launch because the GPU's command buffer was full, i.e. the
# host ran ahead of the GPU (GPU-bound there). A wait of the host, not a kernel: kept out of the kernels' time.
QUEUE_FULL = "Command Buffer Full"


def _ranked(d: dict[str, float], top: int) -> list[dict]:
    return [{"name": k[:200], "ms": round(v, 4)} for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]


def summarize_events(averages, *, cuda: bool, steps: int = 1, top: int = 15):
    """``torch.profiler``'s key averages -> ``(top_ops, ops ms per step, kernels ms per step, queue-full ms per
    step)``. On CUDA an aten op's self device time is the time of the kernels it launched, so the top entries are
    the kernels alone (each microsecond counted once); the launch-queue wait (:data:`QUEUE_FULL`) is neither.
    Where no GPU kernel ran at all (a CPU model profiled on a machine with a GPU), the host ops are the work: as on a
    CPU."""
    def is_kernel(e) -> bool:   # a device event not named aten::
        return cuda and "CUDA" in str(getattr(e, "device_type", "")) and not e.key.startswith("aten::")

    if cuda and not any(is_kernel(e) and getattr(e, "self_device_time_total", 0) for e in averages
                        if e.key != QUEUE_FULL):
        cuda = False
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"

    counted = [e for e in averages if e.key != QUEUE_FULL and (is_kernel(e) if cuda else True)]
    rows = sorted(counted, key=lambda e: getattr(e, attr, 0), reverse=True)[:top]
    top_ops = [{"name": e.key, "calls": e.count, "self_ms": round(getattr(e, attr, 0) / 1e3, 3)} for e in rows]
    ops: dict[str, float] = {}
    kernels: dict[str, float] = {}
    queue_full = 0.0
    for e in averages:
        ms = float(getattr(e, attr, 0) or 0) / 1e3 / steps
        if e.key == QUEUE_FULL:
            queue_full += max(ms, float(getattr(e, "cpu_time_total", 0) or 0) / 1e3 / steps)
            continue
        if ms <= 0:
            continue
        target = kernels if is_kernel(e) else ops
        target[e.key] = target.get(e.key, 0.0) + ms
    return top_ops, ops, kernels, queue_full


def profile(fn: Callable[[], object], *, steps: int = 1, trace_path: str | None = None, top: int = 15,
            sort_by: str | None = None, record_shapes: bool = False) -> ProfileResult:
    """Run ``fn`` ``steps`` times under ``torch.profiler``; export a Chrome trace and return the top entries
    (totals over the steps: on CUDA the GPU kernels by device time, on a CPU the host ops by self time -- never an
    aten op and the kernels it launched both, which would count the same time twice), and per step the ops' and
    the kernels' own time, the GPU's busy time and the time the host waited on a full launch queue."""
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU]
    cuda = torch.cuda.is_available()
    if cuda:
        activities.append(ProfilerActivity.CUDA)
    with quiet_profiler(activities=activities, record_shapes=record_shapes) as prof:
        for _ in range(steps):
            fn()
        if cuda:
            torch.cuda.synchronize()
    if trace_path:
        prof.export_chrome_trace(trace_path)
    key = sort_by or ("self_cuda_time_total" if cuda else "self_cpu_time_total")
    averages = prof.key_averages()
    table = averages.table(sort_by=key, row_limit=top)
    top_ops, ops, kernels, queue_full = summarize_events(averages, cuda=cuda, steps=steps, top=top)
    return ProfileResult(table=table, trace_path=trace_path, top_ops=top_ops, ops_per_step=_ranked(ops, top),
                         kernels_per_step=_ranked(kernels, top),
                         device_busy_ms=round(sum(kernels.values()), 4) if cuda and kernels else None,
                         queue_full_ms=round(queue_full, 4) if cuda and kernels else None)


__all__ = ["SyncCounter", "SyncCountingMode", "caller_site", "short_path", "SyncReport", "count_syncs", "PhaseTimer", "time_ms", "reset_peak_memory",
           "peak_memory", "current_memory", "percentiles", "host_device_timeline", "profile", "ProfileResult",
           "summarize_events", "QUEUE_FULL", "quiet_profiler"]
