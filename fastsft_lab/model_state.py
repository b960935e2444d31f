"""What is switched on, per model: the one value every switch of fastsft_lab returns.

Every switch keeps what it changed, and its record, in the model's restore log (:mod:`fastsft_lab.restore`);
:func:`state` reads the log: each switch that is on contributes what its record reports (``record.state()``).
A switch that changed nothing is off. This module imports none of the switches (no import cycle).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from torch import nn

from .restore import on_records
from .structure import base_model, unwrap


@dataclass(frozen=True)
class ModelState:
    """The optimizations on a model, as :func:`fastsft_lab.apply` and every per-optimization switch report them.

    Attributes:
        packed: packed-attention backend (``"sdpa"``, ``"varlen"``, ...) or None when off.
        packed_cache: True = metadata built once per batch, False = the naive per-layer rebuild (None when off).
        offload_buffers: 0 (no offload), 1 or 2 staging buffers.
        prefetch: offload prefetch on (False when no offload).
        checkpointing: ``"none"``, ``"standard"`` (transformers' own), ``"offload"`` or ``"plan"`` (a per-layer
            plan for a memory budget: :mod:`fastsft_lab.offload.plan`).
        moe_routing: the routing mode fastsft_lab switched the experts to (``"naive"`` / ``"grouped"`` /
            ``"sync_free"``, or a stock name asked for), None when it did not switch them.
        fused_loss: the loss is :func:`fastsft_lab.loss.linear_cross_entropy` (no logits materialised).
        fused_lora: the PEFT LoRA layers run :func:`fastsft_lab.lora.fused_lora_forward`.
        fused_dequant: bitsandbytes' NF4 layers run :func:`fastsft_lab.dequant.fused_dequant_forward`.
        memory_plan: with ``memory_budget``, the plan's choices per layer and its predicted peak (None otherwise).
    """

    packed: str | None = None
    packed_cache: bool | None = None
    offload_buffers: int = 0
    prefetch: bool = False
    checkpointing: str = "none"
    moe_routing: str | None = None
    fused_loss: bool = False
    fused_lora: bool = False
    fused_dequant: bool = False
    memory_plan: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def checkpointing_of(model: nn.Module) -> str:
    """``"standard"`` when transformers' own checkpointing is on for the decoder layers, else ``"none"``."""
    return "standard" if getattr(base_model(model), "is_gradient_checkpointing", False) else "none"


def state(model: nn.Module) -> ModelState:
    """The optimizations switched on for ``model`` right now."""
    model = unwrap(model)
    values: dict = {"checkpointing": checkpointing_of(model)}
    for rec in on_records(model):
        values.update(rec.state())
    return ModelState(**values)


__all__ = ["ModelState", "state", "checkpointing_of"]
