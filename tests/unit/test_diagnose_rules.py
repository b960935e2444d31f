"""The rules under fastsft_lab.diagnose, on hand-made records: the roofline classifier (fastsft_lab.roofline), the op
formulas, the busy union and idle gaps of a step (fastsft_lab.step_profile), the walk to a kernel's layer and phase,
and each switch's prediction from its measured cost (fastsft_lab.predict) -- which must vanish with that cost."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastsft_lab import roofline as R
from fastsft_lab import step_profile as S
from fastsft_lab.predict import Costs, predict, predict_memory_budget

PEAKS = R.Peaks({"16-bit": 1000e12, "tf32": 500e12, "fp32": 60e12}, 3e12, "test peaks")


# --- the classifier -----------------------------------------------------------------------------------------------
def _kernel(name, us, op, shapes, dtypes, concrete=(), key=None, start=0.0):
    flops = R.op_flops(op, shapes, concrete)
    nbytes = R.op_bytes(op, shapes, dtypes)
    prec = R.precision(dtypes[0] if dtypes else None)
    return S.Kernel(name, start, start + us, op, key, S.Where("dense"), flops, nbytes, prec)


def test_a_big_matmul_is_compute_a_big_copy_memory_a_tiny_op_latency():
    n = 8192
    mm = _kernel("sm90_gemm", 1300.0, "aten::mm", [[n, n], [n, n]], ["c10::BFloat16"] * 2, key=1)   # 1.1 TFLOP
    copy = _kernel("copy_kernel", 800.0, "aten::copy_", [[1 << 29], [1 << 29], []],             # 1 GiB read + write
                   ["c10::BFloat16", "c10::BFloat16", "Scalar"], key=2)
    tiny = _kernel("add_kernel", 5.0, "aten::add", [[1024], [1024], []], ["float", "float", "Scalar"], key=3)
    assert mm.flops == 2 * n ** 3 and mm.nbytes == 3 * n * n * 2
    assert copy.nbytes == 2 * (1 << 30)
    S.classify_kernels([mm, copy, tiny], PEAKS)
    assert (mm.bound, copy.bound, tiny.bound) == ("compute", "memory", "latency")
    # a small matmul taking 10 us reaches neither roof (0.3% and 1.3%): latency-bound (occupancy, launch) -- it is short
    m = 256
    assert R.classify(10e-6, 2 * m ** 3, 3 * m * m * 2, PEAKS) == "latency"
    # the big one as slow (22 ms) is no launch overhead: an estimate is missing or the kernel is bad -- unknown
    assert R.classify(2 * n ** 3 / (0.05 * 1000e12), 2 * n ** 3, 3 * n * n * 2, PEAKS) == "unknown"
    # many short kernels of one op together stay latency-bound: their mean length decides
    assert R.classify(400e-6, 2 * m ** 3, 3 * m * m * 2, PEAKS, kernels=20) == "latency"
    # a float32 matmul runs against the float32 peak, not the tensor cores'
    assert R.classify(2 * n ** 3 / 50e12, 2 * n ** 3, 3 * n * n * 4, PEAKS, "fp32") == "compute"


def test_the_ridge_separates_compute_from_memory():
    # intensity F/B above the ridge (1000e12 / 3e12 = 333 FLOP/byte): compute; below: memory; both near their roofs
    assert R.classify(1e-3, 1e12, 1e9, PEAKS) == "compute"          # 1000 FLOP/byte
    assert R.classify(1e-3, 1e10, 2.5e9, PEAKS) == "memory"         # 4 FLOP/byte (LoRA's rank-16 matmul)


def test_an_ops_kernels_are_classified_together_and_a_kernel_without_an_op_by_its_length():
    split_k = [_kernel("gemm_part", 700.0, "aten::mm", [[8192, 8192], [8192, 8192]], ["c10::BFloat16"] * 2, key=7),
               _kernel("splitk_reduce", 600.0, "aten::mm", [[8192, 8192], [8192, 8192]], ["c10::BFloat16"] * 2, key=7)]
    triton_short = S.Kernel("triton_gate", 0, 4.0, None, None, S.Where("experts"))
    triton_long = S.Kernel("triton_gate", 0, 400.0, None, None, S.Where("experts"))
    memcpy = S.Kernel("Memcpy HtoD (Pinned -> Device)", 0, 400.0, None, None, S.Where("copies"))
    S.classify_kernels([*split_k, triton_short, triton_long, memcpy], PEAKS)
    assert [k.bound for k in split_k] == ["compute", "compute"]     # 1300 us together, as the matmul above
    assert (triton_short.bound, triton_long.bound, memcpy.bound) == ("latency", "unknown", "memory")


def test_op_formulas():
    assert R.op_flops("aten::addmm", [[64], [32, 16], [16, 64]]) == 2 * 32 * 16 * 64
    assert R.op_flops("aten::addmm_", [[32, 64], [32, 16], [16, 64]]) == 2 * 32 * 16 * 64       # fused LoRA's
    assert R.op_flops("aten::bmm", [[4, 8, 16], [4, 16, 32]]) == 2 * 4 * 8 * 16 * 32
    assert R.op_flops("aten::_grouped_mm", [[100, 64], [8, 64, 32], [8]]) == 2 * 100 * 64 * 32     # one expert a row
    q = [2, 8, 128, 64]
    full = R.op_flops("aten::_scaled_dot_product_flash_attention", [q, q, q], [None, None, None, 0.0, False])
    causal = R.op_flops("aten::_scaled_dot_product_flash_attention", [q, q, q], [None, None, None, 0.0, True])
    assert full == 2 * 2 * 8 * 128 * 128 * (64 + 64) and causal == full / 2
    bwd = [None] * 11 + [True]
    assert R.op_flops("aten::_scaled_dot_product_flash_attention_backward", [q, q, q, q], bwd) == 2.5 * causal
    # varlen rows (total tokens, heads, dim): every sequence taken as max_seqlen long -- an upper bound
    t = [1000, 8, 64]
    varlen = R.op_flops("aten::_flash_attention_forward", [t, t, t, [5], [5]], [None] * 6 + [300, 0.0, True])
    assert varlen == 2 * 1000 * 8 * 300 * 128 / 2
    # SDPA's cuDNN path launches from _cudnn_attention_forward / _backward (torch 2.9+; is_causal at 10 / 14)
    cudnn = R.op_flops("aten::_cudnn_attention_forward", [q, q, q, [], [], []], [None] * 10 + [True])
    assert cudnn == causal
    cudnn_bwd = R.op_flops("aten::_cudnn_attention_backward", [q, q, q, q], [None] * 14 + [True])
    assert cudnn_bwd == 2.5 * causal
    assert R.op_flops("aten::mul", [[4, 4], [4, 4]], profiler_flops=16) == 16      # the profiler's own count
    # bytes: an in-place op writes its first input back; copy_ reads one and writes one; a list of tensors
    assert R.op_bytes("aten::add_", [[10], [10]], ["float", "float"]) == 3 * 40
    assert R.op_bytes("aten::mul", [[10], []], ["float", "Scalar"]) == 2 * 40
    assert R.op_bytes("aten::cat", [[[4, 8], [4, 8]], []], ["TensorList", "Scalar"], list_itemsize=4) == 4 * 64 * 2
    assert R.precision("c10::BFloat16") == "16-bit" and R.precision("float", "cpu") == "fp32"


def test_the_card_table_matches_the_most_specific_name_and_other_devices_are_measured():
    assert R.card_peaks("NVIDIA H100 80GB HBM3").bandwidth == 3.35e12
    assert R.card_peaks("NVIDIA H100 PCIe").flops["16-bit"] == 756e12
    assert R.card_peaks("NVIDIA H200").bandwidth == 4.8e12
    assert R.card_peaks("NVIDIA A100-SXM4-80GB").bandwidth == 2.039e12
    assert R.card_peaks("NVIDIA A100-SXM4-40GB").bandwidth == 1.555e12
    assert R.card_peaks("NVIDIA L40S").flops["16-bit"] == 362e12 and R.card_peaks("NVIDIA L4").bandwidth == 0.3e12
    assert R.card_peaks("Tesla T4").flops["16-bit"] == 65e12
    assert R.card_peaks("Some GPU") is None
    cpu = R.device_peaks("cpu")
    assert cpu.source.startswith("measured on cpu") and cpu.bandwidth > 0 and cpu.flops["fp32"] > 0
    assert R.device_peaks("cpu") is cpu                                                      # measured once


# --- time: the busy union, the idle gaps ------------------------------------------------------------------------
def test_busy_is_the_union_of_the_kernels_and_idle_the_rest():
    intervals = [(0, 10), (5, 15), (14, 16), (20, 30), (35, 60), (45, 50)]   # overlaps once; clipped at 40
    assert S.union_us(intervals, (0, 40)) == pytest.approx(16 + 10 + 5)
    assert S.union_us([], (0, 40)) == 0
    ks = [S.Kernel(f"k{i}", s, e, "aten::x", i, S.Where("dense"), bound="memory") for i, (s, e) in enumerate(intervals)]
    prof = S.StepProfile("cuda", [(0.0, 40.0)], ks, PEAKS)
    assert prof.busy_ms == pytest.approx(31 / 1e3) and prof.idle_ms == pytest.approx(9 / 1e3)
    assert sum(prof.by_bound().values()) == pytest.approx(prof.step_ms)
    assert prof.by_bound()["idle"] == pytest.approx(prof.idle_ms)
    assert prof.launches() == 5                                             # the one starting after 40 is not inside


def test_each_idle_gap_is_charged_to_the_kernel_that_ends_it():
    ks = [S.Kernel("a", 2, 10, None, None, S.Where("attention")), S.Kernel("b", 4, 12, None, None, S.Where("dense")),
          S.Kernel("c", 20, 25, None, None, S.Where("experts"))]
    gaps = S.gaps(ks, (0, 30))
    assert [(us, k.name if k else None) for us, k in gaps] == [(2, "a"), (8, "c"), (5, None)]
    assert sum(us for us, _ in gaps) == 30 - S.union_us([(k.start, k.end) for k in ks], (0, 30))


# --- the walk: a kernel's layer and phase -----------------------------------------------------------------------
def _evt(name, *, parent=None, id=0, seq=-1, fwd_thread=0, thread=1, start=0.0, end=1.0):
    e = SimpleNamespace(name=name, device_type=torch.autograd.DeviceType.CPU, is_async=False, id=id,
                        linked_correlation_id=0, sequence_nr=seq, fwd_thread=fwd_thread, thread=thread,
                        time_range=SimpleNamespace(start=start, end=end), cpu_parent=parent, cpu_children=[])
    if parent is not None:
        parent.cpu_children.append(e)
    return e


def test_forward_backward_and_recompute_are_told_apart_with_their_layer():
    layers = {"model.layers.0": 0, "model.layers.1": 1}
    l1 = _evt(S.label("elementwise", "model.layers.1"), id=1)
    attn = _evt(S.label("attention", "model.layers.1.self_attn"), parent=l1, id=2)
    mm = _evt("aten::mm", parent=attn, id=3, seq=9)                                   # forward, layer 1
    node = _evt("autograd::engine::evaluate_function: MmBackward0", id=4, seq=9, fwd_thread=1, thread=2)
    bwd_mm = _evt("aten::mm", parent=node, id=5, thread=2)                            # its backward
    ckpt = _evt("autograd::engine::evaluate_function: CheckpointFunctionBackward", id=6, seq=1, fwd_thread=1,
                thread=2)
    again = _evt(S.label("elementwise", "model.layers.0"), parent=ckpt, id=7, thread=2)
    re_mm = _evt("aten::mm", parent=_evt(S.label("dense", "model.layers.0.mlp.up_proj"), parent=again, id=8),
                 id=9, thread=2)                                                       # layer 0 run again
    acc = _evt("aten::add_", parent=_evt("torch::autograd::AccumulateGrad", parent=node, id=10), id=11)
    index = S.EventIndex([l1, attn, mm, node, bwd_mm, ckpt, again, re_mm, acc], layers)
    assert index.where(mm) == S.Where("attention", 1, "forward")
    assert index.where(bwd_mm) == S.Where("attention", 1, "backward")
    assert index.where(re_mm) == S.Where("dense", 0, "recompute")
    assert index.where(acc).category == "optimizer"


# --- predictions: each from its measured cost, gone when the cost is gone ------------------------------------------
def _by_switch(c: Costs, backend="varlen"):
    return {p.switch: p for p in predict(c, backend=backend)}


BASE = dict(step_ms=100.0, device="cuda", state={"checkpointing": "standard"}, num_layers=2, packed=True,
            row_tokens=4096, cross_pairs=0.75, attention_ms=20.0, experts=True, experts_waits_ms=8.0, experts_syncs=40,
            tokens=4096, vocab=32000, itemsize=2, loss_memory_ms=6.0, loss_memory_bytes=8 * 4096 * 32000 * 4,
            lora_layers=14, lora_glue_ms=3.0, recompute_ms=30.0, recompute_per_layer=[10.0, 20.0],
            backward_per_layer=[20.0, 40.0], layer_activations=[600 << 20, 600 << 20],
            layer_inputs=[32 << 20, 32 << 20], peak_bytes=40 << 30, budget_bytes=42 << 30, link_bytes_per_s=25e9)


def test_each_prediction_rests_on_its_measured_cost():
    p = _by_switch(Costs(**BASE))
    assert p["packed_attention"].saving_ms == pytest.approx(15.0) and p["packed_attention"].value == "varlen"
    assert p["moe_routing"].saving_ms == pytest.approx(8.0) and "40 host syncs" in p["moe_routing"].rests_on
    floor = 3 * 4096 * 32000 * 2
    assert p["fused_loss"].saving_ms == pytest.approx(6.0 * (1 - floor / BASE["loss_memory_bytes"]))
    assert p["fused_loss"].memory_bytes == 4096 * 32000 * (2 + 4)
    assert p["fused_lora"].saving_ms == 3.0
    assert p["memory_budget"].saving_ms == pytest.approx(30.0)             # 2 GiB of room keeps both layers
    assert p["offload_buffers"].applies and not p["offload_buffers"].suggested   # a memory switch
    assert p["offload_buffers"].memory_bytes == (32 << 20) * 2 - 2 * (32 << 20)
    assert {s for s, q in p.items() if q.suggested} == {"packed_attention", "moe_routing", "fused_loss", "fused_lora",
                                                        "memory_budget"}


@pytest.mark.parametrize("removed, switch", [
    (dict(cross_pairs=0.0), "packed_attention"), (dict(attention_ms=0.0), "packed_attention"),
    (dict(experts_waits_ms=0.0), "moe_routing"), (dict(loss_memory_ms=0.0), "fused_loss"),
    (dict(loss_memory_bytes=3 * 4096 * 32000 * 2), "fused_loss"), (dict(lora_glue_ms=0.0), "fused_lora"),
    (dict(budget_bytes=40 << 30), "memory_budget"), (dict(recompute_per_layer=[0.0, 0.0]), "memory_budget"),
])
def test_a_prediction_vanishes_with_the_cost_it_rests_on(removed, switch):
    p = _by_switch(Costs(**{**BASE, **removed}))[switch]
    assert p.saving_ms == 0 and not p.suggested


@pytest.mark.parametrize("changed, switch, reason", [
    (dict(packed=False, padding=0.3), "packed_attention", "30% of its tokens are padding"),
    (dict(state={"packed": "varlen", "checkpointing": "standard"}), "packed_attention", "on already"),
    (dict(experts=False), "moe_routing", "dense model"),
    (dict(lora_layers=0), "fused_lora", "no PEFT LoRA"),
    (dict(fused_head=True), "fused_loss", "already runs a fused LM head"),
    (dict(recompute_ms=0.0), "memory_budget", "no recompute"),
    (dict(budget_bytes=None, device="cpu"), "memory_budget", "free memory is unknown"),
    (dict(device="cpu"), "offload_buffers", "from a GPU"),
    (dict(), "packed_metadata_cache", "a mode of packed_attention"),
])
def test_a_switch_that_does_not_apply_says_why(changed, switch, reason):
    p = _by_switch(Costs(**{**BASE, **changed}))[switch]
    assert not p.applies and reason in p.reason


def test_packing_a_model_whose_own_attention_leaks_across_sequences_is_suggested_to_make_it_right():
    c = Costs(**{**BASE, "stock_packs": False})
    p = _by_switch(c, backend="sdpa")["packed_attention"]
    assert p.saving_ms == 0 and p.corrects and p.suggested and "see each other" in p.rests_on
    assert not _by_switch(Costs(**BASE), backend="sdpa")["packed_attention"].suggested


def test_a_step_whose_kernels_are_not_placed_predicts_nothing():
    p = _by_switch(Costs(**{**BASE, "scoped": False}))
    assert len(p) == 8 and not any(q.applies for q in p.values())
    assert all("torch.compile" in q.reason for q in p.values())


def test_the_memory_plan_keeps_the_most_recompute_per_byte_that_fits():
    # room for one layer's extra activations (568 MiB) only: the one with more recompute ms is kept
    c = Costs(**{**BASE, "budget_bytes": (40 << 30) + (600 << 20)})
    p = predict_memory_budget(c)
    assert p.saving_ms == 20.0 and "keeps 1 of 2" in p.rests_on
    assert p.memory_bytes == -((600 - 32) << 20)


def test_sdpa_masks_cross_pairs_without_skipping_them_and_the_cache_removes_the_rebuilds_waits():
    c = Costs(**{**BASE, "state": {"packed": "sdpa", "packed_cache": False, "checkpointing": "none"},
                 "attention_waits_ms": 4.0, "attention_small_ms": 1.5, "attention_syncs": 72})
    p = _by_switch(c, backend="sdpa")
    assert p["packed_metadata_cache"].saving_ms == 5.5 and "72 host syncs" in p["packed_metadata_cache"].rests_on
    q = _by_switch(Costs(**BASE), backend="sdpa")["packed_attention"]
    assert q.applies and q.saving_ms == 0 and "still computes them" in q.rests_on


def test_eager_attention_is_predicted_from_all_its_score_kernels_less_a_fused_kernel_over_the_pairs_within():
    # eager attention: 200 ms of kernels over T x T scores; a varlen kernel does 2 TFLOP of within-sequence pairs at
    # the step's 400 TFLOP/s: 5 ms -- the saving is everything else, far more than the cross-pair share of 200 ms
    c = Costs(**{**BASE, "attention_ms": 200.0, "attention_fused": False, "attention_within_flops": 2e12,
                 "compute_flops_per_s": 400e12})
    p = _by_switch(c)["packed_attention"]
    assert p.saving_ms == pytest.approx(195.0) and "eager attention" in p.rests_on and "5.0 ms" in p.rests_on
    # a fused kernel already skips nothing but pays no score tensors: only the crossing pairs go
    assert _by_switch(Costs(**{**c.as_dict(), "attention_fused": True}))["packed_attention"].saving_ms == 150.0
    # no matmul rate measured (a CPU's kernels, no peaks): the crossing pairs' share, as for a fused kernel
    assert _by_switch(Costs(**{**c.as_dict(), "compute_flops_per_s": 0.0}))["packed_attention"].saving_ms == 150.0
    # a backend that computes every pair wins nothing on the pairs
    assert _by_switch(c, backend="sdpa")["packed_attention"].saving_ms == 0
