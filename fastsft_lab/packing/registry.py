"""One registry of packed-attention backends, and the attention function transformers calls for all of them.

A backend is one record (:class:`Backend`): the name it is registered under in transformers' ``AttentionInterface``,
how the cached path builds its metadata object once per batch, how the naive path rebuilds it in every layer
(and which host syncs that costs), the kernel, and where it runs. Each backend lives in one file of
``fastsft_lab/packing/backends/`` and calls :func:`register_backend` once, at import; adding a backend is one such
file and one line in ``backends/__init__.py``. :func:`packed_attention` is the whole dispatch.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .metadata import PackedMetadata, norm_window


@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend runs on a device: ``available`` (forward), ``training`` (backward too), and why.

    Unpacks as ``available, reason = status`` (what ``python -m fastsft_lab info`` prints).
    """

    name: str
    available: bool
    training: bool
    reason: str

    def __iter__(self):
        return iter((self.available, self.reason))


@dataclass(frozen=True)
class MaskSpec:
    """What a layer's metadata object depends on besides the batch: device, dtype, window, sink layout."""

    device: torch.device
    dtype: torch.dtype
    window: int | None     # normalised: None when it covers the whole row
    sink: bool = False     # the layer has attention sinks (GPT-OSS): some backends build another layout


@dataclass(frozen=True)
class Backend:
    """One packed-attention backend.

    Attributes:
        name: the user-facing name (``"sdpa"``, ``"varlen"``, ...).
        attn_name: its name in transformers' ``AttentionInterface``. transformers reads meaning into substrings:
            "sdpa" is refused by models without SDPA support (GPT-OSS), "flash" is treated as a flash-attention
            request, "flex_attention" runs flex checks; so these names avoid them.
        cached: ``(meta, spec) -> obj``: the fast path, built from the host lengths once per batch (cache it on
            ``meta`` with :meth:`PackedMetadata.cached`).
        naive: ``(position_ids, spec) -> obj``: the same object rebuilt from ``position_ids`` in a layer, as
            per-layer code does (the "before").
        naive_syncs: the host syncs ``naive`` pays per layer, in words.
        kernel: ``(q, k, v, obj, *, scale, dropout, sinks, window, training) -> (out (B, T, H, D), weights)``.
        status: ``(device) -> BackendStatus``.
        description: one line for tables.
        host: ``(meta, window) -> part``: the host-side part of ``cached`` that follows from the lengths alone (CPU
            tensors; see :meth:`PackedMetadata.put_host`), built by :func:`prebuild_metadata` off the critical path
            (a DataLoader worker); ``cached`` then only copies and assembles it. None: the shared cu_seqlens /
            seq_ids / position_ids are all the host side there is (sdpa, eager: their T x T masks are built on the
            device from seq_ids, since shipping 2 T^2 bytes per batch would cost more than building them).
    """

    name: str
    attn_name: str
    cached: Callable[[PackedMetadata, MaskSpec], Any]
    naive: Callable[[torch.Tensor, MaskSpec], Any]
    naive_syncs: str
    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    status: Callable[[torch.device], BackendStatus]
    description: str = ""
    host: Callable[[PackedMetadata, int | None], Any] | None = None


_BACKENDS: dict[str, Backend] = {}

def register_backend(backend: Backend) -> Backend:
    """Add ``backend`` to the registry and to transformers' ``AttentionInterface`` (once per backend)."""
    from transformers import AttentionInterface

    if backend.name in _BACKENDS:
        raise ValueError(f"packed-attention backend {backend.name!r} is registered already")
    _BACKENDS[backend.name] = backend
    def attention(module, query, key, value, attention_mask, **kwargs):
        return packed_attention(backend.name, module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"{backend.attn_name}_attention"
    attention.__doc__ = f"Packed attention, backend {backend.name!r} (fastsft_lab.packing)."
    # Eager under torch.compile: a compiled decoder layer (nn.Module.compile, a regional compile) breaks its graph
    # here instead of specialising on each batch's segment count and longest segment (a recompile per batch).
    AttentionInterface.register(backend.attn_name, torch.compiler.disable(attention))
    _status.cache_clear()
    return backend


def backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def get_backend(name: str) -> Backend:
    """The registered backend ``name``; a one-line error lists the known ones."""
    try:
        return _BACKENDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown packed-attention backend {name!r}; known: {', '.join(_BACKENDS)}") from None


def attn_implementation_name(backend: str) -> str:
    """The name ``backend`` is registered under in transformers' ``AttentionInterface`` (e.g. sdpa ->
    ``fastsft_dense``); usable as ``attn_implementation=`` in ``from_pretrained``."""
    return get_backend(backend).attn_name


@functools.lru_cache(maxsize=8)
def _status(device_type: str) -> dict[str, BackendStatus]:
    device = torch.device(device_type)
    return {name: b.status(device) for name, b in _BACKENDS.items()}


def available_backends(device: torch.device | str | None = None) -> dict[str, BackendStatus]:
    """Which packed-attention backends run on ``device`` (default: CUDA if present), with the reason for each."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return dict(_status(torch.device(device).type))


def prebuild_backends(backends) -> tuple[str, ...]:
    """``backends`` (a name or names) as a tuple of registered names; a one-line ``ValueError`` lists the valid
    ones."""
    names = (backends,) if isinstance(backends, str) else backends
    try:
        names = tuple(names)
    except TypeError:
        names = (backends,)
    bad = [n for n in names if n not in _BACKENDS]
    if bad or not names:
        raise ValueError(f"prebuild takes packed-attention backend names, got {backends!r}; valid: "
                         f"{', '.join(_BACKENDS)}")
    return tuple(dict.fromkeys(names))


def prebuild_metadata(meta: PackedMetadata, backends, *, windows=(None,)) -> PackedMetadata:
    """Build on the host everything ``backends`` will need from ``meta`` (no device, no sync); returns ``meta``.

    The shared tensors (cu_seqlens, seq_ids, position_ids) and each backend's :attr:`Backend.host` part per sliding
    window in ``windows`` (None: full attention; GPT-OSS: ``(None, config.sliding_window)``), as CPU tensors that
    pickle with the batch. Meant for DataLoader workers (``PackedCollator(prebuild=...)``): the step then only
    copies them to the device (:meth:`PackedMetadata.to`). A window that was not prebuilt is built lazily, in the
    step, as without prebuilding: never a wrong mask, only a slower one.
    """
    names = prebuild_backends(backends)
    ws = tuple(dict.fromkeys(norm_window(w, meta.row_tokens) for w in windows))
    meta.build_host_tensors()
    for name in names:
        b = _BACKENDS[name]
        if b.host is None:
            continue
        for w in ws:
            if (name, w) not in meta.prebuilt:
                part = b.host(meta, w)
                if part is not None:
                    meta.put_host((name, w), part)
    return meta


def prepare_metadata(meta: PackedMetadata, device, *, backend: str, dtype: torch.dtype = torch.float32,
                     windows=(None,), sink: bool = False) -> PackedMetadata:
    """Build every object ``backend`` will ask ``meta`` for (the oracle does this outside the timed region)."""
    b = get_backend(backend)
    meta.tensors(device)
    for w in windows:
        b.cached(meta, MaskSpec(torch.device(device), dtype, norm_window(w, meta.row_tokens), sink))
    return meta


# --- the attention function transformers calls --------------------------------------------------------------------
_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=4)


# Keyword arguments transformers' layers pass that change nothing here (bookkeeping of the model call, or the
# padding-free collators' packing kwargs -- TRL's DataCollatorForLanguageModeling(padding_free=True), transformers'
# DataCollatorWithFlattening -- which describe the same segments as packed_metadata / position_ids; seq_idx is
# checked against position_ids once per batch by the packing switch).
IGNORED_KWARGS = frozenset({"use_cache", "output_attentions", "output_hidden_states", "output_router_logits",
                            "return_dict", "cache_position", "num_items_in_batch", "cu_seq_lens_q", "cu_seq_lens_k",
                            "max_length_q", "max_length_k", "seq_idx", "position_embeddings"})


def check_attention_kwargs(module: nn.Module, kwargs: dict) -> None:
    """Refuse what the packed kernels do not implement instead of computing without it (no silent wrong answer)."""
    softcap = kwargs.get("softcap")
    if softcap is not None:
        raise NotImplementedError(f"{type(module).__name__} asks for attention logit softcapping (softcap={softcap}), "
                                  "which fastsft_lab's packed-attention kernels do not implement: use the model's own "
                                  "attention (disable_packed_attention)")
    if kwargs.get("is_causal", True) is False:
        raise NotImplementedError(f"{type(module).__name__} asks for non-causal attention (is_causal=False); packed "
                                  "attention is causal within each sequence")
    unknown = sorted(k for k, v in kwargs.items() if k not in IGNORED_KWARGS and k not in ("softcap", "is_causal")
                     and v is not None)
    if unknown:
        raise NotImplementedError(f"{type(module).__name__} passes attention argument(s) {', '.join(unknown)} that "
                                  "fastsft_lab's packed attention does not know; refusing rather than ignoring them "
                                  "(known and ignored: " + ", ".join(sorted(IGNORED_KWARGS)) + ")")


class _RebuildInEveryLayer:
    """The ``packed_metadata`` of a naive step: each layer rebuilds its metadata from ``position_ids``, by design."""

    def __repr__(self) -> str:
        return "REBUILD_IN_EVERY_LAYER"


REBUILD_IN_EVERY_LAYER = _RebuildInEveryLayer()


def packed_attention(name: str, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     sliding_window: int | None = None, s_aux: torch.Tensor | None = None,
                     packed_metadata: PackedMetadata | None = None, position_ids: torch.Tensor | None = None,
                     **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One attention layer over packed rows. query (B, H, T, D), key/value (B, Hkv, T, D) -> (B, T, H, D)."""
    backend = get_backend(name)
    check_attention_kwargs(module, kwargs)
    b, h, t, d = query.shape
    if key.shape[2] != t:
        # enable_packed_attention routes generate() and calls with a KV cache to the model's own attention
        raise RuntimeError(f"packed attention is for training and prefill: got {t} queries but {key.shape[2]} keys "
                           "(a KV cache that bypassed enable_packed_attention's routing). Call "
                           "disable_packed_attention(model) for this call.")
    cache = packed_metadata is not REBUILD_IN_EVERY_LAYER     # the switch's naive mode marks the step so
    if packed_metadata is REBUILD_IN_EVERY_LAYER:
        packed_metadata = None
    elif packed_metadata is None:
        # Only without enable_packed_attention (the name set by hand): nothing built the metadata for this step.
        _warn_once("no-meta", "fastsft packed attention got no packed_metadata: rebuilding it in every layer (the "
                              "naive path). Call enable_packed_attention(model) or pass packed_metadata=.")
        cache = False
    spec = MaskSpec(query.device, query.dtype, norm_window(sliding_window, t), s_aux is not None)
    if cache:
        packed_metadata.check_shape(b, t)
        obj = backend.cached(packed_metadata, spec)
    elif position_ids is None:
        raise ValueError("the naive packed path rebuilds the metadata from position_ids, and the layer got none")
    else:
        obj = backend.naive(position_ids.expand(b, t), spec)
    return backend.kernel(query, key, value, obj, scale=float(scaling) if scaling is not None else d ** -0.5,
                          dropout=dropout if module.training else 0.0, sinks=s_aux, window=spec.window,
                          training=module.training)


__all__ = ["Backend", "BackendStatus", "IGNORED_KWARGS", "REBUILD_IN_EVERY_LAYER", "check_attention_kwargs", "MaskSpec", "register_backend", "get_backend", "backend_names",
           "attn_implementation_name", "available_backends", "prepare_metadata", "prebuild_metadata",
           "prebuild_backends", "packed_attention"]
