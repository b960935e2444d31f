"""The checkpointing plan for a memory budget (fastsft_lab.offload.plan): every per-layer choice and every mix of
them computes what plain training computes; the solver finds the fastest plan that fits (checked against exhaustive
search); the measured bytes order the choices; bad budgets get one-line errors."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

import fastsft_lab
from fastsft_lab.data import benchmark_batches
from fastsft_lab.lab.scenarios.budget import ranked
from fastsft_lab.models import LoraSettings, build_model, decoder_layers
from fastsft_lab.offload import plan as P
from fastsft_lab.offload.solver import alive

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
GiB = P.GiB


def _batch(tokens=192, row=96, vocab=256, seed=0):
    return benchmark_batches(tokens_per_step=tokens, row_tokens=row, steps=1, vocab_size=vocab, mix="short",
                             seed=seed)[0].model_inputs()


def _step(model, inputs, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**inputs).loss
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_bitwise(ref, got):
    (l0, g0), (l1, g1) = ref, got
    assert set(g0) == set(g1), "a different set of parameters received gradients"
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


_MODELS: dict = {}


def _model(preset, lora=True, dropout=0.0, num_layers=4):
    key = (preset, lora, dropout, num_layers)
    if key not in _MODELS:
        m = build_model(preset, device="cpu", dtype=torch.float32, num_layers=num_layers,
                        lora=LoraSettings(rank=4, dropout=dropout) if lora else None)
        m.train()
        _MODELS[key] = m
    return _MODELS[key]


# -- exactness -------------------------------------------------------------------------------------------------------
PLANS = {"keep": ("keep",) * 4, "selective": ("selective",) * 4, "checkpoint": ("checkpoint",) * 4,
         "offload": ("offload",) * 4, "mixed": ("keep", "offload", "selective", "checkpoint"),
         "mixed-2": ("offload", "selective", "offload", "keep"), "offload_saved": ("offload_saved",) * 4,
         "mixed-3": ("offload_saved", "selective", "keep", "offload_saved")}


def _plan_on(model, **kw):
    """apply(memory_budget=16) with offload_saved moving every saved activation (the tiny models' are all under the
    default 1 MiB it leaves on the device)."""
    state = fastsft_lab.apply(model, memory_budget=16, **kw)
    P.memory_planner(model).saved.min_bytes = 0
    return state


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gpt-oss"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full-ft"])
def test_every_choice_and_mix_equals_plain_training(preset, lora):
    model = _model(preset, lora)
    inputs = _batch()
    reference = _step(model, inputs)            # no checkpointing: nothing of ours touches it
    _plan_on(model)
    try:
        for choices in PLANS.values():
            P.set_plan(model, choices)
            _assert_bitwise(reference, _step(model, inputs))
        assert P.memory_planner(model).saved.stats.bytes_loaded > 0     # offload_saved moved what it saved
    finally:
        fastsft_lab.revert(model)
    _assert_bitwise(reference, _step(model, inputs))


def test_plans_compose_with_packed_metadata_sync_free_routing_and_fused_loss():
    model = _model("tiny-gpt-oss", True)
    inputs = _batch()
    fastsft_lab.apply(model, packed_attention="sdpa", moe_routing="sync_free", fused_loss=True)
    try:
        reference = _step(model, inputs)
        _plan_on(model)
        for choices in (PLANS["mixed"], PLANS["mixed-2"], PLANS["selective"], PLANS["mixed-3"]):
            P.set_plan(model, choices)
            _assert_bitwise(reference, _step(model, inputs))
    finally:
        fastsft_lab.revert(model)


def test_dropout_is_replayed_in_every_recompute():
    model = _model("tiny-qwen3", True, dropout=0.3)
    inputs = _batch()
    reference = _step(model, inputs, seed=3)
    _plan_on(model)
    try:
        for plan in (PLANS["mixed"], PLANS["mixed-3"]):
            P.set_plan(model, plan)
            _assert_bitwise(reference, _step(model, inputs, seed=3))
    finally:
        fastsft_lab.revert(model)


def test_the_measuring_step_and_the_solved_plan_equal_plain_training():
    # step 1 measures each kind of layer inside the step (RNG and output collectors kept out of it), step 2 runs the
    # solved plan: both steps compute what plain training computes
    model = _model("tiny-qwen3", True, dropout=0.3)
    inputs = _batch()
    reference = _step(model, inputs, seed=5)
    state = fastsft_lab.apply(model, memory_budget=16)
    try:
        assert state.checkpointing == "plan" and "measuring" in state.memory_plan
        _assert_bitwise(reference, _step(model, inputs, seed=5))
        planner = P.memory_planner(model)
        assert set(planner.costs) == {"Qwen3DecoderLayer:full_attention"}
        _assert_bitwise(reference, _step(model, inputs, seed=5))
        assert planner.plan is not None and len(planner.plan.choices) == 4
        # 16 GiB holds everything on a CPU: every layer takes its fastest measured choice (timings decide which)
        cost = planner.costs["Qwen3DecoderLayer:full_attention"]
        best = min(cost.seconds.values())
        assert all(cost.seconds[c] == best for c in planner.plan.choices), (planner.plan, cost.seconds)
        shown = fastsft_lab.state(model).memory_plan
        assert planner.plan.describe() in shown
        # and why: every choice's measured time and bytes for the layer kind
        assert all(f"{c} {cost.seconds[c] * 1e3:.1f} ms" in shown for c in P.CHOICES), shown
    finally:
        fastsft_lab.revert(model)
    assert fastsft_lab.state(model).checkpointing == "none"
    assert all(not layer.gradient_checkpointing for layer in decoder_layers(model))


def test_the_measuring_step_leaves_nothing_of_its_measurement_alive():
    # step 1 runs each kind of layer once more under saved-tensor hooks and an op recorder, with no backward: what
    # they hold must go with them (a saved output returned as itself, or an op output kept with its grad_fn, is a
    # cycle through autograd's C++ nodes that stays allocated for the process's life: one layer's activations)
    from _offload_helpers import graph_tensors

    model = _model("tiny-qwen3", True)
    inputs = _batch()
    _step(model, inputs)
    before = graph_tensors()             # (an earlier test's, if any)
    fastsft_lab.apply(model, memory_budget=16)
    try:
        _step(model, inputs)
        assert "Qwen3DecoderLayer:full_attention" in P.memory_planner(model).costs
        leaked = graph_tensors(besides=before)
        assert leaked == [], f"{len(leaked)} tensors of the measurement's graph outlive it"
    finally:
        fastsft_lab.revert(model)


def test_each_layer_runs_the_choice_its_plan_names():
    # what plain autograd keeps is seen by a saved-tensors hook around the step; a checkpointed, selective or
    # offloaded layer keeps its activations behind its own hooks (or none): only kept layers add to the count
    model = _model("tiny-qwen3", True)
    inputs = _batch()

    def kept_bytes(choices):
        seen: dict = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        P.set_plan(model, choices)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**inputs).loss          # the forward only: a recompute in backward saves for a moment
        loss.backward()
        model.zero_grad(set_to_none=True)
        return sum(seen.values())

    fastsft_lab.apply(model, memory_budget=16)
    try:
        _step(model, inputs)         # step 1 measures outside the counted steps
        none = kept_bytes(("checkpoint", "selective", "offload", "checkpoint"))
        one = kept_bytes(("checkpoint", "keep", "offload", "checkpoint"))
        two = kept_bytes(("checkpoint", "keep", "keep", "checkpoint"))
        every = kept_bytes(("keep",) * 4)
    finally:
        fastsft_lab.revert(model)
    # each kept layer adds its activations (kept neighbours share the residual stream: not a fixed amount)
    assert none < one < two < every, (none, one, two, every)
    assert two - none > 1.5 * (one - none) and every - none > 3 * (one - none), (none, one, two, every)


# -- what each choice holds -----------------------------------------------------------------------------------------
def test_measured_bytes_order_the_choices_and_grow_with_tokens():
    model = _model("tiny-qwen3", False)
    layer = decoder_layers(model)[0]
    costs = {}
    for tokens in (256, 512):
        x = torch.randn(1, tokens, model.config.hidden_size)
        pos = torch.arange(tokens)[None]
        rope = model.model.rotary_emb(x, pos)
        fn = lambda h, layer=layer, rope=rope, pos=pos: layer(h, position_embeddings=rope, position_ids=pos)
        costs[tokens] = P.measure_layer(fn, x, [p for p in layer.parameters() if p.requires_grad], repeats=1)
    c = costs[256]
    in_bytes = 256 * model.config.hidden_size * 4
    assert c.held["checkpoint"] == in_bytes and c.held["offload"] == 0
    # selective keeps the input and the matmul / attention outputs: more than the input, less than everything
    assert in_bytes < c.held["selective"] < c.held["keep"], c.held
    # the q/k/v/o, gate/up/down outputs alone are at least this many bytes
    h, inter = model.config.hidden_size, model.config.intermediate_size
    assert c.held["selective"] >= in_bytes + 256 * 4 * (2 * h + 3 * inter)
    for choice in ("keep", "selective", "checkpoint"):
        assert costs[512].held[choice] >= 2 * c.held[choice] * 0.95, choice
    assert set(c.seconds) == set(P.CHOICES) and all(s > 0 for s in c.seconds.values())


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


# -- the switch ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, match", [(-1, "positive"), (0, "positive"), ("lots", "a size in GiB"),
                                        ("150%", "between 0% and 100%"), (float("nan"), "a size in GiB"),
                                        (True, "a size in GiB"), (10**9, "above the device's memory"),
                                        (1e-6, "below what the model already holds")])
def test_bad_budgets_are_refused_in_one_line_and_change_nothing(bad, match):
    model = _model("tiny-qwen3")
    with pytest.raises(ValueError, match=match) as err:
        fastsft_lab.apply(model, packed_attention="sdpa", memory_budget=bad)
    assert "\n" not in str(err.value)
    assert fastsft_lab.state(model) == fastsft_lab.ModelState()       # nothing switched on, the backend neither


def test_a_budget_no_plan_meets_is_refused_at_the_first_layer_of_the_first_step():
    model = _model("tiny-qwen3")
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    fastsft_lab.apply(model, memory_budget=(weights + 1024) / GiB)     # the weights fit; a step's activations do not
    try:
        with pytest.raises(P.BudgetError, match=r"give at least [0-9.]+ (GiB|MiB)$") as err:
            _step(model, _batch())
        assert "\n" not in str(err.value)
        assert P.memory_planner(model).steps == 1
    finally:
        fastsft_lab.revert(model)


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


def test_budget_and_hand_set_checkpointing_say_which_wins():
    model = _model("tiny-qwen3")
    with pytest.raises(ValueError, match="offload_buffers=0 .* contradicts it"):
        fastsft_lab.apply(model, memory_budget=16, offload_buffers=0)
    with pytest.raises(ValueError, match="max_tokens needs memory_budget"):
        fastsft_lab.apply(model, max_tokens=4096)
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        fastsft_lab.apply(model, memory_budget=16, max_tokens=0)
    try:
        state = fastsft_lab.apply(model, memory_budget=16, offload_buffers=1, max_tokens=4096)
        assert state.checkpointing == "plan" and P.memory_planner(model).buffers == 1
        assert P.memory_planner(model).max_tokens == 4096
        with pytest.warns(UserWarning, match="replaces the memory plan"):
            state = fastsft_lab.apply(model, offload_buffers=2)
        assert state.checkpointing == "offload" and state.memory_plan is None
    finally:
        fastsft_lab.revert(model)
    assert fastsft_lab.state(model) == fastsft_lab.ModelState()


def test_set_plan_checks_its_choices():
    model = _model("tiny-qwen3")
    with pytest.raises(ValueError, match="needs a memory plan"):
        P.set_plan(model, ["keep"] * 4)
    fastsft_lab.apply(model, memory_budget=16)
    try:
        with pytest.raises(ValueError, match="3 choices for 4 decoder layers"):
            P.set_plan(model, ["keep"] * 3)
        with pytest.raises(ValueError, match="unknown choice 'recompute'; the choices are keep, selective"):
            P.set_plan(model, ["keep", "keep", "keep", "recompute"])
    finally:
        fastsft_lab.revert(model)


def test_a_larger_batch_replans_for_its_tokens():
    model = _model("tiny-qwen3")
    fastsft_lab.apply(model, memory_budget=16)
    try:
        _step(model, _batch(tokens=128, row=64))
        _step(model, _batch(tokens=128, row=64))
        planner = P.memory_planner(model)
        assert planner.plan.tokens == 128
        _step(model, _batch(tokens=256, row=64))
        assert planner.plan.tokens == 256
        _step(model, _batch(tokens=128, row=64))
        assert planner.plan.tokens == 256               # a smaller batch keeps the plan
    finally:
        fastsft_lab.revert(model)


def test_step_ones_peaks_by_phase_make_the_bases_and_a_missing_one_folds_into_the_next():
    """CUDA reads step 1's peak at the end of the forward (then resets the counter), at the loss and in the
    backward; each phase's base scales with the tokens above what was allocated before the step. Where the loss was
    not read apart, the forward's peak goes back into the whole step's (else it would be lost with the reset)."""
    model = _model("tiny-qwen3")
    fastsft_lab.apply(model, memory_budget=16)
    try:
        _step(model, _batch(tokens=128, row=64))
        planner = P.memory_planner(model)
        planner.static, planner.allowance, planner.tokens = 1000, 10, 128
        planner.peak, planner.loss_peak, planner.forward_peak = 5000, 3000, 6000
        assert (planner.forward_base(256), planner.loss_base(256), planner.base(256)) == (11_010, 5_010, 9_010)
        problem = planner.problem(256)
        assert planner.smallest(256) == P.predict(problem["costs"], ["offload"] * len(planner.layers), 9_010,
                                                  loss_base=5_010, forward_base=11_010, staging=problem["staging"],
                                                  saved_extra=problem["saved_extra"])[0] >= 11_010
        planner.loss_peak = None
        assert (planner.forward_base(128), planner.loss_base(128), planner.base(128)) == (None, None, 6010)
    finally:
        fastsft_lab.revert(model)


def test_the_allocator_ceiling_is_reachable_memory_less_step_ones_slack():
    gib = P.GiB
    assert P.allocator_ceiling(free=2 * gib, reserved=10 * gib, peak_reserved=12 * gib, peak_allocated=9 * gib) \
        == 9 * gib
    # no slack measured (every reserved byte allocated at the peak): everything reachable
    assert P.allocator_ceiling(free=gib, reserved=3 * gib, peak_reserved=3 * gib, peak_allocated=3 * gib) == 4 * gib


def test_a_budget_above_the_ceiling_is_solved_under_the_ceiling_and_says_so():
    """CUDA reads the ceiling at step 2 (the memory this process can reach less the allocator's slack of step 1);
    a budget above it -- "100%" of the free memory -- must not be planned to the last byte: on the H200 such a plan
    ran out of memory with 3.2 GiB reserved but unallocated. Here the ceiling is set as CUDA would set it."""
    model = _model("tiny-qwen3")
    fastsft_lab.apply(model, memory_budget=16)
    try:
        inputs = _batch()
        _step(model, inputs)
        planner = P.memory_planner(model)
        # the measured bytes, with times in the order a GPU measures them (a busy CPU can time keep no faster than
        # checkpoint, and offload then ties with it): what is tested is the ceiling, not the clock
        for kind, cost in planner.costs.items():
            planner.costs[kind] = dataclasses.replace(cost, seconds=dict(zip(P.CHOICES, (1.0, 1.2, 1.5, 1.6, 10.0))))
        unbounded = planner.solve(planner.tokens)
        assert set(unbounded.choices) == {"keep"}           # 16 GiB keeps every layer of the tiny model
        planner.ceiling = unbounded.peak - 1                  # one byte short of keeping everything
        _step(model, inputs)
        plan = planner.plan
        assert plan.budget == planner.ceiling and plan.peak <= planner.ceiling and "keep" in plan.choices
        assert set(plan.choices) != {"keep"}
        assert "solved under" in planner.describe()
        planner.ceiling = 64 * P.GiB                          # above the budget: the budget binds, nothing said
        assert planner.solve(planner.tokens).budget == planner.budget and "solved under" not in planner.describe()
    finally:
        fastsft_lab.revert(model)


def test_solver_is_fast_at_full_depth():
    # 40 layers of one kind and 24 of two alternating kinds: the front stays small (the plan is solved inside a step)
    import time

    for costs in ([_cost(4096, 1500, 512)] * 40,
                  [_cost(4096, 1500, 512), _cost(3000, 1400, 512, (0.8, 1.0, 1.3, 1.35))] * 12):
        t0 = time.perf_counter()
        plan = P.solve(costs, 10_000 + sum(c.held["keep"] for c in costs) // 2, 10_000, staging=1024)
        assert time.perf_counter() - t0 < 2.0 and len(plan.choices) == len(costs)


# -- the frontier benchmark ------------------------------------------------------------------------------------------
def test_budget_scenario_runs_the_frontier_from_the_smallest_plan_to_keeping_everything(tmp_path):
    from fastsft_lab.lab.scenarios import run_scenario
    from fastsft_lab.lab.scenarios.budget import budgets_between

    (result,) = run_scenario("budget", device="cpu", smoke=True, out_dir=str(tmp_path), steps=1, warmup=0,
                             progress=False)
    rows = result["variants"]
    plans = [r for r in rows if "plan" in r["toggles"]]
    # the smallest budget fits only what holds nothing; the largest lets every layer take its fastest measured choice
    (cost,) = result["config"]["layer_costs"].values()
    best = min(cost["seconds"].values())
    assert plans[0]["toggles"]["plan"] == ["offload"] * 4
    assert all(cost["seconds"][c] == best for c in plans[-1]["toggles"]["plan"]), (plans[-1], cost)
    predicted = [r["toggles"]["predicted_peak_bytes"] for r in plans]
    assert predicted == sorted(predicted) and len(set(predicted)) == len(predicted)
    assert all(r["toggles"]["predicted_peak_bytes"] <= r["toggles"]["memory_budget_bytes"] for r in plans)
    assert all("step_ms" in r for r in rows), [r.get("error") for r in rows]
    # the collator's host metadata on every row: no plan, and no reference, pays a host sync in the step
    assert all(r["host_syncs_per_step"] == 0 for r in rows), [(r["name"], r["host_syncs_per_step"]) for r in rows]
    assert [r["name"] for r in rows[-2:]] == ["offload x2 + prefetch everywhere (README recipe)", "no checkpointing"]
    assert (tmp_path / "budget-tiny-qwen3-512.json").exists()
    # MFU's FLOPs as the model trains (LoRA: the frozen base takes no weight gradient): below the 6 N T convention
    assert 0 < result["config"]["model_flops_per_step"] == rows[0]["flops_per_step"]
    assert budgets_between(10, 20, 3) == [10, 15, 20] and budgets_between(10, 10, 5) == [10]


# -- CUDA: the plan holds its budget where memory is measured --------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("kept, fused_loss", [(1, False), (3, False), (1, True), (3, True)])
def test_cuda_plan_holds_its_budget_and_trains_as_plain_training(kept, fused_loss):
    """A budget with room for ``kept`` kept layers (and half of one more) above the smallest plan: the solved plan
    mixes choices, the measured peak stays under the budget (and near the prediction), and the losses equal plain
    training's to bf16 rounding; with the 152k-vocabulary loss unfused and fused (its peak to the loss far lower:
    the step's two phases, each moved by what the plan's layers hold there)."""
    model = build_model("qwen3-0.6b", device="cuda", dtype=torch.bfloat16, num_layers=8, lora=LoraSettings(rank=8))
    model.train()
    inputs = {k: v.cuda() if torch.is_tensor(v) else v for k, v in _batch(tokens=4096, row=2048, vocab=1000).items()}
    plain = _step(model, inputs)[0]
    held_before = torch.cuda.memory_allocated()
    fastsft_lab.apply(model, memory_budget="100%", fused_loss=fused_loss)   # measure: step 1 and 2, any plan fits
    try:
        _step(model, inputs)
        _step(model, inputs)
        # the budget from this planner's own measurement, solved as at step 2 (a second apply measures a step 1 of
        # its own, whose base need not be this one's: on the H200 it came out above this budget, 8.93 > 8.84 GiB)
        planner = P.memory_planner(model)
        keep = max(planner.costs[k].held["keep"] for k in planner.kinds)
        budget = int(planner.smallest(4096) + (kept + 0.5) * keep)
        planner.budget = budget
        planner.plan = planner.solve(4096)
        loss_base, forward_base = planner.loss_base(4096), planner.forward_base(4096)
        assert loss_base is not None and forward_base is not None and loss_base <= planner.base(4096)
        assert all(c.forward for c in planner.costs.values())
        assert len(set(planner.plan.choices)) > 1, \
            (planner.plan.describe(), forward_base / GiB, loss_base / GiB, planner.base(4096) / GiB, budget / GiB,
             {k: (c.held, c.forward) for k, c in planner.costs.items()})
        torch.cuda.reset_peak_memory_stats()
        loss = _step(model, inputs)[0]
        peak = torch.cuda.max_memory_allocated()
        assert peak <= budget, (peak / GiB, budget / GiB, planner.plan.describe())
        assert peak >= 0.8 * planner.plan.peak, (peak / GiB, planner.plan.describe())
        torch.testing.assert_close(loss.float(), plain.float(), rtol=2 * 2**-8, atol=0)
    finally:
        fastsft_lab.revert(model)
    # nothing of the measuring step stays allocated (it once kept a layer's activations for the process's life)
    import gc

    planner = None                      # the plan's own buffers go with it
    gc.collect()
    left = torch.cuda.memory_allocated() - held_before
    assert left < keep / 4, (left / 2**20, keep / 2**20)


def test_attribution_scenario_runs_one_cumulative_chain_checked_against_exact_packing(tmp_path):
    from fastsft_lab.lab.scenarios import run_scenario

    results = run_scenario("attribution", device="cpu", smoke=True, out_dir=str(tmp_path), steps=1, warmup=0,
                           progress=False)
    dense, moe = results
    assert dense["config"]["chain"] == ["stock transformers", "+ sdpa kernel, metadata per layer",
                                        "+ metadata cached", "+ offload, one buffer", "+ double buffer",
                                        "+ fused loss", "+ memory plan (16 GiB)"]
    # fix 3 from transformers' default experts: sync-free grouping with eager glue, then the fused glue kernels
    assert moe["config"]["chain"][3:5] == ["+ sync-free routing, eager glue", "+ fused gate/combine kernels"]
    assert moe["variants"][3]["toggles"]["glue"] == "eager" and moe["variants"][4]["toggles"]["glue"] == "fused"
    for step in moe["config"]["chain"][3:5]:       # float32: no routing decision flips, the reference within rounding
        check = moe["routing"][step]
        assert sum(check["flipped_tokens"]) == 0 and check["forced"]["rel"] < 1e-5, check
    for doc in results:
        rows = {r["name"]: r for r in doc["variants"]}
        assert all("step_ms" in r for r in rows.values()), [r.get("error") for r in rows.values()]
        assert rows["+ sdpa kernel, metadata per layer"]["host_syncs_in_layers"] > 0
        assert rows["+ metadata cached"]["host_syncs_in_layers"] == 0
        # every step after the reference computes the same numbers (exact or within float32 reordering)
        for name in doc["config"]["chain"][2:]:
            eq = rows[name]["equal_to_first"]
            assert eq["bitwise"] or max(eq["loss_rel"], eq["grad_rel"]) < 1e-4, (name, eq)
        assert set(doc["derived"]) >= {"gain_metadata_cached", "gain_double_buffer", "all_over_stock"}
        assert "(predicted peak" in rows["+ memory plan (16 GiB)"]["toggles"]["plan"]
    # stock GPT-OSS attention over packed rows lets sequences see each other: not the same numbers
    leak = moe["variants"][0]["equal_to_first"]
    assert max(leak["loss_rel"], leak["grad_rel"]) > 1e-2, leak
    assert len(list(tmp_path.glob("attribution_*.png"))) == 2


def test_the_plan_under_torch_compile_equals_plain_training():
    # dynamo traces the model; the plan's bookkeeping runs eagerly (torch.compiler.disable), the layers as planned
    model = _model("tiny-qwen3", True)
    inputs = _batch()
    reference = _step(model, inputs)
    compiled = torch.compile(model, backend="eager")
    fastsft_lab.apply(compiled, memory_budget=16)
    try:
        for _ in range(2):                                   # the measuring step, then the solved plan
            _assert_bitwise(reference, _step(compiled, inputs))
        assert P.memory_planner(model).plan is not None
        P.memory_planner(model).saved.min_bytes = 0
        for plan in (PLANS["mixed"], PLANS["mixed-3"]):
            P.set_plan(model, plan)
            _assert_bitwise(reference, _step(compiled, inputs))
    finally:
        fastsft_lab.revert(compiled)
        torch.compiler.reset()


def test_a_solved_plan_pays_no_host_sync_in_the_layers():
    from fastsft_lab.packing import packed_inputs
    from fastsft_lab.profiling import SyncCounter

    model = _model("tiny-gpt-oss", True)
    batch = benchmark_batches(tokens_per_step=192, row_tokens=96, steps=1, vocab_size=256, mix="short")[0]
    fastsft_lab.apply(model, packed_attention="sdpa", moe_routing="sync_free", fused_loss=True, memory_budget=16)
    try:
        for _ in range(2):                         # step 1 measures (it syncs to time), step 2 solves
            model(**packed_inputs(batch)).loss.backward()
        for choices in (P.memory_planner(model).plan.choices, PLANS["mixed"]):
            P.set_plan(model, choices)
            with SyncCounter.for_decoder_layers(model, device="cpu") as syncs:
                model(**packed_inputs(batch)).loss.backward()
            assert syncs.in_modules == 0, (choices, dict(syncs.by_kind))
    finally:
        model.zero_grad(set_to_none=True)
        fastsft_lab.revert(model)


def test_frozen_weights_autograd_saves_are_not_counted_as_held():
    # LoRA: the frozen base weights are saved by the matmuls for the input's gradient, but the GPU holds them anyway
    model = _model("tiny-qwen3", True)
    layer = decoder_layers(model)[0]
    x = torch.randn(1, 128, model.config.hidden_size)
    pos = torch.arange(128)[None]
    rope = model.base_model.model.model.rotary_emb(x, pos)
    fn = lambda h: layer(h, position_embeddings=rope, position_ids=pos)   # noqa: E731
    trainable = [p for p in layer.parameters() if p.requires_grad]
    frozen = [p for p in layer.parameters() if not p.requires_grad]
    counted = P.measure_layer(fn, x, trainable, repeats=1)
    resident = P.measure_layer(fn, x, trainable, repeats=1, resident=[*frozen, *layer.buffers()])
    frozen_bytes = sum(p.numel() * p.element_size() for p in frozen if p.dim() == 2)
    assert counted.held["keep"] - resident.held["keep"] >= 0.9 * frozen_bytes, (counted.held, resident.held)
    assert resident.held["keep"] > resident.held["checkpoint"]


def test_selective_saves_the_nf4_matmuls_and_stays_exact():
    """QLoRA's NF4 projections are one custom op (``bitsandbytes::gemm_4bit``) to a dispatch mode: the selective
    choice saves their outputs as it saves aten matmuls, so its recompute in backward runs no NF4 matmul (a full
    checkpoint runs every one again), and the step equals plain training's to the bit."""
    pytest.importorskip("bitsandbytes")
    from fastsft_lab._compat import TorchDispatchMode

    model = build_model("tiny-qwen3", device="cpu", dtype=torch.bfloat16, num_layers=2, quant="nf4",
                        lora=LoraSettings(rank=4))
    model.train()
    gemm = torch.ops.bitsandbytes.gemm_4bit
    assert gemm in P.saved_ops()
    inputs = _batch()

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket is gemm
            return func(*args, **(kwargs or {}))

    def backward_gemms(choices):
        P.set_plan(model, choices)
        loss = model(**inputs).loss
        with Count() as count:
            loss.backward()
        model.zero_grad(set_to_none=True)
        return count.n

    reference = _step(model, inputs)
    fastsft_lab.apply(model, memory_budget=16)
    try:
        _step(model, inputs)                                     # step 1 measures
        per_layer = backward_gemms(("checkpoint", "keep")) - backward_gemms(("keep", "keep"))
        assert per_layer == 7, per_layer                        # q, k, v, o, gate, up, down recomputed
        assert backward_gemms(("selective", "keep")) == backward_gemms(("keep", "keep"))
        for choices in [("selective", "selective"), ("selective", "offload")]:
            P.set_plan(model, choices)
            _assert_bitwise(reference, _step(model, inputs))
    finally:
        fastsft_lab.revert(model)


def test_the_allocated_reading_counts_only_what_a_kept_layer_holds(monkeypatch):
    """A kept layer's bytes are also read from the allocator (CUDA: ``memory_allocated`` after a forward), for what
    autograd keeps outside saved tensors. That reading must come from a plain forward: the selective choice's op-
    output records hold every matmul output, saved or not, and read under them a MoE layer's unsaved expert outputs
    counted as kept (the H200's GPT-OSS plan predicted 1.21 GB a layer; it held about 0.9). Here an allocator
    stand-in counts the live op outputs (weakly, as the allocator sees them): the reading equals what autograd saves."""
    import weakref

    from fastsft_lab._compat import TorchDispatchMode, pytree

    class Allocator(TorchDispatchMode):
        def __init__(self, exclude):
            super().__init__()
            self.refs, self.exclude = [], exclude

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.refs += [weakref.ref(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            return out

        def allocated(self, device):
            live = {}
            for ref in self.refs:
                if (t := ref()) is not None and t.untyped_storage().data_ptr() not in self.exclude:
                    live[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return sum(live.values())

    model = build_model("tiny-gpt-oss", device="cpu", dtype=torch.float32, num_layers=1)
    layer = decoder_layers(model)[0]
    x = torch.randn(1, 256, model.config.hidden_size)
    pos = torch.arange(256)[None]
    rotary = model.model.rotary_emb(x, pos)
    resident = [*layer.parameters(), *layer.buffers()]
    allocator = Allocator({t.untyped_storage().data_ptr() for t in resident})
    monkeypatch.setattr(P, "_allocated_now", allocator.allocated)
    with allocator:
        cost = P.measure_layer(lambda h: layer(h, position_embeddings=rotary, position_ids=pos, attention_mask=None),
                               x, [], resident=resident, repeats=1)
    # what autograd saves, less the layer's input (allocated before the reading began)
    assert cost.readings["allocated"] + x.numel() * x.element_size() == cost.readings["saved"], cost.readings
    assert cost.held["keep"] == cost.readings["saved"]


def test_enable_memory_plan_refuses_a_budget_below_the_model_before_switching_anything():
    model = _model("tiny-qwen3")
    with pytest.raises(P.BudgetError, match="below what the model already holds"):
        P.enable_memory_plan(model, 1e-6)
    assert fastsft_lab.state(model) == fastsft_lab.ModelState() and P.memory_planner(model) is None
