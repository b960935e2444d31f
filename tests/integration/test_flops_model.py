"""The frontier's MFU counts the model FLOPs of the step as the model trains it (fastsft_lab.lab.flops): a frozen
base's forward and input gradients, LoRA's forward and gradients, attention over the real segments, the LM head --
checked against a hand count on a tiny config; the budget scenario records it and the frontier's table and chart
show it, for runs recorded before too (worked out from what they recorded)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastsft_lab.lab import flops as F

# hidden 64, MLP 128, 4 heads of 16 (2 KV), vocab 256, 2 layers  (Qwen3-14B: 5120, 17408, 40 x 128 (8), 151936, 40)
TINY = SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, vocab_size=256)
SEGMENTS = [[3, 5]]                  # one packed row: two sequences, 8 real tokens


def test_the_step_flops_of_a_tiny_lora_step_equal_a_hand_count():
    # per layer: q 64x64 + k 64x32 + v 64x32 + o 64x64 = 12288; gate, up, down 3 x 64x128 = 24576; LM head 256x64
    n = 2 * (12288 + 24576) + 256 * 64                                  # 90112 matmul parameters a token passes
    # LoRA r4 on the seven projections, r (in + out) each: q 512, k 384, v 384, o 512, gate 768, up 768, down 768
    lora = 2 * (512 + 384 + 384 + 512 + 768 + 768 + 768)                # 8192
    pairs = 2 * (3 * 4 // 2 + 5 * 6 // 2)                               # causal pairs, both layers: 42
    attention = 2 * 2 * 4 * 16 * pairs * 3                              # QK^T and PV, 2 FLOPs a term; x3 with backward
    assert F.lora_params(TINY, 4, F._PROJECTIONS) == lora
    got = F.step_flops(TINY, SEGMENTS, frozen_base=True, adapter_params=lora)
    assert got["matmul_params"] == n and got["tokens"] == 8 and got["attention_flops"] == attention == 32256
    assert got["flops"] == 4 * n * 8 + 6 * lora * 8 + attention == 3_309_056       # frozen: no weight gradients
    assert got["lm_head_flops"] == 4 * 256 * 64 * 8
    full = F.step_flops(TINY, SEGMENTS)                                  # every weight trains: 6 N T
    assert full["flops"] == 6 * n * 8 + attention == 4_357_632
    assert F.batch_flops(TINY, SEGMENTS, "forward", frozen_base=True, adapter_params=lora) == \
        2 * n * 8 + 2 * lora * 8 + attention / 3
    # a step recorded in the PaLM convention converts to the same count
    assert F.model_flops_from_palm(full["flops"], TINY, 8, frozen_base=True, adapter_params=lora) == got["flops"]


def test_what_trains_is_read_off_the_model():
    from fastsft_lab.models import LoraSettings, build_model, get_preset

    lora = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4), seed=1)
    terms = F.trained_terms(lora)
    assert terms["frozen_base"] is True
    assert terms["adapter_params"] == F.lora_params(lora.config, 4, get_preset("tiny-qwen3").lora_targets) == \
        sum(p.numel() for n, p in lora.named_parameters() if p.requires_grad)
    full = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=None, seed=1)
    assert F.trained_terms(full) == {"frozen_base": False, "adapter_params": 0}
    # an MoE's expert adapters: a token passes through top_k of num_experts experts' adapters
    moe = build_model("tiny-gpt-oss", device="cpu", dtype=torch.float32,
                      lora=LoraSettings(rank=4, lora_experts=True), seed=1)
    share = moe.config.num_experts_per_tok / moe.config.num_local_experts
    experts = sum(p.numel() for n, p in moe.named_parameters() if p.requires_grad and ".experts." in n)
    rest = sum(p.numel() for n, p in moe.named_parameters() if p.requires_grad and ".experts." not in n)
    assert F.trained_terms(moe)["adapter_params"] == round(rest + share * experts)
    assert F.lora_params(moe.config, 4, ("q_proj", "gate_proj")) is None     # its MLP is experts: not from sizes


def test_the_harness_counts_model_flops_over_what_the_rows_had():
    from fastsft_lab.data import benchmark_batches
    from fastsft_lab.lab.harness import add_throughput
    from fastsft_lab.models import LoraSettings, build_model

    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4), seed=1)
    batches = benchmark_batches(tokens_per_step=256, row_tokens=128, steps=2, vocab_size=256, mix="short")
    rows = [{"name": "a", "step_ms": {"median": 10.0}}]
    palm = add_throughput(rows, model, batches)
    assert rows[0]["flops_per_step"] == palm
    got = add_throughput(rows, model, batches, model_flops=True)
    real = [[list(r[:-1]) if pad else list(r) for r, pad in zip(b.seq_lengths, b.pad_lengths)] for b in batches]
    terms = F.trained_terms(model)
    assert got == rows[0]["flops_per_step"] == sum(F.step_flops(model.config, sl, **terms)["flops"]
                                                    for sl in real) / 2 < palm
    assert rows[0]["mfu"] is None                                     # a CPU has no bf16 peak in the table


def _doc(config_flops: float | None):
    gib = 2**30
    config = {"model": "qwen3-14b", "num_layers": 8, "tokens_per_step": 8192, "quant": "nf4", "lora_rank": 16}
    if config_flops:
        config["model_flops_per_step"] = config_flops
    return {"scenario": "budget", "_path": "h100-2099-01-01/bench-budget/q.json",
            "env": {"device": "cuda", "gpu_name": "NVIDIA H100 80GB HBM3", "date": "2026"},
            "config": config,
            "variants": [{"name": "7 GiB: 8 offload", "step_ms": {"median": 300.0}, "peak_mem_bytes": 6.9 * gib,
                          "toggles": {"memory_budget_bytes": 7 * gib, "predicted_peak_bytes": 7 * gib},
                          "tokens_per_s": 8000 / 0.3, "flops_per_step": 2.0e14},
                         {"name": "offload x2 + prefetch everywhere (README recipe)", "step_ms": {"median": 320.0},
                          "peak_mem_bytes": 6.8 * gib, "tokens_per_s": 8000 / 0.32, "flops_per_step": 2.0e14}]}


def test_the_frontier_shows_mfu_recorded_or_worked_out_from_an_older_run():
    import matplotlib
    matplotlib.use("Agg")
    from fastsft_lab.lab import plots, report, results
    from fastsft_lab.models import PRESETS

    peak = F.peak_flops("NVIDIA H100 80GB HBM3")
    rows = results.frontier_rows(_doc(1.2e14))
    assert [r["mfu"] for r in rows] == pytest.approx([1.2e14 / 0.300 / peak, 1.2e14 / 0.320 / peak])
    # recorded before the count: the PaLM convention's 6 N T less the frozen base's 2 N T, plus LoRA's 6 A T
    old = _doc(None)
    config = SimpleNamespace(**{**PRESETS["qwen3-14b"].config, "num_hidden_layers": 8})
    n = F.step_flops(config, [[1]])["matmul_params"]
    adapters = F.lora_params(config, 16, PRESETS["qwen3-14b"].lora_targets)
    assert results.frontier_flops(old) == pytest.approx(2.0e14 - 2 * n * 8000 + 6 * adapters * 8000)
    text = report.frontier_text(_doc(1.2e14))
    assert f"{1.2e14 / 0.300 / peak:.1%}" in text and "MFU: model FLOPs" in text
    fig = plots.plot_frontier([_doc(1.2e14)])
    (right,) = fig.axes[0].child_axes
    assert right.get_ylabel().startswith("MFU")
    assert plots.plot_frontier([{**_doc(1.2e14), "env": {"device": "cuda", "gpu_name": "GPU"}}]).axes[0].child_axes \
        == []                                                          # a card without a known peak: no MFU axis
