"""How long a notebook takes to read, outputs included, and the stamp that says so at its top.

The measure: every word of its prose (markdown), its code and its text outputs at 200 words a minute, plus a minute
for every chart (an image output), rounded up. A notebook's first markdown cell carries it as ``Reading time: N min``
(:func:`stamp`), written after each execution (``benchmarks/run_notebooks.py``; ``--stamp`` for committed notebooks);
a test recomputes it for every committed notebook and holds each to :data:`BUDGET_MIN`.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

__all__ = ["WORDS_PER_MIN", "BUDGET_MIN", "STAMP", "reading_minutes", "reading_parts", "stamped_minutes", "stamp",
           "stamp_text", "stamp_source"]

WORDS_PER_MIN = 200
BUDGET_MIN = 40                    # the series' budget per notebook, outputs included
STAMP = re.compile(r"\*\*Reading time: (\d+) min\*\*")
_STAMP_LINE = re.compile(r"\*\*Reading time: [0-9?]+ min\*\*[^\n]*")     # the whole line, its note included


def _text(value) -> str:
    return "".join(value) if isinstance(value, list) else str(value or "")


def _words(text: str) -> int:
    return len(text.split())


def reading_parts(nb: dict) -> dict:
    """Words of prose, code and text outputs, and the number of charts (image outputs), of a notebook (nbformat 4
    as a dict)."""
    parts = {"prose": 0, "code": 0, "outputs": 0, "charts": 0}
    for cell in nb.get("cells", []):
        source = _text(cell.get("source"))
        if cell.get("cell_type") == "markdown":
            parts["prose"] += _words(_STAMP_LINE.sub("", source))
            continue
        if cell.get("cell_type") != "code":
            continue
        parts["code"] += _words(source)
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if any(k.startswith("image/") for k in data):
                parts["charts"] += 1
            elif out.get("output_type") == "stream":
                parts["outputs"] += _words(_text(out.get("text")))
            elif "text/plain" in data:
                parts["outputs"] += _words(_text(data["text/plain"]))
            elif out.get("output_type") == "error":
                parts["outputs"] += _words(" ".join(out.get("traceback", [])))
    return parts


def reading_minutes(nb: dict | str | pathlib.Path) -> int:
    """Minutes to read ``nb`` (a notebook dict or a path): words / 200 + one per chart, rounded up."""
    if not isinstance(nb, dict):
        nb = json.loads(pathlib.Path(nb).read_text())
    p = reading_parts(nb)
    return math.ceil((p["prose"] + p["code"] + p["outputs"]) / WORDS_PER_MIN + p["charts"])


def stamp_text(minutes: int | None) -> str:
    """The line the first cell carries (``None``: not executed yet)."""
    n = "?" if minutes is None else str(minutes)
    return (f"**Reading time: {n} min** (prose, code and outputs at {WORDS_PER_MIN} words a minute, plus a minute a "
            "chart)")


def stamped_minutes(nb: dict) -> int | None:
    """The minutes the first markdown cell says, None where it says none."""
    first = next((c for c in nb.get("cells", []) if c.get("cell_type") == "markdown"), None)
    m = STAMP.search(_text(first.get("source"))) if first else None
    return int(m.group(1)) if m else None


def stamp_source(source: str, minutes: int | None) -> str:
    """``source`` (a first cell's markdown) with its stamp set to ``minutes``: the stamp there replaced, or a new one
    after its title line."""
    line = stamp_text(minutes)
    if _STAMP_LINE.search(source):
        return _STAMP_LINE.sub(line, source, count=1)
    head, _, rest = source.partition("\n")
    return f"{head}\n\n{line}\n{rest}"


def stamp(path: str | pathlib.Path) -> int:
    """Write ``path``'s reading time into its first markdown cell (replacing the stamp there, or after its title
    line); returns the minutes."""
    import nbformat

    nb = nbformat.read(str(path), as_version=4)
    minutes = reading_minutes(json.loads(nbformat.writes(nb)))
    first = next(c for c in nb.cells if c.cell_type == "markdown")
    first.source = stamp_source(first.source, minutes)
    nbformat.write(nb, str(path))
    return minutes
