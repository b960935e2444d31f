"""GPT-OSS's gated activation: the eager expression, and one fused Triton kernel each way on CUDA."""

from __future__ import annotations

import os

import torch
from torch import nn


def is_gpt_oss_gate(module: nn.Module) -> bool:
    return (not getattr(module, "is_concatenated", True)) and hasattr(module, "alpha") and hasattr(module, "limit")


def eager_gpt_oss_glu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's gate: interleaved gate/up columns, gate clamped above at ``limit``, up clamped at +-limit,
    ``(up + 1) * gate * sigmoid(alpha * gate)``; six elementwise kernels instead of seven (``addcmul`` does the
    ``(up + 1) *`` in one)."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return torch.addcmul(glu, up, glu)


# --- Fused GPT-OSS gate (Triton, CUDA) --------------------------------------------------------------------------
# The eager gate is six elementwise kernels forward (each reading/writing an (S, I) tensor, two of them reading the
# interleaved (S, 2I) input) and about a dozen backward, and autograd keeps four (S, I) intermediates. One Triton
# kernel each way reads gate_up once, writes the (S, I) output once, and saves only gate_up. Gate and up of output
# column j sit at flat positions 2n and 2n+1 of the contiguous (S, 2I) input, n = row * I + j: no row arithmetic.
_FUSED_GLU = [os.environ.get("FASTSFT_MOE_FUSED_GLU", "1").strip().lower() not in ("0", "false", "no", "off")]

try:  # Triton ships with CUDA builds of PyTorch; TRITON_INTERPRET=1 runs these kernels on CPU tensors (tests)
    import triton
    import triton.language as tl

    @triton.jit
    def _glu_fwd_kernel(gu_ptr, out_ptr, n, alpha, limit, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(gu_ptr + 2 * offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + 2 * offs + 1, mask=mask, other=0.0).to(tl.float32)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        sig = 1.0 / (1.0 + tl.exp(-alpha * g))
        out = (u + 1.0) * (g * sig)
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _glu_bwd_kernel(gu_ptr, grad_ptr, dgu_ptr, n, alpha, limit, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g_raw = tl.load(gu_ptr + 2 * offs, mask=mask, other=0.0).to(tl.float32)
        u_raw = tl.load(gu_ptr + 2 * offs + 1, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.minimum(g_raw, limit)
        u = tl.minimum(tl.maximum(u_raw, -limit), limit)
        sig = 1.0 / (1.0 + tl.exp(-alpha * g))
        glu = g * sig
        # clamp passes the gradient where min <= x <= max (PyTorch's clamp backward), inclusive at the limits
        dg = tl.where(g_raw <= limit, dout * (u + 1.0) * (sig + g * sig * (1.0 - sig) * alpha), 0.0)
        du = tl.where((u_raw >= -limit) & (u_raw <= limit), dout * glu, 0.0)
        tl.store(dgu_ptr + 2 * offs, dg.to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dgu_ptr + 2 * offs + 1, du.to(dgu_ptr.dtype.element_ty), mask=mask)

    _HAS_TRITON = True
except Exception:  # noqa: BLE001 - no triton (CPU wheels): the eager gate runs
    _HAS_TRITON = False

_GLU_BLOCK = 1024


class _FusedGptOssGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        out = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
        n = out.numel()
        if n:
            _glu_fwd_kernel[(triton.cdiv(n, _GLU_BLOCK),)](gate_up, out, n, float(alpha), float(limit),
                                                            BLOCK=_GLU_BLOCK)
        ctx.save_for_backward(gate_up)
        ctx.alpha, ctx.limit = float(alpha), float(limit)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        grad = grad.contiguous()
        dgu = torch.empty_like(gate_up)
        n = grad.numel()
        if n:
            _glu_bwd_kernel[(triton.cdiv(n, _GLU_BLOCK),)](gate_up, grad, dgu, n, ctx.alpha, ctx.limit,
                                                            BLOCK=_GLU_BLOCK)
        return dgu, None, None


def fused_glu_available(t: torch.Tensor) -> bool:
    """Whether the fused Triton gate runs on ``t`` (CUDA + triton, and not switched off)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return _FUSED_GLU[0] and _HAS_TRITON and (t.device.type == "cuda" or interpret)


def set_fused_glu(enabled: bool) -> bool:
    """Turn the fused Triton GPT-OSS gate of ``sync_free`` on/off (env ``FASTSFT_MOE_FUSED_GLU``); returns the old."""
    old, _FUSED_GLU[0] = _FUSED_GLU[0], bool(enabled)
    return old


def gpt_oss_glu(gate_up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """GPT-OSS's gate on an (S, 2I) interleaved tensor: one fused Triton kernel on CUDA, six eager kernels elsewhere."""
    if fused_glu_available(gate_up):
        return _FusedGptOssGLU.apply(gate_up, alpha, limit)
    return eager_gpt_oss_glu(gate_up, alpha, limit)



__all__ = ["gpt_oss_glu", "eager_gpt_oss_glu", "is_gpt_oss_gate", "fused_glu_available", "set_fused_glu"]
