"""A finished ``torch.profiler`` profile's events, read from kineto's own records: the device activities with the
correlation id of the op that launched each (:func:`device_events`; torch < 2.13's ``FunctionEvent`` drops it), the
host events linked as torch's own parse links them (:func:`host_events`, at a fraction of the cost of
``profile.events()``), and the ops' input dtypes (``FunctionEvent.input_dtypes`` is missing before torch 2.13).
:mod:`fastsft_lab.step_profile` places and classifies the kernels from them.
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from types import SimpleNamespace

import torch

_RUNTIME = re.compile(r"^cu(da)?[A-Z]")    # CUDA runtime / driver calls: cudaLaunchKernel, cuLaunchKernelEx, ...


def device_events(prof) -> list:
    """The device activities of a finished ``torch.profiler.profile``, each with the ``linked_correlation_id`` of the
    op that launched it, read from kineto's own events: the ``FunctionEvent`` of torch < 2.13 drops that id. Times
    are microseconds from the trace start, as ``FunctionEvent.time_range``."""
    results = prof.profiler.kineto_results
    t0 = results.trace_start_ns() if hasattr(results, "trace_start_ns") else results.trace_start_us() * 1000
    out = []
    for k in results.events():
        if k.device_type() == torch.autograd.DeviceType.CPU:
            continue
        note = k.is_user_annotation() if hasattr(k, "is_user_annotation") else False
        out.append(SimpleNamespace(name=k.name(), device_type=k.device_type(), is_async=False,
                                   linked_correlation_id=k.linked_correlation_id(), is_user_annotation=note,
                                   activity_type=None, time_range=SimpleNamespace(start=(k.start_ns() - t0) / 1e3,
                                                                                  end=(k.end_ns() - t0) / 1e3)))
    return out


# The utility ops torch's own parse leaves out of ``profile.events()`` (torch.autograd.profiler_util._filter_name)
_NOT_EVENTS = frozenset({"[memory]", "[OutOfMemory]", "profiler::_record_function_enter",
                         "profiler::_record_function_enter_new", "profiler::_record_function_exit", "aten::is_leaf",
                         "aten::output_nr", "aten::_version"})


class HostEvent:
    """One host-side event of a finished profile, read from kineto's own record: the fields of torch's
    ``FunctionEvent`` that :class:`EventIndex` and :func:`kernels_of` read (its shapes, dtypes and FLOPs only when
    asked), without the cost of building every ``FunctionEvent`` (``profile.events()``: many times this)."""

    __slots__ = ("_k", "name", "id", "thread", "fwd_thread", "sequence_nr", "is_async", "is_user_annotation",
                 "linked_correlation_id", "time_range", "cpu_parent", "cpu_children", "kernels")
    device_type = torch.autograd.DeviceType.CPU

    def __init__(self, k, t0_ns: int):
        self._k = k
        self.name = k.name()
        self.id = k.correlation_id()
        self.thread = k.start_thread_id()
        self.fwd_thread = k.fwd_thread_id()
        self.sequence_nr = k.sequence_nr()
        self.is_async = k.is_async() or self.thread != k.end_thread_id()
        self.is_user_annotation = k.is_user_annotation() if hasattr(k, "is_user_annotation") else False
        self.linked_correlation_id = k.linked_correlation_id()
        self.time_range = SimpleNamespace(start=(k.start_ns() - t0_ns) / 1e3, end=(k.end_ns() - t0_ns) / 1e3)
        self.cpu_parent: HostEvent | None = None
        self.cpu_children: list[HostEvent] = []
        self.kernels: list = []

    @property
    def input_shapes(self) -> list:
        return list(self._k.shapes())

    @property
    def structured_input_shapes(self) -> list | None:
        get = getattr(self._k, "structured_input_shapes", None)
        return list(get()) if get is not None else None

    @property
    def concrete_inputs(self) -> list:
        return list(self._k.concrete_inputs())

    @property
    def input_dtypes(self) -> list:
        return list(self._k.dtypes())

    @property
    def flops(self) -> int:
        return self._k.flops()


def host_events(prof) -> list[HostEvent]:
    """The host-side events of a finished ``torch.profiler.profile`` as :class:`HostEvent`, linked as torch's own
    parse links them (``profile.events()``): an event is async where it ends on another thread; a runtime call
    takes the thread of the op that launched it; each thread's synchronous events nest by their intervals
    (``cpu_parent`` / ``cpu_children``), a child of the same name as its only-child parent merged into it (torch's
    duplicate nodes); each op lists the device activities it launched (``kernels``). Sorted by start."""
    results = prof.profiler.kineto_results
    t0 = results.trace_start_ns() if hasattr(results, "trace_start_ns") else results.trace_start_us() * 1000
    cpu = torch.autograd.DeviceType.CPU
    out: list[HostEvent] = []
    launched: dict[int, list] = defaultdict(list)          # op id -> the device activities it launched
    for k in results.events():
        if k.device_type() != cpu:
            if k.linked_correlation_id() > 0:
                launched[k.linked_correlation_id()].append(SimpleNamespace(name=k.name()))
            continue
        if k.name() in _NOT_EVENTS or (hasattr(k, "is_hidden_event") and k.is_hidden_event()):
            continue
        out.append(HostEvent(k, t0))
    ops = {e.id: e for e in out if e.linked_correlation_id == 0 and not e.is_async}
    for e in out:
        if e.linked_correlation_id > 0:                    # a runtime call: on its op's thread
            op = ops.get(e.linked_correlation_id)
            if op is not None:
                e.thread = op.thread
    for op_id, acts in launched.items():
        if op_id in ops:
            ops[op_id].kernels = acts
    out.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
    by_thread: dict[int, list[HostEvent]] = defaultdict(list)
    for e in out:
        if not e.is_async:
            by_thread[e.thread].append(e)
    parent: HostEvent | None
    for events in by_thread.values():                     # already in (start, -end) order
        stack: list[HostEvent] = []
        for e in events:
            while stack:
                parent = stack[-1]
                if e.time_range.start >= parent.time_range.end or e.time_range.end > parent.time_range.end:
                    stack.pop()
                else:
                    parent.cpu_children.append(e)
                    e.cpu_parent = parent
                    break
            stack.append(e)
    gone: set[int] = set()
    while True:                                           # torch's duplicate nodes, until none is left
        merged = False
        for e in out:
            parent = e.cpu_parent
            if id(e) in gone or parent is None or parent.name != e.name or len(parent.cpu_children) != 1:
                continue
            parent.cpu_children = e.cpu_children
            parent.kernels = e.kernels
            for c in e.cpu_children:
                c.cpu_parent = parent
            gone.add(id(e))
            merged = True
        if not merged:
            break
    return [e for e in out if id(e) not in gone] if gone else out


def _input_dtypes(prof) -> dict[int, list]:
    """``{op id: input dtypes}`` from kineto's events (``FunctionEvent.input_dtypes`` is missing before torch 2.13)."""
    out = {}
    for k in prof.profiler.kineto_results.events():
        if k.device_type() == torch.autograd.DeviceType.CPU and not _RUNTIME.match(k.name()):
            with contextlib.suppress(AttributeError, RuntimeError):
                out[k.correlation_id()] = list(k.dtypes())
    return out


__all__ = ["device_events", "HostEvent", "host_events"]
