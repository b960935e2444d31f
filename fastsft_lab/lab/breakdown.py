"""Where the time of a training step goes: device time per category (attention, experts, dense matmuls, LoRA, ...)
and idle, summing to the step.

One or a few steps run under ``torch.profiler`` (CPU + CUDA activity on a GPU, CPU alone on a CPU) with every
module of interest scoped by a ``record_function`` range (forward pre/post hooks, :class:`ScopeLabels`). Each unit
of work is then given one category:

* **Which unit of work.** On a GPU: every device activity (kernels, memcpy, memset), linked to the CPU op that
  launched it by the profiler's correlation id (``linked_correlation_id`` of the device event == ``id`` of the op;
  read from kineto's raw events, :func:`device_events`, since torch < 2.13's ``FunctionEvent`` drops it).
  On a CPU: each op's *self* time (its span minus its children's), since there is no device.
* **Forward (and the checkpoint recompute).** From the launching op, walk up the op stack (``cpu_parent``) to the
  innermost scope range: its module's category. The recompute of gradient checkpointing runs the modules again,
  so their hooks scope it as well.
* **Backward.** Autograd runs backward nodes outside any module scope (on a GPU, on its own thread). Each node's
  profiler event carries the ``sequence_nr`` of the forward op that created it and that op's thread
  (``fwd_thread``); the creator is the *last* forward op recorded with that ``(thread, sequence_nr)`` (ops record
  the counter's next value, node creation increments it), so a backward kernel gets the category of its node's
  forward op. ``AccumulateGrad`` (gradients into ``.grad``) counts as optimizer work.
* **Modules to categories** (:func:`module_categories`; the innermost scope wins):
  ``attention``: the attention module's own work (the attention kernel -- SDPA, flash, varlen, flex, eager -- RoPE
  and the head reshapes), its projections and q/k norms excluded; ``experts``: the MoE block, its router and its
  experts (grouped_mm, gather/scatter/sort/combine, the Triton gate); ``dense``: the base projections (the frozen
  ``base_layer`` under LoRA, plain ``nn.Linear``, bitsandbytes' ``Linear4bit``), and within them ``nf4_dequant``:
  work under a ``dequantize`` op or a kernel so named (bitsandbytes' fused ``gemm_4bit`` dequantizes inside);
  ``lora``: the PEFT LoRA layer's own work and its ``lora_A``/``lora_B`` (and their dtype casts); ``loss_head``:
  the LM head and the causal-LM forward's own work (logits, cross-entropy, fastsft's fused loss);
  ``elementwise``: norms, rotary embedding, the dense MLP's activation product, the decoder layer's residual adds;
  ``optimizer``: the optimizer step, ``zero_grad`` and gradient accumulation.
* **By name, whatever the scope:** device memcpy and memset are ``copies`` (offload's transfers, staging copies).
* ``other``: what no rule reaches (the embedding, mask and metadata work outside the layers, ops launched outside
  every scope, kernels whose launching op the profiler did not record); its top kernels are listed so that
  "other" never hides a bottleneck.
* ``idle``: the step's wall time (a ``record_function`` range around the step, closed after a device synchronize)
  minus the union of busy device intervals on all streams. Overlapping work is attributed so that the parts sum
  to the step exactly: when compute kernels overlap, each gets an equal share of the overlap; a copy gets only the
  time no compute kernel runs (a copy hidden under compute costs the step nothing). ``kernel_ms`` per category is
  the raw sum of its activity durations, overlap counted. The profiler's own host overhead lands in ``idle``
  wherever the step is host-bound: :func:`without_profiler` re-bases a device breakdown on the step time measured
  without the profiler (work categories kept, idle = unprofiled step - busy), which is what the bench reports.

On a CPU the categories are the self time of the host ops, and ``idle`` is host time inside the step outside any
op (Python, hooks, the profiler itself): not device idleness, which a CPU run cannot show.
"""

from __future__ import annotations

import contextlib
import re
from collections import defaultdict
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import nn

from ..structure import base_model, decoder_layers

CATEGORIES = {
    "attention": "attention",
    "experts": "MoE experts",
    "dense": "dense matmuls",
    "nf4_dequant": "NF4 dequant",
    "lora": "LoRA",
    "loss_head": "loss + LM head",
    "elementwise": "norms & elementwise",
    "copies": "copies & offload",
    "optimizer": "optimizer",
    "other": "other",
    "idle": "idle",
}
WORK = tuple(k for k in CATEGORIES if k != "idle")
LABEL_PREFIX = "fastsft.breakdown["       # scope ranges: "fastsft.breakdown[<category>] <module path>"
STEP_LABEL = "fastsft.breakdown.step"
# offloaded checkpointing's autograd function (fastsft_lab.offload.checkpoint): its own work is the offload's
OFFLOAD_OPS = ("_OffloadedLayer",)
_RUNTIME = re.compile(r"^cu(da)?[A-Z]")    # CUDA runtime / driver calls: cudaLaunchKernel, cuLaunchKernelEx, ...


def label(category: str, name: str = "") -> str:
    if category not in CATEGORIES or category == "idle":
        raise ValueError(f"unknown category {category!r}; known: {', '.join(WORK)}")
    return f"{LABEL_PREFIX}{category}] {name}".rstrip()


def _label_category(name: str) -> str | None:
    if not name.startswith(LABEL_PREFIX):
        return None
    return name[len(LABEL_PREFIX):].split("]", 1)[0]


# --- modules -> categories ------------------------------------------------------------------------------------------
def _is_lora_layer(module: nn.Module) -> bool:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(module, LoraLayer)


def _is_moe_block(module: nn.Module) -> bool:
    from ..moe.modules import is_experts_module

    experts = getattr(module, "experts", None)
    return isinstance(experts, nn.Module) and (is_experts_module(experts) or "expert" in type(experts).__name__.lower())


def _own_category(module: nn.Module) -> str | None:
    """The category of ``module`` by its type alone (None: it opens no scope of its own)."""
    from ..moe.modules import is_experts_module

    cls = type(module).__name__.lower()
    if _is_lora_layer(module):
        return "lora"
    if is_experts_module(module) or "experts" in cls or _is_moe_block(module) or "router" in cls:
        return "experts"
    if "attention" in cls:
        return "attention"
    if "norm" in cls or "rotary" in cls:
        return "elementwise"
    if "mlp" in cls:                          # a dense MLP: its activation product (projections scope themselves)
        return "elementwise"
    if isinstance(module, nn.Linear) or cls.startswith("linear"):   # nn.Linear, bnb Linear4bit / Linear8bitLt
        return "dense"
    return None


def module_categories(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """``{module path: (module, category)}`` for every module that opens a scope (the module docstring's rules).

    Inside an MoE block a linear is routing (``experts``), not a dense projection; LoRA's ``base_layer`` is
    ``dense`` (or ``experts`` when LoRA wraps expert weights); the causal LM's own forward is ``loss_head``; the
    decoder stack's own forward (embedding, masks, metadata) is ``other``.
    """
    lm = base_model(model)
    inner = getattr(lm, "model", None)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    layers = set(map(id, decoder_layers(model)))
    out: dict[str, tuple[nn.Module, str]] = {}
    for path, module in model.named_modules():
        cat: str | None
        parent, up = None, path
        while "." in up and parent is None:           # the nearest ancestor that opened a scope
            up = up.rsplit(".", 1)[0]
            parent = out[up][1] if up in out else None
        if module is lm or module is head:
            cat = "loss_head"
        elif module is inner:
            cat = "other"
        elif id(module) in layers:
            cat = "elementwise"
        elif parent == "lora":
            # inside a LoRA layer: its base_layer is the frozen projection, the rest (lora_A/B, dropout) is LoRA
            cat = (_own_category(module) or "dense") if path.endswith(".base_layer") else None
        else:
            cat = _own_category(module)
            if cat == "dense" and parent == "experts":
                cat = "experts"          # the MoE router's gate linear
        if cat is not None:
            out[path] = (module, cat)
    return out


class ScopeLabels:
    """Forward pre/post hooks that open and close a ``record_function`` range named :func:`label` around each
    module of :func:`module_categories` (a no-op cost when no profiler runs; removed on exit)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.categories = module_categories(model)
        self._hooks: list = []
        self._open: dict[int, list] = defaultdict(list)

    def _pre(self, name: str):
        def hook(module, args):
            rf = torch.profiler.record_function(name)
            rf.__enter__()
            self._open[id(module)].append(rf)
        return hook

    def _post(self):
        def hook(module, args, output):
            stack = self._open.get(id(module))
            if stack:
                stack.pop().__exit__(None, None, None)
        return hook

    def __enter__(self) -> "ScopeLabels":
        for path, (module, cat) in self.categories.items():
            self._hooks.append(module.register_forward_pre_hook(self._pre(label(cat, path))))
            self._hooks.append(module.register_forward_hook(self._post(), always_call=True))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for stack in self._open.values():
            while stack:
                stack.pop().__exit__(None, None, None)
        self._open.clear()


# --- events -> categories -------------------------------------------------------------------------------------------
def _is_device(evt) -> bool:
    return evt.device_type != torch.autograd.DeviceType.CPU


def _is_backward_node(evt) -> bool:
    return evt.sequence_nr >= 0 and bool(evt.fwd_thread) and not _is_device(evt)


class Attributor:
    """Resolves the category of profiler events (the module docstring's walk, memoized)."""

    def __init__(self, events: Iterable):
        self.events = list(events)
        self.by_id: dict[int, list] = defaultdict(list)
        self.forward_of: dict[tuple[int, int], Any] = {}
        for e in self.events:
            if _is_device(e) or e.is_async:
                continue
            if getattr(e, "linked_correlation_id", 0) == 0 and e.id:
                self.by_id[e.id].append(e)
            if e.sequence_nr >= 0 and not e.fwd_thread:
                key = (e.thread, e.sequence_nr)
                prev = self.forward_of.get(key)
                if prev is None or e.time_range.start >= prev.time_range.start:
                    self.forward_of[key] = e      # the last op recorded with this number created the node
        self._memo: dict[int, tuple[str, bool]] = {}

    def scope(self, evt) -> tuple[str, bool]:
        """(category, under a dequantize op) of a CPU event, by its innermost scope or backward node."""
        path = []
        node, found = evt, None
        while node is not None:
            hit = self._memo.get(id(node))
            if hit is not None:
                found = hit
                break
            path.append(node)
            name = node.name
            cat = _label_category(name)
            if cat is not None:
                found = (cat, False)
                break
            if "AccumulateGrad" in name:
                found = ("optimizer", False)
                break
            if name.startswith(OFFLOAD_OPS):
                found = ("copies", False)
                break
            if _is_backward_node(node):
                fwd = self.forward_of.get((node.fwd_thread, node.sequence_nr))
                found = (self.scope(fwd)[0], False) if fwd is not None and fwd is not node else ("other", False)
                break
            node = node.cpu_parent
        cat, dequant = found or ("other", False)
        for n in reversed(path):            # from the scope down: a node is "dequant" when it or an ancestor is
            dequant = dequant or "dequantize" in n.name
            self._memo[id(n)] = (cat, dequant)
        return self._memo[id(evt)] if path else (cat, dequant)

    def launcher(self, evt):
        """The CPU op that launched device event ``evt``. Where torch's ``FunctionEvent`` has no
        ``linked_correlation_id`` (torch < 2.13), the CUDA runtime calls share the ops' id space: the op is the
        candidate that lists a kernel of this name (the profiler appends each op's kernels to it), else one that
        is not a runtime call."""
        cands = self.by_id.get(getattr(evt, "linked_correlation_id", 0)) or []
        if len(cands) <= 1:
            return cands[0] if cands else None
        named = [c for c in cands if any(getattr(k, "name", None) == evt.name for k in getattr(c, "kernels", ()))]
        if named:
            return named[0]
        ops = [c for c in cands if not _RUNTIME.match(c.name)]
        return (ops or cands)[0]

    def category(self, evt) -> str:
        """The category of one unit of work: a device activity (through its launching op) or a CPU op."""
        if _is_device(evt):
            if evt.name.startswith(("Memcpy", "Memset")):
                return "copies"
            op = self.launcher(evt)
            if op is None:          # a kernel no op launched (Triton's, from Python): known by its name at most
                return "nf4_dequant" if "dequant" in evt.name.lower() else "other"
            cat, dequant = self.scope(op)
        else:
            cat, dequant = self.scope(evt)
        if cat not in CATEGORIES or cat == "idle":
            cat = "other"
        # bitsandbytes' fused gemm_4bit op dequantizes inside: its dequant kernels are known by their own name
        # (and fastsft_lab's Triton _nf4_dequant_kernel)
        dequant = dequant or "dequant" in evt.name.lower()
        return "nf4_dequant" if dequant and cat == "dense" else cat


def _self_intervals(evt) -> list[tuple[float, float]]:
    """``evt``'s span minus its children's (microseconds)."""
    start, end = evt.time_range.start, evt.time_range.end
    out, t = [], start
    for c in sorted(evt.cpu_children, key=lambda c: c.time_range.start):
        cs, ce = max(c.time_range.start, start), min(c.time_range.end, end)
        if cs > t:
            out.append((t, cs))
        t = max(t, ce)
    if end > t:
        out.append((t, end))
    return out


def _is_device_work(evt, annotations: set) -> bool:
    """A kernel, memcpy or memset: not the device-side copy of a ``record_function`` range (kineto's
    ``gpu_user_annotation``), nor a synchronization record."""
    if not _is_device(evt) or getattr(evt, "is_user_annotation", False) or evt.name in annotations:
        return False
    kind = str(getattr(evt, "activity_type", "") or "").lower()
    return "annotation" not in kind and "sync" not in kind and "Sync" not in evt.name and \
        not evt.name.startswith((LABEL_PREFIX, STEP_LABEL, "ProfilerStep"))


def device_events(prof) -> list:
    """The device activities of a finished ``torch.profiler.profile``, each with the ``linked_correlation_id`` of the
    op that launched it, read from kineto's own events: the ``FunctionEvent`` of torch < 2.13 drops that id. Times
    are microseconds from the trace start, as ``FunctionEvent.time_range``."""
    results = prof.profiler.kineto_results
    t0 = results.trace_start_ns() if hasattr(results, "trace_start_ns") else results.trace_start_us() * 1000
    out = []
    for k in results.events():
        if k.device_type() == torch.autograd.DeviceType.CPU:
            continue
        note = k.is_user_annotation() if hasattr(k, "is_user_annotation") else False
        out.append(SimpleNamespace(name=k.name(), device_type=k.device_type(), is_async=False,
                                   linked_correlation_id=k.linked_correlation_id(), is_user_annotation=note,
                                   activity_type=None, time_range=SimpleNamespace(start=(k.start_ns() - t0) / 1e3,
                                                                                  end=(k.end_ns() - t0) / 1e3)))
    return out


def work_items(events: Iterable, attributor: Attributor, *, device: bool,
               device_activity: Iterable | None = None) -> list[tuple[float, float, str, str]]:
    """``(start_us, end_us, category, name)`` of every unit of work: on a GPU the device activities
    (``device_activity``, default the device events among ``events``), on a CPU the CPU ops' self time."""
    events = list(events)
    annotations = {e.name for e in events if not _is_device(e) and getattr(e, "is_user_annotation", False)}
    items = []
    if device:
        for e in (device_activity if device_activity is not None else [e for e in events if _is_device(e)]):
            if _is_device_work(e, annotations):
                items.append((e.time_range.start, e.time_range.end, attributor.category(e), e.name))
        return items
    for e in events:
        if not _is_device(e) and not e.is_async and not getattr(e, "is_user_annotation", False) \
                and not e.name.startswith((LABEL_PREFIX, STEP_LABEL, "ProfilerStep", "[memory]")):
            cat = attributor.category(e)
            items.extend((s, t, cat, e.name) for s, t in _self_intervals(e))
    return items


def attribute(items: Iterable[tuple[float, float, str, Any]], window: tuple[float, float]) -> dict[str, float]:
    """Split ``window`` (start, end) among the categories of ``items`` and ``idle``; the values sum to its length.

    A sweep over the interval ends: where compute work overlaps, each active item gets an equal share; ``copies``
    count only where no compute runs; time with nothing active is ``idle``.
    """
    w0, w1 = window
    if w1 < w0:
        raise ValueError(f"window ends before it starts: {window}")
    points = []
    for s, e, cat, *_ in items:
        s, e = max(s, w0), min(e, w1)
        if e > s:
            points.append((s, 1, cat))
            points.append((e, -1, cat))
    points.sort(key=lambda p: (p[0], p[1]))
    out = dict.fromkeys(CATEGORIES, 0.0)
    active: dict[str, int] = defaultdict(int)
    t = w0
    for time_, delta, cat in points:
        if time_ > t:
            seg = time_ - t
            compute = {c: n for c, n in active.items() if n > 0 and c != "copies"}
            if compute:
                total = sum(compute.values())
                for c, n in compute.items():
                    out[c] += seg * n / total
            elif active.get("copies", 0) > 0:
                out["copies"] += seg
            else:
                out["idle"] += seg
            t = time_
        active[cat] += delta
    if w1 > t:
        out["idle"] += w1 - t
    return out


# --- the step under the profiler --------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_steps(model: nn.Module, step: Callable[[int], Any], *, device: torch.device | str, steps: int = 1,
                  optimizer_step: Callable[[], Any] | None = None) -> dict:
    """Run ``step(i)`` (forward + backward) and ``optimizer_step()`` for ``i`` in ``range(steps)`` under the
    profiler with the module scopes on; return the breakdown (:func:`breakdown_from_events`)."""
    from torch.profiler import ProfilerActivity

    from ..profiling import quiet_profiler

    device = torch.device(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with ScopeLabels(model), quiet_profiler(activities=activities) as prof:
        for i in range(steps):
            with torch.profiler.record_function(STEP_LABEL):
                step(i)
                if optimizer_step is not None:
                    with torch.profiler.record_function(label("optimizer", "optimizer.step")):
                        optimizer_step()
                _sync(device)
    cuda = device.type == "cuda"
    return breakdown_from_events(prof.events(), device=cuda, device_activity=device_events(prof) if cuda else None)


def breakdown_from_events(events, *, device: bool, device_activity: Iterable | None = None, top: int = 5) -> dict:
    """Per step and averaged over the steps (the ``STEP_LABEL`` ranges): ms per category and idle, their shares,
    raw kernel ms, the top kernels (or ops) of each category, and the step time the parts sum to.
    ``device_activity``: the device events with their correlation ids (:func:`device_events`)."""
    events = list(events)
    windows = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.name == STEP_LABEL and not _is_device(e))
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


def breakdown_variant(model: nn.Module, batches: Sequence, variant, *, optimizer, device, steps: int = 1) -> dict:
    """The breakdown of ``steps`` training steps of ``variant`` (a :class:`~fastsft_lab.lab.harness.Variant`),
    step ``i`` on ``batches[i % len(batches)]``: forward + backward under the variant's context, then
    ``optimizer.step()`` and ``zero_grad``."""
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
        return profile_steps(model, step, device=device, steps=steps, optimizer_step=opt_step)


__all__ = ["CATEGORIES", "WORK", "label", "module_categories", "ScopeLabels", "Attributor", "work_items", "attribute",
           "profile_steps", "breakdown_from_events", "breakdown_variant", "describe_bottleneck", "format_breakdown",
           "without_profiler", "step_view", "BOUND_BY", "bound_by",
           "STEP_LABEL", "device_events"]
