"""The memory plan reaches its budget whatever ran before in the process: step 1 releases the caching allocator's
unused blocks and resets its peaks (fastsft_lab.offload.plan.release_cached_blocks), so the slack it reads at step 2
is the step's own -- not the blocks cached while the model was built, or by an earlier run. On the CPU through a
caching allocator in miniature (its counters as torch.cuda gives them); on CUDA with a real model."""

from __future__ import annotations

import pytest
import torch

from fastsft_lab.offload import plan as P

GiB, MiB = P.GiB, 1 << 20
ROUND = 2 * MiB              # the allocator's block granularity for large tensors


class SimAllocator:
    """A CUDA caching allocator in miniature, with ``torch.cuda``'s counter functions (device argument ignored).

    A request is rounded up to 2 MiB and served from the best-fitting cached block (the rest split off, still
    cached); when none fits, a segment of its size is reserved from the device. A freed block stays cached (merged
    with free neighbours of its segment); ``empty_cache`` gives back the segments no tensor uses."""

    def __init__(self, total: int):
        self.total = total
        self.segments: list[list[list]] = []      # each: blocks [size, used], in address order
        self.peak_allocated = self.peak_reserved = 0

    # what a program does
    def malloc(self, n: int) -> tuple:
        n = -(-n // ROUND) * ROUND
        fits = [(b[0], s, i) for s, seg in enumerate(self.segments) for i, b in enumerate(seg)
                if not b[1] and b[0] >= n]
        if fits:
            size, s, i = min(fits)
            seg = self.segments[s]
            if size > n:
                seg.insert(i + 1, [size - n, False])
            seg[i][:] = [n, True]
        else:
            if self.memory_reserved() + n > self.total:
                raise MemoryError("out of memory")
            self.segments.append([[n, True]])
            s, i = len(self.segments) - 1, 0
        block = self.segments[s][i]
        self._peaks()
        return block

    def free(self, block: list) -> None:
        block[1] = False
        for seg in self.segments:
            merged: list[list] = []
            for b in seg:
                if merged and not merged[-1][1] and not b[1]:
                    merged[-1][0] += b[0]
                else:
                    merged.append(b)
            seg[:] = merged

    def _peaks(self) -> None:
        self.peak_allocated = max(self.peak_allocated, self.memory_allocated())
        self.peak_reserved = max(self.peak_reserved, self.memory_reserved())

    # torch.cuda's counters
    def memory_allocated(self, device=None) -> int:
        return sum(b[0] for seg in self.segments for b in seg if b[1])

    def memory_reserved(self, device=None) -> int:
        return sum(b[0] for seg in self.segments for b in seg)

    def max_memory_allocated(self, device=None) -> int:
        return self.peak_allocated

    def max_memory_reserved(self, device=None) -> int:
        return self.peak_reserved

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak_allocated, self.peak_reserved = self.memory_allocated(), self.memory_reserved()

    def empty_cache(self) -> None:
        self.segments = [seg for seg in self.segments if any(b[1] for b in seg)]

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self.total - self.memory_reserved(), self.total


DEVICE = torch.device("cuda", 0)
TOTAL = 80 * GiB
WEIGHTS = 30 * GiB


def _build(sim: SimAllocator) -> None:
    """The model's weights, kept, and the transients of building it (quantising layer by layer: 20 GiB of 1 GiB
    buffers), freed -- cached."""
    sim.malloc(WEIGHTS)
    for b in [sim.malloc(GiB) for _ in range(20)]:
        sim.free(b)


def _recipe_step(sim: SimAllocator) -> None:
    """An earlier configuration's training step in the process: 24 GiB of activations, freed."""
    for b in [sim.malloc(3 * GiB) for _ in range(8)]:
        sim.free(b)


FRAGMENT = 1 * GiB


def _plan_step_one(sim: SimAllocator) -> None:
    """The plan's step 1, which fragments the cache itself: a 1 GiB activation freed while a 3 GiB one lives leaves
    a 1 GiB hole that the next 1.5 GiB request cannot use (its slack: 1 GiB at the peak); the planner resets the
    peaks at the end of the forward, as step 1 does."""
    a, b = sim.malloc(FRAGMENT), sim.malloc(3 * GiB)
    sim.free(a)
    sim.reset_peak_memory_stats()                      # the end of step 1's forward
    c = sim.malloc(FRAGMENT + FRAGMENT // 2)
    for x in (b, c):
        sim.free(x)


@pytest.mark.parametrize("before", ["fresh process", "model built", "model built, a recipe run"])
def test_the_ceiling_is_the_step_own_slack_whatever_ran_before(before):
    """Released at step 1's start, the ceiling at step 2 is the device less the step's own fragmentation, the same
    after building the model (its 20 GiB of cached transients) or an earlier run as in a fresh process."""
    sim = SimAllocator(TOTAL)
    if before == "fresh process":
        sim.malloc(WEIGHTS)
    else:
        _build(sim)
    if before.endswith("recipe run"):
        _recipe_step(sim)
    assert sim.memory_reserved() - sim.memory_allocated() >= (0 if before == "fresh process" else 20 * GiB)
    start = P.release_cached_blocks(DEVICE, sim)
    assert start.reserved == start.allocated == WEIGHTS and start.peak_reserved == WEIGHTS
    _plan_step_one(sim)
    assert P.step_ceiling(DEVICE, sim) == TOTAL - FRAGMENT


def test_without_the_release_the_cached_blocks_read_as_slack():
    """What the ceiling read before the release (the counters since the process started): the blocks cached while
    the model was built count as slack, 20 GiB under the reachable memory -- the H100's x40 plan solved under 54.55
    GiB for a budget of 74."""
    sim = SimAllocator(TOTAL)
    _build(sim)
    _plan_step_one(sim)
    assert P.step_ceiling(DEVICE, sim) <= TOTAL - 19 * GiB


def _cost() -> P.LayerCost:
    return P.LayerCost("k", 1024, dict(zip(P.CHOICES, (1.0, 1.2, 1.5, 1.6, 10.0))),
                       {"keep": GiB, "selective": GiB // 2, "checkpoint": GiB // 8, "offload": 0,
                        "offload_saved": 0})


def test_the_planner_releases_at_step_one_and_solves_under_its_budget_not_a_lower_ceiling(monkeypatch):
    """The planner's own steps on a (simulated) GPU after the model was built: step 1 releases the cache, step 2
    reads the ceiling from the step's own slack, and a 74 GiB budget is solved under 74 GiB, keeping every layer."""
    sim = SimAllocator(TOTAL)
    _build(sim)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
                 "reset_peak_memory_stats", "empty_cache", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, getattr(sim, name))
    planner = P.MemoryPlanner(74 * GiB, DEVICE, ["k"] * 8, [None] * 8, costs={"k": _cost()})
    x = torch.zeros(1, 1024, 8)
    planner._step_start(x)                                   # step 1
    assert sim.memory_reserved() == WEIGHTS                   # the build's cached transients given back
    _plan_step_one(sim)
    planner.peak = planner.loss_peak = sim.max_memory_allocated()
    planner._step_start(x)                                   # step 2: the plan
    assert planner.ceiling == TOTAL - FRAGMENT
    assert planner.plan.budget == 74 * GiB and set(planner.plan.choices) == {"keep"}
    assert "solved under" not in planner.describe()


# -- CUDA: a real model, built and planned in one process ------------------------------------------------------------
def _cuda_model():
    from fastsft_lab.models import LoraSettings, build_model

    model = build_model("qwen3-0.6b", device="cuda", dtype=torch.bfloat16, num_layers=8, lora=LoraSettings(rank=8))
    model.train()
    return model


def _cuda_batch(tokens: int):
    from fastsft_lab.data import benchmark_batches

    batch = benchmark_batches(tokens_per_step=tokens, row_tokens=tokens // 2, steps=1, vocab_size=1000,
                              mix="short")[0].model_inputs()
    return {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch.items()}


def _steps(model, inputs, n: int) -> None:
    for _ in range(n):
        model(**inputs).loss.backward()
        model.zero_grad(set_to_none=True)


@pytest.mark.cuda
@pytest.mark.parametrize("before", ["built, half the card cached", "a recipe ran first"])
def test_cuda_a_plan_after_a_build_or_a_recipe_is_solved_under_its_budget(before):
    """No counters reset by hand: blocks cached before the plan (half the card, freed after building; or a recipe's
    larger batch) neither lower the ceiling below the budget nor push the step's peak above it."""
    import fastsft_lab

    model = _cuda_model()
    total = torch.cuda.get_device_properties(0).total_memory
    if before.startswith("built"):
        del_me = torch.empty(total // 2, dtype=torch.uint8, device="cuda")
        del del_me                                            # cached, as a build's transients are
    else:
        fastsft_lab.apply(model, offload_buffers=2)
        _steps(model, _cuda_batch(16384), 2)
        fastsft_lab.apply(model, offload_buffers="off")
    assert torch.cuda.memory_reserved() - torch.cuda.memory_allocated() > GiB      # something is cached
    budget = 0.8 * torch.cuda.mem_get_info()[1] / GiB
    inputs = _cuda_batch(4096)
    fastsft_lab.apply(model, memory_budget=budget)
    try:
        _steps(model, inputs, 2)
        planner = P.memory_planner(model)
        assert planner.ceiling >= planner.budget, (planner.ceiling / GiB, planner.budget / GiB, planner.describe())
        assert planner.plan.budget == planner.budget and "solved under" not in planner.describe()
        torch.cuda.reset_peak_memory_stats()
        _steps(model, inputs, 1)
        assert torch.cuda.max_memory_allocated() <= planner.budget
    finally:
        fastsft_lab.revert(model)
