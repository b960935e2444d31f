"""Long runs of the all-fast path on a GPU: does anything leak, does the OOM fallback keep training exact, do the
loss curves of all naive and all fast agree at real width?

    python benchmarks/soak.py --out DIR [--what soak,fallback,curves] [--preset gpt-oss-20b] [--layers 4]
                              [--tokens 8192] [--steps 500] [--curve-steps 100]

* soak: ``--steps`` steps of the all-fast path (packed varlen with cached metadata, offload x2 + prefetch, sync-free
  experts, fused loss), recording after every step the process's resident host memory, the pinned bytes (our pool
  and PyTorch's caching host allocator), the CUDA memory allocated and reserved. Slopes (bytes per step, least
  squares) over the steps after the first 10% are what a leak would show. Peers leaked 5-7 GB over such runs
  (TRL #5700/#5730, Unsloth #2328).
* fallback: the same steps with offload x1, then with x2 under memory caps (``set_per_process_memory_fraction``)
  stepped down from the x1 run's peak reserved bytes in half staging buffers, until the second staging buffer cannot
  be allocated: the fallback must fire and the losses must equal the x1 run's.
* curves: ``--curve-steps`` LoRA training steps of all naive and all fast from the same initial weights and batches,
  and a noise-floor run (all naive with every weight one bf16 ulp up): how far two runs drift from rounding alone.

Writes DIR/soak.json, DIR/fallback.json, DIR/curves.json (with the environment), and prints a summary. On a CPU it
runs the same code on tiny presets (``--preset tiny-gpt-oss``), the memory cap aside.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import fastsft_lab
from fastsft_lab.data import benchmark_batches
from fastsft_lab.env import environment
from fastsft_lab.lab.harness import make_optimizer, write_json
from fastsft_lab.models import LoraSettings, build_model, get_preset
from fastsft_lab.offload import offload_manager
from fastsft_lab.packing import packed_inputs

FAST = dict(packed_attention="varlen", offload_buffers=2, prefetch=True, moe_routing="sync_free", fused_loss=True)
NAIVE = dict(packed_attention="varlen", packed_metadata_cache=False, offload_buffers=1, moe_routing="naive")


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _host_cached() -> int | None:
    fn = getattr(torch.cuda, "host_memory_stats", None)
    if fn is None or not torch.cuda.is_available():
        return None
    try:
        stats = fn()
    except Exception:  # noqa: BLE001 - an older torch
        return None
    return stats.get("allocated_bytes.current", stats.get("reserved_bytes.current"))


def _slope(ys: list[float]) -> float:
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    den = sum((i - mx) ** 2 for i in range(n))
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / den


def _switches(preset, switches):
    out = dict(switches)
    if not get_preset(preset).is_moe:
        out.pop("moe_routing", None)
    return out


class Run:
    """One model and its batches; every phase starts from the same trainable weights."""

    def __init__(self, preset, layers, tokens, row, device, dtype):
        self.device = torch.device(device)
        p = get_preset(preset)
        targets = None if p.family == "qwen3" else ["q_proj", "k_proj", "v_proj", "o_proj"]
        quant = "nf4" if p.family == "qwen3" and p.real else None
        self.model = build_model(preset, device=self.device, dtype=dtype, quant=quant, num_layers=layers,
                                 lora=LoraSettings(rank=16, target_modules=targets), gradient_checkpointing=True)
        torch.manual_seed(0)
        for n, q in self.model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(q, std=0.01)
        self.initial = {n: q.detach().clone() for n, q in self.model.named_parameters() if q.requires_grad}
        self.batches = [b.to(self.device) for b in benchmark_batches(
            tokens_per_step=tokens, row_tokens=row, steps=8, vocab_size=self.model.config.vocab_size,
            mix="realistic" if p.real else "short")]
        self.preset = preset

    def reset(self, nudge: bool = False):
        with torch.no_grad():
            for n, q in self.model.named_parameters():
                if n in self.initial:
                    q.copy_(self.initial[n])
                    if nudge:
                        q.copy_(torch.nextafter(q, torch.full_like(q, float("inf"))))
        self.opt = make_optimizer(self.model, lr=1e-4)

    def step(self, i: int) -> float:
        b = self.batches[i % len(self.batches)]
        loss = self.model(**packed_inputs(b)).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())          # one read per step (the soak records it)

    def train(self, switches: dict, steps: int, record=None, nudge=False) -> list[float]:
        self.model.train()
        fastsft_lab.revert(self.model)
        self.reset(nudge)
        fastsft_lab.apply(self.model, **_switches(self.preset, switches))
        losses = []
        for i in range(steps):
            losses.append(self.step(i))
            if record is not None:
                record(i)
        fastsft_lab.revert(self.model)
        return losses


def soak(run: Run, steps: int) -> dict:
    rows = []

    def record(i):
        if run.device.type == "cuda":
            torch.cuda.synchronize()
        m = offload_manager(run.model)
        rows.append({"step": i, "rss": _rss(), "pool": m.pool.nbytes if m else 0, "host_cached": _host_cached(),
                     "cuda_allocated": torch.cuda.memory_allocated() if run.device.type == "cuda" else None,
                     "cuda_reserved": torch.cuda.memory_reserved() if run.device.type == "cuda" else None})

    t = time.time()
    losses = run.train(FAST, steps, record)
    seconds = time.time() - t
    skip = max(1, steps // 10)
    slopes = {}
    for key in ("rss", "pool", "host_cached", "cuda_allocated", "cuda_reserved"):
        ys = [r[key] for r in rows[skip:] if r[key] is not None]
        if ys:
            slopes[key] = {"bytes_per_step": round(_slope(ys), 1), "first": ys[0], "last": ys[-1],
                           "min": min(ys), "max": max(ys)}
    return {"scenario": "soak", "steps": steps, "warmup_steps_excluded": skip, "seconds": round(seconds, 1),
            "switches": FAST, "slopes": slopes, "losses": losses, "rows": rows[::max(1, steps // 100)]}


def _two_buffer_trial(run: Run, steps: int, cap: int | None) -> dict:
    """All fast (offload x2) from the same start, under an allocator cap of ``cap`` bytes (None: no cap)."""
    import warnings

    trial: dict = {"cap_bytes": cap}
    if cap is not None:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(run.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), torch.cuda.current_device())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fastsft_lab.revert(run.model)
            run.reset()
            fastsft_lab.apply(run.model, **_switches(run.preset, FAST))
            manager = offload_manager(run.model)
            trial["losses"] = [run.step(i) for i in range(steps)]
            trial["fallbacks"] = manager.stats.fallbacks
            trial["active_buffers_after"] = manager.active_buffers
    except torch.cuda.OutOfMemoryError as e:
        trial["error"] = f"out of memory outside the staging buffer: {str(e).splitlines()[0][:200]}"
        trial["losses"] = []
    finally:
        fastsft_lab.revert(run.model)
        if cap is not None:
            torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
            torch.cuda.empty_cache()
    trial["warnings"] = [str(w.message)[:200] for w in caught if "offloaded" in str(w.message)]
    return trial


def fallback(run: Run, steps: int) -> dict:
    """Offload x1, then all fast (x2) under allocator caps stepped down in half staging buffers, until the second
    buffer's allocation fails and the manager falls back to one buffer (the losses must then equal the x1 run's) or
    an allocation outside the staging buffers fails first (recorded; the search stops). Two starting points, each
    tried in turn: the x1 run's peak *reserved* bytes (from half a buffer above), then the uncapped x2 run's own
    peak (from half a buffer below: on the H200 the x2 step's other allocations already needed more than the x1
    peak plus half a buffer, so the first search hit an out-of-memory outside the buffers at once). A cap on
    reserved memory alone cannot force it when the pool's free blocks hold the second buffer; stepping down finds
    the cap where they no longer do."""
    one = run.train(dict(FAST, offload_buffers=1, prefetch=False), steps)
    out = {"scenario": "offload_fallback", "steps": steps, "losses_x1": one, "trials": []}
    if run.device.type != "cuda":
        trial = _two_buffer_trial(run, steps, None)
        out["trials"].append(trial)
    else:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        run.train(dict(FAST, offload_buffers=1, prefetch=False), 2)
        peak = torch.cuda.max_memory_reserved()
        staging = run.batches[0].num_tokens * run.model.config.hidden_size * 2   # one layer input in bf16
        out.update(peak_reserved_x1=peak, peak_allocated_x1=torch.cuda.max_memory_allocated(), staging_bytes=staging)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        run.train(FAST, 2)
        peak2 = torch.cuda.max_memory_reserved()
        out.update(peak_reserved_x2=peak2, peak_allocated_x2=torch.cuda.max_memory_allocated())
        trial = {}
        for base, name, steps_down in ((peak, "x1", range(1, -9, -1)), (peak2, "x2", range(-1, -9, -1))):
            for j in steps_down:          # x1: peak + staging/2 down to peak - 4 staging; x2: from peak - staging/2
                trial = _two_buffer_trial(run, steps, base + j * staging // 2)
                trial[f"cap_minus_peak_reserved_{name}"] = j * staging // 2
                out["trials"].append({k: v for k, v in trial.items() if k != "losses"})
                if trial.get("fallbacks") or "error" in trial:
                    break
            if trial.get("fallbacks") and "error" not in trial:
                break
    fired = trial.get("fallbacks", 0) > 0 and "error" not in trial
    out["fallbacks"] = trial.get("fallbacks", 0)
    out["fired"] = fired
    out["cap_bytes"] = trial.get("cap_bytes")
    out["active_buffers_after"] = trial.get("active_buffers_after")
    out["warnings"] = trial.get("warnings", [])
    if "error" in trial:
        out["error"] = trial["error"]
    two = trial.get("losses", [])
    out["losses_fallback"] = two
    if two:
        out["max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(one, two))
    return out


def curves(run: Run, steps: int) -> dict:
    naive = run.train(NAIVE, steps)
    fast = run.train(FAST, steps)
    floor = run.train(NAIVE, steps, nudge=True)
    diff = [abs(a - b) for a, b in zip(naive, fast)]
    noise = [abs(a - b) for a, b in zip(naive, floor)]
    return {"scenario": "convergence", "steps": steps, "lr": 1e-4, "switches": {"naive": NAIVE, "fast": FAST},
            "losses": {"all naive": naive, "all fast": fast, "all naive, weights one ulp up": floor},
            "max_abs_diff_fast_vs_naive": max(diff), "max_abs_diff_noise_floor": max(noise),
            "final": {"all naive": naive[-1], "all fast": fast[-1]}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--what", default="soak,fallback,curves")
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--row", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--fallback-steps", type=int, default=20)
    ap.add_argument("--curve-steps", type=int, default=100)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        FAST["packed_attention"] = NAIVE["packed_attention"] = "sdpa"
    run = Run(args.preset, args.layers, args.tokens, args.row, device, dtype)
    env = environment(device)
    config = {"preset": args.preset, "num_layers": run.model.config.num_hidden_layers, "tokens_per_step": args.tokens,
              "row_tokens": args.row, "dtype": str(dtype).replace("torch.", ""), "lora_rank": 16}
    for what in args.what.split(","):
        t = time.time()
        if what == "soak":
            doc = soak(run, args.steps)
        elif what == "fallback":
            doc = fallback(run, args.fallback_steps)
        elif what == "curves":
            doc = curves(run, args.curve_steps)
        else:
            raise SystemExit(f"unknown --what {what!r}; valid: soak, fallback, curves")
        doc.update(env=env, config=config)
        write_json(doc, os.path.join(args.out, f"{what}.json"))
        brief = {k: v for k, v in doc.items() if k in ("slopes", "fallbacks", "active_buffers_after",
                                                        "max_abs_loss_diff", "max_abs_diff_fast_vs_naive",
                                                        "max_abs_diff_noise_floor", "final", "error", "seconds", "fired",
                                                        "cap_bytes")}
        print(f"{what} ({time.time() - t:.0f} s): {json.dumps(brief, default=str)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
