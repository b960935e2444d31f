"""Optimization 2: CPU-offloaded gradient checkpointing with double-buffered, prefetched reloads.

Gradient checkpointing keeps only each decoder layer's *input* and recomputes the layer in backward. Offloading
moves that input to pinned CPU memory in forward and reloads it in backward, so the GPU holds no activations
between the forward and the backward of a layer (``layers x tokens x hidden`` bytes freed: 6.7 GB for Qwen3-14B
at 16k tokens and 40 layers).

The reload is where time goes. With ONE GPU staging buffer the reload of layer k-1 cannot start before the
backward of layer k (which reads that buffer) is finished, so the copy stream and the compute stream take turns::

    compute  | bwd L9 |        | bwd L8 |        | bwd L7 |
    copy     |        | h2d L8 |        | h2d L7 |            <- every reload is exposed

With TWO buffers (slot = layer parity, one "free" and one "ready" event per slot) the reload of layer k-1 runs
while layer k computes; with ``prefetch`` it is issued the moment layer k's backward starts, before its kernels::

    compute  | bwd L9 | bwd L8 | bwd L7 |
    copy     | h2d L8 | h2d L7 | h2d L6 |                    <- hidden behind compute

Layout: ``pool.py`` (pinned host slots), ``streams.py`` (every stream operation, issued on CUDA and logged; the
stream-order model that checks the log), ``policy.py`` (which staging slot a layer uses: the 1-vs-2 buffer policy),
``manager.py`` (save in forward, reload and prefetch in backward), ``checkpoint.py`` (the layer's checkpoint
function: recompute with RNG and autocast replayed), ``switch.py`` (on a live model: the ``offload_buffers`` switch),
``plan.py`` (the ``memory_budget`` switch: a checkpointing plan per layer), ``solver.py`` and ``saved.py`` (its
solver and its offloaded saved activations).

Side outputs that transformers records inside a layer (router logits for MoE's load-balancing loss, which TRL
turns on for MoE models; hidden states) leave the offloaded forward as outputs of their own, and their gradient
goes through the layer's recompute (``checkpoint.py``). Not supported (clear errors): backward twice through the
same graph (``retain_graph=True``), and side outputs captured by hooks of one's own inside a layer.
"""

from .checkpoint import offloaded_checkpoint
from .manager import OffloadManager, OffloadStats
from .policy import SlotPolicy
from .pool import PinnedPool
from .streams import StreamOps, Trace, check_stream_order
from .switch import (OFFLOAD, CheckpointingSwitch, OffloadSettings, disable_offloaded_checkpointing,
                     disable_standard_checkpointing, displaced_layers, enable_offloaded_checkpointing,
                     enable_standard_checkpointing, is_offloaded, offload_manager)

__all__ = ["PinnedPool", "StreamOps", "Trace", "check_stream_order", "SlotPolicy", "OffloadManager", "OffloadStats",
           "offloaded_checkpoint", "enable_offloaded_checkpointing", "disable_offloaded_checkpointing", "is_offloaded",
           "offload_manager", "displaced_layers", "CheckpointingSwitch", "enable_standard_checkpointing",
           "disable_standard_checkpointing", "OFFLOAD", "OffloadSettings"]
