"""One harness for every optimization: the same steps, phases, statistics and JSON for all variants.

A *variant* is a way to run the same model on the same batches (naive, optimized, oracle, peer). Variants are
interleaved step by step (A B C A B C ...) so that clock drift and thermal changes hit all of them alike, and
each is reported with the median and the p20-p80 spread of every phase. A difference smaller than that spread
is not a result.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..data import PackedBatch
from ..env import environment
from ..structure import base_model
from ..packing.metadata import BuildLog
from ..packing.switch import packed_attention_state
from ..profiling import PhaseTimer, SyncCounter, current_memory, peak_memory, percentiles, reset_peak_memory
from .flops import batch_flops, peak_flops, trained_terms


def _noop(model: nn.Module) -> None:
    return None


def default_inputs(batch: PackedBatch, state: Any = None) -> dict:
    return batch.model_inputs()


@dataclass
class Variant:
    """One way of running a step.

    Attributes:
        name: label in tables and charts.
        toggles: the switches this variant sets (recorded in the JSON).
        enable / disable: put the live model into / out of this variant (called around each of its steps).
        prepare: untimed work per step (e.g. the oracle's prebuilt metadata); its result is passed to ``inputs``.
        inputs: timed, inside the forward phase: builds the model's keyword arguments from the batch.
        context: ``(model) -> context manager`` entered around each step's forward and backward (e.g. TRL's
            activation offloading); None: none.
        note: what this variant is faithful to and what it costs (goes into the JSON).
        unequal: why this variant does not compute what the reference computes, where that is known (e.g. a stock
            path that attends across packed sequences): printed under the table when its ``vs ref`` is not bitwise.
    """

    name: str
    toggles: dict = field(default_factory=dict)
    enable: Callable[[nn.Module], None] = _noop
    disable: Callable[[nn.Module], None] = _noop
    prepare: Callable[[PackedBatch], Any] | None = None
    inputs: Callable[[PackedBatch, Any], dict] = default_inputs
    note: str = ""
    context: Callable[[nn.Module], Any] | None = None
    unequal: str = ""


AUTOCAST = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def with_autocast(variants: Sequence[Variant], autocast: str) -> list[Variant]:
    """``variants`` whose forward and backward run under ``torch.autocast(device, dtype)`` (around each variant's own
    context, if any): what ``Trainer``/``SFTTrainer`` with ``bf16=True`` does. Under it PEFT's float32 adapters
    run their matmuls in bf16. ``autocast``: none, bf16 or fp16."""
    if autocast not in AUTOCAST:
        raise ValueError(f"autocast must be one of {', '.join(AUTOCAST)}, got {autocast!r}")
    dtype = AUTOCAST[autocast]
    if dtype is None:
        return list(variants)

    def wrap(inner):
        @contextlib.contextmanager
        def context(model):
            device_type = next(p for p in model.parameters()).device.type
            with torch.autocast(device_type, dtype=dtype):
                with (inner(model) if inner is not None else contextlib.nullcontext()):
                    yield
        return context

    return [dataclasses.replace(v, context=wrap(v.context),
                                toggles=dict(v.toggles, autocast=autocast)) for v in variants]


def _forward_loss(model: nn.Module, kwargs: dict) -> torch.Tensor:
    out = model(**kwargs)
    loss = out.loss if hasattr(out, "loss") else out[0]
    if loss is None:
        raise ValueError("the model returned no loss: pass labels")
    return loss


def run_step(model: nn.Module, batch: PackedBatch, variant: Variant, *, mode: str, optimizer, timer: PhaseTimer,
             state: Any = None, memory: dict | None = None) -> torch.Tensor:
    """One step of ``mode`` ('train': forward+backward+optimizer; 'forward': no-grad forward).

    ``memory`` (a dict), if given, receives ``forward_peak``: the CUDA allocator's peak at the end of the forward
    (a host-side counter: no sync), so a step's peak splits into what the forward keeps and what backward adds."""
    ctx = variant.context(model) if variant.context is not None else contextlib.nullcontext()
    if mode == "train":
        with timer.phase("step"):
            with ctx:
                with timer.phase("forward"):
                    loss = _forward_loss(model, variant.inputs(batch, state))
                if memory is not None:
                    memory["forward_peak"] = peak_memory(loss.device)
                with timer.phase("backward"):
                    loss.backward()
            with timer.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    elif mode == "forward":
        with torch.no_grad(), timer.phase("step"), ctx:
            with timer.phase("forward"):
                loss = _forward_loss(model, variant.inputs(batch, state))
    else:
        raise ValueError(f"mode must be 'train' or 'forward', got {mode!r}")
    return loss.detach()


def make_optimizer(model: nn.Module, lr: float = 1e-6) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (the LoRA adapters under QLoRA). A tiny lr keeps routing stable."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    return torch.optim.AdamW(params, lr=lr)


def run_variants(
    model: nn.Module,
    batches: Sequence[PackedBatch],
    variants: Sequence[Variant],
    *,
    steps: int = 10,
    warmup: int = 2,
    mode: str = "train",
    optimizer: torch.optim.Optimizer | None = None,
    count_syncs: bool = True,
    check_equal: bool | str = True,
    progress: bool = True,
    label: str = "",
    profile: bool = False,
) -> list[dict]:
    """Run every variant ``warmup + steps`` times, interleaved, on the same batches. Returns one dict each.

    ``check_equal``: also one untimed step of each variant at the same weights, its loss and gradients against the
    first variant's, or against the variant it names (:func:`compare_to_first`, in ``equal_to_first``).
    ``profile``: then one more warm step of each variant under the kernel-level profiler (:func:`profile_variant`,
    in ``profile``), after every timed step so that the profiler's cost lands in none of them."""
    if not variants:
        raise ValueError("no variants to run")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    device = batches[0].input_ids.device
    if mode == "train":
        model.train()
        optimizer = optimizer or make_optimizer(model)
    else:
        model.eval()
    timer = PhaseTimer(device)
    samples: dict[str, dict[str, list[float]]] = {v.name: {} for v in variants}
    peaks: dict[str, int] = {v.name: 0 for v in variants}
    resident: dict[str, int] = {v.name: 0 for v in variants}  # allocated before a step: weights, states, caches
    forward_peaks: dict[str, int] = {v.name: 0 for v in variants}
    losses: dict[str, list[float]] = {v.name: [] for v in variants}
    failures: dict[str, str] = {}
    total = (warmup + steps) * len(variants)
    t_start = time.time()
    done = 0
    for s in range(warmup + steps):
        batch = batches[s % len(batches)]
        for v in variants:
            if v.name in failures:
                continue
            try:
                v.enable(model)
                state = v.prepare(batch) if v.prepare else None
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                reset_peak_memory(device)
                before = current_memory(device)
                memory: dict = {}
                loss = run_step(model, batch, v, mode=mode, optimizer=optimizer, timer=timer, state=state,
                                memory=memory)
                times = timer.collect()
                peak = peak_memory(device)
                if peak is not None:
                    peaks[v.name] = max(peaks[v.name], peak)
                    resident[v.name] = max(resident[v.name], before or 0)
                    forward_peaks[v.name] = max(forward_peaks[v.name], memory.get("forward_peak") or 0)
                if s >= warmup:
                    for phase, ms in times.items():
                        samples[v.name].setdefault(phase, []).append(ms)
                    losses[v.name].append(float(loss))
                del state
            except Exception as e:  # noqa: BLE001 - report (OOM, a kernel that fails here), don't crash the others
                kind = "out of memory" if isinstance(e, torch.cuda.OutOfMemoryError) else type(e).__name__
                failures[v.name] = f"{kind}: {(str(e).splitlines() or [''])[0][:300]}"
                print(f"\n  [{label}] variant {v.name!r} failed at step {s}: {failures[v.name]}", file=sys.stderr)
                if os.environ.get("FASTSFT_TRACEBACK"):  # diagnostics: the whole chain, not its first line
                    traceback.print_exc(file=sys.stderr)
                timer._events.clear()
                optimizer.zero_grad(set_to_none=True) if optimizer else None
                gc.collect()
                torch.cuda.empty_cache()
            finally:
                v.disable(model)
            done += 1
            if progress:
                _progress(label, done, total, t_start)
    if progress:
        print(file=sys.stderr)

    results = []
    for v in variants:
        entry: dict[str, Any] = {"name": v.name, "toggles": v.toggles, "note": v.note}
        if v.unequal:
            entry["unequal"] = v.unequal
        if v.name in failures:
            entry["error"] = failures[v.name]
            results.append(entry)
            continue
        for phase in ("forward", "backward", "optimizer", "step"):
            if phase in samples[v.name]:
                entry[f"{phase}_ms"] = percentiles(samples[v.name][phase])
        entry["peak_mem_bytes"] = peaks[v.name] or None
        if peaks[v.name]:  # where the peak comes from: resident before the step, the forward's, the backward's
            entry["resident_mem_bytes"] = resident[v.name]
            if forward_peaks[v.name]:
                entry["forward_peak_mem_bytes"] = forward_peaks[v.name]
        entry["loss_median"] = percentiles(losses[v.name])["median"] if losses[v.name] else None
        results.append(entry)

    add_throughput(results, model, batches, mode=mode)
    if check_equal:
        ok = [(v, e) for v, e in zip(variants, results) if "error" not in e]
        # the reference: the variant named by check_equal (one that computes the exact result), else the first
        ok.sort(key=lambda ve: ve[0].name != check_equal)
        if len(ok) > 1:
            for (_, row), eq in zip(ok, compare_to_first(model, batches[0], [v for v, _ in ok], mode=mode)):
                row["equal_to_first"] = eq
                row["equal_reference"] = ok[0][0].name
    if count_syncs:
        for v, entry in zip(variants, results):
            if "error" in entry:
                continue
            try:
                entry.update(count_step_syncs(model, batches[0], v, mode=mode, optimizer=optimizer))
            except Exception as e:  # noqa: BLE001 - e.g. a higher-order op (flex) the counter's dispatch mode refuses
                entry["host_syncs_error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=True)
    if profile:
        batch = batches[(warmup + steps) % len(batches)]        # the batch the next step would have taken
        for v, entry in zip(variants, results):
            if "error" in entry:
                continue
            try:
                entry["profile"] = profile_variant(model, batch, v, mode=mode, optimizer=optimizer,
                                                   timed_ms=entry["step_ms"]["median"])
                entry["profile"]["syncs"] = entry.get("host_syncs_per_step")
            except Exception as e:  # noqa: BLE001 - evidence beside the measurement: record why it did not run
                entry["profile_error"] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
                if optimizer is not None:
                    optimizer.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return results


def profile_variant(model: nn.Module, batch: PackedBatch, variant: Variant, *, mode: str, optimizer,
                    timed_ms: float | None = None) -> dict:
    """One warm step of ``variant`` -- the step :func:`run_variants` times: forward, backward and optimizer under the
    variant's context (its autocast) -- under the kernel-level profiler (:func:`fastsft_lab.step_profile.profile_step`:
    on a GPU kineto's device activity, each kernel placed by its launching op), as the step's time by what bounds each
    kernel (:mod:`fastsft_lab.roofline`: its op's FLOPs and bytes against the device's peaks) and idle.

    Returns ``{"step_ms", "ms": {compute, memory, latency, unknown, idle}, "launches", ...}``: ``ms`` sums to
    ``step_ms`` (the kernels' union split among them, :meth:`~fastsft_lab.step_profile.StepProfile.by_bound`, plus
    idle). On a GPU idle is re-based on ``timed_ms``, the step timed without the profiler (``idle = timed - busy``, as
    :func:`fastsft_lab.diagnose` does): the profiler slows the host, not the kernels, so the profiled idle holds its
    own overhead (kept in ``profiled_idle_ms``). On a CPU idle is host time outside any op, as profiled."""
    from ..roofline import BOUNDS
    from ..step_profile import profile_step

    device = batch.input_ids.device
    timer = PhaseTimer(device)
    t0 = time.perf_counter()
    variant.enable(model)
    try:
        state = variant.prepare(batch) if variant.prepare else None
        prof = profile_step(lambda: run_step(model, batch, variant, mode=mode, optimizer=optimizer, timer=timer,
                                             state=state), model=model, device=device)
    finally:
        timer._events.clear()
        variant.disable(model)
    bounds = prof.by_bound()
    busy = sum(bounds.get(b, 0.0) for b in BOUNDS)         # the union of the kernels' intervals, split among them
    rebased = device.type == "cuda" and timed_ms is not None
    ms = {b: round(bounds.get(b, 0.0), 3) for b in BOUNDS}
    ms["idle"] = round(max(0.0, timed_ms - busy) if rebased and timed_ms is not None else bounds["idle"], 3)
    return {"step_ms": sum(ms.values()), "ms": ms, "launches": round(prof.launches(), 1),
            "idle_from": "the timed step (idle = timed step - busy)" if rebased else "the profiled step",
            "profiled_step_ms": round(prof.step_ms, 3), "profiled_idle_ms": round(bounds["idle"], 3),
            "activity": prof.activity, "peaks": prof.peaks.source, "seconds": round(time.perf_counter() - t0, 2)}


def add_throughput(rows: list[dict], model: nn.Module, batches: Sequence[PackedBatch], *, mode: str = "train",
                   model_flops: bool = False) -> float | None:
    """Put ``tokens_per_s`` and ``mfu`` beside every measured step time in ``rows``: real tokens per step over the
    median step, and the model FLOPs of the step (:mod:`.flops`: ``6 N T`` + attention for training, a third of it
    for a forward) over the GPU's dense bf16 peak (None where the GPU's peak is not known, e.g. on a CPU).

    ``model_flops``: count the step as this model trains it (:func:`.flops.trained_terms`: a frozen base's weight
    gradients left out, its adapters counted) and set ``mfu`` and ``flops_per_step`` over what the rows had. Returns
    the FLOPs of a step (None where they are not counted)."""
    try:
        config = base_model(model).config
        terms = trained_terms(model) if model_flops else {}
        # each row's padding tail (its last segment when pad_lengths says so) is neither a token nor model FLOPs
        lengths = [[list(row[:-1]) if pad else list(row) for row, pad in zip(b.seq_lengths, b.pad_lengths)]
                   for b in batches]
        tokens = sum(sum(sum(r) for r in sl) for sl in lengths) / len(lengths)
        flops = sum(batch_flops(config, sl, mode, **terms) for sl in lengths) / len(lengths)
    except (AttributeError, TypeError):  # not a decoder LM config the FLOP count knows: no MFU, say nothing false
        return None
    device = batches[0].input_ids.device
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    for r in rows:
        if "step_ms" in r and r["step_ms"].get("median"):
            s = r["step_ms"]["median"] / 1e3
            r.setdefault("tokens_per_s", round(tokens / s, 1))
            put = r.__setitem__ if model_flops else r.setdefault
            put("mfu", round(flops / s / peak, 4) if peak else None)
            put("flops_per_step", flops)
    return flops


def count_step_syncs(model: nn.Module, batch: PackedBatch, variant: Variant, *, mode: str, optimizer) -> dict:
    """Host syncs of one (untimed) step of ``variant``: forward + backward, inside decoder layers, per kind.

    The optimizer step is counted apart (``host_syncs_optimizer``, CUDA only): PyTorch's AdamW keeps its step
    counters on the host, which a CPU run cannot tell from device reads.
    """
    device = batch.input_ids.device
    variant.enable(model)
    try:
        state = variant.prepare(batch) if variant.prepare else None
        counter = SyncCounter.for_decoder_layers(model, device=device, cross_check=device.type == "cuda")
        ctx = variant.context(model) if variant.context is not None else contextlib.nullcontext()
        with counter, ctx, BuildLog() as builds:
            if mode == "train":
                _forward_loss(model, variant.inputs(batch, state)).backward()
            else:
                with torch.no_grad():
                    _forward_loss(model, variant.inputs(batch, state))
        out = {"host_syncs_per_step": counter.total, "host_syncs_in_layers": counter.in_modules,
               "host_syncs_by_kind": dict(counter.by_kind),
               # packed-metadata objects built inside the step (the naive path's per-layer rebuilds, or the
               # cached path's one per batch and window; the collator's host-side builds are outside the step)
               # (None where the variant runs the model's own attention: its masks are not ours to count)
               "metadata_builds_per_step": (sum(builds.naive.values()) + sum(builds.cached.values())
                                            if packed_attention_state(model) is not None else None),
               "metadata_builds_by_kind": {**{f"naive {k}": v for k, v in builds.naive.items()},
                                           **{f"cached {k}": v for k, v in builds.cached.items()}}}
        if counter.cuda_reported is not None:
            # CUDA's own count (torch.cuda.set_sync_debug_mode) of the same forward + backward, and where
            out["cuda_reported_syncs"] = counter.cuda_reported
            out["cuda_sync_sites"] = sorted(set(counter.cuda_messages))[:8]
        if mode == "train":
            opt_counter = SyncCounter(device=device)
            with opt_counter:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            out["host_syncs_optimizer"] = opt_counter.total if device.type == "cuda" else None
    finally:
        variant.disable(model)
    return out


EQUALITY_MAX_GRAD_BYTES = 2 * 2**30     # larger trainable sets are not copied for the check (full fine-tuning)


def compare_to_first(model: nn.Module, batch: PackedBatch, variants: Sequence[Variant], *, mode: str) -> list:
    """One untimed step of every variant at the same weights (no optimizer step): its loss and every trainable
    gradient against the first variant's. Per variant: None for the first (the reference), else
    ``{"bitwise": bool, "loss_rel": float, "grad_rel": float}`` -- the relative difference of the loss and the
    largest of each gradient's ``max|g - g_ref| / max|g_ref|`` -- or ``{"error": ...}`` / ``{"skipped": ...}``."""
    params = [p for p in model.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    if mode == "train" and grad_bytes > EQUALITY_MAX_GRAD_BYTES:
        return [{"skipped": f"{grad_bytes / 2**30:.1f} GiB of gradients"} for _ in variants]
    ref: tuple | None = None
    out: list = []
    for v in variants:
        try:
            v.enable(model)
            state = v.prepare(batch) if v.prepare else None
            ctx = v.context(model) if v.context is not None else contextlib.nullcontext()
            torch.manual_seed(0)
            model.zero_grad(set_to_none=True)
            if mode == "train":
                with ctx:
                    loss = _forward_loss(model, v.inputs(batch, state))
                    loss.backward()
                grads = [p.grad.detach().clone() if p.grad is not None else None for p in params]
                model.zero_grad(set_to_none=True)
            else:
                with torch.no_grad(), ctx:
                    loss = _forward_loss(model, v.inputs(batch, state))
                grads = []
            loss = loss.detach().float()
        except Exception as e:  # noqa: BLE001 - the timing run reports the variant's failure
            out.append({"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"})
            continue
        finally:
            v.disable(model)
        if ref is None:
            ref = (loss, grads)
            out.append(None)
            continue
        loss0, grads0 = ref
        bitwise = torch.equal(loss, loss0) and all(
            (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
            for a, b in zip(grads, grads0))
        grad_rel = 0.0
        for a, b in zip(grads, grads0):
            if a is None or b is None:
                if (a if a is not None else b).abs().max() > 0:
                    grad_rel = float("inf")
                continue
            scale = b.float().abs().max().clamp_min(torch.finfo(torch.float32).tiny)
            grad_rel = max(grad_rel, float((a.float() - b.float()).abs().max() / scale))
        out.append({"bitwise": bitwise, "loss_rel": float((loss - loss0).abs() / loss0.abs().clamp_min(1e-30)),
                    "grad_rel": grad_rel})
    return out


def _fmt_copied(stats: dict | None) -> str:
    """Bytes the offload copied in one step (device->host + host->device), in MiB."""
    if not stats or "bytes_saved" not in stats:
        return "-"
    return f"{(stats['bytes_saved'] + stats['bytes_reloaded']) / 2**20:.2f}"


def _fmt_equal(eq) -> str:
    if eq is None:
        return "ref"
    if "bitwise" not in eq:
        return "-"
    if eq["bitwise"]:
        return "bitwise"
    return f"{max(eq['loss_rel'], eq['grad_rel']):.1e}"


def _progress(label: str, done: int, total: int, t_start: float) -> None:
    """A progress bar redrawn in place on a terminal; into a log or a pipe only the finished bar (no \\r flood)."""
    if done < total and not sys.stderr.isatty():
        return
    elapsed = time.time() - t_start
    eta = elapsed / done * (total - done) if done else 0
    width = 24
    filled = int(width * done / total)
    print(f"\r  {label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} steps, {elapsed:5.0f}s "
          f"(eta {eta:4.0f}s)", end="", file=sys.stderr, flush=True)


# --- Results: JSON and table --------------------------------------------------------------------------------
def make_result(scenario: str, config: dict, variants: list[dict], device, notes: str = "") -> dict:
    return {"scenario": scenario, "env": environment(device), "config": config, "variants": variants,
            "notes": notes}


def write_json(result: dict, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
    return path


def _fmt_ms(stat: dict | None) -> str:
    if not stat or stat.get("n", 0) == 0 or math.isnan(stat["median"]):
        return "-"
    return f"{stat['median']:.1f} [{stat['p20']:.1f}-{stat['p80']:.1f}]"


def format_derived(derived: dict) -> str:
    """A result's derived figures as one readable line: fractions named gain / overhead as signed percents, bytes
    in KiB / MiB / GiB, notes as they are."""
    parts = []
    for k, v in derived.items():
        name = k.replace("_", " ")
        if isinstance(v, float) and any(w in k for w in ("gain", "overhead", "error")) and abs(v) < 10:
            parts.append(f"{name} {v * 100:+.1f}%")
        elif isinstance(v, (int, float)) and k.endswith("bytes"):
            n = float(v)
            unit = next(u for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1)) if abs(n) >= s or s == 1)
            scale = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}[unit]
            parts.append(f"{name} {n / scale:.1f} {unit}")
        elif isinstance(v, float):
            parts.append(f"{name} {v:.3g}")
        elif v is not None:
            parts.append(f"{name}: {v}")
    return "; ".join(parts)


def spreads_overlap(a: dict | None, b: dict | None) -> bool:
    """Whether two timings' p20-p80 ranges overlap: then this run does not tell them apart."""
    if not a or not b or not a.get("n") or not b.get("n"):
        return False
    return a["p20"] <= b["p80"] and b["p20"] <= a["p80"]


def format_table(result: dict) -> str:
    """A short text table: median [p20-p80] per phase, the step's speed against the first variant (higher is
    better; ``~`` where the two p20-p80 spreads overlap, so this run does not tell them apart), MFU, host syncs per
    step (and how many of them inside the decoder layers), packed-metadata objects built in the step, peak GPU
    memory, the bytes offloaded checkpointing copied in one step (``copied MiB``, where a row has them), and
    (``vs ref``) one step's loss and gradients at the same weights against the reference variant's:
    ``bitwise`` or the largest relative difference. A skipped variant is one quiet line, an error says so."""
    rows = result["variants"]
    base = next((r for r in rows if "step_ms" in r), None)
    w = max([28] + [len(r["name"]) for r in rows])
    head = f"{'variant':{w}s} {'forward ms':>22s} {'backward ms':>22s} {'step ms':>22s} {'x step':>8s} " \
           f"{'MFU':>6s} {'syncs/step':>10s} {'(in layers)':>11s} {'meta builds':>11s} {'peak GiB':>8s}" \
           + (f" {'vs ref':>8s}" if any("equal_to_first" in r for r in rows) else "") \
           + (f" {'copied MiB':>10s}" if any("offload_stats_last_step" in r for r in rows) else "")
    lines = [head, "-" * len(head)]
    overlaps = False
    for r in rows:
        if "error" in r:
            err = str(r["error"])
            lines.append(f"{r['name']:{w}s} {err}" if err.startswith("skipped:") else f"{r['name']:{w}s} ERROR: {err}")
            continue
        speed = (base["step_ms"]["median"] / r["step_ms"]["median"]) if base and "step_ms" in r else float("nan")
        same = r is not base and spreads_overlap(r.get("step_ms"), base.get("step_ms") if base else None)
        overlaps |= same
        peak = r.get("peak_mem_bytes")
        inl = r.get("host_syncs_in_layers")
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        lines.append(
            f"{r['name']:{w}s} {_fmt_ms(r.get('forward_ms')):>22s} {_fmt_ms(r.get('backward_ms')):>22s} "
            f"{_fmt_ms(r.get('step_ms')):>22s} {speed:6.2f}x{'~' if same else ' '} {mfu:>6s} "
            f"{str(r.get('host_syncs_per_step', '-')):>10s} "
            f"{'(' + str(inl) + ')' if inl is not None else '-':>11s} "
            f"{str(r.get('metadata_builds_per_step') if r.get('metadata_builds_per_step') is not None else '-'):>11s} "
            f"{f'{peak / 2**30:8.2f}' if peak else '-':>8s}"
            + (f" {_fmt_equal(r['equal_to_first']):>8s}" if "equal_to_first" in r else "")
            + (f" {_fmt_copied(r.get('offload_stats_last_step')):>10s}"
               if any("offload_stats_last_step" in x for x in rows) else "")
        )
    if overlaps:
        lines.append(f"~ the step's p20-p80 overlaps {base['name']}'s: this run does not tell the two apart")
    ref = next((r.get("equal_reference") for r in rows if "equal_to_first" in r), None)
    if ref is not None:
        lines.append(f"vs ref: one step's loss and gradients at the same weights against {ref}'s (ref): bitwise, or "
                     "the largest relative difference")
        for r in rows:
            eq = r.get("equal_to_first")
            if r.get("unequal") and eq and not eq.get("bitwise", True):
                lines.append(f"  {r['name']}: {r['unequal']}")
    return "\n".join(lines)


__all__ = ["Variant", "default_inputs", "run_step", "make_optimizer", "run_variants", "count_step_syncs",
           "profile_variant",
           "compare_to_first",
           "make_result", "write_json", "format_table", "format_derived", "spreads_overlap", "add_throughput", "with_autocast",
           "AUTOCAST"]
