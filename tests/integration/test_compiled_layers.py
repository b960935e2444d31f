"""Regional compile (every decoder layer compiled in place, as Unsloth does) on top of the all-fast path: the same
loss and gradients as the eager all-fast step, and one set of graphs for batches of any segment count (packed
attention runs eager between the compiled regions, so a new batch never recompiles)."""

from __future__ import annotations

import pytest
import torch

from fastsft_lab.data import benchmark_batches
from fastsft_lab.lab.scenarios.combined import (build_combined_model, combined_variants, compile_layers,
                                                uncompile_layers)
from fastsft_lab.models import get_preset
from fastsft_lab.structure import decoder_layers


def _step(model, variant, batch):
    model.zero_grad(set_to_none=True)
    variant.enable(model)
    try:
        loss = model(**variant.inputs(batch, None)).loss
        loss.backward()
    finally:
        variant.disable(model)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# float32: the compiled step equals the eager one to float32 rounding; GPT-OSS in bfloat16 (the sync-free grouped
# matmul traces in bfloat16 only), where inductor's fused kernels round differently from eager's: bf16 tolerances.
# GPT-OSS in float32: the grouped matmul cannot be traced in float32 (its shape function takes bf16), so sync_free
# falls back to grouped inside the compiled layer, with a warning, and still equals the eager step.
CASES = [("tiny-qwen3", "varlen", torch.float32), ("tiny-qwen3", "sdpa", torch.float32),
         ("tiny-gpt-oss", "sdpa", torch.bfloat16), ("tiny-gpt-oss", "sdpa", torch.float32)]


@pytest.mark.inductor
@pytest.mark.parametrize("preset,backend,dtype", CASES, ids=[f"{p}-{b}-{str(d)[6:]}" for p, b, d in CASES])
def test_compiled_layers_match_all_fast_and_never_recompile_for_a_new_batch(preset, backend, dtype, one_cpu_thread):
    _check(preset, backend, dtype, torch.device("cpu"))


# On a GPU: flash varlen attention stays eager between the compiled regions, and for GPT-OSS the sync-free experts'
# Triton gate and combine kernels are traced into the graph.
CUDA_CASES = [("tiny-qwen3", "varlen"), ("tiny-gpt-oss", "varlen")]


@pytest.mark.cuda
@pytest.mark.parametrize("preset,backend", CUDA_CASES, ids=[f"{p}-{b}" for p, b in CUDA_CASES])
def test_cuda_compiled_layers_match_all_fast_and_never_recompile(preset, backend):
    _check(preset, backend, torch.bfloat16, torch.device("cuda"))


def _check(preset, backend, dtype, device):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_combined_model(get_preset(preset), num_layers=2, lora_rank=4, device=device).to(dtype)
    batches = [b.to(device) for b in benchmark_batches(
        tokens_per_step=256, row_tokens=128 if preset == "tiny-gpt-oss" else 256, steps=4,
        vocab_size=model.config.vocab_size, mix="short", seed=3)]
    assert len({b.num_sequences for b in batches}) > 1          # batches with different segment counts
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    variants = {v.name: v for v in combined_variants(model, is_moe=preset == "tiny-gpt-oss", which="core",
                                                     packed=backend, trl=False, compiled=True)}
    fast, compiled = variants["all fast"], variants["all fast + compiled layers"]
    assert compiled.toggles["compile_layers"] is True
    try:
        graphs = []
        for batch in batches:
            want_loss, want = _step(model, fast, batch)
            got_loss, got = _step(model, compiled, batch)
            torch.testing.assert_close(got_loss, want_loss, **tol)
            assert got.keys() == want.keys() and got
            for name in want:
                torch.testing.assert_close(got[name].float(), want[name].float(), **{**tol, "rtol": 10 * tol["rtol"]},
                                           msg=name)
            graphs.append(counters["stats"]["unique_graphs"])
        assert graphs[0] > 0 and graphs[-1] == graphs[0], graphs    # compiled once, for the first batch only
        assert all(layer._compiled_call_impl is None for layer in decoder_layers(model))   # disable undid it
        kept = [layer._fastsft_compiled_call for layer in decoder_layers(model)]   # made once, on the first enable
        assert compile_layers(model) == 2 and [layer._compiled_call_impl for layer in decoder_layers(model)] == kept
        uncompile_layers(model)
        assert all(layer._compiled_call_impl is None for layer in decoder_layers(model))
    finally:
        uncompile_layers(model)
        torch._dynamo.reset()


def test_packed_metadata_is_a_plain_object_to_dynamo():
    """A frozen dataclass passed into a compiled region is a constant to torch 2.11's dynamo: it builds every field
    and guards on it (the segment count, the cached device tensors), and a compiled decoder layer then recompiled
    for every batch until it hit the recompile limit (seen on the H200). PackedMetadata is read-only without being
    a frozen dataclass, so dynamo sees a plain object and guards on its type only."""
    from torch._dynamo.utils import is_frozen_dataclass

    from fastsft_lab.packing import PackedMetadata

    meta = PackedMetadata.from_lengths([[3, 5, 2]])
    assert not is_frozen_dataclass(meta)
