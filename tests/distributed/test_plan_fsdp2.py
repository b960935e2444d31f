"""The memory plan under FSDP2 (fastsft_lab.offload.ranks): one plan for every rank whose predicted peak bounds each
rank's own (checked over every plan of random problems); a sharded layer measured on its gathered weights, the plan
exact in one process through ``fully_shard`` (applied before and after it); what a rank holds counted by its shards.
Two ranks against one process on the same global batch: ``fastsft_lab.lab.distributed``'s ``fsdp2-*plan*`` cases,
run by tests/distributed/test_distributed.py."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

import fastsft_lab
from fastsft_lab.data import benchmark_batches
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.structure import decoder_layers
from fastsft_lab.offload import plan as P
from fastsft_lab.offload import ranks as R

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# -- one plan for every rank -----------------------------------------------------------------------------------------
def _rank_problem(rng: random.Random, depth: int, measured_forward: bool, phased: bool) -> tuple[dict, int]:
    """A rank's problem as ``MemoryPlanner.problem`` gives it (random bytes and seconds; ranks differ as batches of
    different sizes and noisy clocks make them) and its budget."""
    costs = []
    for _ in range(depth):
        ckpt = rng.randint(50, 100)
        sel = ckpt + rng.randint(50, 400)
        keep = sel + rng.randint(0, 600)
        t = sorted(rng.uniform(1, 3) for _ in range(4))
        transient = rng.randint(100, 500)
        forward = ({"keep": keep + transient // 4, "selective": sel + transient, "checkpoint": transient,
                    "offload": transient, "offload_saved": transient + 5} if measured_forward else {})
        costs.append(P.LayerCost("layer", 1000, dict(zip(P.CHOICES, (*t, t[0] + rng.uniform(0, 3)))),
                                 {"keep": keep, "selective": sel, "checkpoint": ckpt, "offload": 0,
                                  "offload_saved": rng.randint(0, 20)}, forward=forward,
                                 first_reload=rng.uniform(0, 1)))
    base = rng.randint(800, 1500)
    loss_base = base - rng.randint(-200, 600) if phased else None
    forward_base = loss_base + rng.randint(-300, 300) if phased and loss_base is not None else None
    choices = P.CHOICES if rng.random() < 0.7 else tuple(c for c in P.CHOICES if c != "offload_saved")
    problem = {"costs": costs, "base": base, "loss_base": loss_base, "forward_base": forward_base,
               "staging": rng.randint(100, 300), "saved_extra": rng.randint(0, 800), "choices": choices}
    return problem, base + rng.randint(0, 3000)


def _predict(problem: dict, choices) -> tuple[int, float]:
    return P.predict(problem["costs"], choices, problem["base"], staging=problem["staging"],
                     saved_extra=problem["saved_extra"], loss_base=problem["loss_base"],
                     forward_base=problem["forward_base"])


@pytest.mark.parametrize("shape", ["whole-step", "phases", "layer-forwards"])
@pytest.mark.parametrize("seed", range(12))
def test_the_combined_problem_bounds_every_ranks_peak_for_every_plan(seed, shape):
    """Whatever plan the ranks take, its predicted peak on the combined problem is at least each rank's own, and its
    time the slowest rank's: the solved plan then fits every rank's budget by its own prediction."""
    rng = random.Random(seed)
    depth, world = rng.randint(2, 4), rng.randint(2, 3)
    ranks = [_rank_problem(rng, depth, shape == "layer-forwards", shape != "whole-step") for _ in range(world)]
    combined, budget = R.combine([p for p, _ in ranks], [b for _, b in ranks])
    assert budget == min(b for _, b in ranks)
    assert set(combined["choices"]) == set.intersection(*(set(p["choices"]) for p, _ in ranks))
    for plan in itertools.product(combined["choices"], repeat=depth):
        peak, seconds = _predict(combined, plan)
        for problem, _ in ranks:
            own_peak, own_seconds = _predict(problem, plan)
            assert peak >= own_peak, (plan, peak, own_peak)
            assert seconds >= own_seconds - 1e-12
    try:
        solved = P.solve(budget=budget, **combined)
    except P.BudgetError:
        return
    assert all(_predict(problem, solved.choices)[0] <= b for problem, b in ranks)


def test_the_combined_plan_is_tight_where_the_ranks_measured_alike():
    """The bound costs nothing where the ranks agree: one rank's problem combines to itself, and so do two equal
    ones (ranks of one model on batches of one size)."""
    problem, budget = _rank_problem(random.Random(3), 4, True, True)
    for copies in (1, 2):
        combined, b = R.combine([problem] * copies, [budget] * copies)
        assert b == budget and combined == problem


def test_the_ranks_take_the_most_conservative_plan_not_rank_zeros():
    """Rank 1's batch is twice rank 0's: alone rank 0 would keep more layers than rank 1 can hold; combined, both
    take the plan that fits rank 1."""
    problem, _ = _rank_problem(random.Random(5), 4, False, False)
    bigger = {**problem, "costs": [c.at(2 * c.tokens) for c in problem["costs"]], "base": problem["base"] + 500}
    bigger["costs"] = [dataclasses.replace(c, tokens=1000) for c in bigger["costs"]]
    budget = problem["base"] + 500 + sum(c.held["keep"] for c in problem["costs"])
    alone = P.solve(budget=budget, **problem)
    combined, b = R.combine([problem, bigger], [budget, budget])
    agreed = P.solve(budget=b, **combined)
    assert _predict(bigger, alone.choices)[0] > budget          # rank 0's own plan does not fit rank 1
    assert _predict(bigger, agreed.choices)[0] <= budget and _predict(problem, agreed.choices)[0] <= budget


def test_a_base_is_combined_above_what_its_own_layers_hold():
    """A base is measured with every layer offloaded, so it holds the largest layer's activations in the backward.
    Rank 0: the larger base, small layers; rank 1: a large first layer. The combined base must be rank 0's fixed
    part plus the combined layers' -- the larger of the two bases alone is below rank 0's peak for a plan whose
    backward is set by a later, smaller layer (here: the first layer offloaded, the others kept)."""
    def layer(keep):
        return P.LayerCost("layer", 1000, dict(zip(P.CHOICES, (1.0, 1.2, 1.5, 1.6, 10.0))),
                           {"keep": keep, "selective": keep // 2, "checkpoint": 5, "offload": 0, "offload_saved": 0})

    def problem(base, keeps):
        return {"costs": [layer(k) for k in keeps], "base": base, "loss_base": base - 1000, "forward_base": None,
                "staging": 0, "saved_extra": 0, "choices": P.CHOICES}

    ranks = [problem(1000, (100, 100, 100)), problem(950, (300, 10, 10))]
    combined, _ = R.combine(ranks, [10_000, 10_000])
    plan = ("offload", "keep", "keep")
    assert _predict(ranks[0], plan)[0] == 1000 - 100 + 200            # its backward: layer 2's 100 beside layer 1's
    assert _predict(combined, plan)[0] >= max(_predict(p, plan)[0] for p in ranks)


def test_combine_refuses_ranks_of_different_depths_in_one_line():
    a, budget = _rank_problem(random.Random(1), 3, False, False)
    b, _ = _rank_problem(random.Random(2), 4, False, False)
    with pytest.raises(ValueError, match="different depths") as err:
        R.combine([a, b], [budget, budget])
    assert "\n" not in str(err.value)


# -- what a rank holds ------------------------------------------------------------------------------------------------
class _Shard:
    """A sharded parameter as a rank sees it: the whole tensor's size, a local shard of a quarter of it."""

    def __init__(self, numel: int):
        self._numel = numel

    def numel(self) -> int:
        return self._numel

    def element_size(self) -> int:
        return 4

    def to_local(self) -> torch.Tensor:
        return torch.zeros(self._numel // 4)


def test_a_rank_holds_its_shards_and_two_layers_gathered_weights():
    shards = [_Shard(400), _Shard(800)]
    assert R.held_bytes(shards) == 4 * 300 and R.full_bytes(shards) == 4 * 1200
    assert R.storage_ptrs(shards) == set()                          # a shard's storage is never read
    plain = torch.zeros(10)
    assert R.storage_ptrs([plain]) == {plain.untyped_storage().data_ptr()}


# -- FSDP2 in one process (a process group of one rank) ------------------------------------------------------------
@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _tiny(lora: bool):
    return build_model("tiny-qwen3", device="cpu", dtype=torch.float32, seed=1,
                       lora=LoraSettings(rank=4) if lora else None)


def _sharded(model):
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def _grads(model) -> dict:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full-ft"])
@pytest.mark.parametrize("order", ["applied-before", "applied-after"])
def test_a_sharded_model_measures_plans_and_trains_as_plain_training(one_rank_group, order, lora):
    """FSDP2 on one rank: the measuring step (each layer measured on its gathered weights, FSDP's hooks as in a
    recompute: no gradient reduced into the shards), the solved plan and a plan of every choice each give plain
    training's loss and gradients, bitwise; before fully_shard (the README's order) and after it."""
    batch = benchmark_batches(tokens_per_step=256, row_tokens=128, steps=1, vocab_size=256, mix="short")[0]
    inputs = batch.model_inputs()
    ref = _tiny(lora)
    ref_loss = ref(**inputs).loss
    ref_loss.backward()
    ref_grads = _grads(ref)
    model = _tiny(lora)
    if order == "applied-before":
        fastsft_lab.apply(model, memory_budget=16)
        _sharded(model)
    else:
        fastsft_lab.apply(_sharded(model), memory_budget=16)
    planner = P.memory_planner(model)
    for step in range(3):
        if step == 2:
            P.set_plan(model, ("selective", "offload_saved", "checkpoint"))
            planner.saved.min_bytes = 0                 # every saved activation offloaded, the shards excluded
        loss = model(**inputs).loss
        loss.backward()
        got = _grads(model)
        model.zero_grad(set_to_none=True)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        assert set(got) == set(ref_grads)
        for name, g in ref_grads.items():
            torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=lambda m, n=name: f"step {step}, {n}: {m}")
        if step == 1:
            assert planner.plan is not None and not planner.plan.by_hand and planner.ranks is None   # one rank
    assert fastsft_lab.state(model).checkpointing == "plan"
    # the plan's stand-in for the model on a CPU: this rank's shards, and two layers' gathered weights
    layer_bytes = max(R.full_bytes(layer.parameters()) for layer in decoder_layers(model))
    assert planner.fixed_cpu == R.held_bytes(model.parameters()) + R.held_bytes(model.buffers()) + 2 * layer_bytes
    fastsft_lab.revert(model)
    assert fastsft_lab.state(model).memory_plan is None


def test_fsdp2_inside_a_decoder_layer_is_refused_in_one_line_before_anything_changes(monkeypatch):
    """fully_shard per decoder layer (and the root) is what the plan takes; a module inside a layer sharded on its
    own is refused (fully_shard needs a process group; its detection is tested in test_compat)."""
    model = _tiny(True)
    inner = decoder_layers(model)[1].mlp
    monkeypatch.setattr(R, "is_fsdp2", lambda m: m is inner)
    with pytest.raises(NotImplementedError, match="decoder layer 1's .*mlp is sharded on its own") as err:
        fastsft_lab.apply(model, packed_attention="sdpa", memory_budget=16)
    assert "\n" not in str(err.value)
    assert fastsft_lab.state(model) == fastsft_lab.ModelState()       # not half switched: packed attention not on
