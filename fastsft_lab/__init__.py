"""fastsft_lab: the glue-code optimizations that make LLM fine-tuning faster once the kernels are already fast.

Three optimizations, each behind a before/after toggle that can be flipped on a live model:

1. ``packing`` -- packed-sequence attention metadata built once per batch and reused by every layer
   (``packed_metadata_cache``), with attention backends registered through transformers' attention registry.
2. ``offload`` -- gradient checkpointing with CPU-offloaded layer inputs and double-buffered, prefetched reloads
   (``offload_buffers`` = 0 / 1 / 2).
3. ``moe``     -- GPT-OSS / Qwen3-MoE expert routing grouped once (``moe_routing`` = naive / grouped / sync_free).

``fastsft_lab.apply(model, ...)`` / ``revert(model)`` switch them together; ``state(model)`` says what is on (each
switch's finer controls are in its package). Every change a switch makes goes through the model's restore log
(``restore``), which ``revert`` undoes. Foundation: ``models`` (presets, random-weight real-size builds, QLoRA),
``data`` (packer, synthetic corpus), ``profiling`` (host-sync counter, timers), ``evidence`` (equivalence checks).
``diagnose(model, batch)`` measures one training step of your own (what bounds it, its host syncs, launches, idle
and recompute) and predicts what each switch would win on it (``diagnosis``, over ``step_profile``, ``roofline`` and
``predict``). What measures and explains them
(scenarios, harness, plots, committed results, the ``python -m fastsft_lab`` CLI) is ``fastsft_lab.lab``, which
the library never imports.
"""

from __future__ import annotations

import importlib

__version__ = "0.2.0"

_SUBMODULES = ("env", "families", "structure", "models", "data", "profiling", "restore", "model_state", "toggles",
               "evidence", "loss", "lora", "dequant", "packing", "offload", "moe", "roofline", "step_profile",
               "predict", "diagnosis", "lab")
_NAMES = {
    "apply": "toggles", "revert": "toggles", "state": "model_state", "ModelState": "model_state",
    "build_model": "models", "LoraSettings": "models", "PRESETS": "models",
    "SyncCounter": "profiling", "count_syncs": "profiling",
    "PackedCollator": "packing", "PackedMetadata": "packing",
    "diagnose": "diagnosis", "Diagnosis": "diagnosis",
}


def __getattr__(name: str):
    # Submodules load on first use: importing fastsft_lab stays cheap and never fails on an optional package.
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _NAMES:
        return getattr(importlib.import_module(f"{__name__}.{_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["__version__", *_NAMES, *_SUBMODULES]
