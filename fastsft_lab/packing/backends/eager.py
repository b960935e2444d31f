"""The exact reference: matmul, the dense mask of :mod:`.sdpa`, softmax (with GPT-OSS's sink column, as its eager
attention computes it). T x T memory per head: for tests and comparisons, not for long rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import Backend, BackendStatus, register_backend
from .common import repeat_kv
from .sdpa import dense_mask, naive_dense_mask


def eager_attention(q, k, v, mask: torch.Tensor, *, scale: float, dropout: float = 0.0, training: bool = False,
                    sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """matmul + additive (B, 1, T, T) mask + softmax; sinks join the softmax as one more column (no value)."""
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    logits = torch.matmul(q, k.transpose(2, 3)) * scale + mask
    if sinks is None:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        b, h, t, _ = q.shape
        sink = sinks.reshape(1, h, 1, 1).expand(b, h, t, 1).to(logits.dtype)
        combined = torch.cat([logits, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    probs = F.dropout(probs, p=dropout, training=training).to(v.dtype)
    return torch.matmul(probs, v).transpose(1, 2), probs


def _kernel(q, k, v, mask, *, scale, dropout, sinks, window, training):
    return eager_attention(q, k, v, mask, scale=scale, dropout=dropout, training=training, sinks=sinks)


BACKEND = register_backend(Backend(
    name="eager", attn_name="fastsft_eager",
    # the sinks are a softmax column here, so the plain mask (no sink layout) serves every layer
    cached=lambda meta, spec: dense_mask(meta, spec.device, spec.dtype, spec.window),
    naive=lambda pos, spec: naive_dense_mask(pos, spec.dtype, spec.window),
    naive_syncs="4 (as sdpa)",
    kernel=_kernel,
    status=lambda device: BackendStatus("eager", True, True, "reference: matmul + softmax with the dense mask "
                                                             "(exact; T^2 memory per head)"),
    description="dense mask + matmul/softmax (reference)",
))

__all__ = ["eager_attention", "BACKEND"]
