"""Packed attention on a live model: on (cached or naive metadata), switched between backends, and off again.

* :func:`enable_packed_attention` sets the model's attention implementation to a registered backend and adds one
  forward pre-hook on the decoder stack, which makes sure every step carries a :class:`PackedMetadata` (the
  collator's, or one recovered from ``position_ids`` with a single sync);
* :func:`set_packed_metadata_cache` toggles cached (0 syncs in the layers) and naive (every layer rebuilds its
  metadata from ``position_ids``, with the syncs per-layer code pays);
* :func:`disable_packed_attention` restores the exact original ``config._attn_implementation``.

Every switch returns :func:`fastsft_lab.state.state` of the model after the change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..models import base_model, decoder_layers, model_device
from ..model_state import ModelState, register_state_reader, state
from .metadata import PackedMetadata
from .registry import available_backends, get_backend


@dataclass
class _PackedState:
    backend: str
    cache: bool
    original_attn: Any
    hook: Any = None


def _inner_model(model: nn.Module) -> nn.Module:
    inner = base_model(model)
    return getattr(inner, "model", inner)


def _inject_metadata(state_: _PackedState):
    """Forward pre-hook on the decoder stack: the cached path needs one PackedMetadata per step."""

    def hook(module, args, kwargs):
        if not state_.cache:
            return None  # naive: each layer rebuilds from position_ids, by design
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        shape = tuple((ids if ids is not None else embeds).shape[:2])
        meta = kwargs.get("packed_metadata")
        if meta is not None:
            if not isinstance(meta, PackedMetadata):
                raise TypeError(f"packed_metadata must be a PackedMetadata, got {type(meta).__name__}")
            meta.check_shape(*shape)
            return None
        mask = kwargs.get("attention_mask")
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            raise ValueError("packed attention builds its own masks: pass packed_metadata or packed position_ids, "
                             "not a prepared 4-D/dict attention_mask")
        # One sync for the whole step (not one per layer): read position_ids (and the mask) back once.
        kwargs["packed_metadata"] = PackedMetadata.from_position_ids(kwargs.get("position_ids"), shape=shape,
                                                                     attention_mask=mask)
        return args, kwargs

    return hook


def check_packed_backend(model: nn.Module, backend: str) -> None:
    """Raise a one-line error if ``backend`` is unknown or cannot train on ``model``'s device."""
    get_backend(backend)
    status = available_backends(model_device(model))[backend]
    if not status.available:
        raise RuntimeError(f"packed-attention backend {backend!r} is not available here: {status.reason}")


def enable_packed_attention(model: nn.Module, backend: str = "sdpa", *, cache: bool = True,
                            check_available: bool = True) -> ModelState:
    """Run ``model``'s attention over packed rows with ``backend``; ``cache`` picks the cached or the naive path.

    Args:
        model: a transformers causal LM, PEFT-wrapped or not (Qwen3, GPT-OSS, Llama-like families).
        backend: ``"sdpa"`` (dense mask; runs anywhere), ``"varlen"`` (torch's flash varlen kernel on CUDA; a
            reference kernel on CPU), ``"flex"`` (flex attention + BlockMask), ``"xformers"``, ``"flash"``
            (the flash_attn package) or ``"eager"`` (the exact reference).
        cache: True builds the metadata once per batch (0 syncs in the layers); False rebuilds it in every layer
            from ``position_ids`` (the naive path, for comparison). Switch later with
            :func:`set_packed_metadata_cache`.
        check_available: raise if ``backend`` cannot run on the model's device (see :func:`available_backends`).

    Returns:
        The model's :class:`~fastsft_lab.state.ModelState`. Calling it again switches the backend;
        :func:`disable_packed_attention` restores the original.
    """
    name = get_backend(backend).attn_name
    if not isinstance(cache, bool):
        raise ValueError(f"cache must be True or False, got {cache!r}")
    if check_available:
        check_packed_backend(model, backend)
    base = base_model(model)
    st: _PackedState | None = getattr(base, "_fastsft_packed_state", None)
    if st is None:
        st = _PackedState(backend=backend, cache=cache, original_attn=base.config._attn_implementation)
        st.hook = _inner_model(model).register_forward_pre_hook(_inject_metadata(st), with_kwargs=True)
        base._fastsft_packed_state = st
        for layer in decoder_layers(model):
            attn = getattr(layer, "self_attn", None)
            if attn is not None:
                attn._fastsft_packed_state = st
    st.backend, st.cache = backend, cache
    if base.config._attn_implementation != name:
        base.set_attn_implementation(name)
    return state(model)


def set_packed_metadata_cache(model: nn.Module, enabled: bool) -> ModelState:
    """Toggle ``packed_metadata_cache`` on a live model: True = cached path, False = naive per-layer rebuild."""
    st = getattr(base_model(model), "_fastsft_packed_state", None)
    if st is None:
        raise RuntimeError("packed attention is not enabled on this model: call enable_packed_attention() first")
    if not isinstance(enabled, bool):
        raise ValueError(f"packed_metadata_cache must be True or False, got {enabled!r}")
    st.cache = enabled
    return state(model)


def disable_packed_attention(model: nn.Module) -> ModelState:
    """Undo :func:`enable_packed_attention`: the exact original ``config._attn_implementation``, no hook left."""
    base = base_model(model)
    st: _PackedState | None = getattr(base, "_fastsft_packed_state", None)
    if st is not None:
        # The setter, not set_attn_implementation(): it would "adjust" some values (e.g. sdpa -> eager on GPT-OSS).
        base.config._attn_implementation = st.original_attn
        st.hook.remove()
        for layer in decoder_layers(model):
            attn = getattr(layer, "self_attn", None)
            if attn is not None and hasattr(attn, "_fastsft_packed_state"):
                del attn._fastsft_packed_state
        del base._fastsft_packed_state
    return state(model)


def packed_attention_state(model: nn.Module) -> dict | None:
    """``{"backend", "cache", "attn_implementation", "original_attn_implementation"}`` or None when off."""
    base = base_model(model)
    st = getattr(base, "_fastsft_packed_state", None)
    if st is None:
        return None
    return {"backend": st.backend, "cache": st.cache, "attn_implementation": base.config._attn_implementation,
            "original_attn_implementation": st.original_attn}


def _read_state(model: nn.Module) -> dict:
    st = getattr(base_model(model), "_fastsft_packed_state", None)
    return {"packed": st.backend, "packed_cache": st.cache} if st is not None else {}


register_state_reader("packed", _read_state)

__all__ = ["enable_packed_attention", "disable_packed_attention", "set_packed_metadata_cache",
           "packed_attention_state", "check_packed_backend"]
