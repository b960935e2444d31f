"""Packed attention on whole models: packed == each sequence alone.

The reference everywhere is each sequence run ALONE through the untouched stock model (sdpa for Qwen3, eager for
GPT-OSS): packed logits and LoRA gradients must equal it, on every backend that runs here, cached and naive; per
preset, per family that is not a preset, MoE routing included; host syncs per step; checkpoint recompute."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastsft_lab.evidence import cross_contamination, packed_vs_alone, packed_vs_alone_moe
from fastsft_lab.packing import (
    BuildLog,
    PackedCollator,
    disable_packed_attention,
    enable_packed_attention,
    packed_inputs,
    set_packed_metadata_cache,
)
from fastsft_lab.data import synthetic_corpus, unpack
from fastsft_lab.models import get_preset
from fastsft_lab.structure import base_model, decoder_layers, family_of
from fastsft_lab.profiling import SyncCounter

from _packed_helpers import PRESETS, make_batch, make_model, lora_grads, assert_close_scaled, _family


CPU_BACKENDS = ["eager", "sdpa", "varlen", "flex", "segments"]   # flex: forward only on a CPU
TRAIN_BACKENDS = ["eager", "sdpa", "varlen", "segments"]


def layer_windows(model) -> set:
    """The distinct sliding windows of the model's layers (None: full attention), as the family record says."""
    return set(family_of(model).layer_windows(base_model(model).config))


@pytest.fixture(scope="module", params=PRESETS)
def reference(request):
    """A LoRA model, a packed batch, and each sequence run alone through the stock model (logits, LoRA grads)."""
    model = make_model(request.param)
    batch = make_batch()
    model.eval()
    alone_logits = []
    with torch.no_grad():
        for s in unpack(batch):
            alone_logits.append(model(input_ids=s.input_ids).logits[0])
    grads = lora_grads(model, [{"input_ids": s.input_ids, "labels": s.labels} for s in unpack(batch)])
    return SimpleNamespace(preset=request.param, model=model, batch=batch, logits=alone_logits, grads=grads)


def check_against_alone(ref, inputs: dict, *, grads: bool):
    model, batch = ref.model, ref.batch
    with torch.no_grad():
        packed = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
    for s, alone in zip(unpack(batch), ref.logits):
        torch.testing.assert_close(packed[s.row, s.start:s.start + s.length], alone, rtol=1e-5, atol=1e-5)
    if grads:
        got = lora_grads(model, [inputs])
        assert got.keys() == ref.grads.keys()
        for name in got:
            assert_close_scaled(got[name], ref.grads[name], 2e-5, name)


# --- equivalence: packed == alone, cached == naive, every backend --------------------------------------------------
@pytest.mark.parametrize("cache", [True, False], ids=["cached", "naive"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_packed_equals_each_sequence_alone(reference, backend, cache):
    enable_packed_attention(reference.model, backend, cache=cache)
    try:
        check_against_alone(reference, packed_inputs(reference.batch), grads=backend in TRAIN_BACKENDS)
    finally:
        disable_packed_attention(reference.model)


def test_metadata_recovered_from_position_ids_also_matches(reference):
    # no packed_metadata in the call: the pre-hook recovers it from position_ids once per step
    enable_packed_attention(reference.model, "sdpa")
    try:
        check_against_alone(reference, reference.batch.model_inputs(), grads=True)
    finally:
        disable_packed_attention(reference.model)


@pytest.mark.parametrize("backend", TRAIN_BACKENDS + ["flex"])
def test_sync_counts(reference, backend):
    """naive: >= 1 sync in every layer; cached: 0 in the layers, 0 per step with the collator's metadata,
    exactly 1 per step when the metadata has to be recovered from position_ids."""
    model, batch = reference.model, reference.batch
    n_layers = len(decoder_layers(model))
    train = backend != "flex"

    def count(cache: bool, inputs: dict) -> SyncCounter:
        enable_packed_attention(model, backend, cache=cache)
        try:
            with SyncCounter.for_decoder_layers(model, device="cpu") as c:
                if train:
                    model(**inputs).loss.backward()
                else:
                    with torch.no_grad():
                        model(**inputs)
        finally:
            disable_packed_attention(model)
        return c

    naive = count(False, batch.model_inputs())
    assert all(n >= 1 for n in naive.per_module().values()), naive.per_module()
    cached = count(True, packed_inputs(batch))
    assert cached.in_modules == 0 and cached.total == 0, dict(cached.by_kind)
    recovered = count(True, batch.model_inputs())
    assert recovered.in_modules == 0 and recovered.total == 1, dict(recovered.by_kind)
    assert naive.in_modules >= n_layers


# --- gradient checkpointing and PEFT: the same object reaches every layer, recompute does not rebuild --------------
@pytest.mark.parametrize("preset", PRESETS)
def test_checkpoint_recompute_reuses_metadata(preset):
    model = make_model(preset, gradient_checkpointing=True)
    model.train()
    batch = make_batch()
    n_layers = len(decoder_layers(model))
    windows = layer_windows(model)
    seen = []
    original = base_model(model).model.layers[0].self_attn.forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("packed_metadata"))
        return original(*args, **kwargs)

    base_model(model).model.layers[0].self_attn.forward = spy
    try:
        enable_packed_attention(model, "sdpa", cache=True)
        inputs = packed_inputs(batch)
        meta = inputs["packed_metadata"]
        with BuildLog() as log:
            model(**inputs).loss.backward()
        assert len(seen) == 2, "layer 0 ran forward + checkpoint recompute"
        assert seen[0] is meta and seen[1] is meta
        # one device copy, one mask per distinct window -- not per layer, not per recompute
        assert log.cached["tensors"] == 1
        assert log.cached["dense_sink" if get_preset(preset).family_record.attention.sinks else "dense"] == len(windows)
        assert not log.naive

        set_packed_metadata_cache(model, False)  # the naive path rebuilds in every layer, twice with recompute
        with BuildLog() as log:
            model(**packed_inputs(batch)).loss.backward()
        assert log.naive["dense"] == 2 * n_layers
    finally:
        disable_packed_attention(model)
        base_model(model).model.layers[0].self_attn.forward = original


# --- families that are not presets ---------------------------------------------------------------------------------
SUPPORTED_FAMILIES = ["llama", "mistral", "qwen2", "mixtral", "qwen3_moe", "gemma3", "olmo2"]


@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_families_that_are_not_presets_packed_equals_alone(family, backend):
    model = _family(family)
    batch = make_batch()
    with torch.no_grad():
        alone = [model(input_ids=s.input_ids).logits[0] for s in unpack(batch)]
    for cache in (True, False):
        enable_packed_attention(model, backend, cache=cache)
        try:
            with torch.no_grad():
                packed = model(**{k: v for k, v in packed_inputs(batch).items() if k != "labels"}).logits
        finally:
            disable_packed_attention(model)
        for s, ref in zip(unpack(batch), alone):
            torch.testing.assert_close(packed[s.row, s.start:s.start + s.length], ref, rtol=1e-5, atol=1e-5,
                                       msg=f"{family} {backend} cache={cache}")


# --- MoE: every layer's routing, the router loss over packed rows --------------------------------------------------
@pytest.mark.parametrize("preset", [p for p in PRESETS if get_preset(p).is_moe])
def test_packed_vs_alone_moe_sees_every_layers_routing(preset):
    """The MoE comparison captures each token's experts in every MoE layer, and on a float32 CPU run nothing is
    rerouted and packed equals alone."""
    from fastsft_lab.evidence import _expert_choices

    model = make_model(preset).eval()
    batch = make_batch()
    enable_packed_attention(model, "sdpa")
    routes = _expert_choices(model, lambda: model(**{k: v for k, v in packed_inputs(batch).items() if k != "labels"}))
    assert len(routes) == model.config.num_hidden_layers
    assert all(r.shape == (batch.input_ids.numel(), model.config.num_experts_per_tok) for r in routes)
    diff, rerouted, total = packed_vs_alone_moe(model, batch)
    assert rerouted == 0 and total == sum(s.length for s in unpack(batch)) and diff < 1e-5


def test_router_aux_loss_over_packed_rows_leaves_the_padding_out():
    from transformers.models.gpt_oss.modeling_gpt_oss import load_balancing_loss_func

    from fastsft_lab import offload as O

    model = make_model("tiny-gpt-oss")
    collate = PackedCollator(max_tokens=96)
    ex = synthetic_corpus(10, vocab_size=256, mix="short", max_len=60, seed=3)
    batch = collate([{"input_ids": list(e.input_ids)} for e in ex])
    meta = batch["packed_metadata"]
    assert any(meta.pad_lengths)
    real = meta.real_tokens_mask("cpu")
    enable_packed_attention(model, "sdpa")
    try:
        with torch.no_grad():
            ours = model(**batch, output_router_logits=True)
            padded = model(**batch, attention_mask=real, output_router_logits=True)   # the mask given by hand
            counted = load_balancing_loss_func(ours.router_logits, 8, 2, None)         # padding counted
        torch.testing.assert_close(ours.aux_loss, padded.aux_loss)
        assert (ours.aux_loss - counted).abs() > 1e-3
        model.train()
        ref = model(**batch, output_router_logits=True)
        ref.loss.backward()
        ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        O.enable_offloaded_checkpointing(model, 2, True)
        try:
            out = model(**batch, output_router_logits=True)
            torch.testing.assert_close(out.aux_loss, padded.aux_loss)
            out.loss.backward()                      # the aux loss's gradient through the offloaded layers
            for n, g in ref_grads.items():
                torch.testing.assert_close(dict(model.named_parameters())[n].grad, g, rtol=1e-5, atol=1e-7)
        finally:
            O.disable_offloaded_checkpointing(model, release_pool=True)
            model.eval()
    finally:
        disable_packed_attention(model)
        model.zero_grad(set_to_none=True)


# --- the cross-contamination pitfall of stock transformers ---------------------------------------------------------
@pytest.mark.parametrize("preset", [*PRESETS, "tiny-qwen3-moe"])
def test_each_family_record_says_whether_its_stock_path_keeps_packed_sequences_apart(preset):
    """``Attention.stock_packs`` is what the benchmarks print beside a stock row that is not equal to exact packing:
    every family record must say what its stock path, packed position_ids and no mask, does."""
    model = make_model(preset).eval()
    leak = cross_contamination(model, make_batch())
    assert (leak > 1e-3) == (not family_of(model).attention.stock_packs), (preset, leak)
    assert leak > 1e-3 or leak < 1e-5


def test_cross_contamination_in_stock_transformers_and_never_ours():
    """Exactly which stock paths leak (transformers 5.17, packed position_ids, CPU): see notebook 01."""
    batch = make_batch()
    qwen = make_model("tiny-qwen3").eval()
    gpt = make_model("tiny-gpt-oss").eval()   # stock eager (GPT-OSS refuses sdpa; flex+sinks is CUDA-only)
    leaks = {}
    for impl in ("eager", "sdpa"):   # flex_attention: same masking_utils logic, checked on CUDA (slow to compile here)
        base_model(qwen).set_attn_implementation(impl)
        leaks["qwen3", impl, "no mask"] = cross_contamination(qwen, batch)
        leaks["qwen3", impl, "ones"] = cross_contamination(qwen, batch, attention_mask_ones=True)
    base_model(qwen).set_attn_implementation("sdpa")
    leaks["gpt-oss", "eager", "no mask"] = cross_contamination(gpt, batch)
    leaks["gpt-oss", "eager", "ones"] = cross_contamination(gpt, batch, attention_mask_ones=True)
    leaked = {key for key, diff in leaks.items() if diff > 1e-3}
    # Qwen3 passes position_ids to create_causal_mask: packing is detected -- unless a 2-D mask is given;
    # GPT-OSS's mask calls never get position_ids: packed sequences always attend to each other.
    assert leaked == {("qwen3", "eager", "ones"), ("qwen3", "sdpa", "ones"),
                      ("gpt-oss", "eager", "no mask"), ("gpt-oss", "eager", "ones")}, leaks
    assert all(diff < 1e-5 for key, diff in leaks.items() if key not in leaked)
    for model in (qwen, gpt):
        for backend in ("sdpa", "varlen"):
            enable_packed_attention(model, backend)
            assert packed_vs_alone(model, batch) < 1e-5
            ones = {**batch.model_inputs(), "attention_mask": torch.ones_like(batch.input_ids)}
            assert packed_vs_alone(model, batch, ones) < 1e-5
            disable_packed_attention(model)
