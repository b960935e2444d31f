"""Packed attention one segment at a time: ``F.scaled_dot_product_attention`` on each sequence's own slice of the row,
causal and unmasked -- what running each sequence alone computes, as Unsloth's packed path does. On CUDA each call
gets SDPA's fastest kernel for its shape (cuDNN or flash); the cost is one call per segment and layer where varlen
makes one per layer.

* cached: :func:`segment_spans`, every segment's (row, start, length) from the host lengths, once per batch (no
  device object at all).
* naive: the same spans derived from ``position_ids`` in a layer, as per-segment code does: ``nonzero`` for the
  segment starts, ``tolist()`` to loop over them (2 host syncs per layer).
* kernel: :func:`segments_attention`. A segment longer than a sliding window, or a layer with GPT-OSS attention
  sinks, takes the dense backend's additive mask for that segment alone (the sinks as its virtual sink key): exact,
  at the memory of one segment's T x T mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..metadata import PackedMetadata, norm_device, note_build
from ..registry import Backend, BackendStatus, register_backend
from .common import repeat_kv, segment_lengths_naive
from .sdpa import additive, sdpa_attention


@dataclass(frozen=True)
class Segments:
    """Every segment of a packed batch as ``(row, start, length)`` host ints, rows in order; ``meta`` (the cached
    path) keeps the per-segment masks of windowed or sink layers for the rest of the batch."""

    spans: tuple[tuple[int, int, int], ...]
    meta: PackedMetadata | None = None


def segment_spans(meta: PackedMetadata) -> Segments:
    """The cached path: the spans of ``meta``'s rows (host ints, built once per batch)."""
    def build():
        spans = []
        for row, lengths in enumerate(meta.seq_lengths):
            start = 0
            for n in lengths:
                spans.append((row, start, n))
                start += n
        return Segments(tuple(spans), meta)

    return meta.cached(("segments",), build)


def naive_segment_spans(position_ids: torch.Tensor) -> Segments:
    """The spans rebuilt in a layer from ``position_ids``. Syncs per layer: 2 -- ``nonzero`` (the number of
    segments lives on the device) and ``tolist()`` (the lengths, to loop over)."""
    note_build("naive", "segments")
    rows, t = position_ids.shape
    spans, offset = [], 0
    for n in segment_lengths_naive(position_ids).tolist():
        row, start = divmod(offset, t)
        spans.append((row, start, n))
        offset += n
    return Segments(tuple(spans))


def _segment_mask(segments: Segments, n: int, device, dtype: torch.dtype, window: int | None,
                  sink: bool) -> torch.Tensor:
    """The additive (1, 1, n, L) mask of one causal segment of length ``n`` (band ``q - window < k <= q``; the sink
    layout of :func:`.sdpa.additive`), cached on the batch's metadata when there is one."""
    def build():
        i = torch.arange(n, device=device)
        allowed = i[:, None] >= i[None, :]
        if window is not None:
            allowed = allowed & (i[:, None] - i[None, :] < window)
        return additive(allowed[None, None], dtype, sink)

    if segments.meta is None:
        return build()
    return segments.meta.cached(("segment_mask", norm_device(device), dtype, n, window, sink), build)


def segments_attention(q, k, v, segments: Segments, *, scale: float, dropout: float = 0.0,
                       window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, T, D) queries, (B, Hkv, T, D) keys and values -> (B, T, H, D): each segment attends causally to
    itself, one SDPA call per segment."""
    groups = q.shape[1] // k.shape[1]
    rows: list[list[torch.Tensor]] = [[] for _ in range(q.shape[0])]
    for row, start, n in segments.spans:
        qs, ks, vs = (x[row:row + 1, :, start:start + n] for x in (q, k, v))
        if sinks is None and (window is None or n <= window):
            # the kv heads expanded, as transformers' SDPA path does: every fused kernel (cuDNN included) applies
            out = F.scaled_dot_product_attention(qs, repeat_kv(ks, groups), repeat_kv(vs, groups), is_causal=True,
                                                 dropout_p=dropout, scale=scale).transpose(1, 2)
        else:
            mask = _segment_mask(segments, n, q.device, q.dtype, window if window is not None and n > window
                                 else None, sinks is not None)
            out = sdpa_attention(qs, ks, vs, mask, scale=scale, dropout=dropout, sinks=sinks)
        rows[row].append(out)
    return torch.cat([torch.cat(parts, dim=1) for parts in rows], dim=0)


def _kernel(q, k, v, segments, *, scale, dropout, sinks, window, training):
    return segments_attention(q, k, v, segments, scale=scale, dropout=dropout, window=window, sinks=sinks), None


BACKEND = register_backend(Backend(
    name="segments", attn_name="fastsft_segments",
    cached=lambda meta, spec: segment_spans(meta),
    naive=lambda pos, spec: naive_segment_spans(pos),
    naive_syncs="2 (nonzero, tolist())",
    kernel=_kernel,
    status=lambda device: BackendStatus("segments", True, True, "F.scaled_dot_product_attention per segment "
                                                               "(cuDNN or flash on CUDA), no mask"),
    description="one SDPA call per segment, causal, no mask",
))

__all__ = ["Segments", "segment_spans", "naive_segment_spans", "segments_attention", "BACKEND"]
