"""The checkpoint function of offloaded checkpointing: what each decoder layer's checkpoint call runs.

It plugs into transformers' own extension point: ``GradientCheckpointingLayer.__call__`` calls the layer's
checkpoint function (:data:`fastsft_lab._compat.CHECKPOINT_FUNCTION`) with ``partial(super().__call__, **kwargs)``;
the switch sets that function (and ``gradient_checkpointing = True``) on each decoder layer, so it works under PEFT/QLoRA wrappers and keeps every
kwarg (rotary cos/sin, masks, optimization 1's ``packed_metadata``) for the recompute untouched.

* forward: the layer runs with grad mode on but keeps nothing (a ``saved_tensors_hooks`` pair drops what autograd
  would save, as torch's non-reentrant checkpoint does), so it runs the very kernels standard checkpointing runs;
  its input goes to the manager (:meth:`OffloadManager.save`).
* backward: the manager stages the input back (:meth:`OffloadManager.begin_backward`), the layer is recomputed
  with grad -- RNG state and autocast state replayed as ``torch.utils.checkpoint`` does -- and back-propagated by a
  nested ``torch.autograd.backward``; then the slot is released (:meth:`OffloadManager.end_backward`).

The layer's trainable parameters are inputs of its autograd node: the recompute's ``torch.autograd.grad`` returns
their gradients and autograd's engine routes them as for any other layer, so ``loss.backward()``,
``torch.autograd.grad(loss, params)`` and ``loss.backward(inputs=...)`` all work. Unlike torch's reentrant checkpoint,
gradients reach LoRA parameters even when the layer input does not require grad.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .._compat import (checkpoint_valid, is_fsdp2, is_zero3_partitioned, output_collector, pytree,
                       saved_tensors_hooks_enabled)
from .manager import Entry, OffloadManager


def _autocast_state(device_type: str) -> tuple[dict | None, dict]:
    dev = None
    if device_type != "cpu" and torch.amp.is_autocast_available(device_type):
        dev = {"enabled": torch.is_autocast_enabled(device_type), "dtype": torch.get_autocast_dtype(device_type),
               "cache_enabled": torch.is_autocast_cache_enabled()}
    cpu = {"enabled": torch.is_autocast_enabled("cpu"), "dtype": torch.get_autocast_dtype("cpu"),
           "cache_enabled": torch.is_autocast_cache_enabled()}
    return dev, cpu


@dataclass
class _Call:
    """Everything the recompute needs, except the offloaded input (which lives in the pinned pool)."""

    manager: OffloadManager
    fn: Callable
    fn_args: tuple
    leaves: list
    spec: Any
    offload_leaf: int | None
    grad_leaves: list[int]
    entry: Entry | None
    trace_layer: int
    params: list | None = None          # the layer's trainable parameters (None: a bare function)
    side_keys: list = field(default_factory=list)      # what the layer recorded for the caller (router_logits ...)
    side_grads: list = field(default_factory=list)     # their gradients, set by _SideOutput.backward
    side_pending: list | None = None                   # forward -> offloaded_checkpoint: the recorded values
    tuple_out: bool = False
    cpu_rng: torch.Tensor | None = None
    dev_rng: torch.Tensor | None = None
    autocast: tuple = field(default_factory=tuple)


def _discard_saved(t: torch.Tensor) -> None:
    return None


def _never_unpacked(_handle) -> torch.Tensor:
    raise RuntimeError(
        "offloaded checkpointing: something computed inside an offloaded layer's forward is being back-propagated "
        "outside of it, and it was not recorded through transformers' output capturing (which offload hands out "
        "with a gradient: router logits, hidden states) -- e.g. a tensor captured by a hook of your own. The "
        "offloaded forward keeps no activations: detach it, record it through the model's outputs, or use "
        "standard checkpointing.")


@contextlib.contextmanager
def _private_collector(keys: list | None = None):
    """Inside: what transformers' output-capturing hooks record goes to a private collector (yielded), with the
    keys of the active one (or ``keys``); the active one is put back on exit."""
    var = output_collector()
    outer = var.get() if var is not None else None
    if keys is None and not outer:
        yield None
        return
    inner = {k: ([] if isinstance(v, list) else v) for k, v in (outer or {}).items()}
    for k in keys or ():
        inner.setdefault(k, [])
    var.set(inner)
    try:
        yield inner
    finally:
        var.set(outer)


def _recorded(inner: dict | None) -> list[tuple[str, torch.Tensor]]:
    if not inner:
        return []
    return [(k, t) for k, v in inner.items() if isinstance(v, list) for t in v if isinstance(t, torch.Tensor)]


class _SideOutput(torch.autograd.Function):
    """A layer's recorded side output (router logits for the load-balancing loss, ...) handed to the caller after
    the offloaded forward. Its input ``token`` is an output of the layer's node, so autograd runs this backward
    first: it keeps the side output's gradient for the layer's recompute, which back-propagates it through the
    recomputed side output together with the layer's own output gradient."""

    @staticmethod
    def forward(ctx, token: torch.Tensor, value: torch.Tensor, call, index: int) -> torch.Tensor:
        ctx.call, ctx.index = call, index
        ctx.token_device = token.device
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.call.side_grads[ctx.index] = grad
        return torch.zeros(0, device=ctx.token_device), None, None, None


def _recompute_and_backward(call: _Call, leaves: list, grad_outputs: tuple, params: list[torch.Tensor] | None,
                            need_leaves: list[bool], need_params: list[bool]) -> tuple[list, list]:
    """Recompute the layer with grad from ``leaves`` (the staged input in place) and back-propagate through it.

    Returns the gradients of the leaves that require grad and, when the layer's parameters are known (``params``),
    of those parameters: autograd's own engine then accumulates them (``loss.backward()``), returns them
    (``torch.autograd.grad``) or drops them (``backward(inputs=...)``), as for any other layer. Without ``params``
    (a bare function), a nested ``backward`` accumulates parameter gradients into ``.grad`` (reentrant semantics).
    """
    manager = call.manager
    # Detached leaves that require grad. The same tensor object in two places maps to one detached tensor, so its
    # gradient is summed as in the original graph.
    detached: dict[int, torch.Tensor] = {}
    for i in call.grad_leaves:
        t = leaves[i]
        d = detached.get(id(t))
        if d is None:
            d = t.detach().requires_grad_(True)
            detached[id(t)] = d
        leaves[i] = d
    grad_leaf_tensors = [leaves[i] for i in call.grad_leaves]
    args, kwargs = pytree.tree_unflatten(leaves, call.spec)
    dev_type = manager.device.type
    rng_devices = [manager.device] if (manager.cuda and call.dev_rng is not None) else []
    dev_autocast, cpu_autocast = call.autocast
    with torch.random.fork_rng(devices=rng_devices, enabled=manager.preserve_rng_state,
                               device_type=dev_type if dev_type != "cpu" else "cuda"):
        if manager.preserve_rng_state:
            torch.set_rng_state(call.cpu_rng)
            if rng_devices:
                torch.cuda.set_rng_state(call.dev_rng, manager.device)
        dev_ctx = torch.autocast(dev_type, **dev_autocast) if dev_autocast else contextlib.nullcontext()
        side_ctx = _private_collector(call.side_keys) if call.side_keys else contextlib.nullcontext()
        with torch.enable_grad(), dev_ctx, torch.autocast("cpu", **cpu_autocast), side_ctx as inner:
            out = call.fn(*call.fn_args, *args, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    pairs = [(o, g) for o, g in zip(outs, grad_outputs[:len(outs)])
             if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
    if call.side_keys:
        # the recorded side outputs, recomputed with their graph, and the gradients the caller's loss gave them
        for (_, t), g in zip(_recorded(inner), call.side_grads):
            if g is not None and t.requires_grad:
                pairs.append((t, g))
        call.side_grads = [None] * len(call.side_grads)
    if params is None:
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        seen: set[int] = set()
        leaf_grads = []
        for d in grad_leaf_tensors:
            # a tensor that appears twice gets its summed gradient once (autograd adds the None of the other)
            leaf_grads.append(None if id(d) in seen else d.grad)
            seen.add(id(d))
        return leaf_grads, []
    wanted: list[torch.Tensor] = []
    seen_ids: set[int] = set()
    for d, need in zip(grad_leaf_tensors, need_leaves):
        if need and id(d) not in seen_ids:
            wanted.append(d)
            seen_ids.add(id(d))
    wanted += [p for p, need in zip(params, need_params) if need]
    grads: dict[int, torch.Tensor | None] = {}
    if pairs and wanted:
        got = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
        grads = {id(t): g for t, g in zip(wanted, got)}
    leaf_grads, given = [], set()
    for d in grad_leaf_tensors:
        leaf_grads.append(None if id(d) in given else grads.get(id(d)))
        given.add(id(d))
    return leaf_grads, [grads.get(id(p)) if need else None for p, need in zip(params, need_params)]


class _OffloadedLayer(torch.autograd.Function):
    """Forward: run the layer keeping nothing, offload its input. Backward: reload, recompute, back-propagate."""

    @staticmethod
    def forward(ctx, call: _Call, dummy: torch.Tensor, *grad_tensors: torch.Tensor):
        # grad_tensors: the layer's inputs that require grad, then (when known) its trainable parameters
        ctx.set_materialize_grads(False)
        manager = call.manager
        leaves = list(call.leaves)
        if call.offload_leaf is not None:
            call.entry = manager.save(call.leaves[call.offload_leaf], call.trace_layer)
            call.leaves[call.offload_leaf] = None   # keep no reference: the GPU copy is freed after this layer
        grad_mode = manager.forward_grad and saved_tensors_hooks_enabled()
        if grad_mode:
            # Same requires_grad flags as in the original graph (detached: this graph is thrown away).
            detached: dict[int, torch.Tensor] = {}
            for i in call.grad_leaves:
                t = leaves[i]
                leaves[i] = detached.setdefault(id(t), t.detach().requires_grad_(True))
        args, kwargs = pytree.tree_unflatten(leaves, call.spec)
        del leaves
        trace = manager.ops.trace
        t0 = trace.mark() if trace else None
        if grad_mode:
            # Grad mode ON, as in standard (non-reentrant) checkpointing and in plain training: kernels whose choice
            # can depend on it (SDPA's backend and variant: with or without the log-sum-exp) are the same ones, so
            # the offloaded forward computes the same bits. Nothing is kept: every tensor autograd would save is
            # dropped by the pack hook, and the outputs are detached from this throw-away graph.
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_discard_saved, _never_unpacked), \
                    _private_collector() as inner:
                out = call.fn(*call.fn_args, *args, **kwargs)
            out = pytree.tree_map_only(torch.Tensor, lambda t: t.detach(), out)
        else:
            with _private_collector() as inner:
                out = call.fn(*call.fn_args, *args, **kwargs)   # grad mode is off inside Function.forward
        side = [(k, t.detach()) for k, t in _recorded(inner)]
        if trace:
            trace.add("fwd", "compute", call.trace_layer, call.entry.seq if call.entry else -1, t0, trace.mark())
        del args, kwargs
        ctx.call = call
        call.tuple_out = isinstance(out, tuple)
        if not side:
            return out
        # the side outputs go to the caller's collector through _SideOutput (see offloaded_checkpoint); the token
        # output makes autograd run their backward before this layer's
        call.side_keys = [k for k, _ in side]
        call.side_grads = [None] * len(side)
        call.side_pending = side
        token = dummy.new_zeros(0)
        return (*out, token) if call.tuple_out else (out, token)

    @staticmethod
    def backward(ctx, *grad_outputs) -> tuple:
        call: _Call | None = ctx.call
        if call is None:
            raise RuntimeError(
                "offloaded checkpointing: backward ran twice through the same layer (retain_graph=True is not "
                "supported); use standard checkpointing for double backward.")
        ctx.call = None
        manager = call.manager
        if call.params is None and not checkpoint_valid():
            raise RuntimeError(
                "offloaded checkpointing of a bare function (no module given) is not compatible with "
                "torch.autograd.grad() or backward(inputs=...): its parameter gradients are accumulated into .grad by "
                "a nested backward. Pass module= (as the decoder-layer switch does), or use loss.backward().")
        n_leaves = len(call.grad_leaves)
        needs = ctx.needs_input_grad[2:]
        need_leaves, need_params = list(needs[:n_leaves]), list(needs[n_leaves:])
        leaves = list(call.leaves)
        slot = None
        if call.entry is not None:
            x, slot = manager.begin_backward(call.entry)
            leaves[call.offload_leaf] = x
        trace = manager.ops.trace
        t0 = trace.mark() if trace else None
        try:
            leaf_grads, param_grads = _recompute_and_backward(call, leaves, grad_outputs, call.params, need_leaves,
                                                              need_params)
        finally:
            if slot is not None:
                # After the layer's nested backward has been issued (it reads autograd's saved views of the staged
                # input) -- and also when it failed, so that the slot's next copy waits for whatever was issued.
                manager.end_backward(slot, call.entry)
        del leaves
        if trace:
            trace.add("bwd", "compute", call.trace_layer, call.entry.seq if call.entry else -1, t0, trace.mark())
        return (None, None, *leaf_grads, *param_grads)


def offloaded_checkpoint(function: Callable, *args, manager: OffloadManager, layer_index: int = -1,
                         module: nn.Module | None = None, preserve_rng_state: bool | None = None,
                         **checkpoint_kwargs) -> Any:
    """Checkpoint ``function(*args)`` with its first positional tensor offloaded to the manager's pinned pool.

    A drop-in for ``torch.utils.checkpoint.checkpoint`` as transformers calls it
    (``function = partial(layer.__call__, **kwargs)``); ``checkpoint_kwargs`` such as ``use_reentrant`` are
    accepted and ignored. Without grad (eval, ``torch.no_grad``) the function just runs: nothing is offloaded.

    Args:
        function: the layer call; a ``functools.partial`` whose keyword tensors that require grad get gradients.
        manager: the :class:`OffloadManager` holding the pool and buffers.
        layer_index: the decoder layer's index (for traces).
        module: the layer, to tell whether it has trainable parameters (LoRA) when no input requires grad.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    fn, fn_args, keywords = function, (), {}
    if isinstance(function, functools.partial):
        fn, fn_args, keywords = function.func, function.args, dict(function.keywords)
    leaves, spec = pytree.tree_flatten((list(args), keywords))
    grad_leaves = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
    layer_params = list(module.parameters()) if module is not None else []    # one pass per layer call
    if is_zero3_partitioned(layer_params):
        raise NotImplementedError("offloaded checkpointing under DeepSpeed ZeRO-3 is not supported (its partitioned "
                                  "parameters are gathered by hooks it has not been tested with): shard with FSDP2's "
                                  "fully_shard, or use offload_buffers=0")
    trainable = [p for p in layer_params if p.requires_grad]
    params_need_grad = module is None or bool(trainable)
    if not grad_leaves and not params_need_grad:
        return function(*args)   # nothing in this layer needs a gradient: no graph, nothing to offload
    offload_leaf = None
    if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point() \
            and args[0].device == manager.device and args[0].numel() > 0:
        offload_leaf = 0   # args are flattened first: leaf 0 is the first positional argument (hidden_states)
    preserve = manager.preserve_rng_state if preserve_rng_state is None else preserve_rng_state
    # The layer's trainable parameters become inputs of the offloaded node (their gradients then flow like any
    # other layer's). Not under FSDP2: there module.parameters() are the sharded copies, while the recompute runs on
    # the unsharded ones fully_shard's pre-forward hook gathers; a nested backward accumulates into those, and
    # FSDP's own post-backward hook reduce-scatters them into the sharded .grad, as for a layer without offload.
    params = None if module is None or is_fsdp2(module) else trainable
    call = _Call(manager=manager, fn=fn, fn_args=fn_args, leaves=leaves, spec=spec, offload_leaf=offload_leaf,
                 grad_leaves=grad_leaves, entry=None, trace_layer=layer_index, params=params,
                 autocast=_autocast_state(manager.device.type))
    if preserve:
        call.cpu_rng = torch.get_rng_state()
        if manager.cuda:
            call.dev_rng = torch.cuda.get_rng_state(manager.device)
    # A zero-size dummy that requires grad keeps the output in the graph when no input requires grad (the first
    # layer under LoRA): the backward still runs and reaches the adapters inside. Reentrant torch checkpoint
    # silently drops those gradients.
    dummy = torch.empty((0,), requires_grad=True)
    grad_tensors = [leaves[i] for i in grad_leaves]
    del args
    result = _OffloadedLayer.apply(call, dummy, *grad_tensors, *(params or ()))
    if not call.side_pending:
        return result
    *outs, token = result
    collector = output_collector().get()
    for i, (key, value) in enumerate(call.side_pending):
        collector[key].append(_SideOutput.apply(token, value, call, i))
    call.side_pending = None
    return tuple(outs) if call.tuple_out else outs[0]


class LayerCheckpointFunc:
    """What a decoder layer's ``_gradient_checkpointing_func`` is set to: the offloaded checkpoint of that layer."""

    def __init__(self, manager: OffloadManager, layer_index: int, layer: nn.Module):
        self.manager = manager
        self.layer_index = layer_index
        self._layer = weakref.ref(layer)

    def __call__(self, function: Callable, *args, **checkpoint_kwargs):
        return offloaded_checkpoint(function, *args, manager=self.manager, layer_index=self.layer_index,
                                    module=self._layer(), **checkpoint_kwargs)

    def __repr__(self) -> str:
        m = self.manager
        return (f"OffloadedCheckpoint(layer={self.layer_index}, buffers={m.buffers}, prefetch={m.prefetch}, "
                f"device={m.device})")


__all__ = ["offloaded_checkpoint", "LayerCheckpointFunc"]
