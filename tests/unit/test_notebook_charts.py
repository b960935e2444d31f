"""Every chart a committed notebook draws is visible in its committed outputs.

The rule, per code cell of each committed ``notebooks/0*.ipynb``: a cell *draws a chart* when its source (parsed as
Python, so comments and strings never count) calls at least one of

* ``plt.subplots(...)`` or ``plt.figure(...)`` (a figure made in the notebook itself);
* a chart function of :mod:`fastsft_lab.lab.plots` -- any name in its ``__all__`` that starts with ``plot_`` --
  called bare (``plot_result(...)``) or as an attribute (``plots.plot_result(...)``);
* ``display(...)`` with a first argument whose name starts with ``fig`` (the notebooks' convention for a figure).

Such a cell must carry at least one ``image/png`` output, unless its output says that the data it would draw has
not been committed yet (a line starting with ``No committed``: a results cell before the GPU run it reads). The notebooks show each figure with
``IPython.display.display(fig)`` (after ``select_figure_formats(get_ipython(), {"png"})``, so that it embeds a PNG
under any matplotlib backend, Agg included) and then close it; a chart left to ``plt.show()`` comes back as a
``<Figure ...>`` text under Agg, which this test catches. A cell that cannot be parsed (an IPython magic) falls back
to a plain-text search for the same call names.
"""

from __future__ import annotations

import ast
import copy
import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")  # the GPU machine runs `pytest -m cuda` without Jupyter

from fastsft_lab.lab import plots

NOTEBOOKS = sorted((pathlib.Path(__file__).resolve().parents[2] / "notebooks").glob("0*.ipynb"))
CHART_FUNCTIONS = frozenset(n for n in plots.__all__ if n.startswith("plot_"))
PYPLOT_MAKERS = frozenset({"subplots", "figure"})


def _call_name(func: ast.expr) -> tuple[str | None, str | None]:
    """(owner, name) of a call's function: ``plt.subplots`` -> ("plt", "subplots"), ``display`` -> (None, "display")."""
    if isinstance(func, ast.Name):
        return None, func.id
    if isinstance(func, ast.Attribute):
        owner = func.value.id if isinstance(func.value, ast.Name) else None
        return owner, func.attr
    return None, None


def draws_chart(source: str) -> bool:
    """Whether a code cell's source draws a chart (the rule of the module docstring)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        names = "|".join(sorted(CHART_FUNCTIONS))
        return bool(re.search(rf"\bplt\.(subplots|figure)\(|\b({names})\(|\bdisplay\(\s*fig", source))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        owner, name = _call_name(node.func)
        if owner == "plt" and name in PYPLOT_MAKERS:
            return True
        if name in CHART_FUNCTIONS:
            return True
        if name == "display" and node.args:
            first = node.args[0]
            label = first.id if isinstance(first, ast.Name) else first.attr if isinstance(first, ast.Attribute) else ""
            if label.startswith("fig"):
                return True
    return False


def has_image(cell) -> bool:
    return any("image/png" in out.get("data", {}) for out in cell.get("outputs", []))


def says_no_data(cell) -> bool:
    return any(line.startswith("No committed") for out in cell.get("outputs", []) if out.get("output_type") == "stream"
               for line in out.get("text", "").splitlines())


def missing_charts(nb) -> list[int]:
    """Indices of the code cells that draw a chart but carry no image/png output (and do not say why)."""
    return [i for i, cell in enumerate(nb.cells)
            if cell.cell_type == "code" and draws_chart(cell.source) and not has_image(cell) and not says_no_data(cell)]


def chart_cells(nb) -> list[int]:
    return [i for i, cell in enumerate(nb.cells) if cell.cell_type == "code" and draws_chart(cell.source)]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 4, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_chart_cell_has_an_image(path):
    nb = nbformat.read(path, as_version=4)
    assert chart_cells(nb), f"{path.name}: no cell draws a chart (the rule found nothing: is it still right?)"
    missing = missing_charts(nb)
    assert not missing, (f"{path.name}: code cells {missing} draw a chart but carry no image/png output "
                         f"(show each figure with display(fig), then plt.close(fig), and re-execute the notebook)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_removing_an_image_output_is_caught(path):
    """Mutation check: a copy of the notebook with the image outputs of one chart cell deleted fails the rule."""
    nb = copy.deepcopy(nbformat.read(path, as_version=4))
    drawn = [i for i in chart_cells(nb) if has_image(nb.cells[i])]
    assert drawn, f"{path.name}: no chart cell with an image output to delete"
    cell = nb.cells[drawn[0]]
    cell.outputs = [out for out in cell.outputs if "image/png" not in out.get("data", {})]
    assert missing_charts(nb) == [drawn[0]]


@pytest.mark.parametrize("source, expected", [
    ("fig, ax = plt.subplots()\nax.plot([1])\ndisplay(fig); plt.close(fig)", True),
    ("fig = plots.plot_result(result)\ndisplay(fig)", True),
    ("plot_regime(points)", True),
    ("display(fig)", True),
    ("print('plt.subplots(')  # plots.plot_result(", False),
    ("display(Markdown('x'))\nprint(results.describe_run(doc))", False),
    ("%matplotlib inline\nfig, ax = plt.subplots()", True),
])
def test_the_rule(source, expected):
    assert draws_chart(source) is expected


def test_expert_grouping_draws_every_sorted_row_and_marks_an_empty_expert():
    import matplotlib
    matplotlib.use("Agg")
    ids = [[0, 3], [1, 0], [3, 1]]
    fig = plots.plot_expert_grouping(ids, [0, 0, 1, 1, 3, 3], [0, 3, 2, 5, 1, 4], [2, 4, 4, 6])
    left, right = fig.axes
    assert len(left.patches) == 6 and len(right.patches) == 6            # one box per (token, slot), per sorted row
    texts = [t.get_text() for t in right.texts]
    assert [t for t in texts if t.startswith("t")] == ["t0", "t1", "t1", "t2", "t0", "t2"]   # perm // top_k
    assert "offs[2]=4 (E2 empty)" in texts and "offs[1]=4" in texts
    assert "E2" in right.get_xlabel()
    matplotlib.pyplot.close(fig)


def test_waterfall_and_loss_curve_titles_name_depth_kernels_and_autocast():
    import matplotlib
    matplotlib.use("Agg")
    doc = {"env": {"gpu_name": "GPU", "date": "2099-01-01"},
           "config": {"model": "m", "num_layers": 4, "tokens_per_step": 8192, "kernels": "liger", "autocast": "bf16",
                      "preset": "m", "dtype": "bfloat16"},
           "variants": [{"name": "transformers default", "step_ms": {"median": 200.0}},
                        {"name": "all naive", "step_ms": {"median": 150.0}},
                        {"name": "all fast", "step_ms": {"median": 100.0}}],
           "losses": {"all naive": [3.0, 2.0, 1.0], "all fast": [3.0, 2.0, 1.0]}}
    fig = plots.plot_waterfall(doc)
    title = fig.axes[0].get_title()
    assert "x4 layers" in title and "kernels liger" in title and "autocast bf16" in title
    matplotlib.pyplot.close(fig)
    fig = plots.plot_loss_curves(doc)
    title = fig.axes[0].get_title()
    assert title.startswith("3 steps") and "x4 layers" in title and "autocast none" in title
    assert len(fig.axes[0].lines) == 2
    matplotlib.pyplot.close(fig)


def test_peer_chart_draws_a_missing_peak_as_missing_not_zero():
    import math

    import matplotlib
    matplotlib.use("Agg")
    peer = {"env": {"gpu_name": "GPU"}, "config": {"model": "m", "num_layers": 8},
            "variants": [{"name": "unsloth", "step_ms": {"median": 300.0}, "peak_mem_bytes": 2**31},
                         {"name": "unsloth x1", "step_ms": {"median": 310.0}}]}
    fig = plots.plot_peer([([peer], [])])
    memory = fig.axes[1]
    widths = [p.get_width() for p in memory.patches]
    assert widths[0] == 2.0 and math.isnan(widths[1])
    assert any("not recorded" in t.get_text() for t in memory.texts)
    matplotlib.pyplot.close(fig)
