"""fastsft_lab.diagnose on tiny models: each finding where its cause is planted and where it is absent -- a host sync
in a decoder layer (found, at its line and layer), a per-expert loop (syncs and launches that grow with the experts
hit; none when sync-free), recompute (checkpointing on: a share of the step; off: none) -- the report, the refusals,
prediction beside measurement, and the callback on TRL's SFTTrainer. The rules themselves: test_diagnose_rules.py."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from torch import nn

import fastsft_lab
from fastsft_lab.diagnosis import diagnose
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.structure import decoder_layers

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
QUICK = dict(warmup=1, repeats=1)


def _batch(model, tokens=128, lengths=None, device="cpu"):
    ids = torch.randint(4, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if lengths:
        batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
    return {k: v.to(device) for k, v in batch.items()}


class Planted(nn.Module):
    """A decoder layer's MLP that reads a value back to the host: the sync a diagnosis must find."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.inner = mlp

    def forward(self, x):
        scale = x.abs().amax().item()            # the planted sync
        return self.inner(x) * (1.0 if scale >= 0 else 0.0)


def _planted_line() -> int:
    lines, first = inspect.getsourcelines(Planted.forward)
    return first + next(i for i, text in enumerate(lines) if ".item()" in text)


# --- host syncs: where they come from -------------------------------------------------------------------------------
def test_a_sync_planted_in_a_layer_is_found_at_its_line_and_layer():
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4))
    clean = diagnose(model, _batch(model), **QUICK)
    # stock transformers reads one value back per step, outside the layers: does the batch pack sequences?
    assert [(s["module"], s["site"].split(":")[0], s["layer"]) for s in clean.sync_sites] == [
        ("model", "transformers/masking_utils.py", None)]
    layer = decoder_layers(model)[1]
    layer.mlp = Planted(layer.mlp)
    d = diagnose(model, _batch(model), **QUICK)
    assert d.syncs == clean.syncs + 1
    (site,) = [s for s in d.sync_sites if s["layer"] is not None]
    assert site["site"] == f"tests/integration/test_diagnose.py:{_planted_line()}"
    assert site["module"] == "model.layers.1.mlp" and site["layer"] == 1 and site["kind"] == "item"
    assert "model.layers.1.mlp -- tests/integration/test_diagnose.py" in str(d)


# --- a per-expert loop ----------------------------------------------------------------------------------------------
def _experts_findings(d):
    per_layer = [sum(s["count"] for s in d.sync_sites if s["layer"] == i and s["category"] == "experts")
                 for i in range(d.costs.num_layers)]
    return per_layer, d.costs.experts_launches


def test_a_per_expert_loop_syncs_and_launches_per_expert_hit_and_sync_free_does_neither():
    from fastsft_lab.lab.scenarios.moe import routing_stats

    model = build_model("tiny-gpt-oss", device="cpu", dtype=torch.float32,
                        lora=LoraSettings(rank=4, target_modules=["q_proj"]))
    batch = _batch(model)
    fastsft_lab.apply(model, moe_routing="naive")
    hits = routing_stats(model, batch)["experts_hit"]
    d = diagnose(model, batch, **QUICK)
    syncs, launches = _experts_findings(d)
    assert all(s >= h for s, h in zip(syncs, hits)) and sum(hits) > 4 * 2   # more experts hit than top-2
    p = d.prediction("moe_routing")
    assert p.suggested and p.value == "sync_free" and f"{sum(syncs)} host syncs" in p.rests_on
    # the same loop with every token routed to two experts: fewer experts hit, fewer syncs and launches
    with torch.no_grad():
        for layer in decoder_layers(model):
            layer.mlp.router.weight.zero_()
            layer.mlp.router.bias.copy_(torch.arange(8, 0, -1, dtype=torch.float32))
    assert routing_stats(model, batch)["experts_hit"] == [2] * 4
    few = diagnose(model, batch, **QUICK)
    few_syncs, few_launches = _experts_findings(few)
    assert all(f < s for f, s in zip(few_syncs, syncs)) and few_launches < launches
    fastsft_lab.apply(model, moe_routing="sync_free")
    free = diagnose(model, batch, **QUICK)
    assert _experts_findings(free)[0] == [0] * 4 and free.costs.experts_launches < few_launches
    assert not free.prediction("moe_routing").applies and "on already" in free.prediction("moe_routing").reason


# --- recompute --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("checkpointing", [True, False])
def test_recompute_is_measured_where_layers_are_checkpointed(checkpointing):
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4),
                        gradient_checkpointing=checkpointing)
    d = diagnose(model, _batch(model), **QUICK)
    per_layer = d.costs.recompute_per_layer
    if checkpointing:
        assert d.recompute_ms > 0 and all(ms > 0 for ms in per_layer) and d.launches_per_layer["recompute"] > 0
        assert 0 < d.recompute_share < 1
        # on a CPU the free memory is unknown: the plan is named, not predicted
        assert "free memory is unknown" in d.prediction("memory_budget").reason
    else:
        assert d.recompute_ms == 0 and d.launches_per_layer["recompute"] == 0
        assert "no recompute" in d.prediction("memory_budget").reason
    assert d.launches_per_layer["forward"] > 0 and d.launches_per_layer["backward"] > 0


# --- the report, the step as given, the refusals ----------------------------------------------------------------------
def test_the_report_adds_up_and_reads_as_json_and_the_models_gradients_are_kept():
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4))
    grads = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.grad = grads[name] = torch.full_like(p, 7.0)
    d = diagnose(model, _batch(model, lengths=[64, 40, 24]), **QUICK)
    assert all(p.grad is grads[n] and bool((p.grad == 7).all()) for n, p in model.named_parameters() if p.requires_grad)
    assert sum(d.bounds.values()) == pytest.approx(d.total_ms, rel=1e-6)
    assert d.busy_ms + d.idle_ms == pytest.approx(d.total_ms) and 0 <= d.idle_share <= 1
    assert d.launches > 0 and d.costs.packed and d.costs.cross_pairs > 0.5 and d.batch.endswith("3 sequences packed")
    assert {r["category"] for r in d.categories} >= {"attention", "lora", "dense", "loss_head"}
    doc = json.loads(json.dumps(d.to_dict()))
    assert {p["switch"] for p in doc["predictions"]} == {
        "packed_attention", "packed_metadata_cache", "moe_routing", "fused_loss", "fused_lora", "fused_dequant",
        "memory_budget", "offload_buffers"}
    text = str(d)
    for part in ("time by bound:", "kernel launches", "host syncs", "recompute", "where the time goes", "suggested:"):
        assert part in text
    assert all(len(line) <= 120 for line in text.splitlines()), max(text.splitlines(), key=len)
    # the packed backend of a CPU masks the other sequences and computes them all: nothing predicted for that
    assert d.prediction("packed_attention").saving_ms == 0


def test_a_step_of_ones_own_is_measured_as_given():
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    calls = []

    def step(m, batch):
        calls.append(1)
        m(**batch).loss.backward()

    d = diagnose(model, _batch(model), step=step, warmup=1, repeats=2)
    assert len(calls) == 1 + 2 + 1 + 1                     # warm-up (its inputs kept), timed, syncs, profiled
    assert d.step_ms > 0


@pytest.mark.parametrize("case, match", [
    ("module", "takes a transformers causal LM"), ("no_layers", "not a transformers causal LM"),
    ("not_a_dict", "batch must be a dict"), ("no_ids", "no 'input_ids'"), ("no_labels", "no 'labels'"),
    ("eval", "eval mode"),
])
def test_bad_input_is_refused_in_one_line(case, match):
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    batch = _batch(model)
    args = {"module": ("a model", batch), "no_layers": (nn.Linear(4, 4), batch), "not_a_dict": (model, [batch]),
            "no_ids": (model, {"labels": batch["labels"]}), "no_labels": (model, {"input_ids": batch["input_ids"]}),
            "eval": (model.eval() if case == "eval" else model, batch)}[case]
    with pytest.raises((TypeError, ValueError), match=match) as err:
        diagnose(*args)
    assert "\n" not in str(err.value)


def test_a_compiled_model_is_measured_as_compiled_and_says_what_it_cannot_see():
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4))
    compiled = torch.compile(model, backend="eager")           # Dynamo's graphs, no compiler: seconds on a CPU
    d = diagnose(compiled, _batch(model), warmup=1, repeats=1)
    assert d.notes and "torch.compile" in d.notes[0] and d.launches > 0
    assert not any(p.applies for p in d.predictions) and "every switch" in str(d)
    assert [s["module"] for s in d.sync_sites] == ["<outside>"]          # no module hooks on a compiled model
    # a layer compiled in place (nn.Module.compile) counts as compiled too
    from fastsft_lab._compat import compiled_in_place

    layer = decoder_layers(model)[0]
    assert not compiled_in_place(layer)
    layer.compile(backend="eager")
    assert compiled_in_place(layer)


def test_apply_and_measure_puts_the_measurement_beside_the_prediction_and_reverts():
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4))
    batch = _batch(model)
    original = fastsft_lab.state(model)
    d = diagnose(model, batch, **QUICK)
    result = d.apply_and_measure(model, batch, switches={"fused_lora": True, "fused_loss": True}, revert=True)
    assert fastsft_lab.state(model) == original
    rows = {r["switch"]: r for r in result.rows()}
    assert rows["fused_lora"]["cost"] == "lora_glue_ms" and rows["fused_lora"]["before"] > 0
    # PEFT's scaling and add are gone (counted: a shared CPU's timings move more than this difference)
    lora = {x["category"]: x["launches"] for x in d.categories}["lora"]
    assert {x["category"]: x["launches"] for x in result.after.categories}["lora"] < lora
    assert result.after.costs.state["fused_lora"] and not d.costs.state["fused_lora"]
    text = str(result)
    assert "predicted" in text and "measured" in text and "fused_lora=True" in text
    with pytest.raises(ValueError, match="nothing to apply"):
        d.apply_and_measure(model, batch, switches={})


def test_a_memory_plan_applied_and_measured_removes_the_recompute_and_reverts_to_checkpointing():
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4),
                        gradient_checkpointing=True)
    batch = _batch(model)
    d = diagnose(model, batch, warmup=2, repeats=1)
    with pytest.warns(UserWarning, match="replaces the model's own gradient checkpointing"):
        result = d.apply_and_measure(model, batch, switches={"memory_budget": 8}, revert=True)    # 8 GiB: all kept
    (row,) = result.rows()
    assert row["cost"] == "recompute_ms" and row["before"] > 0 and row["after"] == 0
    assert fastsft_lab.state(model).as_dict() == d.costs.state and d.costs.state["checkpointing"] == "standard"


def test_the_breakdown_gives_the_steps_time_by_bound():
    from fastsft_lab.lab.breakdown import profile_steps

    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4))
    batch = _batch(model)
    assert "bounds" not in profile_steps(model, lambda i: model(**batch).loss.backward(), device="cpu")
    bd = profile_steps(model, lambda i: model(**batch).loss.backward(), device="cpu", bounds=True)
    assert set(bd["bounds"]) == {"compute", "memory", "latency", "unknown", "idle"}
    assert sum(bd["bounds"].values()) == pytest.approx(bd["step_ms"], rel=1e-3)
    assert sum(sum(v.values()) for v in bd["category_bounds"].values()) + bd["bounds"]["idle"] == \
        pytest.approx(bd["step_ms"], rel=1e-3)


# --- the callback, on TRL's SFTTrainer's own loop ---------------------------------------------------------------------
def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t3")


def _sft(tmp_path, callback, max_steps):
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(4, 256, (int(n),), generator=g).tolist() for n in torch.randint(8, 48, (64,), generator=g)]
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4), seed=1)
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=max_steps, per_device_train_batch_size=4, packing=True,
                         max_length=128, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
                         logging_steps=100, disable_tqdm=True, dataloader_num_workers=0)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict({"input_ids": rows}),
                             processing_class=_tiny_tokenizer(), callbacks=[callback])
    return model, trainer


def test_the_callback_diagnoses_the_trainers_own_step(tmp_path, capsys):
    from fastsft_lab.callbacks import DiagnoseCallback

    diag = DiagnoseCallback(step=1, repeats=1)
    model, trainer = _sft(tmp_path, diag, max_steps=5)
    trainer.train()
    d = diag.diagnosis
    assert d is not None and "fastsft_lab.diagnose:" in capsys.readouterr().out
    assert d.costs.packed and d.recompute_ms > 0            # TRL packs, and checkpoints by default
    assert {"input_ids", "labels", "position_ids"} <= set(diag.batch)
    # the Trainer's own loop reads values back (loss and metrics): found outside the model, at their lines
    loop = [s for s in d.sync_sites if s["module"] == "<outside>"]
    assert loop and all(s["site"].startswith(("trl/", "transformers/")) for s in loop)
    assert d._replay == {"autocast": None}
    # TRL's SFTTrainer computes its loss with a fused LM head of its own: no logits for fused_loss to remove
    assert diag.batch.get("fused_lm_head") and "fused LM head" in d.prediction("fused_loss").reason
    # after training: none of the diagnosis's hooks left on the model (the Trainer's own stay)
    hooks = [h for m in model.modules() for h in (*m._forward_pre_hooks.values(), *m._forward_hooks.values())]
    assert hooks and not [h for h in hooks if getattr(h, "__module__", "").startswith("fastsft_lab")]


def test_the_callback_times_its_steps_before_the_profiler_runs(tmp_path):
    # the profiler's teardown slows the step after it: no timed step may follow the profiled one
    from transformers import TrainerCallback

    from fastsft_lab.callbacks import DiagnoseCallback

    diag = DiagnoseCallback(step=2, repeats=2, print_report=False)
    seen, times = [], []

    class Watch(TrainerCallback):          # runs after the diagnosis's own hooks of each step
        def on_step_begin(self, args, state, control, **kwargs):
            if diag._session is not None:
                times[:] = [diag._session.times_ms]
                seen.append((state.global_step, torch._C._autograd._profiler_enabled(),
                             len(diag._session.times_ms)))

    model, trainer = _sft(tmp_path, diag, max_steps=6)
    trainer.add_callback(Watch())
    trainer.train()
    assert diag.diagnosis is not None
    (profiled,) = [(g, n) for g, on, n in seen if on]
    assert profiled == (diag.last_step, 2)          # the last step measured, after both timed ones
    (timed,) = times
    assert diag.diagnosis.step_ms == pytest.approx((timed[0] + timed[1]) / 2)     # the median of two: their mean


def test_the_callback_refuses_a_run_too_short_to_measure(tmp_path):
    from fastsft_lab.callbacks import DiagnoseCallback

    _, trainer = _sft(tmp_path, DiagnoseCallback(step=2, repeats=2), max_steps=4)
    with pytest.raises(ValueError, match="train at least 6 steps"):
        trainer.train()


# --- on a GPU ---------------------------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_kernels_are_classified_against_the_cards_peaks():
    from fastsft_lab.step_profile import profile_step

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    small = torch.randn(256, device="cuda")

    def run():
        a @ b
        dst.copy_(src)
        small.add_(1.0)

    run()
    prof = profile_step(run, model=None, device="cuda")
    by_op = {}
    for k in prof.kernels:
        if not k.name.startswith("Memset"):            # a library's workspace clearing, if any
            by_op.setdefault(k.op, []).append(k)
    assert {k.bound for k in by_op["aten::mm"]} == {"compute"}, by_op.get("aten::mm")
    assert {k.bound for k in by_op["aten::copy_"]} == {"memory"}, by_op.get("aten::copy_")
    assert {k.bound for k in by_op["aten::add_"]} == {"latency"}, by_op.get("aten::add_")
    assert by_op["aten::mm"][0].flops == 2 * 8192 ** 3
    name = torch.cuda.get_device_name()
    if any(card in name for card in ("H100", "H200", "A100", "L4", "T4")):
        assert prof.peaks.source.startswith("data sheet")
    assert 0 < prof.busy_ms <= prof.step_ms


@pytest.mark.cuda
def test_cuda_diagnosis_of_a_small_model_then_its_suggestions_measured():
    model = build_model("tiny-qwen3", device="cuda", dtype=torch.bfloat16, lora=LoraSettings(rank=4),
                        gradient_checkpointing=True)
    batch = _batch(model, tokens=512, lengths=[200, 150, 100, 62], device="cuda")
    original = fastsft_lab.state(model)
    d = diagnose(model, batch)
    print(d)
    assert d.device == torch.cuda.get_device_name() and d.peaks
    assert d.busy_ms + d.idle_ms == pytest.approx(d.step_ms) and 0 <= d.idle_share <= 1
    assert sum(d.bounds.values()) == pytest.approx(d.step_ms, rel=1e-6)
    assert d.launches > 0 and d.launches_per_layer["recompute"] > 0 and d.recompute_ms > 0
    assert d.memory["peak"] > 0 and d.memory["headroom"] is not None and d.memory["total"] > d.memory["peak"]
    costs = d.costs
    assert len(costs.layer_activations) == 3 and all(a > i > 0 for a, i in zip(costs.layer_activations,
                                                                                costs.layer_inputs))
    assert costs.link_bytes_per_s and costs.link_bytes_per_s > 1e9
    assert d.prediction("memory_budget").applies and d.prediction("offload_buffers").applies
    linked = [k for k in d_kernels(model, batch) if k.op is not None]
    assert linked
    result = d.apply_and_measure(model, batch, revert=True)
    print(result)
    assert fastsft_lab.state(model) == original
    assert result.after.step_ms > 0 and set(result.applied) == set(d.suggested())


def d_kernels(model, batch):
    from fastsft_lab.diagnosis import StepRunner
    from fastsft_lab.step_profile import profile_step

    run = StepRunner(model, batch)
    with run.grads_kept():
        run()
        return profile_step(run, model=model, device="cuda").kernels


@pytest.mark.cuda
def test_cuda_per_expert_loop_waits_on_the_host():
    model = build_model("tiny-gpt-oss", device="cuda", dtype=torch.bfloat16,
                        lora=LoraSettings(rank=4, target_modules=["q_proj"]))
    batch = _batch(model, tokens=256, device="cuda")
    fastsft_lab.apply(model, moe_routing="naive")
    d = diagnose(model, batch)
    print(d)
    experts = [s for s in d.sync_sites if s["category"] == "experts"]
    assert experts and any(s["site"].startswith("fastsft_lab/moe/") for s in experts)
    assert d.costs.experts_waits_ms > 0 and d.prediction("moe_routing").suggested


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_the_attention_cost_is_every_score_kernel_of_eager_attention_and_the_fused_kernel_of_sdpa(impl):
    from fastsft_lab._compat import set_attn_implementation_of
    from fastsft_lab.predict import predict

    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4),
                        gradient_checkpointing=True)
    set_attn_implementation_of(model.config, impl)
    lengths = (100, 100, 56)
    d = diagnose(model, _batch(model, tokens=256, lengths=lengths), **QUICK)
    c = d.costs
    cfg = model.config
    within = sum(n * (n + 1) // 2 for n in lengths)
    # forward, backward (2.5x), every layer recomputed; Q K^T and P V over every head
    assert c.attention_within_flops == within * 4 * cfg.num_attention_heads * cfg.head_dim * 4.5 * cfg.num_hidden_layers
    attention = next(r for r in d.categories if r["category"] == "attention")
    assert c.attention_fused == (impl == "sdpa")
    if impl == "eager":     # softmax, matmuls, mask, casts: all of the category but its latency-bound kernels
        assert c.attention_ms == pytest.approx(attention["kernel_ms"] - attention["latency"], rel=1e-6)
        p = {q.switch: q for q in predict(c, backend="varlen")}["packed_attention"]
        assert c.compute_flops_per_s > 0
        assert p.saving_ms == pytest.approx(c.attention_ms - c.attention_within_flops / c.compute_flops_per_s * 1e3)
    else:
        assert 0 < c.attention_ms < attention["kernel_ms"]
