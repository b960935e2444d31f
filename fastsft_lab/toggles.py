"""One switchboard for the three optimizations on a live model: ``apply(model, ...)`` and ``revert(model)``.

Each argument left at ``None`` leaves that optimization as it is. Every argument is validated before anything
changes, so a bad one leaves the model untouched. ``revert`` puts every one back exactly as the model had it
before the first ``apply`` (original attention implementation, checkpoint functions, experts implementation).
Like every switch of fastsft_lab, both return the model's :class:`~fastsft_lab.model_state.ModelState`; the
per-optimization modules (``fastsft_lab.packing``, ``.offload``, ``.moe``) have the finer controls.
"""

from __future__ import annotations

from torch import nn

from .models import base_model, decoder_layers, unwrap
from .model_state import ModelState, state


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply() takes a transformers causal LM (nn.Module), got {type(model).__name__}")
    unwrap(model)                    # refuses what it cannot see through (FSDP1), in its own words
    try:
        decoder_layers(model)
    except ValueError:
        raise ValueError(f"{type(base_model(model)).__name__} is not a transformers causal LM with decoder layers "
                         "(model.model.layers): fastsft_lab's switches apply to Qwen3, GPT-OSS, Llama-like models"
                         ) from None


def apply(
    model: nn.Module,
    *,
    packed_attention: str | None = None,
    packed_metadata_cache: bool | None = None,
    offload_buffers: int | None = None,
    prefetch: bool | None = None,
    moe_routing: str | None = None,
    fused_loss: bool | None = None,
    fused_lora: bool | None = None,
) -> ModelState:
    """Switch optimizations on (or between modes) on ``model``.

    Args:
        packed_attention: attention backend for packed rows (``"sdpa"``, ``"varlen"``, ``"flex"``, ``"xformers"``,
            ``"flash"``, ``"eager"``); see :func:`fastsft_lab.packing.enable_packed_attention`. Packed batches then
            need no attention mask: pass ``position_ids`` (or ``packed_metadata=``, built once per batch).
        packed_metadata_cache: True (default when a backend is set) builds the metadata once per batch; False is
            the naive per-layer rebuild, for comparison. Needs ``packed_attention`` (now or earlier).
        offload_buffers: 0 = standard checkpointing (no offload), 1 = offload with one staging buffer,
            2 = two staging buffers (overlapped reloads). Trade-off: saves one layer input per layer of GPU memory
            for ~2 x tokens x hidden bytes of staging and pinned host memory of the same size as what it saves.
        prefetch: with ``offload_buffers=2``, reload layer k-1 while layer k's backward runs (default on).
        moe_routing: ``"naive"``, ``"grouped"`` (one host sync per MoE layer) or ``"sync_free"`` (none); MoE
            models only.
        fused_loss: True computes the loss with :func:`fastsft_lab.loss.linear_cross_entropy` (no logits held, no
            host sync); the fast-kernel floor under the three optimizations, not one of them.
        fused_lora: True adds each PEFT LoRA adapter into its base layer's output with one in-place GEMM in the
            activations' dtype (:mod:`fastsft_lab.lora`); fast-kernel floor too. Refused for DoRA / LoRA biases.

    Returns:
        The model's state after the change.
    """
    from .moe.switch import check_moe_routing
    from .offload.manager import _check_buffers
    from .packing.registry import get_backend
    from .packing.switch import check_packed_backend, packed_attention_state

    # validate everything first: a bad argument must not leave the model half switched
    _check_model(model)
    model = unwrap(model)            # DDP / torch.compile: the switches act on the module they wrap
    if packed_attention is not None:
        get_backend(packed_attention)
        check_packed_backend(model, packed_attention)
    if packed_metadata_cache is not None:
        if not isinstance(packed_metadata_cache, bool):
            raise ValueError(f"packed_metadata_cache must be True or False, got {packed_metadata_cache!r}")
        if packed_attention is None and packed_attention_state(model) is None:
            raise ValueError("packed_metadata_cache needs packed_attention=<backend> (now or in an earlier apply)")
    if offload_buffers is not None:
        if isinstance(offload_buffers, bool) or not isinstance(offload_buffers, int) or offload_buffers not in (0, 1, 2):
            raise ValueError(f"offload_buffers must be 0 (standard checkpointing), 1 or 2, got {offload_buffers!r}")
        if offload_buffers:
            _check_buffers(offload_buffers, prefetch)
        elif prefetch:
            raise ValueError("prefetch needs offload_buffers=2")
    elif prefetch is not None:
        raise ValueError("prefetch needs offload_buffers=2")
    if moe_routing is not None:
        check_moe_routing(model, moe_routing)
    if fused_loss is not None and not isinstance(fused_loss, bool):
        raise ValueError(f"fused_loss must be True or False, got {fused_loss!r}")
    if fused_lora is not None:
        if not isinstance(fused_lora, bool):
            raise ValueError(f"fused_lora must be True or False, got {fused_lora!r}")
        if fused_lora:
            from .lora import fused_lora_targets

            if not fused_lora_targets(model):
                raise ValueError(f"fused_lora=True needs PEFT LoRA linear layers; {type(base_model(model)).__name__} "
                                 "has none")

    if packed_attention is not None:
        from .packing.switch import enable_packed_attention

        enable_packed_attention(model, packed_attention,
                                cache=True if packed_metadata_cache is None else packed_metadata_cache)
    elif packed_metadata_cache is not None:
        from .packing.switch import set_packed_metadata_cache

        set_packed_metadata_cache(model, packed_metadata_cache)
    if offload_buffers is not None:
        from .offload.switch import (disable_offloaded_checkpointing, enable_offloaded_checkpointing,
                                     enable_standard_checkpointing, is_offloaded)

        if offload_buffers == 0:
            if is_offloaded(model):
                disable_offloaded_checkpointing(model)
            enable_standard_checkpointing(model)   # a no-op when checkpointing is on already
        else:
            enable_offloaded_checkpointing(model, offload_buffers, prefetch)
    if moe_routing is not None:
        from .moe.switch import set_moe_routing

        set_moe_routing(model, moe_routing)
    if fused_loss is not None:
        from .loss import disable_fused_loss, enable_fused_loss

        (enable_fused_loss if fused_loss else disable_fused_loss)(model)
    if fused_lora is not None:
        from .lora import disable_fused_lora, enable_fused_lora

        (enable_fused_lora if fused_lora else disable_fused_lora)(model)
    return state(model)


def revert(model: nn.Module) -> ModelState:
    """Undo every optimization fastsft_lab switched on for ``model``: back to its original behaviour."""
    from .lora import disable_fused_lora
    from .loss import disable_fused_loss
    from .moe.switch import moe_routing_switched, set_moe_routing
    from .offload.switch import disable_offloaded_checkpointing, disable_standard_checkpointing, is_offloaded
    from .packing.switch import disable_packed_attention, packed_attention_state

    model = unwrap(model)
    if packed_attention_state(model) is not None:
        disable_packed_attention(model)
    if is_offloaded(model):
        disable_offloaded_checkpointing(model, release_pool=True)
    disable_standard_checkpointing(model)
    if moe_routing_switched(model):
        set_moe_routing(model, None)
    disable_fused_loss(model)
    disable_fused_lora(model)
    return state(model)


__all__ = ["apply", "revert", "state"]
