"""NF4 expert weights: GPT-OSS's 3-D expert parameters stored as bitsandbytes NF4 codes, dequantized on demand.

GPT-OSS expert weights are 3-D ``nn.Parameter`` s, so bitsandbytes' ``Linear4bit`` does not apply.
:func:`quantize_experts_nf4` stores each 3-D weight as NF4 (bitsandbytes ``quantize_4bit``, blocksize 64, one
absmax per block, frozen) and the three routing modes compute through it without ever keeping a bf16 copy for
backward: ``naive``/``grouped`` dequantize only the experts that were hit, ``sync_free`` dequantizes the whole layer
once per forward (and once more in backward) so that one grouped matmul can run.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .matmul import grouped_mm
from .modules import experts_modules, spec_of

NF4_ATTR = "_fastsft_nf4"                     # NF4 metadata on an experts module (see quantize_experts_nf4)


def is_nf4(module: nn.Module) -> bool:
    return getattr(module, NF4_ATTR, None) is not None


def _check_nf4_not_lora(module: Any) -> None:
    # PEFT's target_parameters LoRA works by a parametrization of the 3-D nn.Parameter; an NF4 expert weight is a
    # packed uint8 buffer, so there is nothing for PEFT to parametrize: refuse clearly rather than compute without
    # the adapter.
    if hasattr(module, "parametrizations") and any(n in module.parametrizations for n in ("gate_up_proj", "down_proj")):
        raise NotImplementedError(
            "LoRA on NF4-quantized expert weights (PEFT target_parameters) is not supported: the NF4 store has no "
            "nn.Parameter for PEFT to parametrize. Use LoRA on the attention projections with NF4 experts, or keep "
            "the experts in bf16 to adapt them."
        )


def nf4_checked(module: nn.Module) -> bool:
    """True when the experts hold NF4 weights; LoRA on NF4 expert weights is refused with a clear error."""
    nf4 = is_nf4(module)
    if nf4:
        _check_nf4_not_lora(module)
    return nf4


def expert_weight(module: nn.Module, name: str) -> torch.Tensor:
    """The full (E, ., .) weight ``name`` in the module's own layout: PEFT-parametrized or NF4-dequantized."""
    return getattr(module, name)


def mat_b(module: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """(E, in, out) orientation for ``x @ w[e]`` / grouped_mm: GPT-OSS stores it so (the record's ``transposed``),
    Qwen3-MoE stores (E, out, in) for ``F.linear``; a transposed view costs nothing (grouped_mm takes either layout)."""
    return w if spec_of(module).transposed else w.transpose(-2, -1)


class NF4Weight:
    """Read access to one NF4-quantized 3-D expert weight registered as buffers on its experts module.

    Buffers (they move with ``module.to``): ``<name>_nf4`` (E, n/2) uint8 packed codes, ``<name>_absmax``
    (E, n/blocksize) float32, ``nf4_code`` (16,) the NF4 code book. ``n`` is the element count of one expert.
    """

    def __init__(self, module: nn.Module, name: str):
        self.module = module
        self.name = name
        meta = getattr(module, NF4_ATTR)
        self.shape: torch.Size = meta["shapes"][name]
        self.blocksize: int = meta["blocksize"]
        self.dtype: torch.dtype = meta["dtype"]

    def _state(self, absmax: torch.Tensor, numel: int):
        from bitsandbytes.functional import QuantState

        # A flat shape: bitsandbytes' CPU kernel mis-assigns blocks when the last dimension is not a multiple of the
        # blocksize (seen with bitsandbytes 0.50.2); the codes are flat anyway, so dequantize flat and view.
        return QuantState(absmax=absmax, shape=torch.Size([numel]), code=self.module.nf4_code,
                          blocksize=self.blocksize, quant_type="nf4", dtype=self.dtype)

    def dequantize(self, expert: int | None = None) -> torch.Tensor:
        """All experts (E, ., .) or one expert (., .), in the module's layout and compute dtype."""
        from bitsandbytes.functional import dequantize_4bit

        packed = getattr(self.module, f"{self.name}_nf4")          # buffers (nn.Module.__getattr__)
        absmax = getattr(self.module, f"{self.name}_absmax")
        per_expert = math.prod(self.shape[1:])
        if expert is None:
            flat = dequantize_4bit(packed.reshape(-1), self._state(absmax.reshape(-1), packed.numel() * 2))
            return flat.view(self.shape)
        flat = dequantize_4bit(packed[expert], self._state(absmax[expert], per_expert))
        return flat.view(self.shape[1:])

    def mat_b(self, expert: int | None = None) -> torch.Tensor:
        w = self.dequantize(expert)
        if spec_of(self.module).transposed:
            return w
        return w.transpose(-2, -1)


class _NF4ExpertMatmul(torch.autograd.Function):
    """``x @ W[e]`` for one NF4 expert; backward dequantizes again instead of keeping the bf16 weight alive."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, store: NF4Weight, expert: int) -> torch.Tensor:
        ctx.store, ctx.expert = store, expert
        return x @ store.mat_b(expert).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        w = ctx.store.mat_b(ctx.expert).to(grad.dtype)
        return grad @ w.transpose(-2, -1), None, None


class NF4GroupedMM(torch.autograd.Function):
    """Grouped ``x[offs_e-1:offs_e] @ W[e]`` over all NF4 experts: the layer is dequantized once in forward and
    once in backward (never saved), so QLoRA memory stays at 4 bits per expert weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offs: torch.Tensor, store: NF4Weight) -> torch.Tensor:
        ctx.store = store
        ctx.save_for_backward(offs)
        return grouped_mm(x, store.mat_b().to(x.dtype), offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (offs,) = ctx.saved_tensors
        w = ctx.store.mat_b().to(grad.dtype)
        return grouped_mm(grad.contiguous(), w.transpose(-2, -1), offs), None, None


def expert_matmul(module: nn.Module, name: str, x: torch.Tensor, expert: int,
                  weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W[expert]`` (without bias) for a plain or an NF4 weight."""
    if weight is None:
        return _NF4ExpertMatmul.apply(x, NF4Weight(module, name), expert)
    w = weight[expert]
    return x @ w if spec_of(module).transposed else F.linear(x, w)



@functools.lru_cache(maxsize=None)
def _nf4_class(base: type) -> type:
    """A subclass whose ``gate_up_proj`` / ``down_proj`` read the NF4 store (full dequantization on access), so that
    transformers' own forwards (``eager``, ``grouped_mm``) still run on an NF4 module - as a reference: they
    dequantize on every access and autograd keeps the bf16 copy for backward; our three modes do not."""

    def make(name: str):
        return property(lambda self: NF4Weight(self, name).dequantize(),
                        doc=f"{name} dequantized from NF4 (all experts)")

    return type(f"NF4{base.__name__}", (base,), {"gate_up_proj": make("gate_up_proj"),
                                                 "down_proj": make("down_proj"), "__module__": base.__module__})


def quantize_experts_nf4(model: nn.Module, *, blocksize: int = 64, compute_dtype: torch.dtype | None = None) -> int:
    """Store every 3-D expert weight of ``model`` as NF4 (frozen), in place. Returns the number of modules changed.

    Args:
        model: a transformers MoE model (PEFT-wrapped or not); LoRA on the experts' own weights is not supported
            with NF4 (raises ``NotImplementedError``), LoRA on attention is.
        blocksize: NF4 block (64, QLoRA's). One float32 absmax per block, not double-quantized: each expert's
            blocks are then a contiguous slice, so ``naive``/``grouped`` can dequantize a single expert and
            ``sync_free`` the whole layer in one call (cost: 0.5 bit/parameter of absmax instead of ~0.13).
        compute_dtype: dtype the weights are dequantized to (default: the weights' dtype).

    The quantization runs where the weights live (GPU or CPU). Biases stay in their dtype.
    """
    from bitsandbytes.functional import get_4bit_type, quantize_4bit

    # PEFT's target_parameters LoRA (ParamWrapper) parametrizes the 3-D nn.Parameter during each forward; after NF4
    # there is no parameter left to parametrize, so refuse up front instead of failing inside PEFT's forward.
    lora_wrapped = {id(getattr(m, "get_base_layer")()) for m in model.modules()
                    if hasattr(m, "parameter_name") and hasattr(m, "get_base_layer")}
    count = 0
    for module in experts_modules(model):
        if is_nf4(module):
            continue
        if id(module) in lora_wrapped:
            raise NotImplementedError(
                f"{type(module).__name__} carries PEFT LoRA on its expert weights (target_parameters; note that PEFT "
                "also maps gate_proj/up_proj/down_proj targets onto Qwen3-MoE experts). NF4 experts support LoRA on "
                "the attention projections only: pass target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj'], or "
                "keep the experts in bf16 to adapt them."
            )
        _check_nf4_not_lora(module)
        meta: dict[str, Any] = {"blocksize": blocksize, "shapes": {}, "dtype": None}
        for name in ("gate_up_proj", "down_proj"):
            param = dict(module.named_parameters(recurse=False)).get(name)
            if param is None:
                raise ValueError(f"{type(module).__name__} has no parameter {name!r} to quantize")
            per_expert = math.prod(param.shape[1:])
            if per_expert % blocksize or blocksize % 2:
                raise ValueError(f"{name}: {per_expert} elements per expert is not a multiple of the NF4 blocksize "
                                 f"{blocksize}")
            dtype = compute_dtype or param.dtype
            with torch.no_grad():
                packed, state = quantize_4bit(param.detach().reshape(-1).contiguous(), blocksize=blocksize,
                                              compress_statistics=False, quant_type="nf4")
            num_experts = param.shape[0]
            delattr(module, name)
            module.register_buffer(f"{name}_nf4", packed.view(num_experts, per_expert // 2))
            module.register_buffer(f"{name}_absmax", state.absmax.view(num_experts, per_expert // blocksize))
            meta["shapes"][name] = param.shape
            meta["dtype"] = dtype
            del param, packed, state
        module.register_buffer("nf4_code", get_4bit_type("nf4", device=module.gate_up_proj_nf4.device))
        setattr(module, NF4_ATTR, meta)
        module.__class__ = _nf4_class(type(module))
        count += 1
    return count


def dequantize_expert_weight(module: nn.Module, name: str, expert: int | None = None) -> torch.Tensor:
    """One NF4 expert weight (``gate_up_proj``/``down_proj``) dequantized: all experts, or one (module layout)."""
    if not is_nf4(module):
        raise ValueError(f"{type(module).__name__} has no NF4 expert store; call quantize_experts_nf4 first")
    return NF4Weight(module, name).dequantize(expert)


def nf4_expert_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by expert weights: NF4 store (codes + absmax) and what bf16 would take."""
    nf4 = bf16 = 0
    for m in experts_modules(model):
        if not is_nf4(m):
            continue
        for name in ("gate_up_proj", "down_proj"):
            packed, absmax = getattr(m, f"{name}_nf4"), getattr(m, f"{name}_absmax")
            nf4 += packed.numel() * packed.element_size() + absmax.numel() * absmax.element_size()
            bf16 += math.prod(getattr(m, NF4_ATTR)["shapes"][name]) * 2
    return {"nf4_bytes": nf4, "bf16_bytes": bf16}




__all__ = ["quantize_experts_nf4", "dequantize_expert_weight", "nf4_expert_bytes", "is_nf4", "NF4Weight",
           "expert_weight", "mat_b", "expert_matmul", "nf4_checked"]
