"""fastsft_lab: the glue-code optimizations that make LLM fine-tuning faster once the kernels are already fast.

Three optimizations, each behind a before/after toggle that can be flipped on a live model:

1. ``packed``  — packed-sequence attention metadata built once per batch and reused by every layer
   (``packed_metadata_cache``), with attention backends registered through transformers' attention registry.
2. ``offload`` — gradient checkpointing with CPU-offloaded layer inputs and double-buffered, prefetched reloads
   (``offload_buffers`` = 0 / 1 / 2).
3. ``moe``     — GPT-OSS / Qwen3-MoE expert routing grouped once (``moe_routing`` = naive / grouped / sync_free).

Foundation: ``models`` (presets, random-weight real-size builds, QLoRA), ``data`` (packer, synthetic corpus),
``profiling`` (host-sync counter, phase timers), ``bench`` (the harness behind ``python -m fastsft_lab bench``).
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBMODULES = ("env", "models", "data", "profiling", "bench", "packed", "offload", "moe", "timeline", "cli")


def __getattr__(name: str):
    # Submodules load on first use: importing fastsft_lab stays cheap and never fails on an optional package.
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in ("build_model", "LoraSettings", "PRESETS"):
        return getattr(importlib.import_module(f"{__name__}.models"), name)
    if name in ("SyncCounter", "count_syncs"):
        return getattr(importlib.import_module(f"{__name__}.profiling"), name)
    if name in ("apply", "revert"):
        return getattr(importlib.import_module(f"{__name__}.toggles"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["__version__", "apply", "revert", "build_model", "LoraSettings", "PRESETS", "SyncCounter", "count_syncs",
           *_SUBMODULES]
