"""The memory plan on several ranks: each rank measures its own memory; under FSDP2 the ranks take one plan.

Under DDP each rank plans alone, for its own batch: the gradients' all-reduce is the same whatever a layer keeps.

Under FSDP2 (``fully_shard`` per decoder layer, then the root) a rank holds its shards of every layer and, while a
layer runs, that layer's gathered weights. FSDP2's all-gathers and reduce-scatters run from the layers' forward and
backward hooks, which each choice fires in its own way (a kept layer gathers its weights for the backward from FSDP's
pre-backward hook; a recomputed one runs its forward hooks again inside the backward; an offloaded one outside torch's
checkpoint). Ranks on different plans would rely on those orders matching; so the ranks of a sharded model agree:

* the plan: every rank's problem at the ranks' largest token count, combined (:func:`combine`: for each layer the
  most each rank measured, each phase's fixed part the most of any rank, the smallest budget), then solved alike on
  every rank -- one plan whose predicted peak bounds each rank's own;
* the token count each step, whose growth re-plans: one all-reduce of an int per step on a gloo group (host memory:
  no device sync);
* step 1's floor: a budget below one rank's smallest plan is refused on every rank, not on that one alone.

Measuring a sharded layer (:func:`unsharded`): its weights are all-gathered first (the layer's own ``unshard()``), its
FSDP hooks run as in a recompute while the measurement runs forward and ``torch.autograd.grad`` (no collective, no
gradient reduced into the shards), and it is resharded after; the shards' own storages are never touched.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import nn

from .._compat import fsdp2_hooks_as_in_recompute, is_fsdp2
from .solver import CHOICES, LayerCost, _smallest


# -- what a rank holds -------------------------------------------------------------------------------------------------
def local(t: torch.Tensor) -> torch.Tensor:
    """The part of ``t`` this rank holds: a DTensor's (FSDP2's sharded parameters) local shard, else ``t``."""
    if hasattr(t, "to_local"):
        with torch.no_grad():
            return t.to_local()
    return t


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds of ``tensors`` (a sharded parameter: its shard)."""
    return sum((lt := local(t)).numel() * lt.element_size() for t in tensors)


def full_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors`` whole (a sharded parameter: all-gathered)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def storage_ptrs(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The storage pointers of ``tensors`` this rank can read (a sharded parameter has none: its storage is not a
    plain one, and FSDP2 frees its gathered copy between uses)."""
    return {t.untyped_storage().data_ptr() for t in tensors if not hasattr(t, "to_local")}


def sharded(layers: Sequence[nn.Module]) -> bool:
    """Whether the decoder layers are FSDP2 modules (``fully_shard`` per layer)."""
    return any(is_fsdp2(layer) for layer in layers)


def check_sharding(layers: Sequence[nn.Module]) -> None:
    """One line refusing FSDP2 inside a decoder layer: the plan measures and runs a layer as one unit, which
    ``fully_shard`` per decoder layer (then the root) keeps; a module within a layer sharded on its own is not
    tested."""
    for i, layer in enumerate(layers):
        inner = next((n for n, m in layer.named_modules() if m is not layer and is_fsdp2(m)), None)
        if inner is not None:
            raise NotImplementedError(f"memory_budget under FSDP2 takes fully_shard per decoder layer, then the root; "
                                      f"decoder layer {i}'s {inner} is sharded on its own (shard whole layers)")


def model_bytes(root: nn.Module, layers: Sequence[nn.Module]) -> int:
    """What a rank holds of the model: its parameters and buffers (the shards, where sharded) and, under FSDP2, two
    decoder layers' gathered weights (the running one and the next, which FSDP2 gathers ahead)."""
    held = held_bytes(root.parameters()) + held_bytes(root.buffers())
    if sharded(layers):
        held += 2 * max(full_bytes(layer.parameters()) for layer in layers)
    return held


@contextlib.contextmanager
def unsharded(layer: Any) -> Iterator[None]:
    """Inside: an FSDP2 ``layer``'s weights gathered and registered on it (``layer.parameters()`` then lists the
    gathered ones), its hooks as in a recompute (:func:`fastsft_lab._compat.fsdp2_hooks_as_in_recompute`); resharded
    on exit. A no-op for a layer ``fully_shard`` does not manage."""
    if layer is None or not is_fsdp2(layer):
        yield
        return
    layer.unshard()
    try:
        with fsdp2_hooks_as_in_recompute([layer]):
            yield
    finally:
        layer.reshard()


# -- one plan for every rank -------------------------------------------------------------------------------------------
def _most_of(costs: Sequence[LayerCost]) -> LayerCost:
    """One layer's costs over the ranks: the most of each reading, the union of the ops recomputed anyway."""
    def most(attr: str) -> dict:
        keys = set.intersection(*(set(getattr(c, attr)) for c in costs))
        return {k: max(getattr(c, attr)[k] for c in costs) for k in sorted(keys)}

    return replace(costs[0], seconds=most("seconds"), held=most("held"), readings=most("readings"),
                   forward=most("forward") if all(c.forward for c in costs) else {},
                   first_reload=max(c.first_reload for c in costs),
                   unsaved=frozenset().union(*(c.unsaved for c in costs)))


def combine(problems: Sequence[dict], budgets: Sequence[int]) -> tuple[dict, int]:
    """One problem and budget for every rank from each rank's (``MemoryPlanner.problem`` at the same tokens), such
    that any plan's predicted peak (:func:`fastsft_lab.offload.solver.predict`) on the combined problem is at least
    its predicted peak on every rank's own, and its predicted time the slowest rank's:

    * each layer: the most any rank measured of each choice's bytes and seconds;
    * each phase's base: the most any rank has beyond what its layers hold in the smallest plan, plus what the
      combined layers hold there (a base is measured with every layer offloaded; the plan's layers move it);
    * the staging buffers a plan without offloading is spared: the fewest of any rank; what ``offload_saved`` adds:
      the most;
    * the choices every rank allows; the smallest budget.

    A single rank's problem comes back equal."""
    if len(problems) != len(budgets) or not problems:
        raise ValueError(f"combine: {len(problems)} problems for {len(budgets)} budgets")
    depth = {len(p["costs"]) for p in problems}
    if len(depth) != 1:
        raise ValueError(f"combine: the ranks' plans have different depths ({sorted(depth)} decoder layers)")
    costs = [_most_of(layer) for layer in zip(*(p["costs"] for p in problems))]
    at_loss, most, forward_off = _smallest(costs)
    smallest = [_smallest(p["costs"]) for p in problems]
    base = max(p["base"] - s[1] for p, s in zip(problems, smallest)) + most
    loss_base = None
    if any(p["loss_base"] is not None for p in problems):
        loss_base = max((p["base"] if p["loss_base"] is None else p["loss_base"]) - s[0]
                        for p, s in zip(problems, smallest)) + at_loss
    forward_base = None
    measured = [(p, s) for p, s in zip(problems, smallest) if p["forward_base"] is not None]
    if measured:
        if forward_off is None and any(s[2] is not None for _, s in measured):
            raise ValueError("combine: some ranks measured their layers' forwards and some did not")
        own = [(s[0] if forward_off is None else s[2]) for _, s in measured]
        forward_base = max(p["forward_base"] - o for (p, _), o in zip(measured, own)) + \
            (at_loss if forward_off is None else forward_off)
    allowed = set.intersection(*(set(p["choices"]) for p in problems))
    combined = {"costs": costs, "base": base, "loss_base": loss_base, "forward_base": forward_base,
                "staging": min(p["staging"] for p in problems),
                "saved_extra": max(p["saved_extra"] for p in problems),
                "choices": tuple(c for c in CHOICES if c in allowed)}
    return combined, min(budgets)


class Ranks:
    """The ranks a sharded model's plan agrees over (the default process group), through a gloo group: what they
    exchange is host ints and objects, so no device syncs."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.world = dist.get_world_size()
        self.rank = dist.get_rank()
        # a gloo default group (a CPU, or "cpu:gloo,cuda:nccl") takes host tensors itself; NCCL gets a gloo group
        self.group = None if "gloo" in str(dist.get_backend()) else dist.new_group(backend="gloo")

    def max(self, value: int) -> int:
        """The largest of every rank's ``value``."""
        t = torch.tensor([value], dtype=torch.int64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order."""
        out: list = [None] * self.world
        self.dist.all_gather_object(out, obj, group=self.group)
        return out

    def agree(self, problem: dict, budget: int) -> tuple[dict, int]:
        """:func:`combine` of every rank's ``problem`` and ``budget`` (the same on every rank)."""
        # the ops a layer recomputes anyway are this rank's own (the same model everywhere): not sent
        mine = {**problem, "costs": [replace(c, unsaved=frozenset()) for c in problem["costs"]]}
        everyone = self.gather((mine, budget))
        combined, budget = combine([p for p, _ in everyone], [b for _, b in everyone])
        combined["costs"] = [replace(c, unsaved=own.unsaved) for c, own in zip(combined["costs"], problem["costs"])]
        return combined, budget


def ranks_of(layers: Sequence[nn.Module]) -> Ranks | None:
    """The ranks to agree with: those of the default process group where the decoder layers are sharded by FSDP2
    over more than one rank; None otherwise (one process, DDP: each rank plans alone)."""
    import torch.distributed as dist

    if not sharded(layers) or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return Ranks()


__all__ = ["Ranks", "check_sharding", "combine", "full_bytes", "held_bytes", "local", "model_bytes", "ranks_of",
           "sharded", "storage_ptrs", "unsharded"]
