"""Every notebook keeps the series' outline (what you will learn, prerequisites, the problem, the measured before and
after, what it costs, a summary), a budget of code cells, and outputs a reader can read: no raw flags, no JSON."""

from __future__ import annotations

import json
import pathlib
import re

import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[2] / "notebooks").glob("0*.ipynb"))
CODE_CELL_BUDGET = 12          # the Colab cell included
# Notebooks not yet cut to the budget (their outline holds): each comes off this list when reworked.
OVER_BUDGET: set[str] = set()
RAW_FLAG = re.compile(r"\b[a-z0-9]+(?:_[a-z0-9]+){2,}: (?:True|False)\b")      # target_1p5x_vs_save_on_cpu: True
RAW_JSON = re.compile(r'^\s*[\[{]"', re.M)                                    # {"key": ...} printed as is


def _cells(path):
    return json.loads(path.read_text())["cells"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_has_the_outline(path):
    cells = _cells(path)
    md = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    first = "".join(cells[0]["source"])
    for part in ("**What you will learn**", "**Prerequisites", "**The problem", "glossary"):
        assert part in first, f"{path.name}: the first cell has no {part!r}"
    heads = [line for line in md.splitlines() if line.startswith("## ")]
    assert any("What it costs" in h for h in heads), f"{path.name}: no 'What it costs' section"
    assert any(h.startswith("## Summary") for h in heads), f"{path.name}: no summary"
    assert any(w in " ".join(heads) for w in ("measured", "Before", "naive path")), f"{path.name}: no measured before"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_outputs_print_no_raw_flags_or_json(path):
    text = "".join("".join(o.get("text", "")) for c in _cells(path) if c["cell_type"] == "code"
                   for o in c.get("outputs", []))
    assert not RAW_FLAG.findall(text), f"{path.name}: raw flags printed: {RAW_FLAG.findall(text)[:3]}"
    assert not RAW_JSON.findall(text), f"{path.name}: JSON printed as is"


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.xfail(
    p.name in OVER_BUDGET, strict=True, reason="not yet cut to the code-cell budget")) for p in NOTEBOOKS],
    ids=lambda p: p.stem)
def test_code_cell_budget(path):
    n = sum(1 for c in _cells(path) if c["cell_type"] == "code")
    assert n <= CODE_CELL_BUDGET, f"{path.name}: {n} code cells (budget {CODE_CELL_BUDGET})"


ENV_LINE = re.compile(r"^(?:GPU (?P<gpu>.+?)|CPU.*?) \| torch (?P<torch>\S+) \|.*\| smoke=(?P<smoke>True|False) \| "
                      r"(?P<date>\d{4}-\d\d-\d\d)", re.M)


def stated_origin_mismatch(cells) -> str | None:
    """Where the first cell's "The outputs below" says the outputs come from, against the environment line the run
    itself printed (``describe()``: device, torch, smoke, date); None when they agree."""
    first = "".join(cells[0]["source"])
    said = first[first.find("**The outputs below**"):].split("\n\n")[0]
    if not said:
        return "the first cell does not say where the outputs come from (**The outputs below** ...)"
    printed = "".join("".join(o.get("text", "")) for c in cells if c["cell_type"] == "code" for o in c.get("outputs", []))
    m = ENV_LINE.search(printed)
    if not m:
        return "no environment line (describe()) in the outputs"
    if m["smoke"] == "True" and "smoke mode" not in said:
        return f"the outputs are a smoke run ({m['date']}) but the first cell says: {said[:120]!r}"
    if m["smoke"] == "False" and not (m["gpu"] and m["gpu"].removeprefix("NVIDIA ") in said and "SMOKE=0" in said):
        return f"the outputs are a {m['gpu']} run with SMOKE=0 ({m['date']}) but the first cell says: {said[:120]!r}"
    if m["date"] not in said:
        return f"the run's date {m['date']} is not in the first cell's statement: {said[:120]!r}"
    return None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_first_cell_says_where_the_outputs_come_from(path):
    assert stated_origin_mismatch(_cells(path)) is None, f"{path.name}: {stated_origin_mismatch(_cells(path))}"


def test_a_stale_origin_statement_is_caught():
    """Mutation check: a GPU run's outputs under a first cell that still says smoke mode, and the reverse."""
    gpu = [{"cell_type": "markdown", "source": "**The outputs below** come from a CPU run in smoke mode (2026-01-01)."},
           {"cell_type": "code", "source": "", "outputs": [
               {"output_type": "stream", "text": "GPU NVIDIA H200 | torch 2.11 | x | smoke=False | 2026-01-01T00:00Z\n"}]}]
    assert "SMOKE=0" in stated_origin_mismatch(gpu)
    gpu[0]["source"] = "**The outputs below** come from one run on an NVIDIA H200 (`SMOKE=0`, 2026-01-01)."
    assert stated_origin_mismatch(gpu) is None
    gpu[1]["outputs"][0]["text"] = "CPU (2 cores) | torch 2.13 | x | smoke=True | 2026-01-01T00:00Z\n"
    assert "smoke run" in stated_origin_mismatch(gpu)
