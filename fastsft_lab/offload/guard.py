"""transformers' ``gradient_checkpointing_enable()`` / ``_disable()`` kept from replacing fastsft_lab's checkpointing.

While offloaded checkpointing or a memory plan is on, each decoder layer's checkpoint function is fastsft_lab's.
transformers' ``Trainer`` calls ``model.gradient_checkpointing_enable()`` inside ``train()`` when
``gradient_checkpointing=True`` (TRL's ``SFTConfig`` default), and that would put transformers' own checkpointing
back on every layer: the plan silently dropped. So the switch that puts fastsft_lab's functions on the layers also
makes the model's two methods no-ops that warn once (:func:`guard`), through the same restore log: they come back
with the change they protect (``revert``, ``offload_buffers="off"``, ``memory_budget="off"``). Any Trainer then keeps
the plan without a callback.
"""

from __future__ import annotations

import functools
import warnings
import weakref

from torch import nn

from ..model_state import state
from ..restore import Changes, log_of
from ..structure import base_model

METHODS = ("gradient_checkpointing_enable", "gradient_checkpointing_disable")


def _kept(ref: weakref.ref, name: str, warned: list, *args, **kwargs) -> None:
    """The guarded method: leaves the model as it is, and says so once (per switch-on)."""
    model = ref()
    if model is None or warned:
        return
    warned.append(True)
    plan = state(model).checkpointing == "plan"
    what = "the memory plan" if plan else "offloaded checkpointing"
    off = "memory_budget='off'" if plan else "offload_buffers='off'"
    warnings.warn(f"fastsft_lab: {name}() left the model as it is: {what} chooses each decoder layer's checkpointing "
                  "(transformers' Trainer calls gradient_checkpointing_enable() for gradient_checkpointing=True, "
                  f"TRL's default). For transformers' own checkpointing instead: fastsft_lab.apply(model, {off}) "
                  "first",
                  stacklevel=2)


def guard(log: Changes, model: nn.Module) -> None:
    """Make ``model``'s (a transformers model's) ``gradient_checkpointing_enable`` / ``_disable`` no-ops that warn
    once, as changes of ``log``'s switch."""
    base = base_model(model)
    ref = weakref.ref(base)           # the instance attribute must not keep the model alive
    warned: list[bool] = []
    for name in METHODS:
        log.set(base, name, functools.partial(_kept, ref, name, warned))


def guarded(model: nn.Module) -> bool:
    """Whether ``model``'s checkpointing methods are guarded now."""
    log = log_of(model)
    return log is not None and any(e.kind == "set" and e.name == METHODS[0] for e in log.entries)


__all__ = ["METHODS", "guard", "guarded"]
