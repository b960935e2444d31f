"""A real training loop with every optimization on: TRL's SFTTrainer recipe, the step-stats callback, and 200 steps
of training in which the exact switches change no bit and the reordering ones stay within float32 rounding at every
checked step (:mod:`fastsft_lab.lab.convergence` says why a curve-to-curve "noise floor" cannot be the test)."""

from __future__ import annotations

import pytest
import torch

import fastsft_lab
from fastsft_lab.callbacks import StepStatsCallback
from fastsft_lab.data import synthetic_corpus
from fastsft_lab.lab import convergence
from fastsft_lab.models import LoraSettings, build_model, get_preset
from fastsft_lab.packing import PackedCollator

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


def _make(preset):
    return lambda: _model(preset, seed=2, lora=False)      # full fine-tuning: it learns to count within 200 steps


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gpt-oss"])
def test_exact_switches_leave_the_loss_curve_bitwise_equal_over_200_steps(preset):
    """The metadata cache and the offload buffers move no floating-point operation: 200 training steps with them on
    give the naive run's losses and weights to the bit, on any CPU."""
    family = get_preset(preset).family
    got = convergence.exact_curves(_make(preset), family, 200)
    assert got["naive"][-1] < got["naive"][0] - 1.0, "the model did not learn: the comparison would say nothing"
    assert got["bitwise_equal"], max(abs(a - b) for a, b in zip(got["naive"], got["exact"]))
    assert got["params_bitwise_equal"]


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gpt-oss"])
def test_all_fast_equals_all_naive_within_rounding_all_along_the_curve(preset):
    """The fused loss (and sync_free routing) reorder sums: at the same weights, at six points of a 200-step run,
    the loss and every gradient with every switch on stay within float32 rounding of the longest reduction."""
    family = get_preset(preset).family
    got = convergence.along_the_curve(_make(preset), family, 200, every=40)
    assert got["naive"][-1] < got["naive"][0] - 1.0, "the model did not learn: the comparison would say nothing"
    assert [p["step"] for p in got["points"]] == [0, 40, 80, 120, 160, 199]
    assert got["points"][-1]["loss"] < 0.1 * got["points"][0]["loss"]    # checked late in training too
    assert got["within"], (got["worst_ratio"], got["tolerance"], got["points"])


def test_the_rounding_tolerance_is_the_first_order_bound_and_refuses_bad_input():
    u = torch.finfo(torch.float32).eps / 2
    assert convergence.rounding_tolerance(torch.float32, 256) == 2 * 256 * u
    assert convergence.rounding_tolerance(torch.bfloat16, 1) == torch.finfo(torch.bfloat16).eps
    with pytest.raises(ValueError, match="floating-point"):
        convergence.rounding_tolerance(torch.int32, 4)
    with pytest.raises(ValueError, match=">= 1"):
        convergence.rounding_tolerance(torch.float32, 0)
    with pytest.raises(ValueError, match="valid: qwen3, gpt_oss"):
        convergence.switches("llama")
