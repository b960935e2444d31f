"""Execute notebooks in place with a real Jupyter kernel (nbclient), e.g. on the GPU machine.

Usage: python benchmarks/run_notebooks.py notebooks/00_*.ipynb ...   (SMOKE from the environment decides sizes)
Each notebook runs top to bottom in its own folder, its old outputs cleared first; a failing cell stops that notebook and
is reported (the cells after it stay empty).
"""
import os
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

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
    nbformat.write(nb, path)
sys.exit(status)
