"""transformers' ``gradient_checkpointing_enable()`` / ``_disable()`` kept from replacing fastsft_lab's checkpointing.

While offloaded checkpointing or a memory plan is on, each decoder layer's checkpoint function is fastsft_lab's.
transformers' ``Trainer`` calls ``model.gradient_checkpointing_enable()`` inside ``train()`` when
``gradient_checkpointing=True`` (TRL's ``SFTConfig`` default), and that would put transformers' own checkpointing
back on every layer: the plan silently dropped. So the switch that puts fastsft_lab's functions on the layers also
makes the model's two methods no-ops that warn once (:func:`guard`), and the switch that takes them off puts the
methods back (:func:`unguard`): an instance attribute set beside the change it protects, removed on the same way back
(``revert``, ``offload_buffers="off"``, ``memory_budget="off"``). Any Trainer then keeps the plan without a callback.
"""

from __future__ import annotations

import functools
import warnings
import weakref

from torch import nn

from ..model_state import state

METHODS = ("gradient_checkpointing_enable", "gradient_checkpointing_disable")
_MISSING = object()
_GUARDED: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()    # model -> what was there
_WARNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def _kept(ref: weakref.ref, name: str, *args, **kwargs) -> None:
    """The guarded method: leaves the model as it is, and says so once per model."""
    model = ref()
    if model is None or model in _WARNED:
        return
    _WARNED.add(model)
    plan = state(model).checkpointing == "plan"
    what = "the memory plan" if plan else "offloaded checkpointing"
    off = "memory_budget='off'" if plan else "offload_buffers='off'"
    warnings.warn(f"fastsft_lab: {name}() left the model as it is: {what} chooses each decoder layer's checkpointing "
                  "(transformers' Trainer calls gradient_checkpointing_enable() for gradient_checkpointing=True, "
                  f"TRL's default). For transformers' own checkpointing instead: fastsft_lab.apply(model, {off}) "
                  "first",
                  stacklevel=2)


def guard(model: nn.Module) -> None:
    """Make ``model``'s (a transformers model's) ``gradient_checkpointing_enable`` / ``_disable`` no-ops that warn once
    (a no-op when they are already)."""
    if model in _GUARDED:
        return
    _GUARDED[model] = {name: model.__dict__.get(name, _MISSING) for name in METHODS}
    ref = weakref.ref(model)          # the instance attribute must not keep the model alive
    for name in METHODS:
        model.__dict__[name] = functools.partial(_kept, ref, name)
    _WARNED.discard(model)


def unguard(model: nn.Module) -> None:
    """Put ``model``'s methods back exactly as :func:`guard` found them (a no-op when it is not guarded)."""
    saved = _GUARDED.pop(model, None)
    if saved is None:
        return
    for name, before in saved.items():
        if before is _MISSING:
            model.__dict__.pop(name, None)
        else:
            model.__dict__[name] = before
    _WARNED.discard(model)


def guarded(model: nn.Module) -> bool:
    """Whether ``model``'s checkpointing methods are guarded now."""
    return model in _GUARDED


__all__ = ["METHODS", "guard", "guarded", "unguard"]
