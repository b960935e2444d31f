"""The switchboard: apply() turns optimizations on a live model, revert() gives back the original behaviour."""

import pytest
import torch

import fastsft_lab
from fastsft_lab.data import benchmark_batches
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.structure import decoder_layers


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
    base = fastsft_lab.structure.base_model(model)
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
    original = fastsft_lab.structure.base_model(moe_model).config._experts_implementation
    state = fastsft_lab.apply(moe_model, moe_routing=stock)
    assert state.moe_routing == stock
    fastsft_lab.apply(moe_model, moe_routing="grouped")
    assert fastsft_lab.revert(moe_model).moe_routing is None
    assert fastsft_lab.structure.base_model(moe_model).config._experts_implementation == original


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


def _from_config(name, **kw):
    import transformers as T

    cfg = getattr(T, name)(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=128, **kw)
    return T.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("config,field", [("Gemma2Config", "final_logit_softcapping"),
                                          ("GraniteConfig", "logits_scaling"), ("CohereConfig", "logit_scale")])
def test_fused_loss_refuses_a_model_that_changes_its_logits_after_the_head(config, field):
    """Gemma 2 caps its logits with a tanh, Granite divides them, Cohere scales them before the loss: the fused loss
    (h @ W.T straight into the cross-entropy) would compute another loss, silently. Refused, nothing changed."""
    import transformers as T

    kw = {"logits_scaling": 8.0} if field == "logits_scaling" else {"logit_scale": 0.0625} \
        if field == "logit_scale" else {}
    model = _from_config(config, **kw)
    assert getattr(model.config, field) not in (None, 1.0)
    with pytest.raises(NotImplementedError, match=f"changes its logits after the LM head \\({field}="):
        fastsft_lab.apply(model, offload_buffers=2, fused_loss=True)
    assert fastsft_lab.state(model) == fastsft_lab.ModelState()          # nothing was switched on
    # the same family without the transform takes it, and equals the model's own loss
    plain = _from_config(config, **{field: None if field == "final_logit_softcapping" else 1.0})
    ids = torch.randint(0, 128, (2, 24))
    reference = plain(input_ids=ids, labels=ids).loss
    fastsft_lab.apply(plain, fused_loss=True)
    # float32, one chunk: the same logits, a log-sum-exp over 128 words summed in another order (a few ulps)
    torch.testing.assert_close(plain(input_ids=ids, labels=ids).loss, reference, rtol=8 * 2**-23, atol=0)
    assert isinstance(plain, T.PreTrainedModel)


def test_a_model_that_is_not_a_causal_lm_is_refused_before_anything_changes():
    import transformers as T

    cfg = T.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, vocab_size=128, num_labels=3, pad_token_id=0)
    for model in (T.Qwen3ForSequenceClassification(cfg), T.Qwen3Model(cfg)):
        name = type(model).__name__
        with pytest.raises(ValueError, match=f"{name} is not a transformers \\*ForCausalLM with an LM head"):
            fastsft_lab.apply(model, offload_buffers=2, fused_loss=True)
        with pytest.raises(ValueError, match=f"{name} is not a causal LM \\(no generate\\(\\)\\)"):
            fastsft_lab.apply(model, offload_buffers=2, packed_attention="sdpa")
        assert fastsft_lab.state(model) == fastsft_lab.ModelState()
        inner = model.model if hasattr(model, "model") else model
        assert not inner._forward_pre_hooks and not inner._forward_hooks


@pytest.mark.parametrize("bad", [True, 2.0, "2", 3, 0])
def test_offload_buffers_must_be_the_int_1_or_2(bad):
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="buffers must be 1"):
        fastsft_lab.offload.enable_offloaded_checkpointing(model, buffers=bad)
    if bad != 0:
        with pytest.raises(ValueError, match="offload_buffers must be 0"):
            fastsft_lab.apply(model, offload_buffers=bad)
    assert fastsft_lab.state(model).checkpointing == "none"


ROUND_TRIPS = [
    ("tiny-qwen3", {"packed_attention": "sdpa"}, {"packed_attention": "off"}),
    ("tiny-qwen3", {"offload_buffers": 2}, {"offload_buffers": "off"}),
    ("tiny-qwen3", {"offload_buffers": 1}, {"offload_buffers": False}),
    ("tiny-qwen3", {"fused_loss": True}, {"fused_loss": False}),
    ("tiny-qwen3", {"fused_lora": True}, {"fused_lora": False}),
    ("tiny-gpt-oss", {"moe_routing": "sync_free"}, {"moe_routing": "off"}),
    ("tiny-gpt-oss", {"packed_attention": "sdpa"}, {"packed_attention": False}),
    ("tiny-qwen3", {"memory_budget": 16}, {"memory_budget": "off"}),
    ("tiny-gpt-oss", {"memory_budget": 16, "offload_buffers": 1}, {"memory_budget": False}),
]


@pytest.mark.parametrize("preset,on,off", ROUND_TRIPS, ids=[f"{p}-{next(iter(o))}={v}" for p, o, f in ROUND_TRIPS
                                                             for v in [next(iter(f.values()))]])
def test_every_switch_goes_on_off_on_through_apply_with_state_and_bitwise_outputs(preset, on, off, one_cpu_thread):
    """apply(switch=on) -> apply(switch=off) -> apply(switch=on) on one live model: off is the original model to the
    bit (loss and every gradient) and the original state; on again is the first on, to the bit."""
    from fastsft_lab.data import benchmark_batches
    from fastsft_lab.models import LoraSettings, build_model

    model = build_model(preset, device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4), seed=1)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    batch = benchmark_batches(tokens_per_step=256, row_tokens=128, steps=1, vocab_size=256, mix="short")[0]

    def step():
        loss = model(**batch.model_inputs()).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    def same(a, b):
        return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k])
                                                                             for k in a[1])

    original_state, original = fastsft_lab.state(model), step()
    first_state = fastsft_lab.apply(model, **on)
    assert first_state != original_state
    first = step()
    assert fastsft_lab.apply(model, **off) == original_state
    assert same(step(), original), "off is not the original model"
    assert fastsft_lab.apply(model, **on) == first_state
    assert same(step(), first), "on again is not the first on"
    assert fastsft_lab.revert(model) == original_state


def test_a_switch_turned_off_alone_leaves_the_others_on(moe_model):
    fastsft_lab.apply(moe_model, packed_attention="sdpa", offload_buffers=2, moe_routing="sync_free", fused_loss=True)
    s = fastsft_lab.apply(moe_model, moe_routing="off")
    assert s.moe_routing is None and s.packed == "sdpa" and s.offload_buffers == 2 and s.fused_loss
    s = fastsft_lab.apply(moe_model, packed_attention="off")
    assert s.packed is None and s.offload_buffers == 2 and s.fused_loss
    with pytest.raises(ValueError, match="packed_metadata_cache needs packed_attention"):
        fastsft_lab.apply(moe_model, packed_attention="off", packed_metadata_cache=False)
    with pytest.raises(ValueError, match="prefetch needs offload_buffers"):
        fastsft_lab.apply(moe_model, offload_buffers="off", prefetch=True)
    fastsft_lab.revert(moe_model)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gpt-oss", "tiny-qwen3-moe"])
@pytest.mark.parametrize("checkpointing", [dict(offload_buffers=2, prefetch=True), dict(memory_budget=8)],
                         ids=["offload-x2", "memory-plan"])
def test_all_fast_keeps_nothing_of_a_forward_dropped_without_backward(preset, checkpointing):
    """A loss computed under grad and dropped (a validation loss outside no_grad), after training steps: no hook,
    cache or staging of any switch may keep its graph (a saved tensor that holds its own grad_fn, or a recorder the
    graph points back to, is a cycle through C++ that no garbage collection frees)."""
    from _offload_helpers import assert_dropped_forwards_leave_nothing

    model = build_model(preset, device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4), num_layers=2).train()
    batch = benchmark_batches(tokens_per_step=256, row_tokens=128, steps=1, vocab_size=model.config.vocab_size,
                              mix="short")[0].model_inputs()
    moe = {"moe_routing": "sync_free"} if preset != "tiny-qwen3" else {}
    fastsft_lab.apply(model, packed_attention="sdpa", fused_loss=True, **checkpointing, **moe)
    try:
        for _ in range(3):                     # the memory plan measures at step 1 and solves at step 2
            model(**batch).loss.backward()
            model.zero_grad(set_to_none=True)
        assert_dropped_forwards_leave_nothing(model, batch)
    finally:
        fastsft_lab.revert(model)
