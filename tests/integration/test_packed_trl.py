"""Packed attention with its collator, transformers' Trainer and TRL's SFTTrainer (integration)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastsft_lab.packing import PackedCollator, PackedMetadata, disable_packed_attention, enable_packed_attention
from fastsft_lab.data import IGNORE_INDEX, synthetic_corpus
from fastsft_lab.models import LoraSettings, build_model

from _packed_helpers import make_model


def test_collator_outputs_and_errors():
    feats = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [IGNORE_INDEX, 9]},
             {"input_ids": [10, 11, 12, 13], "completion_mask": [0, 0, 1, 1]},
             {"input_ids": [20, 21, 22, 23, 24], "seq_lengths": [2, 3]}]
    out = PackedCollator(max_tokens=None, pad_token_id=0)(feats)
    assert set(out) == {"input_ids", "labels", "position_ids", "packed_metadata"}
    assert out["packed_metadata"].seq_lengths == ((3, 2, 4, 2, 3),)
    assert out["labels"][0].tolist() == [-100, 6, 7, -100, 9, -100, -100, 12, 13, -100, 21, -100, 23, 24]
    assert out["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 0, 1, 2]
    rows = PackedCollator(max_tokens=6, pad_token_id=0)(feats)
    meta = rows["packed_metadata"]
    assert rows["input_ids"].shape == (meta.num_rows, 6) and all(sum(r) == 6 for r in meta.seq_lengths)
    padded = PackedCollator(pad_to_multiple_of=8)(feats)
    assert padded["input_ids"].shape == (1, 16) and padded["packed_metadata"].seq_lengths[0][-1] == 2
    with pytest.raises(ValueError, match="more than a packed row holds"):
        PackedCollator(max_tokens=3)(feats)
    with pytest.raises(ValueError, match="empty"):
        PackedCollator(max_tokens=8)([{"input_ids": []}])
    with pytest.raises(ValueError, match="no 'input_ids'"):
        PackedCollator()([{"labels": [1]}])
    with pytest.raises(ValueError, match="labels"):
        PackedCollator()([{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(ValueError, match="seq_lengths"):
        PackedCollator()([{"input_ids": [1, 2, 3], "seq_lengths": [1, 1]}])


def test_trainer_prepare_inputs_passes_metadata_and_it_moves_lazily():
    from transformers import Trainer

    out = PackedCollator(max_tokens=None)([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    fake = SimpleNamespace(args=SimpleNamespace(device=torch.device("cpu")), is_deepspeed_enabled=False)
    fake._prepare_input = lambda data: Trainer._prepare_input(fake, data)
    prepared = Trainer._prepare_input(fake, out)
    assert prepared["packed_metadata"] is out["packed_metadata"]
    assert not out["packed_metadata"]._cache          # nothing on any device until a layer asks
    model = make_model("tiny-qwen3")
    enable_packed_attention(model, "varlen")
    try:
        model(**prepared)
    finally:
        disable_packed_attention(model)
    assert ("tensors", torch.device("cpu")) in out["packed_metadata"]._cache


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t3")


def test_trl_sft_trainer_with_packed_collator_matches_plain_path(tmp_path):
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    ex = synthetic_corpus(16, vocab_size=256, mix="short", max_len=64, seed=3)
    ds = datasets.Dataset.from_dict({"input_ids": [list(e.input_ids) for e in ex],
                                     "labels": [list(e.labels) for e in ex]})
    made: list[PackedMetadata] = []

    class Recording(PackedCollator):
        def __call__(self, features):
            out = super().__call__(features)
            made.append(out["packed_metadata"])
            return out

    def train(packed: bool) -> list[float]:
        model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4), seed=1)
        if packed:
            enable_packed_attention(model, "sdpa")
        args = trl.SFTConfig(output_dir=str(tmp_path / str(packed)), max_steps=3, per_device_train_batch_size=4,
                             learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             seed=0, max_length=None, dataloader_num_workers=0, bf16=False,
                             disable_tqdm=True)
        extra = {"data_collator": Recording(max_tokens=None, pad_token_id=0)} if packed else {}
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=_tiny_tokenizer(),
                                 **extra)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h]

    plain = train(False)   # stock collator: padded rows + attention mask, one sequence per row
    packed = train(True)
    assert len(plain) == len(packed) == 3
    for a, b in zip(plain, packed):
        assert a == pytest.approx(b, rel=1e-4)
    # the collator's metadata reached the attention layers through Trainer._prepare_inputs, TRL's compute_loss
    # and PEFT (the dataloader also collates one look-ahead batch that is never used)
    used = [m for m in made if ("tensors", torch.device("cpu")) in m._cache]
    assert len(used) >= 3
