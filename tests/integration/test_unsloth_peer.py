"""benchmarks/unsloth_peer/ on the CPU: the export loads back offline, its batches round-trip, its statistics are
the harness's own function, importing it pulls in neither torch nor transformers, and `python -m
benchmarks.unsloth_peer run` without Unsloth fails with one clear line and an error result."""

from __future__ import annotations

import ast
import importlib
import json
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "benchmarks" / "unsloth_peer"
ENTRY = "benchmarks.unsloth_peer"   # `python -m benchmarks.unsloth_peer`, from the repo root (unsloth_peer.sh)
TOKENS, STEPS, LAYERS = 256, 2, 2


def _load_package():
    if str(ROOT) not in sys.path:   # what `python -m` from the repo root gives the stage script
        sys.path.append(str(ROOT))
    module = importlib.import_module(ENTRY)
    assert pathlib.Path(module.__file__).resolve() == PACKAGE / "__init__.py"
    return module


peer = _load_package()


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
    with pytest.raises(ValueError, match="covers dense Qwen3 presets"):
        peer.export(str(tmp_path), model="tiny-qwen3-moe", device="cpu")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        peer.export(str(tmp_path), model="tiny-qwen3", tokens=8192, device="cpu")
    assert peer.main(["export", "--out", str(tmp_path), "--model", "tiny-qwen3-moe", "--device", "cpu"]) == 1
    assert "dense Qwen3" in json.loads((tmp_path / "export_error.json").read_text())["error"]
    assert not (tmp_path / "meta.json").exists()


def test_incomplete_export_is_refused_with_the_export_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="meta.json"):
        peer.read_export(str(tmp_path))
    (tmp_path / "export_error.json").write_text(json.dumps({"error": "OutOfMemoryError: CUDA out of memory"}))
    with pytest.raises(FileNotFoundError, match="export failed: OutOfMemoryError"):
        peer.read_export(str(tmp_path))


def test_statistics_are_the_harness_function_itself():
    """No copy of the harness's statistics: the peer's percentiles are ``fastsft_lab.profiling.percentiles`` (defined
    once, torch-free, in ``fastsft_lab._util``), and no module of the package defines its own."""
    import fastsft_lab._util
    import fastsft_lab.profiling

    assert peer.percentiles is fastsft_lab.profiling.percentiles is fastsft_lab._util.percentiles
    assert importlib.import_module(f"{ENTRY}.stats").percentiles is fastsft_lab.profiling.percentiles
    own = {f"{path.name}:{node.name}" for path in sorted(PACKAGE.glob("*.py"))
           for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.FunctionDef)
           and ("quantile" in node.name or "percentile" in node.name)}
    assert own == set(), own
    assert peer.percentiles([3.0, 1.0, 2.0]) == {"median": 2.0, "p20": 1.4, "p80": 2.6, "n": 3}


def test_importing_the_package_imports_neither_torch_nor_transformers():
    """Unsloth must be imported before transformers (it patches it): the package's import, and the statistics it
    takes from fastsft_lab, stay on the standard library."""
    code = (f"import sys, {ENTRY}; print(sorted(n for n in ('torch', 'transformers', 'peft', 'numpy') "
            "if n in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr
    usage = subprocess.run([sys.executable, "-m", ENTRY, "--help"], capture_output=True, text=True, timeout=60,
                           cwd=ROOT)
    assert usage.returncode == 0 and "python -m benchmarks.unsloth_peer" in usage.stdout, usage.stderr
    for command in ("export", "run", "error-json", "summary"):
        assert command in usage.stdout


def _run_without_unsloth(folder, result, *flags):
    """``python -m benchmarks.unsloth_peer run`` in a subprocess from the repo root as if unsloth were not
    installed, whatever this environment holds (``import unsloth`` raises ModuleNotFoundError): ``runpy.run_module``
    with ``alter_sys`` is what ``-m`` runs, after the one line that hides unsloth."""
    argv = [str(PACKAGE / "__main__.py"), "run", "--dir", str(folder), "--out", str(result), *flags]
    code = (f"import runpy, sys; sys.modules['unsloth'] = None; sys.argv = {argv!r}; "
            f"runpy.run_module({ENTRY!r}, run_name='__main__', alter_sys=True)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_run_without_unsloth_fails_with_one_line_and_an_error_result(exported, tmp_path):
    out, _ = exported
    result = tmp_path / "r.json"
    proc = _run_without_unsloth(out, result, "--double-buffer", "off")
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


def test_stage_script_runs_unsloth_with_checkpointing_off_under_its_own_name(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "UNSLOTH_WHEELS": str(tmp_path / "no-wheels"),
           "UNSLOTH_PEER_MODEL": "tiny-qwen3", "UNSLOTH_PEER_LAYERS": "2", "UNSLOTH_PEER_TOKENS": "256",
           "UNSLOTH_PEER_DB": "on", "UNSLOTH_PEER_CHECKPOINTING": "off", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", "benchmarks/unsloth_peer.sh", str(tmp_path / "res")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "res" / "unsloth-tiny-qwen3-L2-256-ckoff-dbon.json").read_text())
    assert doc["variants"][0]["name"] == "unsloth (checkpointing off)"
    # without UNSLOTH_PEER_DB, checkpointing off is one run: the double buffer has nothing to reload then
    one = {k: v for k, v in env.items() if k != "UNSLOTH_PEER_DB"}
    proc = subprocess.run(["bash", "benchmarks/unsloth_peer.sh", str(tmp_path / "res3")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=one)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert sorted(p.name for p in (tmp_path / "res3").glob("*.json")) == ["unsloth-tiny-qwen3-L2-256-ckoff-dbon.json"]
    bad = subprocess.run(["bash", "benchmarks/unsloth_peer.sh", str(tmp_path / "res2")], capture_output=True,
                         text=True, timeout=60, cwd=ROOT, env={**env, "UNSLOTH_PEER_CHECKPOINTING": "False"})
    assert bad.returncode == 2 and "UNSLOTH_PEER_CHECKPOINTING must be unsloth or off, got 'False'" in bad.stderr


# --- GPT-OSS ---------------------------------------------------------------------------------------------------------
GPT_TOKENS, GPT_ROW, GPT_LAYERS = 512, 256, 2


@pytest.fixture(scope="module")
def exported_gpt_oss(tmp_path_factory):
    out = tmp_path_factory.mktemp("unsloth-peer-moe")
    assert peer.main(["export", "--out", str(out), "--model", "tiny-gpt-oss", "--num-layers", str(GPT_LAYERS),
                      "--tokens", str(GPT_TOKENS), "--row-tokens", str(GPT_ROW), "--steps", str(STEPS), "--mix",
                      "short", "--device", "cpu"]) == 0
    return out, json.loads((out / "meta.json").read_text())


def test_gpt_oss_export_loads_back_with_its_config_tokenizer_and_batches(exported_gpt_oss):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastsft_lab.data import benchmark_batches
    from fastsft_lab.models import build_model

    out, meta = exported_gpt_oss
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "gpt_oss" and cfg["output_router_logits"] is False and cfg["num_hidden_layers"] == 2
    assert "quantization_config" not in cfg  # unquantized: Unsloth's loader reads fused bf16 experts
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert type(model).__name__ == "GptOssForCausalLM" and len(tok) == 256 == meta["vocab_size"]
    reference = build_model("tiny-gpt-oss", device="cpu", dtype=torch.bfloat16, num_layers=GPT_LAYERS).state_dict()
    loaded = model.state_dict()
    assert set(loaded) == set(reference)
    for name, tensor in reference.items():   # experts and sinks too, bit for bit
        assert torch.equal(loaded[name], tensor), name
    assert meta["family"] == "gpt_oss" and meta["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert meta["load_in_4bit"] is False and meta["output_router_logits"] is False
    assert meta["row_tokens"] == GPT_ROW and meta["rows"] == GPT_TOKENS // GPT_ROW and meta["tokens"] == GPT_TOKENS
    assert meta["layer_types"] == ["sliding_attention", "full_attention"] and meta["sliding_window"] == 8
    assert meta["num_local_experts"] == 8 and meta["experts_per_token"] == 2
    _, raw = peer.read_export(str(out))
    want = benchmark_batches(tokens_per_step=GPT_TOKENS, row_tokens=GPT_ROW, steps=STEPS, vocab_size=256,
                             mix="short")
    for got, b in zip(raw, want):
        assert len(got["input_ids"]) == 2 and all(len(r) == GPT_ROW for r in got["input_ids"])
        assert torch.equal(torch.tensor(got["position_ids"]), b.position_ids)
        assert peer.length_stats(got["seq_lengths"], got["pad_lengths"], GPT_ROW) == b.length_stats()
    assert meta["batches"] == [b.length_stats() for b in want]


def test_gpt_oss_defaults_and_argument_checks(tmp_path):
    d = peer.family_defaults("gpt_oss", 8192, 24)
    assert d == {"num_layers": 24, "row_tokens": 4096, "targets": peer.GPT_OSS_LORA_TARGETS, "load_in_4bit": False}
    assert peer.family_defaults("gpt_oss", 2048, 24)["row_tokens"] == 2048
    assert peer.family_defaults("qwen3", 8192, 40)["num_layers"] == 8
    with pytest.raises(ValueError, match="not a positive multiple"):
        peer.export(str(tmp_path), model="tiny-gpt-oss", tokens=512, row_tokens=300, device="cpu")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        peer.export(str(tmp_path), model="tiny-gpt-oss", tokens=16384, row_tokens=8192, device="cpu")
    with pytest.raises(ValueError, match="one row"):
        peer.export(str(tmp_path), model="tiny-qwen3", tokens=512, row_tokens=256, device="cpu")
    with pytest.raises(ValueError, match="num_layers"):
        peer.export(str(tmp_path), model="tiny-gpt-oss", num_layers=0, device="cpu")
    with pytest.raises(ValueError, match="covers dense Qwen3 presets"):
        peer.export(str(tmp_path), model="tiny-qwen3-moe", device="cpu")
    with pytest.raises(OSError, match="GiB free"):
        peer.check_free_space(str(tmp_path), 2**62)
    with pytest.raises(SystemExit):
        peer.main(["export", "--out", str(tmp_path), "--num-layers", "zero"])
    assert not (tmp_path / "meta.json").exists()


def test_gpt_oss_run_config_and_error_result(exported_gpt_oss, tmp_path):
    out, meta = exported_gpt_oss
    _, raw = peer.read_export(str(out))
    config = peer.run_config(meta, raw, str(out), double_buffer="on", lengths_device="cpu", steps=2, warmup=1,
                             layout="packed")
    assert config["family"] == "gpt_oss" and config["load_in_4bit"] is False and config["rows"] == 2
    assert config["layout"] == "packed" and config["padded_tokens_per_step"] == GPT_TOKENS
    assert config["tokens_per_step"] == GPT_TOKENS and config["row_tokens"] == GPT_ROW
    assert config["lora_targets"] == ["q_proj", "k_proj", "v_proj", "o_proj"] and config["output_router_logits"] is False
    assert config["segments_isolated"] is False and "PADDING_FREE_BLOCKLIST" in config["segments_isolated_reason"]
    assert "not measured" in config["segments_isolated_source"] and config["packed_seq_lengths_device"] is None
    assert "cross-entropy alone" in config["router_aux_loss"]
    ctx = {"config": config, "toggles": peer.variant_toggles("gpt_oss", "on", "cpu", "packed"), "stage": "load"}
    doc = peer.error_result(ctx, "load: RuntimeError: boom", "on", "cpu", None)
    assert doc["variants"][0]["toggles"] == {"double_buffer": "on", "gradient_checkpointing": "unsloth",
                                             "packed_seq_lengths": None, "load_in_4bit": False, "load_in_16bit": True,
                                             "layout": "packed"}
    assert doc["config"]["segments_isolated"] is False and doc["error"] == "load: RuntimeError: boom"
    path = tmp_path / "err.json"
    peer.write_json(str(path), doc)
    assert peer.summary_line(str(path)) == "unsloth (double buffer on): ERROR: load: RuntimeError: boom"
    qwen = peer.error_result({}, "x", "off", "cuda", None)["variants"][0]["toggles"]
    assert qwen["load_in_4bit"] is True and qwen["packed_seq_lengths"] == "cuda" and qwen["layout"] == "packed"
    assert peer.variant_toggles("gpt_oss", "off", "cpu")["layout"] == "padded"


def test_gpt_oss_run_without_unsloth_writes_the_gpt_oss_config(exported_gpt_oss, tmp_path):
    out, _ = exported_gpt_oss
    result = tmp_path / "r.json"
    proc = _run_without_unsloth(out, result)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads(result.read_text())
    assert doc["stage"] == "import unsloth" and doc["config"]["family"] == "gpt_oss"
    assert doc["variants"][0]["toggles"]["load_in_16bit"] is True
    # the default layout for GPT-OSS is padded: one row per sequence, isolated by construction
    assert doc["config"]["layout"] == "padded" and doc["variants"][0]["toggles"]["layout"] == "padded"
    assert doc["config"]["segments_isolated"] is True and doc["config"]["pad_to_multiple_of"] == 128
    assert doc["config"]["warmup_run"] >= 2


def test_lora_placement_check():
    names = [f"m.layers.{i}.self_attn.{t}" for i in range(2) for t in peer.GPT_OSS_LORA_TARGETS]
    trainable = [f"{n}.lora_A.default.weight" for n in names]
    assert peer.check_lora_placement(names, trainable, peer.GPT_OSS_LORA_TARGETS, 2) is None
    assert "want 8" in peer.check_lora_placement(names[:-1], trainable, peer.GPT_OSS_LORA_TARGETS, 2)
    why = peer.check_lora_placement(names + ["m.layers.0.mlp.experts"], trainable + ["m.layers.0.mlp.router.weight"],
                                    peer.GPT_OSS_LORA_TARGETS, 2)
    assert "outside" in why and "non-adapter tensors train" in why


def _block_diagonal_masks(b, window):
    """Additive (rows, 1, T, T) masks: causal inside each segment (and its window for sliding layers), closed across."""
    seg = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in b.seq_lengths])
    pos = torch.arange(seg.shape[1])
    allowed = (seg[:, :, None] == seg[:, None, :]) & (pos[None, None, :] <= pos[None, :, None])
    windowed = allowed & (pos[None, None, :] > pos[None, :, None] - window)
    to_mask = lambda a: torch.zeros(a.shape).masked_fill(~a, float("-inf"))[:, None]  # noqa: E731
    return {"full_attention": to_mask(allowed), "sliding_attention": to_mask(windowed)}


@pytest.mark.parametrize("isolated", [True, False])
def test_isolation_probe_on_stock_transformers(isolated):
    """The probe on models whose answer is known: stock transformers 5.17 GPT-OSS (eager) without a mask is causal
    over the whole row (its mask factories get no position_ids: packed segments see each other); with a
    block-diagonal mask the segments are apart."""
    from fastsft_lab.data import benchmark_batches
    from fastsft_lab.models import build_model

    model = build_model("tiny-gpt-oss", device="cpu", dtype=torch.float32, num_layers=2)
    model.train()
    b = benchmark_batches(tokens_per_step=512, row_tokens=256, steps=1, vocab_size=256, mix="short")[0]
    feed = {"input_ids": b.input_ids, "labels": b.labels, "position_ids": b.position_ids, "use_cache": False}
    if isolated:
        feed["attention_mask"] = _block_diagonal_masks(b, model.config.sliding_window)
    probe = peer.isolation_probe(lambda f: model(**f).loss, feed, b.seq_lengths, b.pad_lengths, model.model.layers,
                                 model.config.layer_types, model.config.sliding_window, 256, torch)
    assert probe["rerun_noise"] == 0.0 and probe["first_segment_own_change"] > peer.PROBE_CHANGED
    assert probe["compared_after_first"] == [probe["first_segment"][1], probe["first_segment"][1] + 8]
    assert probe["segments_isolated"] is isolated, probe
    assert probe["causal"] is True, probe
    assert peer.real_segments((3, 4, 5), 5) == [(0, 3), (3, 7)] and peer.real_segments((3, 4), 0) == [(0, 3), (3, 7)]


def test_isolation_probe_sees_a_non_causal_model():
    from fastsft_lab.data import benchmark_batches
    from fastsft_lab.models import build_model

    model = build_model("tiny-gpt-oss", device="cpu", dtype=torch.float32, num_layers=2)
    model.train()
    b = benchmark_batches(tokens_per_step=512, row_tokens=256, steps=1, vocab_size=256, mix="short")[0]
    zeros = torch.zeros(2, 1, 256, 256)   # every position sees every other: neither isolated nor causal
    feed = {"input_ids": b.input_ids, "labels": b.labels, "use_cache": False,
            "attention_mask": {"full_attention": zeros, "sliding_attention": zeros}}
    probe = peer.isolation_probe(lambda f: model(**f).loss, feed, b.seq_lengths, b.pad_lengths, model.model.layers,
                                 model.config.layer_types, model.config.sliding_window, 256, torch)
    assert probe["segments_isolated"] is False and probe["causal"] is False, probe
    one = benchmark_batches(tokens_per_step=64, row_tokens=64, steps=1, vocab_size=256, mix="short")[0]
    assert one.seq_lengths == ((64,),)
    assert peer.isolation_probe(None, {}, one.seq_lengths, one.pad_lengths, [], None, None, 256, torch)[
        "segments_isolated"] is None


def test_stage_script_gpt_oss_defaults(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "UNSLOTH_WHEELS": str(tmp_path / "no-wheels"),
           "UNSLOTH_PEER_MODEL": "tiny-gpt-oss", "UNSLOTH_PEER_TOKENS": "8192", "HOME": str(tmp_path),
           "UNSLOTH_PEER_EXPORT_DIR": str(tmp_path / "export")}
    proc = subprocess.run(["bash", "benchmarks/unsloth_peer.sh", str(tmp_path / "res")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "tiny-gpt-oss, 4 layers, 8192 tokens in rows of 4096, layout padded" in proc.stdout
    for db in ("on", "off"):
        assert (tmp_path / "res" / f"unsloth-tiny-gpt-oss-L4-8192-padded-db{db}.json").is_file()
    proc = subprocess.run(["bash", "benchmarks/unsloth_peer.sh", str(tmp_path / "res2")], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**env, "UNSLOTH_PEER_LAYOUT": "packed"})
    assert "layout packed" in proc.stdout
    assert (tmp_path / "res2" / "unsloth-tiny-gpt-oss-L4-8192-packed-dbon.json").is_file()


@pytest.mark.parametrize("model, layout", [("tiny-qwen3", "padded"), ("tiny-gpt-oss", "sorted")])
def test_stage_script_refuses_a_layout(tmp_path, model, layout):
    env = {"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "UNSLOTH_WHEELS": str(tmp_path / "no-wheels"),
           "UNSLOTH_PEER_MODEL": model, "UNSLOTH_PEER_LAYOUT": layout, "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", "benchmarks/unsloth_peer.sh", str(tmp_path / "res")], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, env=env)
    assert proc.returncode == 2 and "UNSLOTH_PEER_LAYOUT" in proc.stderr, proc.stdout + proc.stderr


# --- GPT-OSS, padded layout -------------------------------------------------------------------------------------------
def _segments(b):
    """(row, start, end) of every real segment of a packed batch dict, in row order."""
    return [(r, s, e) for r, (lens, pad) in enumerate(zip(b["seq_lengths"], b["pad_lengths"]))
            for s, e in peer.real_segments(lens, pad)]


@pytest.mark.parametrize("multiple", [1, 16, 128])
def test_padded_layout_from_the_export(exported_gpt_oss, multiple):
    out, _ = exported_gpt_oss
    _, raw = peer.read_export(str(out))
    for b in raw:
        p = peer.padded_layout(b, multiple=multiple)
        segs = _segments(b)
        assert len(p["input_ids"]) == len(p["labels"]) == len(p["attention_mask"]) == len(segs) > 2
        assert p["lengths"] == [e - s for _, s, e in segs] and p["origin"] == [[r, s] for r, s, _ in segs]
        assert p["longest"] == max(p["lengths"]) and p["width"] % multiple == 0
        assert p["longest"] <= p["width"] < p["longest"] + multiple
        assert p["real_tokens"] == sum(p["lengths"]) == GPT_TOKENS - sum(b["pad_lengths"])
        assert p["padded_tokens"] == p["width"] * len(segs)
        for (r, s, e), ids, labels, mask, n in zip(segs, p["input_ids"], p["labels"], p["attention_mask"],
                                                   p["lengths"]):
            assert len(ids) == len(labels) == len(mask) == p["width"]
            assert ids[:n] == b["input_ids"][r][s:e] and ids[n:] == [0] * (p["width"] - n)   # right padding
            assert labels[:n] == b["labels"][r][s:e] and labels[n:] == [-100] * (p["width"] - n)
            assert labels[0] == -100 and mask == [1] * n + [0] * (p["width"] - n)
        pairs = peer.labelled_pairs_padded(p)
        assert pairs == peer.labelled_pairs_packed(b) and pairs and all(pos >= 0 for _, pos, _ in pairs)
        # the same labelled tokens: every pair's target is the sequence's own next token
        assert all(p["input_ids"][q][t + 1] == target for q, t, target in pairs)


def test_padded_layout_refuses_labels_that_would_change_the_pairs():
    b = {"input_ids": [[5, 6, 7, 8, 9, 0]], "labels": [[-100, 6, -100, 8, 9, -100]],
         "position_ids": [[0, 1, 0, 1, 2, 0]], "seq_lengths": [[2, 3, 1]], "pad_lengths": [1]}
    p = peer.padded_layout(b)
    assert p["lengths"] == [2, 3] and p["width"] == 3 and p["input_ids"] == [[5, 6, 0], [7, 8, 9]]
    assert peer.labelled_pairs_padded(p) == peer.labelled_pairs_packed(b) == [(0, 0, 6), (1, 0, 8), (1, 1, 9)]
    crossing = {**b, "labels": [[-100, 6, 7, 8, 9, -100]]}   # the second segment's first token labelled
    assert (1, -1, 7) in peer.labelled_pairs_packed(crossing)   # seq 0's last token scored on seq 1's first
    with pytest.raises(ValueError, match="first token"):
        peer.padded_layout(crossing)
    with pytest.raises(ValueError, match="padding tail"):
        peer.padded_layout({**b, "labels": [[-100, 6, -100, 8, 9, 3]]})
    with pytest.raises(ValueError, match="multiple"):
        peer.padded_layout(b, multiple=0)


def _tiny_gpt_oss():
    from fastsft_lab.models import build_model

    model = build_model("tiny-gpt-oss", device="cpu", dtype=torch.float32, num_layers=2,
                        attn_implementation="eager")
    model.train()  # dropout 0: training mode is deterministic
    assert model.config._attn_implementation == "eager"
    return model


def _packed_and_padded(multiple=1):
    from fastsft_lab.data import benchmark_batches

    b = benchmark_batches(tokens_per_step=512, row_tokens=256, steps=1, vocab_size=256, mix="short")[0]
    raw = peer.batches_to_json([b])[0]
    p = peer.padded_layout(raw, multiple=multiple)
    feed = {k: torch.tensor(p[k]) for k in ("input_ids", "labels", "attention_mask")}
    return b, raw, p, feed


@pytest.mark.parametrize("multiple", [1, 128])
def test_padded_batch_gives_the_loss_of_each_sequence_alone_on_stock_transformers(multiple):
    """The padded layout's loss (stock transformers 5.17 GPT-OSS, eager: sinks, sliding window 8 on layer 0) is the
    mean over the same labelled tokens as each sequence run alone, and as the packed batch with a block-diagonal
    mask (our packed step's computation); with the attention_mask dropped (as Unsloth's training forward does) the
    causal mask alone gives the same: right padding is exact."""
    import torch.nn.functional as F

    model = _tiny_gpt_oss()
    b, raw, p, feed = _packed_and_padded(multiple)
    assert p["width"] < 256 or multiple > 1
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for ids, labels, n in zip(p["input_ids"], p["labels"], p["lengths"]):
            logits = model(input_ids=torch.tensor([ids[:n]]), use_cache=False).logits[0].double()
            target = torch.tensor(labels[1:n])
            total += F.cross_entropy(logits[:-1], target, ignore_index=-100, reduction="sum")
            count += int((target != -100).sum())
        alone = float(total / count)
        padded = float(model(**feed, use_cache=False).loss)
        no_mask = float(model(input_ids=feed["input_ids"], labels=feed["labels"], use_cache=False).loss)
        packed = float(model(input_ids=b.input_ids, labels=b.labels, position_ids=b.position_ids, use_cache=False,
                             attention_mask=_block_diagonal_masks(b, model.config.sliding_window)).loss)
    assert count == len(peer.labelled_pairs_packed(raw)) == int((b.labels[:, 1:] != -100).sum())
    assert padded == pytest.approx(alone, rel=1e-5, abs=1e-6)
    assert no_mask == pytest.approx(alone, rel=1e-5, abs=1e-6)
    assert packed == pytest.approx(alone, rel=1e-5, abs=1e-6)


def test_padded_probe_on_stock_transformers():
    model = _tiny_gpt_oss()
    _, _, p, feed = _packed_and_padded(16)
    modules = {"layer0_attention": model.model.layers[0].self_attn, "final_norm": model.model.norm}
    forward = lambda f: model(**f, use_cache=False).loss  # noqa: E731
    probe = peer.padded_probe(forward, feed, p["lengths"], modules, 256, torch)
    assert probe["rows_independent"] is True and probe["right_padding_exact"] is True, probe
    assert probe["row_length"] == min(p["lengths"]) and probe["other_length"] == max(p["lengths"])
    for m in probe["modules"].values():
        assert m["rerun_noise"] == 0.0 and m["row_change_control"] > peer.PROBE_CHANGED
        assert m["pad_change_control"] > peer.PROBE_CHANGED and m["pad_change_real_positions"] == 0.0
    # Every position sees every other (no causal mask): the pads after a real token reach it.
    zeros = torch.zeros(len(p["lengths"]), 1, p["width"], p["width"])
    mask = {"full_attention": zeros, "sliding_attention": zeros}
    probe = peer.padded_probe(forward, {**feed, "attention_mask": mask}, p["lengths"], modules, 256, torch)
    assert probe["right_padding_exact"] is False and probe["rows_independent"] is True, probe
    # Rows mixed (the embedding of each row gets the batch mean): a row moves with another row's tokens.
    handle = model.model.embed_tokens.register_forward_hook(lambda m, a, out: out + out.mean(0, keepdim=True))
    try:
        probe = peer.padded_probe(forward, feed, p["lengths"], modules, 256, torch)
    finally:
        handle.remove()
    assert probe["rows_independent"] is False, probe
    one = peer.padded_probe(forward, {k: v[:1] for k, v in feed.items()}, p["lengths"][:1], modules, 256, torch)
    assert one["rows_independent"] is None and one["other_row"] is None


def test_layout_arguments(exported, exported_gpt_oss, tmp_path):
    assert peer.check_layout("gpt_oss", None) == "padded" and peer.check_layout("qwen3", None) == "packed"
    assert peer.check_layout("gpt_oss", "packed") == "packed"
    with pytest.raises(ValueError, match="GPT-OSS only"):
        peer.check_layout("qwen3", "padded")
    with pytest.raises(ValueError, match="one of packed, padded"):
        peer.check_layout("gpt_oss", "sorted")
    with pytest.raises(SystemExit):
        peer.main(["run", "--dir", str(tmp_path), "--out", str(tmp_path / "r.json"), "--layout", "sorted"])
    ctx: dict = {}
    with pytest.raises(ValueError, match="GPT-OSS only"):   # refused before anything is imported or loaded
        peer.run(str(exported[0]), str(tmp_path / "r.json"), layout="padded", ctx=ctx)
    assert ctx["stage"] == "read export" and ctx["toggles"]["layout"] == "padded"
    doc = peer.error_result(ctx, "read export: ValueError: layout 'padded' is for GPT-OSS only", "on", "cpu", None)
    assert doc["variants"][0]["toggles"]["layout"] == "padded" and "GPT-OSS only" in doc["error"]
    with pytest.raises(ValueError, match="padded layout only"):
        peer.run(str(exported_gpt_oss[0]), str(tmp_path / "r.json"), layout="packed", pad_multiple=128)
    with pytest.raises(ValueError, match=">= 1"):
        peer.run(str(exported_gpt_oss[0]), str(tmp_path / "r.json"), pad_multiple=0)


def test_warmup_covers_every_measured_shape():
    assert peer.warmup_covering([(2, 256)] * 6, 2, 6) == 2
    shapes = [(12, 2176), (8, 1792), (16, 768), (32, 384), (19, 1024), (18, 768)]
    assert peer.warmup_covering(shapes, 2, 6) == 6
    assert peer.warmup_covering(shapes, 2, 2) == 6   # 4 or 5 would measure a batch not yet run (4, 5)
    assert peer.warmup_covering(shapes, 8, 6) == 8
    assert peer.warmup_covering([(1, 8), (2, 8), (1, 8)], 1, 1) == 2   # step 2 is batch 2, the shape of batch 0
    assert peer.warmup_covering([(1, 8)] * 3, 0, 4) == 1   # one untimed step, even with warmup 0


def test_padded_run_config(exported, exported_gpt_oss):
    out, meta = exported_gpt_oss
    _, raw = peer.read_export(str(out))
    config = peer.run_config(meta, raw, str(out), double_buffer="off", lengths_device="cpu", steps=2, warmup=2)
    layouts = [peer.padded_layout(b, multiple=128) for b in raw]
    assert config["layout"] == "padded" and config["pad_to_multiple_of"] == 128
    assert config["segments_isolated"] is True and "construction" in config["segments_isolated_source"]
    assert "flex_attention_with_sink" in config["segments_isolated_reason"]
    assert config["real_tokens_per_batch"] == [p["real_tokens"] for p in layouts]
    assert config["padded_tokens_per_batch"] == [p["padded_tokens"] for p in layouts]
    assert config["shapes_per_batch"] == [[len(p["lengths"]), p["width"]] for p in layouts]
    real, fed = sum(config["real_tokens_per_batch"]), sum(config["padded_tokens_per_batch"])
    assert config["real_tokens_per_step"] == round(real / len(raw), 1)
    assert config["padded_tokens_per_step"] == round(fed / len(raw), 1)
    assert config["padding_fraction"] == round(1 - real / fed, 4) and 0 < config["padding_fraction"] < 1
    assert config["rows_independent_measured"] is None and config["right_padding_exact_measured"] is None
    assert config["tokens_per_step"] == GPT_TOKENS and "padded_inputs" in config
    one = peer.run_config(meta, raw, str(out), double_buffer="off", lengths_device="cpu", steps=2, warmup=2,
                          pad_multiple=1)
    assert one["shapes_per_batch"] == [[len(p["lengths"]), p["longest"]] for p in layouts]
    qmeta = exported[1]
    _, qraw = peer.read_export(str(exported[0]))
    q = peer.run_config(qmeta, qraw, str(exported[0]), double_buffer="on", lengths_device="cpu", steps=2, warmup=2)
    assert q["layout"] == "packed" and q["padded_tokens_per_step"] == TOKENS and "pad_to_multiple_of" not in q
    assert q["real_tokens_per_step"] == round(sum(TOKENS - sum(b["pad_lengths"]) for b in qraw) / len(qraw), 1)
