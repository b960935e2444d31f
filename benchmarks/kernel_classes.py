"""Which kernels of one training step the roofline calls compute, memory or latency -- and on what FLOPs and bytes.

Usage: python benchmarks/kernel_classes.py --model qwen3-14b --layers 4 [--quant nf4] [--tokens 8192]
       [--row-tokens 4096] [--top 25] [--out FILE.json]

Builds the model at real width (random weights, LoRA r16, transformers' gradient checkpointing, its default
attention), runs warm steps under autocast bf16, profiles one with :mod:`fastsft_lab.step_profile`, and prints the
kernels grouped by launching op and kernel name, largest first: calls, ms, the op's FLOPs and bytes as
:mod:`fastsft_lab.roofline` estimated them, the FLOP/s and bytes/s they reach against the card's peaks, and the class.
The question it answers: is a class right, or is an estimate missing (a long kernel called "latency" or "unknown")?
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from fastsft_lab.data import benchmark_batches
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.roofline import device_peaks
from fastsft_lab.step_profile import profile_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-14b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--quant", default=None)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--row-tokens", type=int, default=None)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.model, device=device, quant=args.quant, lora=LoraSettings(rank=16),
                        num_layers=args.layers, gradient_checkpointing=True)
    batch = benchmark_batches(tokens_per_step=args.tokens, row_tokens=args.row_tokens, steps=1,
                              vocab_size=model.config.vocab_size)[0].to(device).model_inputs()

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    peaks = device_peaks(device)
    prof = profile_step(step, model=model, device=device, peaks=peaks)
    groups: dict[tuple, dict] = defaultdict(lambda: {"calls": 0, "us": 0.0, "flops": 0.0, "bytes": 0.0,
                                                     "bounds": defaultdict(float), "ops": set()})
    seen_ops: set = set()
    for k in prof.kernels:
        g = groups[(k.op, k.name[:70])]
        g["calls"] += 1
        g["us"] += k.us
        g["bounds"][k.bound] += k.us
        if k.op_key is not None and (k.op_key, k.name) not in seen_ops:
            seen_ops.add((k.op_key, k.name))
            g["flops"] += k.flops
            g["bytes"] += k.nbytes
    rows = sorted(groups.items(), key=lambda kv: -kv[1]["us"])[:args.top]
    print(f"{args.model} x{args.layers} {args.quant or 'bf16'} {args.tokens} tokens | {peaks.source} | "
          f"step {prof.step_ms:.1f} ms, busy {prof.busy_ms:.1f} ms | by bound (ms): "
          + ", ".join(f"{b} {ms:.1f}" for b, ms in prof.by_bound().items()))
    print(f"{'op':38} {'kernel':44} {'calls':>6} {'ms':>8} {'GFLOP':>9} {'MB':>9} {'%flops':>7} {'%bw':>6}  bound")
    out = []
    for (op, name), g in rows:
        s = g["us"] / 1e6
        pf = g["flops"] / s / peaks.flops_for("16-bit") * 100 if s else 0.0
        pb = g["bytes"] / s / peaks.bandwidth * 100 if s else 0.0
        bound = max(g["bounds"], key=g["bounds"].get)
        print(f"{(op or '-')[:38]:38} {name[:44]:44} {g['calls']:6d} {g['us'] / 1e3:8.2f} {g['flops'] / 1e9:9.1f} "
              f"{g['bytes'] / 1e6:9.1f} {pf:7.1f} {pb:6.1f}  {bound}")
        out.append({"op": op, "kernel": name, "calls": g["calls"], "ms": g["us"] / 1e3, "flops": g["flops"],
                    "bytes": g["bytes"], "bounds_ms": {b: v / 1e3 for b, v in g["bounds"].items()}})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "layers": args.layers, "quant": args.quant, "tokens": args.tokens,
                       "peaks": peaks.source, "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
