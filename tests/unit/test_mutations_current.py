"""The mutation run (``make mutants``) stays runnable: every mutation's text is in the code exactly once, so a
change to the guarded code that moves the text fails CI here, not only the (longer) mutation run."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))   # tests/, where mutations.py is
import mutations  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("m", mutations.MUTATIONS, ids=lambda m: m.name)
def test_mutation_text_occurs_once(m):
    text = (ROOT / m.path).read_text()
    for old, new in m.edits():
        assert text.count(old) == 1, f"{m.name}: its text occurs {text.count(old)} times in {m.path}"
        assert new != old
