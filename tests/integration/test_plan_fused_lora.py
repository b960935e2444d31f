"""The memory plan with the fused LoRA on (``fused_lora=True``, the README recipe's floor): every choice computes what
plain training with it computes. The fused LoRA adds each adapter into its projection's matmul output in place,
through an ``_unsafe_view`` alias that does not share the output's version counter; a selective checkpoint that
saved that matmul output would get it back already added into, and its recompute would add the adapter a second
time (a silent wrong gradient: 0.55 off on tiny-qwen3 before the measurement saw the write)."""

from __future__ import annotations

import pytest
import torch

import fastsft_lab
from fastsft_lab.data import benchmark_batches
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.offload import plan as P

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
PLANS = {"selective": ("selective",) * 3, "mixed": ("selective", "keep", "offload"),
         "others": ("checkpoint", "offload_saved", "keep")}


def _step(preset: str, plan) -> tuple[torch.Tensor, dict]:
    model = build_model(preset, device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4), seed=1, num_layers=3)
    torch.manual_seed(7)
    for name, p in model.named_parameters():      # PEFT starts lora_B at zero: give every adapter a gradient path
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    fastsft_lab.apply(model, packed_attention="sdpa", fused_lora=True, **({"memory_budget": 16} if plan else {}))
    if plan:
        P.set_plan(model, plan)
        P.memory_planner(model).saved.min_bytes = 0
    batch = benchmark_batches(tokens_per_step=256, row_tokens=128, steps=1, vocab_size=model.config.vocab_size,
                              mix="short")[0]
    from fastsft_lab.packing import packed_inputs

    loss = model(**packed_inputs(batch)).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    if plan:
        assert all(c.unsaved for c in P.memory_planner(model).costs.values())   # the written matmul: recomputed
    fastsft_lab.revert(model)
    return loss.detach(), grads


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gpt-oss"])
@pytest.mark.parametrize("plan", list(PLANS))
def test_every_choice_with_the_fused_lora_equals_plain_training_with_it(preset, plan):
    ref_loss, ref = _step(preset, None)
    loss, got = _step(preset, PLANS[plan])
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert set(got) == set(ref) and ref
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
