"""The three experts forwards of the ``moe_routing`` switch on standalone experts modules of every MoE family:
grouping worked by hand, equality with transformers' eager experts (outputs and gradients), host syncs per layer,
the fused gates (interpreted on the CPU), the NF4 store."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastsft_lab import moe
from fastsft_lab.families import get_family
from fastsft_lab.lab.scenarios.moe import routing_stats
from fastsft_lab.moe import MODES, group_by_expert, moe_routing, quantize_experts_nf4
from fastsft_lab.profiling import SyncCounter

from _moe_helpers import MOE_FAMILIES, make_experts, random_routing, run_experts, assert_close, compare_to_eager

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


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
