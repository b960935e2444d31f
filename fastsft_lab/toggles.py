"""One switchboard for the three optimizations on a live model: ``apply(model, ...)`` and ``revert(model)``.

Each argument left at ``None`` leaves that optimization as it is. Every argument is validated before anything
changes, so a bad one leaves the model untouched. ``revert`` puts every one back exactly as the model had it
before the first ``apply`` (original attention implementation, checkpoint functions, experts implementation).
Like every switch of fastsft_lab, both return the model's :class:`~fastsft_lab.model_state.ModelState`; the
per-optimization modules (``fastsft_lab.packing``, ``.offload``, ``.moe``) have the finer controls.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

from torch import nn

from .models import base_model, decoder_layers, unwrap
from .model_state import ModelState, state


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply() takes a transformers causal LM (nn.Module), got {type(model).__name__}")
    try:
        decoder_layers(model)
    except ValueError:
        raise ValueError(f"{type(base_model(model)).__name__} is not a transformers causal LM with decoder layers "
                         "(model.model.layers): fastsft_lab's switches apply to Qwen3, GPT-OSS, Llama-like models"
                         ) from None


@dataclass(frozen=True)
class Optimization:
    """One switch of :func:`apply`, in the shape every switch has: ``validate(model, value, args)`` raises a one-line
    error and changes nothing; ``enable(model, value, args)`` turns it on (or to another mode); ``disable(model)``
    turns it off, exactly back to what the model had; ``off`` lists the values that mean off. ``args`` are all of
    :func:`apply`'s arguments (a switch may depend on another: prefetch on offload, the cache on packed attention).
    What is on is read by :func:`fastsft_lab.model_state.state`."""

    name: str
    validate: Callable[[nn.Module, Any, dict], None]
    enable: Callable[[nn.Module, Any, dict], None]
    disable: Callable[[nn.Module], None]
    off: tuple = ()


def _is_off(opt: Optimization, value) -> bool:
    return any(value is o or (type(value) is type(o) and value == o) for o in opt.off)


# -- packed attention (optimization 1) -------------------------------------------------------------------------------
def _validate_packed(model, value, args) -> None:
    from .packing.registry import get_backend
    from .packing.switch import check_packed_backend

    get_backend(value)                         # one line naming the valid backends
    check_packed_backend(model, value)


def _enable_packed(model, value, args) -> None:
    from .packing.switch import enable_packed_attention

    cache = args.get("packed_metadata_cache")
    enable_packed_attention(model, value, cache=True if cache is None else cache)


def _disable_packed(model) -> None:
    from .packing.switch import disable_packed_attention, packed_attention_state

    if packed_attention_state(model) is not None:
        disable_packed_attention(model)


def _validate_cache(model, value, args) -> None:
    from .packing.switch import packed_attention_state

    if not isinstance(value, bool):
        raise ValueError(f"packed_metadata_cache must be True or False, got {value!r}")
    packed = args.get("packed_attention")
    if (packed is not None and _is_off(PACKED, packed)) or (packed is None and packed_attention_state(model) is None):
        raise ValueError("packed_metadata_cache needs packed_attention=<backend> (now or in an earlier apply)")


def _enable_cache(model, value, args) -> None:
    from .packing.switch import set_packed_metadata_cache

    if args.get("packed_attention") is None:   # with a backend, _enable_packed set the cache already
        set_packed_metadata_cache(model, value)


# -- offloaded checkpointing (optimization 2) ------------------------------------------------------------------------
def _budget_given(args) -> bool:
    budget = args.get("memory_budget")
    return budget is not None and not _is_off(BUDGET, budget)


def _validate_offload(model, value, args) -> None:
    from .offload.manager import _check_buffers

    prefetch = args.get("prefetch")
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2):
        raise ValueError(f"offload_buffers must be 0 (standard checkpointing), 1 or 2, got {value!r}")
    if value:
        _check_buffers(value, prefetch)
    elif prefetch:
        raise ValueError("prefetch needs offload_buffers=2")
    if value == 0 and _budget_given(args):
        raise ValueError("memory_budget chooses the checkpointing of each layer, offload_buffers=0 (standard "
                         "checkpointing everywhere) contradicts it: leave offload_buffers out, or give 1 or 2 (the "
                         "staging buffers of the layers the plan offloads)")


def _enable_offload(model, value, args) -> None:
    from .offload.plan import disable_memory_plan, memory_planner
    from .offload.switch import (disable_offloaded_checkpointing, enable_offloaded_checkpointing,
                                 enable_standard_checkpointing, is_offloaded)

    if _budget_given(args):
        return                     # the memory plan offloads with these buffers (_enable_budget)
    if memory_planner(model) is not None:
        import warnings

        warnings.warn(f"offload_buffers={value} set by hand replaces the memory plan (memory_budget off)",
                      stacklevel=4)
        disable_memory_plan(model)
    if value == 0:                 # standard checkpointing: transformers' own, no copies
        if is_offloaded(model):
            disable_offloaded_checkpointing(model)
        enable_standard_checkpointing(model)   # a no-op when checkpointing is on already
    else:
        enable_offloaded_checkpointing(model, value, args.get("prefetch"))


def _disable_offload(model) -> None:
    from .offload.plan import disable_memory_plan
    from .offload.switch import disable_offloaded_checkpointing, disable_standard_checkpointing, is_offloaded

    disable_memory_plan(model)
    if is_offloaded(model):
        disable_offloaded_checkpointing(model, release_pool=True)
    disable_standard_checkpointing(model)      # only what apply turned on; the user's own stays


def _validate_prefetch(model, value, args) -> None:
    buffers = args.get("offload_buffers")
    if buffers is None and _budget_given(args):
        return                     # the plan's offloaded layers use two buffers
    if buffers is None or (isinstance(buffers, (str, bool)) and buffers in ("off", False)):
        raise ValueError("prefetch needs offload_buffers=2")


# -- the checkpointing plan for a memory budget ----------------------------------------------------------------------
def _validate_budget(model, value, args) -> None:
    from .models import model_device
    from .offload.plan import budget_bytes, check_budget_floor, check_plan_sharding
    from .offload.switch import resolve_device

    buffers = args.get("offload_buffers")
    if isinstance(buffers, (str, bool)) and buffers in ("off", False):
        raise ValueError("memory_budget offloads the layers it cannot keep: offload_buffers='off' contradicts it")
    check_budget_floor(model, budget_bytes(value, resolve_device(model_device(model))))
    check_plan_sharding(model)
    _validate_max_tokens(model, args.get("max_tokens"), args)


def _validate_max_tokens(model, value, args) -> None:
    from .offload.plan import memory_planner

    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"max_tokens must be a positive int (the most tokens a batch can have), got {value!r}")
    if not _budget_given(args) and memory_planner(model) is None:
        raise ValueError("max_tokens needs memory_budget=<GiB> (now or in an earlier apply)")


def _enable_budget(model, value, args) -> None:
    import warnings

    from .offload.plan import disable_memory_plan, enable_memory_plan, memory_planner
    from .offload.switch import is_offloaded

    if memory_planner(model) is not None:
        disable_memory_plan(model)
    elif (not is_offloaded(model) and getattr(base_model(model), "is_gradient_checkpointing", False)
          and base_model(model) not in _WARNED_OWN_CHECKPOINTING):
        _WARNED_OWN_CHECKPOINTING.add(base_model(model))          # once per model
        warnings.warn("memory_budget replaces the model's own gradient checkpointing with a per-layer plan; "
                      "revert() (or memory_budget='off') gives it back", stacklevel=4)
    buffers = args.get("offload_buffers") or 2
    enable_memory_plan(model, value, buffers=buffers, prefetch=args.get("prefetch"), max_tokens=args.get("max_tokens"))


_WARNED_OWN_CHECKPOINTING: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _disable_budget(model) -> None:
    from .offload.plan import disable_memory_plan

    disable_memory_plan(model)


def _enable_max_tokens(model, value, args) -> None:
    from .offload.plan import memory_planner

    planner = memory_planner(model)
    if not _budget_given(args) and planner is not None:     # with a budget, _enable_budget passed it already
        planner.max_tokens = value


# -- MoE routing (optimization 3) ------------------------------------------------------------------------------------
def _validate_moe(model, value, args) -> None:
    from .moe.switch import check_moe_routing

    check_moe_routing(model, value)


def _enable_moe(model, value, args) -> None:
    from .moe.switch import set_moe_routing

    set_moe_routing(model, value)


def _disable_moe(model) -> None:
    from .moe.switch import moe_routing_switched, set_moe_routing

    if moe_routing_switched(model):
        set_moe_routing(model, None)


# -- the fast-kernel floor -------------------------------------------------------------------------------------------
def _validate_flag(name: str):
    def check(model, value, args) -> None:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    return check


def _validate_fused_loss(model, value, args) -> None:
    _validate_flag("fused_loss")(model, value, args)
    if value:
        from .loss import check_fused_loss

        check_fused_loss(model)


def _enable_fused_loss(model, value, args) -> None:
    from .loss import enable_fused_loss

    enable_fused_loss(model)


def _disable_fused_loss(model) -> None:
    from .loss import disable_fused_loss

    disable_fused_loss(model)


def _validate_fused_lora(model, value, args) -> None:
    _validate_flag("fused_lora")(model, value, args)
    if value:
        from .lora import fused_lora_targets

        if not fused_lora_targets(model):
            raise ValueError(f"fused_lora=True needs PEFT LoRA linear layers; {type(base_model(model)).__name__} "
                             "has none")


def _enable_fused_lora(model, value, args) -> None:
    from .lora import enable_fused_lora

    enable_fused_lora(model)


def _disable_fused_lora(model) -> None:
    from .lora import disable_fused_lora

    disable_fused_lora(model)


def _validate_fused_dequant(model, value, args) -> None:
    _validate_flag("fused_dequant")(model, value, args)
    if value:
        from .dequant import fused_dequant_targets

        if not fused_dequant_targets(model):
            raise ValueError(f"fused_dequant=True needs bitsandbytes Linear4bit layers (QLoRA); "
                             f"{type(base_model(model)).__name__} has none")


def _enable_fused_dequant(model, value, args) -> None:
    from .dequant import enable_fused_dequant

    enable_fused_dequant(model)


def _disable_fused_dequant(model) -> None:
    from .dequant import disable_fused_dequant

    disable_fused_dequant(model)


def _nothing(model, *args) -> None:
    return None


PACKED = Optimization("packed_attention", _validate_packed, _enable_packed, _disable_packed, off=("off", False))
BUDGET = Optimization("memory_budget", _validate_budget, _enable_budget, _disable_budget, off=("off", False))
# The switches in the order apply enables them (revert disables in the reverse order). packed_metadata_cache,
# prefetch and max_tokens are modes of packed attention, of the offload and of the memory plan: no "off" of their own.
OPTIMIZATIONS: tuple[Optimization, ...] = (
    PACKED,
    Optimization("packed_metadata_cache", _validate_cache, _enable_cache, _nothing),
    Optimization("offload_buffers", _validate_offload, _enable_offload, _disable_offload, off=("off", False)),
    Optimization("prefetch", _validate_prefetch, _nothing, _nothing),
    BUDGET,
    Optimization("max_tokens", _validate_max_tokens, _enable_max_tokens, _nothing),
    Optimization("moe_routing", _validate_moe, _enable_moe, _disable_moe, off=("off", False)),
    Optimization("fused_loss", _validate_fused_loss, _enable_fused_loss, _disable_fused_loss, off=(False,)),
    Optimization("fused_lora", _validate_fused_lora, _enable_fused_lora, _disable_fused_lora, off=(False,)),
    Optimization("fused_dequant", _validate_fused_dequant, _enable_fused_dequant, _disable_fused_dequant,
                 off=(False,)),
)


def apply(
    model: nn.Module,
    *,
    packed_attention: str | bool | None = None,
    packed_metadata_cache: bool | None = None,
    offload_buffers: int | str | bool | None = None,
    prefetch: bool | None = None,
    moe_routing: str | bool | None = None,
    fused_loss: bool | None = None,
    fused_lora: bool | None = None,
    fused_dequant: bool | None = None,
    memory_budget: float | str | bool | None = None,
    max_tokens: int | None = None,
) -> ModelState:
    """Switch optimizations on (or between modes) on ``model``.

    Args:
        packed_attention: attention backend for packed rows (``"sdpa"``, ``"varlen"``, ``"flex"``, ``"xformers"``,
            ``"flash"``, ``"eager"``); see :func:`fastsft_lab.packing.enable_packed_attention`. Packed batches then
            need no attention mask: pass ``position_ids`` (or ``packed_metadata=``, built once per batch).
            ``"off"`` / False: the model's own attention again.
        packed_metadata_cache: True (default when a backend is set) builds the metadata once per batch; False is
            the naive per-layer rebuild, for comparison. Needs ``packed_attention`` (now or earlier).
        offload_buffers: 0 = standard checkpointing (no offload), 1 = offload with one staging buffer,
            2 = two staging buffers (overlapped reloads). Trade-off: saves one layer input per layer of GPU memory
            for ~2 x tokens x hidden bytes of staging and pinned host memory of the same size as what it saves.
            ``"off"`` / False: no offload, and off again the checkpointing apply turned on (the user's own stays).
        prefetch: with ``offload_buffers=2``, reload layer k-1 while layer k's backward runs (default on).
        moe_routing: ``"naive"``, ``"grouped"`` (one host sync per MoE layer) or ``"sync_free"`` (none); MoE
            models only. ``"off"`` / False: the experts implementation the model had.
        fused_loss: True computes the loss with :func:`fastsft_lab.loss.linear_cross_entropy` (no logits held, no
            host sync); the fast-kernel floor under the three optimizations, not one of them.
        fused_lora: True adds each PEFT LoRA adapter into its base layer's output with one in-place GEMM in the
            activations' dtype (:mod:`fastsft_lab.lora`); fast-kernel floor too. Refused for DoRA / LoRA biases.
        fused_dequant: True dequantises QLoRA's NF4 base weights in one Triton kernel (CUDA) and, inside a
            checkpoint's recompute, keeps the weight for the backward instead of dequantising it a third time
            (:mod:`fastsft_lab.dequant`); bit for bit bitsandbytes' weights. Refused for FP4 weights.
        memory_budget: the step's peak (each rank's, under DDP / FSDP2): GiB (``80``), or on a GPU a share of its
            free memory on top of what is allocated now (``"90%"``: the loaded model plus 90% of what is left;
            a CPU takes GiB): each decoder layer keeps
            its activations, saves only matmul / attention outputs, or is checkpointed (input kept or offloaded),
            whichever plan is fastest within the budget (:mod:`fastsft_lab.offload.plan`; measured on step 1,
            solved at step 2, shown by ``state(model).memory_plan``). Exact: every plan computes what plain
            training computes. ``offload_buffers`` 1 or 2 sets the staging buffers of the layers it offloads;
            a later ``offload_buffers`` alone replaces the plan. ``"off"`` / False: off.
        max_tokens: with ``memory_budget``, the most tokens a batch can have: the plan holds the budget for it
            (default: re-plans when a larger batch arrives).

    Every argument left at None leaves its switch as it is; each switch is an :class:`Optimization` of
    :data:`OPTIMIZATIONS`, validated all before any is changed.

    Returns:
        The model's state after the change.
    """
    args = {"packed_attention": packed_attention, "packed_metadata_cache": packed_metadata_cache,
            "offload_buffers": offload_buffers, "prefetch": prefetch, "moe_routing": moe_routing,
            "fused_loss": fused_loss, "fused_lora": fused_lora, "fused_dequant": fused_dequant,
            "memory_budget": memory_budget,
            "max_tokens": max_tokens}
    # validate everything first: a bad argument must not leave the model half switched
    model = unwrap(model)            # DDP / torch.compile: the switches act on the module they wrap; FSDP1 refused
    _check_model(model)
    for opt in OPTIMIZATIONS:
        value = args[opt.name]
        if value is not None and not _is_off(opt, value):
            opt.validate(model, value, args)
    for opt in OPTIMIZATIONS:
        value = args[opt.name]
        if value is None:
            continue
        if _is_off(opt, value):
            opt.disable(model)
        else:
            opt.enable(model, value, args)
    return state(model)


def revert(model: nn.Module) -> ModelState:
    """Undo every optimization fastsft_lab switched on for ``model``: back to its original behaviour."""
    model = unwrap(model)
    for opt in reversed(OPTIMIZATIONS):
        opt.disable(model)
    return state(model)


__all__ = ["apply", "revert", "state", "Optimization", "OPTIMIZATIONS"]
