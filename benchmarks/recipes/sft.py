"""TRL's SFTTrainer with every fastsft_lab switch on and a memory budget, on one process or several (torchrun,
accelerate).

    python benchmarks/recipes/sft.py --preset tiny-qwen3 --max-steps 4                        # one process
    python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/recipes/sft.py  # DDP (gloo on a CPU)
    accelerate launch --config_file benchmarks/recipes/accelerate/ddp.yaml benchmarks/recipes/sft.py \
        --preset qwen3-14b --memory-budget 70
    accelerate launch --config_file benchmarks/recipes/accelerate/fsdp2.yaml benchmarks/recipes/sft.py \
        --preset qwen3-14b --memory-budget 70

The order that works under every launcher: build the model (quantise, add LoRA), ``fastsft_lab.apply``, then hand
it to the trainer, which wraps it (DDP, or FSDP2 from the accelerate config). ``--memory-budget`` is each rank's peak
(GiB, or on a GPU a share of its free memory, "90%"): each rank measures its own memory at step 1 and the plan is
solved at step 2 -- under DDP one per rank, under FSDP2 one for every rank (its shards and the gathered layers
counted). TRL's own padding-free collator packs the batch into one row per rank (``SFTConfig(padding_free=True)``,
which TRL 1.16 takes only with ``max_length=None``); each rank builds its packed metadata on its own device. The loss
is averaged over the tokens of the whole global batch (``average_tokens_across_devices``, transformers' default).
Random weights and a synthetic corpus: no hub needed. Rank 0 writes ``--out`` (JSON: world size, losses, the switches'
state before and after training, every rank's plan).
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="tiny-qwen3", help="a fastsft_lab preset (python -m fastsft_lab info)")
    ap.add_argument("--max-steps", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per device per step")
    ap.add_argument("--memory-budget", default=None,
                    help="each rank's peak: GiB, or on a GPU a share of its free memory (e.g. 90%%); off: every "
                         "layer offloaded instead (default: 90%% on a GPU, 16 on a CPU)")
    ap.add_argument("--offload-buffers", type=int, default=2,
                    help="the staging buffers of offloaded layers: 1 or 2 (0, with --memory-budget off: standard "
                         "checkpointing)")
    ap.add_argument("--out", default="runs/sft-recipe.json")
    args = ap.parse_args(argv)

    import datasets
    import trl
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    import fastsft_lab
    from fastsft_lab.data import synthetic_corpus
    from fastsft_lab.env import has_cuda
    from fastsft_lab.models import LoraSettings, build_model, get_preset

    cuda = has_cuda()
    if cuda and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))      # each rank on its own GPU before building
    preset = get_preset(args.preset)
    model = build_model(args.preset, device="cuda" if cuda else "cpu",
                        dtype=torch.bfloat16 if cuda else torch.float32,
                        quant="nf4" if cuda and preset.family == "qwen3" and preset.real else None,
                        lora=LoraSettings(rank=16 if preset.real else 4))
    budget = args.memory_budget or ("90%" if cuda else "16")
    checkpointing = ({"offload_buffers": args.offload_buffers} if budget == "off" else
                     {"memory_budget": budget if budget.endswith("%") else float(budget),
                      "offload_buffers": args.offload_buffers})
    # sdpa on a CPU: varlen there is a reference kernel (a Python loop over the segments), for checking, not speed
    state = fastsft_lab.apply(model, packed_attention="varlen" if cuda else "sdpa", fused_loss=True, **checkpointing,
                              **({"moe_routing": "sync_free"} if preset.is_moe else {}))
    vocab = model.config.vocab_size
    ex = synthetic_corpus(args.batch_size * args.max_steps * 8, vocab_size=min(vocab, 32000), mix="short",
                          max_len=512, seed=3)
    train = datasets.Dataset.from_dict({"input_ids": [list(e.input_ids) for e in ex]})
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t3"))   # only its ids are used
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="t0", eos_token="t1", unk_token="t3")
    config = trl.SFTConfig(output_dir=os.path.dirname(os.path.abspath(args.out)) or ".", max_steps=args.max_steps,
                           per_device_train_batch_size=args.batch_size, learning_rate=1e-4, logging_steps=1,
                           report_to=[], save_strategy="no", use_cpu=not cuda, bf16=cuda, seed=0, max_length=None,
                           dataloader_num_workers=0, disable_tqdm=True,
                           padding_free=True,                  # TRL's collator: one packed row per rank
                           gradient_checkpointing=False,       # the plan brings its own (True: kept from replacing it)
                           ddp_find_unused_parameters=False)
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer)
    trainer.train()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    after = fastsft_lab.state(model)
    from fastsft_lab.offload.plan import memory_planner

    planner = memory_planner(model)
    plan = list(planner.plan.choices) if planner is not None and planner.plan is not None else None
    plans = [plan] * world
    if world > 1:
        torch.distributed.all_gather_object(plans, plan)
    if trainer.is_world_process_zero():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"world_size": world, "preset": args.preset, "losses": losses, "state": str(state),
                       "state_after": str(after), "plans": plans, "steps": trainer.state.global_step}, f, indent=1)
        print(f"world size {world}: {trainer.state.global_step} steps, losses {[round(x, 4) for x in losses]}")
    if torch.distributed.is_initialized():
        # shut the process group down before the interpreter does: gloo's threads torn down at exit can abort
        # the process ("terminate called without an active exception") after the run has finished
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
