"""Fused Triton kernels for the glue around the sync-free experts' grouped matmuls (CUDA; interpreted on CPU tensors
under ``TRITON_INTERPRET=1``). The eager expressions they replace are in :mod:`.grouping`, side by side.

* **combine** - ``out[t] = sum_j w[t, j] * y_sorted[inv[t * k + j]]``. Eager: an ``index_select`` of the (S, H) expert
  outputs into (T, k, H) and a batched (1 x k) @ (k x H) matmul per token; its backward is a batched outer product
  (cuBLAS picks a 32x32 WMMA kernel for it: ~1.8 ms at GPT-OSS-20B width and 8k tokens, a third of the grouped
  matmuls' own time) plus a batched GEMV and a second (S, H) gather. Fused: one kernel reads each sorted row once and
  writes (T, H); backward is one row-scaling kernel for the expert outputs and one row-dot kernel for the routing
  weights.
* **token gather backward** - the forward stays ``index_select`` (one read, one write); its backward
  ``grad_hidden[t] = sum_j grad_x[inv[t * k + j]]`` is the combine kernel without weights, instead of a gather into
  (S, H) and a sum over k.

Numerics follow the eager path: the routing weights are cast to the activations' dtype first (as the eager combine
does), products and sums accumulate in float32 and round once to the output dtype, like the matmul they replace.
The summation order over the k slots is fixed (deterministic, no atomics).
"""

from __future__ import annotations

import torch

from .._util import KernelSwitch, on_device_of, pow2_ceil

_FUSED_COMBINE = KernelSwitch("FASTSFT_MOE_FUSED_COMBINE")

try:  # Triton ships with CUDA builds of PyTorch
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_sum_kernel(src_ptr, idx_ptr, w_ptr, out_ptr, H, K: tl.constexpr, KP: tl.constexpr,
                           HAS_W: tl.constexpr, BLOCK_H: tl.constexpr):
        # out[t, cols] = sum_j (w[t, j] *) src[idx[t * K + j], cols]; one program per (t, column block)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cmask = cols < H
        j = tl.arange(0, KP)
        jmask = j < K
        rows = tl.load(idx_ptr + t * K + j, mask=jmask, other=0).to(tl.int64)
        tile = tl.load(src_ptr + rows[:, None] * H + cols[None, :], mask=jmask[:, None] & cmask[None, :],
                       other=0.0).to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + t * K + j, mask=jmask, other=0.0).to(tl.float32)
            tile = tile * w[:, None]
        acc = tl.sum(tile, axis=0)
        tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cmask)

    @triton.jit
    def _scale_rows_kernel(g_ptr, perm_ptr, w_ptr, out_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
        # out[s, cols] = w.flat[perm[s]] * g[perm[s] // K, cols]: the combine's gradient for the sorted rows
        s = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        cmask = cols < H
        p = tl.load(perm_ptr + s).to(tl.int64)
        t = p // K
        w = tl.load(w_ptr + p).to(tl.float32)
        g = tl.load(g_ptr + t * H + cols, mask=cmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + s * H + cols, (g * w).to(out_ptr.dtype.element_ty), mask=cmask)

    @triton.jit
    def _row_dots_kernel(g_ptr, src_ptr, idx_ptr, out_ptr, H, K: tl.constexpr, KP: tl.constexpr,
                         BLOCK_H: tl.constexpr):
        # out[t, j] = sum_h g[t, h] * src[idx[t * K + j], h]: the combine's gradient for the routing weights
        t = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, KP)
        jmask = j < K
        rows = tl.load(idx_ptr + t * K + j, mask=jmask, other=0).to(tl.int64)
        acc = tl.zeros((KP, BLOCK_H), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            cmask = cols < H
            g = tl.load(g_ptr + t * H + cols, mask=cmask, other=0.0).to(tl.float32)
            y = tl.load(src_ptr + rows[:, None] * H + cols[None, :], mask=jmask[:, None] & cmask[None, :],
                        other=0.0).to(tl.float32)
            acc += y * g[None, :]
        d = tl.sum(acc, axis=1)
        tl.store(out_ptr + t * K + j, d.to(out_ptr.dtype.element_ty), mask=jmask)

    _HAS_TRITON = True
except Exception:  # noqa: BLE001 - no triton (CPU wheels): the eager combine runs
    _HAS_TRITON = False

_BLOCK_H = 1024      # columns per program of the row kernels
_DOT_BLOCK_H = 256   # columns per iteration of the row-dot kernel (a (k, 256) float32 tile)


def fused_combine_available(t: torch.Tensor) -> bool:
    """Whether the fused combine and token-gather kernels run on ``t`` (CUDA + triton, and not switched off)."""
    return _FUSED_COMBINE.runs_on(t, _HAS_TRITON)


def set_fused_combine(enabled: bool) -> bool:
    """Turn the fused combine / token-gather kernels on or off (env ``FASTSFT_MOE_FUSED_COMBINE``); returns the old."""
    return _FUSED_COMBINE.set(enabled)


def gather_sum(src: torch.Tensor, index: torch.Tensor, k: int, weights: torch.Tensor | None = None) -> torch.Tensor:
    """(S, H) rows, (T * k,) row indices [, (T, k) weights] -> (T, H): ``sum_j (w[t, j] *) src[index[t * k + j]]``."""
    src = src.contiguous()
    num_tokens = index.numel() // k
    hidden = src.shape[1]
    out = src.new_empty(num_tokens, hidden)
    if num_tokens and hidden:
        w = weights.contiguous() if weights is not None else src
        with on_device_of(src):
            _gather_sum_kernel[(num_tokens, triton.cdiv(hidden, _BLOCK_H))](
                src, index, w, out, hidden, K=k, KP=pow2_ceil(k), HAS_W=weights is not None, BLOCK_H=_BLOCK_H)
    return out


class FusedCombine(torch.autograd.Function):
    """(S, H) expert outputs in sorted order, the permutation and its inverse, (T, k) routing weights (already in
    the outputs' dtype) -> (T, H). Saves the sorted outputs (no (T, k, H) gathered copy)."""

    @staticmethod
    def forward(ctx, y_sorted: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor):
        y_sorted, weights = y_sorted.contiguous(), weights.contiguous()
        out = gather_sum(y_sorted, inv, weights.shape[1], weights)
        ctx.save_for_backward(y_sorted, perm, inv, weights)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        y_sorted, perm, inv, weights = ctx.saved_tensors
        grad = grad.contiguous()
        num_tokens, k = weights.shape
        hidden = y_sorted.shape[1]
        grad_y = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_y = torch.empty_like(y_sorted)
            if perm.numel() and hidden:
                with on_device_of(grad):
                    _scale_rows_kernel[(perm.numel(), triton.cdiv(hidden, _BLOCK_H))](
                        grad, perm, weights, grad_y, hidden, K=k, BLOCK_H=_BLOCK_H)
        if ctx.needs_input_grad[3]:
            grad_w = torch.empty_like(weights)
            if num_tokens:
                with on_device_of(grad):
                    _row_dots_kernel[(num_tokens,)](grad, y_sorted, inv, grad_w, hidden, K=k, KP=pow2_ceil(k),
                                                    BLOCK_H=_DOT_BLOCK_H)
        return grad_y, None, None, grad_w


class FusedTokenGather(torch.autograd.Function):
    """(T, H) -> (S, H) rows in expert order (``index_select``); backward ``grad[t] = sum_j grad_x[inv[t * k + j]]``
    in one kernel."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inv)
        ctx.k = k
        return hidden.index_select(0, perm // k)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (inv,) = ctx.saved_tensors
        return gather_sum(grad, inv, ctx.k), None, None, None


__all__ = ["FusedCombine", "FusedTokenGather", "gather_sum", "fused_combine_available", "set_fused_combine"]
