"""Pieces several packed-attention backends share."""

from __future__ import annotations

import contextlib
import logging

import torch


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, T, D) -> (B, Hkv * groups, T, D), query head h reading kv head h // groups (transformers' order)."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


def segment_lengths_naive(position_ids: torch.Tensor) -> torch.Tensor:
    """Segment lengths from ``position_ids`` as per-layer code derives them: ``nonzero`` (1 sync: the number of
    segments lives on the device)."""
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().view(-1)
    ends = torch.cat([starts[1:], torch.tensor([flat.numel()], device=flat.device)])
    return ends - starts


@contextlib.contextmanager
def quiet_logger(name: str):
    """Silence a library's logger below ERROR (xFormers logs a multi-line warning when its extensions do not
    load; the backend reports the reason itself)."""
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)
