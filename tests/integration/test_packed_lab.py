"""The lab's packed scenario (smoke) and the variants notebook 00 uses."""

from __future__ import annotations

import json

import pytest

from fastsft_lab.packing import packed_attention_state

from _packed_helpers import make_model


def test_bench_scenario_smoke(tmp_path):
    from fastsft_lab.lab.scenarios import run_scenario

    # scalars, as `--set packed.tokens=256` gives them
    results = run_scenario("packed", device="cpu", smoke=True, out_dir=str(tmp_path), steps=1, warmup=0,
                           progress=False, models="tiny-qwen3", backends="sdpa", tokens=256)
    assert len(results) == 1
    rows = {r["name"]: r for r in results[0]["variants"]}
    assert set(rows) == {"sdpa naive", "sdpa cached", "sdpa cached (collated)", "sdpa oracle", "stock sdpa"}
    assert rows["sdpa naive"]["host_syncs_in_layers"] >= 3
    assert rows["sdpa cached"]["host_syncs_in_layers"] == 0 and rows["sdpa oracle"]["host_syncs_per_step"] == 0
    # metadata objects built inside one step: the naive path per layer, twice under checkpointing (3 layers); the
    # cached path one device copy and one mask; the oracle none (prebuilt); stock transformers' own masks are not ours
    assert rows["sdpa naive"]["metadata_builds_per_step"] == 2 * 3
    assert rows["sdpa cached"]["metadata_builds_per_step"] == 2 and rows["sdpa oracle"]["metadata_builds_per_step"] == 0
    assert rows["stock sdpa"]["metadata_builds_per_step"] is None
    assert rows["sdpa cached (collated)"]["host_syncs_per_step"] == 0
    assert {"cached_vs_oracle_step", "collated_vs_oracle_step", "collated_step_speedup"} <= set(results[0]["speedups"])
    assert all(r["note"] for r in rows.values())
    assert (tmp_path / "packed_tiny-qwen3_256_short_sdpa.json").exists()
    assert (tmp_path / "packed_regime.png").exists()
    with pytest.raises(ValueError, match="unknown packed-attention backend"):
        run_scenario("packed", device="cpu", smoke=True, out_dir=str(tmp_path), backends=["nope"])
    with pytest.raises(ValueError, match="unknown option.*token.*valid: .*tokens"):
        run_scenario("packed", device="cpu", smoke=True, out_dir=str(tmp_path), token=128)


def test_bench_scenario_records_a_configuration_whose_variants_all_fail_and_goes_on(tmp_path, monkeypatch):
    # A configuration whose variants all fail (e.g. flex at a second row length after transformers' own flex
    # compile) keeps its JSON and must not stop the run before the next token count.
    import fastsft_lab.lab.scenarios.packed as P
    from fastsft_lab.lab.harness import Variant
    from fastsft_lab.lab.scenarios import run_scenario

    real = P.packed_variants
    calls = []

    def first_config_broken(model, backend, device, **kwargs):
        calls.append(backend)
        if len(calls) > 1:
            return real(model, backend, device, **kwargs)

        def broken(batch, state=None):
            raise RuntimeError("could not compile")
        return [Variant("a", inputs=broken), Variant("b", inputs=broken)]

    monkeypatch.setattr(P, "packed_variants", first_config_broken)
    results = run_scenario("packed", device="cpu", smoke=True, out_dir=str(tmp_path), steps=1, warmup=0,
                           progress=False, models="tiny-qwen3", backends="sdpa", tokens=[256, 512])
    assert len(results) == 2 and len(calls) == 2
    failed = json.loads((tmp_path / "packed_tiny-qwen3_256_short_sdpa.json").read_text())
    assert all(v["error"].startswith("RuntimeError: could not compile") for v in failed["variants"])
    assert not (tmp_path / "packed_tiny-qwen3_256_short_sdpa.png").exists()
    assert (tmp_path / "packed_tiny-qwen3_512_short_sdpa.png").exists()


def test_naive_variants_for_notebook_00():
    from fastsft_lab.lab.scenarios.packed import naive_variants

    model = make_model("tiny-qwen3")
    (variant,) = naive_variants(model, backends=["sdpa"])
    assert variant.name == "sdpa naive" and variant.toggles["packed_metadata_cache"] is False
    variant.enable(model)
    try:
        assert packed_attention_state(model)["cache"] is False
    finally:
        variant.disable(model)
    assert packed_attention_state(model) is None
