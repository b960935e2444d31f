"""The ``moe_routing`` switch on live MoE models: through transformers' experts registry and back exactly, whole-model
logits and gradients, NF4 experts, the benchmark's plumbing."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from fastsft_lab import moe
from fastsft_lab.lab.scenarios import run_scenario
from fastsft_lab.lab.scenarios.moe import routing_stats
from fastsft_lab.models import LoraSettings, build_model, get_preset
from fastsft_lab.moe import (MODES, experts_implementation, experts_modules, get_moe_routing, moe_routing,
                             quantize_experts_nf4, set_moe_routing)
from fastsft_lab.profiling import SyncCounter

from _moe_helpers import ATTN_TARGETS, TINY_MOE_PRESETS, make_experts, random_routing, assert_close

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# --- the switch ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_gpt_oss():
    return build_model("tiny-gpt-oss", device="cpu", dtype=torch.float32)


def test_switch_uses_registry_and_off_restores_exactly(tiny_gpt_oss):
    model = tiny_gpt_oss
    original = experts_implementation(model)
    assert original == "grouped_mm"  # transformers 5.x default for from_config models
    mods = experts_modules(model)
    assert len(mods) == model.config.num_hidden_layers
    assert all(m.config is model.config for m in mods)  # one shared config object
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    for mode in MODES:
        assert moe.IMPLEMENTATIONS[mode] in ALL_EXPERTS_FUNCTIONS
        set_moe_routing(model, mode)
        assert get_moe_routing(model) == mode
        assert model.config._experts_implementation == moe.IMPLEMENTATIONS[mode]
    assert set_moe_routing(model, "off").moe_routing is None
    assert experts_implementation(model) == original and get_moe_routing(model) is None
    assert not moe.moe_routing_switched(model)
    # a model that ran stock eager goes back to eager
    model.config._experts_implementation_internal = "eager"
    set_moe_routing(model, "grouped")
    set_moe_routing(model, None)
    assert experts_implementation(model) == "eager"
    model.config._experts_implementation_internal = original
    with moe_routing(model, "sync_free"):
        assert get_moe_routing(model) == "sync_free"
    assert experts_implementation(model) == original


def test_switch_with_per_module_configs():
    model = build_model("tiny-gpt-oss", device="cpu", dtype=torch.float32)
    mods = experts_modules(model)
    for i, m in enumerate(mods):  # give each module its own config, with different originals
        m.config = copy.copy(m.config)
        m.config._experts_implementation_internal = "eager" if i % 2 else "grouped_mm"
    set_moe_routing(model, "naive")
    assert all(m.config._experts_implementation == "fastsft_naive" for m in mods)
    set_moe_routing(model, None)
    assert [m.config._experts_implementation for m in mods] == ["grouped_mm", "eager"] * (len(mods) // 2)


def test_bad_input_raises_clearly(tiny_gpt_oss):
    with pytest.raises(ValueError, match="moe_routing must be one of"):
        set_moe_routing(tiny_gpt_oss, "fast")
    dense = build_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="no transformers experts module"):
        set_moe_routing(dense, "grouped")


# --- whole models: logits and gradients ------------------------------------------------------------------------------
def _model_outputs(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), grads


@pytest.mark.parametrize("preset,lora", [
    ("tiny-gpt-oss", None),                                                       # full fine-tune: router grads too
    ("tiny-gpt-oss", LoraSettings(rank=4, target_modules=ATTN_TARGETS)),
    ("tiny-gpt-oss", LoraSettings(rank=4, target_modules=ATTN_TARGETS, lora_experts=True)),  # PEFT on 3-D params
    ("tiny-qwen3-moe", None),
    ("tiny-qwen3-moe", LoraSettings(rank=4)),  # PEFT maps down_proj/... targets onto the experts' parameters
    ("tiny-mixtral", None),
    ("tiny-mixtral", LoraSettings(rank=4)),    # PEFT maps Mixtral's w1/w2/w3 targets onto the experts' parameters
])
def test_whole_model_logits_and_grads(preset, lora):
    model = build_model(preset, device="cpu", dtype=torch.float32, lora=lora, seed=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "bias" in name:  # non-zero adapters and biases, so their paths are exercised
                p.normal_(0.0, 0.05)
    ids = torch.randint(4, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with moe_routing(model, "eager"):
        ref_logits, ref_grads = _model_outputs(model, ids)
    router = f"mlp.{get_preset(preset).family_record.experts.router}."   # GPT-OSS: mlp.router, others: mlp.gate
    assert ref_grads and (lora is not None or any(router in n for n in ref_grads))
    for mode in MODES:
        with moe_routing(model, mode):
            logits, grads = _model_outputs(model, ids)
        assert_close(logits, ref_logits, f"{preset} {mode} logits")
        assert grads.keys() == ref_grads.keys()
        for name in ref_grads:
            assert_close(grads[name], ref_grads[name], f"{preset} {mode} grad {name}", tol=5e-5)


# --- NF4 experts -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", TINY_MOE_PRESETS)
def test_nf4_experts_equal_stock_on_dequantized_weights(preset):
    model = build_model(preset, device="cpu", dtype=torch.float32,
                        lora=LoraSettings(rank=4, target_modules=ATTN_TARGETS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    reference = copy.deepcopy(model)
    assert quantize_experts_nf4(model) == len(experts_modules(model))
    sizes = moe.nf4_expert_bytes(model)
    assert sizes["nf4_bytes"] < 0.3 * sizes["bf16_bytes"]  # 4 bits + one fp32 absmax per 64 vs 16 bits
    for q, r in zip(experts_modules(model), experts_modules(reference)):
        assert "gate_up_proj" not in dict(q.named_parameters())  # no bf16 copy kept
        with torch.no_grad():
            r.gate_up_proj.copy_(q.gate_up_proj)  # the stock-access property dequantizes
            r.down_proj.copy_(q.down_proj)
    ids = torch.randint(4, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    with moe_routing(reference, "eager"):
        ref_logits, ref_grads = _model_outputs(reference, ids)
    for impl in MODES + ("eager",):
        with moe_routing(model, impl):
            logits, grads = _model_outputs(model, ids)
        assert_close(logits, ref_logits, f"nf4 {impl} logits")
        for name in ref_grads:
            assert_close(grads[name], ref_grads[name], f"nf4 {impl} grad {name}", tol=5e-5)


def test_nf4_dequantizes_only_hit_experts_except_sync_free(monkeypatch):
    module = make_experts("gpt_oss", experts=6)
    quantize_experts_nf4(module)
    calls = []
    original = moe.nf4.NF4Weight.dequantize

    def spy(self, expert=None):
        calls.append((self.name, expert))
        return original(self, expert)

    monkeypatch.setattr(moe.nf4.NF4Weight, "dequantize", spy)
    x = torch.randn(10, 16, requires_grad=True)
    idx, w = random_routing(10, 6, 2, used=[1, 3, 4])
    for mode in ("naive", "grouped"):
        calls.clear()
        with moe_routing(module, mode):
            module(x, idx, w).sum().backward()
        assert {e for _, e in calls} == {1, 3, 4}, (mode, calls)  # forward and backward, hit experts only
    calls.clear()
    with moe_routing(module, "sync_free"):
        module(x, idx, w).sum().backward()
    assert sorted(calls, key=str) == sorted([("gate_up_proj", None), ("down_proj", None)] * 2, key=str)


def test_nf4_refuses_expert_lora_and_bad_blocksize():
    model = build_model("tiny-gpt-oss", device="cpu", dtype=torch.float32,
                        lora=LoraSettings(rank=4, target_modules=ATTN_TARGETS, lora_experts=True))
    with pytest.raises(NotImplementedError, match="NF4 experts support LoRA on the attention"):
        quantize_experts_nf4(model)
    module = make_experts("gpt_oss", hidden=16, inter=6)  # 16 x 12 = 192 elements per expert: not a multiple of 128
    with pytest.raises(ValueError, match="not a multiple of the NF4 blocksize"):
        quantize_experts_nf4(module, blocksize=128)


# --- benchmark plumbing (tiny) ---------------------------------------------------------------------------------------
def test_bench_scenario_smoke(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_scenario("moe", device="cpu", smoke=True, out_dir=str(tmp_path), steps=1, warmup=0,
                               progress=False, tokens=64, row_tokens=32, modes=["forward"], micro_reps=1,
                               micro_presets=[])
    assert [r["scenario"] for r in results] == ["moe-routing", "moe-experts-layer"]
    rows = {v["name"]: v for v in results[0]["variants"]}
    assert rows["grouped"]["host_syncs_in_layers"] == results[0]["config"]["num_layers"]
    assert rows["sync_free"]["host_syncs_in_layers"] == 0
    assert results[0]["config"]["routing"]["experts_hit"]
    micro = {v["name"]: v for v in results[1]["variants"]}
    assert micro["sync_free"]["host_syncs_per_step"] == 0 and "expert matmuls alone" in micro
    assert len(list(tmp_path.glob("*.json"))) == 2 and len(list(tmp_path.glob("*.png"))) == 2
    with pytest.raises(ValueError, match="unknown option.*bogus"):
        run_scenario("moe", device="cpu", smoke=True, out_dir=str(tmp_path), bogus=1)


# --- host syncs per layer, whole model ------------------------------------------------------------------------------
@pytest.mark.parametrize("train", [False, True])
def test_host_syncs_per_layer(tiny_gpt_oss, train):
    model = tiny_gpt_oss
    ids = torch.randint(4, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    hits = routing_stats(model, {"input_ids": ids})["experts_hit"]
    for mode in MODES:
        with moe_routing(model, mode), SyncCounter.for_decoder_layers(model, device="cpu") as syncs:
            with torch.set_grad_enabled(train):
                out = model(input_ids=ids, labels=ids)
                if train:
                    out.loss.backward()
        per_layer = list(syncs.per_module().values())
        if mode == "naive":
            assert all(n >= h for n, h in zip(per_layer, hits)), (per_layer, hits)
        elif mode == "grouped":
            assert per_layer == [1] * len(hits), per_layer
            assert syncs.by_kind == {"tolist": len(hits)}
        else:
            assert syncs.in_modules == 0, dict(syncs.by_kind)
    model.zero_grad(set_to_none=True)
