"""The harness: documented JSON fields, interleaving, failure isolation, chart, and the CLI."""

import json
import os

import pytest
import torch

from fastsft_lab.lab.cli import main, parse_sets
from fastsft_lab.lab.harness import Variant, format_table, make_result, run_variants, write_json
from fastsft_lab.lab.plots import plot_result, save_figure
from fastsft_lab.data import benchmark_batches
from fastsft_lab.models import LoraSettings, build_model


@pytest.fixture(scope="module")
def tiny():
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4),
                        gradient_checkpointing=True)
    batches = benchmark_batches(tokens_per_step=256, row_tokens=128, steps=2, vocab_size=256, mix="short")
    return model, batches


def test_result_json_has_the_documented_fields(tiny, tmp_path):
    model, batches = tiny
    order = []

    def tracer(name):
        return Variant(name, toggles={"which": name}, enable=lambda m: order.append(name), note=f"{name} note")

    rows = run_variants(model, batches, [tracer("a"), tracer("b")], steps=3, warmup=1, progress=False)
    # interleaved: a b a b ... (then one untimed sync-counting step each)
    assert order[:8] == ["a", "b"] * 4
    result = make_result("demo", {"model": "tiny-qwen3", "quant": None, "lora_rank": 4, "tokens_per_step": 256,
                                  "seq_len_stats": batches[0].length_stats(), "dtype": "float32",
                                  "gradient_checkpointing": True}, rows, "cpu")
    path = write_json(result, str(tmp_path / "r.json"))
    doc = json.loads(open(path).read())
    for key in ("device", "gpu_name", "torch", "transformers", "peft", "bitsandbytes", "date"):
        assert key in doc["env"]
    for key in ("model", "quant", "lora_rank", "tokens_per_step", "seq_len_stats", "dtype", "gradient_checkpointing"):
        assert key in doc["config"]
    assert [v["name"] for v in doc["variants"]] == ["a", "b"]
    for v in doc["variants"]:
        assert v["toggles"] == {"which": v["name"]} and v["note"]
        for phase in ("forward_ms", "backward_ms", "step_ms"):
            assert set(v[phase]) >= {"median", "p20", "p80"} and v[phase]["n"] == 3
        assert "host_syncs_per_step" in v and "peak_mem_bytes" in v
        assert v["host_syncs_per_step"] == 1  # stock sdpa: one packed-detection read per forward
    png = save_figure(plot_result(doc), str(tmp_path / "r.png"))
    assert os.path.getsize(png) > 1000
    assert "1.00" in format_table(doc)


def test_a_stock_row_that_attends_across_packed_sequences_says_so():
    """GPT-OSS's stock rows are not equal to exact packing: the table says why in one line, under the rows it
    concerns only (an unequal row whose reason is unknown, or a bitwise one, adds nothing)."""
    from fastsft_lab.lab.scenarios.combined import combined_variants
    from fastsft_lab.lab.scenarios.packed import STOCK_LEAKS
    from fastsft_lab.models import build_model

    for preset, leaks in (("tiny-gpt-oss", True), ("tiny-qwen3", False)):
        model = build_model(preset, device="cpu", dtype=torch.float32)
        marked = {v.name for v in combined_variants(model, is_moe="gpt" in preset, trl=False) if v.unequal}
        stock = {"transformers default", "transformers, eager experts"} if leaks else set()
        assert marked == stock, (preset, marked)
    row = {"forward_ms": {"median": 1.0}, "backward_ms": {"median": 1.0}, "step_ms": {"median": 2.0, "p20": 2.0,
                                                                                     "p80": 2.0}}
    doc = {"variants": [{**row, "name": "all naive", "equal_to_first": None, "equal_reference": "all naive"},
                        {**row, "name": "stock", "unequal": STOCK_LEAKS,
                         "equal_to_first": {"bitwise": False, "loss_rel": 1e-3, "grad_rel": 1.0}},
                        {**row, "name": "other", "unequal": "never printed",
                         "equal_to_first": {"bitwise": True, "loss_rel": 0.0, "grad_rel": 0.0}}]}
    text = format_table(doc)
    assert f"  stock: {STOCK_LEAKS}" in text and "never printed" not in text


def test_a_failing_variant_is_reported_not_fatal(tiny):
    model, batches = tiny

    def broken(batch, state=None):
        raise RuntimeError("kernel not available here")

    rows = run_variants(model, batches, [Variant("ok"), Variant("broken", inputs=broken)], steps=2, warmup=0,
                        progress=False)
    assert "step_ms" in rows[0]
    assert rows[1]["error"].startswith("RuntimeError: kernel not available here")


def test_bad_arguments_raise(tiny):
    model, batches = tiny
    with pytest.raises(ValueError, match="no variants"):
        run_variants(model, batches, [], progress=False)
    with pytest.raises(ValueError, match="steps"):
        run_variants(model, batches, [Variant("a")], steps=0, progress=False)


def test_cli_set_parsing():
    sets = parse_sets(["packed.tokens=4096,16384", "moe.num_layers=8", "offload.sweep=true", "moe.quant=none"])
    assert sets["packed"] == {"tokens": [4096, 16384]}
    assert sets["moe"] == {"num_layers": 8, "quant": None}
    assert sets["offload"] == {"sweep": True}
    with pytest.raises(SystemExit):
        parse_sets(["tokens=4"])
    with pytest.raises(SystemExit):
        parse_sets(["nosuch.tokens=4"])


def test_the_word_none_is_a_string_for_string_options():
    # `--set combined.kernels=none` parses to None; a strs/str option takes it as the word, a str? option as None
    from fastsft_lab.lab.scenario import _coerce

    assert _coerce("kernels", "strs", parse_sets(["combined.kernels=none"])["combined"]["kernels"]) == ["none"]
    assert _coerce("kernels", "strs", [None, "liger"]) == ["none", "liger"]
    assert _coerce("variants", "str", None) == "none"
    assert _coerce("quant", "str?", None) is None
    with pytest.raises(Exception):
        _coerce("steps", "int", None)


def test_cli_bench_runs_a_scenario_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["bench", "--only", "moe", "--smoke", "--device", "cpu", "--out", str(out), "--quiet",
                 "--steps", "1", "--warmup", "0", "--set", "moe.micro=false", "--set", "moe.modes=forward"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["smoke"] is True and summary["scenarios"][0]["scenario"] == "moe"
    assert any(p.suffix == ".png" for p in out.iterdir())
    assert "summary" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "--only", "nosuch"])


@pytest.mark.cuda
def test_cuda_combined_scenario_tiny_runs_every_variant(tmp_path):
    from fastsft_lab.lab.scenarios import run_scenario

    results = run_scenario("combined", device="cuda", smoke=True, out_dir=str(tmp_path), steps=1, warmup=1,
                           progress=False)
    assert {r["config"]["kernels"] for r in results} == {"none", "liger"}
    for r in results:
        assert r["config"]["host_link"]["h2d_gbps"] > 0 and r["config"]["host_link"]["d2h_gbps"] > 0
        rows = {v["name"]: v for v in r["variants"]}
        assert not [n for n, v in rows.items() if "error" in v], {n: v["error"] for n, v in rows.items() if "error" in v}
        assert rows["all fast"]["host_syncs_per_step"] == 0
        assert rows["all naive"]["host_syncs_per_step"] > 0


def test_every_step_time_gets_tokens_per_second_and_model_flops():
    from fastsft_lab.data import benchmark_batches
    from fastsft_lab.lab.flops import batch_flops, peak_flops, step_flops
    from fastsft_lab.lab.harness import Variant, add_throughput, format_table, make_result, run_variants
    from fastsft_lab.models import build_model

    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    batches = benchmark_batches(tokens_per_step=128, row_tokens=128, steps=2, vocab_size=model.config.vocab_size,
                                mix="short")
    rows = run_variants(model, batches, [Variant("plain")], steps=1, warmup=0, progress=False, count_syncs=False)
    assert any(b.pad_lengths[0] for b in batches)                # a padding tail: neither tokens nor model FLOPs
    tokens = sum(b.num_real_tokens for b in batches) / 2
    real = [[list(r[:-1]) if p else list(r) for r, p in zip(b.seq_lengths, b.pad_lengths)] for b in batches]
    flops = sum(step_flops(model.config, sl)["flops"] for sl in real) / 2
    r = rows[0]
    assert r["tokens_per_s"] == round(tokens / (r["step_ms"]["median"] / 1e3), 1)
    assert r["flops_per_step"] == flops and r["mfu"] is None      # a CPU: no known peak, no MFU claimed
    assert batch_flops(model.config, batches[0].seq_lengths, "forward") * 3 == \
        batch_flops(model.config, batches[0].seq_lengths, "train")
    assert peak_flops("NVIDIA H200") == 989e12 and peak_flops("NVIDIA L4") == 121e12 and peak_flops("NVIDIA L40S") == 362e12
    fake = [{"name": "x", "step_ms": {"median": 1000.0, "p20": 1000.0, "p80": 1000.0, "n": 1}}]
    add_throughput(fake, model, batches)
    assert fake[0]["tokens_per_s"] == tokens and "MFU" in format_table(make_result("t", {}, fake, "cpu"))


def test_autocast_runs_the_lora_matmuls_in_bf16_and_is_refused_when_unknown():
    from fastsft_lab.data import benchmark_batches
    from fastsft_lab.lab.harness import Variant, run_variants, with_autocast
    from fastsft_lab.lab.scenario import OptionError
    from fastsft_lab.lab.scenarios import run_scenario
    from fastsft_lab.models import LoraSettings, build_model

    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4))
    seen = []
    lora_a = next(m for n, m in model.named_modules() if n.endswith("lora_A.default"))
    lora_a.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    batches = benchmark_batches(tokens_per_step=128, row_tokens=128, steps=1, vocab_size=model.config.vocab_size,
                                mix="short")
    for autocast, want in (("none", torch.float32), ("bf16", torch.bfloat16)):
        seen.clear()
        (row,) = run_variants(model, batches, with_autocast([Variant("v")], autocast), steps=1, warmup=0,
                              progress=False, count_syncs=False)
        assert "error" not in row and seen and set(seen) == {want}, (autocast, seen)
        assert row["toggles"].get("autocast", "none") == autocast
    with pytest.raises(ValueError, match="autocast must be one of"):
        with_autocast([Variant("v")], "fp8")
    with pytest.raises(OptionError, match="autocast must be one of"):
        run_scenario("combined", device="cpu", smoke=True, out_dir="/tmp/unused", autocast="fp8")


@pytest.mark.parametrize("sets, message", [
    ({"kernels": "triton"}, "kernels must be none or liger, got 'triton'"),
    ({"kernels": "liger"}, "kernels=liger needs a CUDA GPU"),
    ({"search": -1}, "batches must be >= 1 and search >= 0"),
    ({"batches": 0}, "batches must be >= 1 and search >= 0"),
    ({"search": 2, "num_layers": 9}, "search enumerates every layer's choices: at most 8 layers, got 9"),
])
def test_the_budget_scenario_refuses_bad_options_in_one_line(sets, message):
    from fastsft_lab.lab.scenario import OptionError
    from fastsft_lab.lab.scenarios import run_scenario

    with pytest.raises(OptionError, match=message) as e:
        run_scenario("budget", device="cpu", smoke=True, out_dir="/tmp/unused", **sets)
    assert "\n" not in str(e.value)


def test_limit_gap_chart_draws_each_row_over_the_limit_in_percent():
    from fastsft_lab.lab.plots import plot_limit_gap

    def doc(backend, cached, collated, oracle):
        ms = lambda m: {"step_ms": {"median": m}}   # noqa: E731
        return {"config": {"backend": backend, "tokens_per_step": 4096, "model": "m", "num_layers": 2, "mix": "short"},
                "env": {}, "variants": [{"name": f"{backend} cached", **ms(cached)},
                                        {"name": f"{backend} cached (collated)", **ms(collated)},
                                        {"name": f"{backend} oracle", **ms(oracle)},
                                        {"name": f"{backend} naive", "error": "RuntimeError: x"}]}

    fig = plot_limit_gap([doc("sdpa", 102.0, 100.5, 100.0), doc("flex", 99.0, 101.0, 100.0)])
    heights = sorted(round(p.get_height(), 6) for p in fig.axes[0].patches if p.get_width() < 1)
    assert heights == [-1.0, 0.5, 1.0, 2.0]
    assert plot_limit_gap([{"config": {}, "env": {}, "variants": [{"name": "sdpa naive", "error": "x"}]}]) is None


def test_a_bench_that_measures_nothing_exits_non_zero_with_the_reason(tmp_path, capsys):
    from fastsft_lab.lab.cli import main

    rc = main(["bench", "--only", "packed", "--smoke", "--device", "cpu", "--out", str(tmp_path), "--quiet",
               "--set", "packed.backends=flash", "--set", "packed.models=tiny-qwen3"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "skip tiny-qwen3 flash" in captured.out + captured.err
    assert "nothing was measured by packed" in captured.err


def test_the_table_marks_ratios_the_run_cannot_tell_apart_and_skips_quietly():
    from fastsft_lab.lab.harness import format_derived, format_table, spreads_overlap

    stat = lambda m, lo, hi: {"median": m, "p20": lo, "p80": hi, "n": 5}     # noqa: E731
    result = {"variants": [{"name": "base", "step_ms": stat(10.0, 9.0, 11.0)},
                           {"name": "same", "step_ms": stat(9.5, 8.0, 9.2)},
                           {"name": "faster", "step_ms": stat(5.0, 4.9, 5.1)},
                           {"name": "peer", "error": "skipped: needs a GPU"}]}
    assert spreads_overlap(stat(1, 1, 2), stat(1, 2, 3)) and not spreads_overlap(stat(1, 1, 2), stat(3, 2.5, 4))
    lines = format_table(result).splitlines()
    row = {ln.split()[0]: ln for ln in lines[2:]}
    assert "1.05x~" in row["same"] and "2.00x " in row["faster"] and "~" not in row["faster"]
    assert "peer" in row and "skipped: needs a GPU" in row["peer"] and "ERROR" not in row["peer"]
    assert lines[-1].startswith("~ the step's p20-p80 overlaps base's")
    assert format_derived({"double_vs_single_gain": 0.0123, "second_buffer_bytes": 3 * 2**20, "note": "n"}) == \
        "double vs single gain +1.2%; second buffer bytes 3.0 MiB; note: n"


def test_every_variant_is_checked_against_the_first_at_the_same_weights(tiny):
    from fastsft_lab.lab.harness import compare_to_first

    model, batches = tiny
    head = [p for n, p in model.named_parameters() if "lora_B" in n][-1]

    def nudge(m):
        head.data.add_(1e-3)

    def unnudge(m):
        head.data.sub_(1e-3)

    same, moved = Variant("same"), Variant("nudged", enable=nudge, disable=unnudge)
    eq = compare_to_first(model, batches[0], [Variant("ref"), same, moved], mode="train")
    assert eq[0] is None and eq[1] == {"bitwise": True, "loss_rel": 0.0, "grad_rel": 0.0}
    assert not eq[2]["bitwise"] and eq[2]["grad_rel"] > 1e-4, eq[2]
    rows = run_variants(model, batches, [Variant("ref"), same, moved], steps=1, warmup=0, progress=False,
                        count_syncs=False)
    table = format_table(make_result("demo", {}, rows, "cpu"))
    import re

    assert "vs ref" in table and table.split("same")[1].splitlines()[0].endswith("bitwise")
    assert re.search(r"\d\.\de[+-]\d\d$", table.split("nudged")[1].splitlines()[0])


def test_offload_rows_count_the_bytes_one_step_copies(tiny):
    from fastsft_lab.lab.harness import _fmt_copied
    from fastsft_lab.lab.scenarios.offload import _OffloadToggle

    model, batches = tiny
    toggle = _OffloadToggle(2, True, False)
    inputs = batches[0].model_inputs()
    per_step = None
    for _ in range(2):                       # the counters are the last step's, not the manager's running total
        toggle.enable(model)
        model(**inputs).loss.backward()
        model.zero_grad(set_to_none=True)
        toggle.disable(model)
        want = model.config.num_hidden_layers * inputs["input_ids"].numel() * model.config.hidden_size * 4
        assert toggle.last_stats["bytes_saved"] == toggle.last_stats["bytes_reloaded"] == want, toggle.last_stats
        per_step = per_step or dict(toggle.last_stats)
        assert toggle.last_stats == per_step
    assert _fmt_copied(toggle.last_stats) == f"{2 * want / 2**20:.2f}" and _fmt_copied(None) == "-"


def test_trl_activation_offloading_is_built_once_and_its_head_hooks_go_with_the_variant(tiny, monkeypatch):
    """SFTTrainer builds TRL's offloading context once and enters it every step; its hooks on the LM head are never
    removed by TRL. The variant does the same (built at the first enable, outside the timed step) and takes the
    hooks off when it is switched off, so the variants timed after it do not run them. (TRL's context needs an
    accelerator: a stand-in that hooks the head as TRL 1.16 does.)"""
    import trl.models.activation_offloading as trl_offloading

    from fastsft_lab.lab.scenarios.combined import trl_offloading_variant

    model, batches = tiny
    built, entered = [], []

    class Context:             # TRL's: hooks on the LM head at build; one object entered every step
        def __init__(self, model, warn_if_no_head=True):
            head = model.get_output_embeddings()
            head.register_forward_pre_hook(lambda *a: None)
            head.register_forward_hook(lambda *a: None, always_call=True)
            built.append(model)

        def __enter__(self):
            entered.append(hooks())

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(trl_offloading, "get_act_offloading_ctx_manager", Context)
    head = model.get_output_embeddings()
    hooks = lambda: len(head._forward_pre_hooks) + len(head._forward_hooks)      # noqa: E731
    before = hooks()
    inputs = lambda b, s: b.model_inputs()                                       # noqa: E731
    seen = []
    variants = [Variant("plain", inputs=inputs), trl_offloading_variant("TRL activation offloading", "", inputs),
                Variant("spy", inputs=inputs, enable=lambda m: seen.append(hooks()))]
    run_variants(model, batches[:1], variants, steps=3, warmup=1, progress=False)
    # built once, entered in every step it ran (1 warm-up + 3 timed, and the harness's check at equal weights)
    assert len(built) == 1 and len(entered) >= 4 and set(entered) == {before + 2}   # with its hooks each time
    assert hooks() == before and len(seen) >= 4 and set(seen) == {before}    # the next variant ran without them
