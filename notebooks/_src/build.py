"""Build notebooks/*.ipynb from the cell lists in notebooks/_src/nbXX.py (keeps notebooks reviewable as code).

Usage: python notebooks/_src/build.py 00   -> writes notebooks/00_*.ipynb (no outputs; execute it afterwards)
Cells: a list of ("md"|"code", text), or ("colab", "") for the install cell every notebook opens with.
Existing outputs are dropped; run the notebook to produce them.
"""
import importlib.util
import pathlib
import sys

import nbformat

HERE = pathlib.Path(__file__).parent

# Every notebook must run on its own in Colab, so each carries this cell (it cannot live in the library it installs).
COLAB_INSTALL = """
# Colab: install the library (elsewhere: `make setup` or `pip install -e .` from a clone)
import sys
if "google.colab" in sys.modules:
    import subprocess
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "git+https://github.com/fastsft-lab/fastsft_lab"], check=True)
"""


def cells(mod) -> list[tuple[str, str]]:
    """The notebook's cells as (kind, source), the shared ones expanded."""
    return [("code", COLAB_INSTALL.strip("\n")) if kind == "colab" else (kind, text.strip("\n"))
            for kind, text in mod.CELLS]


def build(num: str) -> pathlib.Path:
    spec = importlib.util.spec_from_file_location(f"nb{num}", HERE / f"nb{num}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    nb.metadata["accelerator"] = "GPU"
    for kind, text in cells(mod):
        nb.cells.append(nbformat.v4.new_markdown_cell(text) if kind == "md" else nbformat.v4.new_code_cell(text))
    path = HERE.parent / mod.FILENAME
    nbformat.write(nb, path)
    return path


if __name__ == "__main__":
    for num in sys.argv[1:]:
        print(build(num))
