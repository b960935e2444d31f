"""Offloaded checkpointing on a live model, on and off; transformers' own checkpointing with the same way back.

Every switch returns :func:`fastsft_lab.model_state.state` of the model after the change. The model's
:class:`~.manager.OffloadManager` (and its pinned pool) survives toggles: :func:`offload_manager` returns it.

Use with TRL/Trainer: while it is on, the model's ``gradient_checkpointing_enable()`` / ``_disable()`` (which the
Trainer calls for ``gradient_checkpointing=True``, TRL's default) leave the layers as they are and warn once
(:mod:`.guard`), so the trainer's flag may stay at its default. Where something else overwrites the layer functions,
:func:`state` reports the model's own checkpointing and the next forward warns once (:func:`displaced_layers`);
``apply`` again puts the offload back.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch import nn

from ..models import base_model, decoder_layers, model_device
from ..model_state import ModelState, register_state_reader, state
from .checkpoint import LayerCheckpointFunc
from .guard import guard, unguard
from .manager import OffloadManager, _check_buffers
from .streams import StreamOps

_MISSING = object()
_GC_ATTRS = ("gradient_checkpointing", "_gradient_checkpointing_func")
_MANAGERS: "weakref.WeakKeyDictionary[nn.Module, OffloadManager]" = weakref.WeakKeyDictionary()
_ORIGINALS: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()
_STANDARD: "weakref.WeakKeyDictionary[nn.Module, CheckpointingSwitch]" = weakref.WeakKeyDictionary()
_WATCHES: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()   # forward pre-hook handles
_WARNED_DISPLACED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def displaced_layers(model: nn.Module) -> int:
    """How many decoder layers no longer run fastsft_lab's checkpointing although it is on for ``model``: something
    (``model.gradient_checkpointing_enable()``, which transformers' Trainer calls for ``gradient_checkpointing=True``;
    ``gradient_checkpointing_disable()``) replaced their functions after ``apply``. 0 when it is off."""
    originals = _ORIGINALS.get(base_model(model))
    if originals is None:
        return 0
    return sum(1 for layer, _ in originals
               if not (getattr(layer, "gradient_checkpointing", False)
                       and getattr(layer._gradient_checkpointing_func, "fastsft_checkpointing", False)))


def _watch(model: nn.Module) -> None:
    """A forward pre-hook that warns once when the layers' checkpointing was replaced (removed by disable)."""
    key = base_model(model)
    if key in _WATCHES:
        return

    @torch.compiler.disable
    def check(module, args, kwargs):
        if key in _WARNED_DISPLACED or not torch.is_grad_enabled():
            return None
        n = displaced_layers(key)
        if n:
            _WARNED_DISPLACED.add(key)
            warnings.warn(f"fastsft_lab: {n} of {len(_ORIGINALS.get(key, ()))} decoder layers no longer run its "
                          "checkpointing (offload / memory plan): something replaced their checkpoint functions after "
                          "apply() (the model's gradient_checkpointing_enable() and _disable() are kept from it while "
                          "it is on); apply() again puts it back", stacklevel=2)
        return None

    _WATCHES[key] = key.register_forward_pre_hook(check, with_kwargs=True)


def _unwatch(model: nn.Module) -> None:
    key = base_model(model)
    handle = _WATCHES.pop(key, None)
    if handle is not None:
        handle.remove()
    _WARNED_DISPLACED.discard(key)


def _snapshot(module: nn.Module) -> tuple:
    return tuple(module.__dict__.get(name, _MISSING) for name in _GC_ATTRS)


def _restore(module: nn.Module, saved: tuple) -> None:
    for name, value in zip(_GC_ATTRS, saved):
        if value is _MISSING:
            module.__dict__.pop(name, None)
        else:
            module.__dict__[name] = value


def resolve_device(dev: torch.device) -> torch.device:
    """``cuda`` without an index is the process's current device (a rank's own under torchrun), never cuda:0."""
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


_WARNED_UNIFIED: set = set()


def unified_memory(dev: torch.device) -> bool:
    """Whether ``dev`` is a GPU that shares its memory with the host (DGX Spark / GB10, Jetson)."""
    return dev.type == "cuda" and bool(getattr(torch.cuda.get_device_properties(dev), "is_integrated", 0))


def warn_unified_memory(dev: torch.device, buffers: int, *, integrated: bool | None = None) -> bool:
    """Once per device: on a GPU that shares its memory with the host (DGX Spark / GB10, Jetson), offloading moves
    nothing off the GPU's memory and the second staging buffer only costs time and memory (Unsloth turns its double
    buffer off there). Returns whether it warned."""
    if buffers != 2 or dev.type != "cuda" or dev in _WARNED_UNIFIED:
        return False
    if integrated is None:
        integrated = unified_memory(dev)
    if not integrated:
        return False
    _WARNED_UNIFIED.add(dev)
    warnings.warn(f"{dev}: unified memory (the GPU shares "
                  "the host's memory), so offloaded checkpointing frees nothing and the second staging buffer only "
                  "adds copies; standard checkpointing (offload_buffers=0) is the better choice here", stacklevel=3)
    return True


def enable_offloaded_checkpointing(model: nn.Module, buffers: int = 2, prefetch: bool | None = None, *,
                                   preserve_rng_state: bool = True, forward_grad: bool = True,
                                   streams: StreamOps | None = None,
                                   device: torch.device | str | None = None) -> ModelState:
    """Checkpoint every decoder layer with its input offloaded to pinned CPU memory.

    Args:
        model: a transformers causal LM, possibly PEFT-wrapped (QLoRA works: only the layer input is copied).
        buffers: GPU staging buffers for the reloads. ``1`` is the single-buffer "before" (reload of layer k-1
            waits for layer k's backward); ``2`` (default) overlaps it, for one extra buffer of
            ``tokens x hidden x 2`` bytes (84 MB for Qwen3-14B at 8k tokens).
        prefetch: issue the reload of layer k-1 as soon as layer k's backward starts (default: on with 2
            buffers; not allowed with 1).
        preserve_rng_state: restore the RNG state for the recompute (dropout-exact, like torch checkpoint).
        forward_grad: run the offloaded forward with grad mode on, nothing saved (default; the same kernels as
            standard checkpointing) or, ``False``, under ``no_grad`` (see :class:`OffloadManager`).
        streams: a :class:`~.streams.StreamOps` to issue the stream operations through (benchmarks and tests);
            a new manager is made when it is given.
        device: compute device (default: the model's).

    Returns:
        The model's :class:`~fastsft_lab.model_state.ModelState`. Calling it again on an enabled model reconfigures it;
        :func:`disable_offloaded_checkpointing` restores what was there before the first call (standard
        checkpointing or none).
    """
    prefetch = _check_buffers(buffers, prefetch)
    key = base_model(model)
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        if not hasattr(layer, "gradient_checkpointing"):
            raise ValueError(f"decoder layer {i} ({type(layer).__name__}) is not a transformers "
                             "GradientCheckpointingLayer: offloaded checkpointing plugs in through that class")
    dev = resolve_device(torch.device(device) if device is not None else model_device(model))
    warn_unified_memory(dev, buffers)
    manager = _MANAGERS.get(key)
    if manager is None or manager.device != dev or streams is not None:
        # one manager (pinned pool, staging buffers, copy stream) per model and device: a model moved to another
        # GPU of the process (a rank's own) gets its own, never the first device's
        pool = manager.pool if manager is not None and manager.device == dev else None
        if manager is not None:
            manager.release_staging()
        manager = OffloadManager(dev, buffers, prefetch, preserve_rng_state=preserve_rng_state,
                                 forward_grad=forward_grad, streams=streams, pool=pool)
        _MANAGERS[key] = manager
    else:
        manager.configure(buffers, prefetch)
        manager.preserve_rng_state = preserve_rng_state
        manager.forward_grad = forward_grad
    if key not in _ORIGINALS:
        _ORIGINALS[key] = [(layer, _snapshot(layer)) for layer in layers]
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = True
        layer._gradient_checkpointing_func = LayerCheckpointFunc(manager, i, layer)
    guard(key)                  # the Trainer's gradient_checkpointing_enable() leaves them (guard.py)
    _WARNED_DISPLACED.discard(key)
    _watch(model)
    return state(model)


def disable_offloaded_checkpointing(model: nn.Module, *, release_pool: bool = False) -> ModelState:
    """Restore each decoder layer's checkpointing attributes exactly as they were before enabling.

    Frees the GPU staging buffers; the pinned pool is kept for the next enable unless ``release_pool``.
    A no-op on a model that is not enabled.
    """
    key = base_model(model)
    _unwatch(model)
    unguard(key)
    originals = _ORIGINALS.pop(key, None)
    if originals is not None:
        for layer, saved in originals:
            _restore(layer, saved)
    manager = _MANAGERS.get(key)
    if manager is not None:
        manager.release_staging()
        if release_pool:
            # Inputs still pending (a graph not yet back-propagated) keep this manager alive through their
            # autograd context; the pool memory goes when they do.
            if manager.pending == 0:
                manager.pool.clear()
            del _MANAGERS[key]
    return state(model)


def is_offloaded(model: nn.Module) -> bool:
    """Whether offloaded checkpointing is enabled on ``model``."""
    return base_model(model) in _ORIGINALS


def offload_manager(model: nn.Module) -> OffloadManager | None:
    """The model's manager (kept across disable/enable), or None."""
    return _MANAGERS.get(base_model(model))


# --- transformers' own checkpointing, with the same exact way back ----------------------------------------------------
class CheckpointingSwitch:
    """Turn transformers' own checkpointing on and off with an exact restore (layers and input-grad hooks).

    ``offload=True`` uses transformers' ``gradient_checkpointing_enable(offload=True)`` (``save_on_cpu`` inside each
    layer's checkpoint: a peer in the benchmarks).
    """

    def __init__(self, model: nn.Module, offload: bool = False):
        self.model = model
        self.offload = offload
        self._saved: list | None = None
        self._hooks_before: Any = _MISSING
        self._hook_before: Any = _MISSING

    @property
    def enabled(self) -> bool:
        return self._saved is not None

    def enable(self, model: nn.Module | None = None) -> None:
        if self._saved is not None:
            return
        inner = base_model(self.model)
        self._saved = [(m, _snapshot(m)) for m in inner.modules() if hasattr(m, "gradient_checkpointing")]
        self._hooks_before = inner.__dict__.get("_require_grads_hooks", _MISSING)
        self._hook_before = inner.__dict__.get("_require_grads_hook", _MISSING)
        kwargs: dict[str, Any] = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
        if self.offload:
            kwargs["offload"] = True
        inner.gradient_checkpointing_enable(**kwargs)

    def disable(self, model: nn.Module | None = None) -> None:
        if self._saved is None:
            return
        inner = base_model(self.model)
        for m, saved in self._saved:
            _restore(m, saved)
        # gradient_checkpointing_enable() registers an embedding hook that makes the first layer input require
        # grad (for reentrant checkpointing under PEFT); remove it unless it was there before.
        hooks = inner.__dict__.get("_require_grads_hooks", _MISSING)
        if hooks is not self._hooks_before and hooks is not _MISSING:
            for h in hooks:
                h.remove()
        for name, before in (("_require_grads_hooks", self._hooks_before), ("_require_grads_hook", self._hook_before)):
            if before is _MISSING:
                inner.__dict__.pop(name, None)
            else:
                inner.__dict__[name] = before
        self._saved = None


def enable_standard_checkpointing(model: nn.Module) -> ModelState:
    """transformers' non-reentrant gradient checkpointing on every decoder layer (a no-op when it is on already);
    :func:`disable_standard_checkpointing` restores the model exactly as it was before."""
    key = base_model(model)
    if key not in _STANDARD:
        if getattr(key, "is_gradient_checkpointing", False):
            return state(model)      # the user's own checkpointing: leave it (and its way back) to them
        switch = CheckpointingSwitch(model)
        switch.enable()
        _STANDARD[key] = switch
    return state(model)


def disable_standard_checkpointing(model: nn.Module) -> ModelState:
    """Undo :func:`enable_standard_checkpointing` (a no-op when it did not switch anything on)."""
    switch = _STANDARD.pop(base_model(model), None)
    if switch is not None:
        switch.disable()
    return state(model)


def _read_state(model: nn.Module) -> dict:
    manager = offload_manager(model)
    if not is_offloaded(model) or manager is None or displaced_layers(model):
        return {}          # off, or replaced since: the model's own checkpointing (model_state.checkpointing_of)
    return {"offload_buffers": manager.buffers, "prefetch": manager.prefetch, "checkpointing": "offload"}


register_state_reader("offload", _read_state)

__all__ = ["displaced_layers", "enable_offloaded_checkpointing", "disable_offloaded_checkpointing", "is_offloaded",
           "offload_manager",
           "CheckpointingSwitch", "enable_standard_checkpointing", "disable_standard_checkpointing"]
