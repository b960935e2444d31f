"""The padding-free collators users already have -- TRL's ``DataCollatorForLanguageModeling(padding_free=True)``
(what ``SFTConfig(padding_free=True)`` uses) and transformers' ``DataCollatorWithFlattening`` -- with packed attention
on: their extra keys (``seq_idx``, ``cu_seq_lens_*``, ``max_length_*``) are accepted and checked, and the loss and
every gradient equal each sequence run alone through stock transformers."""

from __future__ import annotations

import pytest
import torch

import fastsft_lab
from fastsft_lab.data import synthetic_corpus
from fastsft_lab.models import LoraSettings, build_model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _features(n=6, seed=3):
    ex = synthetic_corpus(n, vocab_size=256, mix="short", max_len=40, seed=seed)
    return [{"input_ids": list(e.input_ids)} for e in ex]


def _collators():
    out = {}
    trl = pytest.importorskip("trl")
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    out["trl padding_free"] = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    out["trl padding_free, pad to 64"] = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True,
                                                                        pad_to_multiple_of=64)
    from transformers import DataCollatorWithFlattening

    out["transformers flattening"] = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True,
                                                                return_tensors="pt")
    assert trl is not None
    return out


def _alone_loss_and_grads(model, features):
    """The reference no packing touches: each sequence run alone through the stock model, the losses combined as
    the padding-free batch combines them (every predicted token counts once)."""
    total, n_tokens = 0.0, 0
    for f in features:
        ids = torch.tensor([f["input_ids"]])
        n = ids.shape[1] - 1
        total = total + model(input_ids=ids, labels=ids).loss * n
        n_tokens += n
    return _loss_and_grads_of(model, total / n_tokens)


def _loss_and_grads_of(model, loss):
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _loss_and_grads(model, batch):
    return _loss_and_grads_of(model, model(**batch).loss)


def _model(preset):
    model = build_model(preset, device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4), seed=1)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    return model


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gpt-oss"])
@pytest.mark.parametrize("name", ["trl padding_free", "trl padding_free, pad to 64", "transformers flattening"])
def test_padding_free_collator_batch_equals_each_sequence_alone_with_every_switch(preset, name):
    features = _features()
    batch = _collators()[name](features)
    assert "seq_idx" in batch and batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
    model = _model(preset)
    ref_loss, ref = _alone_loss_and_grads(model, features)
    if preset == "tiny-qwen3":   # stock Qwen3 reads packed rows from position_ids exactly (GPT-OSS's eager leaks)
        stock_loss, _ = _loss_and_grads(model, batch)
        torch.testing.assert_close(stock_loss, ref_loss, rtol=1e-5, atol=1e-6)
    switches = dict(packed_attention="sdpa", offload_buffers=2, fused_loss=True)
    if preset == "tiny-gpt-oss":
        switches["moe_routing"] = "sync_free"
    fastsft_lab.apply(model, **switches)
    try:
        loss, grads = _loss_and_grads(model, batch)
    finally:
        fastsft_lab.revert(model)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert set(grads) == set(ref) and len(ref) > 0
    for n, g in ref.items():
        assert g.abs().max() > 0, n
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_seq_idx_that_disagrees_with_position_ids_is_refused():
    batch = _collators()["trl padding_free"](_features())
    batch["seq_idx"] = torch.zeros_like(batch["seq_idx"])     # one sequence, while position_ids restart
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=None, seed=1)
    fastsft_lab.apply(model, packed_attention="sdpa")
    with pytest.raises(RuntimeError, match="seq_idx and position_ids describe different sequences"):
        model(**batch)


def test_sft_trainer_padding_free_with_packed_attention_equals_stock(tmp_path):
    """``SFTConfig(padding_free=True)``: TRL's own collator, no custom one, fastsft_lab.apply on the model."""
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    from test_training import _tokenizer

    ex = synthetic_corpus(24, vocab_size=256, mix="short", max_len=60, seed=3)
    ds = datasets.Dataset.from_dict({"input_ids": [list(e.input_ids) for e in ex]})

    def train(fast: bool) -> list[float]:
        model = _model("tiny-qwen3")
        if fast:
            fastsft_lab.apply(model, packed_attention="sdpa", offload_buffers=2, fused_loss=True)
        args = trl.SFTConfig(output_dir=str(tmp_path / str(fast)), max_steps=3, per_device_train_batch_size=6,
                             learning_rate=1e-3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             seed=0, max_length=None, dataloader_num_workers=0, bf16=False, disable_tqdm=True,
                             gradient_checkpointing=False, padding_free=True)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=_tokenizer())
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    plain, fast = train(False), train(True)
    assert len(plain) == len(fast) == 3
    for a, b in zip(plain, fast):
        assert a == pytest.approx(b, rel=1e-4)
