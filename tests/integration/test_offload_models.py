"""Offloaded checkpointing on whole models: the same loss and gradients as standard checkpointing and as no
checkpointing at all (LoRA, full fine-tuning, QLoRA, dropout, autocast, packed rows, several forwards before one
backward, router aux loss, selective gradients), no added host syncs, packed metadata reused by the recompute."""

from __future__ import annotations

import gc

import pytest
import torch

from fastsft_lab import offload as O
from fastsft_lab.data import pack_examples, synthetic_corpus
from fastsft_lab.offload import CheckpointingSwitch
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.structure import decoder_layers
from fastsft_lab.profiling import SyncCounter

from _offload_helpers import MODES, MODE_IDS, _batch, _step, _assert_same, _enable, _standard, _offloaded, _model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# --- equivalence ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gpt-oss"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full-ft"])
def test_gradients_equal_no_checkpointing_and_standard_checkpointing(preset, lora):
    model = _model(preset, lora)
    inputs = _batch().model_inputs()
    reference = _step(model, inputs)                 # no checkpointing at all: nothing of ours touches it
    standard = _standard(model, inputs)
    _assert_same(reference, standard)
    for buffers, prefetch in MODES:
        got = _offloaded(model, inputs, buffers, prefetch)
        _assert_same(reference, got)
        _assert_same(standard, got)
    if lora:   # the first layer's input does not require grad under LoRA: its adapters still get gradients
        first = [n for n in reference[1] if ".layers.0." in n and "lora_" in n]
        assert first and all(reference[1][n].abs().sum() > 0 for n in first if "lora_B" in n)


def test_qlora_nf4_equal_standard():
    model = _model("tiny-qwen3", True, quant="nf4")
    inputs = _batch(tokens=128, row=64).model_inputs()
    standard = _standard(model, inputs)
    for buffers, prefetch in MODES:
        _assert_same(standard, _offloaded(model, inputs, buffers, prefetch))


def test_dropout_rng_restored_for_recompute():
    # LoRA dropout draws random numbers in forward and again in the recompute: the RNG state must be replayed.
    model = _model("tiny-qwen3", True, dropout=0.3)
    inputs = _batch().model_inputs()
    reference = _step(model, inputs, seed=123)
    _assert_same(reference, _standard(model, inputs, seed=123))
    _assert_same(reference, _offloaded(model, inputs, 2, True, seed=123))


@pytest.mark.parametrize("lengths", [[1, 63], [64], [5] * 12 + [4], [1] * 32 + [32]], ids=["len1", "one", "many", "ones"])
def test_packed_edge_cases(lengths):
    from fastsft_lab.data import Example

    corpus = [Example(tuple((i * 7 + j) % 256 for j in range(n)), tuple((i * 7 + j) % 256 for j in range(n)))
              for i, n in enumerate(lengths)]
    batch = pack_examples(corpus, 64, rows_per_batch=1)[0]
    model = _model("tiny-qwen3", True)
    inputs = batch.model_inputs()
    reference = _step(model, inputs)
    _assert_same(reference, _offloaded(model, inputs, 2, True))
    _assert_same(reference, _offloaded(model, inputs, 1, False))


def test_padding_tail_batch():
    corpus = synthetic_corpus(6, vocab_size=256, mix="short", max_len=100, seed=3)
    batch = pack_examples(corpus, 512, rows_per_batch=1)[0]
    assert batch.pad_lengths[0] > 0
    model = _model("tiny-qwen3", True)
    _assert_same(_step(model, batch.model_inputs()), _offloaded(model, batch.model_inputs(), 2, True))


def test_no_grad_and_eval_offload_nothing():
    model = _model("tiny-qwen3", True)
    inputs = _batch().model_inputs()
    manager = _enable(model)
    try:
        saves = manager.stats.saves
        with torch.no_grad():
            a = model(**inputs).logits
        model.eval()
        b = model(**inputs).logits         # eval: transformers does not call the checkpoint function at all
        model.train()
        assert manager.stats.saves == saves and manager.pending == 0
        O.disable_offloaded_checkpointing(model)
        with torch.no_grad():
            c = model(**inputs).logits
        torch.testing.assert_close(a, c, rtol=0, atol=0)
        torch.testing.assert_close(b.detach(), c, rtol=0, atol=0)
    finally:
        O.disable_offloaded_checkpointing(model)


@pytest.mark.parametrize("buffers,prefetch", MODES, ids=MODE_IDS)
def test_autocast_is_replayed_in_the_recompute(buffers, prefetch):
    # Under CPU bf16 autocast the recompute must run in bf16 too: without the replay it runs in float32 and the
    # gradients differ (by ~2e-3 on this model); with it they equal standard checkpointing bit for bit.
    # The forward runs under autocast, the backward after it (as torch's AMP recipes do): the recompute then only
    # runs in bf16 if the checkpoint function replays the autocast state it recorded.
    model = _model("tiny-qwen3", True)
    inputs = _batch().model_inputs()

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**inputs).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    switch = CheckpointingSwitch(model)
    switch.enable()
    try:
        ref = step()
    finally:
        switch.disable()
    O.enable_offloaded_checkpointing(model, buffers, prefetch)
    try:
        got = step()
    finally:
        O.disable_offloaded_checkpointing(model)
    _assert_same(ref, got)


# --- several forwards before one backward (gradient accumulation) --------------------------------------------------
@pytest.mark.parametrize("order", ["sum", "reverse", "forward-order"])
def test_gradient_accumulation_patterns(order):
    model = _model("tiny-qwen3", True)
    a, b = _batch(seed=1).model_inputs(), _batch(seed=2).model_inputs()

    def run():
        model.zero_grad(set_to_none=True)
        la, lb = model(**a).loss, model(**b).loss
        if order == "sum":
            (la + lb).backward()
        elif order == "reverse":
            lb.backward()
            la.backward()
        else:                          # registry order is violated on purpose: the owner check reloads
            la.backward()
            lb.backward()
        g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return g

    ref = run()
    for buffers, prefetch in MODES:
        manager = _enable(model, buffers, prefetch)
        try:
            got = run()
            assert manager.pending == 0 and manager.pool.in_use == 0
            assert manager.pool.num_slots == 2 * len(decoder_layers(model))   # both forwards held at once
        finally:
            O.disable_offloaded_checkpointing(model, release_pool=True)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-6, atol=1e-7)


def test_interleaved_forward_between_backwards():
    # forward A, forward B, backward B, forward C, backward A, backward C: slots are keyed by registry order.
    model = _model("tiny-qwen3", True)
    xs = [_batch(seed=s).model_inputs() for s in (1, 2, 3)]

    def run():
        model.zero_grad(set_to_none=True)
        la, lb = model(**xs[0]).loss, model(**xs[1]).loss
        lb.backward()
        lc = model(**xs[2]).loss
        la.backward()
        lc.backward()
        g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return g

    ref = run()
    manager = _enable(model, 2, True)
    try:
        got = run()
        assert manager.pending == 0
    finally:
        O.disable_offloaded_checkpointing(model, release_pool=True)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-6, atol=1e-7)


# --- the router aux loss through offloaded layers ------------------------------------------------------------------
@pytest.mark.parametrize("buffers,prefetch", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("forward_grad", [True, False], ids=["grad-fwd", "nograd-fwd"])
def test_router_aux_loss_through_offloaded_layers(buffers, prefetch, forward_grad):
    # The router logits the layers record for the load-balancing loss (output_router_logits=True, which TRL turns on
    # for MoE models) are handed out of the offloaded forward as side outputs whose gradient the layer's recompute
    # back-propagates: loss, aux loss and every gradient equal standard checkpointing, bit for bit.
    model = _model("tiny-gpt-oss", True)
    inputs = {**_batch(tokens=128, row=64).model_inputs(), "output_router_logits": True}
    ref = _standard(model, inputs)
    O.enable_offloaded_checkpointing(model, buffers, prefetch, forward_grad=forward_grad)
    try:
        aux = model(**inputs).aux_loss
        assert aux.requires_grad
        got = _step(model, inputs)
    finally:
        O.disable_offloaded_checkpointing(model, release_pool=True)
    _assert_same(ref, got)
    with torch.no_grad():
        assert torch.equal(model(**inputs).aux_loss, aux.detach())


def test_aux_loss_alone_reaches_the_attention_adapters_through_offloaded_layers():
    # Only the aux loss (the language-model loss detached): its gradient exists only through the side outputs.
    model = _model("tiny-gpt-oss", True)
    inputs = {**_batch(tokens=128, row=64).model_inputs(), "output_router_logits": True}

    def aux_grads():
        model.zero_grad(set_to_none=True)
        model(**inputs).aux_loss.backward()
        g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return g

    switch = CheckpointingSwitch(model)
    switch.enable()
    try:
        ref = aux_grads()
    finally:
        switch.disable()
    O.enable_offloaded_checkpointing(model, 2, True)
    try:
        got = aux_grads()
    finally:
        O.disable_offloaded_checkpointing(model, release_pool=True)
    assert ref and got.keys() == ref.keys() and any(g.abs().sum() > 0 for g in ref.values())
    for n in ref:
        assert torch.equal(got[n], ref[n]), n


# --- selective gradients, double backward --------------------------------------------------------------------------
def _selective(model, inputs, params, how):
    """Gradients of ``params`` only: torch.autograd.grad, or loss.backward(inputs=params) (.grad of the rest)."""
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    if how == "autograd.grad":
        got = torch.autograd.grad(loss, params)
        others = []
    else:
        loss.backward(inputs=params)
        got = [p.grad.clone() for p in params]
        others = [n for n, p in model.named_parameters() if p.grad is not None and all(p is not q for q in params)]
    model.zero_grad(set_to_none=True)
    return got, others


@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=)"])
def test_selective_gradients_reach_parameters_inside_offloaded_layers(how):
    # torch.autograd.grad(loss, [p]) and loss.backward(inputs=[p]) for parameters inside offloaded layers: the same
    # gradients as with standard checkpointing, and no .grad on any other parameter (the layer's parameters are
    # inputs of its autograd node, so autograd's own engine routes their gradients).
    model = _model("tiny-qwen3", True)
    inputs = _batch().model_inputs()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    pick = [names[0], names[len(names) // 2], names[-1]]          # first layer, middle, last layer
    params = [dict(model.named_parameters())[n] for n in pick]
    switch = CheckpointingSwitch(model)
    switch.enable()
    try:
        ref, _ = _selective(model, inputs, params, how)
    finally:
        switch.disable()
    for buffers, prefetch in MODES:
        O.enable_offloaded_checkpointing(model, buffers, prefetch)
        try:
            got, others = _selective(model, inputs, params, how)
        finally:
            O.disable_offloaded_checkpointing(model)
        assert others == []
        for name, a, b in zip(pick, got, ref):
            assert a is not None and torch.equal(a, b), (name, buffers, prefetch)


def test_autograd_grad_with_respect_to_inputs_through_offloaded_layers():
    model = _model("tiny-qwen3", True)
    inputs = _batch().model_inputs()
    embeds = model.get_input_embeddings()(inputs["input_ids"]).detach().requires_grad_(True)
    kw = dict(inputs_embeds=embeds, labels=inputs["labels"], position_ids=inputs["position_ids"])
    switch = CheckpointingSwitch(model)
    switch.enable()
    try:
        (ref,) = torch.autograd.grad(model(**kw).loss, embeds)
    finally:
        switch.disable()
    O.enable_offloaded_checkpointing(model, 2, True)
    try:
        (got,) = torch.autograd.grad(model(**kw).loss, embeds)
        assert all(p.grad is None for p in model.parameters())
    finally:
        O.disable_offloaded_checkpointing(model, release_pool=True)
    assert torch.equal(got, ref)


def test_double_backward_raises_clearly():
    model = _model("tiny-qwen3", True)
    inputs = _batch().model_inputs()
    O.enable_offloaded_checkpointing(model)
    try:
        loss = model(**inputs).loss
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="retain_graph=True is not supported"):
            loss.backward()
        del loss
        gc.collect()
    finally:
        O.disable_offloaded_checkpointing(model, release_pool=True)
        model.zero_grad(set_to_none=True)


# --- host syncs ----------------------------------------------------------------------------------------------------
def test_offload_adds_no_host_syncs():
    model = _model("tiny-qwen3", True)
    inputs = _batch().model_inputs()

    def count():
        with SyncCounter.for_decoder_layers(model, device="cpu") as c:
            model(**inputs).loss.backward()
        model.zero_grad(set_to_none=True)
        return c.total, c.in_modules

    O.enable_standard_checkpointing(model)
    standard = count()
    O.disable_standard_checkpointing(model)
    for buffers, prefetch in MODES:
        O.enable_offloaded_checkpointing(model, buffers, prefetch)
        try:
            assert count() == standard
        finally:
            O.disable_offloaded_checkpointing(model)
    assert standard[1] == 0


# --- together with optimization 1 ----------------------------------------------------------------------------------
def test_recompute_reuses_packed_metadata():
    from fastsft_lab import packed

    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4))
    model.train()
    batch = _batch()
    packed.enable_packed_attention(model, backend="sdpa", cache=True)
    inputs = packed.packed_inputs(batch)
    ref = _standard(model, dict(inputs, packed_metadata=packed.packed_inputs(batch)["packed_metadata"]))
    with packed.BuildLog() as log:
        with torch.no_grad():
            model(**inputs)
        builds_after_forward = dict(log.cached)
        assert builds_after_forward, "the forward built no metadata"
        got = _offloaded(model, inputs, 2, True)
    assert dict(log.cached) == builds_after_forward, "the offloaded recompute rebuilt packed metadata"
    assert not log.naive
    _assert_same(ref, got)
    packed.disable_packed_attention(model)
