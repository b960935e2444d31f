"""Packed attention with a dense block-diagonal mask and ``F.scaled_dot_product_attention`` (runs anywhere).

* cached: :func:`dense_mask`, the additive (rows, 1, T, T) mask built once per batch from the segment ids
  (float, not bool: SDPA turns a bool mask into a float one in every call, in every layer; this one is converted
  once).
* naive: :func:`naive_dense_mask`, the same mask rebuilt in every layer, faithful to Unsloth's pre-cache
  ``utils/packing.py`` builders: 4 host syncs and a per-segment Python loop per layer.
* kernel: :func:`sdpa_attention`. GPT-OSS attention sinks enter as a virtual "sink key" per head (an extra head-dim
  coordinate: q' = [q, 1], k' = [k, 0], sink key [0, sink/scale], value 0), always visible: exact, and autograd
  differentiates it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..._util import round_up
from ..metadata import PackedMetadata, norm_device, norm_window, note_build
from ..registry import Backend, BackendStatus, register_backend
from .common import repeat_kv, segment_lengths_naive


def allowed_from_ids(ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean (rows, 1, T, T): key kept iff same segment id and ``q - window < k <= q``."""
    rows, t = ids.shape
    i = torch.arange(t, device=ids.device)
    causal = i[:, None] >= i[None, :]                        # (T, T): k <= q
    if window is not None:
        causal = causal & (i[:, None] - i[None, :] < window)  # q - W < k
    same = ids[:, :, None] == ids[:, None, :]               # (rows, T, T)
    return (same & causal)[:, None]                          # (rows, 1, T, T)


def additive(allowed: torch.Tensor, dtype: torch.dtype, sink: bool) -> torch.Tensor:
    """0 where allowed, -inf elsewhere; with ``sink`` the layout :func:`sdpa_attention` takes (see there)."""
    rows, _, t, _ = allowed.shape
    if not sink:
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, -math.inf)
    width = round_up(t + 1, 8)
    mask = torch.full((rows, 1, t, width), -math.inf, dtype=dtype, device=allowed.device)
    mask[..., 0] = 0.0                                       # the sink key is always visible
    mask[..., 1:t + 1].masked_fill_(allowed, 0.0)
    return mask


def allowed(meta: PackedMetadata, device, window: int | None = None) -> torch.Tensor:
    """Boolean (rows, 1, T, T) mask of ``meta``'s rows: key kept iff same segment and ``q - window < k <= q``."""
    ids = meta.tensors(device).seq_ids.view(meta.shape)
    return allowed_from_ids(ids, norm_window(window, meta.row_tokens))


def dense_mask(meta: PackedMetadata, device, dtype: torch.dtype, window: int | None = None, *,
               sink: bool = False) -> torch.Tensor:
    """The cached path: additive float mask (rows, 1, T, L) of ``meta``'s rows, built once per (device, dtype,
    window, sink) and then served from ``meta``'s cache.

    ``sink=True`` gives the layout of :func:`sdpa_attention` with sinks: one always-visible column first (the
    virtual sink key), then the T keys, then masked padding columns up to a multiple of 8 (aligned rows for the
    memory-efficient kernel).
    """
    window = norm_window(window, meta.row_tokens)
    device = norm_device(device)

    def build():
        ids = meta.tensors(device).seq_ids.view(meta.shape)
        return additive(allowed_from_ids(ids, window), dtype, sink)

    return meta.cached(("dense_sink" if sink else "dense", device, dtype, window), build)


def naive_dense_mask(position_ids: torch.Tensor, dtype: torch.dtype, window: int | None = None, *,
                     sink: bool = False) -> torch.Tensor:
    """The additive mask rebuilt in a layer, faithful to Unsloth's pre-cache ``utils/packing.py`` builders.

    Syncs per layer: 4 -- segment starts by ``nonzero`` (1), ``max().item()`` of the lengths (its
    ``get_packed_info``) (2), ``sum().item()`` for the mask size (3), ``tolist()`` to loop over the lengths (4);
    then a Python loop fills the T x T mask block by block (~6 small kernels per segment, per layer).
    """
    note_build("naive", "dense")
    rows, t = position_ids.shape
    device = position_ids.device
    lengths = segment_lengths_naive(position_ids)            # sync 1
    _max_seqlen = int(lengths.max().item())                  # sync 2 (kept: per-layer code computes it)
    total = int(lengths.sum().item())                        # sync 3
    if total != rows * t:
        raise ValueError(f"position_ids segments cover {total} tokens, expected {rows * t}")
    width = round_up(t + 1, 8) if sink else t
    off = 1 if sink else 0
    mask = torch.full((rows, 1, t, width), -math.inf, dtype=dtype, device=device)
    if sink:
        mask[..., 0] = 0.0
    offset = 0
    for length in lengths.tolist():                          # sync 4
        row, start = divmod(offset, t)
        block = torch.zeros((length, length), dtype=dtype, device=device)
        upper = torch.triu(torch.ones((length, length), device=device), diagonal=1).bool()
        block = block.masked_fill(upper, -math.inf)
        if window is not None and length > window:
            idx = torch.arange(length, device=device)
            block = block.masked_fill((idx[:, None] - idx[None, :]) >= window, -math.inf)
        mask[row, 0, start:start + length, off + start:off + start + length] = block
        offset += length
    return mask


def sdpa_attention(q, k, v, mask: torch.Tensor, *, scale: float, dropout: float = 0.0,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA with a dense additive mask. ``mask`` is (B, 1, T, T), or the sink layout of ``dense_mask(sink=True)``."""
    groups = q.shape[1] // k.shape[1]
    # A mask rules out SDPA's native GQA on CUDA (the memory-efficient kernel would fall back to math), so the
    # kv heads are expanded, as transformers does.
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    if sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
        return out.transpose(1, 2)
    b, h, t, d = q.shape
    width = mask.shape[-1]
    dp = round_up(d + 1, 8)  # one more coordinate for the sink, padded for aligned kernels
    qx = torch.cat([q, q.new_ones(b, h, t, 1), q.new_zeros(b, h, t, dp - d - 1)], dim=-1)
    sink_col = (sinks.to(q.dtype) / scale).view(1, h, 1, 1).expand(b, h, 1, 1)
    sink_key = torch.cat([k.new_zeros(b, h, 1, d), sink_col, k.new_zeros(b, h, 1, dp - d - 1)], dim=-1)
    kx = torch.cat([sink_key, F.pad(k, (0, dp - d)), k.new_zeros(b, h, width - t - 1, dp)], dim=2)
    vx = torch.cat([v.new_zeros(b, h, 1, dp), F.pad(v, (0, dp - d)), v.new_zeros(b, h, width - t - 1, dp)], dim=2)
    out = F.scaled_dot_product_attention(qx, kx, vx, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out[..., :d].transpose(1, 2)


def _kernel(q, k, v, mask, *, scale, dropout, sinks, window, training):
    return sdpa_attention(q, k, v, mask, scale=scale, dropout=dropout, sinks=sinks), None


BACKEND = register_backend(Backend(
    name="sdpa", attn_name="fastsft_dense",
    cached=lambda meta, spec: dense_mask(meta, spec.device, spec.dtype, spec.window, sink=spec.sink),
    naive=lambda pos, spec: naive_dense_mask(pos, spec.dtype, spec.window, sink=spec.sink),
    naive_syncs="4 (nonzero, max().item(), sum().item(), tolist()) + a per-segment Python loop",
    kernel=_kernel,
    status=lambda device: BackendStatus("sdpa", True, True, "F.scaled_dot_product_attention with the cached "
                                                           "dense mask"),
    description="dense block-diagonal mask + SDPA",
))

__all__ = ["allowed", "dense_mask", "naive_dense_mask", "sdpa_attention", "allowed_from_ids", "additive", "BACKEND"]
