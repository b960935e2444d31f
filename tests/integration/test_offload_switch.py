"""The offload and standard checkpointing switches: the exact way back, and clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fastsft_lab import offload as O
from fastsft_lab.offload import CheckpointingSwitch
from fastsft_lab.offload.checkpoint import LayerCheckpointFunc
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.structure import decoder_layers

from _offload_helpers import _batch, _step, _assert_same, _model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _attrs(model):
    return [(layer.__dict__.get("gradient_checkpointing", "<class>"),
             layer.__dict__.get("_gradient_checkpointing_func", "<class>")) for layer in decoder_layers(model)]


@pytest.mark.parametrize("start", ["no-checkpointing", "standard"])
def test_switch_restores_exactly(start):
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4),
                        gradient_checkpointing=start == "standard")
    model.train()
    before = _attrs(model)
    inputs = _batch().model_inputs()
    ref = _step(model, inputs)
    O.enable_offloaded_checkpointing(model, 1, False)
    O.enable_offloaded_checkpointing(model, 2, True)        # reconfigure while on: originals kept from the first
    assert O.is_offloaded(model)
    assert all(isinstance(f, LayerCheckpointFunc) for _, f in _attrs(model))
    _assert_same(ref, _step(model, inputs))
    O.disable_offloaded_checkpointing(model)
    after = _attrs(model)
    assert not O.is_offloaded(model)
    assert len(after) == len(before)
    for (g0, f0), (g1, f1) in zip(before, after):
        assert g0 == g1 and f0 is f1          # the very same function objects (or none, as before)
    _assert_same(ref, _step(model, inputs))
    O.disable_offloaded_checkpointing(model)    # a second disable is a no-op


def test_standard_switch_restores_hooks_and_attributes():
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4))
    inner = model.get_base_model()
    emb_hooks = dict(inner.get_input_embeddings()._forward_hooks)
    before = [(m, dict((k, m.__dict__.get(k)) for k in ("gradient_checkpointing", "_gradient_checkpointing_func")))
              for m in inner.modules() if hasattr(m, "gradient_checkpointing")]
    for offload in (False, True):
        switch = CheckpointingSwitch(model, offload=offload)
        switch.enable()
        assert any(m.gradient_checkpointing for m in decoder_layers(model))
        switch.disable()
        assert dict(inner.get_input_embeddings()._forward_hooks) == emb_hooks
        for m, d in before:
            assert all(m.__dict__.get(k) is v for k, v in d.items())
        assert "_require_grads_hooks" not in inner.__dict__


# --- errors --------------------------------------------------------------------------------------------------------
def test_bad_configuration_errors():
    model = _model("tiny-qwen3", True)
    with pytest.raises(ValueError, match="buffers must be 1"):
        O.enable_offloaded_checkpointing(model, buffers=3)
    with pytest.raises(ValueError, match="prefetch needs buffers=2"):
        O.enable_offloaded_checkpointing(model, buffers=1, prefetch=True)
    assert not O.is_offloaded(model)
    with pytest.raises(ValueError, match="cannot find decoder layers"):
        O.enable_offloaded_checkpointing(nn.Sequential(nn.Linear(2, 2)))
    manager = O.OffloadManager("cpu")
    with pytest.raises(ValueError, match="offloaded checkpointing was enabled for cpu"):
        manager.save(torch.empty(4, device="meta"), 0)


@pytest.mark.parametrize("switch", [{"offload_buffers": 2}, {"memory_budget": 16}], ids=["offload", "plan"])
@pytest.mark.parametrize("replace", ["enable", "disable"])
def test_checkpointing_replaced_after_apply_is_reported_and_warned_once(switch, replace):
    """Something that overwrites every layer's function after apply (transformers' own gradient_checkpointing_enable
    or _disable run from the class, past the guard that keeps the model's methods from it: tests/integration/test_plan_trainer.py):
    nothing is offloaded any more. state() must say what runs, the next training forward warns once, and apply() again
    puts the offload back."""
    import warnings

    import fastsft_lab

    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, num_layers=2, lora=LoraSettings(rank=4))
    model.train()
    batch = _batch().model_inputs()
    try:
        on = fastsft_lab.apply(model, **switch)
        assert on.checkpointing in ("offload", "plan") and O.displaced_layers(model) == 0
        inner = model.get_base_model()
        if replace == "enable":
            type(inner).gradient_checkpointing_enable(inner, gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            type(inner).gradient_checkpointing_disable(inner)
        now = fastsft_lab.state(model)
        assert O.displaced_layers(model) == 2
        assert now.checkpointing == ("standard" if replace == "enable" else "none")
        assert now.offload_buffers == 0 and now.memory_plan is None
        with pytest.warns(UserWarning, match="2 of 2 decoder layers no longer run its checkpointing"):
            _step(model, batch)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _step(model, batch)                                   # once
        assert fastsft_lab.apply(model, **switch).checkpointing == on.checkpointing
        saves = O.offload_manager(model).stats.saves
        _step(model, batch)
        assert O.displaced_layers(model) == 0 and O.offload_manager(model).stats.saves > saves
    finally:
        fastsft_lab.revert(model)
    from fastsft_lab.restore import log_of

    assert log_of(model) is None          # the watch (and every other change) goes with the switch
    assert not model.get_base_model()._forward_pre_hooks
