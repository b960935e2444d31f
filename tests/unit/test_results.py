"""Committed results read back: one recursive loader, the packaged index a pip-installed copy (Colab) reads."""

import json

from fastsft_lab.lab import results


def test_packaged_index_is_up_to_date_with_benchmarks_results():
    # regenerate with: python -m fastsft_lab results --index
    committed = json.loads(results.INDEX.read_text())
    assert committed == json.loads(json.dumps(results.build_index(), sort_keys=True, default=str))


def test_an_installed_copy_reads_the_index(monkeypatch):
    from_repo = results.load_results("offload", device_type="cuda")
    monkeypatch.setattr(results, "repo_results_dir", lambda: None)
    from_index = results.load_results("offload", device_type="cuda")
    assert from_repo and [d["_path"] for d in from_index] == [d["_path"] for d in from_repo]
    assert [v["name"] for v in from_index[0]["variants"]] == [v["name"] for v in from_repo[0]["variants"]]


def test_loader_is_recursive_and_newest_run_does_not_mix_sessions():
    moe = results.load_results(["moe-routing", "moe-experts-layer"])
    assert len(moe) >= 8 and all("/" in d["_path"] for d in moe)      # bench/ subfolders are found
    newest = results.load_results("packed_metadata", newest_run=True)
    assert newest and len({results.run_of(d) for d in newest}) == 1


def test_regime_points_are_one_per_configuration():
    points = results.packed_regime()
    keys = [(p["model"], p.get("num_layers"), p["backend"], p["mix"], p["tokens_per_step"]) for p in points]
    assert points and len(keys) == len(set(keys))


def test_a_widely_spread_variant_is_unsettled_and_the_peer_table_says_so():
    from fastsft_lab.lab import report
    from fastsft_lab.lab import results as R

    steady = {"step_ms": {"median": 100.0, "p20": 99.0, "p80": 101.0, "n": 6}}
    spread = {"step_ms": {"median": 100.0, "p20": 60.0, "p80": 200.0, "n": 6}}
    assert not R.unsettled(steady) and R.unsettled(spread) and not R.unsettled({})
    assert abs(R.step_spread(spread) - 200 / 60) < 1e-12
    # each committed comparison sets our all fast against the peer's fastest run of the same session: its section
    # must say when that run's median settles nothing
    for docs, same in R.peer_results():
        verdict = report.peer_verdict(docs, same)
        if verdict:
            assert ("not settled" in report._peer_section(docs, same)) == R.unsettled(verdict["peer"])


def test_moe_glue_floor_counts_each_glue_tensor_once_and_feeds_the_profile_rows():
    from fastsft_lab.lab.flops import moe_glue_bytes, peak_bandwidth
    from fastsft_lab.lab.results import experts_profile_rows

    T, k, H, I = 8, 2, 4, 3           # noqa: E741
    R = T * k
    gather, gate, combine = T * H + R * H, 2 * R * I + R * I, R * H + T * H
    combine_bwd, gate_bwd, gather_bwd = T * H + 2 * R * H, R * I + 2 * R * I + 2 * R * I, R * H + T * H
    assert moe_glue_bytes(T, k, H, I) == 2 * (gather + gate + combine + combine_bwd + gate_bwd + gather_bwd)
    assert moe_glue_bytes(T, k, H, I, itemsize=4) == 2 * moe_glue_bytes(T, k, H, I)
    assert peak_bandwidth("NVIDIA H200") == 4.8e12 and peak_bandwidth("Some GPU") is None

    ops = [{"name": "aten::_grouped_mm", "ms": 2.0}, {"name": "FusedCombine", "ms": 0.5}]
    doc = {"env": {"gpu_name": "NVIDIA H200"},
           "cases": [{"preset": "qwen3-30b-a3b", "tokens": 8192, "top_k": 8, "hidden_size": 2048,
                      "rows": [{"name": "expert matmuls alone", "step_ms": {"median": 2.2}},
                               {"name": "sync_free", "step_ms": {"median": 3.0},
                                "profile_step": {"gpu_busy_ms": 3.0, "ops": ops}}]}]}
    (row,) = experts_profile_rows(doc)
    floor = moe_glue_bytes(8192, 8, 2048, 768) / 4.8e12 * 1e3     # moe_intermediate_size of the preset, not 6144
    assert abs(row["glue_floor_ms"] - floor) < 1e-9
    assert abs(row["sync_free"]["glue_ms"] - 1.0) < 1e-9
    assert abs(row["sync_free"]["best_unfused_vs_grouped_mm"] - (2.0 + floor) / 2.0) < 1e-9
    doc["env"]["gpu_name"] = "Some GPU"                               # no data sheet: no floor, no ratio
    (row,) = experts_profile_rows(doc)
    assert "glue_floor_ms" not in row and "best_unfused_vs_grouped_mm" not in row["sync_free"]


def _doc(run, scenario, date, **config):
    return {"scenario": scenario, "env": {"device": "cuda", "date": date}, "config": config,
            "variants": [{"name": scenario, "step_ms": {"median": 1.0, "n": 1}}]}


def test_peer_results_pair_each_shape_with_the_newest_session_that_ran_both_sides(tmp_path):
    # run b (newest) repeats the peer at both shapes but ran ours only for qwen: gpt-oss pairs with run a's two sides
    qwen, oss = dict(model="qwen3-14b", num_layers=8, tokens_per_step=8192), dict(model="gpt-oss-20b", num_layers=24,
                                                                                  tokens_per_step=8192)
    files = {"a/unsloth/q.json": _doc("a", "peer-unsloth", "2026-01-01", **qwen),
             "a/unsloth/o.json": _doc("a", "peer-unsloth", "2026-01-01T01", **oss),
             "a/bench/cq.json": _doc("a", "combined", "2026-01-01", kernels="liger", **qwen),
             "a/bench/co.json": _doc("a", "combined", "2026-01-01", kernels="liger", **oss),
             "b/unsloth/q.json": _doc("b", "peer-unsloth", "2026-01-02", **qwen),
             "b/unsloth/o.json": _doc("b", "peer-unsloth", "2026-01-02T01", **oss),
             "b/bench/cq.json": _doc("b", "combined", "2026-01-02", kernels="liger", **qwen),
             "c/unsloth/x.json": _doc("c", "peer-unsloth", "2026-01-03", model="qwen3-0.6b", num_layers=2,
                                      tokens_per_step=512)}
    for rel, doc in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(json.dumps(doc))
    got = {peer[0]["config"]["model"]: ([results.run_of(d) for d in peer], [results.run_of(d) for d in ours])
           for peer, ours in results.peer_results(root=tmp_path)}
    assert got == {"qwen3-14b": (["b"], ["b"]), "gpt-oss-20b": (["a"], ["a"]), "qwen3-0.6b": (["c"], [])}
    assert [peer[0]["config"]["model"] for peer, _ in results.peer_results(root=tmp_path)] == [
        "qwen3-0.6b", "gpt-oss-20b", "qwen3-14b"]


def test_breakdowns_are_the_newest_per_configuration_across_runs(tmp_path):
    # run b re-profiles one configuration of run a: it replaces that one, and run a's other configuration stays
    cfg = lambda layers: dict(model="qwen3-14b", num_layers=layers, tokens_per_step=8192, kernels="liger")  # noqa: E731
    files = {"a/bd/x8.json": _doc("a", "breakdown", "2026-01-01", **cfg(8)),
             "a/bd/x40.json": _doc("a", "breakdown", "2026-01-01", **cfg(40)),
             "b/bd/x8.json": _doc("b", "breakdown", "2026-01-02", **cfg(8))}
    for rel, doc in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(json.dumps(doc))
    got = [(d["config"]["num_layers"], results.run_of(d)) for d in results.breakdown_results(root=tmp_path)]
    assert got == [(8, "b"), (40, "a")]


def test_newest_peak_gib_of_one_variant_and_a_missing_peak_is_none(tmp_path):
    run = tmp_path / "h200-2099-01-01"
    run.mkdir()
    doc = {"scenario": "offload", "env": {"device": "cuda", "date": "2099-01-01"}, "config": {"model": "m", "num_layers": 2},
           "variants": [{"name": "a", "peak_mem_bytes": 2 * 2**30}, {"name": "b", "peak_mem_bytes": 3 * 2**30},
                        {"name": "c"}]}
    (run / "x.json").write_text(json.dumps(doc))
    assert results.newest_peak_gib("offload", root=tmp_path, model="m")[0] == 3.0                  # largest variant
    assert results.newest_peak_gib("offload", root=tmp_path, variant="a", model="m")[0] == 2.0
    peak, found = results.newest_peak_gib("offload", root=tmp_path, variant="c", model="m")
    assert peak is None and found["config"]["model"] == "m"                                     # missing, not 0
    assert results.newest_peak_gib("offload", root=tmp_path, model="other") == (None, None)


def _packed(run, date, backend, names, tokens=8192, model="qwen3-14b"):
    return {"scenario": "packed_metadata", "env": {"device": "cuda", "date": date},
            "config": {"model": model, "num_layers": 8, "mix": "realistic", "backend": backend, "tokens_per_step": tokens},
            "variants": [{"name": n, "step_ms": {"median": 1.0}} if ok else {"name": n, "error": "boom"}
                         for n, ok in names]}


def test_packed_configs_keep_the_newest_word_and_the_headline_keeps_one_session(tmp_path):
    docs = {"old/a.json": _packed("old", "2099-01-01", "sdpa", [("sdpa naive", True), ("sdpa cached", True)]),
            "old/b.json": _packed("old", "2099-01-01", "flex", [("flex naive", True), ("flex cached", True)]),
            "new/a.json": _packed("new", "2099-01-02", "flex", [("flex naive", False), ("flex cached", True)]),
            "new/c.json": _packed("new", "2099-01-02", "sdpa", [("sdpa cached", True), ("sdpa cached (collated)", True)])}
    for path, doc in docs.items():
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text(json.dumps(doc))
    naive = results.packed_configs(root=tmp_path)
    assert [(results.run_of(d), d["config"]["backend"]) for d in naive] == [("new", "flex"), ("old", "sdpa")]
    assert [results.run_of(d) for d in results.packed_configs(root=tmp_path, collated=True)] == ["new"]
    head = results.packed_headline(backends=("sdpa", "flex"), root=tmp_path)    # only "old" ran naive on both
    assert [(results.run_of(d), d["config"]["backend"]) for d in head] == [("old", "sdpa"), ("old", "flex")]
    assert results.packed_headline(model="other", root=tmp_path) == []


def _frontier_doc(run, date, model="qwen3-14b", tokens=8192):
    gib = 2**30
    plan = lambda b, choices, ms, peak, pred: {  # noqa: E731
        "name": f"{b} GiB: {choices}", "step_ms": {"median": ms, "n": 5}, "peak_mem_bytes": peak * gib,
        "toggles": {"memory_budget_bytes": b * gib, "predicted_peak_bytes": pred * gib}}
    return {"scenario": "budget", "env": {"device": "cuda", "date": date, "gpu_name": "GPU"},
            "config": {"model": model, "num_layers": 40, "tokens_per_step": tokens, "quant": "nf4", "lora_rank": 16,
                       "autocast": "bf16", "floor": {"packed_attention": "varlen"}},
            "variants": [plan(15, "40 offload", 1700.0, 15, 15), plan(90, "40 keep", 1200.0, 88, 90),
                         {"name": "offload x2 + prefetch everywhere (README recipe)",
                          "step_ms": {"median": 1680.0, "n": 5}, "peak_mem_bytes": 15 * gib},
                         {"name": "no checkpointing", "error": "out of memory"}]}


def test_the_frontier_reads_the_newest_per_configuration_and_rates_each_plan_against_the_recipe(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    from fastsft_lab.lab import plots, report

    files = {"a/b/q.json": _frontier_doc("a", "2026-01-01"), "b/b/q.json": _frontier_doc("b", "2026-01-02"),
             "a/b/o.json": _frontier_doc("a", "2026-01-01", model="gpt-oss-20b")}
    for rel, doc in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(json.dumps(doc))
    docs = results.budget_results(root=tmp_path)
    assert [(d["config"]["model"], results.run_of(d)) for d in docs] == [("qwen3-14b", "b"), ("gpt-oss-20b", "a")]
    rows = {r["name"]: r for r in results.frontier_rows(docs[0])}
    assert rows["90 GiB: 40 keep"]["speed"] == 1680.0 / 1200.0          # against the recipe, higher is faster
    assert rows["90 GiB: 40 keep"]["predicted"] == 90 * 2**30 and rows["90 GiB: 40 keep"]["peak"] == 88 * 2**30
    assert rows["no checkpointing"]["ms"] is None and rows["no checkpointing"]["error"] == "out of memory"
    text = report.frontier_text(docs[0])
    assert "1.40x" in text and "did not run: out of memory" in text
    fig = plots.plot_frontier(docs)
    assert len(fig.axes) == 2
    # an MoE's experts are fused parameters that NF4 (every nn.Linear) leaves in the compute dtype: the words say so
    assert "NF4 + LoRA" in text and fig.axes[0].get_title().startswith("qwen3-14b NF4,")
    assert "NF4 (experts bf16) + LoRA r16" in report.frontier_text(docs[1])
    assert fig.axes[1].get_title().startswith("gpt-oss-20b NF4 (experts bf16),")
    assert results.weights_text({"model": "gpt-oss-20b", "quant": None}) == "bf16"
    assert [len(line.get_xdata()) for line in fig.axes[0].lines][0] == 2      # the two plans joined by one line


def test_a_run_at_one_budget_does_not_hide_the_frontier(tmp_path):
    """A later run at one asked-for budget (`--set budget.budgets=80`) is a point, not a frontier: both are read,
    each from its own run, the frontier first, and the point's header says what it is."""
    from fastsft_lab.lab import report

    point = _frontier_doc("c", "2026-01-03")
    point["variants"] = [v for v in point["variants"] if not v["name"].startswith("15 GiB")]
    for rel, doc in {"a/b/q.json": _frontier_doc("a", "2026-01-01"), "c/b/q.json": point}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(json.dumps(doc))
    docs = results.budget_results(root=tmp_path)
    assert [(results.run_of(d), results.plans_in(d)) for d in docs] == [("a", 2), ("c", 1)]
    assert "not a frontier" in report.frontier_text(docs[1]) and "not a frontier" not in report.frontier_text(docs[0])


def test_the_frontier_sets_the_solver_against_its_search_and_the_peer_at_its_memory(tmp_path):
    """The exhaustive search's plans are rows of their own (not on the frontier's line) and the solver's step is set
    against the fastest measured one; the Unsloth runs of the same session stand beside the plans, each compared
    with our fastest *solved* plan within its peak and within 2.5 times it (a faster searched plan does not count)."""
    import matplotlib
    matplotlib.use("Agg")
    from fastsft_lab.lab import plots, report

    gib = 2**30
    doc = _frontier_doc("a", "2026-01-01")
    doc["config"].update(num_layers=8, search=1)
    doc["variants"] = [
        {"name": "7 GiB: 8 offload", "step_ms": {"median": 300.0}, "peak_mem_bytes": 6.9 * gib,
         "toggles": {"memory_budget_bytes": 7 * gib, "predicted_peak_bytes": 7 * gib}},
        {"name": "17 GiB: 8 keep", "step_ms": {"median": 220.0}, "peak_mem_bytes": 16.0 * gib,
         "toggles": {"memory_budget_bytes": 17 * gib, "predicted_peak_bytes": 16.5 * gib}},
        {"name": "7 GiB search #1: 1 selective, 7 offload", "step_ms": {"median": 290.0}, "peak_mem_bytes": 6.95 * gib,
         "toggles": {"search_budget_bytes": 7 * gib, "predicted_peak_bytes": 7 * gib}},
        {"name": "offload x2 + prefetch everywhere (README recipe)", "step_ms": {"median": 310.0},
         "peak_mem_bytes": 6.8 * gib}]
    doc["derived"] = {"solver_vs_searched_7.00GiB": 300.0 / 290.0, "solver_vs_searched_17.00GiB": 1.0}
    peer = {"scenario": "peer-unsloth", "env": {"device": "cuda", "date": "2026-01-01"},
            "config": {"model": "qwen3-14b", "num_layers": 8, "tokens_per_step": 8192},
            "variants": [{"name": "unsloth (double buffer on)", "step_ms": {"median": 315.0},
                          "peak_mem_bytes": 7.0 * gib},
                         {"name": "unsloth (checkpointing off)", "step_ms": {"median": 250.0},
                          "peak_mem_bytes": 6.5 * gib}]}
    other = {**peer, "config": {**peer["config"], "num_layers": 40}}
    for rel, d in {"a/b/q.json": doc, "a/u/p.json": peer, "a/u/o.json": other, "z/u/p.json": peer}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(json.dumps(d))
    (doc,) = results.budget_results(root=tmp_path)
    peers = results.frontier_peers(doc, root=tmp_path)
    assert [results.run_of(p) for p in peers] == ["a"]             # same session and shape only
    rows = results.frontier_rows(doc, peers)
    assert [r["name"] for r in rows if r["peer"]] == ["Unsloth (double buffer on)", "Unsloth (checkpointing off)"]
    assert [r["searched"] for r in rows] == [None, None, 7 * gib, None, None, None]
    got = [(c["peer"]["name"], c["multiple"], c["plan"] and c["plan"]["name"], c["speed"])
           for c in results.frontier_vs_peers(rows)]
    assert got == [("Unsloth (double buffer on)", 1.0, "7 GiB: 8 offload", 315.0 / 300.0),
                   ("Unsloth (double buffer on)", 2.5, "17 GiB: 8 keep", 315.0 / 220.0),
                   ("Unsloth (checkpointing off)", 1.0, None, None),      # 6.5 GiB: no plan peaks that low
                   ("Unsloth (checkpointing off)", 2.5, "17 GiB: 8 keep", 250.0 / 220.0)]
    text = report.frontier_text(doc, root=tmp_path)
    assert "within 3.4% of the fastest measured plan" in text and "1.050x its speed" in text
    assert "no solved plan fits" in text
    fig = plots.plot_frontier([doc], root=tmp_path)
    labels = fig.axes[0].get_legend_handles_labels()[1]
    assert "Unsloth (checkpointing off)" in labels and any("exhaustive search" in x for x in labels)
    (line,) = [x for x in fig.axes[0].lines if x.get_label() == "memory plan, per budget"]
    assert len(line.get_xdata()) == 2                           # the frontier's line joins the two solved plans only


def _chain_doc(model, kernels, steps):
    """An attribution result: ``steps`` as (name, median ms, p20, p80) or (name, None) for a step that failed."""
    variants = [{"name": n, "step_ms": {"median": m, "p20": lo, "p80": hi, "n": 5}} if m else
                {"name": n, "error": "out of memory"} for n, m, lo, hi in [(*s, None, None)[:4] for s in steps]]
    return {"scenario": "attribution", "env": {"device": "cuda", "date": "2026-01-01", "gpu_name": "GPU"},
            "config": {"model": model, "num_layers": 4, "tokens_per_step": 8192, "kernels": kernels,
                       "chain": [s[0] for s in steps]},
            "variants": variants}


def test_the_attribution_table_gives_each_change_over_the_one_before_per_chain(tmp_path):
    from fastsft_lab.lab import report

    dense = _chain_doc("qwen3-14b", "none", [("stock transformers", 200.0, 199, 201),
                                             ("+ varlen kernel, metadata per layer", 100.0, 99, 101),
                                             ("+ metadata cached", 99.0, 98, 100.5),
                                             ("+ double buffer", 90.0, 89, 91)])
    moe = _chain_doc("gpt-oss-20b", "liger", [("stock transformers", 400.0, 399, 401),
                                              ("+ varlen kernel, metadata per layer", 200.0, 199, 201),
                                              ("+ experts grouped once", 500.0, 499, 501),
                                              ("+ sync-free experts", None),
                                              ("+ double buffer", 40.0, 39, 41)])
    for rel, doc in {"r/a/dense.json": dense, "r/a/moe.json": moe}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(json.dumps(doc))
    table = report.attribution_table(root=tmp_path)
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in table.splitlines()
            if line.startswith("| +") or line.startswith("| the whole")}
    # the longer chain gives the order, another chain's own step follows its predecessor there; a step a chain
    # lacks is blank; a failed step says so and the next one is not compared with it; an older run's "grouped once"
    # is no step of the chain: its next step is compared with the step before it
    assert list(rows)[:5] == ["+ varlen kernel, metadata per layer", "+ sync-free experts", "+ metadata cached",
                              "+ double buffer", "the whole chain over stock"]
    cells = {name: r[1:3] for name, r in rows.items()}                    # after "what it removes"
    assert cells["+ varlen kernel, metadata per layer"] == ["2.00x", "2.00x"]
    assert cells["+ metadata cached"] == ["1.01x~", ""]                   # the spreads overlap: "~"
    assert cells["+ sync-free experts"] == ["", "failed"]
    assert cells["+ double buffer"] == ["1.10x", ""]                       # not compared with a failed step
    assert rows["+ metadata cached"][0].startswith("host overhead")        # what it removes
    assert rows["the whole chain over stock"][0].strip("| ").startswith("**2.22x** (200 → 90 ms)")
    assert "+14.3% per batch" in " ".join(rows["+ metadata cached"])          # the published figure beside it


def test_plan_labels_close_in_memory_are_placed_apart():
    """Neighbouring plans a fraction of a GiB apart get labels that do not overlap (each moved to the first free spot
    around its point), so a frontier's chart stays readable where the plans crowd."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from fastsft_lab.lab import plots

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.set_xlim(6, 17)
    ax.set_ylim(0, 350)
    points = [(6.6, 306.0, "1 keep, 7 offload"), (7.9, 304.0, "2 keep, 1 selective, 5 offload"),
              (8.2, 300.0, "2 keep, 6 offload"), (11.2, 273.0, "4 keep, 4 selective")]
    plots._labels_apart(ax, points)
    renderer = fig.canvas.get_renderer()
    boxes = [t.get_window_extent(renderer) for t in ax.texts]
    assert [t.get_text() for t in ax.texts] == [p[2] for p in points]
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    plt.close(fig)
