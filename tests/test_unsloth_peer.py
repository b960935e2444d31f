"""benchmarks/unsloth_peer.py on the CPU: the export loads back offline, its batches round-trip, its statistics are
the harness's, and `run` without Unsloth fails with one clear line and an error result."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import random
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "unsloth_peer.py"
TOKENS, STEPS, LAYERS = 256, 2, 2


def _load_script():
    spec = importlib.util.spec_from_file_location("unsloth_peer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


peer = _load_script()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("unsloth-peer")
    # the command line the stage script runs (it calls export(), the function the lab imports)
    assert peer.main(["export", "--out", str(out), "--model", "tiny-qwen3", "--num-layers", str(LAYERS), "--tokens",
                      str(TOKENS), "--steps", str(STEPS), "--mix", "short", "--lora-rank", "8", "--device", "cpu"]) == 0
    return out, json.loads((out / "meta.json").read_text())


def test_export_loads_back_offline_with_transformers(exported):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastsft_lab.models import build_model

    out, meta = exported
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.model_type == "qwen3"
    assert model.config.num_hidden_layers == LAYERS == meta["num_layers"]
    assert len(tok) == model.config.vocab_size == meta["vocab_size"] == 256
    assert tok("t5 t7 t255", add_special_tokens=False)["input_ids"] == [5, 7, 255]
    assert (tok.pad_token_id, tok.eos_token_id) == (0, 1) == (model.config.pad_token_id, model.config.eos_token_id)
    reference = build_model("tiny-qwen3", device="cpu", dtype=torch.bfloat16, num_layers=LAYERS).state_dict()
    loaded = model.state_dict()
    assert set(loaded) == set(reference)
    for name, tensor in reference.items():   # the harness's seed-0 weights, bit for bit
        assert torch.equal(loaded[name], tensor), name
    assert list(meta["targets"]) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert meta["lora_rank"] == 8 and meta["preset"] == "tiny-qwen3" and meta["tokens"] == TOKENS
    assert meta["versions"]["torch"] == torch.__version__ and meta["date"].endswith("Z")
    assert meta["shards"] and all((out / s).is_file() for s in meta["shards"])


def test_batches_round_trip_to_benchmark_batches(exported):
    from fastsft_lab.data import benchmark_batches

    out, meta = exported
    read_meta, raw = peer.read_export(str(out))
    assert read_meta == meta
    want = benchmark_batches(tokens_per_step=TOKENS, row_tokens=TOKENS, steps=STEPS, vocab_size=256, mix="short")
    assert len(raw) == len(want) == STEPS
    for got, b in zip(raw, want):
        for key in ("input_ids", "labels", "position_ids"):
            t = torch.tensor(got[key], dtype=torch.long)
            assert t.shape == b.input_ids.shape and torch.equal(t, getattr(b, key)), key
        assert tuple(tuple(r) for r in got["seq_lengths"]) == b.seq_lengths
        assert tuple(got["pad_lengths"]) == b.pad_lengths
        assert peer.length_stats(got["seq_lengths"], got["pad_lengths"], TOKENS) == b.length_stats()
    assert meta["batches"] == [b.length_stats() for b in want]


def test_export_refuses_what_the_peer_does_not_cover(tmp_path):
    (tmp_path / "meta.json").write_text("{}")   # an earlier export: a failed one must not leave it looking complete
    with pytest.raises(ValueError, match="dense Qwen3 presets only"):
        peer.export(str(tmp_path), model="tiny-gpt-oss", device="cpu")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        peer.export(str(tmp_path), model="tiny-qwen3", tokens=8192, device="cpu")
    assert peer.main(["export", "--out", str(tmp_path), "--model", "tiny-gpt-oss", "--device", "cpu"]) == 1
    assert "dense Qwen3" in json.loads((tmp_path / "export_error.json").read_text())["error"]
    assert not (tmp_path / "meta.json").exists()


def test_incomplete_export_is_refused_with_the_export_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="meta.json"):
        peer.read_export(str(tmp_path))
    (tmp_path / "export_error.json").write_text(json.dumps({"error": "OutOfMemoryError: CUDA out of memory"}))
    with pytest.raises(FileNotFoundError, match="export failed: OutOfMemoryError"):
        peer.read_export(str(tmp_path))


@pytest.mark.parametrize("values", [[], [4.0], [3.0, 1.0, 2.0], [2.0, 2.0, 2.0, 2.0], [0.1, 1e3, 7.25, -2.0, 5.5],
                                    "random7", "random10", "random31"])
def test_percentiles_equal_the_harness(values):
    from fastsft_lab.profiling import percentiles

    if isinstance(values, str):
        rng = random.Random(len(values))
        values = [rng.uniform(10, 2000) for _ in range(int(values[6:]))]
    ours, theirs = peer.percentiles(values), percentiles(values)
    assert set(ours) == set(theirs) == {"median", "p20", "p80", "n"}
    for key in ours:
        if isinstance(theirs[key], float) and math.isnan(theirs[key]):
            assert math.isnan(ours[key])
        else:
            assert ours[key] == theirs[key], key


def test_run_without_unsloth_fails_with_one_line_and_an_error_result(exported, tmp_path):
    out, _ = exported
    result = tmp_path / "r.json"
    # As if unsloth were not installed, whatever this environment holds: `import unsloth` raises ModuleNotFoundError.
    code = (f"import runpy, sys; sys.modules['unsloth'] = None; "
            f"sys.argv = ['unsloth_peer.py', 'run', '--dir', {str(out)!r}, '--out', {str(result)!r}, "
            f"'--double-buffer', 'off']; runpy.run_path({str(SCRIPT)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("unsloth_peer run: error: import unsloth: ModuleNotFoundError: unsloth is not "
                               "importable")
    assert "PYTHONPATH=/tmp/site-unsloth" in lines[0]
    doc = json.loads(result.read_text())
    assert doc["scenario"] == "peer-unsloth" and "env" in doc and doc["stage"] == "import unsloth"
    assert "unsloth is not importable" in doc["error"]
    [variant] = doc["variants"]
    assert variant["name"] == "unsloth (double buffer off)" and variant["error"] == doc["error"]
    assert "step_ms" not in variant
    assert doc["config"]["model"] == "tiny-qwen3" and doc["config"]["double_buffer"] == "off"
    assert doc["config"]["env_requested"]["UNSLOTH_DISABLE_DOUBLE_BUFFER"] == "1"
    assert peer.summary_line(str(result)).startswith("unsloth (double buffer off): ERROR: import unsloth")


def test_summary_line_of_a_result_and_the_stage_script_parses(tmp_path):
    stat = {"median": 1000.0, "p20": 990.0, "p80": 1010.0, "n": 6}
    doc = {"scenario": "peer-unsloth", "env": {}, "config": {},
           "variants": [{"name": "unsloth (double buffer on)", "forward_ms": stat, "backward_ms": stat,
                         "optimizer_ms": stat, "step_ms": stat, "peak_mem_bytes": 2**31, "tokens_per_s": 8192.0,
                         "host_syncs_per_step": 3, "loss_median": 11.9, "double_buffer_effective": True}]}
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(doc))
    line = peer.summary_line(str(path))
    assert line.startswith("unsloth (double buffer on): step 1000.0 ms [990.0-1010.0] n=6") and "2.00 GiB" in line
    assert peer.summary_line(str(tmp_path / "missing.json")).startswith("missing.json: ERROR: no readable result")
    check = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "unsloth_peer.sh")], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stderr


def test_stage_script_writes_an_error_result_per_run_when_it_cannot_start(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "UNSLOTH_WHEELS": str(tmp_path / "no-wheels"),
           "UNSLOTH_PEER_MODEL": "tiny-qwen3", "UNSLOTH_PEER_LAYERS": "2", "UNSLOTH_PEER_TOKENS": "256",
           "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", "benchmarks/unsloth_peer.sh", str(tmp_path / "res")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for db in ("on", "off"):
        doc = json.loads((tmp_path / "res" / f"unsloth-tiny-qwen3-L2-256-db{db}.json").read_text())
        assert doc["scenario"] == "peer-unsloth" and "env" in doc
        assert doc["variants"][0]["name"] == f"unsloth (double buffer {db})"
        assert "no-wheels/*.whl" in doc["error"] and doc["variants"][0]["error"] == doc["error"]
        assert f"unsloth (double buffer {db}): ERROR: stage script: no " in proc.stdout
