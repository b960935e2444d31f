"""Where things are in a transformers causal LM, under the wrappers a user puts around it.

``unwrap`` sees through DDP and ``torch.compile``; ``base_model`` also through PEFT, to the ``*ForCausalLM``;
``decoder_layers`` and ``model_device`` find the layers and the device every switch acts on; ``family_of`` names the
model's family record (:mod:`fastsft_lab.families`). No presets here (:mod:`fastsft_lab.models` builds models).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._compat import compiled_inner, ddp_inner, is_fsdp1
from .families import ModelFamily, get_family


def unwrap(model: nn.Module) -> nn.Module:
    """The model a user wrapped: through ``DistributedDataParallel`` / ``DataParallel`` and ``torch.compile``
    (PEFT and FSDP2's ``fully_shard``, which keep the module itself, stay). Every switch sees through them, so
    ``apply(DDP(model))`` and ``apply(model)`` do the same. FSDP1 is refused: it flattens the parameters."""
    inner = model
    for _ in range(8):
        if is_fsdp1(inner):
            raise ValueError("FSDP1 (FullyShardedDataParallel) is not supported: shard with FSDP2's "
                             "torch.distributed.fsdp.fully_shard (per decoder layer, then the root)")
        nxt = ddp_inner(inner) or compiled_inner(inner)
        if nxt is None:
            return inner
        inner = nxt
    return inner


def base_model(model: nn.Module) -> Any:
    """The transformers ``*ForCausalLM`` under DDP, ``torch.compile`` and PEFT wrappers (typed ``Any``: its methods,
    transformers' ``PreTrainedModel``'s, are not what ``nn.Module`` declares)."""
    inner: Any = unwrap(model)
    for _ in range(4):
        if hasattr(inner, "get_base_model"):
            inner = inner.get_base_model()
        else:
            break
    return inner


def family_of(model: nn.Module) -> ModelFamily:
    """The family record of ``model`` (wrappers seen through), from its ``config.model_type``; a one-line error
    naming the supported families when fastsft_lab has no record of it."""
    inner = base_model(model)
    config = getattr(inner, "config", None)
    return get_family(getattr(config, "model_type", None), what=type(inner).__name__)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a (possibly PEFT-wrapped) causal LM."""
    inner = base_model(model)
    layers = getattr(getattr(inner, "model", inner), "layers", None)
    if layers is None:
        raise ValueError(f"cannot find decoder layers on {type(inner).__name__}: unsupported model")
    return layers


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter that is not on the meta device."""
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    raise ValueError(f"{type(model).__name__} has no parameters on a real device (built on meta?)")


__all__ = ["unwrap", "base_model", "family_of", "decoder_layers", "model_device"]
