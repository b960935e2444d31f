"""TRL's SFTTrainer with every fastsft_lab switch on, on one process or several (torchrun, accelerate).

    python benchmarks/recipes/sft.py --preset tiny-qwen3 --max-steps 4                        # one process
    python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/recipes/sft.py  # DDP (gloo on a CPU)
    accelerate launch --config_file benchmarks/recipes/accelerate/ddp.yaml benchmarks/recipes/sft.py --preset qwen3-14b
    accelerate launch --config_file benchmarks/recipes/accelerate/fsdp2.yaml benchmarks/recipes/sft.py --preset qwen3-14b

The order that works under every launcher: build the model (quantise, add LoRA), ``fastsft_lab.apply``, then hand
it to the trainer, which wraps it (DDP, or FSDP2 from the accelerate config). TRL's own padding-free collator packs
the batch into one row per rank (``SFTConfig(padding_free=True)``); each rank builds its packed metadata on its own
device. The loss is averaged over the tokens of the whole global batch (``average_tokens_across_devices``,
transformers' default). Random weights and a synthetic corpus: no hub needed. Rank 0 writes ``--out`` (JSON: world
size, losses, the switches' state).
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
    ap.add_argument("--offload-buffers", type=int, default=2, help="0 (standard checkpointing), 1 or 2")
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
    state = fastsft_lab.apply(model, packed_attention="varlen" if cuda else "sdpa",
                              offload_buffers=args.offload_buffers, fused_loss=True,
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
                           gradient_checkpointing=False,       # offload brings its own checkpointing
                           ddp_find_unused_parameters=False)
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=train, processing_class=tokenizer)
    trainer.train()
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"world_size": world, "preset": args.preset, "losses": losses, "state": str(state),
                       "steps": trainer.state.global_step}, f, indent=1)
        print(f"world size {world}: {trainer.state.global_step} steps, losses {[round(x, 4) for x in losses]}")
    if torch.distributed.is_initialized():
        # shut the process group down before the interpreter does: gloo's threads torn down at exit can abort
        # the process ("terminate called without an active exception") after the run has finished
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
