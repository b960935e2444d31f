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
sys.path.insert(0, str(HERE.parents[1]))        # this clone's fastsft_lab
from fastsft_lab.lab.reading import stamp, stamp_source  # noqa: E402

# Every notebook must run on its own in Colab, so each carries this cell (it cannot live in the library it installs).
# The package is not published yet: the cell installs it from FASTSFT_LAB_SOURCE (a path, a wheel, or a git URL of a
# clone), else from the GitHub name it will have once published.
COLAB_INSTALL = """
# Colab: Runtime > Change runtime type > a GPU. T4 (16 GB): float16, sdpa/eager attention, the smaller sizes;
# L4 (24 GB): bfloat16, varlen/flex attention; A100 (40/80 GB): real widths. The parameters cell says what it picked.
# fastsft_lab is NOT published yet: github.com/fastsft-lab/fastsft_lab does not exist. Set FASTSFT_LAB_SOURCE to
# where your copy is (a folder uploaded to Colab, a wheel, or "git+https://..." of a clone you can read), e.g.
#   os.environ["FASTSFT_LAB_SOURCE"] = "/content/fastsft_lab"
# Without it the cell tries the published name, which only works once the project is published.
# Elsewhere: `make setup`, or `pip install -e ".[lab,trl]"` from a clone.
import os, sys
if "google.colab" in sys.modules:
    import subprocess
    import torch
    if not torch.cuda.is_available() and os.environ.get("SMOKE", "") != "1":
        raise SystemExit("This Colab runtime has no GPU: Runtime > Change runtime type > T4, L4 or A100 GPU; "
                         "or set os.environ['SMOKE'] = '1' to run the tiny models on the CPU.")
    source = os.environ.get("FASTSFT_LAB_SOURCE", "git+https://github.com/fastsft-lab/fastsft_lab")
    package = f"fastsft_lab[lab,trl] @ {source}" if "://" in source else f"{source}[lab,trl]"
    print(f"installing fastsft_lab from {source}")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", package,   # Colab's own torch stays
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
        first = out[0][1] + ("\n\n" + where.strip() if where else "") + "\n\n" + GLOSSARY
        out[0] = ("md", stamp_source(first, None))  # the reading time, stamped once the notebook has its outputs
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
    stamp(path)             # the sources alone; benchmarks/run_notebooks.py stamps again after execution
    return path


if __name__ == "__main__":
    for num in sys.argv[1:]:
        print(build(num))
