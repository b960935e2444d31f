"""The committed notebooks carry exactly the cells of their sources in notebooks/_src (outputs aside).

Outputs come from a real run, so a notebook is edited in two places when only its text changes: this keeps the
reviewable source and the executed notebook from drifting apart.
"""
from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

nbformat = pytest.importorskip("nbformat")  # the GPU machine runs `pytest -m cuda` without Jupyter

SRC = pathlib.Path(__file__).resolve().parents[2] / "notebooks" / "_src"


def _unstamped(source: str) -> str:
    """A cell's source with its reading-time stamp's minutes and its origin paragraph ("**The outputs below** ...")
    blanked: both are stamped after a run (the stamp counts the outputs; benchmarks/run_notebooks.py states a GPU
    run's origin from its environment line, which test_notebook_outline.py checks), not written in the source."""
    from fastsft_lab.lab.reading import STAMP

    return re.sub(r"\*\*The outputs below\*\*.*?(?=\n\n|$)", "**The outputs below** ...",
                  STAMP.sub("**Reading time: ? min**", source), flags=re.S)


def _load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("source", sorted(SRC.glob("nb*.py")), ids=lambda p: p.stem)
def test_notebook_cells_equal_their_source(source):
    build = _load(SRC / "build.py")
    mod = _load(source)
    nb = nbformat.read(SRC.parent / mod.FILENAME, as_version=4)
    want = build.cells(mod)
    want = [(kind, _unstamped(text)) for kind, text in want]
    got = [("md" if c.cell_type == "markdown" else c.cell_type, _unstamped(c.source)) for c in nb.cells]
    assert len(got) == len(want), f"{mod.FILENAME}: {len(got)} cells, its source has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"{mod.FILENAME} cell {i} differs from notebooks/_src/{source.name}"
