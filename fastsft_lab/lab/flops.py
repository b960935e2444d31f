"""Model FLOPs of a training step and the GPU's dense bf16 peak: the MFU beside every step time the bench reports."""

from __future__ import annotations

from typing import Sequence

# Dense bf16 tensor-core peaks (no sparsity), from the vendors' data sheets, by a substring of the GPU's name.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12,
             "A10G": 70e12, "T4": 65e12, "RTX 4090": 165e12, "RTX 3090": 71e12}


def peak_flops(gpu_name: str | None) -> float | None:
    for key, value in PEAK_BF16.items():
        if gpu_name and key in gpu_name:
            return value
    return None


def step_flops(config, seq_lengths, *, active_experts: int | None = None) -> dict:
    """Model FLOPs of one training step: ``6 N T`` (N: the matmul parameters a token passes through, LM head
    included, embeddings not) plus causal attention over each packed segment (sliding windows honoured), forward
    and backward. The PaLM convention: it counts the weight gradients of frozen weights that QLoRA skips."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    h, layers = c.hidden_size, c.num_hidden_layers
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or h // heads
    attn = h * heads * hd * 2 + h * kv * hd * 2                       # q, o and k, v
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        inter = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        k = active_experts or c.num_experts_per_tok
        mlp = 3 * h * inter * k + h * experts                           # active experts + router
    else:
        mlp = 3 * h * c.intermediate_size
    n = layers * (attn + mlp) + c.vocab_size * h
    tokens = sum(sum(row) for row in seq_lengths)
    types = getattr(c, "layer_types", None) or ["full_attention"] * layers
    window = getattr(c, "sliding_window", None)
    pairs = 0
    for t in types[:layers]:
        w = window if (t == "sliding_attention" and window) else None
        for row in seq_lengths:
            for s in row:
                pairs += s * (s + 1) // 2 if w is None or w >= s else w * (w + 1) // 2 + (s - w) * w
    attention = 3 * 4 * heads * hd * pairs
    return {"matmul_params": n, "tokens": tokens, "flops": 6 * n * tokens + attention, "attention_flops": attention}


def batch_flops(config, seq_lengths: Sequence[Sequence[int]], mode: str = "train") -> float:
    """Model FLOPs of one step on a batch: :func:`step_flops` for ``train``; a third of it for ``forward`` (no
    backward: ``2 N T`` and the forward attention)."""
    flops = step_flops(config, seq_lengths)["flops"]
    return flops if mode == "train" else flops / 3


__all__ = ["PEAK_BF16", "peak_flops", "step_flops", "batch_flops"]
