"""Benchmark of optimization 2: offloaded checkpointing (1 buffer, 2 buffers, 2 + prefetch) and its baselines.

GPU default (about 3 min on an H200): Qwen3-14B width, 10 layers, NF4 + LoRA r16, sdpa; rows of 8192 tokens; warm-up
2, 5 measured steps; 8k: every variant (incl. no checkpointing and x2 without prefetch); 16k: standard,
transformers offload, save_on_cpu(step), x1, x2 + prefetch; 32k: standard, x1, x2 + prefetch; one extra traced
step per offload mode for the copy/compute timeline; host syncs counted at 8k only. Smoke (CPU): tiny-qwen3,
seconds; a CPU has no streams, so its timings say nothing about overlap.

The baselines: standard checkpointing (transformers, non-reentrant), no checkpointing, transformers'
``offload=True`` (``save_on_cpu`` inside each layer's checkpoint), ``torch.autograd.graph.save_on_cpu`` around the
whole step, and a single-buffer design that also serialises the forward copies (:class:`SerialForwardCopies`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Sequence

import torch
from torch import nn

from ..._compat import empty_host_cache
from ..._util import pow2_ceil
from ...data import benchmark_batches
from ...models import LoraSettings, build_model, get_preset
from ...structure import base_model, model_device
from ...offload import CheckpointingSwitch, OffloadSettings, PinnedPool, StreamOps, offload_manager
from ...offload.pool import host_memory_available
from ...toggles import apply
from ..harness import Variant, format_derived, format_table, make_result, run_variants, write_json
from ..plots import plot_offload_result, plot_sweep, plot_timelines, save_figure
from ..scenario import OptionError, Scenario, option
from ..timelines import copy_overlap


class SerialForwardCopies(StreamOps):
    """The forward device->host copies on the compute stream: models a design that serialises every copy."""

    d2h_stream = "compute"


VARIANT_KEYS = ("standard", "none", "hf_offload", "save_on_cpu", "offload1", "offload1_serial", "offload2",
                "offload2p")
_OFFLOAD_MODES = {"offload1": (1, False, False), "offload1_serial": (1, False, True), "offload2": (2, False, False),
                  "offload2p": (2, True, False)}


class _SaveOnCpuStep:
    """Standard checkpointing with the whole forward under ``save_on_cpu(pin_memory=True)`` (the issue's peer)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.switch = CheckpointingSwitch(model)
        self.device = device
        self.ctx: Any = None

    def enable(self, model: nn.Module) -> None:
        self.switch.enable()
        ctx = torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda", device_type=self.device.type)
        ctx.__enter__()
        self.ctx = ctx

    def disable(self, model: nn.Module) -> None:
        if self.ctx is not None:
            self.ctx.__exit__(None, None, None)
            self.ctx = None
        self.switch.disable()


class _OffloadToggle:
    """enable/disable of one offload mode for the harness; keeps the manager's memory figures and its counters
    (copies, bytes copied, prefetch hits) of the last step it was on for."""

    def __init__(self, buffers: int, prefetch: bool, serial: bool, pool: PinnedPool | None = None):
        self.buffers, self.prefetch, self.serial = buffers, prefetch, serial
        self.pool = pool if pool is not None else PinnedPool(pin=torch.cuda.is_available())
        self.last_memory: dict = {}
        self.last_stats: dict = {}
        self._stats_before: dict = {}

    def enable(self, model: nn.Module) -> None:
        streams = SerialForwardCopies(model_device(model)) if self.serial else None
        # the offload switch with its seams: serialised copies, and a pinned pool every mode shares across steps
        apply(model, offload_buffers=OffloadSettings(self.buffers, self.prefetch, streams=streams, pool=self.pool))
        manager = offload_manager(model)
        self._stats_before = manager.stats.as_dict() if manager is not None else {}

    def disable(self, model: nn.Module) -> None:
        manager = offload_manager(model)
        if manager is not None:
            mem = manager.memory()
            if mem["staging_bytes"]:
                self.last_memory = mem
            now = manager.stats.as_dict()
            self.last_stats = {k: v - self._stats_before.get(k, 0) for k, v in now.items()}
        apply(model, offload_buffers="off")


def release_pools(toggles: dict) -> None:
    """Let the pinned pool of :func:`make_variants`' offload modes go (nothing may be pending)."""
    for pool in {id(t.pool): t.pool for t in toggles.values() if isinstance(t, _OffloadToggle)}.values():
        pool.clear()


def make_variants(model: nn.Module, keys: Sequence[str] = VARIANT_KEYS, device: torch.device | None = None):
    """Harness variants for offloaded checkpointing and its baselines, each with a note of what it is and costs.

    Returns ``(variants, toggles)`` where ``toggles[name]`` is the enable/disable object (offload modes expose
    ``last_memory``; they share one pinned pool, across steps: :func:`release_pools` lets it go).
    """
    device = device or model_device(model)
    pool = PinnedPool(pin=device.type == "cuda")
    out, objs = [], {}
    for key in keys:
        sw: Any
        if key == "standard":
            sw = CheckpointingSwitch(model)
            v = Variant(
                "checkpointing (standard)", {"checkpointing": "standard", "offload_buffers": 0, "prefetch": False},
                enable=sw.enable, disable=sw.disable,
                note="transformers gradient_checkpointing_enable(use_reentrant=False): each layer's input stays on "
                     "the GPU (layers x tokens x hidden x 2 bytes), the layer is recomputed in backward (about one "
                     "extra forward per step). The baseline every offload mode is compared against.")
        elif key == "none":
            sw = None
            v = Variant(
                "no checkpointing", {"checkpointing": "none", "offload_buffers": 0, "prefetch": False},
                note="stock transformers, every activation kept on the GPU: the reference no optimization touches; "
                     "no recompute (fastest when it fits), the most memory.")
        elif key == "hf_offload":
            sw = CheckpointingSwitch(model, offload=True)
            v = Variant(
                "transformers offload=True", {"checkpointing": "hf_offload", "offload_buffers": 0, "prefetch": False},
                enable=sw.enable, disable=sw.disable,
                note="transformers 5.17 gradient_checkpointing_enable(offload=True): each layer's torch checkpoint "
                     "runs inside torch.autograd.graph.save_on_cpu(pin_memory=True), so what checkpoint saves (the "
                     "layer input) goes to a freshly allocated pinned tensor (PyTorch's caching host allocator) by a "
                     "copy on the compute stream, and comes back by .to(device, non_blocking=True) on the compute "
                     "stream when the recompute asks for it: no copy overlaps compute (its docstring: 'the step gets "
                     "slower'). On a CPU-only machine it raises (pin_memory=True without an accelerator).")
        elif key == "save_on_cpu":
            sw = _SaveOnCpuStep(model, device)
            v = Variant(
                "save_on_cpu(step) + ckpt", {"checkpointing": "save_on_cpu_step", "offload_buffers": 0,
                                             "prefetch": False},
                enable=sw.enable, disable=sw.disable,
                note="standard checkpointing with the whole forward inside torch.autograd.graph.save_on_cpu("
                     "pin_memory=True) (the issue's measurement): besides the layer inputs, every tensor autograd "
                     "saves outside the checkpointed layers goes to pinned host memory and back on the compute "
                     "stream: the float32 log-softmax of the logits, packed twice because log_softmax and nll_loss both "
                     "save it (2 x tokens x vocab x 4 bytes: 40 GB at 32k tokens with Qwen3's 152k vocabulary, before "
                     "the pinned allocator's power-of-two rounding), the LM head weight, the final norm's inputs. "
                     "Host memory grows with tokens x vocab.")
        elif key in _OFFLOAD_MODES:
            buffers, prefetch, serial = _OFFLOAD_MODES[key]
            sw = _OffloadToggle(buffers, prefetch, serial, pool)
            name = {"offload1": "offload x1 (single buffer)", "offload1_serial": "offload x1, serial fwd copies",
                    "offload2": "offload x2 (double buffer)", "offload2p": "offload x2 + prefetch"}[key]
            what = {
                "offload1": "ONE GPU staging buffer: the reload of layer k-1 waits for layer k's backward to finish "
                            "with the buffer, so copy and compute take turns (the 'before').",
                "offload1_serial": "one staging buffer AND the forward copies on the compute stream: a design that "
                                   "serialises every copy (models the published 'before').",
                "offload2": "TWO staging buffers (slot = layer parity, free/ready event per slot): the reload of "
                            "layer k-1 overlaps layer k's backward; issued when autograd reaches layer k-1.",
                "offload2p": "TWO staging buffers + prefetch: the reload of layer k-1 is issued as soon as layer k's "
                             "backward starts, before its kernels.",
            }[key]
            v = Variant(
                name, {"checkpointing": "offload", "offload_buffers": buffers, "prefetch": prefetch,
                       "serial_forward_copies": serial},
                enable=sw.enable, disable=sw.disable,
                note=f"fastsft_lab.offload: {what} Layer inputs go to a pinned pool reused across steps on a copy "
                     "stream (compute not blocked); only each staging buffer (tokens x hidden x 2 bytes) stays on "
                     "the GPU.")
        else:
            raise ValueError(f"unknown variant {key!r}; known: {', '.join(VARIANT_KEYS)}")
        out.append(v)
        objs[v.name] = sw
    return out, objs


def estimate_host_bytes(key: str, *, num_layers: int, tokens: int, hidden: int, vocab: int,
                        dtype_bytes: int = 2) -> int:
    """Pinned host bytes a variant needs for one step (caching-allocator power-of-two rounding included)."""
    layer_inputs = num_layers * pow2_ceil(tokens * hidden * dtype_bytes)
    if key in _OFFLOAD_MODES or key == "hf_offload":
        return layer_inputs
    if key == "save_on_cpu":
        # the float32 log-softmax of the logits, packed twice (saved by log_softmax and by nll_loss), the LM head
        # weight, the final norm's float32 inputs (pow, mul) and the LM head input
        return (layer_inputs + 2 * pow2_ceil(tokens * vocab * 4) + pow2_ceil(vocab * hidden * dtype_bytes)
                + 3 * pow2_ceil(tokens * hidden * 4) + pow2_ceil(tokens * hidden * dtype_bytes))
    return 0


def _empty_host_cache() -> None:
    try:
        empty_host_cache()
    except Exception:  # noqa: BLE001 - best effort
        pass


def measure_bandwidth(device: torch.device | str, nbytes: int = 256 << 20, reps: int = 5) -> dict:
    """Pinned host<->device copy bandwidth (GB/s) with CUDA events; on a CPU, a plain memcpy (labelled so)."""
    device = torch.device(device)
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        out = {"bytes": nbytes, "reps": reps, "method": "pinned copies, CUDA events, current stream"}
        for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            dst.copy_(src, non_blocking=True)   # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            out[f"{name}_gbps"] = round(nbytes * reps / (start.elapsed_time(end) / 1e3) / 1e9, 2)
        del host, dev
        return out
    nbytes = min(nbytes, 64 << 20)
    a = torch.empty(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    t = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    gbps = round(nbytes * reps / (time.perf_counter() - t) / 1e9, 2)
    return {"bytes": nbytes, "reps": reps, "method": "CPU memcpy (no host-device link on this machine)",
            "h2d_gbps": gbps, "d2h_gbps": gbps}


def trace_step(model: nn.Module, batch, variant, *, optimizer=None) -> list[dict]:
    """One untimed forward+backward of an offload variant with copy/compute intervals recorded."""
    variant.enable(model)
    try:
        manager = offload_manager(model)
        if manager is None:
            raise ValueError(f"variant {variant.name!r} does not enable offloaded checkpointing")
        with manager.tracing() as trace:
            out = model(**variant.inputs(batch, None))
            out.loss.backward()
        events = trace.events()
    finally:
        variant.disable(model)
        model.zero_grad(set_to_none=True)
    return events


def vram_saved_estimate(num_layers: int, tokens: int, hidden: int, dtype_bytes: int, staging: int) -> dict:
    """GPU bytes of layer inputs that checkpointing keeps and offloading frees (minus its staging buffers)."""
    per_layer = tokens * hidden * dtype_bytes
    return {"layers": num_layers, "layer_input_bytes": per_layer,
            "checkpoint_inputs_bytes": num_layers * per_layer,
            "offload2_staging_bytes": staging, "net_saved_bytes": num_layers * per_layer - staging}


def gain(slow: float | None, fast: float | None) -> float | None:
    """``slow / fast - 1`` (how much faster ``fast`` is), rounded; None when either time is missing."""
    return round(slow / fast - 1, 4) if slow and fast else None


def derived(rows: list[dict], device: torch.device | None = None) -> dict:
    by = {r["name"]: r for r in rows}

    def step(name):
        r = by.get(name)
        return r["step_ms"]["median"] if r and "step_ms" in r else None

    def peak(name):
        r = by.get(name)
        return r.get("peak_mem_bytes") if r else None

    std, x1, x2p = step("checkpointing (standard)"), step("offload x1 (single buffer)"), step("offload x2 + prefetch")
    x2, soc = step("offload x2 (double buffer)"), step("save_on_cpu(step) + ckpt")
    hf = step("transformers offload=True")
    d: dict[str, Any] = {k: v for k, v in (("double_prefetch_vs_single_gain", gain(x1, x2p)),
                                           ("double_vs_single_gain", gain(x1, x2)),
                                           ("offload2p_vs_standard_overhead", gain(x2p, std))) if v is not None}
    if std and x2p:
        d["target_within_3pct_of_standard"] = x2p <= std * 1.03
    if soc and x2p:
        d["offload2p_speedup_vs_save_on_cpu_step"] = round(soc / x2p, 3)
        d["target_1p5x_vs_save_on_cpu"] = soc / x2p >= 1.5
    if hf and x2p:
        d["offload2p_speedup_vs_transformers_offload"] = round(hf / x2p, 3)
    if peak("checkpointing (standard)") and peak("offload x2 + prefetch"):
        d["peak_saved_vs_standard_bytes"] = peak("checkpointing (standard)") - peak("offload x2 + prefetch")
        d["target_peak_below_standard"] = d["peak_saved_vs_standard_bytes"] > 0
    second = by.get("offload x2 + prefetch", {}).get("offload_memory", {}).get("staging_bytes_per_buffer")
    if second:
        d["second_buffer_bytes"] = second
        d["target_second_buffer_le_0p5GB"] = second <= 0.5e9
    if device is not None and device.type != "cuda":
        # a CPU run has no streams and no GPU memory: the targets are not evaluated there
        d = {k: v for k, v in d.items() if not k.startswith("target_")}
        d["note"] = "CPU smoke run: targets are evaluated on a GPU only"
    return d


def _run_config(model, device, *, cfg: dict, tokens: int, keys: Sequence[str], steps: int, warmup: int,
                progress: bool, count_syncs: bool, traced: Sequence[str], host_fraction: float) -> tuple[dict, dict]:
    mcfg = base_model(model).config
    hidden, vocab, layers = mcfg.hidden_size, mcfg.vocab_size, mcfg.num_hidden_layers
    row = min(cfg["row_tokens"], tokens)
    batches = benchmark_batches(tokens_per_step=tokens, row_tokens=row, steps=max(2, min(steps, 4)),
                                vocab_size=vocab, mix=cfg["mix"])
    batches = [b.to(device) for b in batches]
    dtype_bytes = torch.finfo(cfg["dtype"]).bits // 8
    avail = host_memory_available() if device.type == "cuda" else None
    run_keys, skipped = [], []
    for key in keys:
        need = estimate_host_bytes(key, num_layers=layers, tokens=tokens, hidden=hidden, vocab=vocab,
                                   dtype_bytes=dtype_bytes)
        if device.type == "cpu" and key == "hf_offload":
            skipped.append((key, need, "transformers 5.17 offload=True raises on a CPU-only machine "
                                       "(save_on_cpu(pin_memory=True) without an accelerator); GPU runs only"))
        elif avail is not None and need > host_fraction * avail:
            skipped.append((key, need, f"host-memory guard: needs about {need / 2**30:.1f} GiB pinned, more than "
                                       f"{host_fraction:.0%} of the {avail / 2**30:.1f} GiB available"))
        else:
            run_keys.append(key)
    variants, toggles = make_variants(model, run_keys, device)
    rows = run_variants(model, batches, variants, steps=steps, warmup=warmup, count_syncs=count_syncs,
                        progress=progress, label=f"offload {tokens} tok")
    timelines: dict[str, list] = {}
    for v, r in zip(variants, rows):
        key = run_keys[variants.index(v)]
        r["host_bytes_estimate"] = estimate_host_bytes(key, num_layers=layers, tokens=tokens, hidden=hidden,
                                                       vocab=vocab, dtype_bytes=dtype_bytes)
        obj = toggles[v.name]
        if isinstance(obj, _OffloadToggle):
            r["offload_memory"] = obj.last_memory
            r["offload_stats_last_step"] = obj.last_stats
            if key in traced and "error" not in r:
                events = trace_step(model, batches[0], v)
                timelines[v.name] = events
                r["copy_overlap"] = copy_overlap(events)
    for key, need, reason in skipped:
        name = make_variants(model, [key], device)[0][0].name
        rows.append({"name": name, "toggles": {"checkpointing": key}, "error": f"skipped: {reason}",
                     "skipped": True, "host_bytes_estimate": need})
    staging = next((r.get("offload_memory", {}).get("staging_bytes") for r in rows
                    if r["name"] == "offload x2 + prefetch" and r.get("offload_memory")), 0) or 0
    config = {"model": cfg["preset"], "num_layers": layers, "hidden_size": hidden, "vocab_size": vocab,
              "quant": cfg["quant"], "lora_rank": cfg["lora_rank"], "attn_implementation": cfg["attn"],
              "dtype": str(cfg["dtype"]).replace("torch.", ""), "tokens_per_step": tokens, "row_tokens": row,
              "rows": tokens // row, "steps": steps, "warmup": warmup, "length_mix": cfg["mix"],
              "layer_input_bytes": tokens * hidden * dtype_bytes, "host_memory_available_bytes": avail,
              "vram_saved_estimate_at_40_layers": vram_saved_estimate(40, tokens, hidden, dtype_bytes, staging),
              "bandwidth": cfg.get("bandwidth"), "cpu_threads": cfg.get("cpu_threads")}
    notes = ("Variants interleaved step by step on the same batches; first row (standard checkpointing) is 1.00x. "
             "copy_overlap: from CUDA events recorded on the copy and compute streams in one extra traced step "
             "(fastsft_lab.timeline.copy_overlap). Peak memory: torch.cuda.max_memory_allocated per step.")
    if device.type == "cpu":
        notes += " CPU smoke run: no streams, every copy is synchronous: timings say nothing about overlap."
    result = make_result("offload", config, rows, device, notes)
    result["derived"] = derived(rows, device)
    timeline_doc = {"scenario": "offload_timeline", "env": result["env"], "config": config, "timelines": timelines,
                    "overlap": {k: r.get("copy_overlap") for k, r in ((r["name"], r) for r in rows)
                                if r.get("copy_overlap")}}
    return result, timeline_doc


def _run_sweep(device, *, cfg: dict, out_dir: str, steps: int, warmup: int, progress: bool) -> dict:
    """Where does the second buffer matter? Widths x tokens at reduced depth; gain of x2+prefetch over x1."""
    keys = ("standard", "offload1", "offload1_serial", "offload2p")
    rows: list[dict] = []
    points: list[dict] = []
    for preset in cfg["sweep_presets"]:
        model = build_model(preset, device=device, dtype=cfg["dtype"], quant=cfg["quant"],
                            lora=LoraSettings(rank=cfg["lora_rank"]), num_layers=cfg["sweep_layers"],
                            attn_implementation=cfg["attn"])
        mcfg = base_model(model).config
        for tokens in cfg["sweep_tokens"]:
            row = min(cfg["sweep_row_tokens"], tokens)
            batches = [b.to(device) for b in benchmark_batches(tokens_per_step=tokens, row_tokens=row, steps=2,
                                                               vocab_size=mcfg.vocab_size, mix=cfg["mix"])]
            variants, _ = make_variants(model, keys, device)
            res = run_variants(model, batches, variants, steps=steps, warmup=warmup, count_syncs=False,
                               progress=progress, label=f"sweep {preset} {tokens}")
            point = {"preset": preset, "hidden_size": mcfg.hidden_size, "tokens": tokens, "row_tokens": row,
                     "num_layers": mcfg.num_hidden_layers}
            for v, r in zip(variants, res):
                r = dict(r)
                r["name"] = f"{preset} {tokens}: {v.name}"
                r["sweep_point"] = dict(point)
                if v.name in ("offload x1 (single buffer)", "offload x2 + prefetch") and "error" not in r:
                    ov = copy_overlap(trace_step(model, batches[0], v))
                    r["copy_overlap"] = ov
                    if v.name == "offload x2 + prefetch":
                        # copy/compute ratio in backward: total reload time / total layer recompute+backward time
                        point["h2d_ms_total"] = ov["h2d_ms"]
                        point["bwd_ms_total"] = ov["bwd_ms"]
                        if ov["bwd_ms"] > 0:
                            point["copy_to_backward_ratio"] = round(ov["h2d_ms"] / ov["bwd_ms"], 4)
                rows.append(r)
            by = {r["name"].split(": ", 1)[1]: r for r in rows if r.get("sweep_point", {}).get("preset") == preset
                  and r["sweep_point"]["tokens"] == tokens}

            def ms(n):
                return by.get(n, {}).get("step_ms", {}).get("median")
            x1, x1s, x2p, std = (ms("offload x1 (single buffer)"), ms("offload x1, serial fwd copies"),
                                 ms("offload x2 + prefetch"), ms("checkpointing (standard)"))
            for key, value in (("gain_x2p_vs_x1", gain(x1, x2p)), ("gain_x2p_vs_x1_serial", gain(x1s, x2p)),
                               ("x2p_vs_standard", gain(x2p, std))):
                if value is not None:
                    point[key] = value
            points.append(point)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    config = {"model": "sweep", "presets": list(cfg["sweep_presets"]), "tokens": list(cfg["sweep_tokens"]),
              "row_tokens": cfg["sweep_row_tokens"], "num_layers": cfg["sweep_layers"], "steps": steps,
              "warmup": warmup, "quant": cfg["quant"], "lora_rank": cfg["lora_rank"]}
    result = make_result("offload_sweep", config, rows, device,
                         "Regime sweep: the second buffer hides the reloads, so its gain over one buffer grows with "
                         "the copy-to-compute ratio (narrower layers, shorter rows, slower links).")
    result["points"] = points
    return result


def _run_vram_check(device, *, cfg: dict, out_dir: str, layers: int, tokens: int, progress: bool) -> dict:
    """Peak memory of standard checkpointing vs offload x2 + prefetch at full depth (e.g. all 40 layers)."""
    model = build_model(cfg["preset"], device=device, dtype=cfg["dtype"], quant=cfg["quant"],
                        lora=LoraSettings(rank=cfg["lora_rank"]) if cfg["lora_rank"] else None,
                        num_layers=layers, attn_implementation=cfg["attn"])
    mcfg = base_model(model).config
    row = min(cfg["row_tokens"], tokens)
    batches = [b.to(device) for b in benchmark_batches(tokens_per_step=tokens, row_tokens=row, steps=1,
                                                       vocab_size=mcfg.vocab_size, mix=cfg["mix"])]
    variants, toggles = make_variants(model, ("standard", "offload2p"), device)
    rows = run_variants(model, batches, variants, steps=1, warmup=1, count_syncs=False, progress=progress,
                        label=f"vram {layers} layers")
    for v, r in zip(variants, rows):
        if isinstance(toggles[v.name], _OffloadToggle):
            r["offload_memory"] = toggles[v.name].last_memory
    dtype_bytes = torch.finfo(cfg["dtype"]).bits // 8
    config = {"model": cfg["preset"], "num_layers": layers, "tokens_per_step": tokens, "row_tokens": row,
              "quant": cfg["quant"], "lora_rank": cfg["lora_rank"], "steps": 1, "warmup": 1,
              "vram_saved_estimate": vram_saved_estimate(layers, tokens, mcfg.hidden_size, dtype_bytes, 0)}
    result = make_result("offload_vram", config, rows, device,
                         "Peak memory at full depth: one warm-up and one measured step per variant.")
    peaks = [r.get("peak_mem_bytes") for r in rows]
    if all(peaks):
        result["derived"] = {"peak_saved_bytes": int(peaks[0] or 0) - int(peaks[1] or 0)}
    write_json(result, os.path.join(out_dir, f"offload-vram-{cfg['preset']}-{layers}L-{tokens}.json"))
    print(format_table(result))
    release_pools(toggles)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def results_table(results: Sequence[dict]) -> str:
    """Step time, speed against standard checkpointing (higher is better) and peak memory of every variant, one
    column per token count."""
    if not results:
        return "(no results)"
    names: list[str] = []
    for r in results:
        for v in r["variants"]:
            if v["name"] not in names:
                names.append(v["name"])
    cols = [r["config"]["tokens_per_step"] for r in results]
    head = f"{'variant':32s}" + "".join(f"{str(t) + ' tokens':>30s}" for t in cols)
    lines = [head, "-" * len(head)]
    for n in names:
        cells = []
        for r in results:
            by = {v["name"]: v for v in r["variants"]}
            v = by.get(n)
            std = by.get("checkpointing (standard)", {}).get("step_ms", {}).get("median")
            if v is None:
                cells.append("-")
            elif "step_ms" not in v:
                cells.append("skipped" if v.get("skipped") else "error")
            else:
                ms = v["step_ms"]["median"]
                peak = v.get("peak_mem_bytes")
                ratio = f" {std / ms:.2f}x" if std else ""
                cells.append(f"{ms:7.0f} ms{ratio} {peak / 2**30:5.1f} GiB" if peak else f"{ms:7.1f} ms{ratio}")
        lines.append(f"{n:32s}" + "".join(f"{c:>30s}" for c in cells))
    return "\n".join(lines)


def _plan(smoke: bool) -> dict:
    if smoke:
        return {256: ("standard", "none", "hf_offload", "save_on_cpu", "offload1", "offload2", "offload2p")}
    return {8192: ("standard", "none", "hf_offload", "save_on_cpu", "offload1", "offload2", "offload2p"),
            16384: ("standard", "hf_offload", "save_on_cpu", "offload1", "offload2p")}


@dataclasses.dataclass
class OffloadOptions:
    preset: str = option("qwen3-14b", kind="str", help="model preset")
    num_layers: int | None = option(10, kind="int?", help="decoder layers kept at real width (none: all)")
    quant: str | None = option("nf4", kind="str?", help="nf4 (QLoRA) or none")
    lora_rank: int = option(16, kind="int", help="LoRA rank (0: full fine-tuning)")
    attn: str = option("sdpa", kind="str", help="transformers attention implementation")
    dtype: str = option("bfloat16", kind="str", help="compute dtype")
    tokens: list = option([8192, 16384, 32768], kind="ints", help="tokens per step (one configuration each)")
    row_tokens: int = option(8192, kind="int", help="tokens per packed row")
    mix: str = option("realistic", kind="str", help="length mix")
    variants: list | None = option(None, kind="strs", help=f"variant keys for every token count, from: "
                                                             f"{', '.join(VARIANT_KEYS)} (default: a plan per count)")
    full_plan: list = option(["standard", "offload1", "offload2p"], kind="strs",
                             help="variant keys for token counts without a planned list")
    traced: list = option(["offload1", "offload2", "offload2p"], kind="strs",
                          help="variants that get one extra traced step (copy/compute timeline)")
    host_fraction: float = option(0.5, kind="float", help="share of the available host memory a variant may pin")
    count_syncs: bool | None = option(None, kind="any", help="count host syncs (default: first token count only)")
    sweep: bool = option(False, kind="bool", help="also the regime sweep (widths x tokens at reduced depth)")
    sweep_only: bool = option(False, kind="bool", help="only the regime sweep")
    sweep_presets: list = option(["qwen3-0.6b", "qwen3-14b"], kind="strs", help="presets of the sweep")
    sweep_tokens: list = option([4096, 16384], kind="ints", help="tokens per step of the sweep")
    sweep_row_tokens: int = option(2048, kind="int", help="row tokens of the sweep")
    sweep_layers: int = option(4, kind="int", help="decoder layers of the sweep models")
    sweep_steps: int = option(4, kind="int", help="measured steps of the sweep")
    vram_layers: int | None = option(None, kind="int?", help="also peak memory of standard vs offload x2 + "
                                                           "prefetch at this depth (e.g. 40), one step each")
    vram_tokens: int = option(16384, kind="int", help="tokens per step of the VRAM check")
    steps: int = option(5, kind="int", help="measured steps per variant")
    warmup: int = option(2, kind="int", help="warm-up steps per variant")
    _plan: dict = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def defaults(cls, device: torch.device, smoke: bool) -> "OffloadOptions":
        if smoke:
            return cls(preset="tiny-qwen3", num_layers=None, quant="nf4", lora_rank=8,
                       dtype="float32" if device.type == "cpu" else "bfloat16", tokens=[256, 512], row_tokens=256,
                       mix="short", traced=["offload1", "offload2p"], full_plan=["standard", "offload1", "offload2",
                                                                                  "offload2p"],
                       sweep_presets=["tiny-qwen3"], sweep_tokens=[256, 512], sweep_row_tokens=128, sweep_layers=3,
                       sweep_steps=2, vram_tokens=256, steps=5, warmup=2, _plan=_plan(True))
        return cls(_plan=_plan(False))


class OffloadScenario(Scenario):
    name = "offload"
    title = "double-buffered offloaded checkpointing (optimization 2)"
    Options = OffloadOptions

    def validate(self, opts: OffloadOptions, device: torch.device) -> None:
        super().validate(opts, device)
        get_preset(opts.preset)
        for p in opts.sweep_presets:
            get_preset(p)
        for key in (opts.variants or []) + opts.full_plan + opts.traced:
            if key not in VARIANT_KEYS:
                raise OptionError(f"unknown offload variant {key!r}; known: {', '.join(VARIANT_KEYS)}")
        if opts.quant not in (None, "nf4", "none"):
            raise OptionError(f"quant must be nf4 or none, got {opts.quant!r}")
        if opts.dtype not in ("bfloat16", "float16", "float32"):
            raise OptionError(f"dtype must be bfloat16, float16 or float32, got {opts.dtype!r}")

    def run(self, opts: OffloadOptions, *, device: torch.device, out_dir: str, progress: bool = True) -> list[dict]:
        cfg: dict[str, Any] = dataclasses.asdict(opts)
        cfg["quant"] = None if opts.quant in (None, "none") else opts.quant
        cfg["dtype"] = getattr(torch, opts.dtype)
        cfg["plan"] = {t: tuple(opts.variants) for t in opts.tokens} if opts.variants else dict(opts._plan)
        cfg["full_plan"] = tuple(opts.full_plan)
        cfg["traced"] = tuple(opts.traced)
        return _bench(device, cfg, out_dir, opts.steps, opts.warmup, progress, opts.sweep, opts.sweep_only,
                      opts.host_fraction, opts.count_syncs, opts.vram_layers, opts.vram_tokens)


def _bench(device, cfg, out_dir, steps, warmup, progress, sweep, sweep_only, host_fraction, count_syncs_opt,
           vram_layers=None, vram_tokens=16384) -> list[dict]:
    bandwidth = measure_bandwidth(device)
    cfg["bandwidth"] = bandwidth
    cfg["cpu_threads"] = torch.get_num_threads() if device.type == "cpu" else None
    print(f"  host<->device copies: {bandwidth['h2d_gbps']} GB/s H2D, {bandwidth['d2h_gbps']} GB/s D2H "
          f"({bandwidth['method']})")
    results: list[dict] = []
    if not sweep_only:
        model = build_model(cfg["preset"], device=device, dtype=cfg["dtype"], quant=cfg["quant"],
                            lora=LoraSettings(rank=cfg["lora_rank"]) if cfg["lora_rank"] else None,
                            num_layers=cfg["num_layers"], attn_implementation=cfg["attn"])
        for i, tokens in enumerate(cfg["tokens"]):
            keys = cfg["plan"].get(tokens, cfg["full_plan"])
            count = bool(count_syncs_opt) if count_syncs_opt is not None else (i == 0)
            result, tl = _run_config(model, device, cfg=cfg, tokens=tokens, keys=keys, steps=steps, warmup=warmup,
                                     progress=progress, count_syncs=count, traced=cfg["traced"],
                                     host_fraction=host_fraction)
            tag = f"{cfg['preset']}-{tokens}"
            result["files"] = {"json": write_json(result, os.path.join(out_dir, f"offload-{tag}.json")),
                               "png": save_figure(plot_offload_result(result),
                                                  os.path.join(out_dir, f"offload-{tag}.png"))}
            if tl["timelines"]:
                write_json(tl, os.path.join(out_dir, f"offload-timeline-{tag}.json"))
                where = "CUDA events" if device.type == "cuda" else "CPU, synchronous: no overlap possible"
                save_figure(plot_timelines(tl["timelines"], suptitle=f"measured one step, {tokens} tokens ({where})"),
                            os.path.join(out_dir, f"offload-timeline-{tag}.png"))
            print(format_table(result))
            if result["derived"]:
                print("  " + format_derived(result["derived"]))
            results.append(result)
            # release pinned memory between token counts (our pool went with its variants; the peers' cached
            # pinned blocks)
            _empty_host_cache()
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if vram_layers:
        results.append(_run_vram_check(device, cfg=cfg, out_dir=out_dir, layers=int(vram_layers),
                                       tokens=int(vram_tokens), progress=progress))
    if sweep or sweep_only:
        sres = _run_sweep(device, cfg=cfg, out_dir=out_dir, steps=cfg["sweep_steps"], warmup=1, progress=progress)
        sres["files"] = {"json": write_json(sres, os.path.join(out_dir, "offload-sweep.json")),
                         "png": save_figure(plot_sweep(sres), os.path.join(out_dir, "offload-sweep.png"))}
        for p in sres["points"]:
            print("  sweep:", json.dumps(p))
        results.append(sres)
    return results


__all__ = ["OffloadScenario", "OffloadOptions", "VARIANT_KEYS", "make_variants", "release_pools", "SerialForwardCopies",
           "measure_bandwidth", "estimate_host_bytes", "trace_step", "vram_saved_estimate",
           "derived", "gain", "results_table"]
