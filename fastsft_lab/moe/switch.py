"""The ``moe_routing`` switch on a live model, through transformers' experts registry.

The three forwards of :mod:`.experts` are registered once, at import, in
``transformers.integrations.moe.ExpertsInterface`` (as ``fastsft_naive`` / ``fastsft_grouped`` /
``fastsft_sync_free``); the decorated experts modules of the model-family record (``GptOssExperts``,
``Qwen3MoeExperts``, ``MixtralExperts``: :mod:`fastsft_lab.families`) then dispatch on
``config._experts_implementation``, which :func:`set_moe_routing` changes with the model's public
``set_experts_implementation``. The implementation the model had before the first switch (``grouped_mm`` for models
built by ``from_config`` in transformers 5.x, ``eager`` if it was asked for) is recorded and put back by
``set_moe_routing(model, None)``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from torch import nn

from .._compat import set_experts_implementation_of
from ..models import base_model
from ..model_state import ModelState, register_state_reader, state
from .experts import FORWARDS
from .modules import experts_classes, experts_modules

MODES = ("naive", "grouped", "sync_free")
# Names under which our forwards are registered in transformers' experts registry.
IMPLEMENTATIONS = {"naive": "fastsft_naive", "grouped": "fastsft_grouped", "sync_free": "fastsft_sync_free"}
STOCK_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
_ORIGINAL_ATTR = "_fastsft_moe_original_impl"   # on the base model: what it ran before the first switch
_MODE_ATTR = "_fastsft_moe_mode"                # on the base model: the mode last switched to


def _register() -> None:
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:  # pragma: no cover - transformers < 5
        raise ImportError("fastsft_lab.moe needs transformers >= 5 (the experts registry "
                          "transformers.integrations.moe.ExpertsInterface)") from e
    for mode, name in IMPLEMENTATIONS.items():
        ExpertsInterface.register(name, FORWARDS[mode])


_register()


def _set_implementation(model: nn.Module, impl: str | list[str]) -> None:
    """``impl`` for every experts module (or, as a list, one value per module in :func:`experts_modules` order)."""
    mods = experts_modules(model)
    per_module = impl if isinstance(impl, list) else [impl] * len(mods)
    base = base_model(model)
    if hasattr(base, "set_experts_implementation"):
        # transformers' public switch: validates the name, reaches the sub-models' configs
        base.set_experts_implementation(per_module[0] if len(set(per_module)) == 1 else base.config._experts_implementation)
    for m, value in zip(mods, per_module):
        # a config the public switch does not reach (a bare experts module, a module with a config of its own)
        if m.config._experts_implementation != value:
            set_experts_implementation_of(m.config, value)


def _mode_of(impl: str | None) -> str | None:
    for mode, name in IMPLEMENTATIONS.items():
        if impl == name:
            return mode
    return None


def experts_implementation(model: nn.Module) -> str | None:
    """The raw ``config._experts_implementation`` of the model's experts (e.g. ``grouped_mm``, ``fastsft_grouped``)."""
    mods = experts_modules(model)
    return mods[0].config._experts_implementation if mods else None


def get_moe_routing(model: nn.Module) -> str | None:
    """The active mode (``naive``/``grouped``/``sync_free``), or None when the model runs a stock implementation."""
    return _mode_of(experts_implementation(model))


def check_moe_routing(model: nn.Module, mode) -> str | None:
    """Validate ``mode`` for ``model`` (one-line errors); returns it with ``"off"`` read as None."""
    if mode == "off":
        mode = None
    if mode is not None and (not isinstance(mode, str) or (mode not in MODES and mode not in STOCK_IMPLEMENTATIONS)):
        raise ValueError(f"moe_routing must be one of {', '.join(MODES)}, a stock implementation "
                         f"({', '.join(STOCK_IMPLEMENTATIONS)}), or None/'off'; got {mode!r}")
    if not experts_modules(model):
        raise ValueError(f"{type(base_model(model)).__name__} has no mixture-of-experts layers (no transformers "
                         f"experts module of a family in fastsft_lab's record: {experts_classes()}): leave "
                         "moe_routing unset")
    return mode


def set_moe_routing(model: nn.Module, mode: str | None) -> ModelState:
    """Switch the expert routing of a live model.

    Args:
        model: a transformers MoE model (GPT-OSS, Qwen3-MoE, ...), PEFT-wrapped or not.
        mode: ``"naive"`` (per-expert loop, ~2 host syncs per expert and layer), ``"grouped"`` (one host sync per
            layer), ``"sync_free"`` (no host sync; grouped matmul), or ``None``/``"off"`` to restore exactly the
            implementation the model had before the first switch. A stock name (``"eager"``, ``"grouped_mm"``,
            ``"batched_mm"``) is also accepted, for comparisons; ``None`` restores the original after it too.

    Returns:
        The model's :class:`~fastsft_lab.model_state.ModelState`.
    """
    mode = check_moe_routing(model, mode)
    base = base_model(model)
    if mode is None:
        if _ORIGINAL_ATTR in base.__dict__:
            _set_implementation(model, base.__dict__.pop(_ORIGINAL_ATTR))
            base.__dict__.pop(_MODE_ATTR, None)
        return state(model)
    if _ORIGINAL_ATTR not in base.__dict__:
        base.__dict__[_ORIGINAL_ATTR] = [m.config._experts_implementation for m in experts_modules(model)]
    _set_implementation(model, IMPLEMENTATIONS.get(mode, mode))
    base.__dict__[_MODE_ATTR] = mode
    return state(model)


def moe_routing_switched(model: nn.Module) -> bool:
    """Whether :func:`set_moe_routing` changed this model's experts (so that ``None`` has something to restore)."""
    return _ORIGINAL_ATTR in base_model(model).__dict__


@contextlib.contextmanager
def moe_routing(model: nn.Module, mode: str | None) -> Iterator[nn.Module]:
    """``with moe_routing(model, "sync_free"): ...`` - switch, and put back exactly what was there before."""
    base = base_model(model)
    impl_before = [m.config._experts_implementation for m in experts_modules(model)]
    record_before = {k: base.__dict__[k] for k in (_ORIGINAL_ATTR, _MODE_ATTR) if k in base.__dict__}
    set_moe_routing(model, mode)
    try:
        yield model
    finally:
        _set_implementation(model, impl_before)
        for k in (_ORIGINAL_ATTR, _MODE_ATTR):
            base.__dict__.pop(k, None)
        base.__dict__.update(record_before)


def _read_state(model: nn.Module) -> dict:
    mode = base_model(model).__dict__.get(_MODE_ATTR)
    return {"moe_routing": mode} if mode is not None else {}


register_state_reader("moe", _read_state)

__all__ = ["MODES", "IMPLEMENTATIONS", "STOCK_IMPLEMENTATIONS", "set_moe_routing", "get_moe_routing",
           "experts_implementation", "moe_routing", "moe_routing_switched", "check_moe_routing"]
