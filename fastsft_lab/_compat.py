"""Every framework name fastsft_lab reads that is private or version-dependent, in one place.

Each accessor says which versions it was checked on; ``tests/test_compat.py`` fails with a clear message when one
moves. Nothing else in the library reaches into a private torch / transformers / PEFT name.
"""

from __future__ import annotations

from torch import nn


# --- wrappers a user puts around a model --------------------------------------------------------------------------
def compiled_inner(module: nn.Module) -> nn.Module | None:
    """The module under ``torch.compile(module)`` (``OptimizedModule._orig_mod``; torch 2.6-2.13), or None."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:   # a torch without dynamo
        return None
    return module._orig_mod if isinstance(module, OptimizedModule) else None


def ddp_inner(module: nn.Module) -> nn.Module | None:
    """The module under ``DistributedDataParallel`` or ``DataParallel`` (public ``.module``), or None."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    return module.module if isinstance(module, (DistributedDataParallel, DataParallel)) else None


def is_fsdp1(module: nn.Module) -> bool:
    """FSDP1's ``FullyShardedDataParallel`` wrapper (it flattens parameters; fastsft_lab supports FSDP2)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return False
    return isinstance(module, FullyShardedDataParallel)


def is_fsdp2(module: nn.Module) -> bool:
    """A module ``fully_shard`` manages (FSDP2: the module's class becomes an ``FSDPModule``; torch 2.6-2.13)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


__all__ = ["compiled_inner", "ddp_inner", "is_fsdp1", "is_fsdp2"]
