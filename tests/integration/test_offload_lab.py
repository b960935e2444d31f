"""The lab's offload pieces: the timeline model and metrics, the CPU trace, the scenario (smoke)."""

from __future__ import annotations

import pytest

from fastsft_lab import offload as O
from fastsft_lab.structure import decoder_layers

from _offload_helpers import _batch, _enable, _model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# --- timeline helpers ----------------------------------------------------------------------------------------------
def test_schedule_model_and_overlap_metrics():
    from fastsft_lab.lab.timelines import copy_overlap, simulate_schedule, span_ms

    one = simulate_schedule(6, fwd_ms=10, bwd_ms=20, copy_ms=8, buffers=1)
    two = simulate_schedule(6, fwd_ms=10, bwd_ms=20, copy_ms=8, buffers=2)
    # one buffer: every reload but the first waits for the previous backward -> 5 exposed copies
    assert span_ms(one) - span_ms(two) == pytest.approx(5 * 8)
    o1, o2 = copy_overlap(one), copy_overlap(two)
    assert o1["h2d_hidden_ms"] == 0 and o2["h2d_hidden_ms"] == pytest.approx(5 * 8)
    assert o1["d2h_hidden_share"] == 1.0
    assert o1["reload_stall_ms"] == pytest.approx(6 * 8) and o2["reload_stall_ms"] == pytest.approx(8)


def test_cpu_trace_records_every_copy_and_layer():
    model = _model("tiny-qwen3", True)
    manager = _enable(model)
    try:
        with manager.tracing() as tr:
            model(**_batch().model_inputs()).loss.backward()
        ev = tr.events()
        model.zero_grad(set_to_none=True)
    finally:
        O.disable_offloaded_checkpointing(model)
    n = len(decoder_layers(model))
    kinds = [e["kind"] for e in ev]
    assert kinds.count("fwd") == kinds.count("bwd") == kinds.count("d2h") == kinds.count("h2d") == n
    assert all(e["end_ms"] >= e["start_ms"] for e in ev)
    assert [e["layer"] for e in ev if e["kind"] == "bwd"] == list(range(n - 1, -1, -1))


def test_per_layer_means_average_each_kind_and_leave_out_kinds_without_events():
    from fastsft_lab.lab.timelines import per_layer_means

    ev = [{"kind": "fwd", "start_ms": 0.0, "end_ms": 2.0}, {"kind": "fwd", "start_ms": 2.0, "end_ms": 6.0},
          {"kind": "h2d", "start_ms": 6.0, "end_ms": 6.5}, {"kind": "bwd", "start_ms": 7.0, "end_ms": 10.0}]
    assert per_layer_means(ev) == {"fwd": 3.0, "bwd": 3.0, "h2d": 0.5}          # no d2h event: no d2h mean
    assert per_layer_means(ev, kinds=("h2d",)) == {"h2d": 0.5}


# --- the scenario (smoke) ------------------------------------------------------------------------------------------
def test_bench_scenario_smoke(tmp_path):
    from fastsft_lab.lab.scenarios import run_scenario

    results = run_scenario("offload", device="cpu", smoke=True, out_dir=str(tmp_path), steps=1, warmup=0,
                           progress=False, tokens=[128], variants=["standard", "offload1", "offload2p"],
                           count_syncs=False)
    assert len(results) == 1
    names = [r["name"] for r in results[0]["variants"]]
    assert names == ["checkpointing (standard)", "offload x1 (single buffer)", "offload x2 + prefetch"]
    assert all(r["note"] for r in results[0]["variants"])
    assert (tmp_path / "offload-tiny-qwen3-128.json").exists() and (tmp_path / "offload-tiny-qwen3-128.png").exists()
    with pytest.raises(ValueError, match="unknown option.*bogus"):
        run_scenario("offload", device="cpu", smoke=True, out_dir=str(tmp_path), bogus=1)
