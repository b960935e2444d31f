"""One switchboard for the three optimizations on a live model: ``apply(model, ...)`` and ``revert(model)``.

Each argument left at ``None`` leaves that optimization as it is; ``revert`` puts every one back exactly as the
model had it before the first ``apply`` (original attention implementation, checkpoint functions, experts
implementation). The per-optimization modules have the finer controls.
"""

from __future__ import annotations

from torch import nn


def apply(
    model: nn.Module,
    *,
    packed_attention: str | None = None,
    packed_metadata_cache: bool | None = None,
    offload_buffers: int | None = None,
    prefetch: bool | None = None,
    moe_routing: str | None = None,
) -> dict:
    """Switch optimizations on (or between modes) on ``model``.

    Args:
        packed_attention: attention backend for packed rows (``"sdpa"``, ``"varlen"``, ``"flex"``, ``"xformers"``,
            ``"flash"``, ``"eager"``); see :func:`fastsft_lab.packed.enable_packed_attention`. Packed batches then
            need no attention mask: pass ``position_ids`` (or ``packed_metadata=``, built once per batch).
        packed_metadata_cache: True (default when a backend is set) builds the metadata once per batch; False is
            the naive per-layer rebuild, for comparison. Needs ``packed_attention`` (now or earlier).
        offload_buffers: 0 = standard checkpointing (no offload), 1 = offload with one staging buffer,
            2 = two staging buffers (overlapped reloads). Trade-off: saves one layer input per layer of GPU memory
            for ~2 x tokens x hidden bytes of staging and pinned host memory of the same size as what it saves.
        prefetch: with ``offload_buffers=2``, reload layer k-1 while layer k's backward runs (default on).
        moe_routing: ``"naive"``, ``"grouped"`` (one host sync per MoE layer) or ``"sync_free"`` (none).

    Returns:
        The state after the change, as :func:`state` reports it.
    """
    if packed_metadata_cache is not None and packed_attention is None:
        from .packed import packed_attention_state, set_packed_metadata_cache

        if packed_attention_state(model) is None:
            raise ValueError("packed_metadata_cache needs packed_attention=<backend> (now or in an earlier apply)")
        set_packed_metadata_cache(model, packed_metadata_cache)
    if packed_attention is not None:
        from .packed import enable_packed_attention

        enable_packed_attention(model, packed_attention,
                                cache=True if packed_metadata_cache is None else packed_metadata_cache)
    if offload_buffers is not None:
        from .offload import (disable_offloaded_checkpointing, enable_offloaded_checkpointing,
                              enable_standard_checkpointing, is_offloaded)

        if offload_buffers not in (0, 1, 2):
            raise ValueError(f"offload_buffers must be 0, 1 or 2, got {offload_buffers!r}")
        if offload_buffers == 0:
            if is_offloaded(model):
                disable_offloaded_checkpointing(model)
            if not getattr(model, "is_gradient_checkpointing", False):
                enable_standard_checkpointing(model)
        else:
            enable_offloaded_checkpointing(model, offload_buffers, prefetch)
    elif prefetch is not None:
        raise ValueError("prefetch needs offload_buffers=2")
    if moe_routing is not None:
        from .moe import set_moe_routing

        set_moe_routing(model, moe_routing)
    return state(model)


def revert(model: nn.Module) -> dict:
    """Undo every optimization fastsft_lab switched on for ``model``: back to its original behaviour."""
    from .moe import get_moe_routing, set_moe_routing
    from .offload import disable_offloaded_checkpointing, is_offloaded
    from .packed import disable_packed_attention, packed_attention_state

    if packed_attention_state(model) is not None:
        disable_packed_attention(model)
    if is_offloaded(model):
        disable_offloaded_checkpointing(model, release_pool=True)
    if get_moe_routing(model) is not None:
        set_moe_routing(model, None)
    return state(model)


def state(model: nn.Module) -> dict:
    """Which optimizations are on: ``{"packed": ..., "offload": bool, "moe_routing": ...}``."""
    from .moe import get_moe_routing
    from .offload import is_offloaded, offload_manager
    from .packed import packed_attention_state

    manager = offload_manager(model)
    return {
        "packed": packed_attention_state(model),
        "offload": is_offloaded(model),
        "offload_buffers": getattr(manager, "buffers", None) if manager is not None else 0,
        "moe_routing": get_moe_routing(model),
    }


__all__ = ["apply", "revert", "state"]
