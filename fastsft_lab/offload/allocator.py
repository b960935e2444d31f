"""The CUDA caching allocator's counters, as the memory plan reads them: how much a step can reach at most.

A step's tensors can be allocated up to what the device has free plus what this process's allocator holds, less the
slack the allocator's blocks leave (block rounding, fragmentation). The plan reads that slack on its own step 1:
at its start the allocator's unused cached blocks go back to the device and the peak counters are reset
(:func:`release_cached_blocks`), so that blocks cached before -- while the model was built, by an earlier run in the
process -- are not taken for the step's slack; at step 2 the ceiling is read (:func:`step_ceiling`). The functions take
``torch.cuda`` or a stand-in with its counter functions (the tests' simulated allocator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


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


__all__ = ["AllocatorCounters", "allocator_ceiling", "allocator_counters", "release_cached_blocks", "step_ceiling"]
