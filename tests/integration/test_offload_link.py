"""The link-pacing emulation of the ``offload_link`` scenario: its arithmetic, that a paced copy keeps the stream
order and the numbers, the timeline-model glue, and the scenario in smoke mode. CUDA: the paced bandwidth."""

from __future__ import annotations

import json

import pytest
import torch

from fastsft_lab import offload as O
from fastsft_lab.data import benchmark_batches
from fastsft_lab.lab.scenarios.offload_link import (LinkPacer, PacedStreamOps, crossing, link_measured,
                                                    model_step_ms, pace_plan)
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.structure import decoder_layers
from fastsft_lab.offload import StreamOps, check_stream_order

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
MODES = [(1, False), (2, False), (2, True)]
MODE_IDS = ["x1", "x2", "x2-prefetch"]
CPU = torch.device("cpu")


# --- pacing arithmetic -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes,chunk", [(1, 8), (8, 8), (64, 8), (67, 8), (20 * 2**20 + 3, 8 * 2**20)])
def test_pace_plan_chunks_cover_the_copy_exactly(nbytes, chunk):
    plan = pace_plan(nbytes, target_gbps=10.0, native_gbps=50.0, chunk_bytes=chunk, cycles_per_ms=1e6)
    assert len(plan) == -(-nbytes // chunk)
    pos = 0
    for off, size, _ in plan:
        assert off == pos and 0 < size <= chunk
        pos += size
    assert pos == nbytes
    assert all(size == chunk for _, size, _ in plan[:-1])


def test_pace_plan_pad_makes_each_chunk_take_bytes_over_target():
    plan = pace_plan(20 * 2**20 + 3, target_gbps=12.0, native_gbps=55.0, chunk_bytes=8 * 2**20)
    for _, size, pad in plan:
        # the chunk and its dummy bytes cross the 55 GB/s link in the time the chunk alone takes at 12 GB/s
        assert (size + pad) / 55e9 == pytest.approx(size / 12e9, abs=1 / 55e9)
    assert plan[0][2] == round(8 * 2**20 * (55 / 12 - 1))          # 3.58x the chunk in dummy bytes


def test_pace_plan_sleep_makes_each_chunk_take_bytes_over_target():
    cpm = 1.98e6                                    # cycles per ms of a 1.98 GHz SM clock
    plan = pace_plan(20 * 2**20 + 3, target_gbps=12.0, native_gbps=55.0, chunk_bytes=8 * 2**20, method="sleep",
                     cycles_per_ms=cpm)
    for _, size, cycles in plan:
        assert size / 55e9 * 1e3 + cycles / cpm == pytest.approx(size / 12e9 * 1e3, abs=1 / cpm)
    # an 8 MiB chunk at 12 GB/s behind a 55 GB/s link: 0.699 ms - 0.153 ms = 0.546 ms of sleep
    assert plan[0][2] == pytest.approx(0.5465 * cpm, rel=1e-3)


@pytest.mark.parametrize("method", ["pad", "sleep"])
def test_pace_plan_native_and_faster_than_native(method):
    kw = dict(native_gbps=50.0, chunk_bytes=64, method=method, cycles_per_ms=1e6)
    assert pace_plan(1000, target_gbps=None, **kw) == [(0, 1000, 0)]
    plan = pace_plan(1000, target_gbps=80.0, **kw)
    assert len(plan) == 16 and all(c == 0 for _, _, c in plan)      # a link cannot be sped up
    assert pace_plan(0, target_gbps=10.0, **kw) == []
    for bad in (dict(chunk_bytes=0), dict(target_gbps=0.0), dict(method="bogus")):
        with pytest.raises(ValueError):
            pace_plan(100, **(dict(kw, target_gbps=10.0) | bad))
    with pytest.raises(ValueError, match="cycles_per_ms"):
        pace_plan(100, target_gbps=10.0, native_gbps=50.0, chunk_bytes=64, method="sleep", cycles_per_ms=None)


def test_pacer_uses_each_directions_native_bandwidth():
    pad = LinkPacer(10.0, {"d2h": 20.0, "h2d": 40.0}, chunk_bytes=10**6)
    assert pad.plan(10**6, "d2h") == [(0, 10**6, 10**6)] and pad.plan(10**6, "h2d") == [(0, 10**6, 3 * 10**6)]
    sleep = LinkPacer(10.0, {"d2h": 20.0, "h2d": 40.0}, cycles_per_ms=1e6, chunk_bytes=10**6, method="sleep")
    assert sleep.plan(10**6, "d2h") == [(0, 10**6, round(0.05 * 1e6))]
    assert sleep.plan(10**6, "h2d") == [(0, 10**6, round(0.075 * 1e6))]


# --- the paced StreamOps on a tiny model (CPU: chunked, not delayed) ------------------------------------------------
_MODEL: dict = {}


def _model():
    if "m" not in _MODEL:
        m = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4))
        m.train()
        _MODEL["m"] = m
    return _MODEL["m"]


def _inputs():
    return benchmark_batches(tokens_per_step=192, row_tokens=96, steps=1, vocab_size=256, mix="short")[0].model_inputs()


class _RecordingPaced(PacedStreamOps):
    """Records the delays asked for (a CPU issues none)."""

    def __init__(self, device, pacer):
        super().__init__(device, pacer)
        self.delays: list[int] = []
        self.sizes: list[tuple[str, int]] = []

    def delay(self, kind, extra):
        self.delays.append(extra)
        super().delay(kind, extra)

    def copy(self, stream, dst, src, reads, writes, kind, layer, seq):
        self.sizes.append((kind, src.numel() * src.element_size()))
        super().copy(stream, dst, src, reads, writes, kind, layer, seq)


def _pacer(target=6.0, chunk=5000, method="pad"):
    # 192 tokens x 64 hidden x 4 bytes = 48 KiB per layer input: 10 chunks of 5000 bytes (the last one shorter)
    return LinkPacer(target, {"d2h": 50.0, "h2d": 40.0}, cycles_per_ms=1.5e6, chunk_bytes=chunk, method=method)


def _step(model, inputs, buffers, prefetch, streams):
    O.enable_offloaded_checkpointing(model, buffers, prefetch, streams=streams)
    try:
        manager = O.offload_manager(model)
        manager.stream_log = []
        model.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        loss = model(**inputs).loss
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        log = list(manager.stream_log)
        assert manager.pending == 0 and manager.pool.in_use == 0
        return loss.detach(), grads, log
    finally:
        O.disable_offloaded_checkpointing(model)
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("method", ["pad", "sleep"])
@pytest.mark.parametrize("buffers,prefetch", MODES, ids=MODE_IDS)
def test_paced_offload_is_bit_identical_and_keeps_the_stream_order(buffers, prefetch, method):
    model, inputs = _model(), _inputs()
    loss0, g0, log0 = _step(model, inputs, buffers, prefetch, StreamOps(CPU))
    paced = _RecordingPaced(CPU, _pacer(method=method))
    loss1, g1, log1 = _step(model, inputs, buffers, prefetch, paced)
    layers = len(decoder_layers(model))
    assert paced.copies == {"d2h": layers, "h2d": layers}
    assert paced.chunks == 2 * layers * 10, "the copies were not chunked: the test would not see a slicing bug"
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    assert set(g1) == set(g0) and g0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert log1 == log0, "pacing changed the logged stream operations"
    assert check_stream_order(log1) == []


@pytest.mark.parametrize("method", ["pad", "sleep"])
def test_paced_copies_ask_for_the_planned_delays(method):
    model, inputs = _model(), _inputs()
    pacer = _pacer(method=method)
    paced = _RecordingPaced(CPU, pacer)
    _step(model, inputs, 2, True, paced)
    want = [c for kind, n in paced.sizes for _, _, c in pacer.plan(n, kind)]
    assert paced.delays == want and all(c > 0 for c in want)
    assert (paced.pad_bytes, paced.sleep_cycles) == ((sum(want), 0) if method == "pad" else (0, sum(want)))
    assert paced.counts()["copy_bytes"] == {"d2h": sum(n for k, n in paced.sizes if k == "d2h"),
                                            "h2d": sum(n for k, n in paced.sizes if k == "h2d")}


def test_native_pacer_is_the_unpaced_copy():
    model, inputs = _model(), _inputs()
    paced = _RecordingPaced(CPU, _pacer(target=None))
    _step(model, inputs, 2, True, paced)
    assert paced.delays == [] and paced.chunks == sum(paced.copies.values())


# --- timeline-model glue -------------------------------------------------------------------------------------------
def test_model_step_ms_exposes_the_copies_each_design_cannot_hide():
    inputs = {"num_layers": 8, "fwd_ms": 20.0, "bwd_ms": 50.0, "head_ms": 30.0, "plain_step_ms": 700.0,
              "layer_bytes": 84 * 10**6}
    assert model_step_ms(inputs, 0.0, 1) == pytest.approx(700.0)
    assert model_step_ms(inputs, 0.0, 2) == pytest.approx(700.0)
    # copy shorter than a layer forward and than the head: x1 exposes every reload but the first (which overlaps
    # the head), x2 hides them all
    assert model_step_ms(inputs, 5.0, 1) == pytest.approx(700.0 + 7 * 5.0)
    assert model_step_ms(inputs, 5.0, 2) == pytest.approx(700.0)
    # a full-depth model adds the layers' compute: 32 more x (fwd + bwd)
    assert model_step_ms(inputs, 5.0, 1, num_layers=40) == pytest.approx(700.0 + 32 * 70.0 + 39 * 5.0)
    # copies longer than a backward: even x2 is copy-bound
    assert model_step_ms(inputs, 80.0, 2) > 700.0 + 7 * 20.0


def test_crossing_interpolates_in_log_bandwidth():
    pts = [(55.0, 0.02), (25.0, 0.04), (12.0, 0.08), (6.0, 0.15)]
    b = crossing(pts, 0.067)
    assert 12.0 < b < 25.0
    assert b == pytest.approx(25.0 * (12.0 / 25.0) ** ((0.067 - 0.04) / 0.04), rel=1e-3)
    assert crossing(pts, 0.01) == 55.0              # already there at the fastest link
    assert crossing(pts, 0.5) is None               # never reached
    assert crossing(list(reversed(pts)), 0.067) == b


def test_link_measured_is_bytes_over_copy_stream_time():
    ev = [{"kind": "d2h", "start_ms": 0.0, "end_ms": 2.0}, {"kind": "d2h", "start_ms": 5.0, "end_ms": 7.0},
          {"kind": "h2d", "start_ms": 10.0, "end_ms": 11.0}, {"kind": "bwd", "start_ms": 0.0, "end_ms": 50.0}]
    m = link_measured(ev, {"copy_bytes": {"d2h": 40 * 10**6, "h2d": 10 * 10**6}})
    assert m["d2h_gbps"] == pytest.approx(10.0) and m["h2d_gbps"] == pytest.approx(10.0)
    assert m["d2h_copy_ms_median"] == 2.0 and m["h2d_copy_ms_median"] == 1.0 and m["copy_ms_per_layer"] == 1.5


# --- the scenario ------------------------------------------------------------------------------------------------
def test_scenario_smoke_produces_every_variant(tmp_path):
    from fastsft_lab.lab.scenarios import SCENARIOS, run_scenario

    assert "offload_link" in SCENARIOS
    (result,) = run_scenario("offload_link", device="cpu", smoke=True, out_dir=str(tmp_path), steps=1, warmup=0,
                             progress=False)
    names = [v["name"] for v in result["variants"]]
    assert names == ["checkpointing (standard)", "offload x1 @ native", "offload x2 + prefetch @ native",
                     "offload x1 @ 12 GB/s chunks, unpaced (CPU)", "offload x2 + prefetch @ 12 GB/s chunks, unpaced (CPU)",
                     "offload x1 @ 3 GB/s chunks, unpaced (CPU)", "offload x2 + prefetch @ 3 GB/s chunks, unpaced (CPU)"]
    rows = {v["name"]: v for v in result["variants"]}
    assert not [n for n, v in rows.items() if "error" in v], {n: v["error"] for n, v in rows.items() if "error" in v}
    cfg = result["config"]
    per_step = 2 * cfg["num_layers"] * cfg["layer_input_bytes"]
    for name in names[1:]:
        link = rows[name]["link"]
        assert link["copy_bytes_per_step"] == per_step
        assert link["paced"] is False and "measured" not in link          # a CPU measures no link
        assert "model_step_ms" in rows[name] and "copy_overlap" in rows[name]
    assert rows["offload x1 @ 3 GB/s chunks, unpaced (CPU)"]["link"]["chunks"] > \
        rows["offload x1 @ native"]["link"]["chunks"]
    assert [p["target_gbps"] for p in result["points"]] == [None, 12.0, 3.0]
    assert all("gain_x2_vs_x1" in p and "model_gain_x2_vs_x1" in p for p in result["points"])
    assert result["model_inputs"]["num_layers"] == cfg["num_layers"]
    assert "native_link_gbps" not in result["derived"] and "note" in result["derived"]
    on_disk = json.loads((tmp_path / "offload-link-tiny-qwen3-256.json").read_text())
    assert on_disk["scenario"] == "offload_link" and len(on_disk["variants"]) == len(names)
    assert (tmp_path / "offload-link-tiny-qwen3-256.png").exists()


@pytest.mark.parametrize("bad", [{"bandwidths": [12, -1]}, {"modes": ["offload3"]}, {"chunk_bytes": 0},
                                 {"bogus": 1}])
def test_scenario_rejects_bad_options(tmp_path, bad):
    from fastsft_lab.lab.scenarios import run_scenario

    with pytest.raises(ValueError):
        run_scenario("offload_link", device="cpu", smoke=True, out_dir=str(tmp_path), **bad)


# --- CUDA ------------------------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.exclusive
@pytest.mark.parametrize("target", [25.0, 12.0, 6.0])
def test_cuda_paced_copy_reaches_its_target_bandwidth(target):
    # the default method (pad); the sleep method depends on SM clocks and is not held to this (module docstring)
    from fastsft_lab.lab.scenarios.offload_link import measure_chunked_bandwidth, paced_copy_gbps

    dev = torch.device("cuda", torch.cuda.current_device())
    chunk = 8 << 20
    native = measure_chunked_bandwidth(dev, chunk)
    pacer = LinkPacer(target, native, chunk_bytes=chunk)
    for kind in ("h2d", "d2h"):
        got = paced_copy_gbps(dev, pacer, kind)
        assert got == pytest.approx(target, rel=0.15), (kind, got, target, native)


@pytest.mark.cuda
def test_cuda_scenario_tiny(tmp_path):
    from fastsft_lab.lab.scenarios import run_scenario

    (result,) = run_scenario("offload_link", device="cuda", smoke=True, out_dir=str(tmp_path), steps=1, warmup=1,
                             progress=False)
    rows = {v["name"]: v for v in result["variants"]}
    assert not [n for n, v in rows.items() if "error" in v]
    paced = rows["offload x2 + prefetch @ 3 GB/s"]["link"]
    assert paced["paced"] and paced["measured"]["gbps"] and paced["pad_bytes"] > 0
    assert result["derived"]["native_link_gbps"] > 3
