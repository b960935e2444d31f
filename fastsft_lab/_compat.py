"""Every framework name fastsft_lab reads that is private or version-dependent, in one place.

Each accessor says which versions it was checked on; ``tests/unit/test_compat.py`` fails with a clear message when one
moves, and finds no private torch / transformers / PEFT / ... name in any other file of the package (the lab
included; its rule is written there). A private attribute a switch writes is named here (``ATTN_IMPLEMENTATION``,
``CHECKPOINT_FUNCTION``, ...) and written through the model's restore log (:mod:`fastsft_lab.restore`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree   # tree_flatten / tree_unflatten / tree_map_only (torch 2.0-2.13)
from torch.utils._python_dispatch import TorchDispatchMode   # a mode that sees every aten op (torch 2.0-2.13)


# --- wrappers a user puts around a model --------------------------------------------------------------------------
def compiled_inner(module: nn.Module) -> nn.Module | None:
    """The module under ``torch.compile(module)`` (``OptimizedModule._orig_mod``; torch 2.6-2.13), or None."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:   # a torch without dynamo
        return None
    return module._orig_mod if isinstance(module, OptimizedModule) else None


def compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` compiled it in place (``nn.Module._compiled_call_impl``; torch 2.2-2.13)."""
    return getattr(module, "_compiled_call_impl", None) is not None


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


def is_zero3_partitioned(params) -> bool:
    """Whether DeepSpeed ZeRO-3 partitions any of ``params`` (it marks each with ``ds_id``; deepspeed 0.10-0.17):
    between its gather hooks they are empty placeholders."""
    return any(hasattr(p, "ds_id") for p in params)


__all__ = ["compiled_inner", "ddp_inner", "is_fsdp1", "is_fsdp2", "is_zero3_partitioned"]


# --- torch ----------------------------------------------------------------------------------------------------------
def saved_tensors_hooks_enabled() -> bool:
    """Whether autograd's saved-tensor hooks may be set here (``torch._C._autograd._saved_tensors_hooks_is_enabled``,
    torch 2.1-2.13; they are disabled inside some compiled regions). True where torch has no such probe."""
    probe = getattr(torch._C._autograd, "_saved_tensors_hooks_is_enabled", None)
    return probe() if probe is not None else True


def checkpoint_valid() -> bool:
    """False inside ``torch.autograd.grad`` / ``backward(inputs=...)`` (``torch.autograd._is_checkpoint_valid``,
    torch 1.x-2.13): a nested backward cannot accumulate into ``.grad`` there."""
    return torch.autograd._is_checkpoint_valid()


def assert_async(cond: torch.Tensor, message: str) -> None:
    """Assert a device bool without a host sync (``torch._assert_async``, torch 2.0-2.13): a CPU tensor raises
    here; on CUDA a failure is a device-side assert at the next sync."""
    torch._assert_async(cond, message)


def dispatch_modes() -> list:
    """The active ``TorchDispatchMode`` stack (``torch.utils._python_dispatch``, torch 2.0-2.13)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return list(_get_current_dispatch_mode_stack())


def disable_dispatch_modes():
    """A context that steps out of every active ``TorchDispatchMode`` (torch 2.0-2.13)."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def flex_block_transpose():
    """flex attention's ``_transpose_ordered`` (block tables of the backward from the forward's; torch 2.5-2.13),
    or None where torch has none (the backward tables are then derived on the device)."""
    try:
        from torch.nn.attention.flex_attention import _transpose_ordered
    except ImportError:
        return None
    return _transpose_ordered


def has_triton() -> bool:
    """Whether Triton and a device it can compile for are present (``torch.utils._triton.has_triton``)."""
    try:
        from torch.utils._triton import has_triton as probe
    except ImportError:
        return False
    return probe()


def flash_attention_ops() -> tuple | None:
    """``(aten._flash_attention_forward, aten._flash_attention_backward)`` (torch 2.2-2.13), or None."""
    if not hasattr(torch.ops.aten, "_flash_attention_forward"):
        return None
    return torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward


def flash_forward_arguments() -> set[str]:
    """The argument names of ``aten._flash_attention_forward`` in this torch (its schema), or an empty set."""
    try:
        return {a.name for a in torch.ops.aten._flash_attention_forward.default._schema.arguments}
    except Exception:  # noqa: BLE001 - no such op, or a schema without arguments: nothing to offer
        return set()


# --- transformers ---------------------------------------------------------------------------------------------------
def output_collector():
    """transformers' context variable behind ``output_router_logits`` / ``output_hidden_states`` (its
    output-capturing hooks append what a layer records to it; ``transformers.utils.output_capturing
    ._active_collector``, transformers 5.0-5.17), or None where this transformers has none."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector


def flash_packed_helpers():
    """transformers' own per-layer packed flash helpers (``modeling_flash_attention_utils``, transformers
    5.0-5.17): ``(_is_packed_sequence, prepare_fa_kwargs_from_position_ids)``, which the naive varlen path calls
    to stay faithful to what stock transformers runs."""
    from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

    return _is_packed_sequence, prepare_fa_kwargs_from_position_ids


def set_experts_implementation_of(config, value: str) -> None:
    """Set one config's experts implementation where transformers' public ``set_experts_implementation`` does not
    reach (a bare experts module's config; ``_experts_implementation_internal``, transformers 5.0-5.17)."""
    config._experts_implementation_internal = value


__all__ += ["saved_tensors_hooks_enabled", "checkpoint_valid", "assert_async", "dispatch_modes",
            "disable_dispatch_modes", "TorchDispatchMode", "pytree", "flex_block_transpose", "has_triton",
            "flash_attention_ops", "flash_forward_arguments", "output_collector", "flash_packed_helpers",
            "set_experts_implementation_of"]


def dynamo_config():
    """``torch._dynamo.config`` (``recompile_limit``, ``fail_on_recompile_limit_hit``, ``patch``; torch 2.6-2.13)."""
    import torch._dynamo.config as config

    return config


def dynamo_errors() -> tuple[type, type]:
    """``(FailOnRecompileLimitHit, Unsupported)`` from ``torch._dynamo.exc`` (torch 2.6-2.13)."""
    import torch._dynamo.exc as exc

    return exc.FailOnRecompileLimitHit, exc.Unsupported


def grouped_mm_function():
    """The grouped matmul: ``torch.nn.functional.grouped_mm`` where public, else ``torch._grouped_mm``
    (torch 2.8-2.13), or None."""
    import torch.nn.functional as F

    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


__all__ += ["dynamo_config", "dynamo_errors", "grouped_mm_function"]



def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (``torch._C._current_graph_task_id``, -1
    outside one; torch 1.13-2.13): a forward that runs there is a checkpoint's recompute. False while compiling."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def bnb_fix_quant_state():
    """bitsandbytes' ``fix_4bit_weight_quant_state_from_module`` (0.43-0.50): puts a ``Linear4bit``'s quant state
    back on its weight where a wrapper rebuilt the parameter without it, as ``Linear4bit.forward`` does first."""
    from bitsandbytes.nn.modules import fix_4bit_weight_quant_state_from_module

    return fix_4bit_weight_quant_state_from_module


__all__ += ["in_backward", "bnb_fix_quant_state", "compiled_in_place"]


# --- private attributes of transformers' models that the switches write (through the restore log) and read ---------
ATTN_IMPLEMENTATION = "_attn_implementation"
"""A config's attention implementation (transformers 5.0-5.17: a property over ``_attn_implementation_internal``,
set on the sub-configs too). ``set_attn_implementation()`` validates and "adjusts" a name; this field does not."""

EXPERTS_IMPLEMENTATION = "_experts_implementation"
"""A config's experts implementation (transformers 5.0-5.17: a property over ``_experts_implementation_internal``)."""

CHECKPOINT_FUNCTION = "_gradient_checkpointing_func"
"""The checkpoint function a ``GradientCheckpointingLayer`` calls when ``gradient_checkpointing`` is on
(transformers 4.50-5.17: ``self._gradient_checkpointing_func(partial(super().__call__, **kwargs), *args)``)."""

REQUIRE_GRADS_HOOKS = ("_require_grads_hooks", "_require_grads_hook")
"""Where ``enable_input_require_grads()`` keeps the embedding hooks it registers (transformers 5.0-5.17: a list;
older: one handle)."""


def attn_implementation(config) -> str | None:
    """``config._attn_implementation``."""
    return getattr(config, ATTN_IMPLEMENTATION, None)


def set_attn_implementation_of(config, value: str | None) -> None:
    """Write ``config._attn_implementation`` as it is (for a call that needs another implementation for a while)."""
    setattr(config, ATTN_IMPLEMENTATION, value)


def experts_implementation_of(config) -> str | None:
    """``config._experts_implementation``."""
    return getattr(config, EXPERTS_IMPLEMENTATION, None)


def checkpoint_function(layer: nn.Module):
    """A decoder layer's ``_gradient_checkpointing_func`` (None where it has none)."""
    return getattr(layer, CHECKPOINT_FUNCTION, None)


def require_grads_hooks(model: nn.Module) -> list:
    """The handles of the embedding hooks ``enable_input_require_grads()`` registered on ``model``."""
    hooks = vars(model).get(REQUIRE_GRADS_HOOKS[0])
    if hooks is None:
        one = vars(model).get(REQUIRE_GRADS_HOOKS[1])
        return [one] if one is not None else []
    return list(hooks)


__all__ += ["ATTN_IMPLEMENTATION", "EXPERTS_IMPLEMENTATION", "CHECKPOINT_FUNCTION", "REQUIRE_GRADS_HOOKS",
            "attn_implementation", "set_attn_implementation_of", "experts_implementation_of", "checkpoint_function",
            "require_grads_hooks"]


# --- torch internals the library and the lab read -------------------------------------------------------------------
def tensor_version(t: torch.Tensor) -> int:
    """``t._version``: autograd's in-place counter of ``t``'s storage view (torch 1.x-2.13)."""
    return t._version


def tensor_is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor (``t._base``; torch 1.x-2.13)."""
    return t._base is not None


aten = torch.ops.aten
# aten overloads that public calls lower to, named privately by the dispatcher (torch 2.0-2.13); None where absent
ATEN_LOCAL_SCALAR_DENSE = aten._local_scalar_dense       # .item()
ATEN_UNIQUE = tuple(op for op in (getattr(aten, "_unique", None), getattr(aten, "_unique2", None)) if op is not None)
ATEN_UNSAFE_INDEX = getattr(aten, "_unsafe_index", None)  # what decompositions make of advanced indexing
ATEN_INDEX_PUT_IMPL = getattr(aten, "_index_put_impl_", None)
ATEN_TO_COPY = aten._to_copy                              # .to(device) / .cpu()
ATEN_RESHAPE_ALIAS = getattr(aten, "_reshape_alias", None)  # a view's relabelling of memory: no kernel
# the grouped matmul and the attention kernels (their outputs are what a selective checkpoint saves)
ATEN_MATMUL_AND_ATTENTION = tuple(op for op in (getattr(aten, name, None) for name in (
    "_grouped_mm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
    "_efficient_attention_forward")) if op is not None)


def empty_host_cache() -> None:
    """Release the pinned blocks torch's caching host allocator holds (``torch._C._host_emptyCache``, torch
    2.5-2.13; ``_cuda_hostEmptyCache`` before); a no-op where neither exists."""
    for name in ("_host_emptyCache", "_cuda_hostEmptyCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            fn()
            return


def cuda_sleep(cycles: int) -> None:
    """Keep the current CUDA stream busy for ``cycles`` SM clock cycles (``torch.cuda._sleep``, torch 1.x-2.13)."""
    torch.cuda._sleep(cycles)


def compiled_call(module: nn.Module):
    """What ``nn.Module.compile()`` put in front of the module's ``__call__`` (``_compiled_call_impl``, torch
    2.2-2.13), or None."""
    return getattr(module, "_compiled_call_impl", None)


def set_compiled_call(module: nn.Module, fn) -> None:
    """Run ``fn`` (a callable ``nn.Module.compile()`` made, or None: eager) when ``module`` is called."""
    module._compiled_call_impl = fn


def forward_hooks(module: nn.Module) -> tuple[dict, dict, set]:
    """``(pre-hooks, hooks, keys of the hooks that always run)`` of ``module`` (``_forward_pre_hooks``,
    ``_forward_hooks``, ``_forward_hooks_always_called``; torch 2.0-2.13), keyed by handle id."""
    return (module._forward_pre_hooks, module._forward_hooks, set(module._forward_hooks_always_called))


def remove_forward_hook(module: nn.Module, key: int) -> None:
    """Remove the forward (pre-)hook ``key`` of ``module`` from every table torch keeps it in (what a
    ``RemovableHandle`` does, for a hook whose handle someone else holds)."""
    for name in ("_forward_pre_hooks", "_forward_hooks", "_forward_hooks_always_called",
                 "_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs"):
        getattr(module, name, {}).pop(key, None)


# --- transformers / PEFT / xformers internals -------------------------------------------------------------------------
def experts_gate(module: Any, gate_up: torch.Tensor) -> torch.Tensor:
    """The gated activation of a transformers experts module (``_apply_gate``, transformers 5.0-5.17)."""
    return module._apply_gate(gate_up)


def peft_check_forward_args(module: Any, x, *args, **kwargs) -> None:
    """PEFT's argument check of a LoRA layer's forward (``_check_forward_args``, PEFT 0.17-0.21)."""
    module._check_forward_args(x, *args, **kwargs)


def xformers_has_cpp_library(xformers_module) -> bool:
    """Whether xformers' C++/CUDA extensions loaded (``xformers._has_cpp_library``; True where it is not said)."""
    return getattr(xformers_module, "_has_cpp_library", True) is not False


__all__ += ["tensor_version", "tensor_is_view", "ATEN_LOCAL_SCALAR_DENSE", "ATEN_UNIQUE", "ATEN_UNSAFE_INDEX",
            "ATEN_INDEX_PUT_IMPL", "ATEN_TO_COPY", "ATEN_RESHAPE_ALIAS", "ATEN_MATMUL_AND_ATTENTION", "empty_host_cache", "cuda_sleep",
            "compiled_call", "set_compiled_call", "forward_hooks", "remove_forward_hook", "experts_gate",
            "peft_check_forward_args", "xformers_has_cpp_library"]

# --- FSDP2 (torch.distributed.fsdp.fully_shard) -------------------------------------------------------------------
@contextlib.contextmanager
def fsdp2_hooks_as_in_recompute(modules):
    """Inside: the FSDP2 ``modules``' forward hooks run as they do in an activation checkpoint's recompute (their
    ``FSDPState._training_state`` at ``TrainingState.PRE_BACKWARD``; torch 2.6-2.13): the pre-forward hook only
    makes sure the parameters are unsharded and casts the inputs, the post-forward hook neither reshards nor
    registers a gradient hook -- so a forward + ``torch.autograd.grad`` there runs no collective and reduces no
    gradient. The states are put back on exit."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    states = [m._get_fsdp_state() for m in modules]
    before = [s._training_state for s in states]
    for s in states:
        s._training_state = TrainingState.PRE_BACKWARD
    try:
        yield
    finally:
        for s, b in zip(states, before):
            s._training_state = b


__all__ += ["fsdp2_hooks_as_in_recompute"]


# --- aten op schemas ------------------------------------------------------------------------------------------------
def written_tensors(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an aten op writes into (its schema's arguments marked as written: ``self`` of ``x.addmm_``, the
    ``out=`` of an out variant), from a ``TorchDispatchMode``'s ``(func, args, kwargs)`` (``OpOverload._schema``;
    torch 2.0-2.13)."""
    found: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        found += [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return found


__all__ += ["written_tensors"]
