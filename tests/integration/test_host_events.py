"""fastsft_lab.step_profile reads a profile's host events from kineto's own records (host_events), not through
torch's ``profile.events()``: the same events, the same nesting and the same kernels, placed and classified alike,
at a fraction of the cost (what makes one profiled step per chain step affordable at full depth)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from fastsft_lab.data import benchmark_batches
from fastsft_lab.lab.harness import Variant, make_optimizer, run_step
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.profiling import PhaseTimer
from fastsft_lab.roofline import Peaks
from fastsft_lab.step_profile import (StepRecorder, classify_kernels, host_events, kernels_of, layer_paths,
                                      profile_of)

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
PEAKS = Peaks({"16-bit": 1e12, "tf32": 1e11, "fp32": 1e11}, 5e10, "test peaks")


def _recorded(device: str, preset: str = "tiny-gpt-oss"):
    """One warm training step of a tiny MoE model with LoRA and checkpointing (forward, recompute, backward,
    optimizer) under the step recorder, stopped without a result."""
    model = build_model(preset, device=device, lora=LoraSettings(rank=4), num_layers=2, gradient_checkpointing=True)
    batch = benchmark_batches(tokens_per_step=256, row_tokens=128, steps=1, vocab_size=model.config.vocab_size,
                              mix="short")[0].to(device)
    opt, timer, v = make_optimizer(model), PhaseTimer(device), Variant("stock")
    run_step(model, batch, v, mode="train", optimizer=opt, timer=timer)
    timer.collect()
    rec = StepRecorder(model, device).start()
    with rec.step():
        run_step(model, batch, v, mode="train", optimizer=opt, timer=timer)
    rec.close()
    timer.collect()
    return model, rec.prof


def _signature(k):
    return k.name, round(k.start, 3), round(k.end, 3), k.op, k.where, k.flops, k.nbytes, k.precision, k.bound


def test_host_events_are_torchs_events_nested_alike():
    _, prof = _recorded("cpu")
    ours, theirs = host_events(prof), [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]

    def sig(e):
        parent = e.cpu_parent
        return (e.name, round(e.time_range.start, 3), round(e.time_range.end, 3), e.id, e.thread, e.fwd_thread,
                e.sequence_nr, e.is_async, parent.name if parent else None,
                round(parent.time_range.start, 3) if parent else None, len(e.cpu_children))

    assert Counter(map(sig, ours)) == Counter(map(sig, theirs))
    assert any(e.cpu_parent is not None and e.sequence_nr >= 0 for e in ours)          # nested, backward-linked
    op = next(e for e in ours if e.name == "aten::mm")
    assert op.input_shapes and op.input_dtypes and isinstance(op.concrete_inputs, list)


def _classified(device: str):
    """A recorded step's kernels, classified, read from kineto's records (ours) and from torch's events (theirs)."""
    model, prof = _recorded(device)
    layers = layer_paths(model)
    ours, _ = kernels_of(prof, layers, cuda=device == "cuda")
    theirs, _ = kernels_of(prof, layers, cuda=device == "cuda", events=prof.events())
    classify_kernels(ours, PEAKS)
    classify_kernels(theirs, PEAKS)
    return model, prof, ours, theirs


def test_the_kernels_are_placed_and_classified_as_from_torchs_events():
    model, prof, ours, theirs = _classified("cpu")
    assert len(ours) > 100 and Counter(map(_signature, ours)) == Counter(map(_signature, theirs))
    phases = {k.where.phase for k in ours}
    assert {"forward", "backward", "recompute"} <= phases                  # the walk reached every phase
    assert profile_of(prof, model, "cpu", peaks=PEAKS).busy_ms > 0


@pytest.mark.cuda
def test_on_a_gpu_the_kernels_are_placed_and_classified_as_from_torchs_events():
    _, _, ours, theirs = _classified("cuda")
    assert len(ours) == len(theirs) > 100
    # every kernel its launching op (the op's id in kineto's records), at least as often as through torch's events
    assert sum(k.op is None for k in ours) <= sum(k.op is None for k in theirs) <= 0.05 * len(ours)
    same = sum((Counter(map(_signature, ours)) & Counter(map(_signature, theirs))).values())
    assert same >= 0.99 * len(ours), (same, len(ours))
