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
