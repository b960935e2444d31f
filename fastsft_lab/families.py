"""One record per model family: what fastsft_lab knows about an architecture, in one place.

Presets (:mod:`.models`), detection (:func:`get_family`, ``models.family_of``) and the switches (the MoE routing
of :mod:`.moe`, LoRA targets, the stock attention) read a :class:`ModelFamily` instead of branching on family names
or sniffing module attributes. Adding a family is one record in :data:`FAMILIES` (plus a preset and its equality
tests: packed == each sequence alone, experts == transformers' eager experts). Everything here describes
transformers 5.x's modeling code (checked on 5.17); ``tests/integration/test_families.py`` checks each record against the live
modules of its tiny preset, so a transformers change that breaks a record fails there, by name.

Packed attention itself stays generic (it reads each layer's ``sliding_window`` / ``s_aux`` call arguments and
refuses a config with logit softcapping or ALiBi), so it also runs on transformers families that have no record here
(Llama, Mistral, Qwen2, ...); the MoE routing runs only on the experts modules of a record, and reads their layout
(bias, transposed weights), gate and routing weights from it. Every field here is read by the code (or the lab).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

Windows = Literal["none", "layer_types", "every_layer"]
Gate = Literal["gpt_oss_glu", "act_glu"]
RoutingWeights = Literal["top_k", "dense"]


@dataclass(frozen=True)
class Attention:
    """The attention features of a family, as the packed-attention kernels see them.

    ``windows``: where a sliding window comes from - ``"none"``; ``"layer_types"`` (``config.sliding_window`` on the
    layers ``config.layer_types`` marks ``sliding_attention``); ``"every_layer"`` (``config.sliding_window``, when
    set, on every layer). ``sinks``: per-head attention sinks (GPT-OSS's ``s_aux``). No family here softcaps its
    attention logits (no packed kernel implements it: a config that does is refused, recorded or not).
    ``stock``: the attention implementation stock transformers runs the family with (the default of a build).
    ``stock_packs``: stock transformers' masks see packed ``position_ids`` (each packed sequence attends to itself
    only); False where its mask calls never get them and packed sequences attend to the ones before them in the row
    (GPT-OSS, transformers 5.17; ``tests/integration/test_packed_models.py`` checks every record against the stock path).
    """

    windows: Windows
    sinks: bool
    stock: str
    stock_packs: bool = True


@dataclass(frozen=True)
class Experts:
    """The mixture-of-experts layer of a family: transformers' experts module and how it is fed.

    ``class_name``: the ``@use_experts_implementation`` experts class (found by class, NF4 subclasses included);
    ``router``: the attribute of the MoE block that holds the router (``mlp.router`` / ``mlp.gate``); ``gate``: the
    gated activation between the two projections - ``"gpt_oss_glu"`` (interleaved gate/up columns, clamped at
    ``limit``, ``(up + 1) * gate * sigmoid(alpha * gate)``) or ``"act_glu"`` (transformers' default
    ``act_fn(gate) * up`` on concatenated halves; a fused kernel when the act is SiLU), the key of
    :data:`fastsft_lab.moe.gate.GATES`; ``routing_weights``: what the router hands the experts - ``"top_k"`` (T, k)
    weights of the chosen experts, or ``"dense"`` (T, E) scores, gathered to (T, k) before use; ``transposed`` /
    ``bias``: the weights are stored (E, in, out) / carry biases (what transformers' modules say as ``is_transposed``
    / ``has_bias``; the experts forwards read the record); ``lora_parameters``: PEFT ``target_parameters`` for
    ``LoraSettings(lora_experts=True)`` (empty: not offered).
    """

    class_name: str
    router: str
    gate: Gate
    routing_weights: RoutingWeights
    transposed: bool
    bias: bool
    lora_parameters: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelFamily:
    """Everything fastsft_lab knows about one model family; ``name`` is transformers' ``config.model_type``.

    ``config_class``: the transformers config class (by name, imported on use); ``lora_targets``: the default LoRA
    ``target_modules`` (every attention and MLP projection PEFT can adapt); ``experts``: the MoE layer (None: a dense
    family); ``router_aux_loss``: the model adds a router load-balancing loss (``config.router_aux_loss_coef``) when
    ``output_router_logits`` (read through :func:`router_aux_loss`).
    """

    name: str
    config_class: str
    attention: Attention
    lora_targets: tuple[str, ...]
    experts: Experts | None = None
    router_aux_loss: bool = False

    @property
    def is_moe(self) -> bool:
        return self.experts is not None

    def config_type(self) -> type:
        """The transformers config class."""
        import transformers

        return getattr(transformers, self.config_class)

    def layer_windows(self, config) -> list[int | None]:
        """Each decoder layer's sliding window under ``config`` (None: full attention), from where this family takes
        it (``attention.windows``)."""
        layers = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        if self.attention.windows == "layer_types":
            return [window if t == "sliding_attention" else None for t in config.layer_types[:layers]]
        return [window if self.attention.windows == "every_layer" else None] * layers


_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (
    # dense; GQA; sliding layers only with use_sliding_window (off in every Qwen3 checkpoint)
    ModelFamily(
        name="qwen3", config_class="Qwen3Config",
        attention=Attention(windows="layer_types", sinks=False, stock="sdpa"),
        lora_targets=_ATTN + _MLP,
    ),
    # MoE, top-k of the logits then softmax; sliding and full layers alternate; attention sinks
    ModelFamily(
        name="gpt_oss", config_class="GptOssConfig",
        # GptOssPreTrainedModel sets _supports_sdpa = False (SDPA cannot take attention sinks), so stock
        # transformers runs GPT-OSS with eager attention unless a kernel is installed.
        attention=Attention(windows="layer_types", sinks=True, stock="eager", stock_packs=False),
        lora_targets=_ATTN,  # experts are 3-D parameters: LoraSettings(lora_experts=True) adapts them
        experts=Experts(class_name="GptOssExperts", router="router", gate="gpt_oss_glu", routing_weights="top_k",
                        transposed=True, bias=True,
                        lora_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
        router_aux_loss=True,
    ),
    # MoE, softmax then top-k (renormalised with norm_topk_prob)
    ModelFamily(
        name="qwen3_moe", config_class="Qwen3MoeConfig",
        attention=Attention(windows="every_layer", sinks=False, stock="sdpa"),
        lora_targets=_ATTN + _MLP,  # PEFT maps gate_proj/up_proj/down_proj onto the experts' 3-D parameters
        experts=Experts(class_name="Qwen3MoeExperts", router="gate", gate="act_glu", routing_weights="top_k",
                        transposed=False, bias=False),
        router_aux_loss=True,
    ),
    # MoE, softmax then top-2, renormalised; no sinks; a sliding window on every layer when configured
    ModelFamily(
        name="mixtral", config_class="MixtralConfig",
        attention=Attention(windows="every_layer", sinks=False, stock="sdpa"),
        lora_targets=_ATTN + ("w1", "w2", "w3"),  # PEFT maps Mixtral's w1/w3 (gate_up) and w2 (down) onto the experts
        experts=Experts(class_name="MixtralExperts", router="gate", gate="act_glu", routing_weights="top_k",
                        transposed=False, bias=False),
        router_aux_loss=True,
    ),
)}


def supported_families() -> str:
    """``"qwen3, gpt_oss, qwen3_moe, mixtral"`` - for error messages."""
    return ", ".join(FAMILIES)


def get_family(name: str | None, *, what: str = "") -> ModelFamily:
    """The record of the family ``name`` (a ``config.model_type``); a one-line error naming the supported ones."""
    family = FAMILIES.get(name) if isinstance(name, str) else None
    if family is None:
        of = f" ({what})" if what else ""
        raise ValueError(f"unsupported model family {name!r}{of}: fastsft_lab's model-family record knows "
                         f"{supported_families()}")
    return family


_BY_EXPERTS_CLASS = {f.experts.class_name: f for f in FAMILIES.values() if f.experts is not None}


def experts_family(module: nn.Module) -> ModelFamily | None:
    """The family whose experts module ``module`` is (by class, so NF4 subclasses count), or None."""
    for cls in type(module).__mro__:
        family = _BY_EXPERTS_CLASS.get(cls.__name__)
        if family is not None:
            return family
    return None


def router_aux_loss(config) -> bool:
    """Whether a model of ``config`` adds a router load-balancing loss: its record's ``router_aux_loss``; a family
    with no record (OLMoE, ...) is taken at its config's word (``router_aux_loss_coef``, transformers' own field), so
    that no switch drops or miscounts a loss it was not told about."""
    family = FAMILIES.get(getattr(config, "model_type", None))
    if family is not None:
        return family.router_aux_loss
    return hasattr(config, "router_aux_loss_coef")


__all__ = ["FAMILIES", "Attention", "Experts", "ModelFamily", "experts_family", "get_family", "router_aux_loss",
           "supported_families"]
