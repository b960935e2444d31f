"""Scenario ``distributed``: all fast under DDP on every GPU it is given (two gloo processes on a CPU), against the
same step on one process: what DDP itself costs (world 1, through torchrun: the same code path) and what each rank
pays at world N. Each run is a ``torchrun`` of :mod:`fastsft_lab.lab.distributed` (``--time``); the world size is in
the JSON. Every rank trains its own packed row of the same length, so the per-rank work is the same at every world
size and the step times compare directly (the gradient all-reduce is the difference).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import torch

from ..harness import format_derived, format_table, make_result, write_json
from ..scenario import OptionError, Scenario, option


@dataclasses.dataclass
class DistributedOptions:
    preset: str = option("tiny-qwen3", kind="str", help="the model (a fastsft_lab preset)")
    layers: int | None = option(None, kind="int?", help="decoder layers (none: all)")
    tokens: int = option(512, kind="int", help="tokens per rank and step (one packed row)")
    nproc: int = option(0, kind="int", help="processes at the largest world size (0: every GPU, or 2 on a CPU)")
    steps: int = option(6, kind="int", help="measured steps per run")
    warmup: int = option(2, kind="int", help="warm-up steps per run")
    timeout: int = option(600, kind="int", help="seconds each torchrun may take")

    @classmethod
    def defaults(cls, device: torch.device, smoke: bool) -> "DistributedOptions":
        if smoke:
            return cls()
        return cls(preset="qwen3-14b", layers=8, tokens=8192, steps=10, warmup=3)


def _world(opts, device: torch.device) -> int:
    if opts.nproc:
        return opts.nproc
    return torch.cuda.device_count() if device.type == "cuda" else 2


class DistributedScenario(Scenario):
    name = "distributed"
    title = "all fast under DDP (torchrun) against one process: DDP's cost at world 1, a rank's step at world N"
    Options = DistributedOptions

    def validate(self, opts, device: torch.device) -> None:
        super().validate(opts, device)
        if opts.tokens < 16:
            raise OptionError(f"tokens must be >= 16, got {opts.tokens}")
        if opts.nproc < 0:
            raise OptionError(f"nproc must be >= 0 (0: every GPU, or 2 on a CPU), got {opts.nproc}")
        if device.type == "cuda" and opts.nproc > torch.cuda.device_count():
            raise OptionError(f"nproc={opts.nproc} but this machine has {torch.cuda.device_count()} GPU(s)")

    def _torchrun(self, opts, nproc: int, out: str, ddp: bool) -> dict:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "fastsft_lab.lab.distributed", "--time", opts.preset, "--tokens", str(opts.tokens),
               "--steps", str(opts.steps), "--warmup", str(opts.warmup), "--out", out]
        if opts.layers:
            cmd += ["--layers", str(opts.layers)]
        if not ddp:
            cmd.append("--no-ddp")
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=opts.timeout, env=env)
        if proc.returncode != 0:
            return {"error": f"torchrun --nproc_per_node={nproc} failed: {proc.stderr.strip().splitlines()[-1:]}"}
        with open(out) as f:
            return json.load(f)

    def run(self, opts, *, device: torch.device, out_dir: str, progress: bool = True) -> list[dict]:
        world = _world(opts, device)
        runs = [("one process, no DDP", 1, False), ("DDP, world 1 (torchrun)", 1, True)]
        if world > 1:
            runs.append((f"DDP, world {world}", world, True))
        rows = []
        for name, nproc, ddp in runs:
            if progress:
                print(f"  {name} ...", flush=True)
            doc = self._torchrun(opts, nproc, os.path.join(out_dir, f"distributed-{nproc}-{int(ddp)}.json"), ddp)
            row = {"name": name, "toggles": {"world_size": nproc, "ddp": ddp}}
            if "error" in doc:
                row["error"] = doc["error"]
            else:
                row.update(step_ms=doc["step_ms"], world_size=doc["world_size"], backend=doc["backend"],
                           losses_rank0=doc["losses_rank0"],
                           tokens_per_s=opts.tokens * doc["world_size"] / doc["step_ms"]["median"] * 1e3)
            rows.append(row)
        ok = {r["name"]: r for r in rows if "step_ms" in r}
        config = {"model": opts.preset, "num_layers": opts.layers, "tokens_per_rank": opts.tokens,
                  "world_size": world, "steps": opts.steps, "warmup": opts.warmup}
        result = make_result("distributed", config, rows, device,
                             "all fast (packed attention, offload x2, fused loss) per rank on its own packed row; each "
                             "step ends at the slowest rank (barrier); the world size each run saw is in its row")
        derived = derive(ok, world)
        result["derived"] = derived
        write_json(result, os.path.join(out_dir, f"distributed-{opts.preset}-w{world}.json"))
        print(format_table(result))
        if derived:
            print("  " + format_derived(derived))
        return [result]


def derive(ok: dict[str, dict], world: int) -> dict:
    """DDP's cost at world 1 and at world N against one process, and whether DDP at world 1 trains as the plain model.

    The first step runs the same weights on the same row: its loss must be bitwise the plain run's on any device.
    Later steps follow weights updated from gradients that a GPU's kernels may sum in a different order each run
    (atomics in attention's and the NF4 matmuls' backward), so there the losses agree to rounding, not bitwise; the
    largest relative difference over the steps is reported (a CPU run is deterministic: 0).
    """
    derived: dict = {}
    plain, one = ok.get("one process, no DDP"), ok.get("DDP, world 1 (torchrun)")
    if plain and one:
        derived["ddp_overhead_world_1"] = one["step_ms"]["median"] / plain["step_ms"]["median"] - 1
        a, b = plain["losses_rank0"], one["losses_rank0"]
        if a and len(a) == len(b):
            derived["same_first_loss_world_1"] = a[0] == b[0]
            derived["loss_max_rel_diff_world_1"] = max(abs(x - y) / abs(x) for x, y in zip(a, b))
    many = ok.get(f"DDP, world {world}") if world > 1 else None
    if many and plain:
        derived[f"rank_step_overhead_world_{world}"] = many["step_ms"]["median"] / plain["step_ms"]["median"] - 1
    return derived


__all__ = ["DistributedScenario", "DistributedOptions", "derive"]
