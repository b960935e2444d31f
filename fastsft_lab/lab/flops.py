"""Model FLOPs of a training step and the GPU's dense bf16 peak: the MFU beside every step time the bench reports."""

from __future__ import annotations

from typing import Sequence

from ..roofline import CARDS, card_peaks

# The GPUs' data-sheet peaks are the library's (fastsft_lab.roofline.CARDS: dense 16-bit tensor-core FLOP/s and HBM
# bytes/s), which classify every kernel of a diagnosed step; the same numbers give the MFU and the glue's HBM floor.
PEAK_BF16 = {label: flops[0] for _, label, flops, _ in CARDS}
PEAK_HBM = {label: bandwidth for _, label, _, bandwidth in CARDS}


def peak_flops(gpu_name: str | None) -> float | None:
    """The GPU's dense bf16 tensor-core peak, FLOP/s (None for a GPU not in the table)."""
    card = card_peaks(gpu_name)
    return card.flops["16-bit"] if card is not None else None


def peak_bandwidth(gpu_name: str | None) -> float | None:
    """The GPU's HBM bandwidth, bytes/s (None for a GPU not in the table)."""
    card = card_peaks(gpu_name)
    return card.bandwidth if card is not None else None


def moe_glue_bytes(tokens: int, top_k: int, hidden: int, intermediate: int, itemsize: int = 2) -> int:
    """Fewest HBM bytes the glue around an MoE layer's two grouped matmuls moves in one forward + backward (input
    and routing-weight gradients; expert weights frozen), when each glue step is its own kernel as in sync_free.

    With T tokens, R = T * top_k routed rows, H hidden, I expert intermediate size, each tensor read or written once:
    token gather T*H + R*H; gate R*2I in, R*I out; combine R*H + T*H; combine backward T*H (grad) + R*H (grad of the
    rows) + R*H (the rows again, for the routing-weight gradient); gate backward R*I + R*2I in, R*2I out; token-gather
    backward R*H + T*H. Sum: 4*T*H + 5*R*H + 8*R*I elements. Routing (sort, offsets) and the weights are O(R) and left
    out. Only fusing the gather and combine into the matmuls' prologue and epilogue goes below this."""
    rows = tokens * top_k
    return itemsize * (4 * tokens * hidden + 5 * rows * hidden + 8 * rows * intermediate)


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
