"""Every committed notebook states its reading time at its top, the stamp is what its words and charts give, and no
notebook is over the budget (fastsft_lab.lab.reading); the notebooks' committed chains agree with the README's,
all read from the same JSON; the Colab install cell takes the package from where the learner says."""

from __future__ import annotations

import copy
import json
import os
import pathlib
import re
import subprocess
import sys
import types

import pytest

from fastsft_lab.lab import reading

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _nb(path):
    return json.loads(path.read_text())


def test_there_are_notebooks_to_time():
    assert len(NOTEBOOKS) >= 5, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_stamp_at_the_top_is_the_reading_time_and_within_the_budget(path):
    nb = _nb(path)
    minutes = reading.reading_minutes(nb)
    stamped = reading.stamped_minutes(nb)
    assert stamped is not None, f"{path.name}: no 'Reading time: N min' in its first markdown cell"
    assert abs(stamped - minutes) <= 1, (f"{path.name}: stamped {stamped} min, its words and charts give {minutes}: "
                                         f"`python benchmarks/run_notebooks.py --stamp {path.relative_to(ROOT)}`")
    assert minutes <= reading.BUDGET_MIN, f"{path.name}: {minutes} min to read, over the {reading.BUDGET_MIN}"


def test_the_measure_counts_words_at_200_a_minute_and_a_minute_a_chart():
    nb = {"cells": [{"cell_type": "markdown", "source": "# T\n\n" + reading.stamp_text(99) + "\n" + "w " * 198},
                    {"cell_type": "code", "source": "x = 1", "outputs": [
                        {"output_type": "stream", "text": ["a b\n", "c"]},
                        {"output_type": "display_data", "data": {"image/png": "...", "text/plain": "<Figure>"}},
                        {"output_type": "execute_result", "data": {"text/plain": "d e"}}]}]}
    parts = reading.reading_parts(nb)
    assert parts == {"prose": 200, "code": 3, "outputs": 5, "charts": 1}        # the stamp's own words not counted
    assert reading.reading_minutes(nb) == 3                                      # 208 words: 1.04 + 1 chart, up
    more = copy.deepcopy(nb)
    more["cells"][1]["outputs"][0]["text"].append(" word" * 2000)               # ten more minutes of output
    assert reading.reading_minutes(more) == 13
    assert reading.stamped_minutes(nb) == 99


def test_stamping_writes_the_minutes_once_after_the_title(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Title\n\nprose " * 3),
                                         nbformat.v4.new_code_cell("print(1)")])
    path = tmp_path / "00_x.ipynb"
    nbformat.write(nb, str(path))
    first = reading.stamp(path)
    again = reading.stamp(path)
    source = nbformat.read(str(path), as_version=4).cells[0].source
    assert first == again == reading.stamped_minutes(_nb(path))
    assert source.startswith("# Title\n\n**Reading time: ") and source.count("Reading time") == 1


# --- one chain per configuration: the README and the notebooks print the committed JSON's ---------------------------
def _chain_blocks(text: str) -> list[tuple[str, str, dict, dict]]:
    """Every chain that :func:`fastsft_lab.lab.report.attribution_text` printed in ``text``: (the configuration, where
    it comes from, {step: its speed over the step before as printed}, {step: what it removed, measured, as printed}:
    the lines under the table, or "not profiled" for every step where the legend says so)."""
    blocks, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if i + 1 < len(lines) and lines[i + 1].lstrip().startswith("step ") and "removes" in lines[i + 1]:
            config, _, where = line.partition(" | ")
            steps, labels, legend = {}, {}, False
            for row in lines[i + 2:]:
                if legend:                                  # the measured lines after the legend
                    if row.startswith("  measured"):
                        continue
                    if not row.startswith("    "):
                        break
                    labels[row[4:40].strip()] = row[41:]
                    continue
                if not row.startswith("  "):
                    break
                if row.startswith("  ~:"):
                    legend = True
                    if "measured: not profiled" in row:
                        labels = {name: "not profiled" for name in steps}
                    continue
                name, rest = row[2:38].strip(), row[38:].split()
                if len(rest) > 2 and rest[1].startswith("["):
                    steps[name] = rest[2]
            blocks.append((config, where, steps, labels))
    return blocks


def _outputs(path) -> str:
    return "\n".join("".join(o.get("text", "")) for c in _nb(path)["cells"] if c["cell_type"] == "code"
                     for o in c.get("outputs", []) if o.get("output_type") == "stream")


def chain_disagreements(docs, texts: dict[str, str], readme: str) -> list[str]:
    """Where a notebook output or the README's attribution table prints a chain of a committed configuration with
    other numbers than its committed JSON, or prints a live run of a configuration that is committed."""
    from fastsft_lab.lab import report

    want = {report.config_header(d).split(" | ")[0]: (d, report.chain_ratios(d)) for d in docs}
    bad = []
    for name, text in texts.items():
        for config, where, steps, printed_labels in _chain_blocks(text):
            if config not in want:
                continue                          # a configuration nothing committed (smoke mode, a smaller GPU)
            doc, ratios = want[config]
            if "this run" in where:
                bad.append(f"{name}: a live chain of {config}, which is committed ({report.R.run_of(doc)})")
                continue
            for step, printed in steps.items():
                if printed != "–" and ratios.get(step) != printed:
                    bad.append(f"{name}: {config}, {step}: {printed}, the committed JSON gives {ratios.get(step)}")
            labels = report.chain_labels(doc) if report.profiled(doc) else {s: "not profiled" for s in steps}
            for step, printed in printed_labels.items():
                if step in labels and labels[step] != printed:
                    bad.append(f"{name}: {config}, {step}: removes {printed!r}, the committed JSON gives "
                               f"{labels[step]!r}")
    block = re.search(r"<!-- results:attribution -->\n(.*?)<!-- /results:attribution -->", readme, re.S)
    table = block.group(1) if block else ""
    head = next((line for line in table.splitlines() if line.startswith("| step")), "")
    cols = [c.strip() for c in head.strip("|").split("|")][2:-1]
    floor = {"none": "stock kernels", "liger": "Liger floor"}
    for d in docs:
        col = f"{d['config']['model']} {report._depth(d['config'])}, {floor[d['config'].get('kernels', 'none')]}"
        if col not in cols:
            bad.append(f"README: no column for {col}")
            continue
        j = cols.index(col) + 2
        labels = report.chain_labels(d) if report.profiled(d) else {}
        for step, ratio in report.chain_ratios(d).items():
            row = next((line for line in table.splitlines() if line.startswith(f"| {step} |")), None)
            cell = [c.strip() for c in row.strip("|").split("|")][j] if row else None
            want_cell = f"{ratio}<br>{labels[step]}" if step in labels else ratio     # each bar's measured label
            if cell != want_cell:
                bad.append(f"README: {col}, {step}: {cell}, the committed JSON gives {want_cell}")
        if not labels and "not profiled" not in table:
            bad.append(f"README: {col} was not profiled and the table does not say so")
    return bad


def test_the_readme_and_the_notebooks_print_the_same_committed_chains():
    from fastsft_lab.lab import results

    docs = results.attribution_results()
    texts = {p.name: _outputs(p) for p in NOTEBOOKS}
    assert any(_chain_blocks(t) for t in texts.values()), "no notebook prints an attribution chain"
    assert chain_disagreements(docs, texts, (ROOT / "README.md").read_text()) == []


def test_a_chain_that_disagrees_with_the_json_is_caught():
    """Mutation check: a notebook output with one step's ratio changed, a live run of a committed configuration, and
    a README cell changed each fail."""
    from fastsft_lab.lab import report, results

    docs = results.attribution_results()
    doc = docs[0]
    text = report.attribution_text(doc)
    readme = (ROOT / "README.md").read_text()
    assert chain_disagreements([doc], {"nb": text}, readme) == []
    step, ratio = next(iter(report.chain_ratios(doc).items()))
    line = next(x for x in text.splitlines() if x[2:38].strip() == step)
    changed = text.replace(line, line.replace(ratio, "9.99x", 1))
    assert any("9.99x" in b for b in chain_disagreements([doc], {"nb": changed}, readme))
    live = text.replace(f" | {report.R.describe_run(doc)}", " | this run (cuda)")
    assert any("a live chain" in b for b in chain_disagreements([doc], {"nb": live}, readme))
    row = next(x for x in readme.splitlines() if x.startswith(f"| {step} |"))
    # the README cell reads "| 1.39x |" or, with its measured label, "| 1.39x<br>..."
    cell = f"| {ratio} |" if f"| {ratio} |" in row else f"| {ratio}<br>"
    assert cell in row
    assert chain_disagreements([doc], {}, readme.replace(row, row.replace(cell, cell.replace(ratio, "9.99x"), 1)))


# --- the Colab install cell ------------------------------------------------------------------------------------------
def _run_install_cell(monkeypatch, source: str | None) -> list[str]:
    sys.path.insert(0, str(ROOT / "notebooks" / "_src"))
    try:
        import build
    finally:
        sys.path.pop(0)
    calls = []
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: calls.append(args))
    monkeypatch.setenv("SMOKE", "1")
    if source is None:
        monkeypatch.delenv("FASTSFT_LAB_SOURCE", raising=False)
    else:
        monkeypatch.setenv("FASTSFT_LAB_SOURCE", source)
    exec(compile(build.COLAB_INSTALL, "colab cell", "exec"), {})
    assert len(calls) == 1
    return calls[0]


def test_the_install_cell_takes_the_package_from_where_the_learner_says(monkeypatch):
    assert "/content/fastsft_lab[lab,trl]" in _run_install_cell(monkeypatch, "/content/fastsft_lab")
    url = "git+https://example.org/me/fastsft_lab"
    assert f"fastsft_lab[lab,trl] @ {url}" in _run_install_cell(monkeypatch, url)
    assert "fastsft_lab[lab,trl] @ git+https://github.com/fastsft-lab/fastsft_lab" in _run_install_cell(monkeypatch, None)
    sys.path.insert(0, str(ROOT / "notebooks" / "_src"))
    try:
        import build
    finally:
        sys.path.pop(0)
    assert "NOT published" in build.COLAB_INSTALL and "FASTSFT_LAB_SOURCE" in build.COLAB_INSTALL
    assert os.environ.get("FASTSFT_LAB_SOURCE") is None or True
