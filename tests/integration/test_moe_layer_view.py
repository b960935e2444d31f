"""One MoE layer seen per implementation: kernel launches counted beside host syncs (fastsft_lab.lab.launches), the
per-layer chain from transformers' default (report.experts_layer_text), the published figures in one place."""

from __future__ import annotations

import pytest
import torch

from fastsft_lab.lab import report
from fastsft_lab.lab.launches import count_launches
from fastsft_lab.lab.scenarios.moe import experts_microbenchmark
from fastsft_lab.models import build_model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_launches_count_the_ops_that_launch_a_kernel_and_not_views_or_allocations():
    x = torch.randn(8, 8)

    def fn():
        y = x.view(64)             # a view: no kernel
        z = torch.empty(64)        # an allocation: no kernel
        z.copy_(y)                 # one
        return (z + 1).sum()       # two

    assert count_launches(fn, "cpu") == 3


def test_grouped_once_keeps_the_loop_of_launches_and_sync_free_removes_it():
    """With GPT-OSS-20B's 32 experts and top-4 at tiny width (launches do not depend on the width): the loop pays a
    sync per hit expert, grouped once one per layer but still launches kernels per expert, sync-free neither."""
    model = build_model("tiny-gpt-oss", device="cpu", dtype=torch.float32, num_layers=1, seed=0,
                        config_overrides={"num_local_experts": 32, "num_experts_per_tok": 4})
    rows = {r["name"]: r for r in experts_microbenchmark(model, tokens=512, warmup=0, reps=1)}
    naive, grouped, free, default = rows["naive"], rows["grouped"], rows["sync_free"], rows["transformers grouped_mm"]
    assert naive["host_syncs_per_step"] > 32 and grouped["host_syncs_per_step"] == 1 == 1 + free["host_syncs_per_step"]
    assert grouped["launches_forward"] > 32 > free["launches_forward"]          # a loop over the experts, or none
    assert naive["launches_per_step"] > grouped["launches_per_step"] > 5 * free["launches_per_step"]
    assert default["host_syncs_per_step"] == 0 and default["launches_forward"] < 32
    assert list(rows)[0] == "transformers grouped_mm"                           # the 1.00x of tables and charts


def _layer_doc(rows, device="cuda"):
    return {"scenario": "moe-experts-layer", "_path": "h200-2099-01-01/moe/x.json",
            "env": {"gpu_name": "GPU", "date": "2099-01-01", "device": device},
            "config": {"model": "qwen3-30b-a3b", "tokens_per_step": 8192, "num_experts": 128, "top_k": 8},
            "variants": [{"name": n, "step_ms": {"median": ms}, "host_syncs_per_step": s,
                          **({"launches_forward": lf, "launches_per_step": lt} if lf else {})}
                         for n, ms, s, lf, lt in rows]}


def test_the_layer_view_is_a_chain_from_the_default_with_the_loop_and_grouped_once_beside_it():
    doc = _layer_doc([("transformers grouped_mm", 10.0, 0, 30, 60), ("sync_free, eager glue", 8.0, 0, 20, 40),
                      ("sync_free", 5.0, 0, 10, 20), ("grouped", 200.0, 1, 900, 2000), ("naive", 220.0, 641, 1800, 3800),
                      ("expert matmuls alone", 2.0, 0, None, None)])
    text = report.experts_layer_text(doc)
    rows = {line[2:42].strip(): line[42:].split() for line in text.splitlines()[2:]}
    assert rows["+ sync-free routing, eager glue"][:3] == ["8.00", "1.25x", "1.25x"]
    assert rows["+ fused gate/combine kernels"][:3] == ["5.00", "1.60x", "2.00x"]
    assert rows["grouped once (one sync per layer)"][:4] == ["200.00", "–", "0.05x", "1"]
    assert rows["grouped once (one sync per layer)"][4:] == ["900", "/", "2000"]
    assert "transformers eager (the same loop)" in text and "not measured in this run" in text
    assert "naive -> grouped: syncs 641 -> 1, launches 3800 -> 2000, step 220.00 -> 200.00 ms (1.10x)" in text
    assert "grouped -> sync_free: syncs 1 -> 0, launches 2000 -> 20, step 200.00 -> 5.00 ms (40.00x)" in text


def test_a_run_without_the_eager_glue_row_shows_the_two_moe_steps_as_one_and_says_why():
    rows = [("transformers grouped_mm", 10.0, 0, None, None), ("sync_free", 5.0, 0, None, None)]
    assert "+ sync-free routing and fused glue" in report.experts_layer_text(_layer_doc(rows))
    assert "(eager glue: no CUDA)" in report.experts_layer_text(_layer_doc(rows, device="cpu"))
    assert "launches not counted" not in report.experts_layer_text(_layer_doc(rows))   # no naive/grouped: no lesson


def test_the_published_double_buffer_figure_is_the_one_the_link_scenario_uses():
    from fastsft_lab.lab.scenarios.offload_link import PUBLISHED_GAIN

    assert report.PUBLISHED_STEP["+ double buffer"].startswith(f"+{PUBLISHED_GAIN:.1%}")


@pytest.mark.cuda
def test_cuda_launches_are_the_profilers_kernels_and_the_fused_glue_launches_fewer():
    model = build_model("tiny-gpt-oss", device="cuda", dtype=torch.bfloat16, num_layers=1, seed=0,
                        config_overrides={"num_local_experts": 32, "num_experts_per_tok": 4})
    rows = {r["name"]: r for r in experts_microbenchmark(model, tokens=512, warmup=1, reps=2)}
    assert rows["sync_free"]["launches_counted"].startswith("CUDA kernels")
    assert rows["grouped"]["launches_forward"] > 32 > rows["sync_free"]["launches_forward"]
    assert rows["sync_free"]["launches_per_step"] < rows["sync_free, eager glue"]["launches_per_step"]
    assert rows["transformers grouped_mm"]["host_syncs_per_step"] == 0


@pytest.mark.cuda
def test_cuda_bf16_routing_check_runs_with_the_fused_kernels_and_forcing_routes_as_the_reference():
    from fastsft_lab import moe
    from fastsft_lab.data import benchmark_batches
    from fastsft_lab.lab import routing
    from fastsft_lab.lab.harness import Variant

    def mode(name):
        return Variant(name, enable=lambda m: moe.set_moe_routing(m, name),
                       disable=lambda m: moe.set_moe_routing(m, None))

    model = build_model("tiny-gpt-oss", device="cuda", dtype=torch.bfloat16, seed=0).train()
    batch = benchmark_batches(tokens_per_step=512, row_tokens=256, steps=1, vocab_size=256, mix="short")[0].to("cuda")
    a = routing.routing_agreement(model, batch, mode("off"), mode("sync_free"))
    assert a["logits_dtype"] == "bfloat16" and len(a["flipped_tokens"]) == model.config.num_hidden_layers
    with routing.record_routing(model) as ref:
        model(**batch.model_inputs())
    moe.set_moe_routing(model, "sync_free")
    forced = {i: r["index"] for i, r in dict(ref).items()}
    with torch.no_grad(), routing.force_routing(model, forced), routing.record_routing(model) as seen:
        model(**batch.model_inputs())
    moe.set_moe_routing(model, None)
    assert all(routing.flipped_tokens(seen[i]["index"], forced[i]) == 0 for i in forced)
