"""Execute notebooks in place with a real Jupyter kernel (nbclient), e.g. on the GPU machine.

Usage: python benchmarks/run_notebooks.py notebooks/00_*.ipynb ...   (SMOKE from the environment decides sizes)
Each notebook runs top to bottom in its own folder, its old outputs cleared first; a failing cell stops that notebook and
is reported (the cells after it stay empty). Then its reading time is stamped into its first cell
(:mod:`fastsft_lab.lab.reading`); ``--stamp NOTEBOOK...`` stamps committed notebooks without running them.

``--redraw N[,M...] NOTEBOOK``: re-runs only cells N, M (0-based cell indices) after the notebook's setup cell (its
first code cell that imports fastsft_lab), in smoke mode, and replaces only their outputs -- for cells that read
committed results alone (their source must say "committed"), after a run that changed those results. The notebook's
first markdown cell should say which cells were redrawn.
"""
import os
import re
import sys
import time

import nbformat
from nbclient import NotebookClient

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # this clone's fastsft_lab
from fastsft_lab.lab.reading import BUDGET_MIN, stamp  # noqa: E402
from nbclient.exceptions import CellExecutionError


def redraw(path: str, indices: list[int]) -> int:
    nb = nbformat.read(path, as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    for i in indices:
        if i not in code or "committed" not in nb.cells[i].source:
            print(f"[FAIL] {path}: cell {i} is not a code cell that reads committed results (code cells: {code})")
            return 1
    setup = next(i for i in code if "from fastsft_lab" in nb.cells[i].source)
    scratch = nbformat.v4.new_notebook(metadata=nb.metadata,
                                       cells=[nbformat.v4.new_code_cell(nb.cells[j].source) for j in [setup, *indices]])
    os.environ["SMOKE"] = "1"      # the setup cell must not pick a GPU workload
    client = NotebookClient(scratch, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}})
    try:
        client.execute()
    except CellExecutionError as e:
        print(f"[FAIL] {path}: {str(e)[:3000]}")
        return 1
    for i, cell in zip(indices, scratch.cells[1:]):
        nb.cells[i].outputs = cell.outputs
    nbformat.write(nb, path)
    print(f"[ok] {path}: redrew cells {indices}; {_stamp(path)}")
    return 0


# the environment line every notebook prints (fastsft_lab.env.describe()) and the first cell's origin paragraph
_ENV_LINE = re.compile(r"^GPU (?P<gpu>.+?) \| torch (?P<torch>\S+) \| transformers (?P<tf>\S+) \|.*\| smoke=False \| "
                       r"(?P<date>\d{4}-\d\d-\d\d)", re.M)
_ORIGIN = re.compile(r"\*\*The outputs below\*\*.*?(?=\n\n|$)", re.S)


def state_origin(nb) -> str | None:
    """After a GPU run (``SMOKE=0``), the first cell's "**The outputs below** ..." paragraph says so: the card, the
    versions and the date its environment line printed, and the run (``$RUN``). Returns the new paragraph, or None
    where the run was a smoke run (the paragraph the source carries stays)."""
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                      if isinstance(o.get("text", ""), str))
    m = _ENV_LINE.search(printed)
    if not m or not nb.cells or nb.cells[0].cell_type != "markdown" or not _ORIGIN.search(nb.cells[0].source):
        return None
    run = f", run `{os.environ['RUN']}`" if os.environ.get("RUN") else ""
    said = (f"**The outputs below** come from one run on an {m['gpu']} (`SMOKE=0`, torch {m['torch']}, transformers "
            f"{m['tf']}{run}, {m['date']}): every cell executed there, top to bottom. CI re-runs every cell in smoke "
            "mode (nbval, lax: the outputs are not compared).")
    nb.cells[0].source = _ORIGIN.sub(lambda _: said, nb.cells[0].source, count=1)
    return said


def _stamp(path: str) -> str:
    minutes = stamp(path)
    return f"reading time {minutes} min" + (f" (over the {BUDGET_MIN}-minute budget)" if minutes > BUDGET_MIN else "")


if len(sys.argv) == 4 and sys.argv[1] == "--redraw":
    sys.exit(redraw(sys.argv[3], [int(i) for i in sys.argv[2].split(",")]))
if len(sys.argv) > 1 and sys.argv[1] == "--stamp":
    for path in sys.argv[2:]:
        print(f"{path}: {_stamp(path)}")
    sys.exit(0)

status = 0
for path in sys.argv[1:]:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:       # a cell the run does not reach must not keep an earlier run's outputs
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    t = time.time()
    client = NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": os.path.dirname(os.path.abspath(path))}})
    try:
        client.execute()
        print(f"[ok] {path} in {time.time() - t:.0f}s", flush=True)
    except CellExecutionError as e:
        status = 1
        print(f"[FAIL] {path} after {time.time() - t:.0f}s: {str(e)[:3000]}", flush=True)
    origin = state_origin(nb)
    nbformat.write(nb, path)
    print(f"     {path}: {_stamp(path)}" + (f"; first cell: {origin}" if origin else ""), flush=True)
sys.exit(status)
