"""The ``moe_routing`` switch on a live model, through transformers' experts registry.

The three forwards of :mod:`.experts` are registered once, at import, in
``transformers.integrations.moe.ExpertsInterface`` (as ``fastsft_naive`` / ``fastsft_grouped`` /
``fastsft_sync_free``); the decorated experts modules of the model-family record (``GptOssExperts``,
``Qwen3MoeExperts``, ``MixtralExperts``: :mod:`fastsft_lab.families`) then dispatch on
its config's experts implementation (:data:`fastsft_lab._compat.EXPERTS_IMPLEMENTATION`), which :data:`MOE` (``apply(moe_routing=...)``, or :func:`set_moe_routing`)
changes with the model's public ``set_experts_implementation``. What each config held before the first switch
(``grouped_mm`` for models built by ``from_config`` in transformers 5.x, ``eager`` if it was asked for) is kept in
the model's restore log and put back by ``set_moe_routing(model, None)``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

from torch import nn

from .._compat import EXPERTS_IMPLEMENTATION, experts_implementation_of, set_experts_implementation_of
from ..model_state import ModelState, state
from ..restore import Changes, Optimization, changes, is_on, record, undo
from ..structure import base_model
from .experts import FORWARDS
from .modules import experts_classes, experts_modules

SWITCH = "moe_routing"
MODES = ("naive", "grouped", "sync_free")
# Names under which our forwards are registered in transformers' experts registry.
IMPLEMENTATIONS = {"naive": "fastsft_naive", "grouped": "fastsft_grouped", "sync_free": "fastsft_sync_free"}
STOCK_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")


def _register() -> None:
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:  # pragma: no cover - transformers < 5
        raise ImportError("fastsft_lab.moe needs transformers >= 5 (the experts registry "
                          "transformers.integrations.moe.ExpertsInterface)") from e
    for mode, name in IMPLEMENTATIONS.items():
        ExpertsInterface.register(name, FORWARDS[mode])


_register()


@dataclass
class MoeRouting:
    """The ``moe_routing`` switch's record in the model's restore log: the mode it switched the experts to."""

    mode: str

    def state(self) -> dict:
        return {"moe_routing": self.mode}


def _set_implementation(log: Changes, model: nn.Module, impl: str) -> None:
    """``impl`` for every experts module, each config it writes kept in ``log`` first."""
    mods = experts_modules(model)
    base = base_model(model)
    configs = {id(c): c for c in [getattr(m, "config", None) for m in (base, *base.modules(), *mods)]
               if c is not None and hasattr(c, EXPERTS_IMPLEMENTATION)}
    for config in configs.values():
        log.keep(config, EXPERTS_IMPLEMENTATION)
    if hasattr(base, "set_experts_implementation"):
        # transformers' public switch: validates the name, reaches the sub-models' configs
        base.set_experts_implementation(impl)
    for m in mods:
        # a config the public switch does not reach (a bare experts module, a module with a config of its own)
        if experts_implementation_of(m.config) != impl:
            set_experts_implementation_of(m.config, impl)


def _mode_of(impl: str | None) -> str | None:
    for mode, name in IMPLEMENTATIONS.items():
        if impl == name:
            return mode
    return None


def experts_implementation(model: nn.Module) -> str | None:
    """The raw experts implementation of the model's experts' config (e.g. ``grouped_mm``, ``fastsft_grouped``)."""
    mods = experts_modules(model)
    return experts_implementation_of(mods[0].config) if mods else None


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


def validate(model: nn.Module, value, options: dict) -> str | None:
    """The ``moe_routing`` switch's check: a mode this model's experts take (one line otherwise)."""
    return check_moe_routing(model, value)


def enable(model: nn.Module, mode: str) -> None:
    """Switch the experts to ``mode`` (checked by :func:`validate`) through transformers' experts registry."""
    log = changes(model, SWITCH)
    _set_implementation(log, model, IMPLEMENTATIONS.get(mode, mode))
    log.record = MoeRouting(mode)


MOE = Optimization(SWITCH, validate, enable, off=("off", False))


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
    if mode is None:
        MOE.disable(model)
    else:
        enable(model, mode)
    return state(model)


def moe_routing_switched(model: nn.Module) -> bool:
    """Whether :func:`set_moe_routing` changed this model's experts (so that ``None`` has something to restore)."""
    return is_on(model, SWITCH)


@contextlib.contextmanager
def moe_routing(model: nn.Module, mode: str | None) -> Iterator[nn.Module]:
    """``with moe_routing(model, "sync_free"): ...`` - switch, and put back exactly what was there before."""
    before = record(model, SWITCH).mode if is_on(model, SWITCH) else None
    set_moe_routing(model, mode)
    try:
        yield model
    finally:
        if before is None:
            undo(model, SWITCH)
        else:
            enable(model, before)


__all__ = ["MOE", "MODES", "IMPLEMENTATIONS", "STOCK_IMPLEMENTATIONS", "set_moe_routing", "get_moe_routing",
           "experts_implementation", "moe_routing", "moe_routing_switched", "check_moe_routing"]
