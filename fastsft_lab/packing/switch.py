"""Packed attention on a live model: on (cached or naive metadata), switched between backends, and off again.

* :func:`enable_packed_attention` sets the model's attention implementation to a registered backend and adds one
  forward pre-hook on the decoder stack, which makes sure every step carries a :class:`PackedMetadata` (the
  collator's, or one recovered from ``position_ids`` with a single sync);
* :func:`set_packed_metadata_cache` toggles cached (0 syncs in the layers) and naive (every layer rebuilds its
  metadata from ``position_ids``, with the syncs per-layer code pays);
* :func:`disable_packed_attention` takes back what the switch changed (the restore log: :mod:`fastsft_lab.restore`).

:data:`PACKED` is the switch :func:`fastsft_lab.apply` turns (``packed_attention=``, ``packed_metadata_cache=``);
the functions here are its finer controls. Every switch returns :func:`fastsft_lab.model_state.state` of the model after the change.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .._compat import (ATTN_IMPLEMENTATION, assert_async, attn_implementation, set_attn_implementation_of)
from ..families import router_aux_loss
from ..model_state import ModelState, state
from ..restore import Optimization, changes, is_on, record
from ..structure import base_model, decoder_layers, model_device
from .metadata import PackedMetadata
from .registry import REBUILD_IN_EVERY_LAYER, available_backends, get_backend

SWITCH = "packed_attention"


@dataclass
class PackedAttention:
    """Packed attention's settings -- the backend, the metadata mode (``cache``), the batch checks -- as
    ``apply(packed_attention=...)`` takes them (a backend name, or this for the batch checks' ablation); on the
    model, its record in the restore log, with the attention implementation the model had before
    (``original_attn``, what :func:`original_attention` runs)."""

    backend: str
    cache: bool = True
    check_batch: bool = True
    original_attn: Any = None

    def state(self) -> dict:
        return {"packed": self.backend, "packed_cache": self.cache}


def _inner_model(model: nn.Module) -> nn.Module:
    inner = base_model(model)
    return getattr(inner, "model", inner)


@contextlib.contextmanager
def original_attention(model: nn.Module):
    """Run the model's own attention implementation (the one it had before packed attention) inside the block:
    generation with a KV cache, or any call that is not a packed training or prefill step."""
    base = base_model(model)
    st: PackedAttention | None = record(model, SWITCH)
    ours = attn_implementation(base.config)
    if st is None or ours == st.original_attn:
        yield
        return
    set_attn_implementation_of(base.config, st.original_attn)
    try:
        yield
    finally:
        set_attn_implementation_of(base.config, ours)


def check_position_ids(position_ids: torch.Tensor) -> None:
    """Every packed sequence must start at position 0 (a segment starts where the position does not go up by one).

    Checked on the device with ``torch._assert_async``: no host sync (on CUDA a failure surfaces as a device-side
    assert at the next sync; on a CPU it raises here). Otherwise the cached path (segments by position jumps) and the
    naive per-layer paths (segments where the position is 0) would read different segments from the same ids.
    """
    pos = position_ids
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = (pos[:, 1:] - pos[:, :-1]) != 1
    assert_async(((pos == 0) | ~starts).all(),
                        "packed position_ids must restart at 0 in every sequence (e.g. [0, 1, 2, 0, 1]); a sequence "
                        "starting elsewhere cannot be told apart from the one before it")


def check_metadata_matches(meta: PackedMetadata, position_ids: torch.Tensor) -> None:
    """The metadata must describe this batch: its position ids equal the batch's (on the device, no host sync)."""
    mine = meta.tensors(position_ids.device).position_ids
    assert_async((mine == position_ids.expand_as(mine)).all(),
                        "packed_metadata does not describe this batch: its segments give other position_ids than "
                        "the batch's (metadata built from another batch?)")


def check_seq_idx(seq_idx: torch.Tensor, position_ids: torch.Tensor) -> None:
    """A padding-free collator's ``seq_idx`` (the sequence of each token) must mark the same segments as the
    position ids: a new sequence exactly where the position restarts at 0 (on the device, no host sync)."""
    seq_idx = seq_idx.expand_as(position_ids)
    new_seq = torch.ones_like(position_ids, dtype=torch.bool)
    new_seq[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    assert_async((new_seq == (position_ids == 0)).all(),
                        "seq_idx and position_ids describe different sequences: a new sequence must start exactly "
                        "where position_ids restart at 0")


def _inject_metadata(st: PackedAttention, base: nn.Module):
    """Forward pre-hook on the decoder stack: one PackedMetadata per step (cached path), checked against the batch,
    or the naive path's mark (every layer rebuilds from ``position_ids``); calls with a KV cache run the model's own
    attention instead (put back by the post-hook)."""
    decoding: list[str] = []        # our implementation's name while a decoding call runs the model's own

    def pre_hook(module, args, kwargs):
        if attn_implementation(base.config) != get_backend(st.backend).attn_name:
            return None    # inside original_attention() (generate): the model's own attention and masks
        if kwargs.get("past_key_values") is not None:
            # a decoding call: the model's own attention and masks for this forward (restored by the post-hook)
            decoding.append(attn_implementation(base.config))
            set_attn_implementation_of(base.config, st.original_attn)
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        shape = tuple((ids if ids is not None else embeds).shape[:2])
        pos = kwargs.get("position_ids")
        if pos is not None and st.check_batch:
            check_position_ids(pos.expand(*shape))
            if kwargs.get("seq_idx") is not None:
                check_seq_idx(kwargs["seq_idx"], pos.expand(*shape))
        if not st.cache:
            kwargs["packed_metadata"] = REBUILD_IN_EVERY_LAYER     # naive: each layer rebuilds, by design
            return args, kwargs
        meta = kwargs.get("packed_metadata")
        if meta is not None:
            if not isinstance(meta, PackedMetadata):
                raise TypeError(f"packed_metadata must be a PackedMetadata, got {type(meta).__name__}")
            meta.check_shape(*shape)
            if pos is None:
                # the rotary embedding needs the positions inside each sequence: take them from the metadata
                device = (ids if ids is not None else embeds).device
                kwargs["position_ids"] = meta.tensors(device).position_ids
                return args, kwargs
            if st.check_batch:
                check_metadata_matches(meta, pos)
            return None
        mask = kwargs.get("attention_mask")
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            raise ValueError("packed attention builds its own masks: pass packed_metadata or packed position_ids, "
                             "not a prepared 4-D/dict attention_mask")
        # One sync for the whole step (not one per layer): read position_ids (and the mask) back once.
        kwargs["packed_metadata"] = PackedMetadata.from_position_ids(pos, shape=shape, attention_mask=mask)
        return args, kwargs

    def post_hook(module, args, kwargs, output):
        if decoding:
            set_attn_implementation_of(base.config, decoding.pop())
        return None

    return pre_hook, post_hook


def _router_loss_mask(base: nn.Module):
    """Forward pre-hook on a MoE ``*ForCausalLM``: its router load-balancing loss averages over the tokens that the
    ``attention_mask`` marks; packed rows come without one, so the padding tails would count. From the batch's
    metadata (host lengths, one pinned copy) the hook passes the mask of real tokens, which the packed attention
    backends ignore (they take their masks from the metadata)."""

    def hook(module, args, kwargs):
        meta = kwargs.get("packed_metadata")
        if meta is None or kwargs.get("attention_mask") is not None or not isinstance(meta, PackedMetadata):
            return None
        router = kwargs.get("output_router_logits")
        if not (router if router is not None else getattr(base.config, "output_router_logits", False)):
            return None
        if not any(meta.pad_lengths):
            return None
        ids = kwargs.get("input_ids", args[0] if args else None)
        ref = ids if ids is not None else kwargs.get("inputs_embeds")
        kwargs["attention_mask"] = meta.real_tokens_mask(ref.device)
        return args, kwargs

    return hook


def _generate_through_original_attention(base: nn.Module):
    """An instance-level ``generate`` that runs with the model's own attention (KV cache, padding masks), so that
    training and sampling alternate on one model without switching anything."""
    original = base.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        with original_attention(base):
            return original(*args, **kwargs)

    return generate


def check_packed_model(model: nn.Module) -> None:
    """Refuse a model whose attention has a feature the packed kernels do not implement (one-line error)."""
    cfg = base_model(model).config
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    name = type(base_model(model)).__name__
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    if softcap is not None:
        raise NotImplementedError(f"{name} uses attention logit softcapping (attn_logit_softcapping={softcap}), which "
                                  "fastsft_lab's packed-attention kernels do not implement: packed attention would "
                                  "change its numbers. Supported families: see the README's table")
    if getattr(cfg, "alibi", False) or getattr(cfg, "use_alibi", False) or \
            getattr(cfg, "position_embedding_type", None) == "alibi":
        raise NotImplementedError(f"{name} uses ALiBi attention biases, which fastsft_lab's packed-attention kernels "
                                  "do not implement")
    try:
        layers = decoder_layers(model)
    except ValueError:
        raise ValueError(f"{name} has no decoder layers (model.model.layers): packed attention applies to "
                         "transformers causal LMs such as Qwen3, Llama, Mistral, GPT-OSS") from None
    if not callable(getattr(base_model(model), "generate", None)):
        # a head that reads one position per row (sequence classification) would mix the sequences packed there
        raise ValueError(f"{name} is not a causal LM (no generate()): packed attention applies to transformers "
                         "*ForCausalLM models such as Qwen3, Llama, Mistral, GPT-OSS")
    if not any(getattr(layer, "self_attn", None) is not None for layer in layers):
        raise ValueError(f"{name}'s decoder layers have no self_attn module: not a supported architecture")


def check_packed_backend(model: nn.Module, backend: str) -> None:
    """Raise a one-line error if ``backend`` is unknown, cannot train on ``model``'s device, or ``model`` has an
    attention feature the kernels do not implement."""
    get_backend(backend)
    check_packed_model(model)
    status = available_backends(model_device(model))[backend]
    if not status.available:
        raise RuntimeError(f"packed-attention backend {backend!r} is not available here: {status.reason}")


def validate(model: nn.Module, value: str | None, options: dict) -> PackedAttention:
    """The ``packed_attention`` switch's checks (``packed_metadata_cache`` is its mode): one-line errors, nothing
    changed; returns the settings :func:`enable` switches on."""
    cache = options.get("packed_metadata_cache")
    if cache is not None and not isinstance(cache, bool):
        raise ValueError(f"packed_metadata_cache must be True or False, got {cache!r}")
    st: PackedAttention | None = record(model, SWITCH) if is_on(model, SWITCH) else None
    if value is None:
        if st is None:
            raise ValueError("packed_metadata_cache needs packed_attention=<backend> (now or in an earlier apply)")
        return PackedAttention(st.backend, st.cache if cache is None else cache, st.check_batch)
    if isinstance(value, PackedAttention):
        settings = PackedAttention(value.backend, value.cache, bool(value.check_batch))
    else:
        settings = PackedAttention(value)
    if not isinstance(settings.cache, bool):
        raise ValueError(f"cache must be True or False, got {settings.cache!r}")
    check_packed_backend(model, settings.backend)
    return settings if cache is None else PackedAttention(settings.backend, cache, settings.check_batch)


def enable(model: nn.Module, settings: PackedAttention) -> None:
    """Switch packed attention on with ``settings`` (checked by :func:`validate`), or into its backend and mode."""
    log = changes(model, SWITCH)
    base = base_model(model)
    st: PackedAttention | None = log.record
    if st is None:
        st = log.record = PackedAttention(settings.backend, settings.cache, settings.check_batch,
                                          attn_implementation(base.config))
        pre, post = _inject_metadata(st, base)
        inner = _inner_model(model)
        log.hook(inner.register_forward_pre_hook(pre, with_kwargs=True))
        log.hook(inner.register_forward_hook(post, with_kwargs=True, always_call=True))
        if router_aux_loss(base.config):
            log.hook(base.register_forward_pre_hook(_router_loss_mask(base), with_kwargs=True))
        log.set(base, "generate", _generate_through_original_attention(base))
    st.backend, st.cache, st.check_batch = settings.backend, settings.cache, settings.check_batch
    name = get_backend(st.backend).attn_name
    if attn_implementation(base.config) != name:
        log.keep(base.config, ATTN_IMPLEMENTATION)     # put back through the setter: set_attn_implementation()
        base.set_attn_implementation(name)              # would "adjust" some values (sdpa -> eager on GPT-OSS)


PACKED = Optimization("packed_attention", validate, enable, off=("off", False), options=("packed_metadata_cache",))


def enable_packed_attention(model: nn.Module, backend: str = "sdpa", *, cache: bool = True,
                            check_available: bool = True, check_batch: bool = True) -> ModelState:
    """Run ``model``'s attention over packed rows with ``backend``; ``cache`` picks the cached or the naive path.

    Args:
        model: a transformers causal LM, PEFT-wrapped or not (Qwen3, GPT-OSS, Llama-like families; a model with
            attention logit softcapping or ALiBi is refused).
        backend: ``"sdpa"`` (dense mask; runs anywhere), ``"varlen"`` (torch's flash varlen kernel on CUDA; a
            reference kernel on CPU), ``"flex"`` (flex attention + BlockMask), ``"xformers"``, ``"flash"``
            (the flash_attn package) or ``"eager"`` (the exact reference).
        cache: True builds the metadata once per batch (0 syncs in the layers); False rebuilds it in every layer
            from ``position_ids`` (the naive path, for comparison). Switch later with
            :func:`set_packed_metadata_cache`.
        check_available: raise if ``backend`` cannot run on the model's device (see :func:`available_backends`).
        check_batch: check, on the device and without a host sync, that ``position_ids`` restart at 0 in every
            sequence and that a given ``packed_metadata`` describes the batch (its position ids equal the batch's).
            A few tiny kernels per step; off only to measure what they cost.

    ``model.generate()`` and any call with a KV cache run the model's own attention, so training and sampling
    alternate without switching.

    Returns:
        The model's :class:`~fastsft_lab.model_state.ModelState`. Calling it again switches the backend;
        :func:`disable_packed_attention` restores the original.
    """
    get_backend(backend)
    if not isinstance(cache, bool):
        raise ValueError(f"cache must be True or False, got {cache!r}")
    if check_available:
        check_packed_backend(model, backend)
    else:
        check_packed_model(model)
    enable(model, PackedAttention(backend, cache, bool(check_batch)))
    return state(model)


def set_packed_metadata_cache(model: nn.Module, enabled: bool) -> ModelState:
    """Toggle ``packed_metadata_cache`` on a live model: True = cached path, False = naive per-layer rebuild."""
    if not is_on(model, SWITCH):
        raise RuntimeError("packed attention is not enabled on this model: call enable_packed_attention() first")
    enable(model, validate(model, None, {"packed_metadata_cache": enabled}))
    return state(model)


def disable_packed_attention(model: nn.Module) -> ModelState:
    """Undo :func:`enable_packed_attention`: the model's own attention implementation again, no hook left."""
    PACKED.disable(model)
    return state(model)


def packed_attention_state(model: nn.Module) -> dict | None:
    """``{"backend", "cache", "attn_implementation", "original_attn_implementation"}`` or None when off."""
    st: PackedAttention | None = record(model, SWITCH) if is_on(model, SWITCH) else None
    if st is None:
        return None
    return {"backend": st.backend, "cache": st.cache,
            "attn_implementation": attn_implementation(base_model(model).config),
            "original_attn_implementation": st.original_attn}


__all__ = ["PACKED", "PackedAttention", "enable_packed_attention", "disable_packed_attention",
           "set_packed_metadata_cache", "packed_attention_state", "check_packed_backend", "check_packed_model",
           "original_attention", "check_position_ids", "check_metadata_matches"]
