"""Where the time of the all-fast step goes, at full depth: one profiled breakdown per model and kernel floor.

GPU default: the combined scenario's models and batches -- Qwen3-14B (40 layers, NF4 + LoRA r16 on all
projections, one packed row of 8192 tokens) and GPT-OSS-20B (24 layers, bf16, LoRA r16 on attention, rows of 4096)
-- its ``all fast`` variant (cached packed metadata, offload x2 + prefetch, sync-free experts), built once with
stock kernels and once on the Liger floor (``kernels=liger``: Liger's RMSNorm, SwiGLU and RoPE, fastsft's fused
loss). Per build: ``warmup`` steps, ``timed`` unprofiled steps (the step time without the profiler, CUDA events),
then ``steps`` steps under ``torch.profiler`` whose device time is split into the categories of
:mod:`fastsft_lab.lab.breakdown` (attention, experts, dense matmuls, NF4 dequant, LoRA, loss + LM head, norms &
elementwise, copies & offload, optimizer, other, idle), summing to the profiled step. On a device the bottleneck
is named on the breakdown re-based on the unprofiled step (``breakdown.step_view``: idle = unprofiled step - busy,
so the profiler's own host overhead is not taken for the step's); the profiled breakdown is kept as measured.

Smoke (a CPU): tiny models, CPU profiler activity only: the categories are host ops' self time and ``idle`` is host
time outside any op (Python), not device idleness.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ...data import benchmark_batches
from ...dequant import fused_dequant_targets
from ...models import get_preset
from ..breakdown import breakdown_variant, describe_bottleneck, format_breakdown, step_view
from ..harness import make_optimizer, make_result, run_variants, with_autocast, write_json
from ..plots import plot_breakdown, save_figure
from ..scenario import OptionError, Scenario, option
from .combined import combined_variants, model_builds, validate_models_and_kernels


@dataclasses.dataclass
class BreakdownOptions:
    models: list = option(["qwen3-14b", "gpt-oss-20b"], kind="strs", help="model presets")
    num_layers: int | None = option(None, kind="int?", help="decoder layers kept at real width (none: all)")
    tokens: int = option(8192, kind="int", help="tokens per step")
    moe_row_tokens: int = option(4096, kind="int", help="tokens per packed row for MoE models (dense: one row)")
    kernels: list = option(["none", "liger"], kind="strs", help="none and/or liger (the fast-kernel floor)")
    backend: str = option("varlen", kind="str", help="packed-attention backend of the all-fast variant")
    fused_dequant: bool = option(False, kind="bool", help="profile all fast + fused dequant (QLoRA models: "
                                 "fastsft_lab.dequant) instead of all fast")
    mix: str = option("realistic", kind="str", help="length mix")
    lora_rank: int = option(16, kind="int", help="LoRA rank")
    autocast: str = option("none", kind="str", help="none, bf16 or fp16 (GPU default bf16): the step under torch.autocast (as "
                           "SFTTrainer(bf16=True) runs it)")
    steps: int = option(2, kind="int", help="profiled steps (the breakdown is their mean)")
    timed: int = option(3, kind="int", help="unprofiled steps timed before profiling (the profiler's overhead)")
    warmup: int = option(2, kind="int", help="warm-up steps")

    @classmethod
    def defaults(cls, device: torch.device, smoke: bool) -> "BreakdownOptions":
        if smoke:
            cpu = device.type == "cpu"
            return cls(models=["tiny-qwen3", "tiny-gpt-oss"], tokens=512, moe_row_tokens=256,
                       kernels=["none"] if cpu else ["none", "liger"], backend="sdpa" if cpu else "varlen",
                       mix="short", lora_rank=8, steps=1, timed=2, warmup=1)
        return cls(autocast="bf16" if device.type == "cuda" else "none")


class BreakdownScenario(Scenario):
    name = "breakdown"
    title = "where the time of the all-fast step goes, at full depth (attention, experts, matmuls, LoRA, ..., idle)"
    Options = BreakdownOptions

    def validate(self, opts: BreakdownOptions, device: torch.device) -> None:
        super().validate(opts, device)
        validate_models_and_kernels(opts, device)
        if opts.timed < 1:
            raise OptionError(f"timed must be >= 1, got {opts.timed}")
        if opts.fused_dequant:
            dense = [m for m in opts.models if not (get_preset(m).real and not get_preset(m).is_moe)]
            if dense:
                raise OptionError(f"fused_dequant needs QLoRA (NF4) models; {', '.join(dense)} are not (NF4 here: "
                                  "the real dense presets, e.g. qwen3-14b)")

    def run(self, opts: BreakdownOptions, *, device: torch.device, out_dir: str, progress: bool = True) -> list[dict]:
        return [self._one(model, preset, opts, extra, device, out_dir, progress)
                for preset, model, extra in model_builds(opts, device)]

    def _one(self, model, preset, opts: BreakdownOptions, extra: dict, device, out_dir, progress) -> dict:
        is_moe = preset.is_moe
        tokens = opts.tokens
        row = min(opts.moe_row_tokens, tokens) if is_moe else tokens
        batches = [b.to(device) for b in benchmark_batches(tokens_per_step=tokens, row_tokens=row,
                                                           steps=max(2, opts.steps), vocab_size=model.config.vocab_size,
                                                           mix=opts.mix)]
        fast = next(v for v in combined_variants(model, is_moe=is_moe, which="core", packed=opts.backend, trl=False,
                                                 dequant=bool(fused_dequant_targets(model)))
                    if v.name == ("all fast + fused dequant" if opts.fused_dequant else "all fast"))
        (fast,) = with_autocast([fast], opts.autocast)
        label = f"{preset.name} {tokens} tok, kernels={extra['kernels']}"
        optimizer = make_optimizer(model)
        rows = run_variants(model, batches, [fast], steps=opts.timed, warmup=opts.warmup, optimizer=optimizer,
                            count_syncs=False, progress=progress, label=label)
        if "error" in rows[0]:
            breakdown = None
        else:
            breakdown = breakdown_variant(model, batches, fast, optimizer=optimizer, device=device, steps=opts.steps,
                                          unprofiled=False)    # step_view re-bases it on the timed rows
        config = {"model": preset.name, "num_layers": model.config.num_hidden_layers, "tokens_per_step": tokens,
                  "row_tokens": row, "mix": opts.mix, "variant": fast.name, "autocast": opts.autocast,
                  "quant": "nf4" if preset.real and not preset.is_moe else "none",
                  "lora_rank": opts.lora_rank, "gradient_checkpointing": True, "packed_backend": opts.backend,
                  "dtype": str(next(model.parameters()).dtype).replace("torch.", ""), "warmup": opts.warmup,
                  "timed_steps": opts.timed, "profiled_steps": opts.steps, "batch": batches[0].length_stats(),
                  "profiler_activity": "cuda" if device.type == "cuda" else "cpu", **extra}
        notes = ("Device time per category of the profiled all-fast steps (mean), summing to the profiled step; "
                 "categories by module scope and backward-node sequence numbers (fastsft_lab.lab.breakdown). ")
        if device.type != "cuda":
            notes += "CPU run: host ops' self time; idle is host time outside any op, not device idleness."
        result = make_result("breakdown", config, rows, device, notes=notes)
        result["breakdown"] = breakdown
        stem = f"breakdown_{preset.name}_L{config['num_layers']}_{tokens}tok_{extra['kernels']}"
        if opts.fused_dequant:
            stem += "_fused-dequant"
        view = step_view(result)         # on a device: re-based on the unprofiled step (the profiler's idle out)
        if view is not None:
            by = {r["category"]: r for r in view["categories"]}
            top = by[view["bottleneck"]]
            result["bottleneck"] = {"category": top["category"], "label": top["label"], "ms": top["ms"],
                                    "share": top["share"], "top_kernel": top["top"][0]["name"] if top["top"] else None,
                                    "largest_work": view["bottleneck_work"], "sentence": describe_bottleneck(view)}
            unprofiled = rows[0]["step_ms"]["median"]
            result["derived"] = {"profiled_over_unprofiled_step": round(breakdown["step_ms"] / unprofiled, 4)}
            if "profiled_idle_ms" in view:
                result["derived"]["idle_unprofiled_ms"] = by["idle"]["ms"]
        write_json(result, os.path.join(out_dir, stem + ".json"))
        fig = plot_breakdown([result])
        if fig is not None:
            save_figure(fig, os.path.join(out_dir, stem + ".png"))
        if breakdown is not None:
            print(f"\n  {label}: step {rows[0]['step_ms']['median']:.1f} ms unprofiled, "
                  f"{breakdown['step_ms']:.1f} ms profiled\n" + format_breakdown(view) +
                  f"\n  {result['bottleneck']['sentence']}")
        else:
            print(f"\n  {label}: ERROR {rows[0]['error']}")
        return result


__all__ = ["BreakdownScenario", "BreakdownOptions"]
