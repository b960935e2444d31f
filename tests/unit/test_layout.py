"""The package's shape: the library never imports the lab or matplotlib, has no import cycle, and small files."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parents[2] / "fastsft_lab"
LAB = "fastsft_lab.lab"
MAX_LINES = 800


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def library_modules() -> list[str]:
    """Every module a user imports to train: all of fastsft_lab except the lab and the ``-m`` entry point."""
    return [m for m in _modules() if not (m == LAB or m.startswith(LAB + ".") or m == "fastsft_lab.__main__")]


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Modules ``name`` imports anywhere in its source (module level or inside functions), resolved."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.add(mod)
            for alias in node.names:            # `from pkg import sub` imports the submodule pkg.sub
                if f"{mod}.{alias.name}" in known:
                    out.add(f"{mod}.{alias.name}")
    return out


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: {i for i in _imports(m, p, known) if i in known or i.split(".")[0] in ("matplotlib", "ipywidgets")}
            for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_library_never_imports_the_lab_or_matplotlib():
    graph = import_graph()
    bad = {m: sorted(i for i in graph[m] if i == LAB or i.startswith(LAB + ".") or i.startswith("matplotlib")
                     or i.startswith("ipywidgets"))
           for m in library_modules()}
    assert {m: v for m, v in bad.items() if v} == {}


def test_library_imports_in_a_fresh_interpreter_without_matplotlib_or_the_lab():
    # A finder that refuses matplotlib and the lab: importing every library module must not need either.
    code = f"""
import importlib, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name == "matplotlib" or name.startswith("matplotlib.") or name == "{LAB}" or name.startswith("{LAB}."):
            raise ImportError("refused by the layout test: " + name)
        return None
sys.meta_path.insert(0, Refuse())
import warnings
warnings.simplefilter("ignore", DeprecationWarning)
for name in {library_modules()!r}:
    importlib.import_module(name)
print("ok", len({library_modules()!r}))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=str(PKG.parent))
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stderr[-3000:]


def test_no_import_cycle_inside_the_package():
    assert _cycles(import_graph()) == []


@pytest.mark.parametrize("name", library_modules())
def test_library_files_are_small(name):
    path = _modules()[name]
    assert len(path.read_text().splitlines()) <= MAX_LINES, f"{path} is over {MAX_LINES} lines"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
