"""The fastest exact checkpointing plan for a memory budget: keep what fits, recompute the rest, the cheap part first.

Checkpointing is all or nothing in transformers, TRL and Unsloth: every layer recomputes its forward, whatever memory
the GPU has left. Here each decoder layer gets one of five choices; the first four from the most memory and the least
time to the least memory and the most time::

    keep           plain autograd: every activation saved, nothing recomputed
    selective      torch's selective checkpoint: matmul and attention outputs saved, the cheap elementwise ops,
                   norms and activations recomputed (``create_selective_checkpoint_contexts``)
    checkpoint     the layer input kept on the GPU, the whole layer recomputed (transformers' own checkpointing)
    offload        the layer input offloaded to pinned host memory with the double buffer (this package's manager),
                   the whole layer recomputed; costs time only where a reload is longer than the backward it hides
                   behind
    offload_saved  plain autograd, every saved activation in pinned host memory, reloaded with the same double
                   buffer (:mod:`.saved`): keep's compute at offload's memory, for the time the host link cannot
                   hide -- the choice where the link is fast (NVLink C2C hosts, short rows); where it is slow the
                   cost model prices it out

Every choice computes the same numbers as plain training (a recompute runs the same kernels on the same inputs, the
RNG state replayed), so any mix of them is exact.

How a plan is made (:class:`MemoryPlanner`, switched on by ``apply(model, memory_budget=...)``):

1. step 1 runs with every layer offloaded (the smallest plan: it fits wherever any plan fits). The first call of
   each kind of layer (full and sliding-window attention differ) is measured on the step's own input, outside the
   step: each choice's forward + backward time and bytes held to the backward, and the host-link time of its input
   (:func:`measure_layer`; the times are medians of rounds that take one call of each, so that the device's clocks
   ramping up over the first step move every choice alike). The step's peak memory is read in three phases (CUDA):
   at the end of the forward (then the counter is reset), when the decoder layers' backward starts (the loss behind
   it) and when the first layer's backward starts.
2. at the start of step 2 the plan is solved (:func:`solve`): the per-layer choices that minimise the predicted
   step time with a predicted peak within the budget, exactly (a dynamic programme over the layers). The peak is
   the largest of the three phases, each moved by what the plan's layers hold there: in layer ``i``'s forward the
   layers before it hold what they keep beside its forward's most; at the loss every layer holds what it keeps;
   in layer ``i``'s backward the layers before it hold what they keep and layer ``i`` all its activations
   (:func:`fastsft_lab.offload.solver.alive`), so a kept last layer costs little more than the recompute already
   needed. The plan is logged and shown by :func:`fastsft_lab.state`.
3. a later batch with more tokens than the plan was made for re-plans on the host (token counts are shapes: no host
   sync); ``max_tokens`` plans for the largest batch up front.

Several ranks (:mod:`.ranks`): each rank measures and plans its own memory. Under DDP each keeps its own plan; under
FSDP2 (``fully_shard`` per decoder layer, then the root, applied before or after ``apply``) a rank counts its shards
and the gathered weights of the layers running, measures a layer on its gathered weights, and the ranks take one plan:
the most any rank measured, at the largest rank's tokens, under the smallest budget.

On a GPU that shares the host's memory (GB10, Jetson) the plan offloads nothing: a byte moved to "host" memory is
still a byte of the same memory (the allocator's counters would not see it).

The prediction adds the optimizer's state where step 1 ran before the first ``optimizer.step()``
(``optimizer_bytes_per_param``, 8 = Adam in float32); it leaves out the allocator's slack (block rounding,
fragmentation), so on CUDA a plan never spends more than this process can reach at step 2 less step 1's slack
(:func:`allocator_ceiling`; ``state(model)`` says when a budget was solved under it). Step 1 starts by giving the
allocator's unused cached blocks back and resetting its peak counters (:func:`release_cached_blocks`): its peaks and
its slack are its own, whatever the process ran before (building the model, another configuration). On a CPU step
1's peak is not measured: the model's own bytes and the largest layer's activations stand for it.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .._compat import ATEN_MATMUL_AND_ATTENTION, TorchDispatchMode, pytree, tensor_version, written_tensors
from .._util import pow2_ceil
from ..restore import Optimization, changes, is_on, record, undo
from ..structure import base_model, decoder_layers, model_device
from .allocator import (AllocatorCounters, allocator_ceiling, allocator_counters, budget_bytes, device_memory,
                        parse_budget, release_cached_blocks, step_ceiling)
from .pool import host_memory_available
from .ranks import Ranks, check_sharding, held_bytes, local, model_bytes, ranks_of, storage_ptrs, unsharded
from .saved import MIN_BYTES as SAVED_MIN_BYTES
from .saved import SavedOffload
from .solver import CHOICES, BudgetError, GiB, LayerCost, Plan, _size, predict, solve
from .switch import (OFFLOAD, Offloading, check_buffers, check_checkpointing_layers, checkpoint_layers,
                     make_offloading, not_running, resolve_device, unified_memory)

logger = logging.getLogger(__name__)


# The ops whose outputs the selective choice saves: the matmuls and attention kernels (the expensive part of a layer,
# recomputing them costs as much as the forward). Everything else (norms, rotary, activations, residual adds,
# dequantisation) is recomputed.
SAVED_OPS = frozenset((torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm,
                       *ATEN_MATMUL_AND_ATTENTION))
# Quantised matmuls are custom ops a dispatch mode sees whole (their dequantisation and matmul inside): QLoRA's
# NF4 projections run as ``bitsandbytes::gemm_4bit``. Saved once bitsandbytes has registered it.
_SAVED_CUSTOM_OPS = (("bitsandbytes", "gemm_4bit"),)


def saved_ops() -> frozenset:
    """The ops whose outputs the selective choice saves: :data:`SAVED_OPS` and the quantised matmuls of the libraries
    imported so far (a library imported later is seen on the next call; the set is built once per such change)."""
    return _saved_ops(tuple(namespace in sys.modules for namespace, _ in _SAVED_CUSTOM_OPS))


@functools.lru_cache(maxsize=None)
def _saved_ops(imported: tuple[bool, ...]) -> frozenset:
    extra = []
    for (namespace, name), present in zip(_SAVED_CUSTOM_OPS, imported, strict=True):
        if present:
            try:
                extra.append(getattr(getattr(torch.ops, namespace), name))
            except (AttributeError, RuntimeError):       # that version of the library has no such op
                pass
    return SAVED_OPS.union(extra)


@functools.lru_cache(maxsize=None)
def _policy(unsaved: frozenset, saved: frozenset) -> Callable:
    def save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        packet = getattr(op, "overloadpacket", op)
        if packet in saved and packet not in unsaved:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return save_matmuls


def selective_checkpoint(function: Callable, *args, unsaved: frozenset = frozenset(), **kwargs) -> Any:
    """``function(*args)`` under torch's selective checkpoint: matmul and attention outputs saved, the rest
    recomputed in backward. A drop-in for a layer's ``_gradient_checkpointing_func``.

    ``unsaved``: ops of :func:`saved_ops` to recompute anyway -- those whose output the layer changes in place
    (transformers' grouped-mm experts scale theirs): a saved output changed after saving would be wrong in the
    recompute, and torch refuses it (:func:`measure_layer` finds them)."""
    return checkpoint(function, *args, use_reentrant=False,
                      context_fn=functools.partial(create_selective_checkpoint_contexts, _policy(unsaved, saved_ops())))


def full_checkpoint(function: Callable, *args, **kwargs) -> Any:
    """``function(*args)`` under torch's non-reentrant checkpoint (what transformers' own checkpointing runs)."""
    return checkpoint(function, *args, use_reentrant=False)


# -- measuring one layer ---------------------------------------------------------------------------------------------
class _SavedBytes:
    """Counts, during one forward, the bytes autograd saves (unique storages, parameters left out) and the bytes of
    the outputs of the ops the selective choice saves, and which of those outputs an op writes into afterwards."""

    def __init__(self, exclude: set[int]):
        self.exclude = exclude
        self.saved: dict[int, int] = {}
        self.selective: dict[int, tuple[int, Any, torch.Tensor, int]] = {}
        # storages written in place since a saved op made them: through any alias, even one that does not share
        # the output's version counter (the fused LoRA adds into a matmul's output through ``_unsafe_view``'s)
        self.written: set[int] = set()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in self.exclude:
            self.saved[st.data_ptr()] = st.nbytes()
        # detached: a saved output returned as itself would hold its own grad_fn, a cycle through C++ that no
        # garbage collection frees when, as here, the forward is never followed by a backward (the layer's
        # activations stayed allocated for the process's life); autograd restores the grad_fn on unpack
        return t.detach()

    def mode(self) -> TorchDispatchMode:
        counter, saved = self, saved_ops()

        class _Outputs(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                written = written_tensors(func, args, kwargs or {})
                counter.written.update(t.untyped_storage().data_ptr() for t in written)
                if func.overloadpacket in saved:
                    for t in pytree.tree_leaves(out):
                        if isinstance(t, torch.Tensor):
                            st = t.untyped_storage()
                            counter.selective[st.data_ptr()] = (st.nbytes(), func.overloadpacket, t, tensor_version(t))
                            counter.written.discard(st.data_ptr())
                return out

        return _Outputs()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_tensor(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _timed(device: torch.device, fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Seconds of each of ``fns`` (the median of ``repeats`` calls), taken in rounds -- one call of each per round,
    after one warm-up round (first-use allocations and autotuning stay out of the figures) -- so that a drift of
    the device's speed while they are measured (clocks ramping up at the first step, a busy host) moves every
    reading alike instead of the ones measured last."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def _forward_peak(device: torch.device, forward: Callable[[], Any]) -> int:
    """The most ``forward()`` allocates at once on ``device`` (CUDA), its output included. Resets the peak counter
    (the planner resets it again after its measurement)."""
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = forward()
    most = torch.cuda.max_memory_allocated(device) - before
    del out
    return most


def _allocated_now(device: torch.device) -> int | None:
    """Bytes the caching allocator has handed out on ``device`` (CUDA), None where there is no such reading."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else None


def measure_layer(function: Callable, x: torch.Tensor, params: Sequence[torch.Tensor], *, kind: str = "layer",
                  buffers: int = 2, repeats: int = 5, resident: Sequence[torch.Tensor] = (),
                  forward_peaks: bool = True) -> LayerCost:
    """Measure one decoder layer call ``function(x)`` under every choice, on a detached copy of its input.

    ``params``: the layer's trainable parameters (their gradients are computed, not accumulated: ``.grad`` is left
    as it was). ``resident``: tensors the GPU holds anyway (the layer's frozen weights, its buffers): what autograd
    saves of them is not counted as held. The caller keeps the RNG and transformers' output collectors out of it
    (:class:`MemoryPlanner` does). ``forward_peaks`` (CUDA): also each choice's forward at its most, read by
    resetting the device's peak-memory counter (off where a caller's reading of it must survive). Returns the
    layer's :class:`LayerCost` at ``x``'s token count."""
    device = x.device
    params = list(params)
    inp = x.detach().requires_grad_(True)
    exclude = storage_ptrs([*params, *resident])

    def step(run: Callable) -> None:
        out = _first_tensor(run(function, inp))
        torch.autograd.grad([out], [inp, *params], torch.ones_like(out), allow_unused=True)

    # bytes held from forward to backward: what autograd saves (keep), the input plus the saved matmul and
    # attention outputs (selective), the input alone (checkpoint), nothing (offload)
    readings: dict[str, int] = {}
    before = _allocated_now(device)
    if before is not None:
        # also what autograd keeps outside saved tensors (a Function's attributes), read after a plain forward:
        # nothing of the measurement may hold the layer's tensors then (the op-output records below hold every
        # matmul output, saved or not -- read under them, a MoE layer's unsaved expert outputs counted as kept)
        out = _first_tensor(function(inp))
        after = _allocated_now(device)
        readings["allocated"] = (after or 0) - before - out.untyped_storage().nbytes()
        del out
    count = _SavedBytes(exclude)
    with torch.autograd.graph.saved_tensors_hooks(count.pack, lambda t: t), count.mode():
        out = _first_tensor(function(inp))
    in_bytes = inp.untyped_storage().nbytes()
    readings["saved"] = sum(count.saved.values())
    small_saved = list(count.saved.values())          # what offload_saved leaves on the device: the small ones
    keep = max(readings.values())
    # torch's pinned allocator rounds every block up to a power of two (an 80 MiB activation pins 128 MiB)
    readings["pinned"] = sum(pow2_ceil(b) for b in small_saved if b >= SAVED_MIN_BYTES)
    del out
    records = [r for p, r in count.selective.items() if p != inp.untyped_storage().data_ptr()]
    # an output written after it was made would come back from the cache changed, and the recompute would write it
    # again (torch checks the output's version counter, which an ``_unsafe_view`` alias does not share)
    unsaved = frozenset(op for _, op, t, version in records
                        if tensor_version(t) != version or t.untyped_storage().data_ptr() in count.written)
    selective = in_bytes + sum(b for b, op, _, _ in records if op not in unsaved)
    # the records hold every recorded op's output, graph and all, and that graph's saved tensors hold this
    # recorder's pack hook: a cycle through C++ that no garbage collection frees, unless the records go here
    count.selective.clear()
    del records, count

    runners: dict[str, Callable] = {"keep": lambda f, a: f(a), "selective": functools.partial(
        selective_checkpoint, unsaved=unsaved), "checkpoint": full_checkpoint}
    # the host link: what a reload costs where the double buffer cannot hide it behind the next layer's backward
    # (each round stores the input before it reloads it: the input keeps its values)
    host = torch.empty(inp.shape, dtype=inp.dtype, pin_memory=device.type == "cuda")
    timed = _timed(device, {**{c: functools.partial(step, run) for c, run in runners.items()},
                            "forward": lambda: function(inp.detach()),
                            "d2h": lambda: host.copy_(inp, non_blocking=True),
                            "h2d": lambda: inp.detach().copy_(host, non_blocking=True)}, repeats)
    seconds = {c: timed[c] for c in runners}
    fwd, d2h, h2d = timed["forward"], timed["d2h"], timed["h2d"]
    # the most each choice's forward allocates at once (CUDA): a kept layer's activations with the transients of its
    # forward, a recomputed one's transients beside what it saves; offload's is checkpoint's (its input leaves later)
    forward: dict[str, int] = {}
    if device.type == "cuda" and forward_peaks:
        forward = {c: _forward_peak(device, functools.partial(run, function, inp)) for c, run in runners.items()}
        forward["offload"] = forward["checkpoint"]
    # keep runs a subset of every other choice's kernels: a reading above theirs is noise (a busy host), not cost
    seconds["keep"] = min(seconds.values())

    bwd = max(seconds["keep"] - fwd, 0.0)
    exposed = h2d if buffers == 1 else max(h2d - bwd, 0.0)
    seconds["offload"] = seconds["checkpoint"] + exposed + max(d2h - fwd, 0.0)
    # offload_saved: keep's compute, plus the copies of its saved bytes (at the input's measured link rate) that
    # the layers' own compute does not hide: the stores behind the forward, the reloads behind the next backward
    ratio = keep / max(in_bytes, 1)
    exposed = h2d * ratio if buffers == 1 else max(h2d * ratio - bwd, 0.0)
    seconds["offload_saved"] = seconds["keep"] + exposed + max(d2h * ratio - fwd, 0.0)
    first_reload = h2d * ratio - exposed
    held = {"keep": keep, "selective": selective, "checkpoint": in_bytes, "offload": 0,
            "offload_saved": sum(b for b in small_saved if b < SAVED_MIN_BYTES)}
    if forward:          # offload_saved: keep's forward, its stores in flight (saved_extra) aside, what stays
        forward["offload_saved"] = forward["checkpoint"] + held["offload_saved"]
    return LayerCost(kind, int(x.shape[:-1].numel()), seconds, held, unsaved, readings, first_reload, forward)


# -- on a live model -------------------------------------------------------------------------------------------------
@dataclass
class MemoryPlanner:
    """A model's memory plan: measures on step 1, solves at step 2, re-plans for larger batches (module docstring).

    ``kinds[i]``: the kind of layer i (layers of one kind share a measurement); ``offload[i]``: layer i's offloaded
    checkpoint function; ``costs``: the measurements by kind; ``plan``: the current :class:`Plan` (None while
    measuring)."""

    budget: int
    device: torch.device
    kinds: list[str]
    offload: list[Callable]
    buffers: int = 2
    max_tokens: int | None = None
    optimizer_bytes_per_param: int = 8
    layers: list = field(default_factory=list)          # weakrefs to the decoder layers
    costs: dict[str, LayerCost] = field(default_factory=dict)
    plan: Plan | None = None
    steps: int = 0
    static: int = 0            # bytes allocated at step 1's first layer, less its input (weights, optimizer, ...)
    peak: int | None = None    # step 1's peak after its forward (CUDA), read when the first layer's backward starts
    loss_peak: int | None = None   # step 1's peak read when the last layer's backward starts (the loss)
    forward_peak: int | None = None   # step 1's peak read at the end of the forward (then the counter is reset)
    tokens: int = 0            # tokens of step 1
    allowance: int = 0         # optimizer state not yet allocated at step 1
    staging: int = 0           # the staging buffers at step 1's tokens
    fixed_cpu: int = 0         # the model's own bytes (the CPU's stand-in for a measured peak)
    saved: SavedOffload | None = None     # the offload_saved layers' activations (None: that choice is off)
    unified: bool = False      # the GPU shares the host's memory (GB10, Jetson): offloading frees nothing there
    ceiling: int | None = None # CUDA: the most a step can allocate (:func:`allocator_ceiling`, read at step 2)
    root: Any = None           # a weakref to the model (its bytes, read at step 1: it may be sharded after apply)
    ranks: Ranks | None = None # FSDP2 over several ranks: the ranks this plan agrees with (:mod:`.ranks`)
    offloading: Offloading | None = None   # the offloaded layers' manager and checkpoint functions
    functions: list = field(default_factory=list)     # each layer's checkpoint function while the plan is on

    # -- the memory_budget switch's record in the model's restore log
    def state(self) -> dict:
        """What :func:`fastsft_lab.state` reports while the plan is on (nothing once the layers' functions were
        replaced: the model's own checkpointing)."""
        if not_running((ref(), fn) for ref, fn in zip(self.layers, self.functions)):
            return {}
        manager = self.offloading.manager if self.offloading is not None else None
        return {"offload_buffers": manager.buffers if manager is not None else self.buffers,
                "prefetch": manager.prefetch if manager is not None else False,
                "checkpointing": "plan", "memory_plan": self.describe()}

    def close(self) -> None:
        if self.offloading is not None:
            self.offloading.close()

    def layer_func(self, index: int) -> Callable:
        return _PlannedLayer(self, index)

    def call(self, index: int, function: Callable, args: tuple, kwargs: dict) -> Any:
        if not torch.is_grad_enabled():
            return function(*args)
        choice, unsaved = self._choose(index, function, args)
        if choice == "keep":
            return function(*args)
        if choice == "selective":
            return selective_checkpoint(function, *args, unsaved=unsaved)
        if choice == "checkpoint":
            return full_checkpoint(function, *args)
        if choice == "offload_saved":
            layer = self.layers[index]()
            # read at the layer's first saved tensor, inside its forward: under FSDP2 its gathered weights are
            # registered on it only then
            resident: Any = ((lambda: storage_ptrs([*layer.parameters(), *layer.buffers()])) if layer is not None
                             else set())
            with self.saved.layer(index, resident):
                return function(*args)
        out = self.offload[index](function, *args, **kwargs)
        if self.plan is None:
            if index == len(self.layers) - 1:
                self._end_of_forward()
                self._watch_peak(out, "loss_peak")
            if index == 0:
                self._watch_peak(out, "peak")
        return out

    @torch.compiler.disable
    def _end_of_forward(self) -> None:
        """Step 1, after the last layer's forward: read the forward's peak, then reset the counter so that the loss
        and the backward are read apart. A host-side counter: no sync."""
        if self.device.type == "cuda" and self.forward_peak is None:
            self.forward_peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    @torch.compiler.disable
    def _watch_peak(self, out, name: str) -> None:
        """Step 1: read the CUDA peak into ``name`` when this layer's backward starts: at the last layer's, the
        forward, the loss and the logits are behind it; at the first layer's, every later layer's backward too. Read
        there, a reset of the peak counter between steps (a callback that logs memory per step) does not hide it. A
        host-side counter: no sync."""
        t = _first_tensor(out)
        if self.device.type == "cuda" and isinstance(t, torch.Tensor) and t.requires_grad:
            def record(grad):
                setattr(self, name, max(getattr(self, name) or 0, torch.cuda.max_memory_allocated(self.device)))
            t.register_hook(record)

    @torch.compiler.disable
    def _choose(self, index: int, function: Callable, args: tuple) -> tuple[str, frozenset]:
        """Layer ``index``'s choice for this call (host bookkeeping, run eagerly under ``torch.compile``): step 1
        measures and offloads, later steps follow the plan, solved at step 2 and again for a larger batch."""
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if index == 0 and x is not None:
            self._step_start(x)
        if self.plan is None:
            kind = self.kinds[index]
            if kind not in self.costs and x is not None:
                self._measure(index, kind, function, x)
                if index == 0:
                    self._check_floor()
            return "offload", frozenset()
        choice = self.plan.choices[index]
        return choice, self._unsaved(index, function, args) if choice == "selective" else frozenset()

    def _unsaved(self, index: int, function: Callable, args: tuple) -> frozenset:
        cost = self.costs.get(self.kinds[index])
        if cost is None:      # a plan set by hand before any measurement: find the in-place ops once
            cost = self._measure(index, self.kinds[index], function, args[0], reset_peak=False)
        return cost.unsaved

    def _step_start(self, x: torch.Tensor) -> None:
        self.steps += 1
        tokens = int(x.shape[:-1].numel())
        if self.steps == 1:
            self.tokens = tokens
            in_bytes = x.numel() * x.element_size()
            self.staging = self.buffers * in_bytes
            if self.device.type == "cuda":
                release_cached_blocks(self.device)   # step 1's slack and peaks its own, whatever ran before
                self.static = torch.cuda.memory_allocated(self.device) - in_bytes
            layers = [layer for ref in self.layers if (layer := ref()) is not None]
            check_sharding(layers)                   # sharded after apply: read now
            self.ranks = ranks_of(layers)
            root = self.root() if self.root is not None else None
            if root is not None:
                self.fixed_cpu = model_bytes(root, layers)
            trainable = [p for layer in layers for p in layer.parameters() if p.requires_grad]
            if trainable and all(p.grad is None for p in trainable):
                # a sharded parameter's optimizer state is its shard's
                self.allowance = self.optimizer_bytes_per_param * sum(local(p).numel() for p in trainable)
            return
        if self.steps == 2 and self.device.type == "cuda":
            if self.peak is None:   # no backward seen by the hook: everything since step 1's measurement
                self.peak = torch.cuda.max_memory_allocated(self.device)
            self.ceiling = step_ceiling(self.device)
        target = max(tokens, self.max_tokens or 0)
        if self.ranks is not None:        # every rank re-plans at the same step, for the same tokens
            target = self.ranks.max(target)
        if self.plan is None or target > self.plan.tokens:
            self.plan = self._solve_agreed(target)
            logger.info("fastsft_lab memory plan: %s", self.describe())

    def _solve_agreed(self, tokens: int) -> Plan:
        """:meth:`solve`, on a sharded model over several ranks the plan every rank takes (:mod:`.ranks`)."""
        if self.ranks is None:
            return self.solve(tokens)
        problem, budget = self.ranks.agree(self.problem(tokens), self.reachable())
        return solve(budget=budget, **problem)

    def _measure(self, index: int, kind: str, function: Callable, x: torch.Tensor, *,
                 reset_peak: bool = True) -> LayerCost:
        from .checkpoint import _private_collector

        devices = [self.device] if self.device.type == "cuda" else []
        layer = self.layers[index]()
        # under FSDP2 the layer's weights gathered for the measurement (its parameters are then the gathered ones)
        with torch.random.fork_rng(devices=devices), _private_collector(), unsharded(layer):
            resident = [*layer.parameters(), *layer.buffers()] if layer is not None else []
            params = [p for p in resident if p.requires_grad]
            cost = self.costs[kind] = measure_layer(function, x, params, kind=kind, buffers=self.buffers,
                                                    forward_peaks=reset_peak,
                                                    resident=resident)
        if reset_peak and self.device.type == "cuda":   # the measurement's own allocations stay out of the peak
            torch.cuda.reset_peak_memory_stats(self.device)
        return cost

    def _check_floor(self) -> None:
        """Step 1, first layer: refuse a budget below what any plan needs -- what is allocated now (CUDA) or the
        model's bytes (CPU), the optimizer state still to come, the staging buffers and one layer's activations
        in its recompute -- before the step goes on."""
        worst = max(c.held["keep"] for c in self.costs.values())
        floor = (self.static if self.device.type == "cuda" else self.fixed_cpu) + self.allowance + self.staging + worst
        ranks = "" if self.ranks is None else " on one of the ranks"
        if self.ranks is not None:   # every rank stops here when one must (the others would wait for it)
            floor = self.ranks.max(floor - self.budget) + self.budget
        if floor > self.budget:
            raise BudgetError(f"memory_budget {_size(self.budget)} is below the smallest plan's peak (at least "
                              f"{_size(floor)} at {self.tokens} tokens{ranks}, every layer offloaded): give at least "
                              f"{_size(floor)}")

    def base(self, tokens: int) -> int:
        """Predicted peak with every layer offloaded, at ``tokens`` tokens."""
        r = tokens / self.tokens
        if self.peak is not None:     # the forward's peak in it too where the loss's was not read apart
            return self._scaled(self.peak if self.loss_peak is not None else max(self.peak, self.forward_peak or 0),
                                tokens)
        worst = max(c.at(tokens).held["keep"] for c in self.costs.values())    # the recompute's activations
        return self.fixed_cpu + self.allowance + int(math.ceil(self.staging * r)) + worst

    def loss_base(self, tokens: int) -> int | None:
        """Predicted peak with every layer offloaded from the end of the forward to the decoder layers' backward
        (the loss), at ``tokens`` tokens; None where step 1 did not read it (a CPU, no backward through the last
        layer)."""
        if self.loss_peak is None or self.peak is None:
            return None
        return self._scaled(min(self.loss_peak, self.peak), tokens)

    def forward_base(self, tokens: int) -> int | None:
        """Predicted peak with every layer offloaded in the forward, at ``tokens`` tokens; None where not read."""
        return None if self.forward_peak is None or self.loss_peak is None else self._scaled(self.forward_peak, tokens)

    def _scaled(self, peak: int, tokens: int) -> int:
        return self.static + int(math.ceil((peak - self.static) * tokens / self.tokens)) + self.allowance

    def predict(self, tokens: int, choices: Sequence[str]) -> tuple[int, float]:
        """:func:`predict` of the per-layer ``choices`` at ``tokens`` tokens: (peak bytes, decoder-layer seconds)."""
        problem = self.problem(tokens)
        return predict(problem.pop("costs"), choices, **{k: v for k, v in problem.items() if k != "choices"})

    def smallest(self, tokens: int) -> int:
        """Predicted peak of the smallest plan (every layer offloaded) at ``tokens`` tokens: the least budget."""
        return self.predict(tokens, ["offload"] * len(self.kinds))[0]

    def solve(self, tokens: int, budget: int | None = None) -> Plan:
        """The plan for ``tokens`` tokens under ``budget`` bytes (default: this planner's budget)."""
        return solve(budget=self.reachable() if budget is None else budget, **self.problem(tokens))

    def reachable(self) -> int:
        """The budget a plan is solved under: the budget, or the allocator's ceiling where lower (CUDA)."""
        return self.budget if self.ceiling is None else min(self.budget, self.ceiling)

    def problem(self, tokens: int) -> dict:
        """What :func:`solve` (and :func:`ranked`, :func:`predict`) take at ``tokens`` tokens, but the budget: the
        layers' costs, the smallest plan's peak, the staging buffers, what ``offload_saved`` adds, the choices this
        GPU and host allow."""
        costs = [self.costs[k].at(tokens) for k in self.kinds]
        worst = max(c.held["keep"] for c in costs)
        choices: tuple[str, ...] = CHOICES
        host = host_memory_available()
        if self.saved is None or (host is not None and sum(c.pinned for c in costs) > host // 2):
            # off, or the host could not take every layer's activations with room to spare: no offload_saved
            choices = tuple(c for c in CHOICES if c != "offload_saved")
        if self.unified:     # "host" memory is the GPU's own: an offloaded byte is still a used byte
            choices = tuple(c for c in choices if c not in ("offload", "offload_saved"))
        return {"costs": costs, "base": self.base(tokens), "loss_base": self.loss_base(tokens),
                "forward_base": self.forward_base(tokens),
                "staging": int(math.ceil(self.staging * tokens / self.tokens)),
                "saved_extra": self._saved_extra(worst), "choices": choices}

    def _saved_extra(self, worst: int) -> int:
        """What ``offload_saved`` layers hold beyond the smallest plan's peak (one layer recomputed at a time):
        in the forward, the stores in flight (two layers' with the double buffer, one without); in the backward, the
        prefetched layer beside the current one (fewer)."""
        if self.saved is None:
            return 0
        return (2 if self.saved.prefetch else 1) * worst

    def describe(self) -> str:
        if self.plan is None:
            return f"budget {_size(self.budget)}: measuring (every layer offloaded until step 2)"
        unified = " (unified memory: no offloading, it would free nothing)" if self.unified else ""
        capped = ""
        if self.ceiling is not None and self.ceiling < self.budget and not self.plan.by_hand:
            capped = (f" (solved under {_size(self.ceiling)}: the memory this process can reach less the "
                      f"allocator's slack at step 1)")
        agreed = ""
        if self.ranks is not None and not self.plan.by_hand:
            agreed = (f" (one plan for {self.ranks.world} ranks: each layer's costs and each phase's base the most "
                      f"any rank measured, at the largest rank's tokens, under the smallest budget)")
        return f"budget {_size(self.budget)}{capped}{agreed}: {self.plan.describe()}{unified}" + self.why()

    def why(self) -> str:
        """What each choice costs one layer of each kind at the plan's tokens, as measured: the reasons for the plan
        (empty for a plan set by hand)."""
        if self.plan is None or self.plan.by_hand or not self.costs:
            return ""
        parts = []
        for kind, cost in self.costs.items():
            c = cost.at(self.plan.tokens)
            name = kind.split(":")[-1] or kind
            parts.append(f"{name}: " + ", ".join(f"{ch} {c.seconds[ch] * 1e3:.1f} ms {_size(c.held[ch])}"
                                                 for ch in CHOICES if ch in c.seconds))
        return "; per layer (forward + backward, held until backward) " + "; ".join(parts)


class _PlannedLayer:
    """A decoder layer's ``_gradient_checkpointing_func`` while a memory plan is on: the planner picks."""

    def __init__(self, planner: MemoryPlanner, index: int):
        self._planner = weakref.ref(planner)
        self.index = index

    def __call__(self, function: Callable, *args, **kwargs):
        planner = self._planner()
        if planner is None:
            raise RuntimeError("the memory plan of this layer was switched off while the layer was running")
        return planner.call(self.index, function, args, kwargs)

    def __repr__(self) -> str:
        planner = self._planner()
        choice = planner.plan.choices[self.index] if planner is not None and planner.plan else "measuring"
        return f"PlannedCheckpoint(layer={self.index}, {choice})"


def layer_kinds(model: nn.Module) -> list[str]:
    """One name per decoder layer; layers of one name cost the same (the config's ``layer_types`` where it has
    one: full and sliding-window attention)."""
    layers = decoder_layers(model)
    types = getattr(base_model(model).config, "layer_types", None)
    return [f"{type(layer).__name__}:{types[i] if types and i < len(types) else ''}"
            for i, layer in enumerate(layers)]


def check_plan_sharding(model: nn.Module) -> None:
    """One line refusing FSDP2 inside a decoder layer (:func:`fastsft_lab.offload.ranks.check_sharding`); FSDP2 per
    decoder layer and at the root is planned per rank, the ranks agreeing on one plan (:mod:`.ranks`)."""
    check_sharding(decoder_layers(model))


def check_budget_floor(model: nn.Module, budget_bytes: int) -> None:
    """One line refusing a budget below what the model holds already (CUDA: allocated on its device; elsewhere its
    weights and buffers), before anything changes; what a step adds is checked at its first layer."""
    device = resolve_device(model_device(model))
    key = base_model(model)
    held = (torch.cuda.memory_allocated(device) if device.type == "cuda"
            else held_bytes(key.parameters()) + held_bytes(key.buffers()))
    if held > budget_bytes:
        raise BudgetError(f"memory_budget {_size(budget_bytes)} is below what the model already holds "
                          f"({_size(held)}): give more than {_size(held)}")


PLAN = "memory_budget"


@dataclass(frozen=True)
class PlanSettings:
    budget: int | None                 # bytes; None: the plan as it is (``max_tokens`` alone)
    buffers: int = 2
    prefetch: bool | None = None
    max_tokens: int | None = None
    optimizer_bytes_per_param: int = 8


def _check_max_tokens(max_tokens) -> None:
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                   or max_tokens <= 0):
        raise ValueError(f"max_tokens must be a positive int (the most tokens a batch can have), got {max_tokens!r}")


def validate(model: nn.Module, value, options: dict) -> PlanSettings:
    """The ``memory_budget`` switch's checks: one-line errors, nothing changed. ``max_tokens`` is its mode; it takes
    over the offload switch, so ``offload_buffers`` / ``prefetch`` given with it are the staging buffers of the
    layers it offloads."""
    max_tokens = options.get("max_tokens")
    _check_max_tokens(max_tokens)
    if value is None:
        if not is_on(model, PLAN):
            raise ValueError("max_tokens needs memory_budget=<GiB> (now or in an earlier apply)")
        return PlanSettings(None, max_tokens=max_tokens)
    buffers = options.get("offload_buffers")
    if isinstance(buffers, (str, bool)) and buffers in ("off", False):
        raise ValueError("memory_budget offloads the layers it cannot keep: offload_buffers='off' contradicts it")
    if buffers == 0 and not isinstance(buffers, bool):
        raise ValueError("memory_budget chooses the checkpointing of each layer, offload_buffers=0 (standard "
                         "checkpointing everywhere) contradicts it: leave offload_buffers out, or give 1 or 2 (the "
                         "staging buffers of the layers the plan offloads)")
    if buffers is not None and (isinstance(buffers, bool) or buffers not in (1, 2)):
        raise ValueError(f"offload_buffers must be 0 (standard checkpointing), 1 or 2, got {buffers!r}")
    buffers = buffers or 2
    prefetch = check_buffers(buffers, options.get("prefetch"))
    check_plan_sharding(model)
    check_checkpointing_layers(model)
    budget = budget_bytes(value, resolve_device(model_device(model)))
    check_budget_floor(model, budget)
    return PlanSettings(budget, buffers, prefetch, max_tokens)


def enable(model: nn.Module, settings: PlanSettings) -> None:
    """Switch the plan for ``settings`` on (checked by :func:`validate`): every layer offloaded until step 2
    measures and solves; a plan that is on is replaced (re-planned), or, with no budget, given ``max_tokens``."""
    planner: MemoryPlanner | None = record(model, PLAN) if is_on(model, PLAN) else None
    if settings.budget is None:
        if planner is not None and settings.max_tokens is not None:
            planner.max_tokens = settings.max_tokens
        return
    OFFLOAD.disable(model)          # the plan takes the checkpointing over: the offload switch's goes first
    if planner is not None:
        undo(model, PLAN)
    elif getattr(base_model(model), "is_gradient_checkpointing", False):
        import warnings

        warnings.warn("memory_budget replaces the model's own gradient checkpointing with a per-layer plan; "
                      "revert() (or memory_budget='off') gives it back", stacklevel=4)
    key = base_model(model)
    device = resolve_device(model_device(model))
    layers = decoder_layers(model)
    offloading = make_offloading(model, settings.buffers, settings.prefetch, device=device)
    planner = MemoryPlanner(settings.budget, device, layer_kinds(model), list(offloading.functions),
                            buffers=settings.buffers, max_tokens=settings.max_tokens,
                            optimizer_bytes_per_param=settings.optimizer_bytes_per_param,
                            layers=[weakref.ref(layer) for layer in layers], unified=unified_memory(device),
                            fixed_cpu=model_bytes(key, layers), root=weakref.ref(key), offloading=offloading)
    planner.saved = SavedOffload(device, prefetch=offloading.manager.prefetch, streams=offloading.manager.ops)
    planner.functions = [planner.layer_func(i) for i in range(len(layers))]
    log = changes(model, PLAN)
    log.record = planner
    checkpoint_layers(log, model, planner.functions)
    log.callback(offloading.manager.release_staging)


BUDGET = Optimization(PLAN, validate, enable, off=("off", False), options=("max_tokens",), takes=("offload_buffers",))


def enable_memory_plan(model: nn.Module, budget, *, buffers: int = 2, prefetch: bool | None = None,
                       max_tokens: int | None = None, optimizer_bytes_per_param: int = 8) -> MemoryPlanner:
    """Switch a per-layer checkpointing plan for ``budget`` on (see the module docstring); returns its planner.

    Args:
        budget: GiB (``80``) or, on a GPU, a share of its free memory (``"90%"``) beyond what is allocated now;
            each rank's under DDP and FSDP2 (:mod:`.ranks`).
        buffers, prefetch: the staging buffers of the layers the plan offloads (:func:`enable_offloaded_checkpointing`).
        max_tokens: the largest batch the collator emits: plan for it from step 2 on (default: the largest seen).
        optimizer_bytes_per_param: optimizer state per trainable parameter not allocated yet at step 1.
    """
    settings = validate(model, budget, {"offload_buffers": buffers, "prefetch": prefetch, "max_tokens": max_tokens})
    enable(model, PlanSettings(settings.budget, settings.buffers, settings.prefetch, settings.max_tokens,
                               optimizer_bytes_per_param))
    return record(model, PLAN)


def disable_memory_plan(model: nn.Module) -> None:
    """Switch the plan off: the layers as they were before :func:`enable_memory_plan` (a no-op when it is off)."""
    BUDGET.disable(model)


def set_plan(model: nn.Module, choices: Sequence[str]) -> Plan:
    """Fix the per-layer choices by hand on a model whose memory plan is on (no measurement, no re-planning): for a
    policy of one's own (every k-th layer selective, ...) and for tests. Returns the plan."""
    planner = memory_planner(model)
    if planner is None:
        raise ValueError("set_plan needs a memory plan on the model: apply(model, memory_budget=...) first")
    choices = tuple(choices)
    if len(choices) != len(planner.kinds):
        raise ValueError(f"set_plan: {len(choices)} choices for {len(planner.kinds)} decoder layers")
    bad = sorted(set(choices) - set(CHOICES))
    if bad:
        raise ValueError(f"set_plan: unknown choice {bad[0]!r}; the choices are {', '.join(CHOICES)}")
    planner.plan = Plan(choices, planner.budget, peak=0, seconds=float("nan"), tokens=2**62, by_hand=True)
    return planner.plan


def memory_planner(model: nn.Module) -> MemoryPlanner | None:
    """The model's planner, or None."""
    return record(model, PLAN) if is_on(model, PLAN) else None


__all__ = ["CHOICES", "saved_ops", "SAVED_OPS", "LayerCost", "Plan", "BudgetError", "MemoryPlanner", "measure_layer",
           "solve", "predict", "selective_checkpoint", "full_checkpoint", "parse_budget", "budget_bytes", "device_memory",
           "allocator_ceiling", "AllocatorCounters", "allocator_counters", "release_cached_blocks", "step_ceiling",
           "check_budget_floor", "check_plan_sharding", "BUDGET", "PlanSettings", "enable_memory_plan",
           "disable_memory_plan", "memory_planner",
           "set_plan", "layer_kinds"]
