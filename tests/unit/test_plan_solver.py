"""The memory plan's solver (``fastsft_lab.offload.solver``, ``plan.solve``): the fastest plan that fits, checked
against exhaustive search; what each phase of a step holds; the budget in bytes; the timings it is given."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

import fastsft_lab
from fastsft_lab.lab.scenarios.budget import ranked
from fastsft_lab.models import build_model
from fastsft_lab.structure import decoder_layers
from fastsft_lab.offload import plan as P
from fastsft_lab.offload.solver import alive

from _plan_helpers import GiB, _model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# -- the solver ------------------------------------------------------------------------------------------------------
def _cost(keep, sel, ckpt, seconds=(1.0, 1.2, 1.5, 1.6, 10.0), tokens=1000, saved=0, transient=None):
    """A layer's costs; offload_saved (the fifth) by default over a slow link (10 s: never the fastest). With
    ``transient`` (what a recomputed layer's forward allocates at once) the forwards' most is set too."""
    forward = {} if transient is None else {"keep": keep + transient // 4, "selective": sel + transient,
                                            "checkpoint": transient, "offload": transient,
                                            "offload_saved": transient + saved}
    return P.LayerCost("layer", tokens, dict(zip(P.CHOICES, seconds)),
                       {"keep": keep, "selective": sel, "checkpoint": ckpt, "offload": 0, "offload_saved": saved},
                       forward=forward)


def _phased_peak(costs, cs, base, loss_base, forward_base=None):
    """A plan's peak from the three phases of a step measured with every layer offloaded (holding nothing): in
    layer i's forward its forward's most beside what the layers before it keep (``forward_base`` has the largest
    recomputed forward in it); at the loss each layer holds what it keeps; walking the backward from the last layer
    to the first, layer i's activations are all there beside what the layers before it keep (``base`` has the
    largest layer's activations in it: its recompute). ``loss_base`` None: the whole step's peak stands for the
    loss; a forward not measured per layer: every layer's bytes added whole."""
    held = [c.held[x] for c, x in zip(costs, cs)]
    loss = (base if loss_base is None else loss_base) + sum(held)
    largest = max(c.held["keep"] for c in costs)
    backward = max(base - largest + sum(held[:i]) + costs[i].held["keep"] for i in reversed(range(len(costs))))
    forward = -1
    if forward_base is not None and all(c.forward for c in costs):
        transient = max(c.forward["offload"] for c in costs)
        forward = max(forward_base - transient + sum(held[:i]) + costs[i].forward[x] for i, x in enumerate(cs))
    elif forward_base is not None:
        forward = forward_base + sum(held)
    return max(loss, backward, forward)


def _exhaustive(costs, budget, base, staging, saved_extra=0, loss_base=None, forward_base=None):
    best = None
    for cs in itertools.product(P.CHOICES, repeat=len(costs)):
        peak = (_phased_peak(costs, cs, base, loss_base, forward_base) - (0 if "offload" in cs else staging)
                + (saved_extra if "offload_saved" in cs else 0))
        if peak <= budget:
            t = sum(c.seconds[x] for c, x in zip(costs, cs))
            if best is None or t < best[0]:
                best = (t, cs)
    return best


def test_a_noisy_keep_reading_cannot_make_keeping_dearer_than_recomputing(monkeypatch):
    """keep runs a subset of the kernels of selective and checkpoint: a keep time above theirs (the host was busy
    during one reading: 404 ms against 5.4 ms seen under load) is noise, and must not price keep out of the plan."""
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, num_layers=1)
    layer = decoder_layers(model)[0]
    x = torch.randn(1, 64, model.config.hidden_size)
    pos = torch.arange(64)[None]
    rotary = model.model.rotary_emb(x, pos)
    readings = {"keep": 9.0, "selective": 0.2, "checkpoint": 0.3}      # the copies and the forward: 0.01
    monkeypatch.setattr(P, "_timed", lambda device, fns, repeats: {name: readings.get(name, 0.01) for name in fns})
    cost = P.measure_layer(lambda h: layer(h, position_embeddings=rotary, position_ids=pos, attention_mask=None),
                           x, [], resident=[*layer.parameters()], repeats=1)
    assert cost.seconds["keep"] == 0.2 and cost.seconds["checkpoint"] == 0.3


def test_timings_taken_in_rounds_move_alike_under_a_drift(monkeypatch):
    """The device slows down while the choices are measured (each call 4% slower than the one before: clocks, a
    busy host): read in rounds, each choice's median shifts by about the same factor, so their ratio stays within
    10% of the true one (measured one choice after another, the last one's reading would be ~30% dearer); and one
    call held up tenfold does not move a median."""
    clock = {"now": 0.0, "calls": 0}
    monkeypatch.setattr(P.time, "perf_counter", lambda: clock["now"])

    def work(cost: float, hiccup: int | None = None):
        def run():
            clock["calls"] += 1
            clock["now"] += cost * (1 + 0.04 * clock["calls"]) * (10 if clock["calls"] == hiccup else 1)
        return run

    true = {"keep": 1.0, "selective": 1.3, "checkpoint": 1.5, "forward": 0.4}
    got = P._timed(torch.device("cpu"), {name: work(cost) for name, cost in true.items()}, repeats=5)
    for name, cost in true.items():
        assert got[name] / got["keep"] == pytest.approx(cost / true["keep"], rel=0.1), (name, got)
    clock.update(now=0.0, calls=0)
    got = P._timed(torch.device("cpu"), {"a": work(1.0, hiccup=9), "b": work(1.0)}, repeats=5)
    assert got["a"] / got["b"] == pytest.approx(1.0, rel=0.1), got


@pytest.mark.parametrize("phased", [None, "loss", "forward", "layer-forwards"])
@pytest.mark.parametrize("seed", range(20))
def test_solver_equals_exhaustive_search(seed, phased):
    """The solver's plan is the fastest of every per-layer plan whose peak fits, for a step's peak measured whole
    (``None``) or by phase: loss and backward apart; the forward too, without or with each layer's forward."""
    rng = random.Random(seed)
    n = rng.randint(3, 7)
    costs = []
    for _ in range(n):
        ckpt = rng.randint(50, 100)
        sel = ckpt + rng.randint(50, 400)
        keep = sel + rng.randint(0, 600)
        t = sorted(rng.uniform(1, 3) for _ in range(4))
        # offload_saved: keep's time plus what the link does not hide (none to more than a recompute)
        costs.append(_cost(keep, sel, ckpt, (*t, t[0] + rng.uniform(0, 3)), saved=rng.randint(0, 20),
                           transient=rng.randint(100, 500) if phased == "layer-forwards" else None))
    base, staging, saved_extra = 1000, 2 * 100, max(c.held["keep"] for c in costs)
    # the backward's peak above the loss's by up to two layers' activations (a fused loss), or below it; the
    # forward's about the loss's
    loss_base = base - rng.randint(-200, 2 * saved_extra) if phased else None
    forward_base = loss_base + rng.randint(-300, 300) if phased in ("forward", "layer-forwards") else None
    budget = max(base, loss_base or 0, forward_base or 0) + rng.randint(0, sum(c.held["keep"] for c in costs)
                                                                        + saved_extra)
    plan = P.solve(costs, budget, base, staging=staging, saved_extra=saved_extra, loss_base=loss_base,
                   forward_base=forward_base)
    best = _exhaustive(costs, budget, base, staging, saved_extra, loss_base, forward_base)
    assert plan.peak <= budget and plan.peak == _phased_peak(costs, plan.choices, base, loss_base, forward_base) \
        - (0 if "offload" in plan.choices else staging) + (saved_extra if "offload_saved" in plan.choices else 0)
    assert plan.seconds == pytest.approx(best[0], rel=1e-12), (plan, best)
    assert plan.seconds == pytest.approx(sum(c.seconds[x] for c, x in zip(costs, plan.choices)))


@pytest.mark.parametrize("phased", [False, True], ids=["whole-step-peak", "three-phases"])
@pytest.mark.parametrize("seed", range(8))
def test_ranked_search_is_the_exhaustive_search_and_solve_is_its_first(seed, phased):
    """The budget scenario's ``ranked`` (what it measures the solver against) enumerates every plan: its first is the
    independent search's best and :func:`solve`'s; the rest fit, in order, each a different (peak, time); a last layer
    that pays a first reload is priced as :func:`solve` prices it."""
    rng = random.Random(100 + seed)
    n = rng.randint(3, 6)
    costs = [_cost(300 + rng.randint(0, 600), 200, 60, tuple(sorted(rng.uniform(1, 3) for _ in range(4)))
                   + (rng.uniform(1, 4),), saved=rng.randint(0, 20),
                   transient=rng.randint(100, 400) if phased else None) for _ in range(n)]
    costs[-1] = dataclasses.replace(costs[-1], first_reload=rng.uniform(0, 1))
    base, staging, saved_extra = 1000, 200, 50
    loss_base = base - rng.randint(0, 900) if phased else None
    forward_base = base - rng.randint(0, 900) if phased else None
    budget = base + rng.randint(200 * n, sum(c.held["keep"] for c in costs) + saved_extra)
    plans = ranked(costs, budget, base, staging=staging, saved_extra=saved_extra, limit=5, loss_base=loss_base,
                   forward_base=forward_base)
    timed = [*costs[:-1], dataclasses.replace(costs[-1], seconds={**costs[-1].seconds, "offload_saved":
                                              costs[-1].seconds["offload_saved"] + costs[-1].first_reload})]
    best = _exhaustive(timed, budget, base, staging, saved_extra, loss_base, forward_base)
    solved = P.solve(costs, budget, base, staging=staging, saved_extra=saved_extra, loss_base=loss_base,
                     forward_base=forward_base)
    assert plans[0].seconds == pytest.approx(best[0], rel=1e-12) == pytest.approx(solved.seconds, rel=1e-12)
    assert [p.seconds for p in plans] == sorted(p.seconds for p in plans)
    assert len({(p.peak, round(p.seconds, 12)) for p in plans}) == len(plans) > 1
    for p in plans:
        assert p.peak <= budget
        assert (p.peak, p.seconds) == pytest.approx(P.predict(costs, p.choices, base, staging=staging,
                                                               saved_extra=saved_extra, loss_base=loss_base,
                                                               forward_base=forward_base))


def test_ranked_refuses_a_search_too_large_to_enumerate():
    with pytest.raises(ValueError, match="more than 390625: use fewer layers"):
        ranked([_cost(4, 2, 1)] * 9, 10**9, 0)


def test_solver_uses_the_whole_budget_to_the_byte():
    # exactly enough bytes for every layer to keep: the plan keeps every layer (a check off by one unit would not)
    costs = [_cost(4096, 1024, 512) for _ in range(8)]
    base, staging = 10_000, 1024
    full = base + 8 * 4096 - staging
    assert P.solve(costs, full, base, staging=staging).choices == ("keep",) * 8
    one_short = P.solve(costs, full - 1, base, staging=staging)
    assert one_short.choices.count("keep") == 7 and one_short.peak <= full - 1


def test_solver_charges_the_last_layer_too():
    # a budget for seven kept layers and an eighth checkpointed: the last layer's bytes count like the others'
    costs = [_cost(4096, 4000, 512) for _ in range(8)]
    plan = P.solve(costs, 10_000 + 7 * 4096 + 512, 10_000, staging=0)
    assert plan.choices.count("keep") == 7 and "checkpoint" in plan.choices, plan
    assert plan.peak == 10_000 + 7 * 4096 + 512


def test_solver_keeps_the_last_layer_free_where_the_backward_sets_the_peak():
    """Measured on an H100 (Qwen3-14B x8, fused loss): every layer offloaded peaks in the last layer's backward, its
    recompute beside everything else; a kept last layer's activations are those same bytes, so at that peak the
    last layer is kept (and no other). Where the loss sets the peak, keeping it costs its bytes."""
    costs = [_cost(4096, 4000, 512) for _ in range(8)]
    base = 10_000 + 4096                            # the last layer's recompute in the backward
    loss_base = 10_000                              # the loss phase: no layer's activations
    plan = P.solve(costs, base, base, staging=0, loss_base=loss_base)
    assert plan.choices == ("offload",) * 7 + ("keep",) and plan.peak == base, plan
    assert P.solve(costs, base, base, staging=0).choices == ("offload",) * 8        # the whole step's peak alone
    assert P.solve(costs, base, base, staging=0, loss_base=base).choices == ("offload",) * 8
    # every layer kept: its peak is at the loss, all eight layers' activations there
    assert P.predict(costs, ("keep",) * 8, base, loss_base=loss_base)[0] == loss_base + 8 * 4096
    # room for seven layers' activations and one input: one layer recomputed, never the last (its recompute would
    # stand beside the seven kept in the backward)
    plan = P.solve(costs, loss_base + 7 * 4096 + 512, base, staging=0, loss_base=loss_base)
    assert plan.choices.count("keep") == 7 and plan.choices.count("checkpoint") == 1, plan
    assert plan.choices[-1] == "keep" and alive(costs, plan.choices) == 512 + 7 * 4096
    # the forward measured apart (CUDA): a recomputed layer's forward allocates 1024 at once, a kept one its 4096
    # and 1024 / 4 more: with the forward at 9_000 + 1024, keeping the last layer peaks there at 9_000 + 4096 + 256
    # and at the loss at 10_000 - 1024 + 4096: both under the backward's
    layered = [_cost(4096, 4000, 512, transient=1024) for _ in range(8)]
    plan = P.solve(layered, base, base, staging=0, loss_base=10_000 - 1024, forward_base=9_000 + 1024)
    assert plan.choices == ("offload",) * 7 + ("keep",) and plan.peak == base, plan
    # 1000 more in the forward: the kept layer's forward would pass the budget by 256
    assert "keep" not in P.solve(layered, base, base, staging=0, loss_base=10_000 - 1024,
                                 forward_base=10_000 + 1024).choices


def test_solver_drops_the_staging_buffers_when_nothing_offloads():
    costs = [_cost(4096, 1024, 512) for _ in range(2)]
    # every layer kept fits only because a plan without offloaded layers needs no staging buffers
    plan = P.solve(costs, 10_000 + 2 * 4096 - 2048, 10_000, staging=2048)
    assert plan.choices == ("keep", "keep") and plan.peak == 10_000 + 2 * 4096 - 2048


def test_a_budget_below_the_smallest_plan_names_the_smallest_that_works():
    with pytest.raises(P.BudgetError, match=r"give at least 1\.00 GiB"):
        P.solve([_cost(10, 5, 2)], GiB // 2, GiB)


def test_cost_scales_with_tokens():
    c = _cost(4096, 1024, 512).at(2000)
    assert c.tokens == 2000 and c.held["keep"] == 8192 and c.seconds["keep"] == pytest.approx(2.0)


def test_solver_is_fast_at_full_depth():
    # 40 layers of one kind and 24 of two alternating kinds: the front stays small (the plan is solved inside a step)
    import time

    for costs in ([_cost(4096, 1500, 512)] * 40,
                  [_cost(4096, 1500, 512), _cost(3000, 1400, 512, (0.8, 1.0, 1.3, 1.35))] * 12):
        t0 = time.perf_counter()
        plan = P.solve(costs, 10_000 + sum(c.held["keep"] for c in costs) // 2, 10_000, staging=1024)
        assert time.perf_counter() - t0 < 2.0 and len(plan.choices) == len(costs)


def test_the_allocator_ceiling_is_reachable_memory_less_step_ones_slack():
    gib = P.GiB
    assert P.allocator_ceiling(free=2 * gib, reserved=10 * gib, peak_reserved=12 * gib, peak_allocated=9 * gib) \
        == 9 * gib
    # no slack measured (every reserved byte allocated at the peak): everything reachable
    assert P.allocator_ceiling(free=gib, reserved=3 * gib, peak_reserved=3 * gib, peak_allocated=3 * gib) == 4 * gib


def test_a_share_of_free_memory_needs_a_device_that_reports_it():
    with pytest.raises(ValueError, match="does not report its free memory"):
        fastsft_lab.apply(_model("tiny-qwen3"), memory_budget="90%")


def test_free_gpu_memory_counts_what_the_allocator_holds_unallocated(monkeypatch):
    """The driver counts PyTorch's cached blocks as used: after a large step (the budget scenario's calibration at
    16k tokens) it reported 39 GiB free of 140, and the frontier stopped at 35 GiB. What a new tensor can get is the
    driver's free memory plus the cache's unallocated part."""
    gib = P.GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (39 * gib, 140 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 96 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 16 * gib)
    assert P.device_memory(torch.device("cuda")) == (140 * gib, (39 + 96 - 16) * gib)
    assert P.parse_budget("50%", *P.device_memory(torch.device("cuda"))) == int(119 * gib * 0.5)


def test_a_share_of_free_memory_is_on_top_of_what_the_model_holds(monkeypatch):
    """A budget is the step's peak and the loaded model is in it: "90%" is what is allocated now plus 90% of what is
    free. (GPT-OSS-20B on an H100: 38 GiB of weights, 40 GiB free; 90% of the free memory alone, 36 GiB, was refused
    as below what the model holds.)"""
    gib = P.GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (40 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 38 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 38 * gib)
    assert P.budget_bytes("90%", torch.device("cuda")) == 38 * gib + int(40 * gib * 0.9)
    assert P.budget_bytes(60, torch.device("cuda")) == 60 * gib          # a size is the peak itself
