"""The door to every switch on a live model: ``apply(model, ...)`` and ``revert(model)``.

Each argument left at ``None`` leaves that switch as it is. Every argument is validated before anything changes,
so a bad one leaves the model untouched. Each switch is one :class:`~fastsft_lab.restore.Optimization`, defined
beside the code it switches (``packing/switch.py``, ``offload/switch.py``, ``offload/plan.py``, ``moe/switch.py``,
``loss.py``, ``lora.py``, ``dequant.py``); what it changes goes through the model's restore log, so ``revert`` is
the log's undo: every change taken back, the last first. The door knows only the order, the
validate-all-then-enable rule, which arguments are a switch's modes, and the wrappers it sees through. Like every
switch of fastsft_lab, both return the model's :class:`~fastsft_lab.model_state.ModelState`.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from .dequant import FUSED_DEQUANT
from .lora import FUSED_LORA
from .loss import FUSED_LOSS
from .model_state import ModelState, state
from .moe.switch import MOE
from .offload.plan import BUDGET
from .offload.switch import OFFLOAD
from .packing.switch import PACKED
from .restore import Optimization, undo
from .structure import base_model, decoder_layers, unwrap

# The switches in the order apply enables them.
OPTIMIZATIONS: tuple[Optimization, ...] = (PACKED, OFFLOAD, BUDGET, MOE, FUSED_LOSS, FUSED_LORA, FUSED_DEQUANT)


def register(opt: Optimization) -> Optimization:
    """Add a switch to :func:`apply` (enabled after the others; its name and options become arguments)."""
    global OPTIMIZATIONS
    if any(o.name == opt.name for o in OPTIMIZATIONS):
        raise ValueError(f"a switch named {opt.name!r} is registered already")
    OPTIMIZATIONS = (*OPTIMIZATIONS, opt)
    return opt


def unregister(name: str) -> None:
    """Remove the switch ``name`` added with :func:`register`."""
    global OPTIMIZATIONS
    OPTIMIZATIONS = tuple(o for o in OPTIMIZATIONS if o.name != name)


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"apply() takes a transformers causal LM (nn.Module), got {type(model).__name__}")
    try:
        decoder_layers(model)
    except ValueError:
        raise ValueError(f"{type(base_model(model)).__name__} is not a transformers causal LM with decoder layers "
                         "(model.model.layers): fastsft_lab's switches apply to Qwen3, GPT-OSS, Llama-like models"
                         ) from None


def _steps(args: dict[str, Any]) -> list[tuple[Optimization, Any, dict]]:
    """Each switch this call turns, with its value (None: as it is) and its options. A switch another one takes
    over in this call is not one: its value and options are the taker's options."""
    by_name = {o.name: o for o in OPTIMIZATIONS}
    taken = {t for o in OPTIMIZATIONS if o.name in args and not o.is_off(args[o.name]) for t in o.takes}
    steps = []
    for opt in OPTIMIZATIONS:
        if opt.name in taken:
            continue
        value = args.get(opt.name)
        names = list(opt.options)
        if value is not None and not opt.is_off(value):
            names += [n for t in opt.takes for n in (t, *by_name[t].options)]
        options = {n: args[n] for n in names if n in args}
        if value is not None or options:
            steps.append((opt, value, options))
    return steps


def _takers(opt: Optimization, enabled: set[str]) -> list[Optimization]:
    return [o for o in OPTIMIZATIONS if opt.name in o.takes and o.name not in enabled]


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
    **switches: Any,
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

        **switches: the arguments of switches added with :func:`register` (none by default).

    Every argument left at None leaves its switch as it is; each switch is an :class:`Optimization` of
    :data:`OPTIMIZATIONS`, validated all before any is changed.

    Returns:
        The model's state after the change.
    """
    args = {"packed_attention": packed_attention, "packed_metadata_cache": packed_metadata_cache,
            "offload_buffers": offload_buffers, "prefetch": prefetch, "moe_routing": moe_routing,
            "fused_loss": fused_loss, "fused_lora": fused_lora, "fused_dequant": fused_dequant,
            "memory_budget": memory_budget, "max_tokens": max_tokens}
    known = {n for o in OPTIMIZATIONS for n in (o.name, *o.options)}
    unknown = sorted(set(switches) - known)
    if unknown:
        raise TypeError(f"apply() got unknown switch(es) {', '.join(unknown)}; the switches are "
                        f"{', '.join(sorted(known | set(args)))}")
    args.update(switches)
    given = {name: value for name, value in args.items() if value is not None}
    model = unwrap(model)            # DDP / torch.compile: the switches act on the module they wrap; FSDP1 refused
    _check_model(model)
    # validate everything first: a bad argument must not leave the model half switched
    steps = []
    for opt, value, options in _steps(given):
        if value is not None and opt.is_off(value):
            if options:
                raise ValueError(f"{', '.join(options)} needs {opt.name} on, and this call switches it off "
                                 f"({opt.name}={value!r})")
            steps.append((opt, value, None))
        else:
            steps.append((opt, value, opt.validate(model, value, options)))
    enabled = {opt.name for opt, value, _ in steps if value is not None and not opt.is_off(value)}
    for opt, value, settings in steps:
        if value is not None:
            for taker in _takers(opt, enabled):      # set alone, a switch another one took over comes back
                if taker.is_on(model) and not opt.is_off(value):
                    warnings.warn(f"{opt.name}={value!r} set by hand replaces {taker.name} (switched off)",
                                  stacklevel=2)
                taker.disable(model)
        if value is not None and opt.is_off(value):
            opt.disable(model)
        else:
            opt.enable(model, settings)
    return state(model)


def revert(model: nn.Module) -> ModelState:
    """Undo every change fastsft_lab's switches made to ``model`` (its restore log, the last change first): back to
    its original behaviour."""
    model = unwrap(model)
    undo(model)
    return state(model)


__all__ = ["apply", "revert", "state", "register", "unregister", "Optimization", "OPTIMIZATIONS"]
