"""Benchmark of optimization 3: the MoE routing modes on GPT-OSS (whole model steps + one layer's experts alone).

GPU default: GPT-OSS-20B width, 4 layers, bf16, LoRA r16 on attention, stock eager attention in rows of 2048
tokens, 8k and 16k tokens per step; forward (validation) and training steps; then one MoE layer's experts alone per
implementation (GPT-OSS-20B and Qwen3-30B-A3B width) with "expert matmuls alone" as the zero-overhead limit.
Smoke (CPU): tiny-gpt-oss and tiny-qwen3-moe, seconds.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ...data import benchmark_batches
from ...families import get_family
from ...models import LoraSettings, build_model, get_preset
from ...structure import decoder_layers
from ...moe import experts_modules, fused_glu_available, group_by_expert, grouped_mm, grouped_mm_unavailable, moe_routing
from ...moe import IMPLEMENTATIONS, quantize_experts_nf4, set_fused_glu, nf4_expert_bytes
from ...moe.gate import GATES
from ...moe.modules import spec_of
from ...moe.kernels import set_fused_combine
from ...moe.nf4 import NF4_ATTR, NF4Weight, expert_weight, is_nf4, mat_b
from ...profiling import SyncCounter, time_ms
from ...toggles import apply
from ..launches import LAUNCHES_COUNTED, count_launches
from ..harness import Variant, default_inputs, format_table, make_result, run_variants, write_json
from ..plots import plot_result, save_figure
from ..scenario import OptionError, Scenario, option


def _router_and_experts(mlp: nn.Module) -> tuple[Any, Any]:
    router = getattr(mlp, "router", None) or getattr(mlp, "gate", None)
    experts = getattr(mlp, "experts", None)
    if router is None or experts is None:
        raise ValueError(f"{type(mlp).__name__} has no router/gate and experts: not a supported MoE block")
    return router, experts


def routing_stats(model: nn.Module, inputs: dict) -> dict:
    """Tokens per expert in every MoE layer for one forward of ``inputs`` (untimed; reads the ids back once).

    Returns ``{"tokens_per_expert": [[...] per layer], "experts_hit": [...], "load_max_over_mean": [...]}``.
    """
    captured: list[torch.Tensor] = []

    def hook(module, args, kwargs):
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
        captured.append(index.detach().reshape(-1))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in experts_modules(model)]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    mods = experts_modules(model)
    num_experts = mods[0].num_experts if mods else 0
    per_layer = [torch.bincount(ids.cpu(), minlength=num_experts).tolist() for ids in captured]
    return {
        "num_experts": num_experts,
        "top_k": int(captured[0].numel() // max(1, inputs["input_ids"].numel())) if captured else None,
        "tokens_per_expert": per_layer,
        "experts_hit": [sum(1 for c in row if c) for row in per_layer],
        "load_max_over_mean": [round(max(row) / (sum(row) / len(row)), 3) if sum(row) else None for row in per_layer],
    }


MICRO_IMPLEMENTATIONS = (   # transformers' default first (the 1.00x of every table and chart), then fix 3's steps
    ("transformers grouped_mm", "grouped_mm",
     "stock experts_implementation='grouped_mm' (transformers 5.x default): sort, histc, grouped_mm, sentinel "
     "masking, per-row bias gathers, weight multiply + inverse-permutation gather + sum"),
    ("sync_free, eager glue", "sync_free:eager_glue",
     "sync_free with every fused Triton kernel off: eager gate, combine as gather + batched matmul, token-gather "
     "backward as gather + sum (only where the fused kernels run)"),
    ("sync_free", "sync_free", "sort + searchsorted offsets on device, grouped_mm, lean glue; 0 host syncs"),
    ("sync_free, eager gate", "sync_free:eager_gate",
     "sync_free with the eager gate (GPT-OSS: six kernels; SiLU gate: three) instead of the fused Triton kernel "
     "(shows the gate's share; only where the fused kernels run)"),
    ("grouped", "grouped", "sort + searchsorted offsets, ONE .tolist() per layer, per-expert addmm slices"),
    ("naive", "naive", "fastsft naive = transformers' eager GptOssExperts/Qwen3MoeExperts loop, op for op"),
    ("transformers eager", "eager", "stock experts_implementation='eager' (the per-expert loop)"),
)


def experts_microbenchmark(model: nn.Module, *, tokens: int, layer: int = 0, warmup: int = 2, reps: int = 5,
                           implementations: Sequence[tuple[str, str, str]] = MICRO_IMPLEMENTATIONS,
                           seed: int = 0) -> list[dict]:
    """Time one MoE layer's experts alone, per implementation, on the same input and routing.

    The router runs once (outside the timing) on a random (tokens, H) input; each implementation then runs the
    experts forward (no grad: a validation step) and forward + backward (gradients for the input and the routing
    weights; expert weights frozen for the timing, as under LoRA, whatever the model was built with). The last row,
    "expert matmuls alone", is the zero-overhead limit: the two grouped matmuls on rows already sorted by expert
    (and, for training, their input gradients), with no routing, bias, gate or reduction at all.
    """
    mlp = decoder_layers(model)[layer].mlp
    router, experts = _router_and_experts(mlp)
    base = experts.get_base_layer() if hasattr(experts, "get_base_layer") else experts
    param = next(p for p in model.parameters() if p.is_floating_point())
    device = param.device
    dtype = getattr(base, NF4_ATTR)["dtype"] if is_nf4(base) else expert_weight(base, "down_proj").dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(tokens, _hidden_size(base), device=device, dtype=dtype, generator=gen)
    with torch.no_grad():
        _, weights, index = router(hidden)
    grad_out = torch.randn(tokens, hidden.shape[1], device=device, dtype=dtype, generator=gen)
    # Expert weights frozen for the timing, as under LoRA, whatever the model was built with (a model without
    # adapters trains every weight: its step would add the weight gradients the limit below does not have).
    trainable = [p for p in experts.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(False)
    try:
        rows = _micro_rows(model, experts, base, hidden, weights, index, grad_out, device, warmup, reps,
                           implementations)
    finally:
        for p in trainable:
            p.requires_grad_(True)
    return rows


def _micro_rows(model, experts, base, hidden, weights, index, grad_out, device, warmup, reps,
                implementations) -> list[dict]:
    rows = []
    for label, spec, note in implementations:
        impl, _, flag = spec.partition(":")
        if flag in ("eager_gate", "eager_glue") and not fused_glu_available(hidden):
            continue  # identical to sync_free here
        if flag == "eager_gate" and not GATES[spec_of(base).gate].fused(base):
            continue
        fused_before = set_fused_glu(False) if flag in ("eager_gate", "eager_glue") else None
        combine_before = set_fused_combine(False) if flag == "eager_glue" else None
        with moe_routing(model, impl):
            def forward():
                with torch.no_grad():
                    experts(hidden, index, weights)

            def train():
                h = hidden.detach().requires_grad_(True)
                w = weights.detach().requires_grad_(True)
                experts(h, index, w).backward(grad_out)

            toggles = {"experts_implementation": IMPLEMENTATIONS.get(impl, impl)}
            entry: dict[str, Any] = {"name": label, "toggles": toggles, "note": note}
            try:
                entry["forward_ms"] = time_ms(forward, device, warmup, reps)
                entry["step_ms"] = time_ms(train, device, warmup, reps)
                counter = SyncCounter(device=device, cross_check=device.type == "cuda")
                with counter:
                    forward()
                entry["host_syncs_per_step"] = counter.total
                entry["host_syncs_by_kind"] = dict(counter.by_kind)
                if counter.cuda_reported is not None:
                    entry["cuda_reported_syncs"] = counter.cuda_reported
                # beside the syncs, the launches: a host busy issuing small kernels loses little to a sync
                entry["launches_forward"] = count_launches(forward, device)
                entry["launches_per_step"] = count_launches(train, device)
                entry["launches_counted"] = LAUNCHES_COUNTED["cuda" if device.type == "cuda" else "cpu"]
            except torch.cuda.OutOfMemoryError as e:  # report, keep going
                entry = {"name": label, "note": note, "error": f"out of memory: {str(e).splitlines()[0]}"}
                torch.cuda.empty_cache()
            finally:
                if fused_before is not None:
                    set_fused_glu(fused_before)
                if combine_before is not None:
                    set_fused_combine(combine_before)
        rows.append(entry)
    rows.append(_matmuls_alone(base, hidden, index, grad_out, device, warmup, reps))
    return rows


def _hidden_size(experts: nn.Module) -> int:
    return int(getattr(experts, "hidden_size", None) or getattr(experts, "hidden_dim"))


def _matmuls_alone(experts: nn.Module, hidden: torch.Tensor, index: torch.Tensor, grad_out: torch.Tensor,
                   device: torch.device, warmup: int, reps: int) -> dict:
    note = ("zero-overhead limit: grouped_mm(x_sorted, W_gate_up) and grouped_mm(act, W_down) on pre-sorted rows "
            "with device offsets; training adds their input gradients (weights frozen). No routing, bias, gate or "
            "reduction.")
    if is_nf4(experts):
        w_gate_up, w_down = NF4Weight(experts, "gate_up_proj").mat_b(), NF4Weight(experts, "down_proj").mat_b()
        note += " NF4 experts: weights dequantized beforehand (not timed)."
    else:
        w_gate_up = mat_b(experts, expert_weight(experts, "gate_up_proj")).detach()
        w_down = mat_b(experts, expert_weight(experts, "down_proj")).detach()
    entry: dict[str, Any] = {"name": "expert matmuls alone", "toggles": {}, "note": note}
    if grouped_mm_unavailable(hidden, w_down) is not None:
        entry["error"] = f"no grouped_mm here: {grouped_mm_unavailable(hidden, w_down)}"
        return entry
    _, perm, offs = group_by_expert(index, experts.num_experts, int32=True)
    k = index.shape[1]
    x = hidden[perm // k].contiguous()
    act = torch.randn(x.shape[0], w_down.shape[1], device=device, dtype=hidden.dtype)
    g = grad_out.repeat_interleave(k, dim=0)

    def forward():
        with torch.no_grad():
            grouped_mm(x, w_gate_up, offs)
            grouped_mm(act, w_down, offs)

    def train():
        xr = x.detach().requires_grad_(True)
        ar = act.detach().requires_grad_(True)
        gu = grouped_mm(xr, w_gate_up, offs)
        y = grouped_mm(ar, w_down, offs)
        torch.autograd.backward([gu, y], [torch.ones_like(gu), g])

    entry["forward_ms"] = time_ms(forward, device, warmup, reps)
    entry["step_ms"] = time_ms(train, device, warmup, reps)
    entry["host_syncs_per_step"] = 0
    return entry


def routing_variants(model_family: str = "gpt_oss", inputs: Callable | None = None) -> list:
    """The five benchmark variants (naive, grouped, sync_free, transformers eager, transformers grouped_mm).

    ``inputs(batch, state) -> model kwargs`` overrides the stock inputs (e.g. packed attention's metadata).
    """
    inputs = inputs or default_inputs

    def switch(mode):
        return lambda m: apply(m, moe_routing=mode)

    def off(m):
        apply(m, moe_routing="off")

    cls = get_family(model_family).experts.class_name
    return [
        Variant("naive", {"moe_routing": "naive"}, switch("naive"), off, inputs=inputs,
                note=f"before: transformers 5.17's eager {cls}.forward loop, re-registered op for op as "
                     "'fastsft_naive' (one_hot, nonzero, per hit expert: host read of the id, torch.where, gather, "
                     "matmuls, index_add_): 2+ host syncs per hit expert and layer"),
        Variant("grouped", {"moe_routing": "grouped"}, switch("grouped"), off, inputs=inputs,
                note="group once: stable sort of expert ids, searchsorted end offsets, ONE .tolist() per MoE layer, "
                     "per-expert addmm on contiguous slices, deterministic k-way reduction (inverse permutation + "
                     "one bmm); costs one host sync per layer"),
        Variant("sync_free", {"moe_routing": "sync_free"}, switch("sync_free"), off, inputs=inputs,
                note="the same grouping with offsets on the device feeding torch grouped_mm; one-hot addmm for the "
                     "gate_up bias, down bias folded into a (T,E)@(E,H) matmul, no sentinel masking, weighted k-way "
                     "sum as one bmm, GPT-OSS gate fused in one Triton kernel on CUDA; 0 host syncs (falls back to "
                     "'grouped' where grouped_mm cannot run)"),
        Variant("transformers eager", {"experts_implementation": "eager"}, switch("eager"), off, inputs=inputs,
                note="peer: stock transformers experts_implementation='eager' (the same loop, dispatched by "
                     "transformers)"),
        Variant("transformers grouped_mm", {"experts_implementation": "grouped_mm"}, switch("grouped_mm"), off,
                inputs=inputs,
                note="peer: stock transformers experts_implementation='grouped_mm' (the 5.x default): sort, histc "
                     "counts, cumsum offsets, grouped_mm, EP-sentinel masked_fill passes, per-row bias gathers, "
                     "inverse-permutation gather, weight multiply and sum over k"),
    ]


def _modes(modes) -> list:
    """The whole-model modes to run: ``none`` (alone) runs none."""
    return [m for m in modes if m != "none"]


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in str(text))


@dataclasses.dataclass
class MoeOptions:
    preset: str = option("gpt-oss-20b", kind="str", help="model preset (qwen3-30b-a3b and tiny presets work too)")
    num_layers: int | None = option(4, kind="int?", help="decoder layers kept at real width (none: all)")
    tokens: list = option([8192, 16384], kind="ints", help="tokens per step")
    row_tokens: int = option(2048, kind="int", help="tokens per packed row (stock GPT-OSS attention is eager: T x T "
                                                    "scores per row)")
    modes: list = option(["forward", "train"], kind="strs", help="forward (no-grad validation step) and/or train; "
                         "none: no whole-model steps (the experts microbenchmark alone, on a one-layer build)")
    quant: str | None = option(None, kind="str?", help="none (bf16 experts) or nf4 (NF4 experts + attention, QLoRA)")
    lora_rank: int = option(16, kind="int", help="LoRA rank on the attention projections")
    lora_experts: bool = option(False, kind="bool", help="also PEFT LoRA on the expert weights (bf16 only)")
    attn_implementation: str | None = option(None, kind="str?", help="attention (default: the preset's stock one)")
    packed_backend: str | None = option(None, kind="str?", help="a fastsft_lab.packing backend for the attention")
    micro: bool = option(True, kind="bool", help="also time one layer's experts alone per implementation")
    micro_presets: list = option(["qwen3-30b-a3b"], kind="strs", help="extra presets for the experts "
                                                                      "microbenchmark (1 layer built); none: no extra")
    micro_reps: int = option(10, kind="int", help="repetitions of the microbenchmark")
    variants: list | None = option(None, kind="strs", help="subset of variant names (default: all five)")
    dtype: str = option("bfloat16", kind="str", help="compute dtype")
    steps: int = option(6, kind="int", help="measured steps per variant")
    warmup: int = option(2, kind="int", help="warm-up steps per variant")

    @classmethod
    def defaults(cls, device: torch.device, smoke: bool) -> "MoeOptions":
        if smoke:
            return cls(preset="tiny-gpt-oss", num_layers=None, tokens=[256], row_tokens=128,
                       micro_presets=["tiny-qwen3-moe"], micro_reps=5,
                       dtype="float32" if device.type == "cpu" else "bfloat16", steps=4, warmup=1)
        return cls()


@dataclasses.dataclass
class _Plan:
    """The resolved options of one run."""

    device: torch.device
    smoke: bool
    out_dir: str
    steps: int
    warmup: int
    progress: bool
    preset: Any
    num_layers: int | None
    tokens: list
    row_tokens: int
    modes: list
    quant: str | None
    lora_rank: int
    lora_experts: bool
    attn: str | None
    packed_backend: str | None
    micro: bool
    micro_presets: list
    micro_reps: int
    variants: list | None
    dtype: torch.dtype

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"


class MoeScenario(Scenario):
    name = "moe"
    title = "GPT-OSS MoE routing (optimization 3)"
    Options = MoeOptions

    def validate(self, opts: MoeOptions, device: torch.device) -> None:
        super().validate(opts, device)
        get_preset(opts.preset)
        for p in opts.micro_presets:
            if p not in ("none", ""):
                get_preset(p)
        if opts.quant not in (None, "nf4", "none"):
            raise OptionError(f"quant must be none or nf4, got {opts.quant!r}")
        if opts.quant == "nf4" and opts.lora_experts:
            raise OptionError("lora_experts=true needs bf16 experts (PEFT cannot parametrize NF4 expert weights)")
        bad = [m for m in opts.modes if m not in ("forward", "train", "none")]
        if bad:
            raise OptionError(f"modes must be forward and/or train (or none: the experts microbenchmark only), got {bad}")
        if _modes(opts.modes) == [] and not opts.micro:
            raise OptionError("modes=none and micro=false measure nothing: give a mode or micro=true")
        names = [v.name for v in routing_variants()]
        for v in opts.variants or []:
            if v not in names:
                raise OptionError(f"unknown moe variant {v!r}; known: {', '.join(names)}")
        if opts.dtype not in ("bfloat16", "float16", "float32"):
            raise OptionError(f"dtype must be bfloat16, float16 or float32, got {opts.dtype!r}")
        if opts.packed_backend is not None:
            from ...packing import BACKENDS

            if opts.packed_backend not in BACKENDS:
                raise OptionError(f"unknown packed-attention backend {opts.packed_backend!r}; known: "
                                  f"{', '.join(BACKENDS)}")

    def run(self, opts: MoeOptions, *, device: torch.device, out_dir: str, progress: bool = True) -> list[dict]:
        plan = _Plan(device=device, smoke=opts.preset.startswith("tiny"), out_dir=out_dir, steps=opts.steps,
                     warmup=opts.warmup, progress=progress, preset=get_preset(opts.preset),
                     num_layers=opts.num_layers, tokens=list(opts.tokens), row_tokens=opts.row_tokens,
                     modes=_modes(opts.modes), quant=None if opts.quant in (None, "none") else opts.quant,
                     lora_rank=opts.lora_rank, lora_experts=opts.lora_experts, attn=opts.attn_implementation,
                     packed_backend=opts.packed_backend, micro=opts.micro,
                     micro_presets=[p for p in opts.micro_presets if p not in ("none", "")],
                     micro_reps=opts.micro_reps, variants=opts.variants, dtype=getattr(torch, opts.dtype))
        return _bench(plan)


def _bench(plan: _Plan) -> list[dict]:
    preset, device, dtype, quant = plan.preset, plan.device, plan.dtype, plan.quant
    t0 = time.time()
    experts = preset.family_record.experts   # LoRA on the expert parameters where the family's record offers it
    lora = LoraSettings(rank=plan.lora_rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        lora_experts=plan.lora_experts and experts is not None and bool(experts.lora_parameters))
    model = build_model(preset, device=device, dtype=dtype, quant=quant, lora=lora,
                        num_layers=plan.num_layers if plan.modes else 1,   # the microbenchmark alone: one layer
                        attn_implementation=plan.attn)
    info = model.fastsft_info
    if quant == "nf4":
        quantize_experts_nf4(model, compute_dtype=dtype)
    attention = info.attn_implementation
    inputs_fn = None
    if plan.packed_backend:
        from ...packing import attn_implementation_name, packed_inputs

        apply(model, packed_attention=plan.packed_backend)
        attention = f"packed:{plan.packed_backend} ({attn_implementation_name(plan.packed_backend)})"
        inputs_fn = lambda batch, state=None: packed_inputs(batch)  # noqa: E731 - metadata built once
    build_s = time.time() - t0
    if plan.progress:
        print(f"  built {preset.name} ({info.num_layers} layers, quant={quant}, attention={attention}) in "
              f"{build_s:.0f}s")

    variants = routing_variants(preset.family, inputs=inputs_fn)
    if plan.variants:
        variants = [v for v in variants if v.name in set(plan.variants)]
    elif quant == "nf4":
        # Stock eager reads self.gate_up_proj per expert: on NF4 that dequantizes the whole layer per expert and
        # autograd keeps every copy (out of memory in training); it is not a fair peer there.
        variants = [v for v in variants if v.name != "transformers eager"]
    results: list[dict] = []
    base_config = {
        "model": preset.name, "family": preset.family, "num_layers": info.num_layers,
        "num_layers_full": preset.config["num_hidden_layers"], "dtype": str(dtype).replace("torch.", ""),
        "quant": quant or "none", "expert_weights": "nf4" if quant == "nf4" else str(dtype).replace("torch.", ""),
        "lora_rank": plan.lora_rank, "lora_targets": list(lora.target_modules), "lora_experts": lora.lora_experts,
        "attn_implementation": attention, "row_tokens": plan.row_tokens, "steps": plan.steps, "warmup": plan.warmup,
        "num_experts": preset.config.get("num_local_experts", preset.config.get("num_experts")),
        "top_k": preset.config.get("num_experts_per_tok"), "build_seconds": round(build_s, 1),
        "params_total": info.params_total, "params_trainable": info.params_trainable,
        "sync_free_gate": "fused triton" if (preset.family_record.experts.gate == "gpt_oss_glu" and plan.gpu and
                                             fused_glu_available(torch.empty(0, device=device))) else "eager",
    }
    if quant == "nf4":
        base_config.update(nf4_expert_bytes(model))
    for tokens in plan.tokens:
        rt = min(plan.row_tokens, tokens)
        batches = benchmark_batches(tokens_per_step=tokens, row_tokens=rt, steps=max(2, min(plan.steps, 4)),
                                    vocab_size=model.config.vocab_size, mix="short" if plan.smoke else "realistic")
        batches = [b.to(device) for b in batches]
        stats = routing_stats(model, inputs_fn(batches[0]) if inputs_fn else batches[0].model_inputs())
        for mode in plan.modes:
            label = f"{preset.name} {tokens} tok {mode}"
            rows = run_variants(model, batches, variants, steps=plan.steps, warmup=plan.warmup, mode=mode,
                                progress=plan.progress, label=label)
            config = dict(base_config, tokens_per_step=tokens, row_tokens=rt, mode=mode, routing=stats)
            notes = ("Whole-model steps; the variants differ only in the experts forward. 'naive' and "
                     "'transformers eager' run the same loop. Routing from random router weights (see "
                     "config.routing). GPT-OSS MoE layers are a part of each step: see the experts microbenchmark "
                     "JSON for the per-layer view.")
            result = make_result("moe-routing", config, rows, device, notes=notes)
            stem = _slug(f"moe_{preset.name}_L{info.num_layers}_{tokens}tok_{mode}" + ("_nf4" if quant else ""))
            write_json(result, os.path.join(plan.out_dir, stem + ".json"))
            fig = plot_result(result, phases=("forward",) if mode == "forward" else ("forward", "backward", "step"))
            if fig is not None:
                save_figure(fig, os.path.join(plan.out_dir, stem + ".png"))
            print(f"\n  {label}\n" + format_table(result))
            results.append(result)
        if plan.micro:
            results.append(_micro_result(model, preset.name, tokens, plan, num_layers=info.num_layers))
    del model
    if plan.gpu:
        torch.cuda.empty_cache()
    if plan.micro:
        for name in plan.micro_presets:
            mp = get_preset(name)
            m = build_model(mp, device=device, dtype=dtype, num_layers=1)
            if quant == "nf4":
                quantize_experts_nf4(m, compute_dtype=dtype)
            for tokens in plan.tokens:
                results.append(_micro_result(m, mp.name, tokens, plan, num_layers=1))
            del m
            if plan.gpu:
                torch.cuda.empty_cache()
    return results


def _micro_result(model: nn.Module, preset_name: str, tokens: int, plan: _Plan, *, num_layers: int) -> dict:
    device, dtype, quant, warmup, reps = plan.device, plan.dtype, plan.quant, plan.warmup, plan.micro_reps
    rows = experts_microbenchmark(model, tokens=tokens, warmup=warmup, reps=reps)
    experts = experts_modules(model)[0]
    config = {"model": preset_name, "tokens_per_step": tokens, "mode": "one layer's experts (step = fwd+bwd)",
              "layer": 0, "num_experts": experts.num_experts,
              "top_k": model.config.num_experts_per_tok, "hidden_size": _hidden_size(experts),
              "dtype": str(dtype).replace("torch.", ""), "expert_weights": "nf4" if quant == "nf4" else
              str(dtype).replace("torch.", ""), "reps": reps, "warmup": warmup, "model_num_layers": num_layers,
              "phases": {"forward_ms": "experts forward, no grad", "step_ms": "experts forward + backward "
                         "(input and routing-weight grads; expert weights frozen)"}}
    result = make_result("moe-experts-layer", config, rows, device,
                         notes="One MoE layer's experts alone, same input and routing for every implementation; "
                               "the router runs outside the timing.")
    stem = _slug(f"moe_experts_{preset_name}_{tokens}tok" + ("_nf4" if quant else ""))
    write_json(result, os.path.join(plan.out_dir, stem + ".json"))
    fig = plot_result(result, phases=("forward", "step"), limit="expert matmuls alone",
                      title=f"one MoE layer's experts: {preset_name}, {tokens} tokens (step = forward + backward)")
    if fig is not None:
        save_figure(fig, os.path.join(plan.out_dir, stem + ".png"))
    print(f"\n  experts alone: {preset_name} {tokens} tok\n" + format_table(result))
    return result


__all__ = ["MoeScenario", "MoeOptions", "routing_stats", "experts_microbenchmark", "MICRO_IMPLEMENTATIONS",
           "routing_variants"]
