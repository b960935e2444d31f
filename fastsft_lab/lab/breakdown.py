"""Where the time of a training step goes: device time per category (attention, experts, dense matmuls, LoRA, ...)
and idle, summing to the step.

The profiled step, the module categories and the walk from each kernel (or CPU op) to its scope -- launching op by
correlation id, backward nodes to their forward op by sequence number, the innermost module range -- are the
library's (:mod:`fastsft_lab.step_profile`, which :func:`fastsft_lab.diagnose` uses too). This module adds them up:

* **Which unit of work.** On a GPU every device activity (kernels, memcpy, memset); on a CPU each op's *self* time
  (its span minus its children's), since there is no device.
* **Its category** (:func:`~fastsft_lab.step_profile.module_categories`): attention, MoE experts, dense matmuls
  and within them NF4 dequant, LoRA, loss + LM head, norms & elementwise, copies & offload (device memcpy / memset
  whatever their scope), optimizer (``AccumulateGrad`` included), and ``other`` -- what no rule reaches (embedding,
  masks and metadata outside the layers, kernels with no recorded launching op); its top kernels are listed so that
  "other" never hides a bottleneck.
* ``idle``: the step's wall time (a ``record_function`` range around the step, closed after a device synchronize)
  minus the union of busy device intervals on all streams. Overlapping work is attributed so that the parts sum
  to the step exactly: when compute kernels overlap, each gets an equal share of the overlap; a copy gets only the
  time no compute kernel runs (a copy hidden under compute costs the step nothing). ``kernel_ms`` per category is
  the raw sum of its activity durations, overlap counted. The profiler's own host overhead lands in ``idle``
  wherever the step is host-bound: :func:`without_profiler` re-bases a device breakdown on the step time measured
  without the profiler (work categories kept, idle = unprofiled step - busy), which is what the bench reports.
* **What bounds it** (``bounds``, ``category_bounds`` of :func:`profile_steps`, on a GPU): each kernel classified by
  its achieved FLOP/s and bytes/s against the device's peaks (:mod:`fastsft_lab.roofline`): compute, memory, latency.

On a CPU the categories are the self time of the host ops, and ``idle`` is host time inside the step outside any
op (Python, hooks, the profiler itself): not device idleness, which a CPU run cannot show.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from ..profiling import time_ms
from ..step_profile import (CATEGORIES, LABEL_PREFIX, STEP_LABEL, WORK, EventIndex, ScopeLabels, StepRecorder,
                            device_events, is_device_work, label, module_categories, self_intervals, split_window)

# The walk from a kernel (or op) to its scope is the library's (fastsft_lab.step_profile): one implementation for
# this breakdown and for fastsft_lab.diagnose.
Attributor = EventIndex


def work_items(events: Iterable, attributor: EventIndex, *, device: bool,
               device_activity: Iterable | None = None) -> list[tuple[float, float, str, str]]:
    """``(start_us, end_us, category, name)`` of every unit of work: on a GPU the device activities
    (``device_activity``, default the device events among ``events``), on a CPU the CPU ops' self time."""
    events = list(events)
    annotations = {e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU
                   and getattr(e, "is_user_annotation", False)}
    items = []
    if device:
        acts = device_activity if device_activity is not None else [
            e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
        for e in acts:
            if is_device_work(e, annotations):
                items.append((e.time_range.start, e.time_range.end, attributor.category(e), e.name))
        return items
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and not e.is_async \
                and not getattr(e, "is_user_annotation", False) \
                and not e.name.startswith((LABEL_PREFIX, STEP_LABEL, "ProfilerStep", "[memory]")):
            cat = attributor.category(e)
            items.extend((s, t, cat, e.name) for s, t in self_intervals(e))
    return items


def attribute(items: Iterable[tuple[float, float, str, Any]], window: tuple[float, float]) -> dict[str, float]:
    """Split ``window`` (start, end) among the categories of ``items`` and ``idle``; the values sum to its length.

    A sweep over the interval ends: where compute work overlaps, each active item gets an equal share; ``copies``
    count only where no compute runs; time with nothing active is ``idle``.
    """
    return split_window(items, window, WORK, background=("copies",))


# --- the step under the profiler --------------------------------------------------------------------------------
def profile_steps(model: nn.Module, step: Callable[[int], Any], *, device: torch.device | str, steps: int = 1,
                  optimizer_step: Callable[[], Any] | None = None, bounds: bool | None = None) -> dict:
    """Run ``step(i)`` (forward + backward) and ``optimizer_step()`` for ``i`` in ``range(steps)`` under the
    profiler with the module scopes on; return the breakdown (:func:`breakdown_from_events`) and, with ``bounds``
    (default: on a GPU), the step's time by what bounds its kernels (``bounds``: compute / memory / latency / unknown
    / idle ms, from :mod:`fastsft_lab.roofline`) and by category and bound (``category_bounds``). The bounds need
    the ops' shapes recorded: on a GPU that costs host time only, on a CPU it lands in every op's own time (the
    breakdown of a CPU), so there they are left out unless asked for."""
    device = torch.device(device)
    bounds = device.type == "cuda" if bounds is None else bounds
    rec = StepRecorder(model, device, shapes=bounds).start()
    try:
        for i in range(steps):
            with rec.step():
                step(i)
                if optimizer_step is not None:
                    with torch.profiler.record_function(label("optimizer", "optimizer.step")):
                        optimizer_step()
    except BaseException:
        rec.close()
        raise
    if not bounds:
        rec.close()
    kernels = rec.stop() if bounds else None
    cuda = device.type == "cuda"
    bd = breakdown_from_events(rec.prof.events(), device=cuda, device_activity=device_events(rec.prof) if cuda else None)
    if kernels is not None:
        bd["bounds"] = {k: round(v, 4) for k, v in kernels.by_bound().items()}
        pairs = kernels.split(lambda k: f"{k.where.category}:{k.bound}")
        bd["category_bounds"] = {cat: {b: round(pairs.get(f"{cat}:{b}", 0.0), 4) for b in
                                       ("compute", "memory", "latency", "unknown")} for cat in WORK}
        bd["peaks"] = kernels.peaks.source
    return bd


def breakdown_from_events(events, *, device: bool, device_activity: Iterable | None = None, top: int = 5) -> dict:
    """Per step and averaged over the steps (the ``STEP_LABEL`` ranges): ms per category and idle, their shares,
    raw kernel ms, the top kernels (or ops) of each category, and the step time the parts sum to.
    ``device_activity``: the device events with their correlation ids (:func:`device_events`)."""
    events = list(events)
    windows = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.name == STEP_LABEL and e.device_type == torch.autograd.DeviceType.CPU)
    if not windows:
        raise ValueError(f"no {STEP_LABEL!r} range in the profile")
    attributor = Attributor(events)
    items = work_items(events, attributor, device=device, device_activity=device_activity)
    per_step = []
    kernel_us: dict[str, float] = defaultdict(float)
    by_name: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0]))
    for w in windows:
        inside = [it for it in items if w[0] <= it[0] < w[1]]
        parts = attribute(inside, w)
        per_step.append({"step_ms": (w[1] - w[0]) / 1e3, **{k: v / 1e3 for k, v in parts.items()}})
        for s, e, cat, name in inside:
            kernel_us[cat] += min(e, w[1]) - s
            acc = by_name[cat][name]
            acc[0] += min(e, w[1]) - s
            acc[1] += 1
    n = len(windows)
    step_ms = sum(p["step_ms"] for p in per_step) / n
    rows = []
    for key, title in CATEGORIES.items():
        ms = sum(p[key] for p in per_step) / n
        tops = sorted(by_name[key].items(), key=lambda kv: kv[1][0], reverse=True)[:top]
        rows.append({"category": key, "label": title, "ms": round(ms, 4), "share": round(ms / step_ms, 5) if step_ms
                     else 0.0, "kernel_ms": round(kernel_us[key] / n / 1e3, 4) if key != "idle" else None,
                     "top": [{"name": k[:160], "ms": round(v[0] / n / 1e3, 4), "calls": round(v[1] / n, 2)}
                             for k, v in tops]})
    worst = max(rows, key=lambda r: r["ms"])
    work = [r for r in rows if r["category"] != "idle"]
    worst_work = max(work, key=lambda r: r["ms"])
    return {"step_ms": round(step_ms, 4), "steps": n, "categories": rows,
            "per_step": [{k: round(v, 4) for k, v in p.items()} for p in per_step],
            "bottleneck": worst["category"], "bottleneck_work": worst_work["category"],
            "activity": "cuda" if device else "cpu"}


def describe_bottleneck(breakdown: dict) -> str:
    """One sentence naming the largest part of the step (and, if that is idle, the largest work category)."""
    rows = {r["category"]: r for r in breakdown["categories"]}

    def one(key):
        r = rows[key]
        top = f"; top: {r['top'][0]['name'][:70]} ({r['top'][0]['ms']:.1f} ms)" if r.get("top") else ""
        return f"{r['label']}: {r['ms']:.1f} ms, {r['share']:.0%} of the step{top}"

    text = f"next bottleneck -- {one(breakdown['bottleneck'])}"
    if breakdown["bottleneck"] == "idle":
        text += f"; largest work: {one(breakdown['bottleneck_work'])}"
    return text


def without_profiler(breakdown: dict, unprofiled_step_ms: float) -> dict:
    """``breakdown`` (device activity) re-based on the step time measured without the profiler.

    Under ``torch.profiler`` every op and launch costs the host extra work (op records, CUPTI callbacks), so
    wherever the step is bound by the host the device waits longer than it does unprofiled: the profiled ``idle``
    holds the profiler's own overhead. Kernel durations are timestamped on the device and barely change. So every
    work category keeps its ms, ``idle`` becomes the unprofiled step minus the profiled busy time (never below 0),
    ``step_ms`` their sum and each share is of that step; the bottleneck is named again on these numbers. The
    profiled figures stay beside them (``profiled_step_ms``, ``profiled_idle_ms``)."""
    rows = [dict(r) for r in breakdown["categories"]]
    idle = next(r for r in rows if r["category"] == "idle")
    busy = breakdown["step_ms"] - idle["ms"]
    idle["ms"] = round(max(0.0, unprofiled_step_ms - busy), 4)
    step = busy + idle["ms"]
    for r in rows:
        r["share"] = round(r["ms"] / step, 5) if step else 0.0
    worst = max(rows, key=lambda r: r["ms"])
    worst_work = max((r for r in rows if r["category"] != "idle"), key=lambda r: r["ms"])
    return {**breakdown, "categories": rows, "step_ms": round(step, 4), "unprofiled_step_ms": unprofiled_step_ms,
            "profiled_step_ms": breakdown["step_ms"], "profiled_idle_ms": round(breakdown["step_ms"] - busy, 4),
            "bottleneck": worst["category"], "bottleneck_work": worst_work["category"]}


def step_view(result: dict) -> dict | None:
    """The breakdown of a ``breakdown`` result as the step runs unprofiled (:func:`without_profiler`) where it was
    profiled on a device and its unprofiled step time was measured; else the profiled breakdown as it is (a CPU
    run's idle is host time, not device idleness). None when the result has no breakdown."""
    bd = result.get("breakdown")
    if not bd:
        return None
    timed = next((v["step_ms"]["median"] for v in result.get("variants", []) if "step_ms" in v), None)
    if bd.get("activity") != "cuda" or not timed:
        return bd
    return without_profiler(bd, timed)


# What bounds each category's kernels, by their kind (not a roofline measurement): matmuls and attention do many
# FLOPs per byte; norms, elementwise ops, dequantisation, copies and the optimizer move bytes; idle is the device
# waiting for the host (on a CPU: host time between ops) -- the overhead the glue fixes remove.
BOUND_BY = {"compute-bound (matmuls, attention)": ("attention", "experts", "dense", "lora", "loss_head"),
            "memory-bound (norms, elementwise, dequant, copies, optimizer)": ("elementwise", "nf4_dequant", "copies",
                                                                              "optimizer"),
            "overhead (idle: waiting for the host)": ("idle",),
            "other": ("other",)}


def bound_by(breakdown: dict) -> dict[str, float]:
    """The breakdown's ms grouped by what bounds them (:data:`BOUND_BY`)."""
    ms = {r["category"]: r["ms"] for r in breakdown["categories"]}
    return {group: round(sum(ms.get(c, 0.0) for c in cats), 4) for group, cats in BOUND_BY.items()}


def format_breakdown(breakdown: dict) -> str:
    lines = [f"{'category':24s} {'ms':>9s} {'share':>7s} {'kernel ms':>10s}  top kernel"]
    for r in breakdown["categories"]:
        top = r["top"][0]["name"][:60] if r["top"] else ""
        kms = f"{r['kernel_ms']:10.2f}" if r["kernel_ms"] is not None else f"{'-':>10s}"
        lines.append(f"{r['label']:24s} {r['ms']:9.2f} {r['share']:7.1%} {kms}  {top}")
    if "profiled_step_ms" in breakdown:
        lines.append(f"{'step (unprofiled)':24s} {breakdown['step_ms']:9.2f} {1:7.1%}  profiled: step "
                     f"{breakdown['profiled_step_ms']:.2f} ms, idle {breakdown['profiled_idle_ms']:.2f} ms")
    else:
        lines.append(f"{'step':24s} {breakdown['step_ms']:9.2f} {1:7.1%}")
    return "\n".join(lines)


@contextlib.contextmanager
def _variant_on(model, variant):
    variant.enable(model)
    try:
        yield
    finally:
        variant.disable(model)


def breakdown_variant(model: nn.Module, batches: Sequence, variant, *, optimizer, device, steps: int = 1,
                      unprofiled: bool | None = None) -> dict:
    """The breakdown of ``steps`` training steps of ``variant`` (a :class:`~fastsft_lab.lab.harness.Variant`),
    step ``i`` on ``batches[i % len(batches)]``: forward + backward under the variant's context, then
    ``optimizer.step()`` and ``zero_grad``. ``unprofiled`` (default: on a GPU): the same steps timed first without
    the profiler, and the breakdown re-based on their median (:func:`without_profiler`: the profiler's host overhead
    out of ``idle``)."""
    device = torch.device(device)
    unprofiled = device.type == "cuda" if unprofiled is None else unprofiled

    def step(i):
        batch = batches[i % len(batches)]
        state = variant.prepare(batch) if variant.prepare else None
        ctx = variant.context(model) if variant.context is not None else contextlib.nullcontext()
        with ctx:
            out = model(**variant.inputs(batch, state))
            (out.loss if hasattr(out, "loss") else out[0]).backward()

    def opt_step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model.train()
    with _variant_on(model, variant):
        timed = None
        if unprofiled:                                   # before the profiler: its teardown slows the step after it
            order = iter(range(steps))
            timed = time_ms(lambda: (step(next(order)), opt_step()), device, warmup=0, reps=steps)["median"]
        bd = profile_steps(model, step, device=device, steps=steps, optimizer_step=opt_step)
    return without_profiler(bd, timed) if timed is not None else bd


__all__ = ["CATEGORIES", "WORK", "label", "module_categories", "ScopeLabels", "Attributor", "work_items", "attribute",
           "profile_steps", "breakdown_from_events", "breakdown_variant", "describe_bottleneck", "format_breakdown",
           "without_profiler", "step_view", "BOUND_BY", "bound_by",
           "STEP_LABEL", "LABEL_PREFIX", "device_events"]
