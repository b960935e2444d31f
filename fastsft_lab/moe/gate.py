"""The experts' gated activations - GPT-OSS's clamped GLU and the SiLU gate of Qwen3-MoE - each as the eager expression
and one fused Triton kernel each way on CUDA."""

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
    def _glu_fwd_kernel(gu_ptr, out_ptr, n, alpha, limit, b_ptr, ids_ptr, I, HAS_BIAS: tl.constexpr,
                        BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(gu_ptr + 2 * offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + 2 * offs + 1, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:  # the row's expert bias: b[e, 2j], b[e, 2j + 1] with e = ids[row]
            row = offs // I
            col = offs - row * I
            e = tl.load(ids_ptr + row, mask=mask, other=0).to(tl.int64)
            g += tl.load(b_ptr + e * 2 * I + 2 * col, mask=mask, other=0.0).to(tl.float32)
            u += tl.load(b_ptr + e * 2 * I + 2 * col + 1, mask=mask, other=0.0).to(tl.float32)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        sig = 1.0 / (1.0 + tl.exp(-alpha * g))
        out = (u + 1.0) * (g * sig)
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _glu_bwd_kernel(gu_ptr, grad_ptr, dgu_ptr, n, alpha, limit, b_ptr, ids_ptr, I, HAS_BIAS: tl.constexpr,
                        BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g_raw = tl.load(gu_ptr + 2 * offs, mask=mask, other=0.0).to(tl.float32)
        u_raw = tl.load(gu_ptr + 2 * offs + 1, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            row = offs // I
            col = offs - row * I
            e = tl.load(ids_ptr + row, mask=mask, other=0).to(tl.int64)
            g_raw += tl.load(b_ptr + e * 2 * I + 2 * col, mask=mask, other=0.0).to(tl.float32)
            u_raw += tl.load(b_ptr + e * 2 * I + 2 * col + 1, mask=mask, other=0.0).to(tl.float32)
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

    @triton.jit
    def _swiglu_fwd_kernel(gu_ptr, out_ptr, n, I, BLOCK: tl.constexpr):
        # concatenated halves: gate = gu[row, j], up = gu[row, I + j]; out = silu(gate) * up
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        row = offs // I
        base = offs + row * I            # row * 2I + col
        g = tl.load(gu_ptr + base, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + base + I, mask=mask, other=0.0).to(tl.float32)
        out = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(gu_ptr, grad_ptr, dgu_ptr, n, I, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        row = offs // I
        base = offs + row * I
        g = tl.load(gu_ptr + base, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + base + I, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        silu = g * sig
        tl.store(dgu_ptr + base, (dout * u * (sig + silu * (1.0 - sig))).to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dgu_ptr + base + I, (dout * silu).to(dgu_ptr.dtype.element_ty), mask=mask)

    _HAS_TRITON = True
except Exception:  # noqa: BLE001 - no triton (CPU wheels): the eager gate runs
    _HAS_TRITON = False

_GLU_BLOCK = 1024


class _FusedGptOssGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, alpha: float, limit: float, bias: torch.Tensor | None = None,
                expert_ids: torch.Tensor | None = None) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        inter = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], inter)
        n = out.numel()
        has_bias = bias is not None
        b = bias.to(gate_up.dtype).contiguous() if has_bias else gate_up
        ids = expert_ids.contiguous() if has_bias else gate_up
        if n:
            _glu_fwd_kernel[(triton.cdiv(n, _GLU_BLOCK),)](gate_up, out, n, float(alpha), float(limit), b, ids, inter,
                                                            HAS_BIAS=has_bias, BLOCK=_GLU_BLOCK)
        ctx.save_for_backward(gate_up, b if has_bias else None, ids if has_bias else None)
        ctx.alpha, ctx.limit, ctx.has_bias = float(alpha), float(limit), has_bias
        ctx.bias_dtype = bias.dtype if has_bias else None
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate_up, b, ids = ctx.saved_tensors
        grad = grad.contiguous()
        dgu = torch.empty_like(gate_up)
        n = grad.numel()
        inter = gate_up.shape[-1] // 2
        if n:
            _glu_bwd_kernel[(triton.cdiv(n, _GLU_BLOCK),)](gate_up, grad, dgu, n, ctx.alpha, ctx.limit,
                                                            b if ctx.has_bias else gate_up,
                                                            ids if ctx.has_bias else gate_up, inter,
                                                            HAS_BIAS=ctx.has_bias, BLOCK=_GLU_BLOCK)
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[3]:  # trainable expert biases: one_hot^T @ dgu (a GEMM, no atomics)
            one_hot = dgu.new_zeros(ids.numel(), b.shape[0]).scatter_(1, ids.view(-1, 1), 1.0)
            grad_bias = (one_hot.t() @ dgu.view(-1, dgu.shape[-1])).to(ctx.bias_dtype)
        return dgu, None, None, grad_bias, None


class _FusedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        inter = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], inter)
        n = out.numel()
        if n:
            _swiglu_fwd_kernel[(triton.cdiv(n, _GLU_BLOCK),)](gate_up, out, n, inter, BLOCK=_GLU_BLOCK)
        ctx.save_for_backward(gate_up)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        grad = grad.contiguous()
        dgu = torch.empty_like(gate_up)
        n = grad.numel()
        if n:
            _swiglu_bwd_kernel[(triton.cdiv(n, _GLU_BLOCK),)](gate_up, grad, dgu, n, gate_up.shape[-1] // 2,
                                                               BLOCK=_GLU_BLOCK)
        return dgu


def fused_glu_available(t: torch.Tensor) -> bool:
    """Whether the fused Triton gates run on ``t`` (CUDA + triton, and not switched off)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return _FUSED_GLU[0] and _HAS_TRITON and (t.device.type == "cuda" or interpret)


def set_fused_glu(enabled: bool) -> bool:
    """Turn the fused Triton gates of ``sync_free`` (GPT-OSS's GLU, the SiLU gate) on/off (env
    ``FASTSFT_MOE_FUSED_GLU``); returns the old setting."""
    old, _FUSED_GLU[0] = _FUSED_GLU[0], bool(enabled)
    return old


def gpt_oss_glu(gate_up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0, *, bias: torch.Tensor | None = None,
                expert_ids: torch.Tensor | None = None) -> torch.Tensor:
    """GPT-OSS's gate on an (S, 2I) interleaved tensor: one fused Triton kernel on CUDA, six eager kernels elsewhere.

    ``bias`` (E, 2I) with ``expert_ids`` (S,) adds each row's expert bias first; the fused kernel reads it in place
    (no (S, 2I) biased copy), the eager path gathers it.
    """
    if (bias is None) != (expert_ids is None):
        raise ValueError("gpt_oss_glu: pass bias and expert_ids together (or neither)")
    if fused_glu_available(gate_up):
        return _FusedGptOssGLU.apply(gate_up, alpha, limit, bias, expert_ids)
    if bias is not None:
        gate_up = gate_up + bias.to(gate_up.dtype)[expert_ids]
    return eager_gpt_oss_glu(gate_up, alpha, limit)


def is_silu_gate(module: nn.Module) -> bool:
    """transformers' default gate ``act_fn(gate) * up`` on concatenated halves with a SiLU (Qwen3-MoE, Mixtral...)."""
    apply_gate = getattr(type(module), "_apply_gate", None)
    act = getattr(module, "act_fn", None)
    return (getattr(apply_gate, "__name__", "") == "_default_apply_gate" and getattr(module, "is_concatenated", True)
            and (isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")))


def silu_glu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` on (S, 2I) concatenated halves: one fused Triton kernel each way on CUDA, eager elsewhere."""
    if fused_glu_available(gate_up):
        return _FusedSwiGLU.apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


__all__ = ["gpt_oss_glu", "eager_gpt_oss_glu", "is_gpt_oss_gate", "fused_glu_available", "set_fused_glu",
           "is_silu_gate", "silu_glu"]
