"""Host side of offloaded checkpointing: a pool of reusable (pinned) slots for layer inputs."""

from __future__ import annotations

import heapq
import os
import threading
from typing import Sequence

import torch

from .._util import pow2_ceil


# What the pool leaves to everything else on the host (the OS, the DataLoader workers, the other ranks' growth).
HOST_RESERVE_BYTES = 2 * 2**30


def host_memory_available() -> int | None:
    """Bytes of host memory this process can still use: Linux ``MemAvailable``, capped by the cgroup's limit where
    one is set (a container: Colab, Kubernetes); None where neither can be read."""
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


def local_ranks() -> int:
    """Processes of this job on this node (torchrun / accelerate set ``LOCAL_WORLD_SIZE``; 1 otherwise)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)


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
        size = pow2_ceil(nbytes)
        avail = host_memory_available()
        if avail is not None and size + HOST_RESERVE_BYTES > avail:
            ranks = local_ranks()
            need = self.nbytes + size
            raise RuntimeError(
                f"offloaded checkpointing: host memory would run out: this process holds {self.nbytes / 2**30:.2f} GiB "
                f"of {'pinned ' if self.pin else ''}layer inputs and needs {size / 2**30:.2f} GiB more "
                f"({need / 2**30:.2f} GiB per rank, about {ranks * need / 2**30:.1f} GiB for the {ranks} rank(s) on "
                f"this node), with {avail / 2**30:.2f} GiB available and {HOST_RESERVE_BYTES / 2**30:.0f} GiB kept "
                "free: fewer tokens per step, fewer ranks per node, or standard checkpointing (offload_buffers=0)")
        self.allocations += 1
        return torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)

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
            self._gens.append(0)
            return len(self._slots) - 1

    def release(self, idx: int) -> None:
        with self._lock:
            if idx in self._free or idx >= len(self._slots):
                raise RuntimeError(f"pinned pool slot {idx} released twice")
            heapq.heappush(self._free, idx)

    def view(self, idx: int, nbytes: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        return self._slots[idx][:nbytes].view(dtype).view(shape)

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
            self._free.clear()
            self._gens.clear()


__all__ = ["PinnedPool"]
