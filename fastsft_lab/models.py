"""Named model presets (tiny for tests, real sizes for benchmarks) and one builder for all of them.

Where things are in a built model (its decoder layers, its device, the model under its wrappers) is
:mod:`fastsft_lab.structure`.

The real presets carry the published architecture hyper-parameters of each checkpoint's ``config.json``;
speed does not depend on weight values, so ``weights="random"`` builds the real architecture directly on
the target device (no download, no CPU copy of a 14B model), while ``weights="hub"`` is the ordinary
``from_pretrained`` path for users with hub access. Both go through the same quantization and LoRA code.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

from .families import FAMILIES, ModelFamily, get_family
# where things are in a model lives in .structure; re-exported here for code that imports it from the presets
from .structure import base_model, decoder_layers, family_of, model_device, unwrap  # noqa: F401

QWEN3_LORA_TARGETS = get_family("qwen3").lora_targets
GPT_OSS_LORA_TARGETS = get_family("gpt_oss").lora_targets  # experts are 3-D parameters, see lora_experts


@dataclass(frozen=True)
class ModelPreset:
    """A named architecture. ``config`` holds the exact hyper-parameters passed to the transformers config class;
    everything about the architecture itself is its family's record (:mod:`fastsft_lab.families`)."""

    name: str
    family: str  # a key of fastsft_lab.families.FAMILIES (transformers' model_type)
    config: dict
    hub_id: str | None = None
    real: bool = False
    note: str = ""

    def __post_init__(self) -> None:
        get_family(self.family, what=f"preset {self.name!r}")   # an unknown family fails here, naming the known ones

    @property
    def family_record(self) -> ModelFamily:
        return get_family(self.family, what=f"preset {self.name!r}")

    @property
    def is_moe(self) -> bool:
        return self.family_record.is_moe

    @property
    def lora_targets(self) -> tuple[str, ...]:
        return self.family_record.lora_targets

    @property
    def default_attn_implementation(self) -> str:
        return self.family_record.attention.stock


_GPT_OSS_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}

PRESETS: dict[str, ModelPreset] = {}


def _register(preset: ModelPreset) -> ModelPreset:
    PRESETS[preset.name] = preset
    return preset


# --- Real architectures: the values of each checkpoint's config.json on the hub --------------------------
_register(ModelPreset(
    name="qwen3-14b", family="qwen3", hub_id="Qwen/Qwen3-14B", real=True,
    config=dict(
        hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=False, hidden_act="silu",
    ),
    note="14.8B parameters; 40 layers of GQA (40 query / 8 KV heads, head dim 128).",
))
_register(ModelPreset(
    name="qwen3-0.6b", family="qwen3", hub_id="Qwen/Qwen3-0.6B", real=True,
    config=dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-6,
        tie_word_embeddings=True, attention_bias=False, hidden_act="silu",
    ),
    note="0.6B parameters; many thin layers: metadata overhead is a large share of each layer.",
))
_register(ModelPreset(
    name="gpt-oss-20b", family="gpt_oss", hub_id="openai/gpt-oss-20b", real=True,
    config=dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, vocab_size=201088, max_position_embeddings=131072,
        num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
        rope_parameters=dict(_GPT_OSS_ROPE), rms_norm_eps=1e-5, tie_word_embeddings=False,
        attention_bias=True, router_aux_loss_coef=0.9, hidden_act="silu",
    ),
    note="21B parameters (3.6B active); 32 experts, top-4; sliding (128) and full layers alternate; attention sinks.",
))
_register(ModelPreset(
    name="qwen3-30b-a3b", family="qwen3_moe", hub_id="Qwen/Qwen3-30B-A3B", real=True,
    config=dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, hidden_act="silu",
    ),
    note="30B parameters (3B active); 128 experts, top-8.",
))

# --- Tiny presets: same code path, real sizes in the comments ----------------------------------------------
_register(ModelPreset(
    name="tiny-qwen3", family="qwen3",
    config=dict(
        hidden_size=64,           # 5120
        intermediate_size=128,    # 17408
        num_hidden_layers=3,      # 40
        num_attention_heads=4,    # 40
        num_key_value_heads=2,    # 8 (GQA kept)
        head_dim=16,              # 128
        vocab_size=256,           # 151936
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, hidden_act="silu",
    ),
))
_register(ModelPreset(
    name="tiny-gpt-oss", family="gpt_oss",
    config=dict(
        hidden_size=64,           # 2880
        intermediate_size=32,     # 2880
        num_hidden_layers=4,      # 24
        num_attention_heads=4,    # 64
        num_key_value_heads=2,    # 8
        head_dim=16,              # 64
        vocab_size=256,           # 201088
        max_position_embeddings=4096,
        num_local_experts=8,      # 32
        num_experts_per_tok=2,    # 4
        sliding_window=8,         # 128: small so that test sequences cross the window
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters=dict(_GPT_OSS_ROPE), rms_norm_eps=1e-5, tie_word_embeddings=False,
        attention_bias=True, router_aux_loss_coef=0.9, hidden_act="silu",
    ),
))
_register(ModelPreset(
    name="tiny-qwen3-moe", family="qwen3_moe",
    config=dict(
        hidden_size=64,               # 2048
        intermediate_size=128,        # 6144
        moe_intermediate_size=32,     # 768
        num_hidden_layers=2,          # 48
        num_attention_heads=4,        # 32
        num_key_value_heads=2,        # 4
        head_dim=16,                  # 128
        vocab_size=256,               # 151936
        max_position_embeddings=4096,
        num_experts=8,                # 128
        num_experts_per_tok=2,        # 8
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, hidden_act="silu",
    ),
))
_register(ModelPreset(
    name="tiny-mixtral", family="mixtral",
    config=dict(
        hidden_size=64,               # 4096 (Mixtral-8x7B)
        intermediate_size=32,         # 14336
        num_hidden_layers=2,          # 32
        num_attention_heads=4,        # 32
        num_key_value_heads=2,        # 8
        head_dim=16,                  # 128
        vocab_size=256,               # 32000
        max_position_embeddings=4096,  # 32768
        num_local_experts=8,          # 8
        num_experts_per_tok=2,        # 2
        sliding_window=None,          # None, as in the checkpoint's config.json
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, rms_norm_eps=1e-5,
        tie_word_embeddings=False, router_aux_loss_coef=0.02, hidden_act="silu",
    ),
))


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}") from None


def make_config(preset: str | ModelPreset, num_layers: int | None = None, **overrides: Any):
    """The transformers config of a preset; ``num_layers`` keeps every width and cuts the depth (for budgets)."""
    preset = get_preset(preset) if isinstance(preset, str) else preset
    values = copy.deepcopy(preset.config)
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        values["num_hidden_layers"] = num_layers
        if "layer_types" in values:
            pattern = values["layer_types"]
            values["layer_types"] = [pattern[i % len(pattern)] for i in range(num_layers)]
    values.update(overrides)
    return preset.family_record.config_type()(**values)


@dataclass
class LoraSettings:
    """LoRA adapters. ``rank``/``alpha`` as in the QLoRA paper's defaults scaled to r=16."""

    rank: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: Sequence[str] | None = None  # None: every attention and MLP projection of the preset
    lora_experts: bool = False  # MoE: also adapt the 3-D expert weights (PEFT target_parameters)


@dataclass
class ModelInfo:
    preset: str
    family: str
    num_layers: int
    quant: str | None
    lora_rank: int | None
    dtype: str
    device: str
    weights: str
    attn_implementation: str
    params_total: int = 0
    params_trainable: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def quantize_nf4(model: nn.Module, compute_dtype: torch.dtype = torch.bfloat16,
                 skip: Sequence[str] = ("lm_head",)) -> int:
    """Replace every ``nn.Linear`` (except ``skip``) by a bitsandbytes NF4 ``Linear4bit`` on the weight's device.

    The weight is quantized where it lives (GPU or CPU): no round trip through host memory. Returns the number
    of layers replaced.
    """
    import bitsandbytes as bnb

    targets = [
        (name, module) for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not isinstance(module, bnb.nn.Linear4bit)
        and not any(name == s or name.endswith("." + s) for s in skip)
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        device = linear.weight.device
        q = bnb.nn.Linear4bit(
            linear.in_features, linear.out_features, bias=linear.bias is not None,
            compute_dtype=compute_dtype, quant_type="nf4", device="meta",
        )
        weight = linear.weight.data.to(compute_dtype)
        q.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", compress_statistics=True)
        if linear.bias is not None:
            q.bias = nn.Parameter(linear.bias.data.to(compute_dtype), requires_grad=False)
        q = q.to(device)  # Params4bit quantizes on .to(device)
        setattr(parent, child, q)
        del linear, weight
    return len(targets)


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        from .env import default_device

        return default_device()
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be cpu, cuda, cuda:N or meta, got {device!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for, but this machine has no CUDA device (torch.cuda.is_available() "
                         "is False): use device='cpu' and a tiny preset")
    return device


def build_model(
    preset: str | ModelPreset,
    *,
    weights: str = "random",
    device: str | torch.device | None = None,
    dtype: torch.dtype = torch.bfloat16,
    quant: str | None = None,
    lora: LoraSettings | None = None,
    attn_implementation: str | None = None,
    num_layers: int | None = None,
    hub_path: str | None = None,
    gradient_checkpointing: bool = False,
    seed: int = 0,
    config_overrides: dict | None = None,
) -> nn.Module:
    """Build a causal LM from a preset.

    Args:
        preset: a name from ``PRESETS`` (``tiny-qwen3``, ``qwen3-14b``, ``gpt-oss-20b`` …).
        weights: ``"random"`` builds the architecture on ``device`` with random weights (no download);
            ``"hub"`` calls ``from_pretrained`` on ``hub_path`` (a local folder or hub id; default the preset's).
        device: target device; default CUDA when available. ``"meta"`` builds shapes only.
        dtype: parameter dtype of the non-quantized weights.
        quant: ``None`` or ``"nf4"`` (QLoRA: bitsandbytes NF4 base linears, compute in ``dtype``).
        lora: PEFT LoRA adapters to add, or ``None`` for full fine-tuning.
        attn_implementation: transformers attention implementation; default the preset's stock one.
        num_layers: keep every width but only this many decoder layers (benchmark budgets).
        gradient_checkpointing: enable transformers' non-reentrant checkpointing on the decoder layers.
        seed: seed of the random initialisation.
    """
    from transformers import AutoModelForCausalLM

    preset = get_preset(preset) if isinstance(preset, str) else preset
    if weights not in ("random", "hub"):
        raise ValueError(f"weights must be 'random' or 'hub', got {weights!r}")
    if quant not in (None, "nf4"):
        raise ValueError(f"quant must be None or 'nf4', got {quant!r}")
    device = _resolve_device(device)
    attn = attn_implementation or preset.default_attn_implementation

    if weights == "random":
        config = make_config(preset, num_layers=num_layers, **(config_overrides or {}))
        torch.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed_all(seed)
        # Build straight on the target device: parameters are allocated and initialised there.
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    else:
        source = hub_path or preset.hub_id
        if source is None:
            raise ValueError(f"preset {preset.name!r} has no hub id; pass hub_path=<folder or hub id>")
        kwargs: dict[str, Any] = dict(dtype=dtype, attn_implementation=attn)
        if num_layers is not None or config_overrides:
            config = make_config(preset, num_layers=num_layers, **(config_overrides or {}))
            kwargs["config"] = config
        if quant == "nf4" and device.type != "cuda" and preset.real:
            need = count_parameters(preset, num_layers=num_layers) * torch.finfo(dtype).bits // 8
            raise ValueError(f"weights='hub' with quant='nf4' on {device.type} would load {preset.name}'s weights in "
                             f"{str(dtype).replace('torch.', '')} whole ({need / 2**30:.0f} GiB) before quantizing: "
                             "load on a CUDA device (quantized shard by shard), or use a tiny preset on a CPU")
        if quant == "nf4" and device.type == "cuda":
            # The standard QLoRA load: transformers quantizes shard by shard, the bf16 model never exists whole.
            from transformers import BitsAndBytesConfig

            kwargs["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                bnb_4bit_use_double_quant=True,
            )
            kwargs["device_map"] = {"": device.index or 0}
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        if device.type != "meta":
            model = model.to(device) if "quantization_config" not in kwargs else model

    if quant == "nf4" and not getattr(model, "is_loaded_in_4bit", False):
        if device.type == "meta":
            raise ValueError("NF4 quantization needs real weights; build on cuda or cpu, not meta")
        quantize_nf4(model, compute_dtype=dtype)
        model.is_loaded_in_4bit = True

    if quant is not None or lora is not None:
        for p in model.parameters():
            p.requires_grad_(False)

    if lora is not None:
        model = add_lora(model, preset, lora)

    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    info = ModelInfo(
        preset=preset.name, family=preset.family, num_layers=model.config.num_hidden_layers, quant=quant,
        lora_rank=lora.rank if lora else None, dtype=str(dtype).replace("torch.", ""), device=str(device),
        weights=weights, attn_implementation=attn,
        params_total=sum(p.numel() for p in model.parameters()),
        params_trainable=sum(p.numel() for p in model.parameters() if p.requires_grad),
    )
    model.fastsft_info = info
    return model


def add_lora(model: nn.Module, preset: ModelPreset, lora: LoraSettings) -> nn.Module:
    """Wrap ``model`` in PEFT LoRA adapters (all attention and MLP projections unless told otherwise)."""
    from peft import LoraConfig, get_peft_model

    targets = list(lora.target_modules or preset.lora_targets)
    kwargs: dict[str, Any] = dict(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, bias="none",
        target_modules=targets, task_type="CAUSAL_LM",
    )
    if lora.lora_experts:
        experts = preset.family_record.experts
        if experts is None or not experts.lora_parameters:
            offered = [f.name for f in FAMILIES.values() if f.experts is not None and f.experts.lora_parameters]
            raise ValueError(f"lora_experts is implemented for the expert parameters of {', '.join(offered)} only "
                             f"(preset {preset.name!r} is {preset.family})")
        kwargs["target_parameters"] = list(experts.lora_parameters)
    peft_model = get_peft_model(model, LoraConfig(**kwargs))
    return peft_model


def count_parameters(preset: str | ModelPreset, num_layers: int | None = None) -> int:
    """Parameters of a preset, counted on the meta device (nothing is allocated)."""
    model = build_model(preset, device="meta", num_layers=num_layers)
    return sum(p.numel() for p in model.parameters())
