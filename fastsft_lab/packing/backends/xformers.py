"""Packed attention with xFormers' memory-efficient kernel and a ``BlockDiagonalCausalMask`` (optional package).

* cached: :func:`xformers_bias`, the bias over all segments (rows concatenated), local if windowed.
* naive: :func:`naive_xformers_bias`, rebuilt in the layer: ``nonzero`` and ``tolist()`` (2 syncs per layer).
* kernel: :func:`xformers_attention` (no attention sinks).
* prebuilt (:func:`host_xformers_bias`, e.g. in a DataLoader worker): the bias built on the CPU; in the step
  xFormers' own ``.to(device)`` copies its one small ``seqstart`` tensor.

Where the xformers wheel imports but its CUDA extensions do not load (built for another torch), the masks still
build and :func:`available_backends` says why the kernel cannot run.
"""

from __future__ import annotations

import torch

from ..._compat import xformers_has_cpp_library
from ..metadata import PackedMetadata, norm_device, norm_window, note_build
from ..registry import Backend, BackendStatus, register_backend
from .common import quiet_logger, segment_lengths_naive


def _bias(lengths: list[int], window: int | None, device: torch.device):
    with quiet_logger("xformers"):
        from xformers.ops.fmha.attn_bias import BlockDiagonalCausalMask

    bias = BlockDiagonalCausalMask.from_seqlens(lengths)
    if window is not None:
        # xFormers' local window keeps q - W < k <= q: the same semantics as transformers' sliding window.
        bias = bias.make_local_attention(window)
    if device.type != "cpu" and hasattr(bias, "to"):
        bias = bias.to(device)
    return bias


def host_xformers_bias(meta: PackedMetadata, window: int | None):
    """The bias of :func:`xformers_bias` built on the CPU (a DataLoader worker must not touch CUDA, and xFormers
    builds on CUDA by default); None where xformers is missing or too old to take ``device=``."""
    try:
        with quiet_logger("xformers"):
            from xformers.ops.fmha.attn_bias import BlockDiagonalCausalMask
        bias = BlockDiagonalCausalMask.from_seqlens(list(meta.lengths), device=torch.device("cpu"))
    except (ImportError, TypeError):
        return None
    window = norm_window(window, meta.row_tokens)
    return bias if window is None else bias.make_local_attention(window)


def xformers_bias(meta: PackedMetadata, device, window: int | None = None):
    """The cached path: an xFormers ``BlockDiagonalCausalMask`` over all of ``meta``'s segments (moved from the
    prebuilt CPU bias when ``meta`` has one)."""
    window = norm_window(window, meta.row_tokens)
    device = norm_device(device)

    def build():
        prebuilt = meta.host_part(("xformers", window), device)
        return prebuilt if prebuilt is not None else _bias(list(meta.lengths), window, device)

    return meta.cached(("xformers", device, window), build)


def naive_xformers_bias(position_ids: torch.Tensor, window: int | None = None):
    """An xFormers bias rebuilt in the layer: ``nonzero`` (1) and ``tolist()`` (2) syncs per layer."""
    note_build("naive", "xformers")
    lengths = segment_lengths_naive(position_ids).tolist()
    return _bias(lengths, norm_window(window, position_ids.shape[1]), position_ids.device)


def xformers_attention(q, k, v, bias, *, scale: float, dropout: float = 0.0,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """xFormers memory-efficient attention with a ``BlockDiagonalCausalMask`` over the flattened rows."""
    if sinks is not None:
        raise NotImplementedError("the xformers backend does not implement attention sinks (GPT-OSS): "
                                  "use sdpa, varlen or flex")
    import xformers.ops as xops

    b, h, t, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    # BMGHK layout: G groups of kv heads, each shared by H/G query heads (query head h -> kv head h // g).
    qx = q.transpose(1, 2).reshape(1, b * t, hkv, g, d)
    kx = k.transpose(1, 2).reshape(1, b * t, hkv, 1, d).expand(1, b * t, hkv, g, d)
    vx = v.transpose(1, 2).reshape(1, b * t, hkv, 1, d).expand(1, b * t, hkv, g, d)
    try:
        out = xops.memory_efficient_attention(qx, kx, vx, attn_bias=bias, p=dropout, scale=scale)
    except NotImplementedError as e:
        raise RuntimeError(f"xFormers is installed but none of its attention kernels runs here: {_first_line(e)}; "
                           "use another backend (varlen, sdpa)") from e
    return out.reshape(b, t, h, d)


def _first_line(e: BaseException) -> str:
    """The first line of an error that says something (xFormers' messages start with a line ending in ':')."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    text = lines[0]
    for extra in lines[1:]:
        if not text.endswith(":"):
            break
        text = f"{text} {extra}"
    return text[:300]


def _kernel(q, k, v, bias, *, scale, dropout, sinks, window, training):
    return xformers_attention(q, k, v, bias, scale=scale, dropout=dropout, sinks=sinks), None


def _status(device: torch.device) -> BackendStatus:
    try:
        with quiet_logger("xformers"):
            import xformers
            import xformers.ops as xops
            from xformers.ops.fmha.attn_bias import BlockDiagonalCausalMask
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        return BackendStatus("xformers", False, False, f"xformers does not import: {type(e).__name__}: {e}")
    if not xformers_has_cpp_library(xformers) and device.type == "cuda":
        return BackendStatus("xformers", False, False, "xformers imports, but its C++/CUDA extensions do not load "
                                                       "(built for another torch/CUDA version): masks build, "
                                                       "attention cannot run")
    try:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        x = torch.zeros(1, 4, 1, 8, device=device, dtype=dtype)
        xops.memory_efficient_attention(x, x, x, attn_bias=BlockDiagonalCausalMask.from_seqlens([2, 2]))
    except Exception as e:  # noqa: BLE001
        return BackendStatus("xformers", False, False, f"xformers imports but its kernels do not run on "
                                                        f"{device.type}: {_first_line(e)}")
    return BackendStatus("xformers", True, True, "xFormers memory-efficient attention, BlockDiagonalCausalMask")


BACKEND = register_backend(Backend(
    name="xformers", attn_name="fastsft_xformers",
    cached=lambda meta, spec: xformers_bias(meta, spec.device, spec.window),
    naive=lambda pos, spec: naive_xformers_bias(pos, spec.window),
    naive_syncs="2 (nonzero, tolist())",
    kernel=_kernel, status=_status,
    description="xFormers memory-efficient attention + BlockDiagonalCausalMask",
    host=host_xformers_bias,
))

__all__ = ["xformers_bias", "host_xformers_bias", "naive_xformers_bias", "xformers_attention", "BACKEND"]
