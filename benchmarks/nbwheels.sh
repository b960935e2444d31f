#!/usr/bin/env bash
# Fetch a Jupyter kernel for the GPU machine into .nbwhl/ (it has no nbclient/ipykernel): what
# benchmarks/run_notebooks.py needs to execute the notebooks there (`gpu_session.sh notebooks`).
# Wheels for CPython 3.12 on x86-64 Linux, their dependencies resolved by pip; those the machine's image already holds
# (packaging, psutil, pygments, dateutil, typing_extensions, attrs, tzdata) and the large ones a kernel runs without
# (debugpy: no debugger; jedi/parso: no completion; widgetsnbextension: the front end's part of ipywidgets) are
# dropped, so that the kernel (~4.5 MiB) travels beside .whl/ within the device's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.nbwhl/' .git/info/exclude 2>/dev/null || echo '/.nbwhl/' >> .git/info/exclude
PY=${PY:-.venv/bin/python}
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
  -d .nbwhl nbclient nbformat ipykernel ipywidgets
for name in packaging psutil pygments python_dateutil typing_extensions attrs tzdata debugpy jedi parso \
            widgetsnbextension; do
  rm -f .nbwhl/"$name"-*.whl
done
du -sh .nbwhl
