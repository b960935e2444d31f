"""Offloaded checkpointing on a live model, on and off; transformers' own checkpointing with the same way back.

:data:`OFFLOAD` is the switch :func:`fastsft_lab.apply` turns (``offload_buffers=`` 0 / 1 / 2, ``prefetch=``): every
change goes through the model's restore log (:mod:`fastsft_lab.restore`), and its record, :class:`Offloading`,
holds the model's :class:`~.manager.OffloadManager` (pinned pool, staging buffers, copy stream) and each decoder
layer's checkpoint function. The memory plan offloads through the same two calls (:func:`make_offloading`,
:func:`checkpoint_layers`). The functions below are the finer controls; each returns
:func:`fastsft_lab.model_state.state` of the model after the change.

Use with TRL/Trainer: while it is on, the model's ``gradient_checkpointing_enable()`` / ``_disable()`` (which the
Trainer calls for ``gradient_checkpointing=True``, TRL's default) leave the layers as they are and warn once
(:mod:`.guard`), so the trainer's flag may stay at its default. Where something else overwrites the layer functions,
:func:`state` reports the model's own checkpointing and the next forward warns once (:func:`displaced_layers`);
``apply`` again puts the offload back.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
from torch import nn

from .._compat import CHECKPOINT_FUNCTION, REQUIRE_GRADS_HOOKS, checkpoint_function, require_grads_hooks
from ..model_state import ModelState, state
from ..restore import Changes, Optimization, changes, is_on, log_of, record, undo
from ..structure import base_model, decoder_layers, model_device
from .checkpoint import LayerCheckpointFunc
from .guard import guard
from .manager import OffloadManager
from .pool import PinnedPool
from .streams import StreamOps

SWITCH = "offload_buffers"


def check_buffers(buffers, prefetch) -> bool:
    """One-line errors for a staging-buffer count and a prefetch setting; returns prefetch resolved (default: on
    with two buffers)."""
    if isinstance(buffers, bool) or not isinstance(buffers, int) or buffers not in (1, 2):
        raise ValueError(f"buffers must be 1 (single staging buffer) or 2 (double buffer), got {buffers!r}")
    if prefetch is None:
        prefetch = buffers == 2
    if not isinstance(prefetch, bool):
        raise ValueError(f"prefetch must be True, False or None (default: on with 2 buffers), got {prefetch!r}")
    if prefetch and buffers == 1:
        raise ValueError("prefetch needs buffers=2: with one staging buffer the next reload would overwrite "
                         "the input of the layer being back-propagated")
    return prefetch


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


# --- the layers' checkpoint functions, installed and watched: what the offload switch and the memory plan share ------
def not_running(pairs: Iterable[tuple[nn.Module | None, Any]]) -> int:
    """How many of the (layer, checkpoint function) pairs have a layer that does not run that function now."""
    return sum(1 for layer, fn in pairs
               if layer is None or not (getattr(layer, "gradient_checkpointing", False)
                                        and checkpoint_function(layer) is fn))


def displaced_layers(model: nn.Module) -> int:
    """How many decoder layers no longer run the checkpoint function a switch of fastsft_lab set (offload, memory
    plan): something (``model.gradient_checkpointing_enable()``, which transformers' Trainer calls for
    ``gradient_checkpointing=True``; ``gradient_checkpointing_disable()``) replaced it after ``apply``. 0 when none
    is set."""
    log = log_of(model)
    if log is None:
        return 0
    latest = {id(e.target): (e.target, e.value) for e in log.entries
              if e.kind == "set" and e.name == CHECKPOINT_FUNCTION}
    return not_running(latest.values())


def _watch(log: Changes, model: nn.Module, layers: int) -> None:
    """A forward pre-hook that warns once when the layers' checkpointing was replaced (removed with the switch)."""
    key = base_model(model)
    warned: list[bool] = []

    @torch.compiler.disable
    def check(module, args, kwargs):
        if warned or not torch.is_grad_enabled():
            return None
        n = displaced_layers(key)
        if n:
            warned.append(True)
            warnings.warn(f"fastsft_lab: {n} of {layers} decoder layers no longer run its "
                          "checkpointing (offload / memory plan): something replaced their checkpoint functions after "
                          "apply() (the model's gradient_checkpointing_enable() and _disable() are kept from it while "
                          "it is on); apply() again puts it back", stacklevel=2)
        return None

    log.hook(key.register_forward_pre_hook(check, with_kwargs=True))


def checkpoint_layers(log: Changes, model: nn.Module, functions: list[Callable]) -> None:
    """Give decoder layer ``i`` the checkpoint function ``functions[i]`` (checkpointing on), through ``log``; keep the
    model's own checkpointing methods from replacing them (:mod:`.guard`), and watch for anything else that does."""
    layers = decoder_layers(model)
    for layer, fn in zip(layers, functions):
        log.set(layer, "gradient_checkpointing", True)
        log.set(layer, CHECKPOINT_FUNCTION, fn)
    guard(log, model)           # the Trainer's gradient_checkpointing_enable() leaves them (guard.py)
    _watch(log, model, len(layers))


def check_checkpointing_layers(model: nn.Module) -> None:
    """One line refusing a model whose decoder layers are not transformers ``GradientCheckpointingLayer`` s."""
    for i, layer in enumerate(decoder_layers(model)):
        if not hasattr(layer, "gradient_checkpointing"):
            raise ValueError(f"decoder layer {i} ({type(layer).__name__}) is not a transformers "
                             "GradientCheckpointingLayer: offloaded checkpointing plugs in through that class")


@dataclass(eq=False)
class Offloading:
    """Offloaded checkpointing of one model: its manager and each decoder layer's checkpoint function (the
    offload switch's record; the memory plan's offloaded layers use one too)."""

    manager: OffloadManager
    functions: list[LayerCheckpointFunc]
    layers: list = field(default_factory=list)          # weakrefs to the decoder layers
    owns_pool: bool = True                              # False: the caller's pool, kept when this one goes

    def displaced(self) -> int:
        return not_running((ref(), fn) for ref, fn in zip(self.layers, self.functions))

    def state(self) -> dict:
        if self.displaced():
            return {}          # replaced since: the model's own checkpointing (model_state.checkpointing_of)
        return {"offload_buffers": self.manager.buffers, "prefetch": self.manager.prefetch,
                "checkpointing": "offload"}

    def close(self) -> None:
        """Let the manager's memory go: the staging buffers, and the pinned pool when no input waits for a backward
        (inputs still pending keep this manager alive through their autograd context; the pool goes with them)."""
        self.manager.release_staging()
        if self.owns_pool and self.manager.pending == 0:
            self.manager.pool.clear()


def make_offloading(model: nn.Module, buffers: int = 2, prefetch: bool = True, *,
                    preserve_rng_state: bool = True, forward_grad: bool = True, streams: StreamOps | None = None,
                    device: torch.device | str | None = None, pool: PinnedPool | None = None,
                    reuse: Offloading | None = None) -> Offloading:
    """A manager and one offloaded checkpoint function per decoder layer of ``model``, changing nothing on it (the
    arguments as :func:`enable_offloaded_checkpointing` takes them, checked by :func:`check_buffers`). ``pool``: a pinned pool of the
    caller's (kept by the caller across toggles); ``reuse``: an earlier offloading of the model, whose manager (and
    pinned pool) carries on where the device is the same."""
    layers = decoder_layers(model)
    dev = resolve_device(torch.device(device) if device is not None else model_device(model))
    warn_unified_memory(dev, buffers)
    given = pool
    manager = reuse.manager if reuse is not None else None
    if pool is not None and manager is not None and manager.pool is not pool:
        manager = None
    if manager is None or manager.device != dev or streams is not None:
        # one manager (pinned pool, staging buffers, copy stream) per model and device: a model moved to another
        # GPU of the process (a rank's own) gets its own, never the first device's
        if pool is None and manager is not None and manager.device == dev:
            pool = manager.pool
        if manager is not None:
            manager.release_staging()
        manager = OffloadManager(dev, buffers, prefetch, preserve_rng_state=preserve_rng_state,
                                 forward_grad=forward_grad, streams=streams, pool=pool)
    else:
        manager.configure(buffers, prefetch)
        manager.preserve_rng_state = preserve_rng_state
        manager.forward_grad = forward_grad
    owns_pool = given is None and (reuse is None or manager.pool is not reuse.manager.pool or reuse.owns_pool)
    return Offloading(manager, [LayerCheckpointFunc(manager, i, layer) for i, layer in enumerate(layers)],
                      [weakref.ref(layer) for layer in layers], owns_pool)


# --- transformers' own checkpointing, through the same log ----------------------------------------------------------
@dataclass(eq=False)
class StandardCheckpointing:
    """transformers' own checkpointing, switched on by fastsft_lab (``offload_buffers=0``): the model reports it."""

    def state(self) -> dict:
        return {}


def _transformers_checkpointing(log: Changes, model: nn.Module, *, offload: bool = False) -> None:
    """transformers' non-reentrant ``gradient_checkpointing_enable()``, every field and hook it writes kept in
    ``log`` (``offload=True``: its ``save_on_cpu`` inside each layer's checkpoint)."""
    inner = base_model(model)
    for m in inner.modules():
        if hasattr(m, "gradient_checkpointing"):
            log.keep(m, "gradient_checkpointing", CHECKPOINT_FUNCTION)
    log.keep(inner, *REQUIRE_GRADS_HOOKS)
    before = {id(h) for h in require_grads_hooks(inner)}
    kwargs: dict[str, Any] = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    if offload:
        kwargs["offload"] = True
    inner.gradient_checkpointing_enable(**kwargs)
    # the embedding hook that makes the first layer's input require grad (reentrant checkpointing under PEFT)
    for h in require_grads_hooks(inner):
        if id(h) not in before:
            log.hook(h)


class CheckpointingSwitch:
    """Turn transformers' own checkpointing on and off with an exact restore (layers and input-grad hooks), through
    the model's restore log (a switch of its own: ``revert`` takes it back too).

    ``offload=True`` uses transformers' ``gradient_checkpointing_enable(offload=True)`` (``save_on_cpu`` inside each
    layer's checkpoint: a peer in the benchmarks).
    """

    def __init__(self, model: nn.Module, offload: bool = False):
        self.model = model
        self.offload = offload
        self.switch = "transformers_checkpointing" + ("_offload" if offload else "")

    @property
    def enabled(self) -> bool:
        return is_on(self.model, self.switch)

    def enable(self, model: nn.Module | None = None) -> None:
        if not self.enabled:
            _transformers_checkpointing(changes(self.model, self.switch), self.model, offload=self.offload)

    def disable(self, model: nn.Module | None = None) -> None:
        undo(self.model, self.switch)


# --- the switch -----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OffloadSettings:
    """The offload switch's settings, as ``apply(offload_buffers=...)`` takes them: a count of staging buffers, or
    this for the seams a benchmark needs (the arguments of :func:`enable_offloaded_checkpointing`; ``pool``: a pinned
    pool the caller keeps across toggles)."""

    buffers: int                   # 0 = transformers' standard checkpointing
    prefetch: bool | None = None
    preserve_rng_state: bool = True
    forward_grad: bool = True
    streams: StreamOps | None = None
    device: torch.device | str | None = None
    pool: PinnedPool | None = None


def validate(model: nn.Module, value, options: dict) -> OffloadSettings:
    """The ``offload_buffers`` switch's checks (``prefetch`` is its mode): one-line errors, nothing changed."""
    prefetch = options.get("prefetch")
    if value is None:
        raise ValueError("prefetch needs offload_buffers=2")
    if isinstance(value, OffloadSettings):
        check_checkpointing_layers(model)
        prefetch = value.prefetch if prefetch is None else prefetch
        return dataclasses.replace(value, prefetch=check_buffers(value.buffers, prefetch))
    if isinstance(value, bool) or not isinstance(value, int) or value not in (0, 1, 2):
        raise ValueError(f"offload_buffers must be 0 (standard checkpointing), 1 or 2, got {value!r}")
    if value == 0:
        if prefetch:
            raise ValueError("prefetch needs offload_buffers=2")
        return OffloadSettings(0)
    check_checkpointing_layers(model)
    return OffloadSettings(value, check_buffers(value, prefetch))


def enable(model: nn.Module, settings: OffloadSettings) -> None:
    """Switch checkpointing to ``settings`` (checked by :func:`validate`): offloaded, or transformers' own."""
    current = record(model, SWITCH)
    if settings.buffers == 0:
        if isinstance(current, StandardCheckpointing) and is_on(model, SWITCH):
            return
        undo(model, SWITCH)
        if getattr(base_model(model), "is_gradient_checkpointing", False):
            return      # the user's own checkpointing: leave it (and its way back) to them
        log = changes(model, SWITCH)
        _transformers_checkpointing(log, model)
        log.record = StandardCheckpointing()
        return
    reuse = current if isinstance(current, Offloading) else None
    undo(model, SWITCH, keep_record=True)          # the layers as they were; the manager carries on
    offloading = make_offloading(model, settings.buffers, settings.prefetch,
                                 preserve_rng_state=settings.preserve_rng_state, forward_grad=settings.forward_grad,
                                 streams=settings.streams, device=settings.device, pool=settings.pool, reuse=reuse)
    log = changes(model, SWITCH)
    log.record = offloading
    checkpoint_layers(log, model, offloading.functions)
    log.callback(offloading.manager.release_staging)


OFFLOAD = Optimization(SWITCH, validate, enable, off=("off", False), options=("prefetch",))


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
    prefetch = check_buffers(buffers, prefetch)
    check_checkpointing_layers(model)
    enable(model, OffloadSettings(buffers, prefetch, preserve_rng_state, forward_grad, streams, device))
    return state(model)


def disable_offloaded_checkpointing(model: nn.Module, *, release_pool: bool = False) -> ModelState:
    """Restore each decoder layer's checkpointing attributes exactly as they were before enabling.

    Frees the GPU staging buffers; the manager and its pinned pool are kept for the next enable unless
    ``release_pool``. A no-op on a model that is not offloaded.
    """
    if isinstance(record(model, SWITCH), Offloading):
        undo(model, SWITCH, keep_record=not release_pool)
    return state(model)


def is_offloaded(model: nn.Module) -> bool:
    """Whether offloaded checkpointing is enabled on ``model``."""
    return isinstance(record(model, SWITCH), Offloading) and is_on(model, SWITCH)


def offload_manager(model: nn.Module) -> OffloadManager | None:
    """The manager of the model's offloaded layers -- the offload switch's (kept across its disable and enable) or
    the memory plan's -- or None."""
    log = log_of(model)
    for rec in (log.records.values() if log is not None else ()):
        offloading = rec if isinstance(rec, Offloading) else getattr(rec, "offloading", None)
        if isinstance(offloading, Offloading):
            return offloading.manager
    return None


def enable_standard_checkpointing(model: nn.Module) -> ModelState:
    """transformers' non-reentrant gradient checkpointing on every decoder layer (``offload_buffers=0``; a no-op
    when it is on already); :func:`disable_standard_checkpointing` restores the model exactly as it was before."""
    enable(model, OffloadSettings(0))
    return state(model)


def disable_standard_checkpointing(model: nn.Module) -> ModelState:
    """Undo :func:`enable_standard_checkpointing` (a no-op when it did not switch anything on)."""
    if isinstance(record(model, SWITCH), StandardCheckpointing):
        undo(model, SWITCH)
    return state(model)


__all__ = ["OFFLOAD", "Offloading", "OffloadSettings", "StandardCheckpointing", "check_buffers", "displaced_layers",
           "enable_offloaded_checkpointing", "disable_offloaded_checkpointing", "is_offloaded", "offload_manager",
           "make_offloading", "checkpoint_layers", "not_running", "CheckpointingSwitch", "enable_standard_checkpointing",
           "disable_standard_checkpointing", "resolve_device", "unified_memory", "warn_unified_memory"]
