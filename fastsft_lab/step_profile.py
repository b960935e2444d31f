"""One training step under the profiler, kernel by kernel: where each kernel comes from and what bounds it.

A step (or a few) runs under ``torch.profiler`` (CPU activity, plus CUDA on a GPU; shapes and FLOPs recorded) inside
a ``record_function`` range (:data:`STEP_LABEL`, closed after a device synchronize), with a range around every module
of :func:`module_categories` (forward pre/post hooks: :class:`ScopeLabels`). Then every kernel is placed:

* **Its launching op.** On a GPU each device activity (kernel, memcpy, memset) carries the correlation id of the op
  that launched it (``linked_correlation_id`` of the device event == ``id`` of the op; read from kineto's raw events,
  :func:`~fastsft_lab.profile_events.device_events`, since torch < 2.13's ``FunctionEvent`` drops it); the host
  events come from kineto's records too (:func:`~fastsft_lab.profile_events.host_events`: torch's own
  ``profile.events()`` costs several times the rest of the analysis). On a CPU there is no device: the "kernels"
  are the host ops that do work -- each op's own time (its span minus its children's), views, allocations and
  dispatch-only composites (:data:`NOT_KERNELS`) left out.
* **Its scope** (:meth:`EventIndex.where`): from the op, up the op stack (``cpu_parent``) to the innermost scope range,
  whose module gives the category; the decoder layer whose range holds it gives the layer. Autograd runs backward
  nodes outside any module range (on a GPU on its own thread): a node's event carries the ``sequence_nr`` of the
  forward op that created it and that op's thread (``fwd_thread``), and the creator is the *last* forward op recorded
  with that ``(thread, sequence_nr)`` (ops record the counter's next value, node creation increments it), so a
  backward kernel gets its forward op's category and layer, phase ``backward``. A module range opened *inside* a
  backward node is a checkpoint's recompute: phase ``recompute``. ``AccumulateGrad`` is optimizer work.
* **Its bound** (:mod:`fastsft_lab.roofline`): the FLOPs and bytes of its launching op against the device's peaks --
  compute, memory, latency (or unknown); an op's kernels are classified together.
* **Modules to categories** (:func:`module_categories`; the innermost scope wins): ``attention``: the attention
  module's own work (the attention kernel, RoPE, head reshapes; projections and q/k norms excluded); ``experts``: the
  MoE block, router and experts; ``dense``: base projections (the frozen ``base_layer`` under LoRA, ``nn.Linear``,
  bitsandbytes' ``Linear4bit``), and within them ``nf4_dequant`` (work under a ``dequantize`` op or a kernel so named);
  ``lora``: the PEFT LoRA layer's own work; ``loss_head``: the LM head and the causal LM's own forward (logits,
  cross-entropy); ``elementwise``: norms, rotary, the dense MLP's activation product, the decoder layer's residual
  adds; ``optimizer``; ``copies`` (device memcpy / memset, offload's autograd function); ``other``: what no rule
  reaches (embedding, masks and metadata outside the layers, kernels with no recorded launching op).

Time: ``busy`` is the union of the kernels' intervals inside the step, ``idle`` the rest of the step -- on a GPU the
device waiting for the host (host overhead: Python, launches, syncs); on a CPU host time outside any op. Each idle
gap is charged to the kernel that ends it (:meth:`StepProfile.waits`): the device waited for *that* launch.
:func:`split_window` shares overlapping work equally so that parts and idle sum to the step exactly. Under the profiler
the host runs slower (op records, CUPTI callbacks) while kernels barely change, so a caller re-bases idle on the
step timed without it (``idle = unprofiled step - busy``).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Iterable, Sequence

import torch
from torch import nn

from .profile_events import _RUNTIME, HostEvent, _input_dtypes, device_events, host_events
from .structure import base_model, decoder_layers
from .roofline import BOUNDS, Peaks, classify, device_peaks, op_bytes, op_flops, precision

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
LABEL_PREFIX = "fastsft.scope["           # scope ranges: "fastsft.scope[<category>] <module path>"
STEP_LABEL = "fastsft.step"
OFFLOAD_OPS = ("_OffloadedLayer",)        # offloaded checkpointing's autograd function: its own work is copies
# CPU ops that are not kernels: views, allocations, and composites that only dispatch to the ops below them
NOT_KERNELS = frozenset(f"aten::{n}" for n in (
    "view", "reshape", "_reshape_alias", "_unsafe_view", "as_strided", "t", "transpose", "permute", "expand",
    "expand_as", "slice", "select", "narrow", "unsqueeze", "squeeze", "flatten", "unflatten", "split",
    "split_with_sizes", "chunk", "unbind", "detach", "alias", "lift_fresh", "empty", "empty_strided", "empty_like",
    "resize_", "result_type", "resolve_conj", "resolve_neg", "linear", "matmul", "to", "type_as", "contiguous",
    "dropout", "view_as", "movedim", "set_", "scaled_dot_product_attention", "cross_entropy_loss", "broadcast_tensors",
    "_has_compatible_shallow_copy_type", "is_same_size", "size", "stride", "numel", "dim"))


def label(category: str, name: str = "") -> str:
    if category not in CATEGORIES or category == "idle":
        raise ValueError(f"unknown category {category!r}; known: {', '.join(WORK)}")
    return f"{LABEL_PREFIX}{category}] {name}".rstrip()


def _label_parts(name: str) -> tuple[str, str] | None:
    if not name.startswith(LABEL_PREFIX):
        return None
    cat, _, path = name[len(LABEL_PREFIX):].partition("]")
    return cat, path.strip()


# --- modules -> categories ------------------------------------------------------------------------------------------
def _is_lora_layer(module: nn.Module) -> bool:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(module, LoraLayer)


def _is_moe_block(module: nn.Module) -> bool:
    from .moe.modules import is_experts_module

    experts = getattr(module, "experts", None)
    return isinstance(experts, nn.Module) and (is_experts_module(experts) or "expert" in type(experts).__name__.lower())


def _own_category(module: nn.Module) -> str | None:
    """The category of ``module`` by its type alone (None: it opens no scope of its own)."""
    from .moe.modules import is_experts_module

    cls = type(module).__name__.lower()
    if _is_lora_layer(module):
        return "lora"
    if is_experts_module(module) or "experts" in cls or _is_moe_block(module) or "router" in cls:
        return "experts"
    if "attention" in cls:
        return "attention"
    if "norm" in cls or "rotary" in cls or "mlp" in cls:     # a dense MLP: its activation product
        return "elementwise"
    if isinstance(module, nn.Linear) or cls.startswith("linear"):   # nn.Linear, bnb Linear4bit / Linear8bitLt
        return "dense"
    return None


def module_categories(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """``{module path: (module, category)}`` for every module that opens a scope (the module docstring's rules).

    Inside an MoE block a linear is routing (``experts``), not a dense projection; LoRA's ``base_layer`` is
    ``dense`` (or ``experts`` when LoRA wraps expert weights); the causal LM's own forward is ``loss_head``; the
    decoder stack's own forward (embedding, masks, metadata) is ``other``; a decoder layer's own work elementwise.
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


def layer_paths(model: nn.Module) -> dict[str, int]:
    """``{module path: index}`` of the decoder layers, as ``model.named_modules()`` names them."""
    index = {id(m): i for i, m in enumerate(decoder_layers(model))}
    return {path: index[id(m)] for path, m in model.named_modules() if id(m) in index}


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


# --- events -> where they come from ---------------------------------------------------------------------------------
def _is_device(evt) -> bool:
    return evt.device_type != torch.autograd.DeviceType.CPU


def _is_backward_node(evt) -> bool:
    return evt.sequence_nr >= 0 and bool(evt.fwd_thread) and not _is_device(evt)


@dataclass(frozen=True)
class Where:
    """Where a unit of work comes from: its category, decoder layer (None: outside the layers) and phase
    (``forward``, ``backward`` or ``recompute``: a checkpointed forward run again inside the backward)."""

    category: str
    layer: int | None = None
    phase: str = "forward"
    dequant: bool = False


_NOWHERE = Where("other")


class EventIndex:
    """Links profiler events: device activity to its launching op, backward nodes to their forward op, any op to its
    scope (the module docstring's walk, memoized). ``layers``: ``{module path: index}`` of the decoder layers."""

    def __init__(self, events: Iterable, layers: dict[str, int] | None = None):
        self.events = list(events)
        self.layers = layers or {}
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
        self._memo: dict[int, Where] = {}

    def _backward(self, node) -> Where:
        hit = self._memo.get(id(node))
        if hit is None:
            fwd = self.forward_of.get((node.fwd_thread, node.sequence_nr))
            base = self.where(fwd) if fwd is not None and fwd is not node else _NOWHERE
            hit = self._memo[id(node)] = Where(base.category, base.layer, "backward")
        return hit

    def _below(self, node, above: Where) -> Where:
        """The place of ``node`` given the place of its parent (innermost scope wins)."""
        name = node.name
        parts = _label_parts(name)
        if parts is not None:
            phase = "forward" if above.phase == "forward" else "recompute"
            return Where(parts[0], self.layers.get(parts[1], above.layer), phase)
        if "AccumulateGrad" in name:
            return Where("optimizer", None, above.phase)
        if name.startswith(OFFLOAD_OPS):
            return Where("copies", above.layer, above.phase)
        return Where(above.category, above.layer, above.phase, above.dequant or "dequantize" in name)

    def where(self, evt) -> Where:
        """The :class:`Where` of a CPU event: by its innermost scope range, or its backward node's forward op."""
        chain, node, top = [], evt, _NOWHERE
        while node is not None:
            hit = self._memo.get(id(node))
            if hit is not None:
                top = hit
                break
            if _is_backward_node(node):
                top = self._backward(node)
                break
            chain.append(node)
            node = node.cpu_parent
        for n in reversed(chain):            # from the outermost down
            top = self._memo[id(n)] = self._below(n, top)
        return top

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

    def op_of(self, evt):
        """The op whose shapes describe ``evt``'s work: its launcher (device) or itself (CPU), up past runtime calls."""
        node = self.launcher(evt) if _is_device(evt) else evt
        while node is not None and (_RUNTIME.match(node.name) or "::" not in node.name
                                    or node.name.startswith(("autograd::", LABEL_PREFIX))):
            node = node.cpu_parent
        return node

    def place(self, evt) -> Where:
        """The :class:`Where` of a unit of work -- a device activity (through its launching op) or a CPU op; work
        under a ``dequantize`` op (or a kernel so named) in a dense projection is ``nf4_dequant``."""
        if _is_device(evt):
            op = self.launcher(evt)
            w = self.where(op) if op is not None else _NOWHERE
            if evt.name.startswith(("Memcpy", "Memset")):
                return Where("copies", w.layer, w.phase)
            if op is None:          # a kernel no op launched (Triton's, from Python): known by its name at most
                return Where("nf4_dequant" if "dequant" in evt.name.lower() else "other")
        else:
            w = self.where(evt)
        cat = w.category if w.category in CATEGORIES and w.category != "idle" else "other"
        # bitsandbytes' fused gemm_4bit op dequantizes inside: its dequant kernels are known by their own name
        if cat == "dense" and (w.dequant or "dequant" in evt.name.lower()):
            cat = "nf4_dequant"
        return Where(cat, w.layer, w.phase)

    def category(self, evt) -> str:
        return self.place(evt).category


# --- kernels --------------------------------------------------------------------------------------------------------
def is_device_work(evt, annotations: AbstractSet = frozenset()) -> bool:
    """A kernel, memcpy or memset: not the device-side copy of a ``record_function`` range (kineto's
    ``gpu_user_annotation``), nor a synchronization record."""
    if not _is_device(evt) or getattr(evt, "is_user_annotation", False) or evt.name in annotations:
        return False
    kind = str(getattr(evt, "activity_type", "") or "").lower()
    return "annotation" not in kind and "sync" not in kind and "Sync" not in evt.name and \
        not evt.name.startswith((LABEL_PREFIX, STEP_LABEL, "ProfilerStep"))


def self_intervals(evt) -> list[tuple[float, float]]:
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


def is_cpu_kernel(evt) -> bool:
    """A host op that does work of its own (the module docstring's CPU kernels)."""
    name = evt.name
    return (not _is_device(evt) and not evt.is_async and "::" in name and name not in NOT_KERNELS
            and not name.startswith(("autograd::", "torch::autograd::", LABEL_PREFIX, STEP_LABEL, "ProfilerStep"))
            and not getattr(evt, "is_user_annotation", False))


@dataclass
class Kernel:
    """One unit of device work (microseconds from the trace start) and what it is known by."""

    name: str
    start: float
    end: float
    op: str | None          # the launching op's name
    op_key: int | None      # kernels of one op call share it (classified together)
    where: Where
    flops: float = 0.0      # of the whole op call
    nbytes: float = 0.0
    precision: str = "fp32"
    bound: str = "unknown"

    @property
    def us(self) -> float:
        return self.end - self.start


def kernels_of(prof, layers: dict[str, int] | None = None, *, cuda: bool,
               events: Sequence | None = None) -> tuple[list[Kernel], list]:
    """Every unit of work of a finished profile as a :class:`Kernel` (unclassified), and the profile's host events
    (:func:`host_events`; ``events``: others, e.g. torch's own ``profile.events()``)."""
    events = host_events(prof) if events is None else list(events)
    index = EventIndex(events, layers)
    dtypes: dict[int, list] | None = None

    def dtypes_of(op) -> list:
        nonlocal dtypes
        found = getattr(op, "input_dtypes", None)
        if found is not None:
            return list(found)
        if dtypes is None:
            dtypes = _input_dtypes(prof)
        return dtypes.get(op.id, [])
    device_type = "cuda" if cuda else "cpu"
    sizes: dict[int, tuple] = {}

    def measure(op) -> tuple:
        key = id(op)
        if key not in sizes:
            shapes = list(getattr(op, "structured_input_shapes", None) or getattr(op, "input_shapes", None) or [])
            types = dtypes_of(op)
            concrete = list(getattr(op, "concrete_inputs", None) or [])
            first = next((d for d in types if d in ("c10::BFloat16", "c10::Half", "float", "double")), None)
            sizes[key] = (op_flops(op.name, shapes, concrete, getattr(op, "flops", 0) or 0),
                          op_bytes(op.name, shapes, types, 2 if cuda else 4), precision(first, device_type))
        return sizes[key]

    out: list[Kernel] = []
    if cuda:
        annotations = {e.name for e in events if not _is_device(e) and getattr(e, "is_user_annotation", False)}
        for e in device_events(prof):
            if not is_device_work(e, annotations):
                continue
            op = index.op_of(e)
            flops, nbytes, prec = measure(op) if op is not None and not e.name.startswith(("Memcpy", "Memset")) \
                else (0.0, 0.0, "fp32")
            out.append(Kernel(e.name, e.time_range.start, e.time_range.end, op.name if op is not None else None,
                              id(op) if op is not None else None, index.place(e), flops, nbytes, prec))
        return out, events
    for e in events:
        if is_cpu_kernel(e):
            flops, nbytes, prec = measure(e)
            where = index.place(e)
            out.extend(Kernel(e.name, s, t, e.name, id(e), where, flops, nbytes, prec) for s, t in self_intervals(e))
    return out, events


def classify_kernels(kernels: Sequence[Kernel], peaks: Peaks) -> None:
    """Set each kernel's ``bound``: an op's kernels together (their summed time against its FLOPs and bytes)."""
    seconds: dict[int, float] = defaultdict(float)
    count: dict[int, int] = defaultdict(int)
    for k in kernels:
        if k.op_key is not None:
            seconds[k.op_key] += k.us / 1e6
            count[k.op_key] += 1
    for k in kernels:
        if k.name.startswith(("Memcpy", "Memset")):
            k.bound = "memory"
        elif k.op_key is None:
            k.bound = classify(k.us / 1e6, 0.0, 0.0, peaks)
        else:
            k.bound = classify(seconds[k.op_key], k.flops, k.nbytes, peaks, k.precision, count[k.op_key])


# --- time -----------------------------------------------------------------------------------------------------------
def union_us(intervals: Iterable[tuple[float, float]], window: tuple[float, float]) -> float:
    """Length of the union of ``intervals`` clipped to ``window`` (overlaps counted once)."""
    w0, w1 = window
    total, end = 0.0, w0
    for s, e in sorted((max(s, w0), min(e, w1)) for s, e in intervals):
        if e <= s:
            continue
        if s > end:
            total += e - s
        elif e > end:
            total += e - end
        end = max(end, e)
    return total


def split_window(items: Iterable[tuple], window: tuple[float, float], keys: Iterable[str],
                 background: Sequence[str] = ()) -> dict[str, float]:
    """Split ``window`` (start, end) among the keys of ``items`` -- ``(start, end, key, ...)`` -- and ``idle``, so that
    the values sum to its length: where work overlaps each active item gets an equal share; ``background`` keys
    (copies) count only where nothing else runs; time with nothing active is ``idle``."""
    w0, w1 = window
    if w1 < w0:
        raise ValueError(f"window ends before it starts: {window}")
    points = []
    for s, e, key, *_ in items:
        s, e = max(s, w0), min(e, w1)
        if e > s:
            points.append((s, 1, key))
            points.append((e, -1, key))
    points.sort(key=lambda p: (p[0], p[1]))
    out = dict.fromkeys([*keys, "idle"], 0.0)
    active: dict[str, int] = defaultdict(int)
    t = w0
    for time_, delta, key in points:
        if time_ > t:
            seg = time_ - t
            front = {c: n for c, n in active.items() if n > 0 and c not in background}
            back = [c for c in background if active.get(c, 0) > 0]
            if front:
                total = sum(front.values())
                for c, n in front.items():
                    out[c] = out.get(c, 0.0) + seg * n / total
            elif back:
                for c in back:
                    out[c] += seg / len(back)
            else:
                out["idle"] += seg
            t = time_
        active[key] += delta
    if w1 > t:
        out["idle"] += w1 - t
    return out


def gaps(kernels: Sequence[Kernel], window: tuple[float, float]) -> list[tuple[float, Kernel | None]]:
    """The idle gaps of ``window`` (microseconds), each with the kernel that ends it (None: the tail of the step)."""
    out: list[tuple[float, Kernel | None]] = []
    covered = window[0]
    for k in sorted((k for k in kernels if k.end > window[0] and k.start < window[1]), key=lambda k: k.start):
        if k.start > covered:
            out.append((k.start - covered, k))
        covered = max(covered, k.end)
    if window[1] > covered:
        out.append((window[1] - covered, None))
    return out


@dataclass
class StepProfile:
    """The kernels of one or a few profiled steps and the step windows (microseconds); figures are per step."""

    activity: str                       # "cuda" or "cpu"
    windows: list[tuple[float, float]]
    kernels: list[Kernel]
    peaks: Peaks
    num_layers: int = 0
    _inside: dict = field(default_factory=dict, repr=False)

    @property
    def steps(self) -> int:
        return len(self.windows)

    def inside(self, w: tuple[float, float]) -> list[Kernel]:
        if w not in self._inside:
            self._inside[w] = [k for k in self.kernels if w[0] <= k.start < w[1]]
        return self._inside[w]

    def _mean(self, fn: Callable[[tuple[float, float], list[Kernel]], float]) -> float:
        return sum(fn(w, self.inside(w)) for w in self.windows) / max(1, self.steps)

    @property
    def step_ms(self) -> float:
        return self._mean(lambda w, ks: (w[1] - w[0]) / 1e3)

    @property
    def busy_ms(self) -> float:
        return self._mean(lambda w, ks: union_us(((k.start, k.end) for k in ks), w) / 1e3)

    @property
    def idle_ms(self) -> float:
        return self.step_ms - self.busy_ms

    def launches(self, where: Callable[[Kernel], bool] = lambda k: True) -> float:
        """Kernel launches per step (on a CPU: op calls) of the kernels ``where`` selects."""
        return self._mean(lambda w, ks: len({(k.op_key if self.activity == "cpu" else id(k)) for k in ks if where(k)}))

    def kernel_ms(self, where: Callable[[Kernel], bool] = lambda k: True) -> float:
        """Summed kernel time per step (overlaps counted twice) of the kernels ``where`` selects."""
        return self._mean(lambda w, ks: sum(min(k.end, w[1]) - k.start for k in ks if where(k)) / 1e3)

    def group(self, key: Callable[[Kernel], Any]) -> dict[Any, tuple[float, float]]:
        """``{key(kernel): (kernel ms, launches)}`` per step, in one pass (what :meth:`kernel_ms` and
        :meth:`launches` give for one selection each)."""
        ms: dict[Any, float] = defaultdict(float)
        calls: dict[Any, set] = defaultdict(set)
        for w in self.windows:
            for k in self.inside(w):
                name = key(k)
                ms[name] += (min(k.end, w[1]) - k.start) / 1e3
                calls[name].add((w, k.op_key if self.activity == "cpu" else id(k)))
        n = max(1, self.steps)
        return {name: (ms[name] / n, len(calls[name]) / n) for name in ms}

    def split(self, key: Callable[[Kernel], str], keys: Sequence[str] = ()) -> dict[str, float]:
        """ms per step by ``key(kernel)``, and idle: summing to the step (:func:`split_window`)."""
        total: dict[str, float] = defaultdict(float, dict.fromkeys([*keys, "idle"], 0.0))
        for w in self.windows:
            for name, us in split_window(((k.start, k.end, key(k)) for k in self.inside(w)), w, keys).items():
                total[name] += us / 1e3 / self.steps
        return dict(total)

    def by_bound(self) -> dict[str, float]:
        """ms per step by what bounds the kernels (compute, memory, latency, unknown) and idle."""
        return self.split(lambda k: k.bound, BOUNDS)

    def waits(self) -> list[tuple[float, Kernel | None]]:
        """Every idle gap of every step (ms) with the kernel it held up (:func:`gaps`)."""
        return [(us / 1e3, k) for w in self.windows for us, k in gaps(self.inside(w), w)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepRecorder:
    """Profiles steps of ``model`` as they run: :meth:`start`, then :meth:`begin_step` / :meth:`end_step` around each
    step (or ``with recorder.step():``), then :meth:`stop` -> :class:`StepProfile`. The driver may be a training
    callback: the step is whatever runs between the two calls."""

    def __init__(self, model: nn.Module | None, device: torch.device | str, *, peaks: Peaks | None = None,
                 shapes: bool = True):
        self.model = model
        self.device = torch.device(device)
        self.peaks = peaks
        self.shapes = shapes          # record shapes and FLOPs (what the bounds need; on a CPU it slows every op)
        self.prof: Any = None              # the torch profiler, once started
        self._stack: contextlib.ExitStack | None = None
        self._range: Any = None

    def start(self) -> "StepRecorder":
        from torch.profiler import ProfilerActivity

        from .profiling import quiet_profiler

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._stack = contextlib.ExitStack()
        if self.model is not None:
            self._stack.enter_context(ScopeLabels(self.model))
        self.prof = self._stack.enter_context(quiet_profiler(activities=activities, record_shapes=self.shapes,
                                                             with_flops=self.shapes))
        return self

    def begin_step(self) -> None:
        _sync(self.device)
        self._range = torch.profiler.record_function(STEP_LABEL)
        self._range.__enter__()

    def end_step(self) -> None:
        _sync(self.device)
        self._range.__exit__(None, None, None)
        self._range = None

    @contextlib.contextmanager
    def step(self):
        self.begin_step()
        try:
            yield
        finally:
            self.end_step()

    def close(self) -> None:
        """Stop without a result (after an error): the open step range closed, hooks removed, profiler stopped."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self._stack is not None:
            self._stack.close()
            self._stack = None

    def stop(self) -> StepProfile:
        if self._range is not None:
            self.end_step()
        self.close()
        return profile_of(self.prof, self.model, self.device, peaks=self.peaks)


def profile_of(prof, model: nn.Module | None, device: torch.device | str, *, peaks: Peaks | None = None) -> StepProfile:
    """The :class:`StepProfile` of a finished profile whose steps ran inside :data:`STEP_LABEL` ranges."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    layers = layer_paths(model) if model is not None else {}
    kernels, events = kernels_of(prof, layers, cuda=cuda)
    windows = sorted((e.time_range.start, e.time_range.end) for e in events
                     if e.name == STEP_LABEL and not _is_device(e))
    if not windows:
        raise ValueError(f"no {STEP_LABEL!r} range in the profile")
    peaks = peaks or device_peaks(device)
    classify_kernels(kernels, peaks)
    return StepProfile("cuda" if cuda else "cpu", windows, kernels, peaks, len(set(layers.values())))


def profile_step(run: Callable[[], Any], *, model: nn.Module | None, device: torch.device | str, steps: int = 1,
                 peaks: Peaks | None = None) -> StepProfile:
    """Profile ``steps`` calls of ``run()`` (one training step each) with ``model``'s modules scoped."""
    rec = StepRecorder(model, device, peaks=peaks).start()
    try:
        for _ in range(steps):
            with rec.step():
                run()
    except BaseException:
        rec.close()
        raise
    return rec.stop()


__all__ = ["CATEGORIES", "WORK", "LABEL_PREFIX", "STEP_LABEL", "NOT_KERNELS", "label", "module_categories",
           "layer_paths", "ScopeLabels", "Where", "EventIndex", "HostEvent", "host_events", "device_events",
           "is_device_work", "self_intervals",
           "is_cpu_kernel", "Kernel", "kernels_of", "classify_kernels", "union_us", "split_window", "gaps",
           "StepProfile", "StepRecorder", "profile_of", "profile_step"]
