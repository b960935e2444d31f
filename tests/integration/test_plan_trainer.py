"""The memory plan in transformers' Trainer / TRL's SFTTrainer in one line: with TRL's defaults
(``gradient_checkpointing=True``, which calls the model's ``gradient_checkpointing_enable()`` inside ``train()``) the
plan survives training, trains as without it, and the logs carry the plan and the real tokens per second (the
collator's padding tail left out); the guard on the model's checkpointing methods goes with the switch that set it;
a share budget on a CPU says what to give instead."""

from __future__ import annotations

import warnings

import pytest
import torch

import fastsft_lab
from fastsft_lab.callbacks import StepStatsCallback, real_tokens
from fastsft_lab.data import synthetic_corpus
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.offload import guard as G
from fastsft_lab.offload import plan as P
from fastsft_lab.packing import PackedCollator

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
ROW = 128


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t3"))   # only its ids are used
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1", unk_token="t3")


class _Counting(PackedCollator):
    """The README's collator, counting each batch's tokens as they come in (before any padding)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.real: list[int] = []

    def __call__(self, features):
        self.real.append(sum(len(f["input_ids"]) for f in features))
        return super().__call__(features)


def _train(tmp_path, name: str, switches: dict, **config) -> tuple[list[dict], torch.nn.Module, list[int]]:
    """TRL's SFTTrainer as a new user writes it: a model, apply(), the README's collator, TRL's defaults. Returns the
    logs, the model and each batch's real tokens in the order collated."""
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    ex = synthetic_corpus(32, vocab_size=256, mix="short", max_len=60, seed=3)
    ds = datasets.Dataset.from_dict({"input_ids": [list(e.input_ids) for e in ex],
                                     "labels": [list(e.labels) for e in ex]})
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4), seed=1)
    fastsft_lab.apply(model, **switches)
    args = trl.SFTConfig(output_dir=str(tmp_path / name), max_steps=4, per_device_train_batch_size=6,
                         learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                         max_length=None, dataloader_num_workers=0, disable_tqdm=True,
                         include_num_input_tokens_seen=True, **config)
    collator = _Counting(max_tokens=ROW, pad_token_id=0)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=_tokenizer(),
                             data_collator=collator, callbacks=[StepStatsCallback(count_syncs=False)])
    trainer.train()
    return [h for h in trainer.state.log_history if "loss" in h], model, collator.real


def test_sft_trainer_with_trls_defaults_keeps_the_plan_and_logs_it_with_real_tokens(tmp_path):
    """gradient_checkpointing=True (TRL's default): the Trainer's gradient_checkpointing_enable() in train() leaves
    the plan on (one warning, before the first step), the losses are those of the same run without the plan, bitwise,
    and the logs name the plan once solved and count only the tokens that are not padding."""
    plain, _, _ = _train(tmp_path, "plain", {"packed_attention": "sdpa"}, gradient_checkpointing=False)
    with pytest.warns(UserWarning, match=r"gradient_checkpointing_enable\(\) left the model as it is: the memory plan"):
        logs, model, real = _train(tmp_path, "plan", {"packed_attention": "sdpa", "memory_budget": 16})
    state = fastsft_lab.state(model)
    assert state.checkpointing == "plan" and state.memory_plan and "measuring" not in state.memory_plan
    planner = P.memory_planner(model)
    assert planner.steps == 4 and planner.plan is not None
    assert [h["loss"] for h in logs] == [h["loss"] for h in plain]          # the plan changes no number
    # the plan in the log of the step that solved it (step 2), and not repeated
    assert [h["step"] for h in logs if "memory_plan" in h] == [2]
    assert next(h for h in logs if "memory_plan" in h)["memory_plan"] == planner.plan.describe()
    # each step's real tokens against the Trainer's count (which includes the collator's padding tail), over the same
    # time: their ratio is the batch's (the dataloader collates one batch ahead: the last is never trained on)
    seen = [0] + [h["num_input_tokens_seen"] for h in logs]
    for h, n, before, after in zip(logs, real, seen, seen[1:], strict=False):
        assert h["real_tokens_per_s"] / h["tokens_per_s"] == pytest.approx(n / (after - before), rel=1e-3), h
        assert n < after - before                                # there is a padding tail to leave out
    fastsft_lab.revert(model)
    assert not G.guarded(model.get_base_model())


@pytest.mark.parametrize("switch", [{"memory_budget": 16}, {"offload_buffers": 2}], ids=["plan", "offload"])
def test_the_models_checkpointing_methods_are_no_ops_while_on_and_back_after(switch):
    """While the plan (or offload) is on, gradient_checkpointing_enable() / _disable() change nothing and warn once;
    every way off puts the methods back exactly (the instance attributes gone), and they work again."""
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4), seed=1)
    inner = model.get_base_model()
    on = fastsft_lab.apply(model, **switch)
    assert set(G.METHODS) <= set(inner.__dict__)
    with pytest.warns(UserWarning, match="left the model as it is") as got:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert len(got) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.gradient_checkpointing_disable()                    # once per model
        inner.gradient_checkpointing_enable()
    assert fastsft_lab.state(model) == on
    off = {"memory_budget": "off"} if "memory_budget" in switch else {"offload_buffers": "off"}
    fastsft_lab.apply(model, **off)
    assert not set(G.METHODS) & set(inner.__dict__)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert fastsft_lab.state(model).checkpointing == "standard"
    model.gradient_checkpointing_disable()
    fastsft_lab.apply(model, **switch)
    fastsft_lab.revert(model)                                     # revert takes it off too
    assert not set(G.METHODS) & set(inner.__dict__)


def test_real_tokens_leave_out_the_padding_tail_and_only_it():
    feats = [{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}, {"input_ids": [10, 11, 12, 13]}]
    assert real_tokens(PackedCollator(max_tokens=8)(feats)) == 9            # two rows of 8, 7 padding
    assert real_tokens(PackedCollator(max_tokens=None)(feats)) == 9         # padding-free
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    got = real_tokens({"input_ids": torch.zeros(2, 4, dtype=torch.long), "attention_mask": mask})
    assert isinstance(got, torch.Tensor) and int(got) == 5                  # on the device: no sync until read
    assert real_tokens({"input_ids": torch.zeros(1, 11, dtype=torch.long),
                        "position_ids": torch.arange(11)[None]}) == 11     # TRL's padding_free: nothing padded


def test_a_share_budget_on_a_cpu_says_to_give_gib():
    """'90%' is a share of a GPU's free memory; on a CPU the refusal names the form that works, not '90%' again."""
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=None, seed=1)
    with pytest.raises(ValueError, match=r"give a size in GiB instead, e\.g\. memory_budget=\d+") as err:
        fastsft_lab.apply(model, memory_budget="90%")
    assert "'90%'" not in str(err.value).split(":", 1)[1] and "\n" not in str(err.value)
    assert fastsft_lab.state(model) == fastsft_lab.ModelState()
