"""Packed attention with ``cu_seqlens``: torch's flash varlen kernel on CUDA, a reference kernel on the CPU.

* cached: :func:`varlen_args`, ``(cu_seqlens on the device, max_seqlen as a host int)`` from the host lengths.
* naive: :func:`naive_varlen_args`, exactly what transformers' flash-attention packed path derives in every layer
  from ``position_ids`` (its own functions): 3 host syncs per layer.
* kernel: :func:`varlen_attention` over the rows flattened to (B*T, H, D). GPT-OSS attention sinks: a
  ``torch.autograd.Function`` rescales the output by ``sigmoid(lse - sink)``; its backward runs the kernel's own
  backward with (out', lse' = logaddexp(lse, sink)), which gives exact dq, dk, dv, and
  ``d sink_h = -sum_i exp(sink_h - lse'_i) * rowsum(dout_i * out'_i)``.
"""

from __future__ import annotations

import functools
import math

import torch

from ..._compat import assert_async, flash_attention_ops, flash_forward_arguments, flash_packed_helpers
from ..metadata import PackedMetadata, norm_device, note_build
from ..registry import Backend, BackendStatus, register_backend


def varlen_args(meta: PackedMetadata, device) -> tuple[torch.Tensor, int]:
    """The cached path: ``(cu_seqlens, max_seqlen)`` of ``meta``; the tensor is copied once per device."""
    return meta.tensors(norm_device(device)).cu_seqlens, meta.max_seqlen


def naive_varlen_args(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` exactly as transformers' flash-attention packed path derives them per layer.

    Faithful to ``modeling_flash_attention_utils`` (5.x), which every attention layer runs when it gets packed
    ``position_ids`` and no ``cu_seq_lens``; we call its own functions. Syncs per layer: 3 --
    its packed-sequence check returns a device bool that Python branches on (1), ``prepare_fa_kwargs_from_position_ids``
    calls ``nonzero`` whose output size lives on the device (2), and the kernel takes ``max_seqlen`` as a Python
    int, read back from the device (3).
    """
    is_packed_sequence, prepare_fa_kwargs_from_position_ids = flash_packed_helpers()

    note_build("naive", "varlen")
    flat = position_ids.reshape(1, -1)
    if not is_packed_sequence(flat, batch_size=1):  # sync 1
        n = flat.shape[1]
        return torch.tensor([0, n], dtype=torch.int32, device=flat.device), n
    (cu, _), (max_len, _) = prepare_fa_kwargs_from_position_ids(flat)  # sync 2 (nonzero)
    return cu, int(max_len)  # sync 3


# --- the kernels ----------------------------------------------------------------------------------------------------
def _flash_schema_kwargs() -> set[str]:
    return flash_forward_arguments()


@functools.lru_cache(maxsize=1)
def _flash_has_window() -> bool:
    return "window_size_left" in _flash_schema_kwargs()


def _flash_window(window: int | None) -> dict:
    if window is None:
        return {"window_size_left": -1, "window_size_right": -1} if _flash_has_window() else {}
    if not _flash_has_window():
        raise NotImplementedError("this torch build's flash kernel takes no window_size: sliding windows need "
                                  "torch >= 2.5 (use the sdpa or flex backend)")
    # transformers keeps q - W < k <= q: W - 1 keys to the left, none to the right (flash's inclusive convention).
    return {"window_size_left": window - 1, "window_size_right": 0}


class CudaFlashVarlen:
    """``aten._flash_attention_forward/backward`` on (N, H, D) rows with ``cu_seqlens`` (GQA native)."""

    name = "flash"

    @staticmethod
    def forward(q, k, v, cu, max_len, scale, window):
        flash_forward, _ = flash_attention_ops()
        out, lse, rng_state, unused, _ = flash_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale, **_flash_window(window))
        if lse.dim() == 2 and lse.shape[0] != q.shape[1]:  # some builds return (N, H)
            lse = lse.t()
        return out, lse.float().contiguous(), (rng_state, unused)

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu, max_len, scale, window, extra):
        rng_state, unused = extra
        _, flash_backward = flash_attention_ops()
        dq, dk, dv = flash_backward(
            dout.contiguous(), q, k, v, out, lse, cu, cu, max_len, max_len, 0.0, True, rng_state, unused,
            scale=scale, **_flash_window(window))
        return dq, dk, dv


class ReferenceVarlen:
    """The same contract as the flash kernel, in plain PyTorch (exact, O(N^2) memory): makes the varlen backend's
    plumbing -- cu_seqlens, max_seqlen, windows, GQA, the sink forward and backward formulas -- testable on a CPU.
    Its backward is flash's: recompute P = exp(S - lse) from the *given* lse, dS = P * (dP - rowsum(dO * O))."""

    name = "reference"

    @staticmethod
    def _logits(q, k, cu, scale, window):
        n, h, _ = q.shape
        groups = h // k.shape[1]
        kk = k.repeat_interleave(groups, dim=1)
        ids = torch.searchsorted(cu[1:].to(torch.long), torch.arange(n, device=q.device), right=True)
        i = torch.arange(n, device=q.device)
        allowed = (ids[:, None] == ids[None, :]) & (i[None, :] <= i[:, None])
        if window is not None:
            allowed = allowed & (i[:, None] - i[None, :] < window)
        s = torch.einsum("qhd,khd->hqk", q.float(), kk.float()) * scale
        return s.masked_fill(~allowed, -math.inf), groups

    @staticmethod
    def forward(q, k, v, cu, max_len, scale, window):
        # flash kernels size their tiles by max_seqlen: one below the longest segment drops its last tile
        assert_async((cu[1:] - cu[:-1]).max() <= max_len,
                            f"varlen max_seqlen={max_len} is below the longest segment")
        s, groups = ReferenceVarlen._logits(q, k, cu, scale, window)
        lse = torch.logsumexp(s, dim=-1)                                   # (H, N)
        p = torch.exp(s - lse[..., None])
        out = torch.einsum("hqk,khd->qhd", p, v.float().repeat_interleave(groups, dim=1))
        return out.to(q.dtype), lse, None

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu, max_len, scale, window, extra):
        s, groups = ReferenceVarlen._logits(q, k, cu, scale, window)
        n, hkv, d = k.shape
        vv = v.float().repeat_interleave(groups, dim=1)
        p = torch.exp(s - lse[..., None])                                  # (H, N, N)
        dout = dout.float()
        dp = torch.einsum("qhd,khd->hqk", dout, vv)
        delta = (dout * out.float()).sum(-1).t()                           # (H, N)
        ds = p * (dp - delta[..., None])
        dq = torch.einsum("hqk,khd->qhd", ds, k.float().repeat_interleave(groups, dim=1)) * scale
        dk = torch.einsum("hqk,qhd->khd", ds, q.float()) * scale
        dv = torch.einsum("hqk,qhd->khd", p, dout)
        dk = dk.view(n, hkv, groups, d).sum(2)
        dv = dv.view(n, hkv, groups, d).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cu, max_len, scale, window, kernel):
        out, lse, extra = kernel.forward(q, k, v, cu, max_len, scale, window)
        if sinks is not None:
            sink = sinks.float()[:, None]                                  # (H, 1)
            lse_sink = torch.logaddexp(lse, sink)
            out = (out.float() * torch.exp(lse - lse_sink).t()[..., None]).to(q.dtype)
            lse = lse_sink
        ctx.save_for_backward(q, k, v, out, lse, cu, sinks)
        ctx.meta = (max_len, scale, window, kernel, extra)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, sinks = ctx.saved_tensors
        max_len, scale, window, kernel, extra = ctx.meta
        # With (out', lse') the kernel's own backward is exact: the sink column has no value, so it only shifts
        # the row normaliser, and rowsum(dO * O') already accounts for it.
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, cu, max_len, scale, window, extra)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            delta = (dout.float() * out.float()).sum(-1).t()              # (H, N)
            dsinks = -(torch.exp(sinks.float()[:, None] - lse) * delta).sum(-1).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None, None


def varlen_kernel_for(device: torch.device):
    return CudaFlashVarlen if device.type == "cuda" else ReferenceVarlen


def varlen_attention(q, k, v, cu: torch.Tensor, max_len: int, *, scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None, kernel=None) -> torch.Tensor:
    """Varlen attention over the rows flattened to (B*T, H, D): each segment attends causally to itself."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    kernel = kernel or varlen_kernel_for(q.device)
    qf = q.transpose(1, 2).reshape(b * t, h, d)
    kf = k.transpose(1, 2).reshape(b * t, hkv, d)
    vf = v.transpose(1, 2).reshape(b * t, hkv, d)
    out = _VarlenAttention.apply(qf, kf, vf, sinks, cu, int(max_len), float(scale), window, kernel)
    return out.view(b, t, h, d)


def _kernel(q, k, v, args, *, scale, dropout, sinks, window, training):
    if dropout:
        raise NotImplementedError("the varlen backend runs without attention dropout: set attention_dropout=0, "
                                  "or use the sdpa backend")
    cu, max_len = args
    return varlen_attention(q, k, v, cu, max_len, scale=scale, window=window, sinks=sinks), None


def _status(device: torch.device) -> BackendStatus:
    if device.type != "cuda":
        return BackendStatus("varlen", True, True, "reference kernel on CPU (pure PyTorch, for tests: same plumbing "
                                                   "and sink formulas as the CUDA path)")
    ok = flash_attention_ops() is not None and torch.backends.cuda.is_flash_attention_available() \
        and torch.cuda.get_device_capability() >= (8, 0)
    return BackendStatus("varlen", ok, ok, "torch's flash varlen kernel (aten._flash_attention_forward)" if ok
                         else "torch's flash attention kernel needs a GPU of compute capability 8.0+ (Ampere)")


BACKEND = register_backend(Backend(
    name="varlen", attn_name="fastsft_varlen",
    cached=lambda meta, spec: varlen_args(meta, spec.device),
    naive=lambda pos, spec: naive_varlen_args(pos),
    naive_syncs="3 (bool(), nonzero, max_seqlen as int)",
    kernel=_kernel, status=_status,
    description="cu_seqlens + torch's flash varlen kernel",
))

__all__ = ["varlen_args", "naive_varlen_args", "varlen_attention", "varlen_kernel_for", "CudaFlashVarlen",
           "ReferenceVarlen", "BACKEND"]
