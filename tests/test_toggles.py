"""The switchboard: apply() turns optimizations on a live model, revert() gives back the original behaviour."""

import pytest
import torch

import fastsft_lab
from fastsft_lab.data import benchmark_batches
from fastsft_lab.models import LoraSettings, build_model, decoder_layers


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch.model_inputs())
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), grads


@pytest.fixture(scope="module")
def moe_model():
    torch.manual_seed(0)
    return build_model("tiny-gpt-oss", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4),
                       gradient_checkpointing=True)


def test_apply_all_three_then_revert_restores_original(moe_model):
    model = moe_model
    batch = benchmark_batches(tokens_per_step=192, row_tokens=96, steps=1, vocab_size=256, mix="short")[0]
    base = fastsft_lab.models.base_model(model)
    original_attn = base.config._attn_implementation
    original_experts = base.config._experts_implementation
    original_funcs = [layer._gradient_checkpointing_func for layer in decoder_layers(model)]
    ref_logits, ref_grads = _loss_and_grads(model, batch)

    state = fastsft_lab.apply(model, packed_attention="sdpa", offload_buffers=2, moe_routing="sync_free")
    assert state.packed == "sdpa" and state.packed_cache is True
    assert state.checkpointing == "offload" and state.offload_buffers == 2 and state.prefetch is True
    assert state.moe_routing == "sync_free"
    logits, grads = _loss_and_grads(model, batch)
    # stock transformers' GPT-OSS attends across packed sequences (no mask from position_ids), ours does not:
    # compare on the first sequence of each row, which has nothing before it
    first = batch.seq_lengths[0][0]
    torch.testing.assert_close(logits[0, :first], ref_logits[0, :first], rtol=1e-4, atol=1e-4)

    fastsft_lab.apply(model, packed_metadata_cache=False)
    assert fastsft_lab.state(model).packed_cache is False

    state = fastsft_lab.revert(model)
    assert state == fastsft_lab.ModelState(checkpointing="standard")     # the model was built with checkpointing
    assert base.config._attn_implementation == original_attn
    assert base.config._experts_implementation == original_experts
    assert [layer._gradient_checkpointing_func for layer in decoder_layers(model)] == original_funcs
    logits2, grads2 = _loss_and_grads(model, batch)
    assert torch.equal(logits2, ref_logits)
    assert set(grads2) == set(ref_grads)
    for name in ref_grads:
        assert torch.equal(grads2[name], ref_grads[name]), name


def test_apply_rejects_bad_combinations(moe_model):
    with pytest.raises(ValueError, match="offload_buffers"):
        fastsft_lab.apply(moe_model, offload_buffers=3)
    with pytest.raises(ValueError, match="prefetch"):
        fastsft_lab.apply(moe_model, prefetch=True)
    with pytest.raises(ValueError, match="packed_attention"):
        fastsft_lab.apply(moe_model, packed_metadata_cache=True)
    with pytest.raises(ValueError, match="moe_routing"):
        fastsft_lab.apply(moe_model, moe_routing="fastest")
    assert fastsft_lab.revert(moe_model).packed is None


def test_public_api_is_lazy_and_complete():
    assert callable(fastsft_lab.apply) and callable(fastsft_lab.revert)
    for name in ("packing", "offload", "moe", "models", "data", "profiling", "evidence", "lab"):
        assert getattr(fastsft_lab, name).__name__ == f"fastsft_lab.{name}"
    with pytest.raises(AttributeError):
        fastsft_lab.not_a_module  # noqa: B018


def test_revert_turns_off_the_checkpointing_apply_turned_on():
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4))
    before = [dict(layer.__dict__) for layer in decoder_layers(model)]
    assert fastsft_lab.state(model).checkpointing == "none"
    assert fastsft_lab.apply(model, offload_buffers=0).checkpointing == "standard"
    assert fastsft_lab.apply(model, offload_buffers=2).checkpointing == "offload"
    assert fastsft_lab.apply(model, offload_buffers=0).checkpointing == "standard"
    assert fastsft_lab.revert(model).checkpointing == "none"
    assert [dict(layer.__dict__) for layer in decoder_layers(model)] == before


@pytest.mark.parametrize("stock", ["eager", "grouped_mm", "batched_mm"])
def test_revert_restores_the_experts_after_a_stock_name(moe_model, stock):
    original = fastsft_lab.models.base_model(moe_model).config._experts_implementation
    state = fastsft_lab.apply(moe_model, moe_routing=stock)
    assert state.moe_routing == stock
    fastsft_lab.apply(moe_model, moe_routing="grouped")
    assert fastsft_lab.revert(moe_model).moe_routing is None
    assert fastsft_lab.models.base_model(moe_model).config._experts_implementation == original


def test_apply_validates_everything_before_changing_anything():
    dense = build_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="no mixture-of-experts layers"):
        fastsft_lab.apply(dense, packed_attention="varlen", moe_routing="sync_free")
    assert fastsft_lab.state(dense) == fastsft_lab.ModelState()          # nothing was switched on
    with pytest.raises(ValueError, match="unknown packed-attention backend 'turbo'; known: sdpa"):
        fastsft_lab.apply(dense, packed_attention="turbo", offload_buffers=2)
    assert fastsft_lab.state(dense) == fastsft_lab.ModelState()
    with pytest.raises(TypeError, match="nn.Module"):
        fastsft_lab.apply("qwen3-14b", packed_attention="sdpa")
    with pytest.raises(ValueError, match="not a transformers causal LM"):
        fastsft_lab.apply(torch.nn.Linear(4, 4), packed_attention="sdpa")


@pytest.mark.parametrize("bad", [True, 2.0, "2", 3, 0])
def test_offload_buffers_must_be_the_int_1_or_2(bad):
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="buffers must be 1"):
        fastsft_lab.offload.enable_offloaded_checkpointing(model, buffers=bad)
    if bad != 0:
        with pytest.raises(ValueError, match="offload_buffers must be 0"):
            fastsft_lab.apply(model, offload_buffers=bad)
    assert fastsft_lab.state(model).checkpointing == "none"
