"""The evidence the notebooks print for offloaded checkpointing: gradient comparison, equivalence and transport
reports."""

from __future__ import annotations

import pytest
import torch

from fastsft_lab import evidence as EV
from fastsft_lab import offload as O
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.structure import decoder_layers

from _offload_helpers import _batch, _model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_compare_grads_names_the_worst_tensor():
    ref = (torch.tensor(2.0), {"a": torch.ones(4), "tiny": torch.full((4,), 1e-9), "b": torch.ones(2)})
    got = (torch.tensor(2.0), {"a": torch.ones(4) * 1.001, "tiny": torch.full((4,), 3e-6), "c": torch.ones(2)})
    rep = EV.compare_grads(ref, got, rtol=2e-2, atol=1e-6)
    assert not rep["ok"] and not rep["bitwise_equal"]
    assert rep["worst"]["name"] == "tiny" and rep["worst"]["scale"] == pytest.approx(1e-9)
    assert rep["failing"] == ["tiny"] and rep["missing"] == ["b", "c"]
    nan = EV.compare_grads(ref, (torch.tensor(float("nan")), ref[1]), rtol=1.0, atol=1.0)
    assert not nan["ok"] and nan["worst"]["name"] == "loss"


def test_check_equivalence_report_and_transport_on_cpu():
    model = _model("tiny-qwen3", True)
    inputs = _batch().model_inputs()
    eq = EV.check_equivalence(model, inputs, modes=[(2, True)])
    assert eq["offload x2 + prefetch"]["report"]["vs_standard"]["bitwise_equal"]
    text = EV.format_equivalence(eq)
    assert "offload x2 + prefetch" in text and "bitwise equal" in text
    for forward_grad in (True, False):
        tr = EV.check_transport(model, inputs, forward_grad=forward_grad)
        assert set(tr) == {"offload x1", "offload x2", "offload x2 + prefetch"}
        for mode, r in tr.items():
            n = len(decoder_layers(model))
            assert r["transport_ok"] and r["checked"] == 2 * n, (mode, r)
            assert r["forward_inputs_bitwise_equal"] and r["loss_abs_diff"] == 0, (mode, r)
    assert not O.is_offloaded(model)


def test_check_equivalence_forces_use_cache_off():
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4))
    model.config.use_cache = True                      # as a model loaded with from_pretrained has it
    eq = EV.check_equivalence(model, _batch().model_inputs(), modes=[(2, True)])
    assert eq["standard_vs_no_checkpointing"] and eq["offload x2 + prefetch"]["vs_no_checkpointing"]
