"""Optimization 3: MoE expert routing for GPT-OSS (and Qwen3-MoE, Mixtral: the MoE families of
:mod:`fastsft_lab.families`): the per-expert loop, grouped once, sync-free.

The problem. The common expert loop (transformers' ``eager`` experts, and the pattern most MoE code copies) asks,
for every expert, *which tokens did you get?* (``nonzero`` / ``torch.where`` on a mask) and checks the expert id on
the host. Each question is a device->host read: the CPU stops issuing kernels until the GPU has caught up, the
launch queue drains, and the GPU idles while Python decides what to launch next. Two or more syncs per expert per
layer, 32 experts, 24 layers: thousands of stalls per forward.

The fix, the toggle ``moe_routing``: ``naive`` (the loop, the "before"), ``grouped`` (group once: one host sync per
layer), ``sync_free`` (the same grouping feeding a grouped matmul: none). Usage::

    from fastsft_lab.moe import set_moe_routing, quantize_experts_nf4
    set_moe_routing(model, "sync_free")   # or "grouped" / "naive"; None or "off" restores the original
    quantize_experts_nf4(model)           # optional: NF4 expert weights for a QLoRA memory budget

Layout: ``experts.py`` (the three forwards side by side), ``grouping.py`` (sort, offsets, gathers, combine),
``matmul.py`` (the grouped matmul), ``gate.py`` (GPT-OSS's gate: eager and fused Triton), ``nf4.py`` (NF4 expert
store), ``switch.py`` (through transformers' experts registry), ``modules.py`` (finding the experts, through the
model-family record).

Equivalence (float32, CPU) with transformers' eager experts - outputs and gradients - is proven in
``tests/unit/test_moe_experts.py`` (per layer) and ``tests/integration/test_moe_models.py``; notebook 03 walks
through it.
"""

from .experts import (FORWARDS, HOST_READ_LABEL, grouped_experts_forward, naive_experts_forward,
                      sync_free_experts_forward)
from .gate import fused_glu_available, gpt_oss_glu, set_fused_glu
from .grouping import combine, group_by_expert, inverse_permutation, tokens_in_expert_order
from .matmul import grouped_mm, grouped_mm_unavailable
from .modules import experts_modules, is_experts_module
from .nf4 import dequantize_expert_weight, nf4_expert_bytes, quantize_experts_nf4
from .switch import (IMPLEMENTATIONS, MODES, MOE, STOCK_IMPLEMENTATIONS, check_moe_routing, experts_implementation,
                     get_moe_routing, moe_routing, moe_routing_switched, set_moe_routing)

__all__ = [
    "MODES", "IMPLEMENTATIONS", "STOCK_IMPLEMENTATIONS", "naive_experts_forward", "grouped_experts_forward",
    "sync_free_experts_forward", "FORWARDS", "HOST_READ_LABEL", "group_by_expert", "inverse_permutation",
    "tokens_in_expert_order", "combine", "grouped_mm", "grouped_mm_unavailable", "gpt_oss_glu", "fused_glu_available",
    "set_fused_glu", "is_experts_module", "experts_modules", "quantize_experts_nf4", "dequantize_expert_weight",
    "nf4_expert_bytes", "set_moe_routing", "get_moe_routing", "experts_implementation", "moe_routing",
    "moe_routing_switched", "check_moe_routing", "MOE",
]
