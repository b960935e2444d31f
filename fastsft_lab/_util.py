"""Small helpers shared by the library's modules (no torch state, no imports of the package)."""

from __future__ import annotations

import contextlib
import os
from typing import Iterable, Sequence


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` that is >= ``n``."""
    return (n + multiple - 1) // multiple * multiple


def pow2_ceil(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1)."""
    return 1 << max(0, int(n - 1).bit_length())


def quantile(sorted_values: Sequence[float], p: float) -> float:
    """Linear-interpolation quantile ``p`` in [0, 1] of already sorted values (numpy's default method)."""
    if not sorted_values:
        raise ValueError("quantile of no values")
    x = p * (len(sorted_values) - 1)
    lo = int(x)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (x - lo)


def percentiles(values: Iterable[float]) -> dict[str, float]:
    """median, p20, p80 (linear interpolation) and n, rounded as the harness reports them; NaNs and n=0 for no
    values. Torch-free: ``benchmarks/unsloth_peer`` imports it in Unsloth's environment (re-exported by
    ``fastsft_lab.profiling``)."""
    v = sorted(values)
    if not v:
        return {"median": float("nan"), "p20": float("nan"), "p80": float("nan"), "n": 0}
    return {"median": round(quantile(v, 0.5), 4), "p20": round(quantile(v, 0.2), 4),
            "p80": round(quantile(v, 0.8), 4), "n": len(v)}


def on_device_of(t):
    """The current CUDA device set to ``t``'s for a kernel launch (Triton launches on the current device, not the
    tensors'): a model on ``cuda:1`` of a process whose current device is ``cuda:0``. A no-op off CUDA."""
    if t.device.type != "cuda":
        return contextlib.nullcontext()
    import torch          # here, not at the top: the Unsloth peer's process imports this module without torch

    return torch.cuda.device(t.device)


class KernelSwitch:
    """On/off for one family of fused Triton kernels: on unless the environment variable ``env`` says
    0/false/no/off, switchable at run time; they run on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``
    (the tests' way of running a kernel without a GPU)."""

    _OFF = ("0", "false", "no", "off")

    def __init__(self, env: str):
        self.env = env
        self.on = os.environ.get(env, "1").strip().lower() not in self._OFF

    def set(self, enabled: bool) -> bool:
        """Turn the kernels on or off; returns the old setting."""
        old, self.on = self.on, bool(enabled)
        return old

    def runs_on(self, t, have_triton: bool) -> bool:
        """Whether the kernels run on tensor ``t``: switched on, triton importable, and a CUDA tensor (or a CPU one
        under the interpreter)."""
        return self.on and have_triton and (t.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
