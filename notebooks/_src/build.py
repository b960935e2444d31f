"""Build notebooks/*.ipynb from the cell lists in notebooks/_src/nbXX.py (keeps notebooks reviewable as code).

Usage: python notebooks/_src/build.py 00   -> writes notebooks/00_*.ipynb (no outputs; execute it afterwards)
Cells: a list of ("md"|"code", text). Existing outputs are dropped; run the notebook to produce them.
"""
import importlib.util
import pathlib
import sys

import nbformat

HERE = pathlib.Path(__file__).parent


def build(num: str) -> pathlib.Path:
    spec = importlib.util.spec_from_file_location(f"nb{num}", HERE / f"nb{num}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.metadata["accelerator"] = "GPU"
    for kind, text in mod.CELLS:
        text = text.strip("\n")
        nb.cells.append(nbformat.v4.new_markdown_cell(text) if kind == "md" else nbformat.v4.new_code_cell(text))
    path = HERE.parent / mod.FILENAME
    nbformat.write(nb, path)
    return path


if __name__ == "__main__":
    for num in sys.argv[1:]:
        print(build(num))
