"""MoE routing (optimization 3): every mode equals transformers' own eager experts, with the host syncs we claim.

Reference = the untouched stock path (``experts_implementation="eager"``: transformers' ``GptOssExperts.forward`` /
``Qwen3MoeExperts.forward`` / ``MixtralExperts.forward``). Float32 on the CPU; CUDA checks compare per MoE layer (bf16
drifts end to end). The MoE families and their tiny presets come from the model-family record
(:mod:`fastsft_lab.families`): a family added there is checked here with no edit.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastsft_lab import moe
from fastsft_lab.families import FAMILIES, get_family
from fastsft_lab.lab.scenarios import run_scenario
from fastsft_lab.lab.scenarios.moe import experts_microbenchmark, routing_stats
from fastsft_lab.models import PRESETS, LoraSettings, build_model, get_preset
from fastsft_lab.structure import decoder_layers
from fastsft_lab.moe import (MODES, experts_implementation, experts_modules, get_moe_routing, group_by_expert,
                             moe_routing, quantize_experts_nf4, set_moe_routing)
from fastsft_lab.profiling import SyncCounter

ATTN_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_IMPLS = ("eager",) + MODES + ("grouped_mm",)
MOE_FAMILIES = [f.name for f in FAMILIES.values() if f.is_moe]                        # gpt_oss, qwen3_moe, mixtral
TINY_MOE_PRESETS = [p.name for p in PRESETS.values() if p.is_moe and not p.real]     # one tiny preset per family


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# --- helpers -----------------------------------------------------------------------------------------------------
# the config names of each MoE family's expert width and expert count (transformers 5.17)
EXPERT_SIZE_KEYS = {"gpt_oss": ("intermediate_size", "num_local_experts"),
                    "qwen3_moe": ("moe_intermediate_size", "num_experts"),
                    "mixtral": ("intermediate_size", "num_local_experts")}


def make_experts(family: str, *, hidden: int = 16, inter: int = 8, experts: int = 6, top_k: int = 2,
                 dtype=torch.float32, device="cpu", seed: int = 0):
    """A standalone experts module of ``family`` (its record names the config and experts classes) with random
    weights large enough to hit GPT-OSS's clamps (limit 7)."""
    import importlib

    torch.manual_seed(seed)
    fam = get_family(family)
    width_key, count_key = EXPERT_SIZE_KEYS[family]
    cfg = fam.config_type()(hidden_size=hidden, num_experts_per_tok=top_k, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=8, **{width_key: inter, count_key: experts})
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    module = getattr(modeling, fam.experts.class_name)(cfg)
    module = module.to(device=device, dtype=dtype)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(0.0, 0.5 if "bias" in name else 1.0 / math.sqrt(p.shape[-2]))
    return module


def random_routing(tokens: int, experts: int, top_k: int, *, used: list[int] | None = None, seed: int = 0,
                   device="cpu", dtype=torch.float32):
    """(T, k) distinct expert ids drawn from ``used`` (default: all), softmax weights."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(used if used is not None else list(range(experts)))
    assert top_k <= len(pool)
    idx = torch.stack([pool[torch.randperm(len(pool), generator=g)[:top_k]] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return idx.to(device), weights.to(device=device, dtype=dtype)


def run_experts(module, impl, x, idx, w, grad_out):
    """Output and gradients (input, routing weights, every expert parameter) of one implementation."""
    set_moe_routing(module, impl)
    try:
        module.zero_grad(set_to_none=True)
        xx = x.detach().clone().requires_grad_(True)
        ww = w.detach().clone().requires_grad_(True)
        out = module(xx, idx, ww)
        out.backward(grad_out)
        grads = {"input": xx.grad, "weights": ww.grad}
        grads.update({n: p.grad.clone() for n, p in module.named_parameters()})
        return out.detach(), grads
    finally:
        set_moe_routing(module, None)


def assert_close(actual, expected, what="", tol=2e-5):
    scale = 1.0 + expected.abs().max().item()
    diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert diff <= tol * scale, f"{what}: max |diff| {diff:.3g} > {tol} x {scale:.3g}"


def compare_to_eager(module, x, idx, w, modes=MODES + ("grouped_mm",)):
    torch.manual_seed(123)
    grad_out = torch.randn_like(x)
    ref_out, ref_grads = run_experts(module, "eager", x, idx, w, grad_out)
    for mode in modes:
        out, grads = run_experts(module, mode, x, idx, w, grad_out)
        if mode == "naive":  # the same ops as the stock loop: bit-identical
            assert torch.equal(out, ref_out)
            assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
            continue
        assert_close(out, ref_out, f"{mode} output")
        for name in ref_grads:
            assert_close(grads[name], ref_grads[name], f"{mode} grad {name}")


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


# --- grouping ------------------------------------------------------------------------------------------------------
def test_group_by_expert_worked_example_is_sync_free():
    # 6 tokens, top-2, 4 experts; expert 2 gets no token
    idx = torch.tensor([[0, 3], [1, 0], [3, 1], [0, 1], [3, 0], [1, 3]])
    with SyncCounter(device="cpu") as syncs:
        sorted_ids, perm, ends = group_by_expert(idx, 4)
    assert syncs.total == 0
    assert sorted_ids.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 3, 3, 3, 3]
    assert ends.tolist() == [4, 8, 8, 12]  # end offsets = cumulative counts (4, 4, 0, 4)
    assert perm.tolist() == [0, 3, 6, 9, 2, 5, 7, 10, 1, 4, 8, 11]  # stable: token order kept within each expert
    assert (perm // 2).tolist()[:4] == [0, 1, 3, 4]


def test_bincount_would_be_counted_as_a_sync():
    # Why group_by_expert avoids bincount: CUDA reads the max id back to size the output, even with minlength.
    with SyncCounter(device="cpu") as syncs:
        torch.bincount(torch.tensor([0, 2, 2]), minlength=4)
    assert syncs.by_kind.get("bincount") == 1


# --- equivalence: experts modules ------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("case", ["basic", "zero_token_experts", "one_token", "top1", "one_expert_takes_all",
                                  "topk_equals_experts"])
def test_experts_equal_stock_eager(family, case):
    experts, top_k, tokens, used = 6, 2, 23, None
    if case == "zero_token_experts":
        used = [0, 2, 5]
    elif case == "one_token":
        tokens = 1
    elif case == "top1":
        top_k = 1
    elif case == "one_expert_takes_all":
        top_k, used = 1, [4]
    elif case == "topk_equals_experts":
        experts, top_k = 3, 3
    module = make_experts(family, experts=experts, top_k=top_k)
    x = torch.randn(tokens, 16) * 2.0  # large enough that GPT-OSS's clamps at +-7 are hit
    idx, w = random_routing(tokens, experts, top_k, used=used)
    compare_to_eager(module, x, idx, w)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(family=st.sampled_from(MOE_FAMILIES), tokens=st.integers(1, 40), experts=st.integers(2, 9),
       data=st.data())
def test_experts_equal_stock_eager_random(family, tokens, experts, data):
    top_k = data.draw(st.integers(1, min(4, experts)))
    n_used = data.draw(st.integers(top_k, experts))
    used = sorted(data.draw(st.permutations(list(range(experts))))[:n_used])
    seed = data.draw(st.integers(0, 2**16))
    module = make_experts(family, experts=experts, top_k=top_k, seed=seed % 97)
    x = torch.randn(tokens, 16, generator=torch.Generator().manual_seed(seed)) * 2.0
    idx, w = random_routing(tokens, experts, top_k, used=used, seed=seed)
    compare_to_eager(module, x, idx, w)


def test_dense_routing_weights_are_gathered_to_the_top_k(monkeypatch):
    """A family whose router hands its experts dense (T, E) scores (record: ``routing_weights="dense"``) computes, in
    every mode, what the (T, k) weights of the chosen experts give; the score gradient lands on the chosen entries."""
    from fastsft_lab import families

    module = make_experts("qwen3_moe")
    tokens, experts = 23, 6
    x = torch.randn(tokens, 16) * 2.0
    idx, w = random_routing(tokens, experts, 2)
    torch.manual_seed(5)
    grad_out = torch.randn_like(x)
    ref_out, ref_grads = run_experts(module, "eager", x, idx, w, grad_out)            # stock eager on (T, k)
    fam = get_family("qwen3_moe")
    dense_family = dataclasses.replace(fam, experts=dataclasses.replace(fam.experts, routing_weights="dense"))
    monkeypatch.setitem(families._BY_EXPERTS_CLASS, fam.experts.class_name, dense_family)
    scores = torch.zeros(tokens, experts).scatter(1, idx, w)
    for mode in MODES:
        out, grads = run_experts(module, mode, x, idx, scores, grad_out)
        assert_close(out, ref_out, f"{mode} output")
        assert_close(grads["weights"].gather(1, idx), ref_grads["weights"], f"{mode} grad weights")
        assert grads["weights"].scatter(1, idx, 0.0).abs().max() == 0
        for name in ref_grads.keys() - {"weights"}:
            assert_close(grads[name], ref_grads[name], f"{mode} grad {name}")


def test_empty_input_returns_empty():
    module = make_experts("gpt_oss")
    x = torch.zeros(0, 16)
    idx, w = torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
    for mode in MODES:
        with moe_routing(module, mode):
            assert module(x, idx, w).shape == (0, 16)


# --- host syncs ------------------------------------------------------------------------------------------------------
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


def test_sync_free_fallback_warns_and_stays_exact(monkeypatch):
    module = make_experts("gpt_oss")
    x = torch.randn(9, 16)
    idx, w = random_routing(9, 6, 2)
    with moe_routing(module, "eager"):
        ref = module(x, idx, w)
    from fastsft_lab.moe import experts

    monkeypatch.setattr(experts, "grouped_mm_unavailable", lambda *a: "test: no grouped_mm")
    experts._FALLBACK_WARNED.discard("test: no grouped_mm")
    with moe_routing(module, "sync_free"), SyncCounter(device="cpu") as syncs:
        with pytest.warns(UserWarning, match="falls back to 'grouped'"):
            out = module(x, idx, w)
    assert syncs.total == 1
    assert_close(out, ref, "fallback")


def test_cpu_grouped_mm_runs_here_and_is_exact():
    x, w = torch.randn(10, 16), torch.randn(4, 16, 8)
    assert moe.grouped_mm_unavailable(x, w) is None  # torch >= 2.9 has a CPU kernel: the real path is tested
    offs = torch.tensor([3, 3, 7, 10], dtype=torch.int32)  # expert 1 empty
    out = moe.grouped_mm(x, w, offs)
    ref = torch.cat([x[0:3] @ w[0], x[3:7] @ w[2], x[7:10] @ w[3]])
    assert_close(out, ref, "cpu grouped_mm", tol=1e-6)


# --- the fused gates: GPT-OSS's GLU, the SiLU gate (Triton; interpreted on the CPU where triton is installed) --------
_GLU_CHECK = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from fastsft_lab import moe
from fastsft_lab.moe import gate
assert gate._HAS_TRITON

def close(x, y, what, tol=1e-5):
    err = (x - y).abs().max().item()
    assert err <= tol * (1 + y.abs().max().item()), (what, err)

torch.manual_seed(0)
# (rows, I, experts): I = 24 fits one tile; I = 1100 -> 5 column tiles of 256 (the last 76 wide) x 16-row tiles (the
# last 5 rows); GPT-OSS-20B's I = 2880 -> 3 tiles of 1024 x 4 rows; E > 0: each row's expert bias, read in place
for S, I, E in [(37, 24, 0), (37, 1100, 0), (9, 2880, 0), (37, 1100, 5), (9, 2880, 3)]:
    grid, block_r, block_c = gate._gate_grid(S, I)
    assert I == 24 or (grid[1] > 1 and I % block_c and S % block_r), (S, I, block_r, block_c)  # partial tiles
    gu = torch.randn(S, 2 * I) * 6
    for r, c in [(0, 0), (S - 1, 2 * I - 4), (S // 2, I)]:  # gate at +limit, up at -limit/+limit: exactly at the
        gu[r, c], gu[r, c + 1], gu[r, c + 3] = 7.0, -7.0, 7.0  # clamps PyTorch passes the gradient (first, last, mid)
    bias = torch.randn(E, 2 * I) if E else None
    ids = torch.sort(torch.randint(0, E, (S,)))[0] if E else None
    if E:
        gu -= bias[ids]  # the biased input sits on the clamps there (where the float32 add rounds back)
    a, b = gu.clone().requires_grad_(True), gu.clone().requires_grad_(True)
    ba, bb = (bias.clone().requires_grad_(True), bias.clone().requires_grad_(True)) if E else (None, None)
    ref = moe.gate.eager_gpt_oss_glu(a + ba[ids] if E else a, 1.702, 7.0)
    out = moe.gpt_oss_glu(b, 1.702, 7.0, bias=bb, expert_ids=ids)
    assert out.grad_fn is not None and "Fused" in type(out.grad_fn).__name__, type(out.grad_fn)
    go = torch.randn_like(out)
    ref.backward(go); out.backward(go)
    close(out, ref, ("glu", S, I, E)); close(b.grad, a.grad, ("glu grad", S, I, E))
    if E:
        close(bb.grad, ba.grad, ("bias grad", S, I, E))
    if not E:  # the SiLU gate over the same tiles
        a, b = gu.clone().requires_grad_(True), gu.clone().requires_grad_(True)
        ref = torch.nn.functional.silu(a[:, :I]) * a[:, I:]
        out = gate.silu_glu(b)
        assert "Fused" in type(out.grad_fn).__name__, type(out.grad_fn)
        ref.backward(go); out.backward(go)
        close(out, ref, ("swiglu", S, I)); close(b.grad, a.grad, ("swiglu grad", S, I))
print("ok")
"""


def test_fused_glu_kernel_interpreted_on_cpu(interpreted):
    interpreted(_GLU_CHECK)


_FUSED_GLUE_CHECK = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from fastsft_lab.moe import gate, grouping, kernels
assert kernels._HAS_TRITON and kernels.fused_combine_available(torch.zeros(1))

def close(a, b, what, tol=1e-5):
    err = (a - b).abs().max().item()
    assert err <= tol * (1 + b.abs().max().item()), (what, err)

torch.manual_seed(0)
for T, k, H, E in [(37, 4, 48, 8), (21, 8, 40, 16), (5, 3, 7, 4)]:   # k = 3: a slot count that is not a power of 2
    idx = torch.randint(0, E, (T, k))
    _, perm, _ = grouping.group_by_expert(idx, E)
    inv = grouping.inverse_permutation(perm)
    h, w = torch.randn(T, H), torch.rand(T, k)
    go = torch.randn(T, H)
    runs = []
    for fused in (False, True):
        kernels.set_fused_combine(fused)
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        x = grouping.tokens_in_expert_order(hh, perm, inv, k)
        y = x * 1.5 + 0.25 * x ** 2          # a row-wise function: every row's gradient differs
        out = grouping.combine(y, perm, inv, ww)
        out.backward(go)
        runs.append((out.detach(), hh.grad, ww.grad, type(out.grad_fn).__name__, type(x.grad_fn).__name__))
    (o0, h0, w0, n0, x0), (o1, h1, w1, n1, x1) = runs
    assert n1 == "FusedCombineBackward" and x1 == "FusedTokenGatherBackward", (n1, x1)
    assert n0 != n1 and x0 != x1, (n0, x0)
    close(o1, o0, "combine"); close(h1, h0, "token grad"); close(w1, w0, "weight grad")

gu = torch.randn(13, 48)
a, b = gu.clone().requires_grad_(True), gu.clone().requires_grad_(True)
ref = torch.nn.functional.silu(a[:, :24]) * a[:, 24:]
out = gate.silu_glu(b)
assert "Fused" in type(out.grad_fn).__name__, type(out.grad_fn)
go = torch.randn_like(out); ref.backward(go); out.backward(go)
close(out, ref, "swiglu"); close(b.grad, a.grad, "swiglu grad")

E, I, S = 4, 12, 19
gu = torch.randn(S, 2 * I) * 6
bias = torch.randn(E, 2 * I)
ids = torch.sort(torch.randint(0, E, (S,)))[0]
a, b = gu.clone().requires_grad_(True), gu.clone().requires_grad_(True)
ba, bb = bias.clone().requires_grad_(True), bias.clone().requires_grad_(True)
ref = gate.eager_gpt_oss_glu(a + ba[ids], 1.702, 7.0)
out = gate.gpt_oss_glu(b, 1.702, 7.0, bias=bb, expert_ids=ids)
go = torch.randn_like(out); ref.backward(go); out.backward(go)
close(out, ref, "glu+bias"); close(b.grad, a.grad, "glu+bias grad"); close(bb.grad, ba.grad, "bias grad")
print("ok")
"""


def test_fused_combine_gather_and_gates_interpreted_on_cpu(interpreted):
    # The combine, the token gather's backward, the SiLU gate and GPT-OSS's gate with its bias read in place: each
    # fused kernel against its eager expression, outputs and gradients (Triton's interpreter on CPU tensors).
    interpreted(_FUSED_GLUE_CHECK, timeout=600)


def test_eager_glu_equals_stock_gate():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    gu = torch.randn(9, 24) * 6
    a, b = gu.clone().requires_grad_(True), gu.clone().requires_grad_(True)
    ref = GptOssExperts._apply_gate(make_experts("gpt_oss"), a)
    out = moe.gate.eager_gpt_oss_glu(b, 1.702, 7.0)
    go = torch.randn_like(out)
    ref.backward(go)
    out.backward(go)
    assert_close(out, ref, "glu")
    assert_close(b.grad, a.grad, "glu grad")


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


# --- CUDA: per MoE layer in bf16, syncs cross-checked by CUDA -------------------------------------------------------
def _real_width_layer(family: str, dtype=torch.bfloat16):
    """One MoE block (router + experts) at real width on the GPU, initialised like the model (std 0.02)."""
    from fastsft_lab.models import make_config

    preset = "gpt-oss-20b" if family == "gpt_oss" else "qwen3-30b-a3b"
    config = make_config(preset, num_layers=1)
    torch.manual_seed(0)
    if family == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as Block
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    with torch.device("cuda"):
        block = Block(config).to(dtype)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(0.0, 0.02)
    return block


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


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_nf4_store_dequantizes_to_what_bitsandbytes_gives(family):
    # An independent round trip through bitsandbytes (quantize_4bit / dequantize_4bit on the same flat weight, the
    # same blocksize): the store's dequantization must equal it bit for bit, all experts and one expert, and stay
    # within NF4's error of the original weight.
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    module = make_experts(family)
    original = {n: getattr(module, n).detach().clone() for n in ("gate_up_proj", "down_proj")}
    quantize_experts_nf4(module)
    for name, w in original.items():
        packed, st = quantize_4bit(w.reshape(-1).contiguous(), blocksize=64, compress_statistics=False,
                                   quant_type="nf4")
        ref = dequantize_4bit(packed, st).view(w.shape)
        got = moe.dequantize_expert_weight(module, name)
        assert torch.equal(got, ref), name
        assert torch.equal(moe.dequantize_expert_weight(module, name, 2), ref[2]), name
        scale = w.abs().amax()
        assert (got - w).abs().max() <= 0.2 * scale, name                  # NF4: 4 bits per weight
