"""Shared by the offload tests (tests/*/test_offload_*.py): the batches and tiny models they run, one training step's
loss and gradients with standard or offloaded checkpointing, the exact comparison, and stream operations whose second
staging allocation fails (the OOM fallback)."""

from __future__ import annotations

import weakref

import torch

from fastsft_lab import offload as O
from fastsft_lab.data import benchmark_batches
from fastsft_lab.offload import CheckpointingSwitch, StreamOps
from fastsft_lab.models import LoraSettings, build_model


MODES = [(1, False), (2, False), (2, True)]
MODE_IDS = ["x1", "x2", "x2-prefetch"]


def _batch(tokens=192, row=96, vocab=256, seed=0):
    return benchmark_batches(tokens_per_step=tokens, row_tokens=row, steps=1, vocab_size=vocab, mix="short",
                             seed=seed)[0]


def _step(model, inputs, seed=0):
    """loss and every trainable gradient of one forward + backward (fresh grads)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(**inputs).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_same(ref, got, exact=True):
    (l0, g0), (l1, g1) = ref, got
    assert set(g0) == set(g1), "a different set of parameters received gradients"
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l1, l0, **tol)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], **tol, msg=lambda m, n=name: f"{n}: {m}")


def _enable(model, *args, **kwargs):
    """enable_offloaded_checkpointing, returning the model's manager (the switch returns the model's state)."""
    O.enable_offloaded_checkpointing(model, *args, **kwargs)
    return O.offload_manager(model)


def _standard(model, inputs, seed=0):
    switch = CheckpointingSwitch(model)
    switch.enable()
    try:
        return _step(model, inputs, seed)
    finally:
        switch.disable()


def _offloaded(model, inputs, buffers, prefetch, seed=0, streams=None):
    manager = _enable(model, buffers=buffers, prefetch=prefetch, streams=streams)
    try:
        out = _step(model, inputs, seed)
        assert manager.pending == 0, "registry not emptied by the backward"
        assert manager.pool.in_use == 0, "pool slots not returned after the backward"
        return out
    finally:
        O.disable_offloaded_checkpointing(model)


_MODELS: dict = {}


def _model(preset, lora, quant=None, dropout=0.0, num_layers=None):
    key = (preset, lora, quant, dropout, num_layers)
    if key not in _MODELS:
        m = build_model(preset, device="cpu", dtype=torch.float32, quant=quant, num_layers=num_layers,
                        lora=LoraSettings(rank=4, dropout=dropout) if lora else None)
        m.train()
        _MODELS[key] = m
    return _MODELS[key]


class SecondBufferFails(StreamOps):
    """Stream operations whose staging allocation fails whenever another staging buffer is alive (the second one).

    Which slot is allocated first depends on the parity of the layer count (the first backward is the last
    layer, slot = seq % 2): a fake that only failed on slot 1 would never fire on a 6-layer model.
    """

    def __init__(self, device, calls=None):
        super().__init__(device)
        self.calls = calls
        self._alive = weakref.WeakSet()

    def allocate(self, nbytes, stream):
        if self.calls is not None:
            self.calls.append(nbytes)
        if len(self._alive):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 84.00 MiB (injected)")
        buf = super().allocate(nbytes, stream)
        self._alive.add(buf)
        return buf


def graph_tensors(besides=()) -> list[torch.Tensor]:
    """Every live tensor that is part of an autograd graph (has a ``grad_fn``), leaving out those of ``besides`` (an
    earlier call's). After a step whose outputs were dropped no new one is left, with or without a backward; one
    that survives is held by something that should have let go (a cycle through autograd's C++ nodes, which no
    garbage collection frees)."""
    import gc
    import warnings

    old = {id(t) for t in besides}
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # isinstance on some modules' deprecated attributes warns
        return [o for o in gc.get_objects()
                if isinstance(o, torch.Tensor) and o.grad_fn is not None and id(o) not in old]


def assert_dropped_forwards_leave_nothing(model, inputs: dict, times: int = 2) -> None:
    """Compute the loss under grad ``times`` times and drop it without a backward (a validation loss outside
    ``no_grad``): no tensor of those forwards' graphs may stay alive."""
    before = graph_tensors()                  # (an earlier test's, if any)
    for _ in range(times):
        loss = model(**inputs).loss
        assert loss.requires_grad
        del loss
    leaked = graph_tensors(besides=before)
    assert leaked == [], f"{len(leaked)} tensors of dropped forwards stay alive"
