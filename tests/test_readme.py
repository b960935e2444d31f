"""The README tells the truth: its results tables are what the committed JSON gives, its Python runs as written."""

import pathlib
import re

import pytest

from fastsft_lab.lab import report

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"

# What the CI machine cannot do as written (no hub, no GPU, seconds not minutes): the only changes made to the
# README's code before it runs here.
SUBSTITUTIONS = [
    ('"qwen3-14b"', '"tiny-qwen3"'),
    ('AutoTokenizer.from_pretrained("Qwen/Qwen3-14B")', "_tiny_tokenizer()"),
    ("tokens_per_step=4096", "tokens_per_step=512"),
    ("max_tokens=4096", "max_tokens=256"),
    ("report_to=[],", "report_to=[], use_cpu=True, bf16=False,"),
]


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t3")


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_results_tables_equal_what_the_committed_results_give():
    names = []
    for path in report.DOCS:
        text = path.read_text()
        names += re.findall(r"<!-- results:(\w+) -->", text)
        assert report.render(text) == text, f"{path.name}: regenerate with: python -m fastsft_lab results --readme"
    assert sorted(names) == sorted(report.TABLES)               # every table once, in the README or docs/results.md
    assert "results:headline" in README.read_text()


def test_the_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    head = text[:text.index("## Quick start")]
    assert "docs/headline.png" in head and "<!-- results:headline -->" in head     # chart and table above the fold
    assert (README.parent / "docs" / "headline.png").stat().st_size > 10_000
    for link in re.findall(r"\]\((docs/[\w.]+)\)", text):
        assert (README.parent / link).exists(), link


def test_the_readme_has_its_code():
    assert len(python_blocks()) == 2


@pytest.mark.parametrize("index", [0, 1], ids=["training-script", "trl-recipe"])
def test_readme_python_runs_on_a_tiny_preset(index, tmp_path, monkeypatch, one_cpu_thread):
    code = python_blocks()[index]
    for old, new in SUBSTITUTIONS:
        code = code.replace(old, new)
    assert "qwen3-14b" not in code
    monkeypatch.chdir(tmp_path)
    namespace = {"_tiny_tokenizer": _tiny_tokenizer, "__name__": "readme"}
    exec(compile(code, f"README.md block {index}", "exec"), namespace)
    import fastsft_lab

    if index == 0:
        assert namespace["state"].packed == "varlen" and namespace["state"].fused_loss
        assert namespace["text"].shape[1] == 16 + 8
        assert fastsft_lab.state(namespace["model"]) == fastsft_lab.ModelState(checkpointing="standard")
    else:
        assert namespace["trainer"].state.global_step == 4


# --- the text views notebooks print (report.py) ---------------------------------------------------------------------
def _moe_doc(scenario, variants, run="h200-2099-01-01", **config):
    return {"scenario": scenario, "_path": f"{run}/moe/x.json", "env": {"gpu_name": "GPU", "date": "2099-01-01"},
            "config": {"model": "gpt-oss-20b", "num_layers": 4, "tokens_per_step": 8192, **config},
            "variants": [{"name": n, "step_ms": {"median": ms}, "host_syncs_per_step": s} if ms else
                         {"name": n, "error": "CUDA out of memory"} for n, ms, s in variants]}


def test_moe_runs_text_gives_speed_over_naive_and_over_transformers_default_and_leaves_missing_points_missing():
    both = _moe_doc("moe-routing", [("naive", 400.0, 900), ("sync_free", 200.0, 0),
                                    ("transformers grouped_mm", 250.0, 0), ("grouped", None, None)], mode="train")
    no_default = _moe_doc("moe-experts-layer", [("naive", 40.0, 225), ("sync_free", 10.0, 0)])
    text = report.moe_runs_text([no_default, both])
    lines = text.splitlines()
    sync_free = [line.split() for line in lines if line.strip().startswith("sync_free")]
    assert sync_free[0][1:4] == ["200.00", "2.00x", "1.25x"]        # whole model first: 400/200 and 250/200
    assert sync_free[1][1:4] == ["10.00", "4.00x", "–"]              # no transformers grouped_mm: no ratio, none made up
    assert any(line.split()[:2] == ["grouped", "failed:"] for line in lines)
    assert text.count("from GPU") == 1                                # the run named once
    assert report.moe_runs_text([]).startswith("No committed")


def test_experts_profile_text_gives_percent_over_the_limit_and_says_when_nothing_is_committed():
    assert report.experts_profile_text(None).startswith("No committed")
    doc = {"_path": "h200-2099-01-01/p.json", "env": {"gpu_name": "Some GPU", "date": "2099-01-01"}, "what": "w",
           "cases": [{"preset": "gpt-oss-20b", "tokens": 8192, "top_k": 4, "hidden_size": 2880, "rows": [
               {"name": "expert matmuls alone", "step_ms": {"median": 5.0}},
               {"name": "sync_free", "step_ms": {"median": 6.0},
                "profile_step": {"gpu_busy_ms": 5.5, "ops": [{"name": "aten::_grouped_mm", "ms": 4.5},
                                                             {"name": "FusedCombine", "ms": 1.0}]}},
               {"name": "sync_free:eager_glue", "step_ms": {"median": 12.5}}]}]}
    text = report.experts_profile_text(doc, top=1)
    assert "+20% over the matmuls alone" in text and "+150% over the matmuls alone" in text
    assert "aten::_grouped_mm" in text and "FusedCombine" not in text   # top=1 op
    assert "x the" not in text                                          # no time ratio written as "x"


def test_offload_texts_say_targets_in_words_use_human_units_and_mark_missing_points():
    from test_notebook_outline import RAW_FLAG

    doc = {"config": {"tokens_per_step": 8192}, "derived": {
        "double_prefetch_vs_single_gain": 0.0078, "offload2p_vs_standard_overhead": 0.0047,
        "target_within_3pct_of_standard": True, "offload2p_speedup_vs_save_on_cpu_step": 1.4,
        "target_1p5x_vs_save_on_cpu": False, "peak_saved_vs_standard_bytes": 838860800,
        "target_peak_below_standard": True, "second_buffer_bytes": 83886080, "target_second_buffer_le_0p5GB": True}}
    text = report.offload_derived_text(doc)
    assert "+0.8% over one buffer" in text and "0.5% slower than standard" in text
    assert "1.40x the speed of save_on_cpu around the step (target: 1.5x, NOT met)" in text
    assert "800.0 MiB below" in text and "80.0 MiB" in text
    assert not RAW_FLAG.findall(text) and "target_" not in text and "True" not in text
    sweep = {"_path": "r/s.json", "env": {"date": "2099"}, "points": [
        {"preset": "p", "hidden_size": 8, "tokens": 16, "copy_to_backward_ratio": 0.04, "gain_x2p_vs_x1": 0.017}]}
    row = report.offload_sweep_text(sweep).splitlines()[-1].split()
    assert row[3:] == ["0.040", "+1.7%", "–"]                         # no serial-copies gain measured: "–"
    assert report.offload_sweep_text(None).startswith("No committed")
    assert report.offload_link_text(None).startswith("No committed")
    vram = {"_path": "r/v.json", "env": {}, "config": {"num_layers": 40, "tokens_per_step": 16384},
            "variants": [{"name": "a", "peak_mem_bytes": 2**31}, {"name": "b"}]}
    assert "a 2.00 GiB, b not measured" in report.offload_vram_text([vram])
    overlap = {"_path": "r/t.json", "env": {}, "overlap": {"x1": {"hidden_share": 0.55, "h2d_hidden_share": 0.1,
                                                                   "reload_stall_ms": 27.3}}}
    assert "55% (reloads 10%), compute waited 27.3 ms" in report.offload_overlap_text(overlap)


def _packed_doc(backend, ms, run="h200-2099-01-01", **config):
    base = {"model": "qwen3-14b", "num_layers": 8, "mix": "realistic", "backend": backend, "tokens_per_step": 8192}
    return {"scenario": "packed_metadata", "_path": f"{run}/p.json", "env": {"gpu_name": "GPU", "date": "2099-01-01"},
            "config": {**base, **config},
            "variants": [{"name": n, "forward_ms": {"median": m / 2}, "step_ms": {"median": m, "p20": m * 0.9, "p80": m * 1.1}}
                         if m else {"name": n, "error": "compile failed"} for n, m in ms.items()]}


def test_packed_texts_give_ratios_from_the_run_and_say_failed_instead_of_an_older_ratio():
    ok = _packed_doc("sdpa", {"sdpa naive": 300.0, "sdpa cached": 200.0, "sdpa oracle": 200.0, "stock sdpa": 250.0})
    failed = _packed_doc("flex", {"flex naive": None, "flex cached": 100.0, "flex oracle": 100.0})
    table = report.packed_configs_text([ok, failed])
    assert "1.500x" in table and "no ratio, failed: naive" in table
    text = report.packed_variants_text([ok])
    assert "sdpa cached              step   200.0 ms   speed over stock sdpa 1.25x" in text
    assert "speed over stock sdpa –" in report.packed_variants_text([failed])       # no stock row in that run
    assert "failed: compile failed" in report.packed_variants_text([failed])
    findings = report.packed_findings_text([ok, failed], published_forward=1.4)
    assert "within 1% of the oracle (step time): 2 of 2" in findings
    assert "reached in 1 of 1 configurations: qwen3-14b 8 realistic sdpa 8192" in findings
    collated = _packed_doc("varlen", {"varlen cached": 101.0, "varlen cached (collated)": 100.4, "varlen oracle": 100.0})
    text = report.packed_collated_text([collated])
    assert "1.0100" in text and "1.0040" in text and "within 0.5% of the oracle: 1 of 1" in text
    assert report.packed_collated_text([]).startswith("No committed")
