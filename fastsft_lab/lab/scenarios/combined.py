"""Benchmark of the three optimizations together, at full depth, against what a user would otherwise run.

GPU default: Qwen3-14B (all 40 layers, NF4 + LoRA r16 on all projections, one packed row per step) and GPT-OSS-20B
(all 24 layers, bf16, LoRA r16 on attention, rows of 4096 tokens), 8192 tokens per step from the realistic mix,
gradient checkpointing. Variants, interleaved step by step on the same batches:

* ``transformers default``: stock attention (Qwen3 sdpa; GPT-OSS eager, which lets packed sequences attend to each
  other), stock experts (``grouped_mm``), transformers' checkpointing; packed ``position_ids``, no mask.
* ``transformers, eager experts`` (MoE): the per-expert loop transformers also ships.
* ``TRL activation offloading``: the default path inside TRL's ``get_act_offloading_ctx_manager`` (what
  ``SFTConfig(activation_offloading=True)`` runs). TRL's padding-free collator gives the same inputs as the default
  path here (packed ``position_ids``, no mask): its cost is the same step.
* ``all naive``: per-layer metadata (varlen), offload with one buffer, transformers' default experts (MoE:
  ``grouped_mm``, the "before" fix 3 is measured against; runs before 2026-12-06 ran the eager per-expert loop here,
  which the default does not, and their toggles say ``moe: naive``).
* ``packed (cached metadata)`` -> ``+ sync_free experts`` (MoE) -> ``all fast`` (+ offload x2 + prefetch); the
  decomposition every view reads is the attribution scenario's chain, one change per step;
* the ablation: ``all fast`` with one optimization back to its naive form at a time;
* ``all fast + compiled layers`` (``compiled=true``): every decoder layer compiled in place (``nn.Module.compile``,
  as Unsloth compiles its blocks), packed attention eager between the compiled regions.
* ``all fast + fused dequant`` (QLoRA models): all fast with :mod:`fastsft_lab.dequant` (one Triton kernel per NF4
  dequantisation, none in a recomputed layer's backward), kept out of ``all fast`` until it measures faster.

``kernels=liger`` builds the model again with the fast-kernel floor the published fixes assume -- Liger-Kernel's
RMSNorm, SwiGLU (Qwen3) and RoPE, fastsft_lab's fused linear cross-entropy (Liger's reads the token count back
with ``.item()``) and fused LoRA (:mod:`fastsft_lab.lora`) -- and runs the default, all-naive and all-fast variants on it. Liger patches RoPE module-wide, so
a model's ``none`` configuration runs before its ``liger`` one. Per variant: forward, backward, step, tokens/s,
MFU (model FLOPs ``6 N T`` + attention over the GPU's dense bf16 peak), host syncs per step, peak memory.
"""

from __future__ import annotations

import dataclasses
import os
import weakref

import torch
from torch import nn

from ...data import benchmark_batches
from ...env import environment, package_version
from ..._compat import compiled_call, forward_hooks, remove_forward_hook, set_compiled_call
from ...dequant import fused_dequant_targets
from ...lora import fused_lora_targets
from ...models import LoraSettings, build_model, get_preset
from ...structure import base_model, decoder_layers
from ...packing import PackedAttention, packed_inputs
from ...toggles import apply
from ..flops import peak_flops
from ..harness import AUTOCAST, Variant, format_table, make_result, run_variants, with_autocast, write_json
from ..plots import plot_waterfall, save_figure
from ..scenario import OptionError, Scenario, option
from .offload import measure_bandwidth
from .packed import stock_leak

def build_combined_model(preset, *, num_layers: int | None, lora_rank: int, device: torch.device) -> nn.Module:
    """The model the combined scenario (and the breakdown) measures: NF4 for the real Qwen3, LoRA on every
    projection (attention only for GPT-OSS), gradient checkpointing, LoRA B drawn away from zero so that the adapters
    have a real gradient path; bf16 on a GPU, float32 on a CPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    quant = "nf4" if preset.real and not preset.is_moe else None
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] if preset.is_moe else None
    model = build_model(preset.name, device=device, dtype=dtype, quant=quant, num_layers=num_layers,
                        lora=LoraSettings(rank=lora_rank, target_modules=targets),
                        gradient_checkpointing=True, attn_implementation=None)
    for p in model.parameters():
        if p.requires_grad and p.dim() == 2 and not p.any():
            nn.init.normal_(p, std=0.01)
    return model


# --- the variants ---------------------------------------------------------------------------------------------------
def _configure(model: nn.Module, *, packed: str | None = None, cache: bool = True, moe: str | None = None,
               offload: int = 0, check: bool = True) -> None:
    """One variant's switches, set through :func:`fastsft_lab.apply` (what a user calls); ``moe="stock"`` is the
    experts implementation the model had. The batch-check ablation (``check=False``) gives packed attention its
    settings (:class:`~fastsft_lab.packing.PackedAttention`) instead of a backend name."""
    apply(model, packed_attention=(PackedAttention(packed, cache, check_batch=check) if packed else "off"),
          moe_routing=None if moe is None else ("off" if moe == "stock" else moe),
          offload_buffers=offload or "off")


def _reset(model: nn.Module, is_moe: bool) -> None:
    _configure(model, moe="stock" if is_moe else None)


_COMPILED = "_fastsft_compiled_call"


def compile_layers(model: nn.Module) -> int:
    """Compile every decoder layer in place (``nn.Module.compile``: a regional compile, as Unsloth does); packed
    attention stays eager (the registry wraps it in ``torch.compiler.disable``). Each layer's compiled callable is
    made once and kept, so switching back on (every interleaved step) builds nothing. Returns the number of layers.
    Undone by :func:`uncompile_layers`."""
    layers = decoder_layers(model)
    for layer in layers:
        if _COMPILED not in layer.__dict__:
            layer.compile()
            layer.__dict__[_COMPILED] = compiled_call(layer)
        set_compiled_call(layer, layer.__dict__[_COMPILED])   # what nn.Module.compile sets and __call__ reads
    return len(layers)


def uncompile_layers(model: nn.Module) -> None:
    """The decoder layers back to their eager forward (the compiled callables are kept for the next switch-on)."""
    for layer in decoder_layers(model):
        set_compiled_call(layer, None)


class TRLActivationOffloading:
    """TRL 1.16's activation offloading as ``SFTTrainer`` runs it for ``SFTConfig(activation_offloading=True)``: the
    context is built once, before the first step (:meth:`enable`, outside the timed step: it walks the parameters and
    hooks the LM head), and entered around each step (the instance, called, gives it: a variant's ``context``). TRL
    never removes the hooks it puts on the LM head; :meth:`disable` takes them off and :meth:`enable` puts the same
    ones back, so the variants timed between run without them. (Its ``__enter__`` also empties the CUDA cache where
    bitsandbytes is imported, every step, as in TRL: the variant timed next then allocates afresh.)"""

    def __init__(self) -> None:
        # model -> [context, [(module, hook, always_call: None for a pre-hook)], live hook keys or None]
        self._built: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()

    def enable(self, model: nn.Module) -> None:
        from trl.models.activation_offloading import get_act_offloading_ctx_manager

        entry = self._built.get(model)
        if entry is None:
            before = {id(m): set(forward_hooks(m)[0]) | set(forward_hooks(m)[1]) for m in model.modules()}
            context = get_act_offloading_ctx_manager(model, warn_if_no_head=False)
            hooks, keys = [], []
            for m in model.modules():
                pre, post, always_called = forward_hooks(m)
                for key, hook in pre.items():
                    if key not in before.get(id(m), ()):
                        hooks.append((m, hook, None))
                        keys.append((m, key))
                for key, hook in post.items():
                    if key not in before.get(id(m), ()):
                        hooks.append((m, hook, key in always_called))
                        keys.append((m, key))
            self._built[model] = [context, hooks, keys]
        elif entry[2] is None:
            entry[2] = [(m, (m.register_forward_pre_hook(h) if always is None
                             else m.register_forward_hook(h, always_call=always)).id) for m, h, always in entry[1]]

    def disable(self, model: nn.Module) -> None:
        entry = self._built.get(model)
        if entry is None or entry[2] is None:
            return
        for module, key in entry[2]:
            remove_forward_hook(module, key)
        entry[2] = None

    def __call__(self, model: nn.Module):
        if model not in self._built:
            raise RuntimeError("TRL activation offloading: enable(model) builds its context before the first step")
        return self._built[model][0]


def trl_offloading_variant(name: str, note: str, inputs, enable=None, disable=None, toggles=None) -> Variant:
    """A variant running TRL's activation offloading around each step, after ``enable`` and before ``disable``."""
    trl = TRLActivationOffloading()

    def on(model):
        if enable is not None:
            enable(model)
        trl.enable(model)

    def off(model):
        trl.disable(model)
        if disable is not None:
            disable(model)

    return Variant(name, dict(toggles or {}), enable=on, disable=off, inputs=inputs, note=note, context=trl)


def combined_variants(model: nn.Module, *, is_moe: bool, packed: str = "varlen", which: str = "all",
                      trl: bool = True, compiled: bool = False, dequant: bool = False) -> list[Variant]:
    """The variants of the module docstring (``which="core"``: default, all naive, all fast only; ``trl``: TRL's
    activation offloading, which needs an accelerator; ``compiled``: also all fast with compiled decoder layers;
    ``dequant``: also all fast with the fused NF4 dequantisation, for QLoRA models)."""
    stock_inputs = lambda b, s: b.model_inputs()      # noqa: E731
    meta_inputs = lambda b, s: packed_inputs(b)        # noqa: E731
    moe_fast = "sync_free" if is_moe else None
    stock = "stock" if is_moe else None

    def v(name, note, inputs, context=None, **cfg):
        cfg.setdefault("moe", stock)
        toggles = {k: val for k, val in cfg.items()}
        return Variant(name, toggles, enable=lambda m: _configure(m, **cfg), disable=lambda m: _reset(m, is_moe),
                       inputs=inputs, note=note, context=context)

    default = v("transformers default", "stock transformers 5.17: its attention (Qwen3 sdpa; GPT-OSS eager, where "
                "packed sequences attend to each other), grouped_mm experts, its gradient checkpointing; packed "
                "position_ids, no mask", stock_inputs)
    naive = v("all naive", f"metadata rebuilt in every layer ({packed}: the per-layer derivation that path's code "
              "runs), offload with one staging buffer, transformers' default experts (grouped_mm)", stock_inputs,
              packed=packed, cache=False, moe=stock, offload=1)
    fast = v("all fast", f"PackedMetadata once per batch ({packed}), offload x2 + prefetch, sync-free grouped "
             "experts: 0 host syncs", meta_inputs, packed=packed, moe=moe_fast, offload=2)
    def fast_plus(name: str, toggle: dict, switch_on, switch_off, note: str) -> Variant:
        """All fast with one more switch on (turned off again before the reset)."""
        def enable(m):
            _configure(m, packed=packed, moe=moe_fast, offload=2)
            switch_on(m)

        def disable(m):
            switch_off(m)
            _reset(m, is_moe)

        return Variant(f"all fast + {name}", {**fast.toggles, **toggle}, enable=enable, disable=disable,
                       inputs=meta_inputs, note=note)

    extra = []
    if compiled:
        extra.append(fast_plus("compiled layers", {"compile_layers": True}, compile_layers, uncompile_layers,
                               "all fast with every decoder layer compiled (nn.Module.compile, inductor; a regional "
                               "compile as Unsloth's); packed attention runs eager between the compiled regions; "
                               "compiled in the warm-up steps"))
    if dequant:
        extra.append(fast_plus("fused dequant", {"fused_dequant": True}, lambda m: apply(m, fused_dequant=True),
                               lambda m: apply(m, fused_dequant=False),
                               "all fast with QLoRA's NF4 weights dequantised by one Triton kernel and kept from each "
                               "checkpoint's recompute to its backward (two dequantisations per projection and step "
                               "instead of three); bitsandbytes' weights bit for bit"))
    if which == "core":
        return _mark_leaks(model, [default, naive, fast, *extra])
    out = [default]
    if is_moe:
        out.append(v("transformers, eager experts", "stock attention and checkpointing, transformers' eager "
                     "per-expert loop (experts_implementation='eager')", stock_inputs, moe="eager"))

    if trl:
        stock_variant = v("TRL activation offloading", "", stock_inputs)
        out.append(trl_offloading_variant(
            "TRL activation offloading", "the default path inside TRL 1.16's get_act_offloading_ctx_manager "
            "(SFTConfig(activation_offloading=True)): saved activations to pinned CPU memory on a side stream; its "
            "context built once, entered every step, as SFTTrainer does", stock_inputs,
            enable=stock_variant.enable, disable=stock_variant.disable, toggles=stock_variant.toggles))
    out.append(naive)
    out.append(v("packed (cached metadata)", f"waterfall step 1: packed attention ({packed}), metadata once per "
                 "batch; stock experts, standard checkpointing", meta_inputs, packed=packed))
    if is_moe:
        out.append(v("+ sync_free experts", "waterfall step 2: + the sync-free grouped experts (all fast without "
                     "offload)", meta_inputs, packed=packed, moe=moe_fast))
    out.append(fast)
    out.append(v("all fast, naive metadata", "ablation: all fast with the metadata rebuilt in every layer",
                 stock_inputs, packed=packed, cache=False, moe=moe_fast, offload=2))
    out.append(v("all fast, one buffer", "ablation: all fast with offload x1 (no overlapped reloads)", meta_inputs,
                 packed=packed, moe=moe_fast, offload=1))
    if is_moe:
        out.append(v("all fast, default experts", "ablation: all fast with transformers' default experts (grouped_mm)",
                     meta_inputs, packed=packed, moe=stock, offload=2))
    out.append(v("all fast, no batch check", "all fast without the on-device check that the metadata describes the "
                 "batch (check_batch=False): what that check costs", meta_inputs, packed=packed, moe=moe_fast,
                 offload=2, check=False))
    return _mark_leaks(model, out + extra)


def _mark_leaks(model: nn.Module, variants: list[Variant]) -> list[Variant]:
    """``variants`` with those on stock attention marked as computing something else where the family's stock masks
    let packed sequences attend to each other (GPT-OSS): their ``vs ref`` against all naive says so in one line."""
    leak = stock_leak(model)
    if not leak:
        return variants
    return [dataclasses.replace(v, unequal=leak) if v.toggles.get("packed") is None else v for v in variants]


# Liger-Kernel's entry point per model family, and whether its SwiGLU applies (the dense MLP's; GPT-OSS's experts
# have a gate of their own).
_LIGER_RECIPES = {"qwen3": ("apply_liger_kernel_to_qwen3", True), "gpt_oss": ("apply_liger_kernel_to_gpt_oss", False)}


def apply_liger(model: nn.Module, family: str) -> dict:
    """Liger-Kernel's RMSNorm, SwiGLU (Qwen3) and RoPE on this model, and fastsft_lab's fused loss and fused LoRA
    (irreversible for Liger's module patches: the scenario builds a fresh model for it)."""
    from liger_kernel.transformers import monkey_patch as mp

    if family not in _LIGER_RECIPES:
        raise ValueError(f"no Liger recipe for family {family!r}")
    entry, swiglu = _LIGER_RECIPES[family]
    getattr(mp, entry)(rope=True, rms_norm=True, swiglu=swiglu, cross_entropy=False, fused_linear_cross_entropy=False,
                       model=base_model(model))
    fused_lora = bool(fused_lora_targets(model))
    apply(model, fused_loss=True, fused_lora=fused_lora)
    detail = "liger rms_norm + rope" + (" + swiglu" if swiglu else "") + " + fastsft fused loss"
    if fused_lora:
        detail += " + fastsft fused LoRA"
    return {"liger_kernel": package_version("liger-kernel") or "unknown", "kernels_detail": detail}


def model_builds(opts, device: torch.device):
    """Yield ``(preset, model, extra)`` for each model of ``opts.models`` on each kernel floor of ``opts.kernels``
    (none before liger: Liger patches RoPE module-wide, so each floor gets a fresh build), freeing each model after
    its turn. ``extra`` is the configuration the floor adds to a result: ``kernels``, Liger's version and detail,
    and ``host_link``, the pinned host link the offloaded copies cross (measured once: hosts differ, and so can
    their step times). The combined and breakdown scenarios both measure through it."""
    link = measure_bandwidth(device)
    for model_name in opts.models:
        preset = get_preset(model_name)
        for kernels in opts.kernels:
            model = build_combined_model(preset, num_layers=opts.num_layers, lora_rank=opts.lora_rank, device=device)
            extra = {"kernels": kernels, "host_link": link,
                     **(apply_liger(model, preset.family) if kernels == "liger" else {})}
            yield preset, model, extra
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()


# --- the scenario ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ModelOptions:
    """The options of the scenarios that run whole models at full depth on both kernel floors (combined,
    attribution): which models, how deep, how many tokens, which floor, autocast, packed backend, data, LoRA."""

    models: list = option(["qwen3-14b", "gpt-oss-20b"], kind="strs", help="model presets")
    num_layers: int | None = option(None, kind="int?", help="decoder layers kept at real width (none: all)")
    tokens: list = option([8192], kind="ints", help="tokens per step")
    moe_row_tokens: int = option(4096, kind="int", help="tokens per packed row for MoE models (dense: one row)")
    kernels: list = option(["none", "liger"], kind="strs", help="none and/or liger (the fast-kernel floor)")
    autocast: str = option("none", kind="str", help="none, bf16 or fp16 (GPU default bf16): every variant under torch.autocast (what "
                           "SFTTrainer(bf16=True) does; PEFT's fp32 adapters then run their matmuls in bf16)")
    backend: str = option("varlen", kind="str", help="packed-attention backend of the packed variants")
    mix: str = option("realistic", kind="str", help="length mix")
    lora_rank: int = option(16, kind="int", help="LoRA rank")
    steps: int = option(4, kind="int", help="measured steps per variant")
    warmup: int = option(1, kind="int", help="warm-up steps per variant")

    @classmethod
    def defaults(cls, device: torch.device, smoke: bool):
        if smoke:
            cpu = device.type == "cpu"
            return cls(models=["tiny-qwen3", "tiny-gpt-oss"], tokens=[512], moe_row_tokens=256,
                       kernels=["none"] if cpu else ["none", "liger"], lora_rank=8, mix="short",
                       backend="sdpa" if cpu else "varlen", steps=4, warmup=1)
        return cls(autocast="bf16" if device.type == "cuda" else "none")


@dataclasses.dataclass
class CombinedOptions(ModelOptions):
    variants: str = option("all", kind="str", help="all, or core (default, all naive, all fast)")
    liger_variants: str = option("core", kind="str", help="variant set on the liger build (all or core)")
    compiled: bool = option(False, kind="bool", help="also time all fast with every decoder layer compiled "
                            "(nn.Module.compile; give warmup >= 2: the first steps compile)")


def validate_models_and_kernels(opts, device: torch.device) -> None:
    """The checks the combined and breakdown scenarios share: known presets, kernels none/liger (liger on CUDA
    only), a known autocast, a known packed-attention backend."""
    for m in opts.models:
        get_preset(m)
    for k in opts.kernels:
        if k not in ("none", "liger"):
            raise OptionError(f"kernels must be none and/or liger, got {k!r}")
        if k == "liger" and device.type != "cuda":
            raise OptionError("kernels=liger needs a CUDA GPU (Liger-Kernel is Triton)")
    if opts.autocast not in AUTOCAST:
        raise OptionError(f"autocast must be one of {', '.join(AUTOCAST)}, got {opts.autocast!r}")
    from ...packing import BACKENDS

    if opts.backend not in BACKENDS:
        raise OptionError(f"unknown packed-attention backend {opts.backend!r}; known: {', '.join(BACKENDS)}")


class CombinedScenario(Scenario):
    name = "combined"
    title = "the three optimizations together, at full depth (stock transformers, TRL, ablation, fast kernels)"
    Options = CombinedOptions

    def validate(self, opts: CombinedOptions, device: torch.device) -> None:
        super().validate(opts, device)
        validate_models_and_kernels(opts, device)
        for name in (opts.variants, opts.liger_variants):
            if name not in ("all", "core"):
                raise OptionError(f"variants must be all or core, got {name!r}")

    def run(self, opts: CombinedOptions, *, device: torch.device, out_dir: str, progress: bool = True) -> list[dict]:
        results = []
        for preset, model, extra in model_builds(opts, device):
            for tokens in opts.tokens:
                results.append(self._config(model, preset, opts, tokens, extra["kernels"], extra, device, out_dir,
                                            progress))
        return results

    def _config(self, model, preset, opts, tokens, kernels, extra, device, out_dir, progress) -> dict:
        is_moe = preset.is_moe
        row = min(opts.moe_row_tokens, tokens) if is_moe else tokens
        batches = [b.to(device) for b in benchmark_batches(tokens_per_step=tokens, row_tokens=row,
                                                           steps=max(2, opts.steps), vocab_size=model.config.vocab_size,
                                                           mix=opts.mix)]
        which = opts.liger_variants if kernels == "liger" else opts.variants
        variants = combined_variants(model, is_moe=is_moe, which=which, packed=opts.backend,
                                     trl=device.type == "cuda", compiled=opts.compiled,
                                     dequant=bool(fused_dequant_targets(model)))
        label = f"{preset.name} {tokens} tok, kernels={kernels}"
        variants = with_autocast(variants, opts.autocast)
        # checked against all naive: exact packing (stock GPT-OSS attention lets packed sequences see each other)
        rows = run_variants(model, batches, variants, steps=opts.steps, warmup=opts.warmup, progress=progress,
                            label=label, check_equal="all naive")
        peak = peak_flops(environment(device).get("gpu_name"))   # run_variants put tokens/s and MFU on every row
        mean_flops = next((r["flops_per_step"] for r in rows if "flops_per_step" in r), None)
        config = {"model": preset.name, "num_layers": model.config.num_hidden_layers, "tokens_per_step": tokens,
                  "row_tokens": row, "mix": opts.mix, "quant": "nf4" if preset.real and not preset.is_moe
                  else "none", "lora_rank": opts.lora_rank, "gradient_checkpointing": True,
                  "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "steps": opts.steps,
                  "warmup": opts.warmup, "batch": batches[0].length_stats(), "flops_per_step": mean_flops,
                  "flops_convention": "6 N T + causal attention (fwd + bwd); N = matmul parameters per token",
                  "peak_flops": peak, "packed_backend": opts.backend,
                  "autocast": opts.autocast, **extra}
        result = make_result("combined", config, rows, device,
                             notes="Variants interleaved step by step on the same batches; the first row is 1.00x.")
        by = {r["name"]: r for r in rows if "step_ms" in r}

        def speed(a, b):
            return round(by[a]["step_ms"]["median"] / by[b]["step_ms"]["median"], 4) if a in by and b in by else None

        result["derived"] = {k: v for k, v in {
            "all_fast_vs_default": speed("transformers default", "all fast"),
            "all_fast_vs_all_naive": speed("all naive", "all fast"),
            "batch_check_cost": (round(by["all fast"]["step_ms"]["median"] / by["all fast, no batch check"]["step_ms"]
                                       ["median"] - 1, 4) if "all fast, no batch check" in by and "all fast" in by
                                 else None),
            "all_fast_vs_best_stock": (round(min(by[n]["step_ms"]["median"] for n in by if n.startswith(
                ("transformers", "TRL"))) / by["all fast"]["step_ms"]["median"], 4) if "all fast" in by else None),
        }.items() if v is not None}
        return write_waterfall_result(result, out_dir, f"combined_{preset.name}_L{config['num_layers']}_{tokens}tok_"
                                      f"{kernels}", label)


def write_waterfall_result(result: dict, out_dir: str, stem: str, label: str) -> dict:
    """``result`` as ``<stem>.json``, its waterfall as ``<stem>.png``, its table printed under ``label``."""
    write_json(result, os.path.join(out_dir, stem + ".json"))
    fig = plot_waterfall(result)
    if fig is not None:
        save_figure(fig, os.path.join(out_dir, stem + ".png"))
    print(f"\n  {label}\n" + format_table(result))
    return result


__all__ = ["CombinedScenario", "CombinedOptions", "ModelOptions", "write_waterfall_result", "combined_variants", "apply_liger", "build_combined_model",
           "validate_models_and_kernels", "compile_layers", "uncompile_layers", "model_builds"]
