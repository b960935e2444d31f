"""The README tells the truth: its results tables are what the committed JSON gives, its Python runs as written."""

import pathlib
import re

import pytest

from fastsft_lab.lab import report

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"

# What the CI machine cannot do as written (no hub, no GPU, seconds not minutes): the only changes made to the
# README's code before it runs here.
SUBSTITUTIONS = [
    ('"qwen3-14b"', '"tiny-qwen3"'),
    ('AutoTokenizer.from_pretrained("Qwen/Qwen3-14B")', "_tiny_tokenizer()"),
    ("tokens_per_step=4096", "tokens_per_step=512"),
    ("max_tokens=4096", "max_tokens=256"),
    ("report_to=[],", "report_to=[], use_cpu=True, bf16=False,"),
]


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t3")


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_results_tables_equal_what_the_committed_results_give():
    names = []
    for path in report.DOCS:
        text = path.read_text()
        names += re.findall(r"<!-- results:(\w+) -->", text)
        assert report.render(text) == text, f"{path.name}: regenerate with: python -m fastsft_lab results --readme"
    assert sorted(names) == sorted(report.TABLES)               # every table once, in the README or docs/results.md
    assert "results:headline" in README.read_text()


def test_the_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    head = text[:text.index("## Quick start")]
    assert "docs/headline.png" in head and "<!-- results:headline -->" in head     # chart and table above the fold
    assert (README.parent / "docs" / "headline.png").stat().st_size > 10_000
    for link in re.findall(r"\]\((docs/[\w.]+)\)", text):
        assert (README.parent / link).exists(), link


def test_the_readme_has_its_code():
    assert len(python_blocks()) == 2


@pytest.mark.parametrize("index", [0, 1], ids=["training-script", "trl-recipe"])
def test_readme_python_runs_on_a_tiny_preset(index, tmp_path, monkeypatch, one_cpu_thread):
    code = python_blocks()[index]
    for old, new in SUBSTITUTIONS:
        code = code.replace(old, new)
    assert "qwen3-14b" not in code
    monkeypatch.chdir(tmp_path)
    namespace = {"_tiny_tokenizer": _tiny_tokenizer, "__name__": "readme"}
    exec(compile(code, f"README.md block {index}", "exec"), namespace)
    import fastsft_lab

    if index == 0:
        assert namespace["state"].packed == "varlen" and namespace["state"].fused_loss
        assert namespace["text"].shape[1] == 16 + 8
        assert fastsft_lab.state(namespace["model"]) == fastsft_lab.ModelState(checkpointing="standard")
    else:
        assert namespace["trainer"].state.global_step == 4
