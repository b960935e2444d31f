"""``fastsft_lab.diagnose`` on two real-width configurations, its suggestions then applied and measured: the report a
learner would paste, for the model as transformers ships it and for the README's recipe.

Usage: python benchmarks/diagnose_report.py --out DIR [--only stock-gpt-oss,recipe-qwen3] [--tokens 8192]

* ``stock-gpt-oss``: GPT-OSS-20B, all 24 layers, bf16 + LoRA r16 on the attention projections, transformers'
  default attention and experts (``grouped_mm``), its gradient checkpointing, autocast bf16, ``--tokens`` in rows of
  4096 (its eager attention holds T x T scores per row).
* ``recipe-qwen3``: Qwen3-14B, all 40 layers, NF4 + LoRA r16, the README's recipe (``packed_attention="varlen"``,
  ``offload_buffers=2``, ``fused_loss``, ``fused_lora``), autocast bf16, ``--tokens`` tokens of packed sequences.

Each writes ``<name>.txt`` (the report, then prediction beside measurement for the suggested switches) and
``<name>.json`` (``Diagnosis.to_dict()`` and the comparison) into ``--out``. Random weights at the real widths (no
download); the same batches as the benchmarks (:func:`fastsft_lab.data.benchmark_batches`).
"""
from __future__ import annotations

import argparse
import gc
import json
import pathlib
import time

import torch

import fastsft_lab
from fastsft_lab.data import benchmark_batches
from fastsft_lab.env import describe
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.packing import packed_inputs


def stock_gpt_oss(tokens: int):
    model = build_model("gpt-oss-20b", lora=LoraSettings(rank=16, target_modules=["q_proj", "k_proj", "v_proj",
                                                                                  "o_proj"]),
                        gradient_checkpointing=True)
    # rows of 4096 tokens, as the benchmarks feed stock GPT-OSS: its eager attention holds T x T scores per row
    batch = benchmark_batches(tokens_per_step=tokens, row_tokens=min(tokens, 4096), steps=1,
                              vocab_size=model.config.vocab_size)[0]
    return model, batch.to(model.device).model_inputs()     # what stock transformers takes: rows and their mask


def recipe_qwen3(tokens: int):
    model = build_model("qwen3-14b", quant="nf4", lora=LoraSettings(rank=16), gradient_checkpointing=True)
    fastsft_lab.apply(model, packed_attention="varlen", offload_buffers=2, fused_loss=True, fused_lora=True)
    batch = benchmark_batches(tokens_per_step=tokens, steps=1, vocab_size=model.config.vocab_size)[0]
    return model, packed_inputs(batch.to(model.device))


CONFIGS = {"stock-gpt-oss": stock_gpt_oss, "recipe-qwen3": recipe_qwen3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=",".join(CONFIGS), help=f"comma-separated, from {', '.join(CONFIGS)}")
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configuration {', '.join(unknown)}: choose from {', '.join(CONFIGS)}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = describe()
    for name in names:
        t = time.time()
        model, batch = CONFIGS[name](args.tokens)
        diagnosis = fastsft_lab.diagnose(model, batch, autocast=torch.bfloat16)
        text = [f"{name}: {args.tokens} tokens | {stamp}", str(diagnosis)]
        record: dict = {"name": name, "tokens": args.tokens, "environment": stamp, "diagnosis": diagnosis.to_dict()}
        if diagnosis.suggested():
            comparison = diagnosis.apply_and_measure(model, batch, revert=True)
            text += ["", str(comparison)]
            record["comparison"] = comparison.to_dict()
        report = "\n".join(text)
        print(report, f"\n[{name}: {time.time() - t:.0f} s]\n", flush=True)
        (out / f"{name}.txt").write_text(report + "\n")
        (out / f"{name}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
        del model, batch, diagnosis
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
