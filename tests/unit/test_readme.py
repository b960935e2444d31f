"""The README tells the truth: its results tables are what the committed JSON gives, its Python runs as written."""

import pathlib
import re

import pytest

from fastsft_lab.lab import report

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"

# What the CI machine cannot do as written (no hub, no GPU, seconds not minutes): the only changes made to the
# README's code before it runs here.
SUBSTITUTIONS = [
    ('"qwen3-14b"', '"tiny-qwen3"'),
    ('AutoTokenizer.from_pretrained("Qwen/Qwen3-14B")', "_tiny_tokenizer()"),
    ("tokens_per_step=4096", "tokens_per_step=512"),
    ("max_tokens=4096", "max_tokens=256"),
    ("report_to=[],", "report_to=[], use_cpu=True, bf16=False,"),
    ("memory_budget=70,", "memory_budget=4,"),              # a CI host may have less memory than 70 GiB
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


def test_the_readme_counts_the_mutations_there_are(monkeypatch):
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("mutations", README.parent / "tests" / "mutations.py")
    mutations = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "mutations", mutations)   # its dataclasses look their module up there
    spec.loader.exec_module(mutations)
    stated = re.search(r"`make mutants` applies (\d+) named bugs", README.read_text())
    assert stated and int(stated.group(1)) == len(mutations.MUTATIONS)


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
        assert fastsft_lab.state(namespace["model"]).checkpointing == "plan"     # TRL's defaults kept the plan


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


def test_the_packed_table_names_each_rows_gpu_where_the_rows_come_from_different_cards(monkeypatch):
    from fastsft_lab.lab import results as R

    def doc(backend, tokens, gpu, run):
        d = _packed_doc(backend, {f"{backend} naive": 300.0, f"{backend} cached": 200.0}, run=run,
                        tokens_per_step=tokens)
        d["env"]["gpu_name"], d["speedups"] = gpu, {"cached_step_speedup": 1.5}
        return d

    h200 = doc("sdpa", 8192, "NVIDIA H200", "a")
    monkeypatch.setattr(R, "load_results", lambda *a, **k: [h200, doc("varlen", 8192, "NVIDIA H200", "a")])
    assert "GPU |" not in report.packed_table()
    monkeypatch.setattr(R, "load_results", lambda *a, **k: [h200, doc("varlen", 4096, "NVIDIA H100 80GB HBM3", "b")])
    rows = [r for r in report.packed_table().splitlines() if r.startswith("| sdpa") or r.startswith("| varlen")]
    assert rows[0].endswith("| H100 80GB HBM3 |") and rows[1].endswith("| H200 |"), rows


def _combined_doc(kernels, ms, run="h200-2099-01-01", model="qwen3-14b", layers=40, **variant_extra):
    return {"scenario": "combined", "_path": f"{run}/{kernels}.json", "env": {"gpu_name": "GPU", "date": "2099-01-01"},
            "config": {"model": model, "num_layers": layers, "tokens_per_step": 8192, "kernels": kernels,
                       "autocast": "bf16"},
            "variants": [{"name": n, "step_ms": {"median": m, "p20": m, "p80": m, "n": 6}, "host_syncs_per_step": 0,
                          **variant_extra} for n, m in ms.items()]}


def test_combined_summary_states_the_glue_fixes_alone_and_says_not_measured_where_a_floor_lacks_them(monkeypatch):
    from fastsft_lab.lab import results as R

    none = _combined_doc("none", {"transformers default": 300.0, "all naive": 210.0, "all fast": 200.0})
    liger = _combined_doc("liger", {"transformers default": 250.0, "all fast": 150.0})
    monkeypatch.setattr(R, "combined_results", lambda: [none, liger])
    (model, table, pick), = report.combined_summary()
    assert model == "qwen3-14b" and "all 40 layers" in table and "autocast bf16" in table
    assert "all fast over all naive (the glue fixes alone, same kernels): 1.05x on kernels none, not measured on " \
           "kernels liger; published: ~25%" in table
    assert "1.50x" not in table.split("all fast over")[1]            # no ratio made up from the liger default


def test_config_header_names_depth_kernels_and_autocast_and_says_what_was_not_recorded():
    doc = _combined_doc("liger", {})
    assert report.config_header(doc) == ("qwen3-14b, all 40 layers, 8192 tokens/step, kernels liger, autocast bf16 | "
                                         "GPU, torch None, transformers None, 2099-01-01 (h200-2099-01-01)")
    eight = {"config": {"model": "qwen3-14b", "num_layers": 8}}
    assert report.config_header(eight, "here") == ("qwen3-14b, 8 of 40 layers, tokens not recorded, kernels not "
                                                   "recorded, autocast not recorded | here")


def test_peer_text_gives_who_leads_in_x_and_marks_a_missing_peak_and_a_failed_run():
    peer = {"scenario": "peer-unsloth", "_path": "h200-2099-01-01/peer.json", "env": {"gpu_name": "GPU", "date": "2099"},
            "config": {"model": "qwen3-14b", "num_layers": 8, "tokens_per_step": 8192},
            "variants": [{"name": "unsloth", "step_ms": {"median": 300.0, "p20": 290.0, "p80": 310.0, "n": 6},
                          "peak_mem_bytes": 2**31, "host_syncs_per_step": 2},
                         {"name": "unsloth (x1)", "error": "CUDA out of memory"}]}
    ours = _combined_doc("liger", {"all fast": 250.0, "all naive": 260.0}, layers=8)
    text = report.peer_text([peer], [ours])
    assert "qwen3-14b, 8 of 40 layers, 8192 tokens/step" in text
    assert "unsloth (x1): failed: CUDA out of memory" in text
    assert "ours (all fast) vs unsloth: 1.20x the speed by medians (6 and 6 steps)" in text
    assert "peak memory" not in text.split("vs unsloth")[1]          # our peak not recorded: no memory ratio
    fast = next(line for line in text.splitlines() if "fastsft all fast" in line)
    assert "– GiB" in fast and "0.0 GiB" not in fast
    alone = report.peer_text([peer], [])
    assert "no ratio" in alone and "x the speed" not in alone


def test_breakdown_text_gives_each_configuration_its_own_header_and_marks_empty_categories():
    def doc(kernels, autocast, ms):
        cats = [{"category": c, "label": c, "ms": m, "share": m / 100, "kernel_ms": m, "top": []}
                for c, m in (("dense", ms), ("idle", 100 - ms), ("experts", 0.0))]
        return {"_path": "h200-2099-01-01/b.json", "env": {"gpu_name": "GPU", "date": "2099-01-01"},
                "config": {"model": "qwen3-14b", "num_layers": 8, "tokens_per_step": 8192, "kernels": kernels,
                           "autocast": autocast},
                "variants": [{"name": "all fast"}],                # no unprofiled timing: the profiled view
                "breakdown": {"step_ms": 100.0, "categories": cats, "bottleneck": "dense", "activity": "cuda"}}
    text = report.breakdown_text([doc("liger", "none", 60.0), doc("liger", "bf16", 70.0)])
    lines = text.splitlines()
    assert lines[1].split() == ["x8", "liger", "x8", "liger"]
    assert lines[2].split() == ["autocast", "none", "autocast", "bf16"]   # the two columns differ in their header
    assert any(line.split() == ["dense", "60.0", "(60%)", "70.0", "(70%)"] for line in lines)
    assert not any(line.split()[:1] == ["experts"] for line in lines)     # no time anywhere: no row
    assert report.breakdown_text([]).startswith("No committed")


def test_loss_curves_text_states_the_number_of_steps_it_holds():
    doc = {"_path": "h200-2099-01-01/curves.json", "env": {"gpu_name": "GPU", "date": "2099-01-01"},
           "config": {"preset": "gpt-oss-20b", "num_layers": 4, "tokens_per_step": 8192, "dtype": "bfloat16"},
           "losses": {"all naive": [3.0] * 60, "all fast": [3.0] * 60},
           "max_abs_diff_fast_vs_naive": 1e-3, "max_abs_diff_noise_floor": 2e-3}
    text = report.loss_curves_text(doc)
    assert text.startswith("60 LoRA steps, gpt-oss-20b, 4 of 24 layers") and "few hundred" not in text
    assert "1.00e-03" in text and "2.00e-03" in text
    assert report.loss_curves_text(None).startswith("No committed")


def test_attribution_text_gives_each_step_over_the_one_before_and_marks_a_failed_step():
    from fastsft_lab.lab.report import attribution_text

    def row(name, ms, spread=1.0):
        return {"name": name, "step_ms": {"median": ms, "p20": ms - spread, "p80": ms + spread, "n": 5}}

    chain = ["stock transformers", "+ varlen kernel, metadata per layer", "+ metadata cached", "+ double buffer",
             "+ fused loss"]
    doc = {"scenario": "attribution", "env": {}, "_path": "h200-2027-01-01/attribution.json", "config": {"chain": chain, "model": "qwen3-14b", "num_layers": 40,
                                                           "tokens_per_step": 8192, "kernels": "none",
                                                           "autocast": "bf16"},
           "variants": [row(chain[0], 2000.0), row(chain[1], 1600.0),
                        {**row(chain[2], 1590.0, 20.0), "equal_to_first": {"bitwise": True, "loss_rel": 0.0,
                                                                           "grad_rel": 0.0}},
                        {"name": chain[3], "error": "out of memory"}, row(chain[4], 1500.0)]}
    text = attribution_text(doc)
    lines = {line[2:38].strip(): line[38:].split() for line in text.splitlines()[2:-1]}
    # step ms, [p20-p80], vs before, vs stock, syncs, vs ref, what the step removes
    assert lines[chain[1]][2:6] == ["1.25x", "1.25x", "-", "-"] and lines[chain[1]][6] == "compute"
    assert lines[chain[2]][2:6] == ["1.01x~", "1.26x", "-", "bitwise"]          # the spreads overlap: "~"
    assert lines[chain[2]][6:8] == ["host", "overhead"]
    assert " ".join(lines[chain[3]]).startswith("failed: out of memory")
    assert lines[chain[4]][2:4] == ["–", "1.33x"]                               # not compared with a failed step
    assert "qwen3-14b, all 40 layers" in text.splitlines()[0] and "autocast bf16" in text.splitlines()[0]
    only = attribution_text(doc, only=[chain[2]])                                # one step, still over its predecessor
    assert [line[2:38].strip() for line in only.splitlines()[2:-1]] == [chain[2]] and "1.01x~" in only


def test_the_moe_rows_routing_check_is_printed_under_the_chain():
    from fastsft_lab.lab.report import attribution_text

    chain = ["stock transformers", "+ varlen kernel, metadata per layer", "+ sync-free routing, eager glue"]
    check = {"reference": chain[1], "other": chain[2], "tokens": 8192, "top_k": 4, "logits_dtype": "bfloat16",
             "flipped_tokens": [0, 3, 5], "near_ties": [9, 9, 9], "flip_gap_ulps": [None, 1.0, 2.0],
             "free": {"rel": 0.86, "bitwise": False}, "forced": {"rel": 0.025, "bitwise": False}}
    doc = {"scenario": "attribution", "env": {}, "_path": "h200-2027-01-01/a.json",
           "config": {"chain": chain, "model": "gpt-oss-20b", "num_layers": 3, "tokens_per_step": 8192},
           "variants": [{"name": n, "step_ms": {"median": 100.0 - i, "p20": 99.0 - i, "p80": 101.0 - i}}
                        for i, n in enumerate(chain)], "routing": {chain[2]: check}}
    text = attribution_text(doc)
    assert "8 of 8192 tokens x 3 layers routed to other experts" in text
    assert "vs ref as run 8.6e-01, with the reference's routing forced 2.5e-02" in text
    assert "stock transformers: not the model's output" in text or "equal_to_first" not in doc["variants"][0]
