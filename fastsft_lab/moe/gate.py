"""The experts' gated activations - GPT-OSS's clamped GLU and the SiLU gate of Qwen3-MoE - each as the eager expression
and one fused Triton kernel each way on CUDA; :data:`GATES` maps the record's gate kind to its :class:`Gate`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .._compat import experts_gate
from .._util import KernelSwitch, on_device_of, pow2_ceil


def eager_gpt_oss_glu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's gate: interleaved gate/up columns, gate clamped above at ``limit``, up clamped at +-limit,
    ``(up + 1) * gate * sigmoid(alpha * gate)``; six elementwise kernels instead of seven (``addcmul`` does the
    ``(up + 1) *`` in one)."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return torch.addcmul(glu, up, glu)


# --- Fused gates (Triton, CUDA) ---------------------------------------------------------------------------------
# The eager gate is six elementwise kernels forward (each reading/writing an (S, I) tensor, two of them reading the
# interleaved (S, 2I) input) and about a dozen backward, and autograd keeps four (S, I) intermediates. One Triton
# kernel each way reads gate_up once, writes the (S, I) output once, and saves only gate_up.
# Access pattern: a program owns a (BLOCK_R, BLOCK_C) tile of the output, i.e. BLOCK_R rows x 2 * BLOCK_C contiguous
# columns of the interleaved gate_up. It loads that as one contiguous tile (wide vector loads) and splits the even
# (gate) and odd (up) columns in registers with reshape + split; the backward joins (d_gate, d_up) back into pairs and
# stores one contiguous tile; for sm_90 this compiles to 16-byte loads and stores, the reshape/split/join stay in
# registers and only the (S, I) operand goes through shared memory (a layout change, 8 KiB per program). Loading
# the halves as two stride-2 streams instead compiled to 2-byte scalar loads (and stores in the backward) and ran the
# GPT-OSS gate at 1.4-1.9 TB/s on an H200 against ~4.8 TB/s of HBM.
_FUSED_GLU = KernelSwitch("FASTSFT_MOE_FUSED_GLU")

try:  # Triton ships with CUDA builds of PyTorch; TRITON_INTERPRET=1 runs these kernels on CPU tensors (tests)
    import triton
    import triton.language as tl

    @triton.jit
    def _gate_up_tile(gu_ptr, b_ptr, ids_ptr, rows, cols, mask, R, I, HAS_BIAS: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_C: tl.constexpr):
        # rows (BLOCK_R,) int64, cols (2 * BLOCK_C,) interleaved columns -> float32 (gate, up), each (BLOCK_R, BLOCK_C)
        x = tl.load(gu_ptr + rows[:, None] * (2 * I) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:  # the row's expert bias, read in place: b[ids[row], cols]
            e = tl.load(ids_ptr + rows, mask=rows < R, other=0).to(tl.int64)
            x += tl.load(b_ptr + e[:, None] * (2 * I) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        return tl.split(tl.reshape(x, (BLOCK_R, BLOCK_C, 2)))  # column 2j -> gate[:, j], 2j + 1 -> up[:, j]

    @triton.jit
    def _glu_fwd_kernel(gu_ptr, out_ptr, R, I, alpha, limit, b_ptr, ids_ptr, HAS_BIAS: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * (2 * BLOCK_C) + tl.arange(0, 2 * BLOCK_C)  # gate_up columns 2j, 2j + 1
        j = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # output columns
        mask = (rows < R)[:, None] & (cols < 2 * I)[None, :]  # 2I is even: a pair is in or out together
        g, u = _gate_up_tile(gu_ptr, b_ptr, ids_ptr, rows, cols, mask, R, I, HAS_BIAS, BLOCK_R, BLOCK_C)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        sig = 1.0 / (1.0 + tl.exp(-alpha * g))
        out = (u + 1.0) * (g * sig)
        tl.store(out_ptr + rows[:, None] * I + j[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(rows < R)[:, None] & (j < I)[None, :])

    @triton.jit
    def _glu_bwd_kernel(gu_ptr, grad_ptr, dgu_ptr, R, I, alpha, limit, b_ptr, ids_ptr, HAS_BIAS: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * (2 * BLOCK_C) + tl.arange(0, 2 * BLOCK_C)
        j = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows < R)[:, None] & (cols < 2 * I)[None, :]
        g_raw, u_raw = _gate_up_tile(gu_ptr, b_ptr, ids_ptr, rows, cols, mask, R, I, HAS_BIAS, BLOCK_R, BLOCK_C)
        dout = tl.load(grad_ptr + rows[:, None] * I + j[None, :], mask=(rows < R)[:, None] & (j < I)[None, :],
                       other=0.0).to(tl.float32)
        g = tl.minimum(g_raw, limit)
        u = tl.minimum(tl.maximum(u_raw, -limit), limit)
        sig = 1.0 / (1.0 + tl.exp(-alpha * g))
        glu = g * sig
        # clamp passes the gradient where min <= x <= max (PyTorch's clamp backward), inclusive at the limits
        dg = tl.where(g_raw <= limit, dout * (u + 1.0) * (sig + g * sig * (1.0 - sig) * alpha), 0.0)
        du = tl.where((u_raw >= -limit) & (u_raw <= limit), dout * glu, 0.0)
        dgu = tl.reshape(tl.join(dg, du), (BLOCK_R, 2 * BLOCK_C))  # interleaved again: (d_gate, d_up) pairs
        tl.store(dgu_ptr + rows[:, None] * (2 * I) + cols[None, :], dgu.to(dgu_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_fwd_kernel(gu_ptr, out_ptr, R, I, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # concatenated halves: gate = gu[row, j], up = gu[row, I + j]; out = silu(gate) * up
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        j = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows < R)[:, None] & (j < I)[None, :]
        g_ptrs = gu_ptr + rows[:, None] * (2 * I) + j[None, :]
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(g_ptrs + I, mask=mask, other=0.0).to(tl.float32)
        out = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + rows[:, None] * I + j[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(gu_ptr, grad_ptr, dgu_ptr, R, I, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        j = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows < R)[:, None] & (j < I)[None, :]
        base = rows[:, None] * (2 * I) + j[None, :]
        g = tl.load(gu_ptr + base, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + base + I, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(grad_ptr + rows[:, None] * I + j[None, :], mask=mask, other=0.0).to(tl.float32)
        sig = 1.0 / (1.0 + tl.exp(-g))
        silu = g * sig
        tl.store(dgu_ptr + base, (dout * u * (sig + silu * (1.0 - sig))).to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dgu_ptr + base + I, (dout * silu).to(dgu_ptr.dtype.element_ty), mask=mask)

    _HAS_TRITON = True
except Exception:  # noqa: BLE001 - no triton (CPU wheels): the eager gate runs
    _HAS_TRITON = False

# Tiles: ~4096 outputs per program (8192 gate_up elements: 16 KiB of bf16 read, 8 KiB written forward) over 8 warps,
# i.e. 32 inputs per thread (four 16-byte loads). BLOCK_C is a power of two of at most 1024 output columns that pads
# a row little: GPT-OSS's I = 2880 -> 3 x 1024 (4 rows per tile), Qwen3-MoE's 768 -> 3 x 256 (16 rows), 1536 -> 3 x 512.
_GATE_TILE = 4096
_GATE_MAX_COLS = 1024
_GATE_WARPS = 8


def _gate_grid(rows: int, inter: int) -> tuple[tuple[int, int], int, int]:
    """(grid, BLOCK_R, BLOCK_C) of the gate kernels for an (rows, 2 * inter) gate_up."""
    block_c = min(_GATE_MAX_COLS, pow2_ceil(inter))
    while block_c > 256 and 8 * (-(-inter // block_c) * block_c - inter) > inter:  # > 1/8 of the row padded
        block_c //= 2
    block_r = max(1, _GATE_TILE // block_c)
    return (-(-rows // block_r), -(-inter // block_c)), block_r, block_c


class _FusedGptOssGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, alpha: float, limit: float, bias: torch.Tensor | None = None,
                expert_ids: torch.Tensor | None = None) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        inter = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], inter)
        rows = out.numel() // inter if inter else 0
        has_bias = bias is not None
        b = bias.to(gate_up.dtype).contiguous() if has_bias else gate_up
        ids = expert_ids.contiguous() if has_bias else gate_up
        if rows:
            grid, block_r, block_c = _gate_grid(rows, inter)
            with on_device_of(gate_up):
                _glu_fwd_kernel[grid](gate_up, out, rows, inter, float(alpha), float(limit), b, ids,
                                      HAS_BIAS=has_bias, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=_GATE_WARPS)
        ctx.save_for_backward(gate_up, b if has_bias else None, ids if has_bias else None)
        ctx.alpha, ctx.limit, ctx.has_bias = float(alpha), float(limit), has_bias
        ctx.bias_dtype = bias.dtype if has_bias else None
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate_up, b, ids = ctx.saved_tensors
        grad = grad.contiguous()
        dgu = torch.empty_like(gate_up)
        inter = gate_up.shape[-1] // 2
        rows = grad.numel() // inter if inter else 0
        if rows:
            grid, block_r, block_c = _gate_grid(rows, inter)
            with on_device_of(gate_up):
                _glu_bwd_kernel[grid](gate_up, grad, dgu, rows, inter, ctx.alpha, ctx.limit,
                                      b if ctx.has_bias else gate_up, ids if ctx.has_bias else gate_up,
                                      HAS_BIAS=ctx.has_bias, BLOCK_R=block_r, BLOCK_C=block_c,
                                      num_warps=_GATE_WARPS)
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
        rows = out.numel() // inter if inter else 0
        if rows:
            grid, block_r, block_c = _gate_grid(rows, inter)
            with on_device_of(gate_up):
                _swiglu_fwd_kernel[grid](gate_up, out, rows, inter, BLOCK_R=block_r, BLOCK_C=block_c,
                                         num_warps=_GATE_WARPS)
        ctx.save_for_backward(gate_up)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        grad = grad.contiguous()
        dgu = torch.empty_like(gate_up)
        inter = gate_up.shape[-1] // 2
        rows = grad.numel() // inter if inter else 0
        if rows:
            grid, block_r, block_c = _gate_grid(rows, inter)
            with on_device_of(gate_up):
                _swiglu_bwd_kernel[grid](gate_up, grad, dgu, rows, inter, BLOCK_R=block_r, BLOCK_C=block_c,
                                         num_warps=_GATE_WARPS)
        return dgu


def fused_glu_available(t: torch.Tensor) -> bool:
    """Whether the fused Triton gates run on ``t`` (CUDA + triton, and not switched off)."""
    return _FUSED_GLU.runs_on(t, _HAS_TRITON)


def set_fused_glu(enabled: bool) -> bool:
    """Turn the fused Triton gates of ``sync_free`` (GPT-OSS's GLU, the SiLU gate) on/off (env
    ``FASTSFT_MOE_FUSED_GLU``); returns the old setting."""
    return _FUSED_GLU.set(enabled)


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


def silu_glu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` on (S, 2I) concatenated halves: one fused Triton kernel each way on CUDA, eager elsewhere."""
    if fused_glu_available(gate_up):
        return _FusedSwiGLU.apply(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _silu_act(module: nn.Module) -> bool:
    """The config's ``hidden_act`` picks the act of transformers' default gate, so the module's act decides."""
    act = getattr(module, "act_fn", None)
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def _act_glu(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    return silu_glu(gate_up) if _silu_act(module) else experts_gate(module, gate_up)


@dataclass(frozen=True)
class Gate:
    """One gate kind of the family record: ``apply(module, gate_up)`` the (S, 2I) -> (S, I) activation of
    ``sync_free`` (fused on CUDA where ``fused(module)``); ``apply_with_bias(module, gate_up, expert_ids)`` adds each
    row's expert bias inside the fused kernel (None: the bias is added before ``apply``)."""

    apply: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    fused: Callable[[nn.Module], bool]
    apply_with_bias: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None


GATES: dict[str, Gate] = {
    # GPT-OSS: interleaved gate/up, clamped at ``limit``; the fused kernel reads the expert bias in place
    "gpt_oss_glu": Gate(apply=lambda m, gate_up: gpt_oss_glu(gate_up, m.alpha, m.limit),
                        fused=lambda m: True,
                        apply_with_bias=lambda m, gate_up, ids: gpt_oss_glu(gate_up, m.alpha, m.limit,
                                                                            bias=m.gate_up_proj_bias,
                                                                            expert_ids=ids)),
    # transformers' default act_fn(gate) * up on concatenated halves (Qwen3-MoE, Mixtral): fused when the act is SiLU
    "act_glu": Gate(apply=_act_glu, fused=_silu_act),
}


__all__ = ["GATES", "Gate", "gpt_oss_glu", "eager_gpt_oss_glu", "fused_glu_available", "set_fused_glu", "silu_glu"]
