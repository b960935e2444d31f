"""Where the step's time goes (fastsft_lab.lab.breakdown): modules to categories, the walk from a kernel (or op) to
its scope -- forward by the innermost scope range, backward through the node's forward sequence number -- the
sweep that makes the parts sum to the step, and the ``breakdown`` scenario end to end."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from fastsft_lab.data import benchmark_batches
from fastsft_lab.lab import breakdown as B
from fastsft_lab.lab import results
from fastsft_lab.lab.harness import make_optimizer
from fastsft_lab.lab.scenarios import run_scenario
from fastsft_lab.lab.scenarios.breakdown import BreakdownOptions, BreakdownScenario
from fastsft_lab.lab.scenarios.combined import build_combined_model, combined_variants
from fastsft_lab.models import get_preset


# --- the sweep ------------------------------------------------------------------------------------------------------
def test_attribute_splits_overlaps_hides_copies_and_counts_idle():
    items = [(0, 10, "dense", "a"),          # alone for 0-4, with attention 4-10
             (4, 12, "attention", "b"),      # with dense 4-10, alone 10-12
             (5, 20, "copies", "c"),         # under compute until 12, exposed 12-15 (then idle: no, copy runs)
             (25, 30, "lora", "d"),
             (95, 130, "optimizer", "e")]    # clipped at the window's end
    parts = B.attribute(items, (0, 100))
    assert parts["dense"] == pytest.approx(4 + 3)
    assert parts["attention"] == pytest.approx(3 + 2)
    assert parts["copies"] == pytest.approx(20 - 12)
    assert parts["lora"] == pytest.approx(5)
    assert parts["optimizer"] == pytest.approx(5)
    assert parts["idle"] == pytest.approx(100 - 7 - 5 - 8 - 5 - 5)
    assert sum(parts.values()) == pytest.approx(100)
    assert set(parts) == set(B.CATEGORIES)


def test_attribute_of_nothing_is_all_idle_and_a_reversed_window_is_refused():
    assert B.attribute([], (3, 8))["idle"] == 5
    with pytest.raises(ValueError):
        B.attribute([], (8, 3))


# --- the walk, on hand-made events (device linking, memcpy) ---------------------------------------------------------
def _evt(name, *, device=False, parent=None, id=0, linked=0, seq=-1, fwd_thread=0, thread=1, start=0.0, end=1.0):
    kind = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
    e = SimpleNamespace(name=name, device_type=kind, is_async=False, id=id, linked_correlation_id=linked,
                        sequence_nr=seq, fwd_thread=fwd_thread, thread=thread,
                        time_range=SimpleNamespace(start=start, end=end), cpu_parent=parent, cpu_children=[],
                        is_user_annotation=name.startswith(B.LABEL_PREFIX), activity_type=None)
    if parent is not None:
        parent.cpu_children.append(e)
    return e


def test_device_kernels_take_their_launching_ops_scope_and_memcpy_is_a_copy():
    glue = _evt("aten::slice", id=8, seq=7, start=-2, end=-1)               # records 7 too, creates nothing
    lora = _evt(B.label("lora", "q_proj"), id=1, start=0, end=10)
    mm = _evt("aten::mm", parent=lora, id=2, seq=7, start=1, end=2)           # the last to record 7: node 7's
    bwd = _evt("autograd::engine::evaluate_function: MmBackward0", id=3, seq=7, fwd_thread=1, thread=2,
               start=20, end=30)
    bwd_mm = _evt("aten::mm", parent=bwd, id=4, thread=2, start=21, end=22)
    dense = _evt(B.label("dense", "base_layer"), id=5, start=40, end=50)
    deq = _evt("bitsandbytes::dequantize_4bit", parent=dense, id=6, start=41, end=43)
    deq_op = _evt("aten::empty", parent=deq, id=7, start=41, end=42)
    fused = _evt("bitsandbytes::gemm_4bit", parent=dense, id=9, start=44, end=46)    # dequantizes inside
    events = [glue, lora, mm, bwd, bwd_mm, dense, deq, deq_op, fused]
    kernels = [_evt("sm90_gemm", device=True, linked=2), _evt("sm90_gemm", device=True, linked=4),
               _evt("elementwise_kernel", device=True, linked=7), _evt("Memcpy DtoH (Device -> Pinned)",
               device=True, linked=2), _evt("orphan_kernel", device=True, linked=99),
               _evt("kDequantizeBlockwise<bf16>", device=True, linked=9), _evt("nvjet_gemm", device=True, linked=9)]
    a = B.Attributor(events + kernels)
    assert [a.category(k) for k in kernels] == ["lora", "lora", "nf4_dequant", "copies", "other", "nf4_dequant",
                                                "dense"]


def test_a_runtime_call_sharing_an_ops_id_is_not_taken_for_the_launcher():
    # torch < 2.13: FunctionEvent has no linked_correlation_id, and CUDA runtime ids collide with op ids
    runtime = _evt("cudaLaunchKernel", parent=_evt(B.label("attention", "attn"), id=1), id=5)
    op = _evt("aten::mm", parent=_evt(B.label("dense", "proj"), id=2), id=5)
    op.kernels = [SimpleNamespace(name="sm90_gemm", device=0, duration=1.0)]
    for e in (runtime, op):
        del e.linked_correlation_id
    a = B.Attributor([runtime, op, runtime.cpu_parent, op.cpu_parent])
    assert a.category(_evt("sm90_gemm", device=True, linked=5)) == "dense"
    assert a.category(_evt("unlisted_kernel", device=True, linked=5)) == "dense"     # not the runtime call


def test_a_backward_node_without_its_forward_op_is_other():
    bwd = _evt("autograd::engine::evaluate_function: MulBackward0", id=1, seq=3, fwd_thread=1, thread=2)
    op = _evt("aten::mul", parent=bwd, id=2, thread=2)
    assert B.Attributor([bwd, op]).category(op) == "other"


# --- the walk, on a real profile (CPU) ----------------------------------------------------------------------------
def test_backward_ops_follow_their_forward_scope_through_sequence_numbers(one_cpu_thread):
    w_lora = nn.Parameter(torch.randn(16, 4))
    w_head = nn.Parameter(torch.randn(4, 8))
    x = torch.randn(32, 16)
    target = torch.randint(0, 8, (32,))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with record_function(B.STEP_LABEL):
            with record_function(B.label("lora", "adapter")):
                h = torch.tanh(x @ w_lora)
            with record_function(B.label("loss_head", "head")):
                loss = nn.functional.cross_entropy(h @ w_head, target)
            loss.backward()                           # outside every scope
            unscoped = torch.ones(3) * 2             # noqa: F841 - an op no rule reaches
    events = list(prof.events())
    a = B.Attributor(events)
    cats: dict[str, set] = {}
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and not e.name.startswith((B.LABEL_PREFIX, B.STEP_LABEL)):
            cats.setdefault(e.name, set()).add(a.category(e))
    assert cats["aten::tanh_backward"] == {"lora"}
    assert cats["aten::_log_softmax_backward_data"] == {"loss_head"}
    assert cats["aten::nll_loss_backward"] == {"loss_head"}
    assert cats["aten::mm"] == {"lora", "loss_head"}             # forward and backward of both matmuls
    assert "optimizer" in cats["torch::autograd::AccumulateGrad"]
    assert cats["aten::ones"] == {"other"}


# --- modules to categories ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_qwen(one_cpu_thread):
    opts = BreakdownOptions.defaults(torch.device("cpu"), smoke=True)
    return build_combined_model(get_preset("tiny-qwen3"), num_layers=opts.num_layers, lora_rank=opts.lora_rank,
                                device=torch.device("cpu"))


def test_module_categories_of_a_lora_model(tiny_qwen):
    cats = {path.split("layers.0.", 1)[-1] if "layers.0." in path else path.rsplit(".", 1)[-1]: cat
            for path, (_, cat) in B.module_categories(tiny_qwen).items() if "layers.1" not in path
            and "layers.2" not in path}
    assert cats["self_attn"] == "attention"
    assert cats["self_attn.q_proj"] == "lora" and cats["self_attn.q_proj.base_layer"] == "dense"
    assert "self_attn.q_proj.lora_A.default" not in cats          # inside the LoRA layer's scope: LoRA
    assert cats["mlp.down_proj.base_layer"] == "dense" and cats["mlp"] == "elementwise"
    assert cats["input_layernorm"] == "elementwise" and cats["self_attn.q_norm"] == "elementwise"
    assert cats["lm_head"] == "loss_head"


def test_moe_router_and_experts_are_experts(one_cpu_thread):
    opts = BreakdownOptions.defaults(torch.device("cpu"), smoke=True)
    model = build_combined_model(get_preset("tiny-gpt-oss"), num_layers=opts.num_layers, lora_rank=opts.lora_rank,
                                 device=torch.device("cpu"))
    cats = {p: c for p, (_, c) in B.module_categories(model).items() if ".layers.0.mlp" in p}
    assert cats and set(cats.values()) == {"experts"}, cats
    assert any(p.endswith("mlp.router") for p in cats) and any(p.endswith("mlp.experts") for p in cats)


def test_all_fast_step_of_a_tiny_model_is_attributed(tiny_qwen):
    batches = benchmark_batches(tokens_per_step=256, row_tokens=256, steps=2, vocab_size=256, mix="short")
    fast = next(v for v in combined_variants(tiny_qwen, is_moe=False, which="core", packed="sdpa", trl=False)
                if v.name == "all fast")
    opt = make_optimizer(tiny_qwen)
    bd = B.breakdown_variant(tiny_qwen, batches, fast, optimizer=opt, device="cpu", steps=2)
    rows = {r["category"]: r for r in bd["categories"]}
    tops = {k: {t["name"] for t in r["top"]} for k, r in rows.items()}
    # the attention kernel's forward and backward, the loss's forward and backward, each in its own category
    assert {"aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward"} <= tops["attention"]
    assert any("log_softmax_backward" in n for n in tops["loss_head"])
    assert "aten::mm" in tops["lora"] and "aten::mm" in tops["dense"]
    for key in ("attention", "dense", "lora", "loss_head", "elementwise", "optimizer", "copies"):
        assert rows[key]["ms"] > 0, key
    assert rows["experts"]["ms"] == 0 and rows["nf4_dequant"]["ms"] == 0     # a dense bf16/fp32 model
    assert rows["other"]["ms"] < 0.05 * bd["step_ms"]                        # nearly everything has a scope
    # the invariant: the parts (idle included) sum to the step, in every profiled step and on average
    assert bd["steps"] == 2 and len(bd["per_step"]) == 2
    for p in bd["per_step"]:
        assert sum(p[k] for k in B.CATEGORIES) == pytest.approx(p["step_ms"], rel=1e-6, abs=1e-3)
    assert sum(r["ms"] for r in rows.values()) == pytest.approx(bd["step_ms"], rel=1e-5, abs=1e-3)
    assert sum(r["share"] for r in rows.values()) == pytest.approx(1.0, abs=1e-3)
    assert bd["bottleneck"] == max(rows, key=lambda k: rows[k]["ms"])
    assert B.describe_bottleneck(bd).startswith("next bottleneck -- ")
    assert not tiny_qwen._forward_hooks and not tiny_qwen.base_model.model.lm_head._forward_pre_hooks  # hooks removed


def test_a_breakdown_asked_unprofiled_times_its_steps_first_and_rebases_idle_on_them(tiny_qwen, monkeypatch):
    # the notebook's stock step on a GPU: idle is the unprofiled step less the profiled busy time, not the profiler's
    batches = benchmark_batches(tokens_per_step=256, row_tokens=256, steps=2, vocab_size=256, mix="short")
    fast = next(v for v in combined_variants(tiny_qwen, is_moe=False, which="core", packed="sdpa", trl=False)
                if v.name == "all fast")
    order = []
    real = B.profile_steps
    monkeypatch.setattr(B, "profile_steps", lambda *a, **k: (order.append("profiled"), real(*a, **k))[1])
    ticks = iter(range(1000))
    monkeypatch.setattr(time, "perf_counter", lambda: (order.append("timed"), next(ticks) * 7.0)[1])
    bd = B.breakdown_variant(tiny_qwen, batches, fast, optimizer=make_optimizer(tiny_qwen), device="cpu", steps=2,
                             unprofiled=True)
    assert order[-1] == "profiled" and order.count("timed") == 4     # both timed steps (a start and an end each) first
    assert bd["unprofiled_step_ms"] == pytest.approx(7000.0)         # each timed step 7 s by the fake clock
    idle = next(r for r in bd["categories"] if r["category"] == "idle")
    busy = bd["profiled_step_ms"] - bd["profiled_idle_ms"]
    assert idle["ms"] == pytest.approx(7000.0 - busy, abs=1e-3) and bd["step_ms"] == pytest.approx(7000.0, abs=1e-3)
    assert "unprofiled_step_ms" not in B.breakdown_variant(tiny_qwen, batches, fast, device="cpu", steps=1,
                                                           optimizer=make_optimizer(tiny_qwen))   # CPU default


def test_smoke_scenario_writes_a_result_the_loader_reads(tmp_path, one_cpu_thread):
    out = tmp_path / "cpu-run"
    docs = run_scenario("breakdown", device="cpu", smoke=True, out_dir=str(out), progress=False,
                        models=["tiny-gpt-oss"], timed=1, warmup=0)
    assert len(docs) == 1
    doc = docs[0]
    assert doc["scenario"] == "breakdown" and doc["config"]["variant"] == "all fast"
    rows = {r["category"]: r for r in doc["breakdown"]["categories"]}
    assert rows["experts"]["ms"] > 0                                          # an MoE model
    assert doc["bottleneck"]["category"] in B.CATEGORIES and doc["bottleneck"]["sentence"]
    assert doc["variants"][0]["step_ms"]["n"] == 1
    assert doc["config"]["host_link"]["h2d_gbps"] > 0          # breakdowns from two hosts are compared by it
    written = json.loads(next(out.glob("breakdown_tiny-gpt-oss_*.json")).read_text())
    assert written["breakdown"]["step_ms"] == doc["breakdown"]["step_ms"]
    assert list(out.glob("breakdown_tiny-gpt-oss_*.png"))
    loaded = results.breakdown_results(root=tmp_path, device_type="cpu")
    assert [d["config"]["model"] for d in loaded] == ["tiny-gpt-oss"]
    from fastsft_lab.lab import report

    with pytest.MonkeyPatch.context() as mp:      # the README's table names the link each breakdown's copies crossed
        mp.setattr(report.R, "breakdown_results", lambda: loaded)
        link = loaded[0]["config"]["host_link"]
        assert f"| host link, H2D / D2H GB/s | {link['h2d_gbps']:.0f} / {link['d2h_gbps']:.0f} |" in report.breakdown_table()


def test_options_are_checked():
    with pytest.raises(ValueError, match="liger"):
        BreakdownScenario().options(torch.device("cpu"), True, {"kernels": ["liger"]})
    assert BreakdownScenario().options(torch.device("cpu"), True, {"kernels": None}).kernels == ["none"]
    with pytest.raises(ValueError, match="timed"):
        BreakdownScenario().options(torch.device("cpu"), True, {"timed": 0})
    with pytest.raises(ValueError, match="autocast must be one of"):
        BreakdownScenario().options(torch.device("cpu"), True, {"autocast": "fp8"})
    assert BreakdownScenario().options(torch.device("cpu"), True, {"autocast": "bf16"}).autocast == "bf16"


def test_without_profiler_moves_the_profilers_idle_out_and_renames_the_bottleneck():
    from fastsft_lab.lab.breakdown import step_view, without_profiler

    def row(cat, ms):
        return {"category": cat, "label": cat, "ms": ms, "share": 0.0, "kernel_ms": ms, "top": []}

    bd = {"step_ms": 100.0, "steps": 1, "activity": "cuda", "bottleneck": "idle", "bottleneck_work": "experts",
          "categories": [row("experts", 30.0), row("attention", 25.0), row("idle", 45.0)], "per_step": []}
    view = without_profiler(bd, 60.0)                      # busy 55 ms; unprofiled 60 ms: 5 ms of real idle
    by = {r["category"]: r for r in view["categories"]}
    assert by["idle"]["ms"] == 5.0 and by["experts"]["ms"] == 30.0 and view["step_ms"] == 60.0
    assert abs(sum(r["share"] for r in view["categories"]) - 1) < 1e-4 and abs(by["experts"]["share"] - 0.5) < 1e-4
    assert view["bottleneck"] == "experts" and view["profiled_idle_ms"] == 45.0 and view["profiled_step_ms"] == 100.0
    assert bd["categories"][2]["ms"] == 45.0               # the profiled breakdown is left as measured
    assert without_profiler(bd, 50.0)["step_ms"] == 55.0   # kernels slower under the profiler: idle 0, never below

    doc = {"breakdown": bd, "variants": [{"name": "all fast", "step_ms": {"median": 60.0}}]}
    assert step_view(doc)["step_ms"] == 60.0
    assert step_view({**doc, "breakdown": {**bd, "activity": "cpu"}})["step_ms"] == 100.0   # a CPU run's idle is host time
    assert step_view({"breakdown": None}) is None
