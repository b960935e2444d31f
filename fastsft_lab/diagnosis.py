"""Diagnose your own training step: what bounds it, where its host syncs come from, and what each switch of
:func:`fastsft_lab.apply` would win on it -- predicted from the step's own measured costs, then measured::

    diagnosis = fastsft_lab.diagnose(model, batch, autocast=torch.bfloat16)   # the step you train
    print(diagnosis)                                      # the report (paste it)
    print(diagnosis.apply_and_measure(model, batch))      # the suggested switches on: prediction beside measurement

One warm step (after ``warmup`` steps) is measured three ways, each leaving the model as it was (gradients kept):

* **timed** without the profiler, ``repeats`` times (the step time: the median; the peak memory);
* **host syncs** counted by :class:`~fastsft_lab.profiling.SyncCounter`, each with the module it ran in and the source
  line that asked the device for an answer;
* **profiled** kernel by kernel (:mod:`fastsft_lab.step_profile`): each kernel's category (attention, experts, LoRA,
  loss + head, ...), decoder layer and phase -- forward, backward, or a checkpoint's recompute -- and what bounds it
  (:mod:`fastsft_lab.roofline`: compute, memory, latency). On a GPU the profiled idle time is re-based on the timed
  step (idle = step - busy: the profiler's own host overhead is not the step's), and each idle gap is charged to the
  kernel that ended it ("waits": the device waited for that launch).

The model is the one you train, as wrapped (PEFT, DDP and ``torch.compile`` seen through), the step yours: the
default runs ``model(**batch).loss.backward()`` under ``torch.autocast(dtype=autocast)``; ``step=`` takes your own.
In a Trainer, :class:`fastsft_lab.callbacks.DiagnoseCallback` diagnoses the Trainer's own steps instead.

The report: step time; device busy, idle and its share; time by bound; kernel launches per step and per decoder layer
(by phase); host syncs and where they come from; the recompute's share; memory peak and headroom; the time of each
category; and, for every switch, a :class:`~fastsft_lab.predict.Prediction` from the measured costs
(:mod:`fastsft_lab.predict`), or the reason it does not apply.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import textwrap
import warnings
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from ._compat import compiled_in_place
from .structure import base_model, decoder_layers, model_device, unwrap
from .predict import COSTS, MEMORY_SHARE, Costs, Prediction, predict, size
from .profiling import SyncCounter, time_ms
from .roofline import ATTENTION_OPS, Peaks, achieved
from .step_profile import WORK, Kernel, StepProfile, layer_paths, module_categories, profile_step

# the attention kernels proper: SDPA / flash / efficient attention, and eager attention's matmuls and softmax
_ATTENTION_CORE = ATTENTION_OPS | {"bmm", "baddbmm", "_softmax", "_softmax_backward_data", "_safe_softmax"}
_MATMULS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_", "matmul", "linear", "_grouped_mm"}
WIDTH = 118                     # the report's lines (a notebook cell shows 120 characters without wrapping)


def _restore(before, args: dict) -> dict:
    """apply()'s arguments that put the switches of ``args`` back as ``before`` (a ModelState) had them."""
    back = {"packed_attention": before.packed or "off", "packed_metadata_cache": before.packed_cache,
            "moe_routing": before.moe_routing or "off", "fused_loss": before.fused_loss,
            "fused_lora": before.fused_lora, "fused_dequant": before.fused_dequant,
            "memory_budget": None if before.checkpointing == "plan" else "off",
            "offload_buffers": before.offload_buffers or "off"}
    if not before.packed:
        back["packed_metadata_cache"] = None           # off with packed attention
    return {k: back[k] for k in args if back.get(k) is not None}


def _short(op: str | None) -> str:
    return (op or "").removeprefix("aten::")


# --- the input --------------------------------------------------------------------------------------------------------
def check_inputs(model: Any, batch: Any, step: Callable | None = None) -> None:
    """One-line errors for what :func:`diagnose` cannot measure."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"diagnose() takes a transformers causal LM (an nn.Module), got {type(model).__name__}")
    try:
        decoder_layers(model)
    except ValueError:
        raise ValueError(f"{type(base_model(model)).__name__} is not a transformers causal LM with decoder layers "
                         "(model.model.layers): diagnose() measures a causal LM's training step") from None
    head = getattr(base_model(model), "get_output_embeddings", lambda: None)()
    if head is None:
        raise ValueError(f"{type(base_model(model)).__name__} has no LM head: diagnose() measures a causal LM's "
                         "training step (a *ForCausalLM)")
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch must be a dict of model inputs (input_ids, labels, ...), got {type(batch).__name__}")
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor):
        raise ValueError(f"batch has no 'input_ids' tensor (its keys: {', '.join(map(str, batch)) or 'none'})")
    if step is None and batch.get("labels") is None:
        raise ValueError("batch has no 'labels': a training step needs a loss (labels=input_ids to train on every "
                         "token), or pass step=<your own forward + backward>")
    device = model_device(model)
    if ids.device != device:
        raise ValueError(f"batch is on {ids.device}, the model on {device}: move the batch to the model's device")
    if not model.training:
        raise ValueError("the model is in eval mode: call model.train() (a training step's checkpointing and dropout "
                         "run in training mode only)")


def _batch_facts(inputs: Mapping) -> dict:
    """Tokens, rows, packing and padding of the batch the step saw (host copies, outside the step)."""
    ids = inputs["input_ids"]
    rows, row_tokens = (ids.shape[0], ids.shape[-1]) if ids.dim() > 1 else (1, ids.shape[-1])
    facts = {"tokens": int(ids.numel()), "rows": int(rows), "row_tokens": int(row_tokens), "packed": False,
             "cross_pairs": 0.0, "within_pairs": 0, "padding": 0.0, "sequences": int(rows)}
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        facts["padding"] = 1.0 - float(mask.float().mean())
    pos = inputs.get("position_ids")
    if isinstance(pos, torch.Tensor):
        pos = pos.detach().cpu().expand(rows, row_tokens)
        within = cross = 0
        sequences = 0
        for row in pos.tolist():
            starts = [i for i, p in enumerate(row) if p == 0 or i == 0] + [len(row)]
            lengths = [b - a for a, b in zip(starts, starts[1:])]
            sequences += len(lengths)
            within += sum(n * (n + 1) // 2 for n in lengths)
            cross += row_tokens * (row_tokens + 1) // 2
        facts["sequences"] = sequences
        facts["packed"] = sequences > rows or inputs.get("packed_metadata") is not None
        facts["cross_pairs"] = 1.0 - within / cross if cross else 0.0
        facts["within_pairs"] = within
    return facts


def _attention_pair_flops(config: Any) -> float:
    """The FLOPs one causal (query, key) pair costs a decoder layer's exact attention, forward only: ``Q K^T`` and
    ``P V`` over every head (2 x 2 x heads x head_dim); 0 where the config does not say its heads."""
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return 0.0
    dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads
    return 4.0 * heads * dim


def _compute_rate(prof: StepProfile) -> float:
    """The FLOP/s the step's compute-bound kernels reach (their ops' FLOPs over their time; 0: none measured)."""
    ops = {k.op_key: k.flops for k in prof.kernels if k.bound == "compute" and k.op_key is not None}
    seconds = prof.kernel_ms(lambda k: k.bound == "compute") * max(1, prof.steps) / 1e3
    return achieved(seconds, sum(ops.values()), 0.0)["flops_per_s"]


# --- what one diagnosis measures ------------------------------------------------------------------------------------
class Session:
    """What one diagnosis measures, filled by a driver -- :func:`diagnose`'s own loop, or
    :class:`~fastsft_lab.callbacks.DiagnoseCallback` around a Trainer's steps -- then read by :meth:`diagnosis`."""

    def __init__(self, model: nn.Module, *, peaks: Peaks | None = None):
        self.model = model
        self.inner = unwrap(model)
        self.base = base_model(model)
        self.device = model_device(self.inner)
        self.peaks = peaks
        self.times_ms: list[float] = []
        self.peak: int | None = None
        self.memory: tuple[int, int | None, int | None] | None = None     # allocated between steps, total, free
        self.counter: SyncCounter | None = None
        self.profile: StepProfile | None = None
        self.inputs: dict | None = None           # the causal LM's keyword inputs in the step
        self.autocast: torch.dtype | None = None  # the autocast dtype the step's forward ran under
        self._layer_calls: dict[str, tuple[int, tuple, dict]] = {}
        self.layer_memory: tuple[list, list] | None = None       # per layer: activation bytes, input bytes
        self.link: float | None = None
        self._prefix = next(p for p, m in self.inner.named_modules() if m is self.base)   # "" or PEFT's path
        self._cut = len(self._prefix) + 1 if self._prefix else 0
        # torch.compile'd (the model, or modules compiled in place): module hooks would change what is compiled (and
        # recompile it inside the measured step), so the kernels are not scoped and the syncs not placed in modules
        self.compiled = _compiled(model) or any(compiled_in_place(m) for m in self.inner.modules())

    def rel(self, path: str) -> str:
        """A module path of the user's model as the causal LM names it (``model.layers.3.mlp``)."""
        return path[self._cut:]

    def sync_counter(self) -> SyncCounter:
        modules = {self.rel(p): m for p, m in self.inner.named_modules()
                   if p.startswith(self._prefix + ".") or (p and not self._prefix)} if not self.compiled else {}
        self.counter = SyncCounter(device=self.device, modules=modules, locate=True)
        return self.counter

    def read_memory(self) -> None:
        """Between steps: what is allocated and what the device has free (CUDA)."""
        if self.device.type == "cuda":
            from .offload.plan import device_memory

            total, free = device_memory(self.device)
            self.memory = (torch.cuda.memory_allocated(self.device), total, free)

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        """Hooks that keep the step's inputs, its autocast dtype and one call of each kind of decoder layer."""
        from .offload.plan import layer_kinds

        kinds = layer_kinds(self.inner)
        seen: set[str] = set()

        def model_hook(module, args, kwargs):      # the batch, as the training loop passes it
            if self.inputs is None:
                self.inputs = {**({"input_ids": args[0]} if args else {}), **kwargs}

        def lm_hook(module, args, kwargs):         # the autocast the forward runs under (a wrapper may set it)
            kind = self.device.type
            if torch.is_autocast_enabled(kind):
                self.autocast = torch.get_autocast_dtype(kind)

        def layer_hook(index):
            def hook(module, args, kwargs):
                if kinds[index] not in seen and args and isinstance(args[0], torch.Tensor):
                    seen.add(kinds[index])
                    self._layer_calls[kinds[index]] = (index, args, kwargs)
            return hook

        handles = [self.inner.register_forward_pre_hook(model_hook, with_kwargs=True),
                   self.base.register_forward_pre_hook(lm_hook, with_kwargs=True)]
        handles += [layer.register_forward_pre_hook(layer_hook(i), with_kwargs=True)
                    for i, layer in enumerate(decoder_layers(self.inner))]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def measure_layers(self) -> None:
        """Where layers are checkpointed on a GPU: the bytes one layer of each kind keeps for its backward without
        checkpointing (autograd's saved tensors, weights left out) beside its input, and the host link's speed."""
        if self.device.type != "cuda" or not self._layer_calls:
            self._layer_calls.clear()
            return
        from .offload.plan import layer_kinds

        layers, kinds = decoder_layers(self.inner), layer_kinds(self.inner)
        per_kind = {kind: _activation_bytes(layers[i], args, kwargs, self.autocast)
                    for kind, (i, args, kwargs) in self._layer_calls.items()}
        first = next(iter(self._layer_calls.values()))[1][0]
        self._layer_calls.clear()
        if all(k in per_kind for k in kinds):
            self.layer_memory = ([per_kind[k][0] for k in kinds], [per_kind[k][1] for k in kinds])
        self.link = _link_speed(first)

    def diagnosis(self) -> "Diagnosis":
        return _build(self)


def _compiled(model: nn.Module) -> bool:
    """Whether a ``torch.compile`` wrapper is among the wrappers around ``model``."""
    from ._compat import compiled_inner, ddp_inner

    inner: Any = model
    for _ in range(8):
        if compiled_inner(inner) is not None:
            return True
        inner = ddp_inner(inner)
        if inner is None:
            return False
    return False


def _activation_bytes(layer: nn.Module, args: tuple, kwargs: dict, autocast: torch.dtype | None) -> tuple[int, int]:
    """(bytes autograd saves in one plain forward of ``layer``, bytes of its input): the weights, buffers and the
    call's other inputs (rotary tables, masks: shared by every layer) left out."""
    exclude = {t.untyped_storage().data_ptr() for t in [*layer.parameters(), *layer.buffers()]}
    exclude |= {v.untyped_storage().data_ptr() for v in kwargs.values() if isinstance(v, torch.Tensor)}
    for v in kwargs.values():
        if isinstance(v, (tuple, list)):
            exclude |= {t.untyped_storage().data_ptr() for t in v if isinstance(t, torch.Tensor)}
    x = args[0].detach().requires_grad_(True)
    saved: dict[int, int] = {}

    def pack(t):
        with contextlib.suppress(RuntimeError, NotImplementedError):
            storage = t.untyped_storage()
            if storage.data_ptr() not in exclude:
                saved[storage.data_ptr()] = storage.nbytes()
        return t

    cast = torch.autocast(x.device.type, dtype=autocast) if autocast else contextlib.nullcontext()
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), cast:
        out = layer.forward(x, *args[1:], **kwargs)
    del out
    return sum(saved.values()), x.untyped_storage().nbytes()


def _link_speed(x: torch.Tensor) -> float:
    """bytes/s of pinned host <-> device copies of a layer input (the mean of both directions)."""
    import time

    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    dev = torch.empty_like(x)
    best = []
    for copy in (lambda: host.copy_(dev, non_blocking=True), lambda: dev.copy_(host, non_blocking=True)):
        times = []
        for _ in range(4):
            torch.cuda.synchronize(x.device)
            t0 = time.perf_counter()
            copy()
            torch.cuda.synchronize(x.device)
            times.append(time.perf_counter() - t0)
        best.append(min(times[1:]))
    return x.numel() * x.element_size() / (sum(best) / 2)


# --- the step, run as given -------------------------------------------------------------------------------------------
class StepRunner:
    """One training step of ``model`` on ``batch`` -- ``step(model, batch)`` or ``model(**batch).loss.backward()``
    under ``torch.autocast(dtype=autocast)`` -- each on fresh gradients; :meth:`grads_kept` puts the model's own
    gradients back after."""

    def __init__(self, model: nn.Module, batch: Mapping, *, autocast: torch.dtype | None = None,
                 step: Callable | None = None):
        self.model, self.batch, self.autocast, self.step = model, batch, autocast, step
        self.device = model_device(model)
        self.params = [p for p in model.parameters() if p.requires_grad]

    def __call__(self) -> None:
        for p in self.params:
            p.grad = None
        if self.step is not None:
            self.step(self.model, self.batch)
            return
        cast = torch.autocast(self.device.type, dtype=self.autocast) if self.autocast else contextlib.nullcontext()
        with cast:
            out = self.model(**self.batch)
        loss = out.loss if hasattr(out, "loss") else out[0]
        if loss is None:
            raise ValueError("the model returned no loss for this batch: give it labels")
        loss.backward()

    @contextlib.contextmanager
    def grads_kept(self):
        saved = [(p, p.grad) for p in self.params]
        try:
            yield
        finally:
            for p, g in saved:
                p.grad = g


def diagnose(model: nn.Module, batch: Mapping, *, autocast: torch.dtype | None = None, step: Callable | None = None,
             warmup: int = 2, repeats: int = 3, peaks: Peaks | None = None) -> "Diagnosis":
    """Measure one warm training step of ``model`` on ``batch`` and predict what each switch would win on it.

    Args:
        model: the causal LM you train, as you wrap it (PEFT, DDP, ``torch.compile``), in training mode.
        batch: its keyword inputs (``input_ids``, ``labels``, ``position_ids``, ...) on the model's device.
        autocast: the dtype your forward runs under (``torch.bfloat16`` as ``SFTTrainer(bf16=True)``), or None.
        step: ``step(model, batch)``: your own forward + backward instead of ``model(**batch).loss.backward()``.
        warmup: steps run before measuring (2: a memory plan measures at step 1 and solves at step 2).
        repeats: timed steps (their median is the step time).
        peaks: the device's peaks (default: its data sheet, else measured here: :mod:`fastsft_lab.roofline`).

    Returns:
        A :class:`Diagnosis` (``print`` it; ``.to_dict()`` for JSON; ``.apply_and_measure(model, batch)``).
    """
    check_inputs(model, batch, step)
    if warmup < 1 or repeats < 1:
        raise ValueError(f"warmup and repeats must be >= 1, got warmup={warmup}, repeats={repeats}")
    run = StepRunner(model, batch, autocast=autocast, step=step)
    session = Session(model, peaks=peaks)
    device = session.device
    if session.compiled:
        warmup = max(warmup, 2)     # the step that keeps the inputs runs hooks: one more to be back on the graph
    with run.grads_kept():
        with session.capture():                 # the first warm-up step keeps the inputs
            run()
        for _ in range(warmup - 1):             # the others run as measured (a compiled model back on its graph)
            run()
        for p in run.params:
            p.grad = None
        session.read_memory()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        session.times_ms = [time_ms(run, device, warmup=0, reps=1)["median"] for _ in range(repeats)]
        if device.type == "cuda":
            session.peak = int(torch.cuda.max_memory_allocated(device))
        with session.sync_counter():
            run()
        session.profile = profile_step(run, model=None if session.compiled else session.inner, device=device,
                                       peaks=peaks)
        if session.profile.kernel_ms(lambda k: k.where.phase == "recompute") > 0:
            session.measure_layers()
        session._layer_calls.clear()
    result = session.diagnosis()
    result._replay = {"autocast": autocast, "step": step, "warmup": warmup, "repeats": repeats, "peaks": peaks,
                      "own": True}
    result._batch = batch
    return result


# --- from measurements to a diagnosis ---------------------------------------------------------------------------------
def _op_bytes_per_step(prof: StepProfile, where: Callable[[Kernel], bool]) -> float:
    ops = {k.op_key: k.nbytes for k in prof.kernels if where(k) and k.op_key is not None}
    return sum(ops.values()) / max(1, prof.steps)


def _longest_prefix(path: str, table: dict[str, Any]) -> Any:
    while True:
        if path in table:
            return table[path]
        if "." not in path:
            return None
        path = path.rsplit(".", 1)[0]


def _build(s: Session) -> "Diagnosis":
    from .env import device_profile
    from .families import FAMILIES
    from .model_state import state
    from .moe.modules import experts_modules

    prof = s.profile
    if prof is None or not s.times_ms:
        raise ValueError("nothing was measured: the diagnosis needs a timed and a profiled step")
    cuda = prof.activity == "cuda"
    step_ms = statistics.median(s.times_ms)
    busy, profiled_idle = prof.busy_ms, prof.idle_ms
    idle = max(0.0, step_ms - busy) if cuda else profiled_idle
    scale = (idle / profiled_idle if profiled_idle > 0 else 0.0) if cuda else 1.0
    bounds = prof.by_bound()
    bounds["idle"] = idle
    waits: dict[str, float] = defaultdict(float)
    for ms, k in prof.waits():
        waits[k.where.category if k is not None else "tail"] += ms * scale

    cats = {s.rel(p): c for p, (_, c) in module_categories(s.inner).items()}
    lpaths = {s.rel(p): i for p, i in layer_paths(s.inner).items()}
    sites: list[dict] = []
    syncs_by_cat: Counter = Counter()
    counter = s.counter
    for (module, site, kind), n in (counter.sites.items() if counter is not None else []):
        cat = _longest_prefix(module, cats) or "other"
        syncs_by_cat[cat] += n
        sites.append({"module": module, "site": site, "kind": kind, "count": n, "category": cat,
                      "layer": _longest_prefix(module, lpaths)})
    sites.sort(key=lambda r: -r["count"])

    layers = prof.num_layers
    # one pass each: by category and bound; by phase and layer
    by_cat = prof.group(lambda k: (k.where.category, k.bound))
    by_layer = prof.group(lambda k: (k.where.phase, k.where.layer))
    per_layer = {ph: sum(n for (p, i), (_, n) in by_layer.items() if p == ph and i is not None) / max(1, layers)
                 for ph in ("forward", "backward", "recompute")}
    categories = []
    for cat in WORK:
        row: dict[str, Any] = {"category": cat, "kernel_ms": sum(ms for (c, _), (ms, _) in by_cat.items() if c == cat),
               "launches": sum(n for (c, _), (_, n) in by_cat.items() if c == cat),
               "waits_ms": waits.get(cat, 0.0), "syncs": syncs_by_cat.get(cat, 0),
               **{b: by_cat.get((cat, b), (0.0, 0))[0] for b in ("compute", "memory", "latency")}}
        if row["kernel_ms"] or row["syncs"] or row["waits_ms"] > 0.05:
            categories.append(row)

    inputs = s.inputs or {}
    facts = _batch_facts(inputs) if "input_ids" in inputs else {}
    head = s.base.get_output_embeddings()
    dtype = s.autocast or getattr(getattr(head, "weight", None), "dtype", torch.float32)
    family = FAMILIES.get(getattr(s.base.config, "model_type", None))
    st = state(s.inner).as_dict()
    recompute = [by_layer.get(("recompute", i), (0.0, 0))[0] for i in range(layers)]
    backward = [by_layer.get(("backward", i), (0.0, 0))[0] for i in range(layers)]
    allocated, total, free = s.memory if s.memory is not None else (None, None, None)
    budget = int(allocated + MEMORY_SHARE * free) if allocated is not None and free is not None else None
    mods = list(s.inner.modules())

    def in_cat(cat: str, pred: Callable[[Kernel], bool] = lambda k: True) -> Callable[[Kernel], bool]:
        return lambda k: k.where.category == cat and pred(k)

    # attention: one fused kernel (SDPA, flash, flex) does the T x T work, or -- the model's own eager attention --
    # the scores are materialised and every kernel over them (matmuls, mask, softmax, casts, sinks) grows with the pairs
    fused = prof.kernel_ms(in_cat("attention", lambda k: _short(k.op) in ATTENTION_OPS)) > 0
    quadratic: Callable[[Kernel], bool] = ((lambda k: _short(k.op) in _ATTENTION_CORE) if fused
                                           else (lambda k: k.bound != "latency"))
    recomputed = sum(1 for i in range(layers) if by_layer.get(("recompute", i), (0.0, 0))[0] > 0)
    passes = 1.0 + 2.5 + recomputed / max(1, layers)        # forward, backward (five matmuls to two), recompute
    within_flops = (facts.get("within_pairs", 0) * _attention_pair_flops(s.base.config) * passes
                    * (layers or getattr(s.base.config, "num_hidden_layers", 0)))

    costs = Costs(
        step_ms=step_ms, device=prof.activity, state=st, num_layers=layers,
        packed=facts.get("packed", False), row_tokens=facts.get("row_tokens", 0),
        cross_pairs=facts.get("cross_pairs", 0.0), padding=facts.get("padding", 0.0),
        stock_packs=family.attention.stock_packs if family is not None else True,
        attention_ms=prof.kernel_ms(in_cat("attention", quadratic)), attention_fused=fused,
        attention_within_flops=within_flops, compute_flops_per_s=_compute_rate(prof),
        attention_waits_ms=waits.get("attention", 0.0),
        attention_small_ms=prof.kernel_ms(in_cat("attention", lambda k: k.bound == "latency"
                                                 and _short(k.op) not in _ATTENTION_CORE)),
        attention_syncs=syncs_by_cat.get("attention", 0),
        experts=bool(experts_modules(s.inner)), experts_waits_ms=waits.get("experts", 0.0),
        experts_syncs=syncs_by_cat.get("experts", 0), experts_launches=prof.launches(in_cat("experts")),
        tokens=facts.get("tokens", 0), vocab=int(getattr(head, "out_features", 0) or 0),
        itemsize=torch.empty((), dtype=dtype).element_size(), fused_head=bool(inputs.get("fused_lm_head")),
        loss_memory_ms=prof.kernel_ms(in_cat("loss_head", lambda k: k.bound == "memory")),
        loss_memory_bytes=_op_bytes_per_step(prof, in_cat("loss_head", lambda k: k.bound == "memory")),
        lora_layers=sum(1 for _, (_, c) in module_categories(s.inner).items() if c == "lora"),
        lora_glue_ms=prof.kernel_ms(in_cat("lora", lambda k: _short(k.op) not in _MATMULS)),
        nf4_layers=sum(1 for m in mods if type(m).__name__ == "Linear4bit"),
        dequant_backward_ms=prof.kernel_ms(in_cat("nf4_dequant", lambda k: k.where.phase == "backward")),
        recompute_ms=sum(recompute), recompute_per_layer=recompute, backward_per_layer=backward,
        layer_activations=s.layer_memory[0] if s.layer_memory else [],
        layer_inputs=s.layer_memory[1] if s.layer_memory else [],
        peak_bytes=s.peak, budget_bytes=budget, link_bytes_per_s=s.link, scoped=not s.compiled)
    backend = device_profile(s.device).packed_backends[0] if s.device.type == "cuda" else "sdpa"
    name = type(s.base).__name__ + (" (PEFT)" if s.inner is not s.base else "")
    where = torch.cuda.get_device_name(s.device) if cuda else "CPU"
    return Diagnosis(
        model=name, device=where, autocast=str(s.autocast).replace("torch.", "") if s.autocast else None,
        batch=(f"{facts['rows']} x {facts['row_tokens']} tokens, {facts['sequences']} "
               f"sequence{'s' if facts['sequences'] != 1 else ''}" + (" packed" if facts["packed"] else "")
               ) if facts else "?",
        step_ms=step_ms, profiled_step_ms=prof.step_ms, busy_ms=busy, idle_ms=idle, bounds=bounds,
        launches=prof.launches(), launches_per_layer=per_layer, syncs=counter.total if counter is not None else 0,
        sync_sites=sites, recompute_ms=costs.recompute_ms,
        memory={"peak": s.peak, "total": total, "free": free, "budget": budget,
                "headroom": budget - s.peak if budget is not None and s.peak is not None else None},
        categories=categories, predictions=predict(costs, backend=backend), peaks=prof.peaks.source, costs=costs,
        waits_tail_ms=waits.get("tail", 0.0),
        notes=["torch.compile: kernels are not placed in modules or layers (module hooks would change what is "
               "compiled); diagnose the uncompiled model for where the time goes"] if s.compiled else [])


# --- the report -------------------------------------------------------------------------------------------------------
def _pct(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole else "-"


@dataclass
class Diagnosis:
    """What one step costs and what each switch would win on it (the module docstring). ``print`` it for the
    report; :meth:`to_dict` for JSON; :meth:`suggested` for :func:`fastsft_lab.apply`'s arguments."""

    model: str
    device: str
    autocast: str | None
    batch: str
    step_ms: float                 # timed without the profiler (median)
    profiled_step_ms: float
    busy_ms: float                 # device busy (union of kernels)
    idle_ms: float                 # the step's rest: the device waiting for the host (a CPU: host time outside ops)
    bounds: dict                   # ms by what bounds the kernels (compute, memory, latency, unknown) and idle
    launches: float                # kernel launches per step (a CPU: op calls)
    launches_per_layer: dict       # per decoder layer, by phase
    syncs: int                     # host syncs per step
    sync_sites: list               # each: module, site (file:line), kind, count, category, layer
    recompute_ms: float
    memory: dict                   # peak, total, free, budget (90% of free), headroom: bytes (None: unknown)
    categories: list               # per category: kernel ms, launches, waits, syncs, ms by bound
    predictions: list              # a Prediction per switch
    peaks: str                     # where the device's peaks come from
    costs: Costs = field(repr=False)
    waits_tail_ms: float = 0.0     # idle at the step's end (after the last kernel)
    notes: list = field(default_factory=list)     # what this diagnosis could not see, and why
    _replay: dict = field(default_factory=dict, repr=False)
    _batch: Any = field(default=None, repr=False)

    @property
    def total_ms(self) -> float:
        """The step its parts sum to: the timed step on a GPU, the profiled one on a CPU."""
        return self.busy_ms + self.idle_ms

    @property
    def idle_share(self) -> float:
        return self.idle_ms / self.total_ms if self.total_ms else 0.0

    @property
    def recompute_share(self) -> float:
        return self.recompute_ms / self.total_ms if self.total_ms else 0.0

    def prediction(self, switch: str) -> Prediction:
        return next(p for p in self.predictions if p.switch == switch)

    def suggested(self) -> dict:
        """:func:`fastsft_lab.apply`'s arguments for the switches predicted to save time."""
        return {p.switch: p.value for p in self.predictions if p.suggested}

    @property
    def predicted_step_ms(self) -> float:
        return self.step_ms - sum(p.saving_ms for p in self.predictions if p.suggested)

    def to_dict(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if not k.startswith("_") and k not in ("predictions", "costs")}
        out["predictions"] = [p.as_dict() for p in self.predictions]
        out["costs"] = self.costs.as_dict()
        out["suggested"] = self.suggested()
        return json.loads(json.dumps(out, default=str))

    def __str__(self) -> str:
        step, total = self.step_ms, self.total_ms
        b = self.bounds
        lines = [f"fastsft_lab.diagnose: {self.model} on {self.device}, autocast {self.autocast or 'off'}, "
                 f"{self.batch}",
                 f"step {step:.1f} ms (profiled {self.profiled_step_ms:.1f}); device busy {self.busy_ms:.1f} ms, "
                 f"idle {self.idle_ms:.1f} ms ({self.idle_share:.0%})"
                 + ("  [a CPU: idle is host time outside ops]" if self.costs.device != "cuda" else ""),
                 "time by bound: " + " | ".join(f"{k} {b[k]:.1f} ms {_pct(b[k], total)}" for k in
                                                ("compute", "memory", "latency", "unknown", "idle")
                                                if k != "unknown" or b.get(k, 0.0) >= 0.05),
                 f"kernel launches {self.launches:,.0f} per step; per decoder layer "
                 + ", ".join(f"{ph} {n:.0f}" for ph, n in self.launches_per_layer.items() if n),
                 f"host syncs {self.syncs} per step" + (":" if self.sync_sites else "")]
        for r in self.sync_sites[:5]:
            lines.append(f"  {r['count']:4d} x {r['kind']:<16s} {r['module'] or '<outside>'} -- {r['site']}")
        if len(self.sync_sites) > 5:
            lines.append(f"  ... and {sum(r['count'] for r in self.sync_sites[5:])} more at "
                         f"{len(self.sync_sites) - 5} other sites")
        lines.append(f"recompute {self.recompute_ms:.1f} ms ({self.recompute_share:.0%} of the step)")
        m = self.memory
        lines.append("memory: " + (f"peak {size(m['peak'])} of {size(m['total'])}; {MEMORY_SHARE:.0%} of the free "
                                   f"memory leaves {size(m['headroom'])} of headroom" if m.get("peak") is not None
                                   else "unknown on a CPU"))
        lines.append(f"peaks: {self.peaks}")
        lines += [f"note: {n}" for n in self.notes]
        lines.append(f"{'where the time goes':22s} {'kernel ms':>9s} {'compute':>8s} {'memory':>8s} {'latency':>8s} "
                     f"{'launches':>8s} {'waits ms':>8s} {'syncs':>5s}")
        for r in sorted(self.categories, key=lambda r: -r["kernel_ms"]):
            lines.append(f"{r['category']:22s} {r['kernel_ms']:9.1f} {r['compute']:8.1f} {r['memory']:8.1f} "
                         f"{r['latency']:8.1f} {r['launches']:8.0f} {r['waits_ms']:8.1f} {r['syncs']:5d}")
        lines.append(f"{'switch':30s} {'predicted':>10s}  the measured cost it rests on / why not")
        # one reason for every switch (a compiled model): said once
        same = not any(p.applies for p in self.predictions) and len({p.reason for p in self.predictions}) == 1
        if same:
            head = f"{'every switch':30s} {'-':>10s}  "
            lines += textwrap.wrap(self.predictions[0].reason, WIDTH, initial_indent=head,
                                   subsequent_indent=" " * len(head))
        for p in [] if same else self.predictions:
            if p.applies:
                what = f"{-p.saving_ms:+.1f} ms" if p.saving_ms else "0 ms"
                mem = f"; frees {size(p.memory_bytes)}" if p.memory_bytes > 0 else ""
                head, text = f"{p.switch + '=' + repr(p.value):30s} {what:>10s}  ", p.rests_on + mem
            else:
                head, text = f"{p.switch:30s} {'-':>10s}  ", p.reason
            lines += textwrap.wrap(text, WIDTH, initial_indent=head, subsequent_indent=" " * len(head))
        sug = self.suggested()
        if sug:
            args = ", ".join(f"{k}={v!r}" for k, v in sug.items())
            lines += textwrap.wrap(f"suggested: fastsft_lab.apply(model, {args}) -> predicted step "
                                   f"{self.predicted_step_ms:.1f} ms ({step / max(self.predicted_step_ms, 1e-9):.2f}x)",
                                   WIDTH, subsequent_indent="    ")
        else:
            lines.append("suggested: nothing -- no switch is predicted to save time on this step")
        return "\n".join(w for line in lines for w in (textwrap.wrap(line, WIDTH, subsequent_indent="    ")
                                                      if len(line) > WIDTH else [line]))

    def compare(self, after: "Diagnosis", applied: dict | None = None) -> "Comparison":
        """This step's predictions beside ``after``, the same step measured with ``applied`` switched on."""
        return Comparison(self, after, dict(self.suggested() if applied is None else applied))

    def apply_and_measure(self, model: nn.Module, batch: Mapping | None = None, *, switches: dict | None = None,
                          revert: bool = False) -> "Comparison":
        """Switch on the suggested switches (or ``switches``) with :func:`fastsft_lab.apply`, diagnose the step
        again as it was diagnosed, and return the prediction beside the measurement; ``revert`` switches them off
        again after (the model as it was)."""
        from .model_state import state
        from .toggles import apply

        batch = batch if batch is not None else self._batch
        if batch is None:
            raise ValueError("apply_and_measure needs the batch (a diagnosis from a callback: callback.batch)")
        args = dict(self.suggested() if switches is None else switches)
        if not args:
            raise ValueError("nothing to apply: no switch is predicted to save time on this step (pass switches=)")
        replay = {k: v for k, v in self._replay.items() if k != "own"}
        # like for like: a diagnosis of a Trainer's loop is measured again as diagnose() measures the step after
        first = self if self._replay.get("own") else diagnose(model, batch, **replay)
        before = state(model)
        apply(model, **args)
        try:
            after = diagnose(model, batch, **replay)
        finally:
            if revert:
                apply(model, **_restore(before, args))
                if state(model) != before:
                    warnings.warn(f"apply_and_measure(revert=True) left {state(model)}, was {before}", stacklevel=2)
        return first.compare(after, args)


@dataclass
class Comparison:
    """A diagnosis, the same step with ``applied`` switched on, and each switch's prediction beside the change of
    the measured cost it rested on."""

    before: Diagnosis
    after: Diagnosis
    applied: dict

    def rows(self) -> list[dict]:
        out = []
        for name, value in self.applied.items():
            p = next((q for q in self.before.predictions if q.switch == name), None)
            cost = COSTS.get(name, "")
            out.append({"switch": name, "value": value,
                        "predicted_ms": -(p.saving_ms if p is not None and p.applies else 0.0),
                        "cost": cost, "before": getattr(self.before.costs, cost, None) if cost else None,
                        "after": getattr(self.after.costs, cost, None) if cost else None})
        return out

    @property
    def predicted_step_ms(self) -> float:
        return self.before.step_ms - sum(-r["predicted_ms"] for r in self.rows())

    def to_dict(self) -> dict:
        return {"applied": self.applied, "rows": self.rows(), "step_ms": self.before.step_ms,
                "predicted_step_ms": self.predicted_step_ms, "measured_step_ms": self.after.step_ms}

    def __str__(self) -> str:
        b, a = self.before, self.after
        lines = [f"{'':30s} {'predicted':>10s} {'measured':>10s}",
                 f"{'step (ms)':30s} {self.predicted_step_ms:10.1f} {a.step_ms:10.1f}   before {b.step_ms:.1f} ms: "
                 f"predicted {b.step_ms / max(self.predicted_step_ms, 1e-9):.2f}x, measured "
                 f"{b.step_ms / max(a.step_ms, 1e-9):.2f}x"]
        for r in self.rows():
            def fmt(v):
                return "-" if v is None else (size(v) if "bytes" in r["cost"] else f"{v:.1f}")
            lines.append(f"{r['switch'] + '=' + repr(r['value']):30s} {r['predicted_ms']:+9.1f}  "
                         f"{r['cost'] or '-'}: {fmt(r['before'])} -> {fmt(r['after'])}")
        lines.append(f"{'host syncs':30s} {'':>10s} {b.syncs} -> {a.syncs}; launches {b.launches:,.0f} -> "
                     f"{a.launches:,.0f}; idle {b.idle_ms:.1f} -> {a.idle_ms:.1f} ms")
        if b.memory.get("peak") is not None and a.memory.get("peak") is not None:
            lines.append(f"{'peak memory':30s} {'':>10s} {size(b.memory['peak'])} -> {size(a.memory['peak'])}")
        return "\n".join(lines)


__all__ = ["diagnose", "Diagnosis", "Comparison", "Session", "StepRunner", "check_inputs"]
