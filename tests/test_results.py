"""Committed results read back: one recursive loader, the packaged index a pip-installed copy (Colab) reads."""

import json

from fastsft_lab.lab import results


def test_packaged_index_is_up_to_date_with_benchmarks_results():
    # regenerate with: python -m fastsft_lab results --index
    committed = json.loads(results.INDEX.read_text())
    assert committed == json.loads(json.dumps(results.build_index(), sort_keys=True, default=str))


def test_an_installed_copy_reads_the_index(monkeypatch):
    from_repo = results.load_results("offload", device_type="cuda")
    monkeypatch.setattr(results, "repo_results_dir", lambda: None)
    from_index = results.load_results("offload", device_type="cuda")
    assert from_repo and [d["_path"] for d in from_index] == [d["_path"] for d in from_repo]
    assert [v["name"] for v in from_index[0]["variants"]] == [v["name"] for v in from_repo[0]["variants"]]


def test_loader_is_recursive_and_newest_run_does_not_mix_sessions():
    moe = results.load_results(["moe-routing", "moe-experts-layer"])
    assert len(moe) >= 8 and all("/" in d["_path"] for d in moe)      # bench/ subfolders are found
    newest = results.load_results("packed_metadata", newest_run=True)
    assert newest and len({results.run_of(d) for d in newest}) == 1


def test_regime_points_are_one_per_configuration():
    points = results.packed_regime()
    keys = [(p["model"], p.get("num_layers"), p["backend"], p["mix"], p["tokens_per_step"]) for p in points]
    assert points and len(keys) == len(set(keys))
