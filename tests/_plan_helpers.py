"""Shared by the memory-plan tests: a tiny model per configuration, a packed batch, one step's loss and gradients,
and their bitwise comparison."""

from __future__ import annotations

import torch

from fastsft_lab.data import benchmark_batches
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.offload import plan as P

GiB = P.GiB


def _batch(tokens=192, row=96, vocab=256, seed=0):
    return benchmark_batches(tokens_per_step=tokens, row_tokens=row, steps=1, vocab_size=vocab, mix="short",
                             seed=seed)[0].model_inputs()


def _step(model, inputs, seed=0):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**inputs).loss
    loss.backward()
    grads = {n.removeprefix("_orig_mod."): p.grad.detach().clone() for n, p in model.named_parameters()
             if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_bitwise(ref, got):
    (l0, g0), (l1, g1) = ref, got
    assert set(g0) == set(g1), "a different set of parameters received gradients"
    torch.testing.assert_close(l1, l0, rtol=0, atol=0)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


_MODELS: dict = {}


def _model(preset, lora=True, dropout=0.0, num_layers=4):
    key = (preset, lora, dropout, num_layers)
    if key not in _MODELS:
        m = build_model(preset, device="cpu", dtype=torch.float32, num_layers=num_layers,
                        lora=LoraSettings(rank=4, dropout=dropout) if lora else None)
        m.train()
        _MODELS[key] = m
    return _MODELS[key]
