"""The CUDA caching allocator's counters, as the memory plan reads them: how much a step can reach at most.

A step's tensors can be allocated up to what the device has free plus what this process's allocator holds, less the
slack the allocator's blocks leave (block rounding, fragmentation). The plan reads that slack on its own step 1:
at its start the allocator's unused cached blocks go back to the device and the peak counters are reset
(:func:`release_cached_blocks`), so that blocks cached before -- while the model was built, by an earlier run in the
process -- are not taken for the step's slack; at step 2 the ceiling is read (:func:`step_ceiling`). The functions take
``torch.cuda`` or a stand-in with its counter functions (the tests' simulated allocator). A ``memory_budget`` in
bytes (:func:`budget_bytes`) is read from the same counters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .solver import GiB


def allocator_ceiling(*, free: int, reserved: int, peak_reserved: int, peak_allocated: int) -> int:
    """The most bytes a step's tensors can be allocated on a CUDA device: what this process has reserved plus what
    the device has free, less the caching allocator's slack as step 1 measured it (reserved but unallocated at its
    peak: block rounding and fragmentation, which the same layers at the same sizes pay again). The peaks must be
    step 1's own: read since :func:`release_cached_blocks` at its start."""
    return free + reserved - max(0, peak_reserved - peak_allocated)


@dataclass(frozen=True)
class AllocatorCounters:
    """A CUDA caching allocator's counters on one device, in bytes."""

    free: int                # the device's free memory as the driver reports it (cached blocks count as used)
    reserved: int            # held by the allocator: allocated blocks and cached ones
    allocated: int           # handed out to tensors
    peak_reserved: int       # the most of each since the peak counters were last reset
    peak_allocated: int


def allocator_counters(device: torch.device, cuda: Any = torch.cuda) -> AllocatorCounters:
    """The counters of ``device``'s caching allocator (``cuda``: ``torch.cuda``, or a stand-in with its functions)."""
    return AllocatorCounters(free=cuda.mem_get_info(device)[0], reserved=cuda.memory_reserved(device),
                             allocated=cuda.memory_allocated(device),
                             peak_reserved=cuda.max_memory_reserved(device),
                             peak_allocated=cuda.max_memory_allocated(device))


def release_cached_blocks(device: torch.device, cuda: Any = torch.cuda) -> AllocatorCounters:
    """Step 1's start: the allocator's cached blocks that no tensor uses given back to the device, and the peak
    counters reset. Blocks cached while the model was built, or by an earlier run in the process, are reusable: left
    cached they would read as step 1's slack (reserved but unallocated at its peak) and the plan would be solved
    that much under its budget (Qwen3-14B x40 on an H100, built then trained in one script: 20 GiB under). What
    step 1 then reads is its own. Returns the counters after."""
    cuda.empty_cache()
    cuda.reset_peak_memory_stats(device)
    return allocator_counters(device, cuda)


def step_ceiling(device: torch.device, cuda: Any = torch.cuda) -> int:
    """:func:`allocator_ceiling` from ``device``'s counters now (at step 2: step 1's slack since its start)."""
    c = allocator_counters(device, cuda)
    return allocator_ceiling(free=c.free, reserved=c.reserved, peak_reserved=c.peak_reserved,
                             peak_allocated=c.peak_allocated)


# --- a memory budget in bytes ----------------------------------------------------------------------------------------
def parse_budget(value, total: int | None, free: int | None, held: int = 0) -> int:
    """``memory_budget`` in bytes, the most a step may allocate: a number of GiB (``80``), or a share of the device's
    free memory (``"90%"``) on top of the ``held`` bytes already allocated (the model: a budget is a peak, and a
    loaded model's weights are in it)."""
    forms = "a size in GiB (e.g. 80) or a share of the device's free memory (e.g. '90%')"
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            share = float(value.strip()[:-1])
        except ValueError:
            share = -1.0
        if not 0 < share <= 100:
            raise ValueError(f"memory_budget {value!r}: a share must be between 0% and 100%; {forms}")
        if free is None:      # a CPU: the one form that works there, with a size this host can hold
            example = f"{max(1, int(total / GiB / 2))}" if total else "16"
            raise ValueError(f"memory_budget {value!r}: a share is of a GPU's free memory, and this device does not "
                             f"report its free memory (a CPU): give a size in GiB instead, e.g. memory_budget="
                             f"{example}" + (f" (this host has {total / GiB:.0f} GiB)" if total else ""))
        return held + int(free * share / 100)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"memory_budget must be {forms}, got {value!r}")
    if value <= 0:
        raise ValueError(f"memory_budget must be positive, got {value!r}: {forms}")
    budget = int(value * GiB)
    if total is not None and budget > total:
        raise ValueError(f"memory_budget {value} GiB is above the device's memory ({total / GiB:.1f} GiB): "
                         f"give {forms}")
    return budget


def budget_bytes(value, device: torch.device) -> int:
    """:func:`parse_budget` on ``device``: its total and free memory and, on CUDA, what is allocated there now."""
    held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    return parse_budget(value, *device_memory(device), held=held)


def device_memory(device: torch.device) -> tuple[int | None, int | None]:
    """(total, free) bytes of ``device``: the GPU's, or the host's physical memory for a CPU (free unknown). On CUDA
    "free" is what a new tensor can get: the device's free memory plus what this process's caching allocator holds
    unallocated (the driver counts that as used)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        import os
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), None
    except (ValueError, OSError, AttributeError):
        return None, None

__all__ = ["AllocatorCounters", "allocator_ceiling", "allocator_counters", "release_cached_blocks", "step_ceiling",
           "parse_budget", "budget_bytes", "device_memory"]
