"""The packed-attention switch on a live model: exact restore, errors, the names it registers, what it refuses
(softcapping, another batch's metadata, position ids that do not restart at 0), generation with it on, and
metadata recovered from position_ids by value."""

from __future__ import annotations

import pytest
import torch

from fastsft_lab.evidence import packed_vs_alone
from fastsft_lab.packing import (
    ATTN_NAMES,
    PackedMetadata,
    attn_implementation_name,
    available_backends,
    disable_packed_attention,
    enable_packed_attention,
    packed_attention_state,
    packed_inputs,
    set_packed_metadata_cache,
)
from fastsft_lab.models import build_model
from fastsft_lab.structure import base_model, decoder_layers

from _packed_helpers import PRESETS, make_batch, make_model, _family


@pytest.mark.parametrize("preset", PRESETS)
def test_toggle_on_live_model_and_exact_restore(preset):
    model = make_model(preset)
    model.eval()
    batch = make_batch()
    base = base_model(model)
    original = base.config._attn_implementation
    hooks_before = len(base.model._forward_pre_hooks)
    with torch.no_grad():
        before = model(**batch.model_inputs()).logits

    enable_packed_attention(model, "sdpa")
    assert packed_attention_state(model) == {"backend": "sdpa", "cache": True, "attn_implementation": "fastsft_dense",
                                             "original_attn_implementation": original}
    set_packed_metadata_cache(model, False)
    assert packed_attention_state(model)["cache"] is False
    enable_packed_attention(model, "varlen", cache=True)  # switching backends keeps the first original
    assert packed_attention_state(model)["original_attn_implementation"] == original
    disable_packed_attention(model)

    assert packed_attention_state(model) is None
    assert base.config._attn_implementation == original
    assert len(base.model._forward_pre_hooks) == hooks_before
    assert "_fastsft_restore_log" not in vars(base)          # nothing of the switch left on the model
    with torch.no_grad():
        after = model(**batch.model_inputs()).logits
    assert torch.equal(before, after)
    disable_packed_attention(model)  # idempotent


def test_switch_errors():
    model = make_model("tiny-qwen3")
    with pytest.raises(ValueError, match="unknown packed-attention backend"):
        enable_packed_attention(model, "nope")
    for backend in ("xformers", "flash"):
        if not available_backends("cpu")[backend].available:
            with pytest.raises(RuntimeError, match="not available here"):
                enable_packed_attention(model, backend)
    with pytest.raises(RuntimeError, match="enable_packed_attention"):
        set_packed_metadata_cache(model, True)
    enable_packed_attention(model, "flex")
    try:
        with pytest.raises(RuntimeError, match="no CPU backward"):
            model(**packed_inputs(make_batch()))
        batch = make_batch()
        wrong = PackedMetadata.from_lengths([[64, 64]])
        with pytest.raises(ValueError, match="describes a"):
            model(**batch.model_inputs(), packed_metadata=wrong)
    finally:
        disable_packed_attention(model)


def test_registered_names_build_no_transformers_mask_and_gpt_oss_accepts_them():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, create_causal_mask, \
        create_sliding_window_causal_mask

    model = make_model("tiny-gpt-oss")   # GPT-OSS refuses "sdpa"; our names avoid the substrings it checks
    base = base_model(model)
    batch = make_batch()
    for backend, name in ATTN_NAMES.items():
        assert attn_implementation_name(backend) == name and name in AttentionInterface._global_mapping
        assert name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
        for word in ("sdpa", "flash", "flex_attention"):
            assert word not in name
    for backend in ("sdpa", "eager", "varlen", "flex"):
        enable_packed_attention(model, backend)
        embeds = base.get_input_embeddings()(batch.input_ids)
        for fn in (create_causal_mask, create_sliding_window_causal_mask):
            assert fn(config=base.config, inputs_embeds=embeds, attention_mask=None, past_key_values=None,
                      position_ids=batch.position_ids) is None
    disable_packed_attention(model)
    direct = build_model("tiny-gpt-oss", device="cpu", dtype=torch.float32, attn_implementation="fastsft_dense")
    assert direct.config._attn_implementation == "fastsft_dense"


# --- no silent wrong answers: what the kernels do not implement is refused -----------------------------------------
def test_softcapping_is_refused_not_dropped():
    model = _family("gemma2", attn_logit_softcapping=1.0)
    with pytest.raises(NotImplementedError, match="softcapping"):
        enable_packed_attention(model, "sdpa")
    with pytest.raises(NotImplementedError, match="softcapping"):
        __import__("fastsft_lab").apply(model, packed_attention="varlen")
    assert packed_attention_state(model) is None
    # set by hand (attn_implementation=the registered name): the layer's softcap kwarg is refused at the call
    model.set_attn_implementation(ATTN_NAMES["sdpa"])
    with pytest.raises(NotImplementedError, match="softcap"):
        with torch.no_grad():
            model(**{k: v for k, v in packed_inputs(make_batch()).items() if k != "labels"})
    # without softcapping, Gemma2 works like any other family
    plain = _family("gemma2", attn_logit_softcapping=None, final_logit_softcapping=None)
    enable_packed_attention(plain, "sdpa")
    disable_packed_attention(plain)


def _first_rows(batch):
    return {k: v for k, v in packed_inputs(batch).items() if k != "labels"}


@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
def test_metadata_of_another_batch_is_refused(backend):
    model = make_model("tiny-qwen3")
    a, b = make_batch(seed=1), make_batch(seed=2)
    assert a.shape == b.shape and a.seq_lengths != b.seq_lengths
    enable_packed_attention(model, backend)
    try:
        with torch.no_grad():
            model(**_first_rows(a))                                     # its own metadata: fine
            with pytest.raises(RuntimeError, match="does not describe this batch"):
                model(**{**_first_rows(a), "packed_metadata": PackedMetadata.from_batch(b)})
    finally:
        disable_packed_attention(model)


def test_metadata_without_position_ids_supplies_them():
    model = make_model("tiny-qwen3")
    batch = make_batch()
    enable_packed_attention(model, "sdpa")
    try:
        with torch.no_grad():
            full = model(**_first_rows(batch)).logits
            inputs = _first_rows(batch)
            del inputs["position_ids"]
            assert torch.equal(model(**inputs).logits, full)
    finally:
        disable_packed_attention(model)


@pytest.mark.parametrize("backend", ["sdpa", "varlen", "eager"])
def test_position_ids_that_do_not_start_at_zero_are_refused_by_every_path(backend):
    model = make_model("tiny-qwen3")
    ids = torch.randint(4, 200, (1, 9))
    pos = torch.tensor([[5, 6, 7, 8, 0, 1, 2, 0, 1]])
    for cache in (True, False):
        enable_packed_attention(model, backend, cache=cache)
        try:
            with torch.no_grad(), pytest.raises(RuntimeError, match="restart at 0"):
                model(input_ids=ids, position_ids=pos)
        finally:
            disable_packed_attention(model)


def test_in_place_edit_of_position_ids_is_not_served_stale():
    """The hook path recovers the metadata from the *values* of position_ids on every call."""
    model = make_model("tiny-qwen3")
    model.eval()
    a, b = make_batch(seed=1), make_batch(seed=5)
    assert a.seq_lengths != b.seq_lengths
    enable_packed_attention(model, "sdpa")
    try:
        inputs = {"input_ids": b.input_ids, "position_ids": a.position_ids.clone()}
        with torch.no_grad():
            model(**inputs)
            inputs["position_ids"].copy_(b.position_ids)   # edit in place: same tensor object, new packing
            edited = model(**inputs).logits
        assert packed_vs_alone(model, b, {"input_ids": b.input_ids, "position_ids": b.position_ids}) < 1e-5
        with torch.no_grad():
            fresh = model(**packed_inputs(b)).logits
        torch.testing.assert_close(edited, fresh, rtol=0, atol=1e-6)
    finally:
        disable_packed_attention(model)


# --- generation ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_generate_with_packed_attention_on_equals_the_unpatched_model(preset):
    model = make_model(preset)
    prompt = torch.randint(4, 200, (2, 7))
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0                                                     # left padding, as batched generation pads
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=mask, use_cache=True)
    ref = model.generate(prompt, **kw)
    enable_packed_attention(model, "sdpa")
    try:
        batch = make_batch()
        model.train()
        model(**packed_inputs(batch)).loss.backward()                   # a packed training step, then sampling
        model.eval()
        assert torch.equal(model.generate(prompt, **kw), ref)
        assert torch.equal(model.generate(prompt, **{**kw, "use_cache": False}), ref)
        model.train()
        model(**packed_inputs(batch)).loss.backward()                   # and training again, nothing switched
        assert packed_attention_state(model)["attn_implementation"] == ATTN_NAMES["sdpa"]
    finally:
        disable_packed_attention(model)
        model.zero_grad(set_to_none=True)
    assert "generate" not in base_model(model).__dict__
