"""Command line: ``python -m fastsft_lab bench`` (the main job), ``info`` and ``results``.

``bench`` runs the three optimizations' benchmark scenarios on an embedded default: tiny models on a CPU (smoke
mode), real architectures (random weights, reduced depth where the budget needs it) on a GPU. Each scenario writes
one JSON per configuration and a chart; a summary table closes the run.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import sys
import time

import torch

from .harness import spreads_overlap
from .scenario import OptionError, option_help
from .scenarios import SCENARIOS


class UsageError(SystemExit):
    """A one-line error about the command line (exit status 2)."""

    def __init__(self, message: str):
        print(f"fastsft_lab: error: {message}", file=sys.stderr)
        super().__init__(2)


def _parse_value(text: str):
    if "," in text:
        return [_parse_value(t) for t in text.split(",") if t != ""]
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_sets(items: list[str] | None) -> dict[str, dict]:
    """``--set packed.tokens=4096,16384`` -> {"packed": {"tokens": [4096, 16384]}}."""
    out: dict[str, dict] = {name: {} for name in SCENARIOS}
    for item in items or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise UsageError(f"--set expects SCENARIO.KEY=VALUE (e.g. packed.tokens=4096,16384), got {item!r}")
        key, value = item.split("=", 1)
        scenario, option = key.split(".", 1)
        if scenario not in SCENARIOS:
            raise UsageError(f"--set: unknown scenario {scenario!r}; known: {', '.join(SCENARIOS)}")
        out[scenario][option] = _parse_value(value)
    return out


def _options_epilog() -> str:
    lines = ["scenario options (--set SCENARIO.KEY=VALUE; lists comma-separated; defaults differ on a GPU and in "
             "smoke mode):"]
    for name, scenario in SCENARIOS.items():
        lines.append(f"  {name}: {scenario.title}")
        for key, kind, text in option_help(scenario.Options):
            lines.append(f"    {name}.{key} ({kind}): {text}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fastsft_lab",
        description="Benchmarks and tools for fastsft_lab's three fine-tuning optimizations.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    bench = sub.add_parser(
        "bench", help="benchmark all three optimizations (before/after/peers) on an embedded default",
        description="Run the benchmark scenarios. On a CPU the default is tiny models (smoke mode: about two "
                    "minutes on 2 cores; the timings show the mechanism, not GPU speed); on a GPU the real "
                    "architectures (random weights). Variants are interleaved step by step; every phase is reported "
                    "as median [p20-p80].",
        epilog=_options_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--only", default=",".join(SCENARIOS),
                       help=f"comma-separated scenarios to run, from: {', '.join(SCENARIOS)}")
    bench.add_argument("--out", default=None,
                       help="output folder for JSON + PNG (default: runs/bench-<device>-<UTC time>, git-ignored)")
    bench.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    smoke = bench.add_mutually_exclusive_group()
    smoke.add_argument("--smoke", dest="smoke", action="store_true", default=None,
                       help="tiny models and sizes (default on a CPU, or when SMOKE=1)")
    smoke.add_argument("--full", dest="smoke", action="store_false",
                       help="real architectures and sizes (default on a GPU)")
    bench.add_argument("--steps", type=int, default=None, help="measured steps per variant (scenario default)")
    bench.add_argument("--warmup", type=int, default=None, help="warm-up steps per variant (scenario default)")
    bench.add_argument("--set", action="append", metavar="SCENARIO.KEY=VALUE",
                       help="scenario option, repeatable (the keys are listed below)")
    bench.add_argument("--quiet", action="store_true", help="no progress bars")

    sub.add_parser("info", help="print the environment, the presets and which attention backends run here")
    res = sub.add_parser("results", help="list the committed benchmark results, or rebuild their packaged index")
    res.add_argument("--index", action="store_true", help="rewrite fastsft_lab/lab/data/results.json from "
                                                          "benchmarks/results (run in a clone)")
    res.add_argument("--readme", action="store_true", help="regenerate the README headline and docs/results.md from "
                                                           "the committed results")
    return parser


def _default_out(device: torch.device) -> str:
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return os.path.join("runs", f"bench-{device.type}-{stamp}")


def _quiet_optional_notices() -> None:
    """bitsandbytes' CPU build announces an optional kernel package it does not find, at import: not our news."""
    import logging

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


def run_bench(args) -> int:
    _quiet_optional_notices()
    from ..env import default_device, describe, device_profile, smoke_mode

    if args.device not in (None, "cpu", "cuda") and not str(args.device).startswith("cuda:"):
        raise UsageError(f"--device must be cpu or cuda, got {args.device!r}")
    device = torch.device(args.device) if args.device else default_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda was asked for, but torch.cuda.is_available() is False on this machine")
    try:   # FASTSFT_DEVICE_PROFILE=t4|24gb: a smaller GPU's memory cap for this process (env.device_profile)
        profile = device_profile(device)
    except ValueError as e:
        raise UsageError(str(e)) from None
    smoke = smoke_mode() if args.smoke is None else args.smoke
    if device.type == "cpu" and not smoke:
        print("note: --full on a CPU builds real-size models; expect it to be very slow", file=sys.stderr)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise UsageError(f"--only: unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    sets = parse_sets(args.set)
    for name, values in sets.items():
        if values and name not in names:
            raise UsageError(f"--set {name}.*: scenario {name!r} is not in --only {args.only}")
    # every scenario's options are resolved and checked before anything runs
    plans = {}
    for name in names:
        try:
            plans[name] = SCENARIOS[name].options(device, smoke, sets[name], steps=args.steps, warmup=args.warmup)
        except (OptionError, ValueError) as e:
            raise UsageError(f"{name}: {e}") from None
    out_dir = args.out or _default_out(device)
    os.makedirs(out_dir, exist_ok=True)
    print(f"fastsft_lab bench | {describe()} | device={device} smoke={smoke} | out={out_dir}")
    if device.type == "cuda":
        print(f"device profile: {profile.describe()}")
    if device.type == "cpu":
        print("CPU run: tiny models, one thread per scenario. The timings show each mechanism (host syncs removed, "
              "metadata built once, copies scheduled), not GPU speed; GPU figures: README and benchmarks/results.")

    summary = []
    empty = []
    t0 = time.time()
    for name in names:
        scenario = SCENARIOS[name]
        print(f"\n=== {name}: {scenario.title} ===")
        t1 = time.time()
        results = scenario(plans[name], device=device, out_dir=out_dir, progress=not args.quiet)
        for r in results:
            summary.append(_summarize(name, r))
        if not any("error" not in v for r in results for v in r.get("variants", [])):
            empty.append(name)
        print(f"  ({time.time() - t1:.0f} s)")

    path = os.path.join(out_dir, "summary.json")
    with open(path, "w") as f:
        json.dump({"device": str(device), "smoke": smoke, "seconds": round(time.time() - t0, 1),
                   "scenarios": summary}, f, indent=2, default=str)
    print("\n=== summary: step-time speed of each variant against its scenario's first variant (higher is better; "
          "~: the p20-p80 spreads overlap, not told apart) and host syncs per step ===")
    for s in summary:
        print(f"  {s['scenario']:8s} {s['label']}")
        for v in s["variants"]:
            print(f"      {v['name']:30s} {v['speedup']}")
    print(f"\nwrote {path} ({time.time() - t0:.0f} s in all)")
    if empty:
        print(f"fastsft_lab bench: nothing was measured by {', '.join(empty)}: every configuration was skipped or "
              "failed (the lines above say why)", file=sys.stderr)
        return 1
    return 0


def _summarize(name: str, result: dict) -> dict:
    cfg = result.get("config", {})
    rows = [r for r in result.get("variants", []) if "step_ms" in r]
    base_stat = rows[0]["step_ms"] if rows else None
    base = base_stat["median"] if base_stat else None
    label = ", ".join(f"{k}={cfg[k]}" for k in ("model", "num_layers", "tokens_per_step", "backend", "mode")
                      if k in cfg)
    variants = []
    for r in result.get("variants", []):
        if "step_ms" in r and base:
            same = r is not rows[0] and spreads_overlap(r["step_ms"], base_stat)
            syncs = r.get("host_syncs_per_step")
            variants.append({"name": r["name"], "step_ms": r["step_ms"]["median"], "overlaps_baseline": same,
                             "host_syncs_per_step": syncs,
                             "speedup": f"{base / r['step_ms']['median']:.2f}x{'~' if same else ' '} "
                                        f"({r['step_ms']['median']:.1f} ms)"
                                        + (f"  {syncs} syncs/step" if syncs is not None else "")})
        else:
            variants.append({"name": r["name"], "speedup": r.get("error", "-")})
    return {"scenario": name, "label": label, "variants": variants}


def run_info() -> int:
    from ..env import describe, environment
    from ..models import PRESETS
    from ..packing import available_backends

    print(describe())
    print(json.dumps(environment(), indent=2, default=str))
    print("\npresets:")
    for p in PRESETS.values():
        c = p.config
        print(f"  {p.name:15s} {p.family:9s} layers={c['num_hidden_layers']:3d} hidden={c['hidden_size']:5d} "
              f"{'real' if p.real else 'tiny'} {p.hub_id or ''}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print("\nattention backends on", device)
    for name, (ok, why) in available_backends(device).items():
        print(f"  {name:12s} {'yes' if ok else 'no '} {why}")
    return 0


def run_results(args) -> int:
    from . import results

    if args.index or args.readme:
        from . import report

        if args.index:
            print("wrote", results.write_index())
        if args.readme:
            print("wrote", report.write_readme())
            print("wrote", report.write_headline_chart())
        return 0
    docs = results.all_results()
    for d in sorted(docs, key=lambda d: d["_path"]):
        print(f"  {d['_path']:80s} {d.get('scenario')}")
    print(f"{len(docs)} results")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and importlib.util.find_spec("matplotlib") is None:
        print("fastsft_lab bench: its charts need matplotlib, which the library alone does not install: "
              "pip install 'fastsft_lab[lab]'", file=sys.stderr)
        return 2
    if args.command == "bench":
        return run_bench(args)
    if args.command == "info":
        return run_info()
    if args.command == "results":
        return run_results(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
