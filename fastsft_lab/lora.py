"""A fused LoRA forward: the adapter's two matmuls in the activations' dtype, added into the base output in place.

A PEFT LoRA ``Linear`` computes ``y = base(x) + lora_B(lora_A(dropout(x))) * scaling``. As PEFT 0.21 runs it
(:func:`peft_lora_forward` below is that path, for reading side by side):

* without autocast it casts ``x`` to the adapters' dtype -- float32 for QLoRA -- a copy of the activations per
  adapted projection, runs both matmuls in float32, and turns the ``(tokens, out)`` product into a float32 sum
  with the base output, then back: on an H200 at Qwen3-14B width (8 layers, 8192 tokens, NF4 + LoRA r16 on all
  seven projections) that is 131 ms of a 415 ms step;
* under ``torch.autocast`` (what ``SFTTrainer(bf16=True)`` runs) the matmuls run in bf16, yet every projection
  still makes three more passes over a ``(tokens, out)`` tensor -- the scale multiply, the add, and for
  bitsandbytes' ``Linear4bit`` a defensive clone of the base output: 30 ms of the same step.

The fused forward (:func:`fused_lora_forward`) runs ``xa = dropout(x) @ A.T`` (``(tokens, rank)``, small) and then
``y.addmm_(xa, B.T, alpha=scaling)``: cuBLAS adds the scaled low-rank product into the base output in its epilogue
(one read and one write of ``y``, no temporary of that size). Both matmuls run in the dtype of the base output --
the activations' dtype, or the autocast dtype -- as autocast and Unsloth's LoRA kernels run them, accumulating in
float32 inside the GEMM. Gradients flow through autograd as usual: the adapters keep their own dtype (float32
for QLoRA) and receive float32 gradients.

Numbers: in float32 the fused forward equals PEFT's to float32 rounding. In bf16 it equals PEFT-under-autocast up
to rounding, and rounds less (one rounding of ``y + s * xa @ B.T`` where PEFT rounds the product, the scaled product
and the sum); without autocast PEFT computes the adapter in float32, which the fused forward does not (the tests
bound its error against a float32 reference by PEFT-under-autocast's).

The switch (:data:`FUSED_LORA`, ``apply(fused_lora=True)``, or :func:`enable_fused_lora`) puts the fused forward in
front of each plain-LoRA linear layer of one model (PEFT's ``Linear`` and bitsandbytes' ``Linear4bit`` /
``Linear8bitLt``; on the instances, through the model's restore log: the classes stay untouched) and refuses what
it cannot compute exactly: DoRA and other LoRA variants, LoRA biases. A call with ``adapter_names``, merged or
disabled adapters runs PEFT's own forward. :func:`disable_fused_lora` takes it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ._compat import peft_check_forward_args, tensor_is_view
from .model_state import state
from .restore import Optimization, changes, entries
from .structure import base_model

SWITCH = "fused_lora"


def _lora_linear_classes() -> tuple[type[nn.Module], ...]:
    """PEFT's LoRA layers whose forward is ``base(x) + B(A(dropout(x))) * scaling`` over ``nn.Linear`` adapters."""
    try:
        from peft.tuners.lora import layer
    except ImportError:
        return ()
    classes = [layer.Linear]
    try:
        from peft.tuners.lora import bnb

        classes += [c for c in (getattr(bnb, "Linear4bit", None), getattr(bnb, "Linear8bitLt", None)) if c]
    except ImportError:   # bitsandbytes missing: PEFT leaves its bnb module out
        pass
    return tuple(classes)


def peft_lora_forward(module, x: torch.Tensor, adapter: str) -> torch.Tensor:
    """The naive path, as PEFT 0.21's ``Linear.forward`` computes one adapter (for reading; not called)."""
    result = module.base_layer(x)
    lora_A, lora_B = module.lora_A[adapter], module.lora_B[adapter]
    x = x.to(lora_A.weight.dtype)                                   # without autocast: a float32 copy of x
    return (result + lora_B(lora_A(module.lora_dropout[adapter](x))) * module.scaling[adapter]).to(result.dtype)


def fused_lora_forward(self, original, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """PEFT LoRA ``Linear.forward`` with each active adapter added into the base output by one in-place GEMM
    (``original``: the layer's own forward)."""
    if self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None:
        return original(x, *args, **kwargs)
    peft_check_forward_args(self, x, *args, **kwargs)
    result = self.base_layer(x, *args, **kwargs)                    # (..., out)
    if tensor_is_view(result):
        # a view (some quantized bases return one): adding into it in place would rewrite what autograd saved
        result = result.clone()
    out2d = result.view(-1, result.shape[-1])                      # (N, out)
    dtype = result.dtype
    for name in self.active_adapters:
        if name not in self.lora_A:
            continue
        a = self.lora_A[name].weight.to(dtype)                      # (r, in)
        b = self.lora_B[name].weight.to(dtype)                      # (out, r)
        xd = self.lora_dropout[name](x).to(dtype)
        xa = xd.reshape(-1, xd.shape[-1]) @ a.t()                   # (N, r)
        out2d.addmm_(xa, b.t(), alpha=self.scaling[name])           # out += scaling * xa @ b.T, in the GEMM
    return result


def _check_plain_lora(name: str, module: Any) -> None:
    variants = getattr(module, "lora_variant", None) or {}
    if variants:
        kinds = ", ".join(sorted({type(v).__name__ for v in variants.values()}))
        raise NotImplementedError(f"fused LoRA computes plain LoRA; {name} uses a LoRA variant ({kinds}, e.g. "
                                  "DoRA): leave fused_lora off for this model")
    for adapter, lin in module.lora_B.items():
        if getattr(lin, "bias", None) is not None:
            raise NotImplementedError(f"fused LoRA takes adapters without bias; {name} (adapter {adapter!r}) has "
                                      "lora_bias=True: leave fused_lora off for this model")
        if not isinstance(lin, nn.Linear) or not isinstance(module.lora_A[adapter], nn.Linear):
            raise NotImplementedError(f"fused LoRA takes nn.Linear adapters; {name} (adapter {adapter!r}) has "
                                      f"{type(lin).__name__}")


def fused_lora_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The plain-LoRA linear layers of ``model`` the fused forward applies to, checked (raises on what it cannot
    compute exactly)."""
    classes = _lora_linear_classes()
    found = [(n, m) for n, m in model.named_modules() if classes and isinstance(m, classes)]
    for n, m in found:
        _check_plain_lora(n, m)
    return found


@dataclass
class FusedLora:
    """The ``fused_lora`` switch's record in the model's restore log."""

    layers: int

    def state(self) -> dict:
        return {"fused_lora": True}


def validate(model: nn.Module, value, options: dict) -> bool:
    """The ``fused_lora`` switch's checks: True or False, and PEFT LoRA layers it computes exactly."""
    if not isinstance(value, bool):
        raise ValueError(f"fused_lora must be True or False, got {value!r}")
    if not fused_lora_targets(model):
        raise ValueError(f"fused_lora=True needs PEFT LoRA linear layers; {type(base_model(model)).__name__} "
                         "has none")
    return value


def enable(model: nn.Module, value: bool = True) -> None:
    """Put :func:`fused_lora_forward` in front of every plain-LoRA linear layer's forward (checked by
    :func:`validate`)."""
    log = changes(model, SWITCH)
    targets = fused_lora_targets(model)
    for _, m in targets:
        log.forward(m, fused_lora_forward)
    log.record = FusedLora(len(targets))


FUSED_LORA = Optimization(SWITCH, validate, enable, off=(False,))


def enable_fused_lora(model: nn.Module):
    """Run every plain-LoRA linear layer of ``model`` through :func:`fused_lora_forward`.

    Raises:
        ValueError: the model has no PEFT LoRA linear layer.
        NotImplementedError: a LoRA variant (DoRA, ...) or a LoRA bias, before anything changes.
    """
    if not fused_lora_targets(model):
        raise ValueError(f"{type(model).__name__} has no PEFT LoRA linear layer (peft.get_peft_model with "
                         "LoraConfig): fused LoRA has nothing to fuse")
    enable(model)
    return state(model)


def disable_fused_lora(model: nn.Module):
    """PEFT's own forward on every layer again (a no-op when fused LoRA is off)."""
    FUSED_LORA.disable(model)
    return state(model)


def fused_lora_layers(model: nn.Module) -> int:
    """How many layers of ``model`` run the fused LoRA forward."""
    return sum(1 for e in entries(model, SWITCH) if e.name == "forward")


__all__ = ["FUSED_LORA", "enable_fused_lora", "disable_fused_lora", "fused_lora_forward", "fused_lora_layers",
           "fused_lora_targets", "peft_lora_forward"]
