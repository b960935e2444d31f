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


def step_flops(config, seq_lengths, *, active_experts: int | None = None, frozen_base: bool = False,
               adapter_params: int = 0) -> dict:
    """Model FLOPs of one training step on ``seq_lengths`` (the real segments: padding left out), forward and
    backward: the matmuls ``2 N T`` forward, ``2 N T`` for the input gradients and, where the weights train,
    ``2 N T`` for their gradients (N: the matmul parameters a token passes through, LM head included, embeddings not;
    T: the tokens), plus causal attention over each segment (sliding windows honoured).

    ``frozen_base``: the base weights take no gradient (LoRA / QLoRA): ``4 N T``, where the PaLM convention
    (the default, ``6 N T``) counts weight gradients a frozen base never computes. ``adapter_params``: the adapter
    parameters a token passes through (:func:`adapter_params`): trained, ``6`` FLOPs per token each. A recompute
    (checkpointing) is not model FLOPs: MFU is the same for every plan of one model and batch."""
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
    attention = 3 * 4 * heads * hd * pairs           # forward: Q K^T and P V, 2 d each per pair; backward twice that
    base = (4 if frozen_base else 6) * n * tokens
    adapters = 6 * adapter_params * tokens
    return {"matmul_params": n, "tokens": tokens, "flops": base + adapters + attention, "attention_flops": attention,
            "base_flops": base, "adapter_flops": adapters, "lm_head_flops": (4 if frozen_base else 6) * c.vocab_size
            * h * tokens}


def batch_flops(config, seq_lengths: Sequence[Sequence[int]], mode: str = "train", **trained) -> float:
    """Model FLOPs of one step on a batch: :func:`step_flops` for ``train`` (``trained``: its ``frozen_base`` and
    ``adapter_params``); for ``forward`` (no backward) ``2 N T`` and the forward attention."""
    parts = step_flops(config, seq_lengths, **trained)
    if mode == "train":
        return parts["flops"]
    n, tokens = parts["matmul_params"], parts["tokens"]
    return 2 * n * tokens + 2 * trained.get("adapter_params", 0) * tokens + parts["attention_flops"] / 3


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_params(config, rank: int, targets: Sequence[str]) -> int | None:
    """LoRA's parameters a token passes through, from the sizes alone: rank ``rank`` on ``targets`` of every
    decoder layer of ``config``, named as transformers' decoders name their projections (each adapter ``r (in +
    out)``); None for a target not among them or an MoE's MLP (its experts' adapters: :func:`adapter_params` on the
    model counts them)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    h, heads, kv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or h // heads
    moe = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    inter = c.intermediate_size
    sizes = {"q_proj": h + heads * hd, "k_proj": h + kv * hd, "v_proj": h + kv * hd, "o_proj": heads * hd + h,
             "gate_proj": h + inter, "up_proj": h + inter, "down_proj": inter + h}
    if any(t not in sizes or (moe and t not in _PROJECTIONS[:4]) for t in targets):
        return None
    return c.num_hidden_layers * rank * sum(sizes[t] for t in targets)


def model_flops_from_palm(palm_flops: float, config, tokens: float, *, frozen_base: bool,
                          adapter_params: int) -> float:
    """:func:`step_flops`'s model FLOPs from a step counted in the PaLM convention (its default: ``6 N T`` plus
    attention, as the bench recorded ``flops_per_step`` before it counted a frozen base apart): the frozen base's
    weight gradients taken out, the adapters' FLOPs put in."""
    n = step_flops(config, [[1]])["matmul_params"]
    return palm_flops - (2 * n * tokens if frozen_base else 0) + 6 * adapter_params * tokens


def adapter_params(model) -> int:
    """The adapter (PEFT LoRA) parameters a token of ``model`` passes through: every ``lora_`` parameter that
    trains, those of an MoE layer's experts scaled by the share of experts a token is routed to."""
    c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    share = (getattr(c, "num_experts_per_tok", None) or 1) / experts if experts else 1.0
    total = 0.0
    for name, p in model.named_parameters():
        if p.requires_grad and ".lora_" in f".{name}":
            total += p.numel() * (share if ".experts." in f".{name}." else 1.0)
    return int(round(total))


def trained_terms(model) -> dict:
    """What :func:`step_flops` needs to know of how ``model`` trains: whether its base weights are frozen (only
    adapters train) and its adapters' parameters."""
    trains = [n for n, p in model.named_parameters() if p.requires_grad]
    frozen = bool(trains) and all(".lora_" in f".{n}" for n in trains)
    return {"frozen_base": frozen, "adapter_params": adapter_params(model)}


__all__ = ["PEAK_BF16", "adapter_params", "lora_params", "model_flops_from_palm", "peak_flops", "step_flops",
           "batch_flops", "trained_terms"]
