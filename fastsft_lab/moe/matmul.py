"""The grouped matmul the sync-free path runs on: where it is available, and a call with a contiguous backward."""

from __future__ import annotations

from typing import Callable

import torch

from .._compat import grouped_mm_function


def _grouped_mm_fn() -> Callable | None:
    return grouped_mm_function()


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


_TORCH_VERSION = _torch_version()   # a constant, so that torch.compile traces no cache wrapper


def grouped_mm_unavailable(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why no sync-free grouped matmul can run on these tensors here (None: it can).

    Conditions follow transformers' ``_can_use_grouped_mm`` and PyTorch's kernels: CUDA needs sm80+ and bfloat16
    (other dtypes go through a PyTorch fallback that reads the offsets back); the CPU kernel exists from torch 2.9
    (and wants 16-byte aligned pointers up to 2.10); under ``torch.compile`` its shape function takes bfloat16 only.
    """
    if _grouped_mm_fn() is None:
        return f"torch {torch.__version__} has no grouped_mm"
    if x.device.type == "cuda":
        if torch.cuda.get_device_capability(x.device) < (8, 0):
            return "grouped_mm needs a CUDA GPU with compute capability >= 8.0"
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
            return f"grouped_mm on CUDA runs sync-free in bfloat16 only (got {x.dtype})"
        return None
    if x.device.type == "cpu":
        version = _TORCH_VERSION
        if torch.compiler.is_compiling() and (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16):
            return f"grouped_mm under torch.compile on a CPU traces in bfloat16 only (got {x.dtype})"
        if version < (2, 9):
            return f"torch {torch.__version__} has no CPU grouped_mm kernel (needs >= 2.9)"
        if version <= (2, 10) and (x.data_ptr() % 16 or weight.data_ptr() % 16):
            return "CPU grouped_mm of this torch needs 16-byte aligned tensors"
        return None
    return f"no grouped_mm kernel known for device type {x.device.type!r}"


class ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's backward rejects expanded
    (stride-0) gradients such as the one ``out.sum().backward()`` produces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_mm(x: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(S, K) rows sorted by expert, (E, K, N) weights, int32 end offsets (E,) -> (S, N). No host sync."""
    fn = _grouped_mm_fn()
    assert fn is not None, "no grouped matmul in this torch (grouped_mm_unavailable says so first)"
    return ContiguousGrad.apply(fn(x, mat_b, offs=offs))



__all__ = ["grouped_mm", "grouped_mm_unavailable"]
