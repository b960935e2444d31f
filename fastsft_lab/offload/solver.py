"""Solving a memory plan: the per-layer choices with the least predicted time whose predicted peak fits a budget
(:func:`solve`), and the prediction it minimises and bounds (:func:`predict`). Pure arithmetic over measured costs
(:class:`LayerCost`, measured by :func:`fastsft_lab.offload.plan.measure_layer`); the live model's side is :mod:`fastsft_lab.offload.plan`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

CHOICES = ("keep", "selective", "checkpoint", "offload", "offload_saved")
GiB = 1 << 30


def _size(b: float) -> str:
    return f"{b / GiB:.2f} GiB" if b >= GiB / 100 else f"{b / 2**20:.1f} MiB"


@dataclass(frozen=True)
class LayerCost:
    """What one kind of decoder layer costs under each choice, at ``tokens`` tokens.

    ``seconds[c]``: forward + backward under choice ``c`` (for ``offload``: the checkpoint's time plus the reload
    and the store that the double buffer cannot hide). ``held[c]``: bytes kept on the GPU from the layer's forward
    to its backward. Both grow with the tokens: :meth:`at` scales them linearly (the packed backends' attention
    memory is linear in tokens)."""

    kind: str
    tokens: int
    seconds: dict[str, float]
    held: dict[str, int]
    unsaved: frozenset = frozenset()      # saved_ops() the layer changes in place: recomputed by ``selective``
    # the two readings ``held["keep"]`` is the larger of: "saved" (what autograd's saved-tensor hooks saw) and, on
    # CUDA, "allocated" (memory_allocated after the forward, less the output): reported, so a prediction that misses
    # says which reading it came from; and "pinned", the host memory offload_saved pins for the layer (each
    # allocation rounded up to a power of two by torch's pinned allocator)
    readings: dict = field(default_factory=dict)
    # offload_saved in the layer whose backward runs first (the last layer): its reload has no later layer's backward
    # to hide behind, so the part of it the other layers hide is paid here (seconds)
    first_reload: float = 0.0
    # CUDA: the most the layer's forward allocates at once under each choice (its output, what it keeps and what it
    # frees before returning: a kept layer's activations and the transients of a recomputed one overlap); empty
    # where not measured (a CPU): then the forward phase is not predicted apart
    forward: dict = field(default_factory=dict)

    @property
    def pinned(self) -> int:
        """Host bytes the layer's saved activations take in pinned memory (offload_saved)."""
        return self.readings.get("pinned", self.held["keep"])

    def at(self, tokens: int) -> "LayerCost":
        if tokens == self.tokens:
            return self
        r = tokens / self.tokens
        return replace(self, tokens=tokens, seconds={c: s * r for c, s in self.seconds.items()},
                       held={c: int(math.ceil(b * r)) for c, b in self.held.items()},
                       readings={k: int(math.ceil(b * r)) for k, b in self.readings.items()},
                       first_reload=self.first_reload * r,
                       forward={c: int(math.ceil(b * r)) for c, b in self.forward.items()})


class BudgetError(ValueError):
    """The budget cannot be met by any plan (the message names the smallest budget that works)."""


@dataclass(frozen=True)
class Plan:
    """One choice per decoder layer, with what it was predicted to cost."""

    choices: tuple[str, ...]
    budget: int                  # bytes
    peak: int                    # predicted peak bytes of a step
    seconds: float               # predicted decoder-layer time of a step (forward + backward)
    tokens: int
    by_hand: bool = False        # set by :func:`set_plan`, not solved

    def counts(self) -> dict[str, int]:
        return {c: self.choices.count(c) for c in CHOICES if c in self.choices}

    def describe(self) -> str:
        parts = ", ".join(f"{n} {c}" for c, n in self.counts().items())
        if self.by_hand:
            return f"{parts} (set by hand)"
        return (f"{parts} (predicted peak {_size(self.peak)} of {_size(self.budget)} at {self.tokens} "
                f"tokens, layers {self.seconds * 1e3:.0f} ms)")


def alive(costs: Sequence[LayerCost], choices: Sequence[str]) -> int:
    """The most bytes the decoder layers hold at once in the backward. It runs the layers last to first and frees
    each layer's activations once its backward is done, so in layer ``i``'s backward the layers before it hold what
    they keep and layer ``i`` holds all its activations whatever its choice -- kept, rebuilt by a recompute or
    reloaded: ``held["keep"]``. A recompute therefore costs least in the first layers, whose backward runs last,
    and keeping the last layer costs nothing here (its activations are the ones rebuilt first anyway)."""
    return _most(costs, choices, lambda cost, _: cost.held["keep"])


def forward_most(costs: Sequence[LayerCost], choices: Sequence[str]) -> int:
    """The most bytes the decoder layers hold at once in the forward: in layer ``i``'s forward what the layers before
    it keep, beside its own forward's most (:attr:`LayerCost.forward`)."""
    return _most(costs, choices, lambda cost, choice: cost.forward[choice])


def _most(costs: Sequence[LayerCost], choices: Sequence[str], own: Callable[[LayerCost, str], int]) -> int:
    """The most bytes held at once when each layer in turn needs ``own(cost, choice)`` beside what the layers before
    it keep."""
    held = most = 0
    for cost, choice in zip(costs, choices, strict=True):
        most = max(most, held + own(cost, choice))
        held += cost.held[choice]
    return most


def _offloaded(costs: Sequence[LayerCost]) -> list[str]:
    """The plan the bases are measured on: every layer offloaded (checkpointed where it cannot offload)."""
    return ["offload" if "offload" in c.held else "checkpoint" for c in costs]


def _smallest(costs: Sequence[LayerCost]) -> tuple[int, int, int | None]:
    """What the layers hold in the plan the bases were measured on (:func:`_offloaded`): (at the loss, at most
    in the backward, at most in the forward where measured)."""
    offload = _offloaded(costs)
    forward = forward_most(costs, offload) if all(c.forward for c in costs) else None
    return sum(c.held[x] for c, x in zip(costs, offload)), alive(costs, offload), forward


def _best_plan(costs: Sequence[LayerCost], allowed: tuple, total: int, most: int,
               forward: int | None = None) -> tuple[tuple, int, float] | None:
    """The least-time choices among ``allowed`` whose layers hold at most ``total`` bytes at the loss, at most
    ``most`` in the backward (:func:`alive`) and, given, at most ``forward`` in the forward (:func:`forward_most`):
    (choices, bytes held at the loss, seconds)."""
    # front: (bytes held by the layers so far, seconds, choices as a linked list (previous, choice)), bytes ascending
    # and seconds strictly descending; a partial plan holding fewer bytes leaves every later layer more room (at the
    # loss and in each later layer's backward), so one holding more bytes *and* taking longer is never in the best
    front: list[tuple[int, float, Any]] = [(0, 0.0, None)]
    for cost in costs:
        room = most - cost.held["keep"]            # this layer's backward: its activations beside the earlier layers'
        # this layer's forward: its most beside the earlier layers' (no bound where the forward is not measured)
        options = [(cost.held[c], cost.seconds[c], c, -math.inf if forward is None else cost.forward[c] - forward)
                   for c in allowed]
        cand = sorted((b + w, t + s, (cs, c)) for b, t, cs in front if b <= room
                      for w, s, c, over in options if b + w <= total and b + over <= 0)
        front = []
        for b, t, cs in cand:
            if not front or t < front[-1][1]:
                front.append((b, t, cs))
        if not front:
            return None
    held, seconds, node = front[-1]               # the most bytes that fit buy the least time
    picked: list[str] = []
    while node is not None:
        node, c = node
        picked.append(c)
    return tuple(reversed(picked)), held, seconds


def _with_first_reload(costs: Sequence[LayerCost]) -> list[LayerCost]:
    """``costs`` with the last layer's ``offload_saved`` time paying its first reload (its backward runs first:
    nothing hides it)."""
    last = costs[-1] if costs else None
    if last is None or not last.first_reload or "offload_saved" not in last.seconds:
        return list(costs)
    return [*costs[:-1], replace(last, seconds={**last.seconds, "offload_saved": last.seconds["offload_saved"]
                                                + last.first_reload})]


def predict(costs: Sequence[LayerCost], choices: Sequence[str], base: int, *, staging: int = 0,
            saved_extra: int = 0, loss_base: int | None = None, forward_base: int | None = None
            ) -> tuple[int, float]:
    """The predicted peak (bytes) and decoder-layer time (seconds) of one per-layer plan, as :func:`solve` bounds and
    minimises them (:func:`predictor` for many plans of the same layers).

    The peak is the largest of three phases, each measured with every layer offloaded and moved by what this plan's
    layers hold there: the forward (``forward_base``; :func:`forward_most`), from its end to the decoder layers'
    backward (``loss_base``: the loss; every layer holds what it keeps) and that backward (``base``;
    :func:`alive`). A phase not measured apart is in the next one's base (the forward in ``loss_base``, both in
    ``base``), which then bounds it: every layer's bytes added whole. The staging buffers count when some layer
    offloads its input, ``saved_extra`` when some layer offloads its saved activations."""
    return predictor(costs, base, staging=staging, saved_extra=saved_extra, loss_base=loss_base,
                     forward_base=forward_base)(choices)


def predictor(costs: Sequence[LayerCost], base: int, *, staging: int = 0, saved_extra: int = 0,
              loss_base: int | None = None, forward_base: int | None = None
              ) -> Callable[[Sequence[str]], tuple[int, float]]:
    """:func:`predict` for ``costs`` and these bases as a function of the choices: what does not depend on them is
    worked out once (an exhaustive search predicts every plan of the same layers)."""
    timed = _with_first_reload(costs)
    at_loss, most, forward_off = _smallest(costs)
    loss_base = base if loss_base is None else loss_base

    def peak_and_seconds(choices: Sequence[str]) -> tuple[int, float]:
        held = sum(c.held[x] for c, x in zip(costs, choices, strict=True))
        loss = loss_base + held - at_loss
        backward = base + alive(costs, choices) - most
        if forward_base is None:
            forward: float = -math.inf
        elif forward_off is None:       # the layers' forwards not measured: every layer's bytes added whole
            forward = forward_base + held - at_loss
        else:
            forward = forward_base + forward_most(costs, choices) - forward_off
        peak = int(max(loss, backward, forward) - (0 if "offload" in choices else staging)
                   + (saved_extra if "offload_saved" in choices else 0))
        return peak, sum(c.seconds[x] for c, x in zip(timed, choices, strict=True))
    return peak_and_seconds


def solve(costs: Sequence[LayerCost], budget: int, base: int, *, staging: int = 0, saved_extra: int = 0,
          choices: Sequence[str] = CHOICES, loss_base: int | None = None, forward_base: int | None = None) -> Plan:
    """The per-layer choices with the least predicted time (:func:`predict`) whose predicted peak fits ``budget``
    bytes, exactly.

    A dynamic programme over the layers keeps, after each layer, the Pareto front of (bytes held, time) over the
    choices so far -- a partial plan that holds more bytes *and* takes longer than another can never be part of the
    best plan, since the loss and every later layer's backward hold those bytes beside their own -- so the answer
    is the exact optimum of :func:`predict`, to the byte (layers of one kind keep the front small).

    Args:
        costs: each decoder layer's :class:`LayerCost`, in order, at the tokens to plan for.
        budget: bytes the step may peak at.
        base: predicted peak with every layer offloaded (weights, optimizer state, logits, the recompute's
            workspace and the staging buffers all in it).
        loss_base: the same plan's peak from the end of the forward to the decoder layers' backward (the loss),
            where measured apart: then ``base`` bounds the backward alone, and a plan keeping the last layers is not
            charged for them twice.
        forward_base: the same plan's peak in the forward, where measured apart (with :attr:`LayerCost.forward`):
            then ``loss_base`` bounds the loss alone.
        staging: the offload's staging buffers, in ``base``: a plan that offloads no layer does not need them.
        saved_extra: what a plan with ``offload_saved`` layers holds on top of ``base`` (their stores in flight in
            the forward, the prefetched layer beside the current one in the backward).

    Raises:
        BudgetError: when not even every layer offloaded fits.
    """
    smallest = predict(costs, _offloaded(costs), base,
                       loss_base=loss_base, forward_base=forward_base)[0]
    if smallest > budget:
        raise BudgetError(f"memory_budget {_size(budget)} is below the smallest plan's peak "
                          f"({_size(smallest)}, every layer offloaded): give at least {_size(smallest)}")
    choices = [c for c in choices if all(c in cost.held and c in cost.seconds for cost in costs)]
    timed = _with_first_reload(costs)
    at_loss, most, forward_off = _smallest(costs)
    best: Plan | None = None
    # four cases: some layer offloads its input (the staging buffers are paid) or none does (they are not); some
    # layer offloads its saved activations (the prefetched layer's activations are paid) or none does
    for offloads in (True, False):
        for saves in (True, False):
            allowed = tuple(c for c in choices if (offloads or c != "offload") and (saves or c != "offload_saved"))
            extra = (0 if offloads else staging) - (saved_extra if saves else 0)
            total = budget - (base if loss_base is None else loss_base) + at_loss + extra
            backward = budget - base + most + extra
            forward = None
            if forward_base is not None and forward_off is None:   # bounded as the loss is (:func:`predict`)
                total = min(total, budget - forward_base + at_loss + extra)
            elif forward_base is not None and forward_off is not None:
                forward = budget - forward_base + forward_off + extra
            if not allowed or min(total, backward, math.inf if forward is None else forward) < 0:
                continue
            found = _best_plan(timed, allowed, total, backward, forward)
            if found is None:
                continue
            cs_, _, seconds = found
            peak, _ = predict(costs, cs_, base, staging=staging, saved_extra=saved_extra, loss_base=loss_base,
                              forward_base=forward_base)
            plan = Plan(cs_, budget, peak, seconds, costs[0].tokens if costs else 0)
            if best is None or (plan.seconds, plan.peak) < (best.seconds, best.peak):
                best = plan
    if best is None:      # only when "offload" is not among the choices
        raise BudgetError(f"memory_budget {_size(budget)}: no plan of {', '.join(choices)} fits")
    return best


__all__ = ["CHOICES", "GiB", "LayerCost", "BudgetError", "Plan", "alive", "forward_most", "predict", "predictor",
           "solve"]
