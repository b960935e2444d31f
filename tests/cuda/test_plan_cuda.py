"""The memory plan on a GPU: it holds its budget where memory is measured, and trains as plain training."""

from __future__ import annotations

import pytest
import torch

import fastsft_lab
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.offload import plan as P

from _plan_helpers import GiB, _batch, _step

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


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
