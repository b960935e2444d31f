"""Reading the library's own source in tests that keep a rule over it (private names, family branches)."""

from __future__ import annotations

import pathlib


def code_lines(path: pathlib.Path):
    """(line number, code) of ``path`` without docstrings and comments."""
    in_doc = False
    for i, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        quotes = stripped.count('"""')
        if in_doc or stripped.startswith('"""'):
            if quotes == 1:
                in_doc = not in_doc
            continue
        yield i, line.split("#", 1)[0]
