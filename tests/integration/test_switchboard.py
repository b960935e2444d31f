"""The ipywidgets switchboard, driven from code on a CPU: its controls switch the live model, its runs record."""

import pytest
import torch

import fastsft_lab
from fastsft_lab.data import benchmark_batches
from fastsft_lab.lab.switchboard import Switchboard
from fastsft_lab.models import LoraSettings, build_model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def board():
    model = build_model("tiny-gpt-oss", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4),
                        gradient_checkpointing=True)
    batches = benchmark_batches(tokens_per_step=256, row_tokens=128, steps=2, vocab_size=256, mix="short")
    return Switchboard(model, batches)


def test_switches_apply_to_the_model_and_runs_record(board):
    fast = board.set(backend="sdpa", buffers=2, prefetch=True, moe="sync_free", fused_loss=True)
    state = fastsft_lab.state(board.model)
    assert (state.packed, state.packed_cache, state.offload_buffers, state.prefetch, state.moe_routing,
            state.fused_loss) == ("sdpa", True, 2, True, "sync_free", True)
    fast_run = board.run(2)
    board.set(cache=False, buffers=1, moe="naive", fused_loss=False)
    naive_run = board.run(2)
    assert fast_run["setting"] == fast.label() and fast_run["step_ms"]["n"] == 2
    assert naive_run["host_syncs_per_step"] > fast_run["host_syncs_per_step"]
    assert "sdpa naive" in board.table() and len(board.records) == 2
    fig = board.figure()
    assert len(fig.axes) == 3
    board.set(backend="off", buffers=0, moe="off")
    assert fastsft_lab.state(board.model).packed is None and fastsft_lab.state(board.model).moe_routing is None


def test_bad_switches_are_refused_and_leave_the_setting(board):
    before = board.setting
    with pytest.raises(ValueError, match="valid: off"):
        board.set(backend="turbo")
    with pytest.raises(ValueError, match="unknown switch"):
        board.set(speed="max")
    with pytest.raises(ValueError, match="steps"):
        board.run(0)
    assert board.setting == before


def test_widget_callbacks_drive_the_same_switches(board):
    ipywidgets = pytest.importorskip("ipywidgets")
    widgets = board._build(ipywidgets)
    board._widgets = widgets
    c = widgets["controls"]
    c["backend"].value = "sdpa"
    c["buffers"].value = 2
    assert fastsft_lab.state(board.model).offload_buffers == 2 and board.setting.backend == "sdpa"
    assert c["prefetch"].disabled is False
    c["buffers"].value = 1
    assert c["prefetch"].disabled is True
    widgets["steps"].value = 1
    widgets["button"].click()
    assert board.records[-1]["buffers"] == 1
    board.set(backend="off", buffers=0)
    assert c["backend"].value == "off"
    board._widgets = None


def test_one_at_a_time_flips_one_switch_per_run_and_says_what_it_changed(board):
    with pytest.raises(ValueError, match="one switch at a time"):
        board.one_at_a_time([{"cache": True, "buffers": 2}])
    n = len(board.records)
    board.set(backend="off", buffers=0, moe="off", fused_loss=False, cache=False)
    runs = board.one_at_a_time([{"backend": "sdpa"}, {"cache": True}, {"moe": "sync_free"}], steps=1)
    assert [r["changed"] for r in runs] == ["start: stock attn, ckpt", "backend: off -> sdpa", "cache: off -> on",
                                            "moe: off -> sync_free"]
    assert len(board.records) == n + 4 and board.setting.backend == "sdpa" and board.setting.moe == "sync_free"
    lines = board.changes_text().splitlines()
    cache = next(line for line in lines if line.startswith("cache: off -> on"))
    before, after = runs[1]["host_syncs_per_step"], runs[2]["host_syncs_per_step"]
    assert before > after and f"{before} -> {after}" in cache
    assert cache.split()[-1] == "–"                                  # no peak memory on a CPU: missing, not 0
    assert runs[1]["step_ms"]["median"] / runs[2]["step_ms"]["median"] == pytest.approx(
        float(cache.split()[5].rstrip("x")), abs=0.006)                # "x prev": the run before over this one
    fig = board.figure()
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()][-1] == "moe: off -> sync_free"
    assert any("not\nmeasured" in t.get_text() for t in fig.axes[2].texts)
    board.set(backend="off", buffers=0, moe="off", cache=True)


def test_breakdown_of_the_current_setting_splits_a_step_into_its_categories(board):
    board.set(backend="sdpa", buffers=2, moe="sync_free", fused_loss=True)
    bd = board.breakdown(steps=1)
    cats = {r["category"]: r["ms"] for r in bd["categories"]}
    assert bd["activity"] == "cpu" and bd["steps"] == 1 and bd["step_ms"] > 0
    assert cats["experts"] > 0 and cats["attention"] > 0
    assert sum(cats.values()) == pytest.approx(bd["step_ms"], rel=0.02)
    board.set(backend="off", buffers=0, moe="off", fused_loss=False)


def test_the_switchboard_runs_its_steps_under_the_autocast_it_is_given():
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4))
    batches = benchmark_batches(tokens_per_step=128, row_tokens=64, steps=1, vocab_size=256, mix="short")
    with pytest.raises(ValueError, match="autocast must be one of"):
        Switchboard(model, batches, autocast="bf15")
    seen = []
    proj = next(m for n, m in model.named_modules() if n.endswith("q_proj.base_layer"))
    handle = proj.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    for autocast, dtype in (("none", torch.float32), ("bf16", torch.bfloat16)):
        seen.clear()
        board = Switchboard(model, batches, autocast=autocast)
        board.run(1)
        assert set(seen) == {dtype}, (autocast, seen)
    handle.remove()
