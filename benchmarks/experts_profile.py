"""Where one MoE layer's sync-free experts spend their time beyond the grouped matmuls (issue: closer to the limits).

    python benchmarks/experts_profile.py --out DIR [--presets gpt-oss-20b,qwen3-30b-a3b] [--tokens 8192,16384]

For each preset (one decoder layer at real width, bf16, random weights) and token count: the router runs once on a
random input; then the experts forward + backward (input and routing-weight gradients, expert weights frozen, as
under LoRA) of every ``moe_routing`` implementation named in ``--impls`` is timed (CUDA events, median of
``--reps``), next to "expert matmuls alone" (the zero-overhead limit of ``fastsft_lab.lab.scenarios.moe``), and
profiled with ``torch.profiler``: GPU time per aten op (self device time: the kernels an op launches itself) and per
kernel, averaged over the profiled calls. Everything lands in ``DIR/experts_profile.json`` (a result document,
scenario ``moe-experts-profile``, read by ``fastsft_lab.lab.results``) plus one text table per case on stdout. Needs a CUDA GPU with grouped_mm (sm80+, bf16).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def profile_ops(fn, calls: int) -> dict:
    """GPU time per aten op and per kernel (ms per call), from ``calls`` profiled calls of ``fn``."""
    from fastsft_lab.profiling import profile

    r = profile(fn, steps=calls, top=30)
    return {"gpu_busy_ms": r.device_busy_ms, "ops": r.ops_per_step, "kernels": r.kernels_per_step}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--presets", default="gpt-oss-20b,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="8192,16384")
    ap.add_argument("--impls", default="sync_free,sync_free:eager_glue",
                    help="moe_routing implementations to time and profile (':eager_glue': every fused kernel off)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--calls", type=int, default=3, help="profiled calls per case")
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a dry run of the script)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("experts_profile.py measures on a CUDA GPU (grouped_mm in bf16); none here (--device cpu: dry run)",
              file=sys.stderr)
        return 2

    from fastsft_lab.env import environment
    from fastsft_lab.lab.scenarios.moe import _matmuls_alone, _router_and_experts
    from fastsft_lab.models import build_model
    from fastsft_lab.structure import decoder_layers
    from fastsft_lab.moe import moe_routing, set_fused_glu
    from fastsft_lab.moe.kernels import set_fused_combine
    from fastsft_lab.profiling import time_ms

    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    doc = {"scenario": "moe-experts-profile", "env": environment(device),
           "what": "one MoE layer's experts, forward + backward (input and routing-weight grads, expert weights "
                   "frozen as under LoRA); time per implementation and the GPU time per op/kernel under torch.profiler",
           "cases": []}
    for preset in args.presets.split(","):
        model = build_model(preset, device=device, dtype=torch.bfloat16, num_layers=1)
        mlp = decoder_layers(model)[0].mlp
        router, experts = _router_and_experts(mlp)
        base = experts.get_base_layer() if hasattr(experts, "get_base_layer") else experts
        for tokens in [int(t) for t in args.tokens.split(",")]:
            gen = torch.Generator(device=device).manual_seed(0)
            hidden_size = int(getattr(base, "hidden_size", None) or getattr(base, "hidden_dim"))
            hidden = torch.randn(tokens, hidden_size, device=device, dtype=torch.bfloat16, generator=gen)
            with torch.no_grad():
                _, weights, index = router(hidden)
            grad_out = torch.randn_like(hidden)
            case = {"preset": preset, "tokens": tokens, "num_experts": base.num_experts, "top_k": index.shape[1],
                    "hidden_size": hidden_size, "rows": []}
            trainable = [p for p in experts.parameters() if p.requires_grad]
            for p in trainable:  # expert weights frozen, as under LoRA (the limit has no weight gradients either)
                p.requires_grad_(False)
            floor = _matmuls_alone(base, hidden, index, grad_out, device, 3, args.reps)
            case["rows"].append({"name": "expert matmuls alone", "step_ms": floor.get("step_ms"),
                                 "forward_ms": floor.get("forward_ms"), "error": floor.get("error")})
            for spec in args.impls.split(","):
                impl, _, flag = spec.partition(":")
                glu_before = set_fused_glu(flag != "eager_glue")
                combine_before = set_fused_combine(flag != "eager_glue")
                with moe_routing(model, impl):
                    def train():
                        h = hidden.detach().requires_grad_(True)
                        w = weights.detach().requires_grad_(True)
                        experts(h, index, w).backward(grad_out)

                    def forward():
                        with torch.no_grad():
                            experts(hidden, index, weights)

                    row = {"name": spec, "step_ms": time_ms(train, device, 3, args.reps),
                           "forward_ms": time_ms(forward, device, 3, args.reps),
                           "profile_step": profile_ops(train, args.calls),
                           "profile_forward": profile_ops(forward, args.calls)}
                set_fused_glu(glu_before)
                set_fused_combine(combine_before)
                case["rows"].append(row)
                ratio = row["step_ms"]["median"] / floor["step_ms"]["median"] if floor.get("step_ms") else None
                print(f"\n== {preset} {tokens} tok {spec}: step {row['step_ms']['median']:.3f} ms, forward "
                      f"{row['forward_ms']['median']:.3f} ms; matmuls alone {floor['step_ms']['median']:.3f} / "
                      f"{floor['forward_ms']['median']:.3f} ms" + (f" ({ratio:.2f}x)" if ratio else ""))
                busy = row["profile_step"]["gpu_busy_ms"]
                print(f"   GPU busy per step {busy:.3f} ms; top ops (self GPU ms):" if busy is not None else
                      "   (no GPU: top ops by self host ms)")
                for o in row["profile_step"]["ops"][:18]:
                    print(f"     {o['ms']:8.3f}  {o['name']}")
                print("   top kernels:")
                for o in row["profile_step"]["kernels"][:14]:
                    print(f"     {o['ms']:8.3f}  {o['name'][:110]}")
            for p in trainable:
                p.requires_grad_(True)
            doc["cases"].append(case)
            del hidden, grad_out, weights, index
        del model, mlp, router, experts, base
        torch.cuda.empty_cache()
    path = os.path.join(args.out, "experts_profile.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
