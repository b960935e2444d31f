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
# Colab: Runtime > Change runtime type > a GPU. T4 (16 GB): float16, sdpa/eager attention, the smaller sizes;
# L4 (24 GB): bfloat16, varlen/flex attention; A100 (40/80 GB): real widths. The parameters cell says what it picked.
# Elsewhere: `make setup`, or `pip install -e ".[lab,trl]"` from a clone.
import os, sys
if "google.colab" in sys.modules:
    import subprocess
    import torch
    if not torch.cuda.is_available() and os.environ.get("SMOKE", "") != "1":
        raise SystemExit("This Colab runtime has no GPU: Runtime > Change runtime type > T4, L4 or A100 GPU; "
                         "or set os.environ['SMOKE'] = '1' to run the tiny models on the CPU.")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",   # Colab's own torch stays; the rest as tested
                    "fastsft_lab[lab,trl] @ git+https://github.com/fastsft-lab/fastsft_lab",
                    "transformers==5.17.0", "peft==0.21.2", "accelerate==1.16.0", "bitsandbytes==0.50.2",
                    "trl==1.16.0", "datasets==5.2.0"], check=True)
"""


# Every term the series uses is defined once, in the glossary every notebook's first cell links to.
GLOSSARY = ("Terms (host sync, pinned memory, streams, MFU, p20–p80, HBM floor, sinks, ...): "
            "[the glossary](https://github.com/fastsft-lab/fastsft_lab/blob/main/docs/glossary.md).")


def cells(mod) -> list[tuple[str, str]]:
    """The notebook's cells as (kind, source), the shared ones expanded and the glossary linked from the first."""
    out = [("code", COLAB_INSTALL.strip("\n")) if kind == "colab" else (kind, text.strip("\n"))
           for kind, text in mod.CELLS]
    if out and out[0][0] == "md":
        where = getattr(mod, "OUTPUTS", None)      # where the committed outputs come from, in the first cell
        out[0] = ("md", out[0][1] + ("\n\n" + where.strip() if where else "") + "\n\n" + GLOSSARY)
    return out


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
