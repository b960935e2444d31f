"""What each switch of :func:`fastsft_lab.apply` would win on a measured step: pure arithmetic over the step's
measured costs (:class:`Costs`, measured by :func:`fastsft_lab.diagnose`), one rule per switch.

Each rule names the cost it removes, and predicts the saving from that cost as measured -- never from a table of
typical speed-ups (a prediction is an upper bound where the switch adds work of its own):

    packed_attention       the attention kernels' work on pairs of tokens from different sequences of a packed row:
                           attention ms x the share of the row's causal pairs that cross a sequence boundary, with
                           a backend that skips them (varlen, flex; sdpa and eager mask them and still compute them)
    packed_metadata_cache  (packed attention on, the per-layer rebuild on) the device's waits on the host inside
                           attention -- the rebuild's syncs and launches -- and its small kernels
    moe_routing            the device's waits on the host inside the experts (a per-expert loop's syncs and launches)
    fused_loss             the loss's memory-bound kernels over the (tokens, vocab) logits, down to the fused loss's
                           three passes over them (two reads, one write); frees the logits it no longer holds
    fused_lora             the PEFT LoRA layers' work outside their matmuls (scaling, adds, casts): one in-place GEMM
    fused_dequant          (NF4 weights, checkpointing on) the dequantisation the backward repeats after a recompute
    memory_budget          the recompute of the layers whose activations fit the memory left (most ms per byte first)
    offload_buffers        a memory switch: frees the checkpointed layer inputs; costs the reloads the double buffer
                           cannot hide behind each layer's backward

A switch that does not apply is named with the reason (no experts, no LoRA, not packed, on already, ...). A switch
that makes a wrong step right (packed attention where the model's own attention lets packed sequences see each other,
as stock GPT-OSS does) is suggested whatever it is predicted to save.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

GiB = 1 << 30
SKIPPING_BACKENDS = ("varlen", "flex", "flash", "xformers")    # packed backends that skip cross-sequence pairs
MEMORY_SHARE = 0.9          # memory_budget="90%": the model plus 90% of the free memory


def size(b: float | None) -> str:
    if b is None:
        return "?"
    return f"{b / GiB:.2f} GiB" if abs(b) >= GiB / 10 else f"{b / 2**20:.1f} MiB"


@dataclass
class Costs:
    """The measured costs of one step that the predictions rest on (ms per step, bytes)."""

    step_ms: float = 0.0
    device: str = "cpu"
    state: dict = field(default_factory=dict)          # fastsft_lab.state(model) as a dict
    num_layers: int = 0
    # the batch
    packed: bool = False             # sequences packed into rows (position_ids restart, packed metadata)
    row_tokens: int = 0
    cross_pairs: float = 0.0         # share of the rows' causal pairs that cross a sequence boundary
    padding: float = 0.0             # share of the batch's tokens that are padding
    stock_packs: bool = True         # the model's own attention keeps packed sequences apart
    # attention
    attention_ms: float = 0.0        # the attention kernels whose work grows with the T x T pairs, fwd + bwd
    attention_fused: bool = True     # one fused kernel (SDPA / flash / flex) does it; False: eager, scores held
    attention_within_flops: float = 0.0   # what exact attention over the pairs within sequences costs a step
    compute_flops_per_s: float = 0.0      # what the step's compute-bound kernels reach
    attention_waits_ms: float = 0.0  # device idle ended by an attention kernel
    attention_small_ms: float = 0.0  # latency-bound attention kernels besides the attention ops
    attention_syncs: int = 0
    # MoE experts
    experts: bool = False
    experts_waits_ms: float = 0.0
    experts_syncs: int = 0
    experts_launches: float = 0.0    # per step
    # loss head
    tokens: int = 0
    vocab: int = 0
    itemsize: int = 2                # of the logits (the compute dtype)
    fused_head: bool = False         # the step already runs a fused LM head (TRL's fused_lm_head): no logits
    loss_memory_ms: float = 0.0      # memory-bound loss-head kernels
    loss_memory_bytes: float = 0.0   # and the bytes they move
    # LoRA, NF4
    lora_layers: int = 0
    lora_glue_ms: float = 0.0        # LoRA kernels outside its matmuls
    nf4_layers: int = 0
    dequant_backward_ms: float = 0.0
    # checkpointing and memory
    recompute_ms: float = 0.0
    recompute_per_layer: list = field(default_factory=list)
    backward_per_layer: list = field(default_factory=list)
    layer_activations: list = field(default_factory=list)   # bytes a layer keeps without checkpointing
    layer_inputs: list = field(default_factory=list)        # bytes of its input (what checkpointing keeps)
    peak_bytes: int | None = None
    budget_bytes: int | None = None  # what memory_budget="90%" would allow (None: unknown, a CPU)
    link_bytes_per_s: float | None = None                    # host link, pinned copies
    scoped: bool = True              # kernels placed in modules and layers (not under torch.compile)

    def as_dict(self) -> dict:
        return asdict(self)


# the measured cost (a Costs field) each switch's prediction rests on: read again after the switch is on
COSTS = {"packed_attention": "attention_ms", "packed_metadata_cache": "attention_waits_ms",
         "moe_routing": "experts_waits_ms", "fused_loss": "loss_memory_ms", "fused_lora": "lora_glue_ms",
         "fused_dequant": "dequant_backward_ms", "memory_budget": "recompute_ms", "offload_buffers": "peak_bytes"}


@dataclass
class Prediction:
    """One switch: whether it applies, what :func:`fastsft_lab.apply` would get, the predicted step time saved
    (negative: a cost) and memory freed, the measured cost it rests on (``cost``: a :class:`Costs` field, read again
    after the switch is on), or why it does not apply."""

    switch: str
    value: Any = None
    applies: bool = False
    saving_ms: float = 0.0
    memory_bytes: int = 0
    rests_on: str = ""
    reason: str = ""
    cost: str = ""
    speed: bool = True          # a speed switch (suggested when it saves time); False: a memory switch
    corrects: bool = False      # it makes the step right where the model's own path is wrong (suggested whatever
                                # it saves)

    def __post_init__(self) -> None:
        self.cost = self.cost or COSTS.get(self.switch, "")

    @property
    def suggested(self) -> bool:
        return self.applies and ((self.speed and self.saving_ms > 0) or self.corrects)

    def as_dict(self) -> dict:
        return {**asdict(self), "suggested": self.suggested}


def _off(switch: str, reason: str) -> Prediction:
    return Prediction(switch, reason=reason)


def predict_packed_attention(c: Costs, backend: str) -> Prediction:
    on = c.state.get("packed")
    if on:
        return _off("packed_attention", f"on already ({on})")
    if not c.packed:
        pad = f" ({c.padding:.0%} of its tokens are padding: pack them with PackedCollator or " \
              f"SFTConfig(padding_free=True), then this applies)" if c.padding > 0 else ""
        return _off("packed_attention", "the batch is one sequence per row" + pad)
    skips = backend in SKIPPING_BACKENDS
    how = "" if skips else f" (the {backend} backend masks them but still computes them; varlen and flex skip them)"
    exact = "" if c.stock_packs else "; and right: the model's own attention lets packed sequences see each other"
    what = f"attention kernels {c.attention_ms:.1f} ms on rows of {c.row_tokens} tokens, " \
           f"{c.cross_pairs:.0%} of whose causal pairs cross a sequence boundary{how}"
    saving = c.attention_ms * c.cross_pairs if skips else 0.0
    if skips and not c.attention_fused:
        # eager attention holds the T x T scores; a fused varlen kernel computes the pairs within sequences only,
        # costed at the step's own matmul rate (a floor: attention kernels rarely run faster than the matmuls)
        rate = c.compute_flops_per_s
        after = c.attention_within_flops / rate * 1e3 if rate > 0 and c.attention_within_flops > 0 else None
        if after is not None:
            saving = max(0.0, c.attention_ms - after)
            what = (f"eager attention: {c.attention_ms:.1f} ms of kernels over T x T scores on rows of "
                    f"{c.row_tokens} tokens ({c.cross_pairs:.0%} of the causal pairs cross a sequence boundary); "
                    f"a fused {backend} kernel over the pairs within sequences, {c.attention_within_flops / 1e12:.2f} "
                    f"TFLOP at the step's matmul rate ({rate / 1e12:.0f} TFLOP/s): {after:.1f} ms")
    return Prediction("packed_attention", backend, True, saving, 0, what + exact, corrects=not c.stock_packs)


def predict_metadata_cache(c: Costs) -> Prediction:
    if not c.state.get("packed"):
        return _off("packed_metadata_cache", "a mode of packed_attention (on with it by default)")
    if c.state.get("packed_cache") is not False:
        return _off("packed_metadata_cache", "on already: the metadata is built once per batch")
    saving = c.attention_waits_ms + c.attention_small_ms
    return Prediction("packed_metadata_cache", True, True, saving, 0,
                      f"every layer rebuilds the metadata: {c.attention_syncs} host syncs in attention, "
                      f"{c.attention_waits_ms:.1f} ms of waits on the host there, {c.attention_small_ms:.1f} ms of "
                      "small kernels")


def predict_moe_routing(c: Costs) -> Prediction:
    if not c.experts:
        return _off("moe_routing", "a dense model: no experts")
    if c.state.get("moe_routing") == "sync_free":
        return _off("moe_routing", "on already (sync_free)")
    now = c.state.get("moe_routing") or "transformers' own"
    return Prediction("moe_routing", "sync_free", True, c.experts_waits_ms, 0,
                      f"experts ({now}): {c.experts_syncs} host syncs, {c.experts_launches:.0f} launches per step, "
                      f"{c.experts_waits_ms:.1f} ms of waits on the host inside them")


def predict_fused_loss(c: Costs) -> Prediction:
    if c.state.get("fused_loss"):
        return _off("fused_loss", "on already")
    if not c.vocab:
        return _off("fused_loss", "no LM head found")
    if c.fused_head:
        return _off("fused_loss", "the step's loss already runs a fused LM head (TRL's fused_lm_head): it builds no "
                                  "logits to remove, and it runs in place of fastsft_lab's")
    logits = float(c.tokens) * c.vocab
    floor = 3 * logits * c.itemsize                      # the fused loss: two reads and one write of the logits
    saving = c.loss_memory_ms * max(0.0, 1 - floor / c.loss_memory_bytes) if c.loss_memory_bytes else 0.0
    freed = int(logits * (c.itemsize + 4))               # the logits and their float32 copy, held for the backward
    return Prediction("fused_loss", True, True, saving, freed,
                      f"the loss's memory-bound kernels: {c.loss_memory_ms:.1f} ms moving {size(c.loss_memory_bytes)} "
                      f"over {c.tokens} x {c.vocab} logits (fused: {size(floor)})")


def predict_fused_lora(c: Costs) -> Prediction:
    if c.state.get("fused_lora"):
        return _off("fused_lora", "on already")
    if not c.lora_layers:
        return _off("fused_lora", "no PEFT LoRA layers")
    return Prediction("fused_lora", True, True, c.lora_glue_ms, 0,
                      f"{c.lora_layers} LoRA layers: {c.lora_glue_ms:.1f} ms of kernels outside their matmuls "
                      "(scaling, adds, casts)")


def predict_fused_dequant(c: Costs) -> Prediction:
    if c.state.get("fused_dequant"):
        return _off("fused_dequant", "on already")
    if not c.nf4_layers:
        return _off("fused_dequant", "no bitsandbytes NF4 layers")
    if c.device != "cuda":
        return _off("fused_dequant", "its Triton kernel runs on a GPU")
    return Prediction("fused_dequant", True, True, c.dequant_backward_ms, 0,
                      f"{c.nf4_layers} NF4 layers: the backward dequantises again after the recompute, "
                      f"{c.dequant_backward_ms:.1f} ms")


def _layers_that_fit(c: Costs, room: float) -> list[int]:
    """The layers to keep (no recompute) within ``room`` bytes: the most recompute ms per extra byte first."""
    extra = [max(1, a - i) for a, i in zip(c.layer_activations, c.layer_inputs)]
    order = sorted(range(len(extra)), key=lambda i: -c.recompute_per_layer[i] / extra[i])
    kept = []
    for i in order:
        if extra[i] <= room:
            kept.append(i)
            room -= extra[i]
    return kept


def predict_memory_budget(c: Costs) -> Prediction:
    if c.state.get("checkpointing") == "plan":
        return _off("memory_budget", "on already")
    if c.recompute_ms <= 0:
        return _off("memory_budget", "no recompute to skip: no layer is checkpointed")
    if c.budget_bytes is None or c.peak_bytes is None:
        return _off("memory_budget", "the device's free memory is unknown (a CPU)")
    if len(c.layer_activations) != len(c.recompute_per_layer) or not c.layer_activations:
        return _off("memory_budget", "the layers' activations were not measured")
    room = c.budget_bytes - c.peak_bytes
    kept = _layers_that_fit(c, room)
    saving = sum(c.recompute_per_layer[i] for i in kept)
    n = len(c.recompute_per_layer)
    return Prediction("memory_budget", f"{MEMORY_SHARE:.0%}", True, saving, -int(sum(
        c.layer_activations[i] - c.layer_inputs[i] for i in kept)),
        f"recompute {c.recompute_ms:.1f} ms in {n} layers; a layer keeps {size(max(c.layer_activations))} of "
        f"activations (checkpointed: its input, {size(max(c.layer_inputs))}); {size(room)} left under "
        f"{MEMORY_SHARE:.0%} of the free memory (peak {size(c.peak_bytes)}) keeps {len(kept)} of {n}")


def predict_offload(c: Costs) -> Prediction:
    if c.state.get("offload_buffers"):
        return _off("offload_buffers", f"on already ({c.state.get('offload_buffers')} buffers)")
    if c.device != "cuda":
        return _off("offload_buffers", "it moves activations from a GPU to host memory")
    if c.state.get("checkpointing") != "standard" or not c.layer_inputs:
        return _off("offload_buffers", "no standard checkpointing to offload (its layer inputs stay on the GPU)")
    n, one = len(c.layer_inputs), max(c.layer_inputs)
    freed = int(sum(c.layer_inputs) - 2 * one)          # every input, less the two staging buffers
    link = c.link_bytes_per_s or 0
    reload_ms = one / link * 1e3 if link else 0.0
    exposed = sum(max(0.0, reload_ms - b) for b in c.backward_per_layer) if link else 0.0
    return Prediction("offload_buffers", 2, True, -exposed, freed,
                      f"{n} layer inputs of {size(one)} on the GPU; each reload {reload_ms:.2f} ms over the host "
                      f"link ({(link or 0) / 1e9:.0f} GB/s) behind a layer's backward of "
                      f"{min(c.backward_per_layer or [0]):.1f} ms or more", speed=False)


def predict(c: Costs, *, backend: str = "sdpa") -> list[Prediction]:
    """Every switch's :class:`Prediction` on the step ``c`` describes (``backend``: the packed-attention backend)."""
    if not c.scoped:
        why = "the step's kernels are not placed in modules (torch.compile): diagnose the uncompiled model"
        return [_off(name, why) for name in ("packed_attention", "packed_metadata_cache", "moe_routing",
                                             "fused_loss", "fused_lora", "fused_dequant", "memory_budget",
                                             "offload_buffers")]
    return [predict_packed_attention(c, backend), predict_metadata_cache(c), predict_moe_routing(c),
            predict_fused_loss(c), predict_fused_lora(c), predict_fused_dequant(c), predict_memory_budget(c),
            predict_offload(c)]


__all__ = ["Costs", "Prediction", "predict", "COSTS", "MEMORY_SHARE", "size"]
