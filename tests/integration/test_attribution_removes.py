"""What each step of the attribution chain removes, measured: one profiled warm step per step, after its timed ones
(same batch cycle, same autocast), its time by what bounds each kernel (compute / memory / latency) and idle; the
label of a step comes from the change against the step before -- the kind whose time fell most, never the largest
part -- its parts sum to the profiled step's change, a slower step says so, and a step without a profile says "not
profiled". The README table, the notebooks' chains and the charts read the same labels (test_notebook_reading.py
holds the committed outputs to the JSON)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastsft_lab.lab.removes import KINDS, PARTS, chain_removed, measured_lines, profile_text, removed

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _profile(compute=0.0, memory=0.0, latency=0.0, idle=0.0, unknown=0.0, launches=100.0, syncs=0) -> dict:
    """A row's profile as :func:`fastsft_lab.lab.harness.profile_variant` writes it: the parts sum to step_ms."""
    ms = {"compute": compute, "memory": memory, "latency": latency, "unknown": unknown, "idle": idle}
    return {"step_ms": sum(ms.values()), "ms": ms, "launches": launches, "syncs": syncs, "activity": "cuda",
            "peaks": "data sheet: H100 SXM", "idle_from": "the timed step"}


def _row(name, profile=None, ms=100.0):
    row = {"name": name, "step_ms": {"median": ms, "p20": ms - 1, "p80": ms + 1, "n": 5}}
    if profile is not None:
        row["profile"] = profile
    return row


# --- the label: from the deltas ---------------------------------------------------------------------------------------
def test_the_label_names_the_kind_that_fell_most_not_the_largest_part():
    # compute is by far the largest part and does not move; idle and latency-bound kernels fall: host overhead
    before = _profile(compute=500.0, memory=100.0, latency=20.0, idle=60.0)
    after = _profile(compute=500.0, memory=98.0, latency=8.0, idle=19.0)
    r = removed(before, after)
    assert r["kind"] == "host overhead"
    assert r["label"] == "host overhead: idle -41.0 ms, latency-bound kernels -12.0 ms"   # memory's -2 under 1%
    assert r["short"] == "host overhead -53.0 ms"
    # memory falls most while idle is the largest part of both steps: memory bandwidth
    r = removed(_profile(compute=50.0, memory=80.0, idle=400.0), _profile(compute=52.0, memory=20.0, idle=395.0))
    assert r["kind"] == "memory bandwidth" and r["label"].startswith("memory bandwidth: memory-bound kernels -60.0 ms")
    # a kind adds up its parts: latency -30 and idle -30 (host overhead -60) beat compute -50
    r = removed(_profile(compute=300.0, latency=100.0, idle=100.0), _profile(compute=250.0, latency=70.0, idle=70.0))
    assert r["kind"] == "host overhead" and r["kinds_ms"]["compute"] == -50.0


def test_a_step_that_got_slower_says_so_and_names_what_grew():
    r = removed(_profile(compute=100.0, memory=50.0, idle=10.0), _profile(compute=99.0, memory=70.0, idle=12.0))
    assert r["step_delta_ms"] == pytest.approx(21.0)
    assert r["label"] == "slower (+21.0 ms), more memory bandwidth: memory-bound kernels +20.0 ms, idle +2.0 ms"
    assert r["short"] == "slower: memory bandwidth +20.0 ms"


def test_a_step_that_moved_less_than_the_noise_is_about_even():
    r = removed(_profile(compute=100.0, idle=100.0), _profile(compute=90.0, idle=109.5))
    assert r["kind"] is None and r["short"] == "about even"
    assert r["label"] == "about even (-0.5 ms): compute-bound kernels -10.0 ms, idle +9.5 ms"
    # a step over the noise whose parts each moved under it: the one that moved most is named
    r = removed(_profile(compute=100.0, memory=50.0, idle=50.0), _profile(compute=101.5, memory=51.0, idle=50.0))
    assert r["label"] == "slower (+2.5 ms), more compute: compute-bound kernels +1.5 ms"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 5000, allow_nan=False), min_size=10, max_size=10))
def test_the_parts_changes_sum_to_the_profiled_step_change(values):
    before, after = (_profile(**dict(zip(PARTS, values[i:i + 5]))) for i in (0, 5))
    r = removed(before, after)
    assert sum(r["deltas_ms"].values()) == pytest.approx(after["step_ms"] - before["step_ms"], abs=1e-3)
    assert r["step_delta_ms"] == pytest.approx(after["step_ms"] - before["step_ms"], abs=1e-3)
    assert sum(r["kinds_ms"].values()) == pytest.approx(r["step_delta_ms"], abs=1e-3)
    assert sorted(p for parts in KINDS.values() for p in parts) == sorted(PARTS)   # every part in one kind


def test_each_step_is_compared_with_the_step_before_and_an_unprofiled_step_says_so():
    a, b, c = _profile(compute=100.0, idle=100.0), _profile(compute=100.0, idle=50.0), _profile(compute=60.0, idle=50.0)
    rows = [_row("stock", a), _row("+ one", b), _row("+ two", c), {"name": "+ three", "error": "out of memory"},
            _row("+ four", c), _row("+ five"), _row("+ six", c)]
    out = chain_removed(rows)
    assert list(out) == ["+ one", "+ two", "+ three", "+ four", "+ five", "+ six"]
    assert out["+ one"]["label"] == "host overhead: idle -50.0 ms"
    assert out["+ two"]["label"] == "compute: compute-bound kernels -40.0 ms"      # against "+ one", not stock
    assert out["+ three"]["label"] == "not profiled (the step failed)"
    assert out["+ four"]["label"] == "not profiled (the step before it failed)"
    assert out["+ five"]["label"].startswith("not profiled (a run before")
    assert out["+ six"]["label"].startswith("not profiled")                         # the step before has none
    assert all(r["kind"] is None for n, r in out.items() if n not in ("+ one", "+ two"))
    lines = measured_lines(rows)
    assert lines[1].split()[:2] == ["stock", "200.0"] and "50% idle" in lines[1]
    assert [line[4:40].strip() for line in lines[2:]] == list(out)
    assert measured_lines([_row("stock"), _row("+ one")]) == []          # nothing profiled: the caller says so
    assert profile_text(a).startswith("200.0 ms: compute 100.0 | memory 0.0 | latency 0.0 | idle 100.0 (50% idle)")


# --- the views: the README table, attribution_text, the chart, notebook 00's stock step --------------------------------
def _doc(profiled: bool) -> dict:
    chain = ["stock transformers", "+ varlen kernel, metadata per layer", "+ metadata cached"]
    profiles = [_profile(compute=800.0, memory=300.0, latency=200.0, idle=700.0, syncs=1),
                _profile(compute=500.0, memory=280.0, latency=220.0, idle=800.0, syncs=240),
                _profile(compute=500.0, memory=280.0, latency=190.0, idle=700.0, syncs=0)]
    rows = [_row(n, p if profiled else None, ms=p["step_ms"]) for n, p in zip(chain, profiles)]
    return {"scenario": "attribution", "env": {"device": "cuda", "date": "2027-01-01", "gpu_name": "GPU"},
            "_path": "h200-2027-01-01/a.json", "variants": rows,
            "config": {"chain": chain, "model": "qwen3-14b", "num_layers": 40, "tokens_per_step": 8192,
                       "kernels": "none", "autocast": "bf16"}}


def test_the_views_print_the_measured_labels_or_say_not_profiled(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    from fastsft_lab.lab import plots, report

    doc = _doc(True)
    labels = report.chain_labels(doc)
    assert labels == {"+ varlen kernel, metadata per layer": "compute: compute-bound kernels -300.0 ms, memory-bound "
                                                              "kernels -20.0 ms, latency-bound kernels +20.0 ms, "
                                                              "idle +100.0 ms",                  # falls first
                      "+ metadata cached": "host overhead: idle -100.0 ms, latency-bound kernels -30.0 ms"}
    text = report.attribution_text(doc)
    for name, label in labels.items():
        assert f"    {name:36s} {label}" in text.splitlines()
    stock = report.stock_step_text(doc)
    assert "2000.0 ms = 800.0 compute + 300.0 memory + 200.0 latency" in stock and "700.0 idle" in stock
    assert "idle: 35% of the step; idle + latency-bound kernels: 900.0 ms (45%)" in stock
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "a.json").write_text(json.dumps(doc))
    table = report.attribution_table(root=tmp_path)
    row = next(x for x in table.splitlines() if x.startswith("| + metadata cached |"))
    assert f"<br>{labels['+ metadata cached']} |" in row and "not profiled" not in table
    fig = plots.plot_waterfall(doc)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert any(t.endswith("host overhead\n-130.0 ms") for t in texts), texts
    # a run before the chain profiled its steps: no label invented anywhere
    old = _doc(False)
    assert set(report.chain_labels(old).values()) == {"not profiled (a run before the chain profiled its steps)"}
    assert "measured: not profiled" in report.attribution_text(old) and "host overhead:" not in \
        report.attribution_text(old)
    assert "not profiled" in report.stock_step_text(old)
    (tmp_path / "r" / "a.json").write_text(json.dumps(old))
    table = report.attribution_table(root=tmp_path)
    assert "<br>" not in table and "not profiled" in table
    fig = plots.plot_waterfall(old)
    assert "not profiled" in fig.axes[0].get_title()


def test_a_label_that_disagrees_with_the_json_is_caught():
    """Mutation check for the committed outputs' test: a notebook that prints another label than its JSON's, a
    README cell with another label, fail."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from test_notebook_reading import chain_disagreements
    finally:
        sys.path.pop(0)
    from fastsft_lab.lab import report

    doc = _doc(True)
    text = report.attribution_text(doc)
    readme = "<!-- results:attribution -->\n" + _table(doc) + "\n<!-- /results:attribution -->"
    assert chain_disagreements([doc], {"nb": text}, readme) == []
    label = report.chain_labels(doc)["+ metadata cached"]
    assert chain_disagreements([doc], {"nb": text.replace(label, "compute: compute-bound kernels -1.0 ms")}, readme)
    assert chain_disagreements([doc], {"nb": text}, readme.replace(label, "memory bandwidth: made up"))


def _table(doc: dict) -> str:
    import tempfile

    from fastsft_lab.lab import report

    with tempfile.TemporaryDirectory() as d:
        (pathlib.Path(d) / "r").mkdir()
        (pathlib.Path(d) / "r" / "a.json").write_text(json.dumps(doc))
        return report.attribution_table(root=d)


# --- the scenario: one profiled step per chain step, after the timed ones -----------------------------------------------
def test_the_smoke_chain_profiles_each_step_once_after_its_timed_steps(monkeypatch, capsys):
    import fastsft_lab.lab.harness as H
    import fastsft_lab.step_profile as SP
    from fastsft_lab.lab.scenarios import run_scenario

    calls: list[str] = []
    inside = [False]
    run_step, profile_step = H.run_step, SP.profile_step

    def counted_step(*args, **kwargs):
        calls.append("profiled" if inside[0] else "timed")
        return run_step(*args, **kwargs)

    def counted_profile(*args, **kwargs):
        inside[0] = True
        try:
            return profile_step(*args, **kwargs)
        finally:
            inside[0] = False

    monkeypatch.setattr(H, "run_step", counted_step)
    monkeypatch.setattr(SP, "profile_step", counted_profile)
    (doc,) = run_scenario("attribution", device="cpu", smoke=True, out_dir="/tmp/test_attribution_removes",
                          progress=False, models=["tiny-qwen3"], budget=None, steps=2, warmup=1)
    rows = doc["variants"]
    n = len(rows)
    # every timed step of every variant first, then one profiled step each (the profiler's cost in none of them)
    assert calls == ["timed"] * (3 * n) + ["profiled"] * n
    for r in rows:
        p = r["profile"]
        assert set(p["ms"]) == set(PARTS) and p["step_ms"] == pytest.approx(sum(p["ms"].values()))
        assert p["launches"] > 0 and p["syncs"] == r["host_syncs_per_step"] and p["activity"] == "cpu"
        assert p["ms"]["compute"] > 0 and p["ms"]["idle"] > 0
    # each row's "removed" is the change against the row before it, and the scenario printed its label
    printed = capsys.readouterr().out
    for prev, r in zip(rows, rows[1:]):
        assert r["removed"] == removed(prev["profile"], r["profile"])
        assert sum(r["removed"]["deltas_ms"].values()) == pytest.approx(
            r["profile"]["step_ms"] - prev["profile"]["step_ms"], abs=1e-3)
        assert f"    {r['name']:36s} {r['removed']['label']}" in printed.splitlines()


def test_the_profiled_step_runs_under_the_variants_autocast():
    from fastsft_lab.data import benchmark_batches
    from fastsft_lab.lab.harness import Variant, run_variants, with_autocast
    from fastsft_lab.models import LoraSettings, build_model

    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4), num_layers=1)
    batches = benchmark_batches(tokens_per_step=128, row_tokens=128, steps=2, vocab_size=model.config.vocab_size,
                                mix="short")
    seen: list[bool] = []

    def inputs(batch, state):
        seen.append(torch.is_autocast_enabled("cpu"))
        return batch.model_inputs()

    (row,) = run_variants(model, batches, with_autocast([Variant("stock", inputs=inputs)], "bf16"), steps=1,
                          warmup=0, progress=False, check_equal=False, count_syncs=False, profile=True)
    assert seen == [True, True] and row["profile"]["syncs"] is None     # the timed step, then the profiled one
    assert row["profile"]["step_ms"] == pytest.approx(sum(row["profile"]["ms"].values()))


# --- on a GPU: kineto's device activity, idle re-based on the timed step ----------------------------------------------
@pytest.mark.cuda
def test_on_a_gpu_each_step_is_profiled_kernel_by_kernel_and_idle_is_rebased_on_the_timed_step():
    import time

    from fastsft_lab.lab.scenarios import run_scenario

    t = time.time()
    (doc,) = run_scenario("attribution", device="cuda", smoke=True, out_dir="/tmp/test_attribution_removes_cuda",
                          progress=False, models=["tiny-gpt-oss"], kernels=["none"], autocast="bf16", budget=None,
                          steps=2, warmup=1)
    for r in doc["variants"]:
        p = r["profile"]
        assert p["activity"] == "cuda" and p["idle_from"].startswith("the timed step"), p
        busy = sum(v for k, v in p["ms"].items() if k != "idle")
        assert busy > 0 and p["launches"] > 10
        # idle = the timed step - busy: the parts sum to the timed median (unless the kernels alone exceed it)
        assert p["step_ms"] == pytest.approx(max(r["step_ms"]["median"], busy), rel=1e-3, abs=1e-3)
        assert p["ms"]["unknown"] <= 0.5 * busy                 # kernels placed by their launching op and classified
        assert p["seconds"] < 30
    assert all("label" in r["removed"] and "not profiled" not in r["removed"]["label"] for r in doc["variants"][1:])
    assert time.time() - t < 600
