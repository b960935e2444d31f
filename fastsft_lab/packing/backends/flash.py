"""Packed attention with the ``flash_attn`` package's varlen kernel (only where that package is installed).

Metadata as :mod:`.varlen` (cached ``cu_seqlens``/``max_seqlen``, or transformers' per-layer derivation); no
attention sinks (use the varlen backend, torch's own flash kernel, for GPT-OSS).
"""

from __future__ import annotations

import torch

from ..registry import Backend, BackendStatus, register_backend
from .varlen import naive_varlen_args, varlen_args


def flash_attn_attention(q, k, v, cu: torch.Tensor, max_len: int, *, scale: float, window: int | None = None,
                         dropout: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """``flash_attn.flash_attn_varlen_func`` over the rows flattened to (B*T, H, D)."""
    if sinks is not None:
        raise NotImplementedError("the flash backend (flash_attn package) does not take attention sinks here: "
                                  "use varlen (torch's flash kernel, sinks supported)")
    from flash_attn import flash_attn_varlen_func

    b, h, t, d = q.shape
    hkv = k.shape[1]
    out = flash_attn_varlen_func(
        q.transpose(1, 2).reshape(b * t, h, d), k.transpose(1, 2).reshape(b * t, hkv, d),
        v.transpose(1, 2).reshape(b * t, hkv, d), cu, cu, int(max_len), int(max_len), dropout_p=dropout,
        softmax_scale=scale, causal=True, window_size=(-1, -1) if window is None else (window - 1, 0))
    return out.view(b, t, h, d)


def _kernel(q, k, v, args, *, scale, dropout, sinks, window, training):
    cu, max_len = args
    return flash_attn_attention(q, k, v, cu, max_len, scale=scale, window=window, dropout=dropout, sinks=sinks), None


def _status(device: torch.device) -> BackendStatus:
    try:
        import flash_attn  # noqa: F401
    except Exception:  # noqa: BLE001
        return BackendStatus("flash", False, False, "the flash_attn package is not installed")
    ok = device.type == "cuda"
    return BackendStatus("flash", ok, ok, "flash_attn varlen kernel" if ok else "flash_attn needs CUDA")


BACKEND = register_backend(Backend(
    name="flash", attn_name="fastsft_fa2",
    cached=lambda meta, spec: varlen_args(meta, spec.device),
    naive=lambda pos, spec: naive_varlen_args(pos),
    naive_syncs="3 (as varlen)",
    kernel=_kernel, status=_status,
    description="flash_attn package varlen kernel",
))

__all__ = ["flash_attn_attention", "BACKEND"]
