"""Scenario ``attribution``: where each gain comes from -- one cumulative chain from transformers' default to
everything on, each step one change, interleaved step by step on the same batches, so every bar is what that change
is worth here and nothing else.

The chain (MoE steps on MoE models only; the fused-loss step where the kernel floor does not include it already)::

    stock transformers                   transformers' default: its attention (Qwen3 sdpa; GPT-OSS eager, where
                                         packed sequences see each other), grouped_mm experts, its checkpointing
    + packed kernel, metadata per layer  the packed backend (varlen / flex / sdpa): the kernel, and exact packing
                                         where stock leaks; its metadata rebuilt in every layer (the "before" of fix 1)
    + metadata cached                    fix 1: built once per batch
    + sync-free routing, eager glue      fix 3: tokens grouped on the device feeding one grouped matmul, its Triton
                                         kernels off (gate, combine and token-gather backward as eager ops)
    + fused gate/combine kernels         fix 3's glue fused (CUDA: one Triton kernel each way for the gate, the combine)
    + offload, one buffer                fix 2's "before": checkpointing with the input in pinned host memory
    + double buffer                      fix 2: two staging buffers + prefetch
    + fused loss                         the fast-kernel floor's loss (no logits held)
    + memory plan (B GiB)                the checkpointing plan for a budget (``apply(memory_budget=B)``)

Every step starts from what a user runs: fix 3 from transformers' own default experts (``grouped_mm``, no host sync
either, so what it can remove is kernels, not syncs); "grouped once" (one sync per layer) is no step of the chain: it
is slower than that default (a loop of launches per expert; notebook 03 counts them). Fix 2 starts from offload with
one buffer (the before the published +6.7% is against); the step from standard checkpointing to one-buffer offload
is what offloading itself costs. :data:`STEP_REMOVES` says what each step removes and why (the mechanism); the
measure of it is one profiled warm step per step, after its timed steps (same batches, same autocast:
:func:`..harness.profile_variant`, in each row's ``profile``): the step's time by what bounds each kernel --
compute, memory, latency (:mod:`fastsft_lab.roofline`: its op's FLOPs and bytes against the card's peaks, not the
module that launched it) -- and idle; :func:`..removes.removed` compares a step's profile with the one before it
and names what fell (``removed`` in each row; :func:`..removes.measured_lines` prints it). The plan's costs are measured once
before the timed steps (what ``apply(memory_budget=...)`` does on its first two steps) and run as a fixed plan. For MoE
models the result also carries ``routing``: per MoE step, the routing decisions it flips against the reference in bf16
and its loss and gradients with the reference's routing forced (:func:`..routing.routing_agreement`). GPU default:
Qwen3-14B x40 and GPT-OSS-20B x24, 8192 tokens, both kernel floors, autocast bf16, budget 80 GiB (an H100's card).
Smoke: the tiny models on a CPU.
"""

from __future__ import annotations

import dataclasses
import warnings

import torch

from ... import toggles
from ...data import benchmark_batches
from ...model_state import state
from ...moe import set_fused_glu
from ...moe.kernels import set_fused_combine
from ...offload import plan as P
from ...packing import packed_inputs
from ..harness import Variant, make_result, run_variants, with_autocast
from ..removes import chain_removed, measured_lines
from ..scenario import OptionError, Scenario, option
from .budget import calibrate
from .packed import stock_leak
from .combined import ModelOptions, _configure, model_builds, validate_models_and_kernels, write_waterfall_result


@dataclasses.dataclass
class AttributionOptions(ModelOptions):
    budget: float | None = option(80.0, kind="float?", help="GiB for the memory-plan step (none: no such step)")
    profile: bool = option(True, kind="bool", help="one profiled warm step per chain step after its timed ones "
                           "(what each step removes, by what bounds its kernels; a few seconds per step)")

    @classmethod
    def defaults(cls, device: torch.device, smoke: bool) -> "AttributionOptions":
        base = dataclasses.asdict(ModelOptions.defaults(device, smoke))
        if smoke:
            return cls(**{**base, "steps": 3, "budget": 16.0})
        return cls(**{**base, "autocast": "bf16", "steps": 5})


# The MoE steps of fix 3, over transformers' default experts (grouped_mm)
SYNC_FREE_EAGER = "+ sync-free routing, eager glue"
FUSED_GLUE = "+ fused gate/combine kernels"

# What each step removes, by step name (a name's variable part -- the packed backend, the budget -- by its prefix)
STEP_REMOVES = {
    "stock transformers": "the baseline: transformers' default (attention, grouped_mm experts, checkpointing)",
    "+ {packed} kernel, metadata per layer": "compute: the stock T×T attention over whole packed rows (exact packing "
                                             "where stock leaks); adds fix 1's per-layer syncs",
    "+ metadata cached": "host overhead: the per-layer metadata syncs (fix 1)",
    SYNC_FREE_EAGER: "host overhead: grouped_mm's extra glue kernels (masking, bias gathers); neither path syncs",
    FUSED_GLUE: "memory traffic and launches: the eager gate and combine as one Triton kernel each way (CUDA)",
    "+ sync-free experts": "host overhead and memory traffic: grouped_mm's glue kernels, the gate and combine fused "
                           "(the two MoE steps at once, older runs)",
    "+ offload, one buffer": "memory: layer inputs in host memory (costs copies that wait for compute)",
    "+ double buffer": "host-link waits: reloads run under the backward (fix 2)",
    "+ fused loss": "memory traffic: the logits are never held",
    "+ memory plan ({budget} GiB)": "compute: recompute, where the budget lets a layer keep its activations",
}


def step_removes(name: str) -> str:
    """What the chain step ``name`` removes (:data:`STEP_REMOVES`); "" for a name it does not know."""
    for key, text in STEP_REMOVES.items():
        head, _, tail = key.partition("{")
        tail = tail.partition("}")[2]
        if name == key or ("{" in key and name.startswith(head) and name.endswith(tail)):
            return text
    return ""


def attribution_chain(model, *, is_moe: bool, packed: str, fused_floor: bool, plan: P.Plan | None = None,
                      costs: dict | None = None, budget: float | None = None) -> list[Variant]:
    """The cumulative chain of the module docstring, each step's switches set through :func:`fastsft_lab.apply`.
    ``fused_floor``: the kernel floor has the fused loss already (no step for it); ``plan``/``costs``: the memory
    plan solved for ``budget`` GiB, run as a fixed plan (no step without them)."""
    stock_inputs = lambda b, s: b.model_inputs()      # noqa: E731
    meta_inputs = lambda b, s: packed_inputs(b)        # noqa: E731
    stock_moe = "stock" if is_moe else None
    steps: list[tuple[str, dict, object]] = [
        ("stock transformers", {"moe": stock_moe}, stock_inputs),
        (f"+ {packed} kernel, metadata per layer", {"packed": packed, "cache": False, "moe": stock_moe},
         stock_inputs),
        ("+ metadata cached", {"packed": packed, "moe": stock_moe}, meta_inputs)]
    cfg = dict(steps[-1][1])
    if is_moe:
        cfg.update(moe="sync_free", glue="eager")
        steps.append((SYNC_FREE_EAGER, dict(cfg), meta_inputs))
        cfg["glue"] = "fused"
        steps.append((FUSED_GLUE, dict(cfg), meta_inputs))
    cfg["offload"] = 1
    steps.append(("+ offload, one buffer", dict(cfg), meta_inputs))
    cfg["offload"] = 2
    steps.append(("+ double buffer", dict(cfg), meta_inputs))
    fused = None if fused_floor else False
    out = []
    for name, c, inputs in steps:
        out.append(_step(name, {**c, "fused": fused}, inputs))
    if not fused_floor:
        out.append(_step("+ fused loss", {**cfg, "fused": True}, meta_inputs))
        cfg["fused"] = True
    else:
        cfg["fused"] = None
    if plan is not None and costs is not None and budget is not None:
        out.append(_plan_step(f"+ memory plan ({budget:g} GiB)", cfg, plan, costs, budget, meta_inputs))
    return out


def _glue(fused: bool) -> tuple[bool, bool]:
    """sync_free's fused Triton kernels (gate; combine and token-gather backward) on or off; returns the old
    settings (where they do not run -- a CPU -- the eager ops run either way)."""
    return set_fused_glu(fused), set_fused_combine(fused)


def _set(m, cfg: dict) -> None:
    c = dict(cfg)
    fused = c.pop("fused", None)
    c.pop("glue", None)
    _configure(m, **c)
    if fused is not None:
        toggles.apply(m, fused_loss=fused)


def _step(name: str, cfg: dict, inputs) -> Variant:
    toggles_ = {k: v for k, v in cfg.items() if v is not None}
    saved: list = []

    def enable(m):
        if cfg.get("glue") is not None:
            saved.append(_glue(cfg["glue"] == "fused"))
        _set(m, cfg)

    def disable(m):
        _set(m, _OFF)
        while saved:
            glu, combine = saved.pop()
            set_fused_glu(glu)
            set_fused_combine(combine)

    removes = step_removes(name)
    return Variant(name, toggles_, enable=enable, disable=disable, inputs=inputs,
                   note="one step of the attribution chain: everything of the step before, plus this change"
                        + (f"; removes {removes}" if removes else ""))


_OFF = {"moe": None, "fused": None}


def _plan_step(name: str, cfg: dict, plan: P.Plan, costs: dict, budget: float, inputs) -> Variant:
    def enable(m):
        _set(m, {**cfg, "offload": 0})
        toggles.apply(m, memory_budget=budget)
        P.memory_planner(m).costs.update(costs)
        P.set_plan(m, plan.choices)

    def disable(m):
        toggles.apply(m, memory_budget="off")
        _set(m, _OFF)

    return Variant(name, {**{k: v for k, v in cfg.items() if v is not None and k != "offload"},
                          "memory_budget_gib": budget, "plan": plan.describe()},
                   enable=enable, disable=disable, inputs=inputs,
                   note="the plan apply(memory_budget=...) solves for this budget, measured on this model and batch; "
                        f"removes {step_removes(name)}")


class AttributionScenario(Scenario):
    name = "attribution"
    title = "where each gain comes from: one cumulative chain from stock transformers, one change per step"
    Options = AttributionOptions

    def validate(self, opts, device: torch.device) -> None:
        super().validate(opts, device)
        validate_models_and_kernels(opts, device)
        if opts.budget is not None and opts.budget <= 0:
            raise OptionError(f"budget must be a positive number of GiB or none, got {opts.budget}")
        total, _ = P.device_memory(device)
        if opts.budget is not None and total is not None and opts.budget * P.GiB > total:
            raise OptionError(f"budget {opts.budget:g} GiB is above this device's {total / P.GiB:.0f} GiB: give less, "
                              "or none for no memory-plan step")

    def run(self, opts, *, device: torch.device, out_dir: str, progress: bool = True) -> list[dict]:
        results = []
        for preset, model, extra in model_builds(opts, device):
            for tokens in opts.tokens:
                results.append(self._config(model, preset, opts, tokens, extra, device, out_dir, progress))
        return results

    def _config(self, model, preset, opts, tokens, extra, device, out_dir, progress) -> dict:
        is_moe = preset.is_moe
        row = min(opts.moe_row_tokens, tokens) if is_moe else tokens
        batches = [b.to(device) for b in benchmark_batches(tokens_per_step=tokens, row_tokens=row,
                                                           steps=max(2, opts.steps), vocab_size=model.config.vocab_size,
                                                           mix=opts.mix)]
        fused_floor = state(model).fused_loss
        plan = costs = None
        if opts.budget is not None:
            # the plan's costs measured with everything else of the chain on, as apply would on its first steps
            _set(model, {"packed": opts.backend, "moe": "sync_free" if is_moe else None, "fused": True})
            with warnings.catch_warnings():     # the model's own checkpointing is replaced on purpose here
                warnings.filterwarnings("ignore", message="memory_budget replaces")
                planner = calibrate(model, batches[0], opts.autocast, opts.budget)
            plan, costs = planner.plan, dict(planner.costs)
            toggles.apply(model, memory_budget="off")
            _set(model, {**_OFF, "fused": None if fused_floor else False})
        chain = attribution_chain(model, is_moe=is_moe, packed=opts.backend, fused_floor=fused_floor, plan=plan,
                                  costs=costs, budget=opts.budget)
        chain[0] = dataclasses.replace(chain[0], unequal=stock_leak(model))   # GPT-OSS's stock masks leak
        label = f"{preset.name} {tokens} tok, kernels={extra['kernels']}"
        rows = run_variants(model, batches, with_autocast(chain, opts.autocast), steps=opts.steps,
                            warmup=opts.warmup, progress=progress, label=label,
                            check_equal=f"+ {opts.backend} kernel, metadata per layer", profile=opts.profile)
        for name, r in chain_removed(rows).items():
            next(x for x in rows if x["name"] == name)["removed"] = r
        config = {"model": preset.name, "num_layers": model.config.num_hidden_layers, "tokens_per_step": tokens,
                  "row_tokens": row, "mix": opts.mix, "lora_rank": opts.lora_rank, "packed_backend": opts.backend,
                  "autocast": opts.autocast, "steps": opts.steps, "warmup": opts.warmup,
                  "batch": batches[0].length_stats(), "chain": [v.name for v in chain],
                  "memory_budget_gib": opts.budget, **extra}
        result = make_result("attribution", config, rows, device,
                             notes="A cumulative chain, interleaved step by step on the same batches: each row is "
                                   "the row before plus one change.")
        result["derived"] = step_gains(rows)
        if is_moe:
            result["routing"] = _routing(model, batches[0], with_autocast(chain, opts.autocast))
        result = write_waterfall_result(result, out_dir, f"attribution_{preset.name}_L{config['num_layers']}_"
                                        f"{tokens}tok_{extra['kernels']}", label)
        print("\n".join(measured_lines(rows)))
        return result


def _routing(model, batch, chain: list[Variant]) -> dict:
    """Per MoE step of ``chain``: its routing against the reference step's (the packed kernel with transformers'
    default experts), and its loss and gradients as run and with the reference's routing forced
    (:func:`..routing.routing_agreement`); an error in one line where the check could not run."""
    from ..routing import routing_agreement

    by = {v.name: v for v in chain}
    ref = chain[1]
    out: dict = {}
    for name in (SYNC_FREE_EAGER, FUSED_GLUE):
        if name not in by:
            continue
        try:
            out[name] = routing_agreement(model, batch, ref, by[name])
        except Exception as e:  # noqa: BLE001 - a check, not the measurement: record why it did not run
            out[name] = {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"}
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return out


def step_gains(rows: list[dict]) -> dict:
    """Each step's speed over the step before it (``gain_<name>``: > 0 is faster), and everything over stock."""
    out: dict = {}
    prev = None
    first = next((r for r in rows if "step_ms" in r), None)
    for r in rows:
        if "step_ms" not in r:
            prev = None           # a failed step: the next one has no measured step before it
            continue
        if prev is not None:
            key = "gain_" + r["name"].lstrip("+ ").split(" (")[0].replace(" ", "_").replace(",", "")
            out[key] = round(prev["step_ms"]["median"] / r["step_ms"]["median"] - 1, 4)
        prev = r
    last = next((r for r in reversed(rows) if "step_ms" in r), None)
    if first is not None and last is not None and last is not first:
        out["all_over_stock"] = round(first["step_ms"]["median"] / last["step_ms"]["median"], 4)
    return out


__all__ = ["AttributionScenario", "AttributionOptions", "attribution_chain", "step_gains", "step_removes", "STEP_REMOVES",
           "SYNC_FREE_EAGER", "FUSED_GLUE"]
