"""A real training loop with every optimization on: TRL's SFTTrainer recipe, the step-stats callback, and loss
curves of all naive against all fast over 200 steps, within the noise floor: how far two runs that differ by
rounding noise alone (every weight one ulp apart) drift in the same 200 steps."""

from __future__ import annotations

import pytest
import torch

import fastsft_lab
from fastsft_lab.callbacks import StepStatsCallback
from fastsft_lab.data import synthetic_corpus
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.packing import PackedCollator, packed_inputs

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

FAST = {"tiny-qwen3": dict(packed_attention="sdpa", offload_buffers=2, fused_loss=True),
        "tiny-gpt-oss": dict(packed_attention="sdpa", offload_buffers=2, moe_routing="sync_free", fused_loss=True)}
NAIVE = {"tiny-qwen3": dict(packed_attention="sdpa", packed_metadata_cache=False, offload_buffers=1),
         "tiny-gpt-oss": dict(packed_attention="sdpa", packed_metadata_cache=False, offload_buffers=1,
                              moe_routing="naive")}


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t3")


def _model(preset, seed=1, lora=True):
    model = build_model(preset, device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4) if lora else None,
                        seed=seed)
    torch.manual_seed(seed)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    return model


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gpt-oss"])
def test_sft_trainer_recipe_with_every_optimization_on(tmp_path, preset):
    """The README's TRL recipe: our collator (packing=False), processing_class, gradient_checkpointing=False in
    the config (offload brings its own), fastsft_lab.apply on the model; the losses equal TRL's plain path."""
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    ex = synthetic_corpus(24, vocab_size=256, mix="short", max_len=60, seed=3)
    ds = datasets.Dataset.from_dict({"input_ids": [list(e.input_ids) for e in ex],
                                     "labels": [list(e.labels) for e in ex]})

    def train(fast: bool):
        model = _model(preset)
        callback = StepStatsCallback()
        args = trl.SFTConfig(output_dir=str(tmp_path / str(fast)), max_steps=4, per_device_train_batch_size=6,
                             learning_rate=1e-3, logging_steps=2, report_to=[], save_strategy="no", use_cpu=True,
                             seed=0, max_length=None, dataloader_num_workers=0, bf16=False, disable_tqdm=True,
                             gradient_checkpointing=False, packing=False, include_num_input_tokens_seen=True)
        extra = {}
        if fast:
            fastsft_lab.apply(model, **FAST[preset])
            extra["data_collator"] = PackedCollator(max_tokens=None, pad_token_id=0)
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=_tokenizer(),
                                 callbacks=[callback], **extra)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if fast:
            assert fastsft_lab.state(model).checkpointing == "offload"          # the trainer left it in place
        return losses, callback.history

    plain, _ = train(False)   # TRL's own collator: padded rows + attention mask, one sequence per row
    fast, history = train(True)
    assert len(plain) == len(fast) == 2
    for a, b in zip(plain, fast):
        assert a == pytest.approx(b, rel=1e-4)
    assert len(history) == 2
    for h in history:
        assert h["step_time_ms"] > 0 and h["tokens_per_s"] > 0 and isinstance(h["host_syncs_per_step"], int)


def _learnable_batches():
    """Packed rows of counting sequences (each token is the previous one plus one): something a tiny model learns
    in a few hundred steps, so the two curves fall together and their agreement means something."""
    import random

    from fastsft_lab.data import Example, pack_examples

    rng = random.Random(5)
    examples = []
    for _ in range(64):
        n, start = rng.randint(6, 40), rng.randrange(4, 256)
        ids = tuple(4 + (start - 4 + i) % 252 for i in range(n))
        examples.append(Example(ids, ids))
    return pack_examples(examples, 128, rows_per_batch=2)


def _curve(preset, switches, steps, *, nudge=False, lr=3e-3):
    model = _model(preset, seed=2, lora=False)      # full fine-tuning: it learns to count within 200 steps
    if nudge:   # every weight one float32 ulp up: a run that differs from the other by rounding noise alone
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.nextafter(p, torch.full_like(p, float("inf"))))
    model.train()
    fastsft_lab.apply(model, **switches)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    batches = _learnable_batches()
    losses = []
    for s in range(steps):
        b = batches[s % len(batches)]
        loss = model(**packed_inputs(b)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    fastsft_lab.revert(model)
    return losses


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gpt-oss"])
def test_loss_curves_of_all_naive_and_all_fast_agree_over_200_steps(preset):
    steps = 200
    naive = _curve(preset, NAIVE[preset], steps)
    fast = _curve(preset, FAST[preset], steps)
    # the noise floor: how far two runs drift apart over 200 steps when they differ by rounding noise alone
    floor = max(abs(a - b) for a, b in zip(naive, _curve(preset, NAIVE[preset], steps, nudge=True)))
    diff = max(abs(a - b) for a, b in zip(naive, fast))
    assert naive[-1] < naive[0] - 1.0, "the model did not learn: the comparison would say nothing"
    assert 0 < floor < 1e-2
    assert diff <= 3 * floor, f"all fast vs all naive {diff:.2e} > 3x the noise floor {floor:.2e}"
