"""MoE routing on a GPU: per MoE layer in bf16 against eager within its own error, syncs cross-checked by CUDA, the
fused gates and glue, NF4 training memory."""

from __future__ import annotations

import copy

import pytest
import torch

from fastsft_lab import moe
from fastsft_lab.lab.scenarios.moe import experts_microbenchmark, routing_stats
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.structure import decoder_layers
from fastsft_lab.moe import MODES, experts_modules, moe_routing, quantize_experts_nf4, set_moe_routing
from fastsft_lab.profiling import SyncCounter

from _moe_helpers import ATTN_TARGETS, _real_width_layer

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
@pytest.mark.parametrize("tokens", [4096])
def test_cuda_per_layer_bf16_matches_eager_within_its_own_error(family, tokens):
    block = _real_width_layer(family)
    router = block.router if family == "gpt_oss" else block.gate
    experts = block.experts
    x = torch.randn(tokens, experts.gate_up_proj.shape[1 if family == "gpt_oss" else 2], device="cuda",
                    dtype=torch.bfloat16)
    with torch.no_grad():
        _, w, idx = router(x)
    # float32 reference of the same layer on the same routing
    ref_block = copy.deepcopy(experts).float()
    with moe_routing(ref_block, "eager"), torch.no_grad():
        ref = ref_block(x.float(), idx, w.float())
    errors = {}
    for impl in ("eager", "grouped_mm") + MODES:
        with moe_routing(experts, impl), torch.no_grad():
            out = experts(x, idx, w).float()
        errors[impl] = (out - ref).abs().max().item()
    scale = ref.abs().max().item()
    for mode in MODES:  # bf16 rounding only: no worse than the stock paths' own bf16 error (plus slack)
        assert errors[mode] <= 2.0 * max(errors["eager"], errors["grouped_mm"]) + 1e-3 * scale, errors


@pytest.mark.cuda
def test_cuda_sync_counts_cross_checked():
    block = _real_width_layer("gpt_oss")
    experts = block.experts
    x = torch.randn(2048, 2880, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        _, w, idx = block.router(x)
    hit = int((torch.bincount(idx.flatten(), minlength=experts.num_experts) > 0).sum())
    counts = {}
    for mode in MODES:
        with moe_routing(experts, mode):
            experts(x, idx, w).float().sum().backward()  # warm-up: allocator, cuBLAS handles, backward kernels
            torch.cuda.synchronize()
            with SyncCounter(device="cuda", cross_check=True) as syncs:
                out = experts(x, idx, w)
                out.float().sum().backward()
            torch.cuda.synchronize()
        counts[mode] = (syncs.total, syncs.cuda_reported)
    assert counts["sync_free"] == (0, 0), counts
    assert counts["grouped"][0] == 1, counts
    assert counts["naive"][0] >= hit, counts
    assert moe.grouped_mm_unavailable(x.detach(), experts.down_proj) is None


@pytest.mark.cuda
@pytest.mark.parametrize("quant", [None, "nf4"])
def test_cuda_tiny_model_per_layer_equivalence(quant):
    """Same input to each implementation, layer by layer (captured from the stock run), bf16."""
    model = build_model("tiny-gpt-oss", device="cuda", dtype=torch.bfloat16,
                        lora=LoraSettings(rank=4, target_modules=ATTN_TARGETS))
    if quant:
        quantize_experts_nf4(model)
    captured = []
    hooks = [m.register_forward_pre_hook(lambda mod, args: captured.append((mod, args)))
             for m in experts_modules(model)]
    ids = torch.randint(4, 256, (2, 128), device="cuda")
    with moe_routing(model, "eager"), torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    for module, (h, idx, w) in captured:
        with moe_routing(module, "eager"), torch.no_grad():
            ref = module(h, idx, w).float()
        for mode in MODES:
            with moe_routing(module, mode), torch.no_grad():
                out = module(h, idx, w).float()
            assert (out - ref).abs().max().item() <= 2e-2 * (1 + ref.abs().max().item()), mode


@pytest.mark.cuda
def test_cuda_nf4_sync_free_training_keeps_no_bf16_expert_copy():
    """What autograd holds between forward and backward: NF4 sync_free ~ bf16 sync_free (activations only); stock
    grouped_mm on the NF4 module holds the dequantized layer (its matmul saves the weight) - the contrast."""
    block = _real_width_layer("gpt_oss")
    experts = block.experts.requires_grad_(False)  # frozen base, as under QLoRA
    bf16_bytes = sum(p.numel() * 2 for n, p in experts.named_parameters() if p.dim() == 3)
    x = torch.randn(4096, 2880, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        _, w, idx = block.router(x)

    def held(impl):
        with moe_routing(experts, impl):
            experts(x, idx, w).float().sum().backward()  # warm-up
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            out = experts(x, idx, w)
            kept = torch.cuda.memory_allocated() - before
            out.float().sum().backward()
            return kept

    held_bf16 = held("sync_free")
    quantize_experts_nf4(experts)
    held_nf4 = held("sync_free")
    held_stock = held("grouped_mm")
    assert held_nf4 < held_bf16 + 0.25 * bf16_bytes, (held_nf4, held_bf16, bf16_bytes)
    assert held_stock > held_bf16 + 0.5 * bf16_bytes, (held_stock, held_bf16, bf16_bytes)


@pytest.mark.cuda
def test_cuda_fused_glu_matches_eager_gate():
    assert moe.fused_glu_available(torch.zeros(1, device="cuda")), "triton should ship with CUDA torch"
    gu = (torch.randn(4096, 2 * 2880, device="cuda") * 6).to(torch.bfloat16)
    ref_in = gu.float().requires_grad_(True)
    ref = moe.gate.eager_gpt_oss_glu(ref_in, 1.702, 7.0)  # float32 reference
    x = gu.clone().requires_grad_(True)
    out = moe.gpt_oss_glu(x, 1.702, 7.0)
    go = torch.randn_like(ref)
    ref.backward(go)
    out.backward(go.to(out.dtype))
    eager_in = gu.clone().requires_grad_(True)
    eager = moe.gate.eager_gpt_oss_glu(eager_in, 1.702, 7.0)  # bf16 eager: the error the stock path has
    eager.backward(go.to(eager.dtype))
    err_fused = (out.float() - ref).abs().max().item()
    err_eager = (eager.float() - ref).abs().max().item()
    assert err_fused <= 1.05 * err_eager + 1e-6, (err_fused, err_eager)
    gerr_fused = (x.grad.float() - ref_in.grad).abs().max().item()
    gerr_eager = (eager_in.grad.float() - ref_in.grad).abs().max().item()
    assert gerr_fused <= 1.5 * gerr_eager + 1e-6, (gerr_fused, gerr_eager)


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_cuda_fused_glue_is_as_close_to_fp32_as_the_eager_glue(family):
    # sync_free experts at real width in bf16, fused kernels on and off, against the same experts in float32.
    from fastsft_lab.moe.kernels import set_fused_combine

    preset = "gpt-oss-20b" if family == "gpt_oss" else "qwen3-30b-a3b"
    model = build_model(preset, device="cuda", dtype=torch.bfloat16, num_layers=1)
    from fastsft_lab.lab.scenarios.moe import _router_and_experts
    from fastsft_lab.moe.kernels import fused_combine_available

    router, experts = _router_and_experts(decoder_layers(model)[0].mlp)
    hidden = torch.randn(2048, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    assert moe.fused_glu_available(hidden) and fused_combine_available(hidden), "triton ships with CUDA torch"
    with torch.no_grad():
        _, weights, index = router(hidden)
    go = torch.randn_like(hidden)

    def run(module, dtype):
        h = hidden.detach().to(dtype).requires_grad_(True)   # fresh leaves each run
        w = weights.detach().to(dtype).requires_grad_(True)
        module.zero_grad(set_to_none=True)
        out = module(h, index, w)
        out.backward(go.to(dtype))
        return out.float(), h.grad.float(), w.grad.float()

    set_moe_routing(model, "sync_free")
    fused = run(experts, torch.bfloat16)
    glu_before, combine_before = moe.set_fused_glu(False), set_fused_combine(False)
    try:
        eager = run(experts, torch.bfloat16)
    finally:
        moe.set_fused_glu(glu_before)
        set_fused_combine(combine_before)
    ref = run(copy.deepcopy(experts).float(), torch.float32)
    for name, f, e, r in zip(("output", "input grad", "routing-weight grad"), fused, eager, ref):
        err_f = ((f - r).abs().max() / r.abs().max()).item()
        err_e = ((e - r).abs().max() / r.abs().max()).item()
        assert err_f <= 1.5 * err_e + 1e-3, (name, err_f, err_e)


@pytest.mark.cuda
def test_cuda_microbenchmark_and_stats_run():
    model = build_model("tiny-gpt-oss", device="cuda", dtype=torch.bfloat16)
    rows = {r["name"]: r for r in experts_microbenchmark(model, tokens=512, warmup=1, reps=2)}
    assert rows["sync_free"]["host_syncs_per_step"] == 0 and rows["sync_free"].get("cuda_reported_syncs") == 0
    assert rows["grouped"]["host_syncs_per_step"] == 1
    assert "forward_ms" in rows["expert matmuls alone"]
    ids = torch.randint(4, 256, (2, 64), device="cuda")
    stats = routing_stats(model, {"input_ids": ids})
    assert len(stats["tokens_per_expert"]) == model.config.num_hidden_layers
    assert all(sum(row) == 2 * 64 * model.config.num_experts_per_tok for row in stats["tokens_per_expert"])
