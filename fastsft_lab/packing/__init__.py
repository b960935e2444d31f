"""Optimization 1: packed-sequence attention metadata built once per batch, zero host syncs inside the layers.

In packed SFT every attention layer needs the same metadata (segment starts ``cu_seqlens``, ``max_seqlen``, a
block-diagonal mask or a flex ``BlockMask``...). Common code rebuilds it in every layer from ``position_ids``,
paying device->host syncs each time (a ``nonzero``, a ``.max().item()``, a ``.tolist()``, a Python loop that
assembles a T x T mask). This package builds it once per batch on the host (:class:`PackedMetadata`) and hands it
to the layers as a keyword argument of the model call, the way transformers passes attention kwargs -- so it
survives PEFT wrappers, and gradient-checkpoint recompute reuses the same object instead of rebuilding it.

Usage::

    from fastsft_lab.packing import PackedCollator, enable_packed_attention

    enable_packed_attention(model, backend="sdpa")          # or "varlen", "flex", "segments", "xformers", "flash", "eager"
    batch = PackedCollator(max_tokens=4096, pad_token_id=0)(examples)
    loss = model(**batch).loss                               # batch holds packed_metadata=PackedMetadata(...)

Off the critical path: ``PackedCollator(..., prebuild="flex")`` builds the metadata's host side (cu_seqlens,
position ids, flex's block tables) in the DataLoader workers; ``DataLoader(num_workers=N, pin_memory=True)`` pins
it, and the step only queues non-blocking copies (:meth:`PackedMetadata.to`).

Layout: ``metadata.py`` (the host-built object), ``registry.py`` (one record per backend, the attention function
transformers calls), ``backends/<name>.py`` (per backend: the cached builder, the naive per-layer builder with the
syncs it pays, and the kernel, side by side), ``switch.py`` (on a live model), ``collator.py`` (TRL).

Each backend handles GQA, causal attention within each segment, per-layer sliding windows (transformers'
semantics: key kept iff q - W < k <= q) and GPT-OSS attention sinks -- which makes packed GPT-OSS training
correct, where stock transformers lets packed sequences attend to each other
(:func:`fastsft_lab.evidence.cross_contamination`).
"""

from . import backends  # noqa: F401  (registers every backend, once)
from .collator import PackedCollator, packed_inputs
from .metadata import BuildLog, DeviceTensors, PackedMetadata, normalize_row_lengths
from .registry import (Backend, BackendStatus, MaskSpec, attn_implementation_name, available_backends,
                       backend_names, get_backend, prebuild_metadata, prepare_metadata, register_backend)
from .switch import (PACKED, PackedAttention, check_packed_backend, disable_packed_attention, enable_packed_attention,
                     packed_attention_state, set_packed_metadata_cache)

BACKENDS = backend_names()
ATTN_NAMES = {name: get_backend(name).attn_name for name in BACKENDS}

__all__ = [
    "PackedMetadata", "DeviceTensors", "normalize_row_lengths", "PackedCollator", "packed_inputs", "Backend",
    "BackendStatus", "MaskSpec", "BACKENDS", "ATTN_NAMES", "BuildLog", "register_backend", "get_backend",
    "backend_names", "available_backends", "attn_implementation_name", "prepare_metadata", "prebuild_metadata",
    "enable_packed_attention", "disable_packed_attention", "set_packed_metadata_cache", "packed_attention_state",
    "check_packed_backend", "PACKED", "PackedAttention",
]
