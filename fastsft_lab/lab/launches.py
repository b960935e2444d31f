"""Kernel launches of one call, counted beside its host syncs: what bounds a host that issues many small kernels.

A host sync stalls the launch queue, but only costs what the GPU could have run meanwhile: when the host spends its
time *issuing* kernels (a Python loop of small launches, a few microseconds each), the GPU waits for launches anyway
and a sync adds almost nothing. So a "fewer syncs" change that keeps the launches (MoE routing ``grouped``: one sync
per layer instead of hundreds, still a loop over experts) buys little; fewer launches (``sync_free``: one grouped
matmul) buy much. :func:`count_launches` counts them for one call:

* on CUDA, the device operations the call launched (kernels, memcpys, memsets), from ``torch.profiler``;
* elsewhere, the aten operations the call ran that would each launch at least one kernel on a GPU (every op but
  views and bare allocations) -- an estimate of the same count, exact for eager code; a fused Triton kernel runs on
  a GPU only, so a CPU run counts the eager ops it replaces.
"""

from __future__ import annotations

from typing import Callable

import torch

from .._compat import ATEN_RESHAPE_ALIAS, TorchDispatchMode

__all__ = ["count_launches", "LaunchCountingMode", "LAUNCHES_COUNTED"]

aten = torch.ops.aten

# ops that allocate or relabel memory without a kernel
_NO_KERNEL = {aten.empty, aten.empty_like, aten.empty_strided, aten.new_empty, aten.new_empty_strided, aten.detach,
              aten.alias, aten.lift_fresh, aten.set_, aten.resize_, ATEN_RESHAPE_ALIAS}

LAUNCHES_COUNTED = {"cuda": "CUDA kernels, memcpys and memsets launched (torch.profiler)",
                    "cpu": "aten ops that would each launch a kernel on a GPU (views and bare allocations left out)"}


class LaunchCountingMode(TorchDispatchMode):
    """Counts the aten ops dispatched inside it that launch a kernel on a GPU (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func.overloadpacket in _NO_KERNEL):
            self.count += 1
        return func(*args, **(kwargs or {}))


def count_launches(fn: Callable[[], object], device: torch.device | str) -> int:
    """Kernel launches of one call of ``fn`` on ``device`` (see the module docstring for what a CPU run counts).
    Warm ``fn`` up first: a first call's one-off work (autotuning, allocations) is counted too."""
    device = torch.device(device)
    if device.type != "cuda":
        with LaunchCountingMode() as mode:
            fn()
        return mode.count
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity

    from ..profiling import quiet_profiler

    torch.cuda.synchronize(device)
    with quiet_profiler(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize(device)
    return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
