"""The memory plan as a user's plain script runs it: build the model, apply, train -- no counters reset by hand.

    python benchmarks/plan_script.py --order build-then-plan --budget 74 --out runs/plan-script
    python benchmarks/plan_script.py --order recipe-then-plan --budget 74 --out runs/plan-script

``build-then-plan``: the model is built (NF4 + LoRA, the README recipe's floor) and trained at once with
``memory_budget`` -- whatever the build left cached in the allocator is there when step 1 measures.
``recipe-then-plan``: the README recipe (offload x2 + prefetch everywhere) trains first in the same process and is
timed; then ``offload_buffers="off", memory_budget=...`` and the plan trains and is timed: a notebook switching
configurations. Both train with AdamW on the LoRA parameters under autocast bf16, on the same packed batches
(cycled), step 1 and 2 (measure, solve) untimed; medians of ``--steps`` steps after ``--warmup``. Writes one JSON per
order: the plan, what it was solved under (the budget, or the allocator's ceiling where lower), the predicted and
measured peak, step ms, and the recipe's where it ran. ``--device cpu --preset tiny-qwen3``: the same script without
NF4 or memory figures, to check it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def _steps(model, batches, optimizer, n: int, start: int = 0) -> list[float]:
    """``n`` training steps (forward, backward, AdamW step), each timed to its end on the device (ms)."""
    from fastsft_lab.packing import packed_inputs

    device = batches[0].input_ids.device
    cuda = device.type == "cuda"
    times = []
    for i in range(n):
        batch = batches[(start + i) % len(batches)]
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            loss = model(**packed_inputs(batch)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _gib(read) -> float | None:
    """A CUDA memory counter in GiB (None on a CPU)."""
    return read() / 2**30 if torch.cuda.is_available() else None


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--order", choices=("build-then-plan", "recipe-then-plan"), required=True)
    ap.add_argument("--preset", default="qwen3-14b")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: all)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per step, one packed row")
    ap.add_argument("--budget", type=float, default=74.0, help="memory_budget, GiB")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps after the plan's two (or the recipe's first)")
    ap.add_argument("--out", required=True, help="folder for the JSON")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only to check the script (no NF4, no memory figures)")
    args = ap.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("plan_script.py: no CUDA GPU here (--device cpu --preset tiny-qwen3 checks the script)")
        return 2

    import fastsft_lab
    from fastsft_lab.data import benchmark_batches
    from fastsft_lab.models import LoraSettings, build_model
    from fastsft_lab.offload.plan import memory_planner

    gib = 2**30
    t0 = time.perf_counter()
    model = build_model(args.preset, device=args.device, dtype=torch.bfloat16 if cuda else torch.float32,
                        quant="nf4" if cuda else None, lora=LoraSettings(rank=16), num_layers=args.layers)
    built_s = time.perf_counter() - t0
    batches = [b.to(args.device) for b in benchmark_batches(tokens_per_step=args.tokens, row_tokens=args.tokens,
                                                           steps=args.batches, vocab_size=model.config.vocab_size)]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    # the README's floor (sdpa on a CPU: varlen is a reference kernel there)
    fastsft_lab.apply(model, packed_attention="varlen" if cuda else "sdpa", fused_loss=True, fused_lora=True)
    doc: dict = {"order": args.order, "preset": args.preset, "num_layers": model.config.num_hidden_layers,
                 "tokens_per_step": args.tokens, "budget_gib": args.budget,
                 "gpu": torch.cuda.get_device_name() if cuda else None, "torch": torch.__version__,
                 "build_s": round(built_s, 1),
                 "at_apply": {"allocated_gib": _gib(torch.cuda.memory_allocated),
                              "reserved_gib": _gib(torch.cuda.memory_reserved),
                              "peak_reserved_gib": _gib(torch.cuda.max_memory_reserved)}}
    if args.order == "recipe-then-plan":
        fastsft_lab.apply(model, offload_buffers=2, prefetch=True)
        times = _steps(model, batches, optimizer, 1 + args.warmup + args.steps)[1 + args.warmup:]
        doc["recipe"] = {"step_ms": _median(times), "steps_ms": times,
                         "peak_gib": _gib(torch.cuda.max_memory_allocated)}
        fastsft_lab.apply(model, offload_buffers="off")
        doc["after_recipe"] = {"allocated_gib": _gib(torch.cuda.memory_allocated),
                               "reserved_gib": _gib(torch.cuda.memory_reserved)}
    fastsft_lab.apply(model, memory_budget=args.budget)
    _steps(model, batches, optimizer, 2 + args.warmup)                # step 1 measures, step 2 solves
    planner = memory_planner(model)
    if cuda:
        torch.cuda.reset_peak_memory_stats()                          # the planned steps' own peak, from here
    times = _steps(model, batches, optimizer, args.steps, start=2 + args.warmup)
    doc["plan"] = {"describe": planner.describe(), "choices": list(planner.plan.choices),
                   "solved_under_gib": planner.reachable() / gib,
                   "ceiling_gib": None if planner.ceiling is None else planner.ceiling / gib,
                   "predicted_peak_gib": planner.plan.peak / gib, "peak_gib": _gib(torch.cuda.max_memory_allocated),
                   "step_ms": _median(times), "steps_ms": times}
    if "recipe" in doc:
        doc["plan_over_recipe"] = doc["recipe"]["step_ms"] / doc["plan"]["step_ms"]
    fastsft_lab.revert(model)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"plan-script-{args.order}-{args.preset}-L{doc['num_layers']}-{args.tokens}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    p = doc["plan"]
    print(f"{args.order}: solved under {p['solved_under_gib']:.2f} GiB (budget {args.budget} GiB, ceiling "
          f"{p['ceiling_gib'] if p['ceiling_gib'] is None else round(p['ceiling_gib'], 2)} GiB); "
          f"{p['describe'].split(';')[0]}; {p['step_ms']:.1f} ms, peak {p['peak_gib'] or 0:.2f} GiB "
          f"(predicted {p['predicted_peak_gib']:.2f})"
          + (f"; recipe {doc['recipe']['step_ms']:.1f} ms: {doc['plan_over_recipe']:.3f}x" if "recipe" in doc else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
