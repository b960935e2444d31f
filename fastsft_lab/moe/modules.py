"""Finding the experts modules of a transformers MoE model, through the model-family record
(:mod:`fastsft_lab.families`: GPT-OSS, Qwen3-MoE, Mixtral)."""

from __future__ import annotations

import torch
from torch import nn

from ..families import FAMILIES, Experts, experts_family


def is_experts_module(module: nn.Module) -> bool:
    """The experts module of a family in the record (its transformers class, or the NF4 subclass of it): its forward
    dispatches on its config's experts implementation."""
    return experts_family(module) is not None


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """Every experts module of ``model`` (PEFT wrappers see through to the wrapped module)."""
    return [m for m in model.modules() if is_experts_module(m)]


def experts_classes() -> str:
    """``"GptOssExperts (gpt_oss), ..."`` - the experts modules the record knows, for error messages."""
    return ", ".join(f"{f.experts.class_name} ({f.name})" for f in FAMILIES.values() if f.experts is not None)


def spec_of(module: nn.Module) -> Experts:
    """The record of the experts module ``module`` (its family's :class:`~fastsft_lab.families.Experts`): layout,
    gate, routing weights. A module no record knows is refused in one line."""
    family = experts_family(module)
    if family is None or family.experts is None:
        raise ValueError(f"{type(module).__name__} is not an experts module of a family in fastsft_lab's record: "
                         f"{experts_classes()}")
    return family.experts


def top_k_weights(module: nn.Module, top_k_index: torch.Tensor, routing_weights: torch.Tensor) -> torch.Tensor:
    """The (T, k) routing weights of the chosen experts, whatever layout the family's router hands over: ``"top_k"``
    as is, ``"dense"`` (T, E) scores gathered at ``top_k_index``."""
    if spec_of(module).routing_weights == "dense":
        return routing_weights.gather(1, top_k_index)
    return routing_weights


__all__ = ["is_experts_module", "experts_modules", "experts_classes", "spec_of", "top_k_weights"]
