"""Scenario ``budget``: the memory plan's frontier -- step time and peak memory from the smallest plan (every layer
offloaded) to keeping every activation, against the README recipe (offload x2 + prefetch everywhere) and no
checkpointing, on the same batches.

The plan's costs are measured once per token count (``apply(memory_budget=...)``'s own step 1 and 2: each kind of
layer under each choice, and the peak of a step with every layer offloaded); each budget's plan is then solved from
those costs (:func:`fastsft_lab.offload.solver.solve`, what ``apply`` solves) and run as a fixed plan, interleaved with
the references. Every row has the plan's *predicted* peak beside the measured one (CUDA), so the cost model is
checked where it is used, and its MFU: the model FLOPs of the step as the model trains them (a frozen base's forward
and input gradients, the adapters', attention over the real segments, the LM head; ``config.model_flops_per_step``)
over the card's dense bf16 peak.

GPU default: Qwen3-14B, all 40 layers, NF4 + LoRA r16, the README recipe's floor (cached varlen, fused loss, fused
LoRA, autocast bf16), 8192 and 16384 tokens, 5 budgets. Smoke (CPU): tiny-qwen3, seconds; a CPU has no peak
counter, so its rows show the plans and times but no measured memory.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import torch

from ... import toggles
from ...data import benchmark_batches
from ...models import PRESETS, LoraSettings, build_model
from ...offload import plan as P
from ...offload.pool import host_memory_available
from ...offload.solver import predictor
from ...packing import packed_inputs
from ..harness import (Variant, add_throughput, format_derived, format_table, make_result, run_variants,
                       with_autocast, write_json)
from ..scenario import OptionError, Scenario, option


@dataclasses.dataclass
class BudgetOptions:
    preset: str = option("qwen3-14b", kind="str", help="model preset")
    num_layers: int | None = option(None, kind="int?", help="decoder layers (none: all)")
    quant: str | None = option("nf4", kind="str?", help="nf4 (QLoRA) or none")
    lora_rank: int = option(16, kind="int", help="LoRA rank")
    packed: str = option("varlen", kind="str", help="packed-attention backend of the floor")
    autocast: str = option("bf16", kind="str", help="autocast of every step: none, bf16 or fp16")
    dtype: str = option("bfloat16", kind="str", help="parameter dtype")
    tokens: list = option([8192, 16384], kind="ints", help="tokens per step (one frontier each)")
    row_tokens: int = option(8192, kind="int", help="tokens per packed row")
    points: int = option(5, kind="int", help="budgets per frontier, from the smallest plan to keeping everything "
                                             "(or the model plus 90% of the free GPU memory)")
    budgets: list = option([], kind="strs", help="budgets in GiB instead of the even spread (e.g. 40,60,80); the "
                           "spread includes the preset's target budget (TARGETS_GIB) where it falls inside")
    fused_dequant: bool = option(False, kind="bool", help="the floor also dequantises NF4 in one kernel "
                                 "(fastsft_lab.dequant; quant=nf4 only)")
    kernels: str = option("none", kind="str", help="none, or liger: the fast-kernel floor (Liger's RMSNorm, SwiGLU "
                          "and RoPE; CUDA)")
    batches: int = option(2, kind="int", help="distinct batches per token count, cycled (the Unsloth peer's "
                          "UNSLOTH_PEER_STEPS exports the same ones)")
    search: int = option(0, kind="int", help="also time, per budget, the plans the cost model ranks next to the "
                         "solver's in an exhaustive search over every layer's choices (at most 8 layers): the "
                         "solver's plan against the fastest measured")
    steps: int = option(5, kind="int", help="measured steps per variant")
    warmup: int = option(2, kind="int", help="warm-up steps per variant")

    @classmethod
    def defaults(cls, device: torch.device, smoke: bool) -> "BudgetOptions":
        if smoke:
            return cls(preset="tiny-qwen3", num_layers=4, quant=None, lora_rank=8, packed="sdpa",
                       autocast="none", dtype="float32" if device.type == "cpu" else "bfloat16", tokens=[512],
                       row_tokens=256, points=4, steps=3, warmup=1)
        return cls()


TARGETS_GIB = {"qwen3-14b": 80, "gpt-oss-20b": 64}
"""The issue's target budgets (an 80 GB card for Qwen3-14B x40; 64 GiB for GPT-OSS-20B x24): added to the even
spread wherever they fall inside it."""

SEARCH_LAYERS = 8
"""The most layers ``search`` enumerates (5 choices each: 390,625 plans)."""

USABLE = 0.9
"""The share of a GPU's free memory, beyond what the model holds, the frontier goes up to (what
``apply(memory_budget="90%")`` gives)."""


def _gib(b: float) -> float:
    return b / P.GiB


def size(b: float) -> str:
    """Bytes in human units: ``"12.5 GiB"``, ``"340 MiB"``."""
    return f"{b / P.GiB:.2f} GiB" if b >= P.GiB else f"{b / 2**20:.0f} MiB"


def budgets_between(lo: int, hi: int, points: int) -> list[int]:
    """``points`` budgets from ``lo`` to ``hi`` bytes, evenly spread (one when they meet)."""
    if points < 2 or hi <= lo:
        return [lo]
    return [lo + (hi - lo) * i // (points - 1) for i in range(points)]


def calibrate(model, batch, autocast: str, budget_gib: float | None = None) -> P.MemoryPlanner:
    """apply(memory_budget=...)'s own measurement on ``batch``: step 1 measures, step 2 solves (no optimizer step).
    Returns the planner (its costs, and the plan for ``budget_gib``, default the model plus :data:`USABLE` of the
    GPU's free memory -- the allocator's fragmentation and the CUDA context need the rest -- or the host's memory on
    a CPU); the plan stays on the model until ``apply(model, memory_budget="off")``."""
    device = batch.input_ids.device
    total, free = P.device_memory(device)
    default = f"{USABLE:.0%}" if free is not None else (_gib(total) if total else 1024)
    toggles.apply(model, memory_budget=budget_gib if budget_gib is not None else default)
    (variant,) = with_autocast([Variant("calibration")], autocast)
    for _ in range(2):
        with variant.context(model) if variant.context else torch.enable_grad():
            model(**_inputs(batch, None)).loss.backward()
        model.zero_grad(set_to_none=True)
    planner = P.memory_planner(model)
    assert planner is not None and planner.plan is not None
    return planner


def _inputs(batch, _prepared) -> dict:
    """The batch with its metadata from the host lengths, as ``PackedCollator`` gives it: no host sync in the step."""
    return packed_inputs(batch)


def ranked(costs, budget: int, base: int, *, staging: int = 0, saved_extra: int = 0, choices=P.CHOICES,
           limit: int = 4, max_plans: int = 5**SEARCH_LAYERS, loss_base: int | None = None,
           forward_base: int | None = None) -> list[P.Plan]:
    """Exhaustive search: the ``limit`` plans with the least predicted time (:func:`fastsft_lab.offload.solver.predict`)
    among every per-layer choice that fits ``budget``, plans equal in predicted peak and time counted once (layers of
    one kind in another order). What the solver is checked against, on paper (tests) and measured (``search``); it
    enumerates ``len(choices) ** len(costs)`` plans, so it refuses more than ``max_plans``."""
    choices = [c for c in choices if all(c in cost.held and c in cost.seconds for cost in costs)]
    if len(choices) ** len(costs) > max_plans:
        raise ValueError(f"exhaustive search over {len(choices)} choices for {len(costs)} layers is "
                         f"{len(choices) ** len(costs)} plans, more than {max_plans}: use fewer layers")
    found: dict[tuple[int, float], tuple[str, ...]] = {}
    predict = predictor(costs, base, staging=staging, saved_extra=saved_extra, loss_base=loss_base,
                        forward_base=forward_base)
    for cs in itertools.product(choices, repeat=len(costs)):
        peak, seconds = predict(cs)
        if peak <= budget:
            found.setdefault((peak, round(seconds, 12)), cs)
    best = sorted(found.items(), key=lambda kv: (kv[0][1], kv[0][0]))[:limit]
    tokens = costs[0].tokens if costs else 0
    return [P.Plan(cs, budget, peak, seconds, tokens) for (peak, seconds), cs in best]


def _plan_variant(plan: P.Plan, costs: dict, rank: int | None = None) -> Variant:
    """``plan`` as a fixed plan on the measured ``costs``: the solver's for its budget, or (``rank``) the exhaustive
    search's ``rank``-th next-fastest plan for it."""
    def enable(model):
        toggles.apply(model, memory_budget=_gib(plan.budget))
        P.memory_planner(model).costs.update(costs)       # the measured costs: no measurement inside a timed step
        P.set_plan(model, plan.choices)

    def disable(model):
        toggles.apply(model, memory_budget="off")

    counts = ", ".join(f"{n} {c}" for c, n in plan.counts().items())
    predicted = {"plan": list(plan.choices), "predicted_peak_bytes": plan.peak, "predicted_layer_seconds": plan.seconds}
    if rank is None:
        return Variant(f"{size(plan.budget)}: {counts}", enable=enable, disable=disable, inputs=_inputs,
                       toggles={"memory_budget_bytes": plan.budget, **predicted},
                       note="the plan apply(memory_budget=...) solves for this budget, run as a fixed plan")
    return Variant(f"{size(plan.budget)} search #{rank}: {counts}", enable=enable, disable=disable, inputs=_inputs,
                   toggles={"search_budget_bytes": plan.budget, "search_rank": rank, **predicted},
                   note="the exhaustive search's next-fastest plan for this budget (by the cost model), against "
                        "the solver's")


def _offload_saved_everywhere(layers: int) -> Variant:
    def enable(model):
        total, _ = P.device_memory(next(model.parameters()).device)
        toggles.apply(model, memory_budget=0.99 * total / P.GiB if total else 1024)   # a fixed plan: any budget
        P.set_plan(model, ("offload_saved",) * layers)

    return Variant("offload_saved everywhere", enable=enable, disable=lambda m: toggles.apply(m, memory_budget="off"),
                   inputs=_inputs, toggles={"plan": ["offload_saved"] * layers},
                   note="every layer's saved activations in pinned host memory, double-buffered (a fixed plan): "
                        "no recompute; against TRL's activation offloading (the same idea) and no checkpointing "
                        "(its limit)")


def _references(device: torch.device, layers: int, activation_bytes: int) -> list[Variant]:
    """The references every frontier is timed against; on a GPU whose host can pin every layer's activations twice
    over (both peers' pinned blocks stay cached between interleaved steps), also the two that keep every activation
    in host memory: ``offload_saved`` everywhere and TRL's activation offloading."""
    peers = []
    host = host_memory_available()
    fits = host is not None and 2 * activation_bytes <= 0.8 * host
    if device.type == "cuda" and not fits:
        print(f"  offload_saved everywhere and TRL activation offloading left out: twice every layer's activations "
              f"in pinned blocks ({2 * activation_bytes / P.GiB:.1f} GiB) is more than 80% of the host memory "
              f"available "
              f"({(host or 0) / P.GiB:.1f} GiB)")
    if device.type == "cuda" and fits:   # TRL's offloading and pinned host copies need an accelerator
        from .combined import trl_offloading_variant

        peers = [_offload_saved_everywhere(layers),
                 trl_offloading_variant("TRL activation offloading", "TRL 1.16's get_act_offloading_ctx_manager "
                                        "around the step (SFTConfig(activation_offloading=True)): saved activations "
                                        "to pinned host memory on a side stream, no checkpointing; built once, "
                                        "entered every step", _inputs,
                                        toggles={"checkpointing": "none", "trl_offload": True})]
    return peers + [Variant("offload x2 + prefetch everywhere (README recipe)",
                    enable=lambda m: toggles.apply(m, offload_buffers=2, prefetch=True),
                    disable=lambda m: toggles.apply(m, offload_buffers="off"), inputs=_inputs,
                    toggles={"offload_buffers": 2, "prefetch": True}),
            Variant("no checkpointing", toggles={"checkpointing": "none"}, inputs=_inputs,
                    note="every activation kept: the fastest step, where it fits")]


def derived(rows: list[dict]) -> dict:
    """Each plan's step against the README recipe's, its measured peak against its predicted one (CUDA), and, where
    the search ran, the solver's step against the fastest measured plan for its budget (``solver_vs_searched``:
    1.0 when the solver's was the fastest; above it by how much a searched plan was faster)."""
    recipe = next((r for r in rows if r["name"].startswith("offload x2") and "step_ms" in r), None)
    out: dict = {}
    for r in rows:
        if "memory_budget_bytes" not in r.get("toggles", {}) or "step_ms" not in r:
            continue
        budget = r["toggles"]["memory_budget_bytes"]
        key = size(budget).replace(" ", "")
        ms = r["step_ms"]["median"]
        if recipe is not None:
            out[f"speedup_vs_recipe_{key}"] = recipe["step_ms"]["median"] / ms
        if r.get("peak_mem_bytes"):
            out[f"peak_over_predicted_{key}"] = r["peak_mem_bytes"] / r["toggles"]["predicted_peak_bytes"]
        searched = [x["step_ms"]["median"] for x in rows
                    if x.get("toggles", {}).get("search_budget_bytes") == budget and "step_ms" in x]
        if searched:
            out[f"solver_vs_searched_{key}"] = ms / min([ms, *searched])
    return out


class BudgetScenario(Scenario):
    name = "budget"
    title = "the memory plan's frontier: step time and peak memory per budget, against the recipe and no checkpointing"
    Options = BudgetOptions

    def validate(self, opts, device: torch.device) -> None:
        super().validate(opts, device)
        if opts.points < 1:
            raise OptionError(f"points must be >= 1, got {opts.points}")
        for b in opts.budgets:
            try:
                if float(b) <= 0:
                    raise ValueError
            except ValueError:
                raise OptionError(f"budgets: {b!r} is not a positive number of GiB") from None
        if any(t < 16 for t in opts.tokens):
            raise OptionError(f"tokens must be >= 16 each, got {opts.tokens}")
        if opts.fused_dequant and opts.quant != "nf4":
            raise OptionError(f"fused_dequant needs quant=nf4 (QLoRA), got quant={opts.quant}")
        if opts.kernels not in ("none", "liger"):
            raise OptionError(f"kernels must be none or liger, got {opts.kernels!r}")
        if opts.kernels == "liger" and device.type != "cuda":
            raise OptionError("kernels=liger needs a CUDA GPU (Liger-Kernel is Triton)")
        if opts.batches < 1 or opts.search < 0:
            raise OptionError(f"batches must be >= 1 and search >= 0, got batches={opts.batches}, "
                              f"search={opts.search}")
        layers = opts.num_layers or (PRESETS[opts.preset].config.get("num_hidden_layers", 0)
                                     if opts.preset in PRESETS else 0)
        if opts.search and layers > SEARCH_LAYERS:
            raise OptionError(f"search enumerates every layer's choices: at most {SEARCH_LAYERS} layers, got "
                              f"{layers} (set num_layers)")

    def run(self, opts, *, device: torch.device, out_dir: str, progress: bool = True) -> list[dict]:
        dtype = getattr(torch, opts.dtype)
        model = build_model(opts.preset, device=device, dtype=dtype, quant=opts.quant,
                            lora=LoraSettings(rank=opts.lora_rank) if opts.lora_rank else None,
                            num_layers=opts.num_layers)
        floor = {"packed_attention": opts.packed, "fused_loss": True}
        if opts.lora_rank:
            floor["fused_lora"] = device.type == "cuda"     # the fused LoRA GEMM is a CUDA kernel's floor
        if PRESETS[opts.preset].is_moe:
            floor["moe_routing"] = "sync_free"              # an MoE model's floor routes its experts sync-free
        if opts.fused_dequant:
            floor["fused_dequant"] = True
        extra = {}
        if opts.kernels == "liger":
            from .combined import apply_liger
            extra = apply_liger(model, PRESETS[opts.preset].family)
        toggles.apply(model, **floor)
        results = []
        for tokens in opts.tokens:
            batches = [b.to(device) for b in benchmark_batches(tokens_per_step=tokens, row_tokens=opts.row_tokens,
                                                               steps=opts.batches,
                                                               vocab_size=model.config.vocab_size)]
            planner = calibrate(model, batches[0], opts.autocast)
            costs = dict(planner.costs)
            full = [planner.costs[k].at(tokens) for k in planner.kinds]
            problem = planner.problem(tokens)
            base, keep_all = (planner.predict(tokens, [c] * len(full))[0] for c in ("offload", "keep"))
            top = min(keep_all, P.budget_bytes(f"{USABLE:.0%}", device)) if device.type == "cuda" else keep_all
            toggles.apply(model, memory_budget="off")
            budgets = ([int(float(b) * P.GiB) for b in opts.budgets] if opts.budgets
                       else budgets_between(base, top, opts.points))
            target = TARGETS_GIB.get(opts.preset)
            if not opts.budgets and target is not None and base <= target * P.GiB <= top:
                budgets = sorted({*budgets, target * P.GiB})
            plans, seen, searched = [], set(), []
            for b in budgets:
                try:
                    plan = planner.solve(tokens, budget=b)         # what apply(memory_budget=b) would solve
                except P.BudgetError as e:
                    print(f"  {tokens} tokens: {e}")
                    continue
                if plan.choices not in seen:
                    seen.add(plan.choices)
                    plans.append(plan)
                    if opts.search:
                        found = ranked(budget=b, limit=opts.search + 1, **problem)
                        others = [p for p in found if (p.peak, round(p.seconds, 12))
                                  != (plan.peak, round(plan.seconds, 12))][:opts.search]
                        searched += [_plan_variant(p, costs, i + 1) for i, p in enumerate(others)]
            variants = with_autocast([*(_plan_variant(p, costs) for p in plans), *searched,
                                      *_references(device, len(planner.kinds), sum(c.pinned for c in full))],
                                     opts.autocast)
            rows = run_variants(model, batches, variants, steps=opts.steps, warmup=opts.warmup,
                                progress=progress, label=f"budget {tokens}")
            # MFU as the model trains: a frozen base's weight gradients are not FLOPs of this step, its adapters' are
            flops = add_throughput(rows, model, batches, model_flops=True)
            config = {"model": opts.preset, "num_layers": opts.num_layers or model.config.num_hidden_layers,
                      "quant": opts.quant, "lora_rank": opts.lora_rank, "floor": floor, "autocast": opts.autocast,
                      "kernels": opts.kernels, **extra, "batches": opts.batches, "search": opts.search,
                      "tokens_per_step": tokens, "row_tokens": opts.row_tokens, "steps": opts.steps,
                      "warmup": opts.warmup, "model_flops_per_step": flops,
                      "flops_counted": "model FLOPs of a step (mfu, flops_per_step): the frozen base's forward and "
                                       "input gradients, the adapters' forward and gradients, causal attention over "
                                       "the real segments, the LM head; no recompute",
                      "predicted_smallest_peak_bytes": base,
                      "predicted_keep_all_peak_bytes": keep_all,
                      "smallest_peak_by_phase_bytes": {"forward": problem["forward_base"],
                                                        "loss": problem["loss_base"], "backward": problem["base"]},
                      "layer_costs": {k: {"tokens": c.tokens, "seconds": c.seconds, "held_bytes": c.held,
                                          "forward_most_bytes": c.forward, "keep_readings_bytes": c.readings}
                                      for k, c in costs.items()}}
            result = make_result("budget", config, rows, device,
                                 "plans solved from costs measured on this model and batch; predicted peaks beside "
                                 "the measured ones (CUDA max_memory_allocated)")
            result["derived"] = derived(rows)
            write_json(result, os.path.join(out_dir, f"budget-{opts.preset}-{tokens}.json"))
            print(format_table(result))
            if result["derived"]:
                print("  " + format_derived(result["derived"]))
            results.append(result)
        toggles.revert(model)
        return results


__all__ = ["BudgetScenario", "BudgetOptions", "budgets_between", "calibrate", "derived", "ranked", "size"]
