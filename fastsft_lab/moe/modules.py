"""Finding the experts modules of a transformers MoE model (GPT-OSS, Qwen3-MoE, ...)."""

from __future__ import annotations

from torch import nn


def is_experts_module(module: nn.Module) -> bool:
    """A transformers experts module whose forward dispatches on ``config._experts_implementation``."""
    return (getattr(type(module).forward, "__wrapped__", None) is not None and hasattr(type(module), "_apply_gate")
            and "is_transposed" in module.__dict__ and hasattr(module, "config") and hasattr(module, "num_experts"))


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """Every experts module of ``model`` (PEFT wrappers see through to the wrapped module)."""
    return [m for m in model.modules() if is_experts_module(m)]




__all__ = ["is_experts_module", "experts_modules"]
