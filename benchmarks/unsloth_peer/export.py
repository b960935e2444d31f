"""The export folder both sides share: written in our environment, read back in Unsloth's.

``export --out DIR`` (our environment) writes the preset's architecture with random bf16 weights
(``fastsft_lab.models.build_model``, the harness's seed-0 init; safetensors shards), a WordLevel tokenizer whose
vocabulary is the model's (Unsloth's loader needs one in the folder), the packed batches of
``fastsft_lab.data.benchmark_batches`` as plain lists (``batches.json``) and ``meta.json`` (written last: its
presence means the export is complete). Families: dense Qwen3 (default 8 layers, one row of ``tokens`` per step,
QLoRA on all seven projections) and GPT-OSS (default every layer, rows of 4096 tokens, bf16, LoRA on q/k/v/o;
``output_router_logits`` written false). The export first checks the file system can hold the bf16 shards
(GPT-OSS-20B x24: ~21B parameters, ~39 GiB).

``read_export`` is what ``run`` reads (plain JSON: both environments). torch, transformers and fastsft_lab's
models are imported inside ``export`` only.
"""

from __future__ import annotations

import json
import os
import platform
import time

from .common import (FAMILIES, GPT_OSS_LORA_TARGETS, LORA_ALPHA, LORA_DROPOUT, LORA_TARGETS, MOE_ROW_TOKENS,
                     dist_version, log, now, one_line, write_json)
from .stats import length_stats

EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "batches.json")


def batches_to_json(batches) -> list[dict]:
    """PackedBatch list -> plain lists (input_ids, labels, position_ids, seq_lengths, pad_lengths)."""
    return [{"input_ids": b.input_ids.tolist(), "labels": b.labels.tolist(), "position_ids": b.position_ids.tolist(),
             "seq_lengths": [list(r) for r in b.seq_lengths], "pad_lengths": list(b.pad_lengths)} for b in batches]


def read_export(folder: str) -> tuple[dict, list[dict]]:
    """meta.json and batches.json of an export folder, checked; raises with what is missing."""
    meta_path = os.path.join(folder, "meta.json")
    if not os.path.isfile(meta_path):
        err = os.path.join(folder, "export_error.json")
        why = ""
        if os.path.isfile(err):
            with open(err) as f:
                why = "; export failed: " + one_line(json.load(f).get("error", "?"), 300)
        raise FileNotFoundError(f"{meta_path} is missing (no complete export in {folder}{why})")
    with open(meta_path) as f:
        meta = json.load(f)
    with open(os.path.join(folder, "batches.json")) as f:
        batches = json.load(f)["batches"]
    if not batches:
        raise ValueError(f"{folder}/batches.json holds no batches")
    for i, b in enumerate(batches):
        rows = len(b["input_ids"])
        for r in range(rows):
            if sum(b["seq_lengths"][r]) != len(b["input_ids"][r]):
                raise ValueError(f"batch {i} row {r}: seq_lengths sum to {sum(b['seq_lengths'][r])}, "
                                 f"the row has {len(b['input_ids'][r])} tokens")
    return meta, batches


def tokenizer(vocab_size: int, model_max_length: int):
    """A WordLevel tokenizer "t0".."t{V-1}" (ids = our token ids) with pad t0, eos t1, unk t3."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t3",
                                   model_max_length=model_max_length)


def family_defaults(family: str, tokens: int, preset_layers: int) -> dict:
    """What the peer runs by default for a model family: the combined scenario's setup (see the docstring)."""
    if family == "gpt_oss":
        return {"num_layers": preset_layers, "row_tokens": min(MOE_ROW_TOKENS, tokens),
                "targets": GPT_OSS_LORA_TARGETS, "load_in_4bit": False}
    return {"num_layers": 8, "row_tokens": tokens, "targets": LORA_TARGETS, "load_in_4bit": True}


def check_free_space(folder: str, need_bytes: int) -> int:
    """Free bytes under ``folder``; raises before anything is built if the shards cannot fit."""
    import shutil

    free = shutil.disk_usage(folder).free
    if free < need_bytes:
        raise OSError(f"{folder} has {free / 2**30:.1f} GiB free, the bf16 shards need ~{need_bytes / 2**30:.1f} GiB "
                      "(set UNSLOTH_PEER_EXPORT_DIR to a larger file system, e.g. /dev/shm if it is big enough)")
    return free


def _check_arguments(preset, model: str, num_layers, tokens: int, steps: int, row_tokens: int | None,
                     defaults: dict) -> tuple[int | None, int]:
    """(num_layers, row_tokens) the export builds; raises on what the peer does not run."""
    if num_layers == "auto":
        num_layers = defaults["num_layers"]
    elif isinstance(num_layers, str) or (num_layers is not None and num_layers < 1):
        raise ValueError(f"num_layers must be an int >= 1, None (all) or 'auto', got {num_layers!r}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    row_tokens = defaults["row_tokens"] if row_tokens is None else row_tokens
    if preset.family == "qwen3" and row_tokens != tokens:
        raise ValueError(f"row_tokens={row_tokens}: the Qwen3 peer packs one row of tokens={tokens} per step (as the "
                         "combined scenario does for dense models)")
    if row_tokens < 1 or tokens % row_tokens:
        raise ValueError(f"tokens={tokens} is not a positive multiple of row_tokens={row_tokens}")
    max_pos = preset.config["max_position_embeddings"]
    if row_tokens > max_pos:
        raise ValueError(f"rows of {row_tokens} tokens exceed {model}'s max_position_embeddings={max_pos} (Unsloth "
                         "would rescale RoPE)")
    return num_layers, row_tokens


def _clear(out: str) -> None:
    """Remove only what an export writes: a stale meta.json must never survive a failure."""
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):
        if name in EXPORT_FILES or (name.startswith("model-") and name.endswith(".safetensors")):
            os.remove(os.path.join(out, name))


def _save_model(net, out: str, family: str) -> dict:
    """Write ``net``'s config and bf16 shards into ``out`` (pad 0, eos 1, no bos); what meta.json records of them."""
    net.config.pad_token_id, net.config.eos_token_id, net.config.bos_token_id = 0, 1, None
    if family == "gpt_oss":
        # The combined scenario's loss: cross-entropy only (transformers adds router_aux_loss_coef x the
        # load-balancing loss only when output_router_logits is on; written explicitly, so neither side guesses).
        net.config.output_router_logits = False
    if getattr(net, "generation_config", None) is not None:
        net.generation_config.pad_token_id, net.generation_config.eos_token_id, net.generation_config.bos_token_id = \
            0, 1, None
    n_params = sum(p.numel() for p in net.parameters())
    t1 = time.time()
    net.save_pretrained(out, max_shard_size="2GB")  # transformers 5 always writes safetensors
    shards = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    if not shards:
        raise RuntimeError(f"save_pretrained wrote no .safetensors file into {out}")
    weight_bytes = sum(os.path.getsize(os.path.join(out, n)) for n in shards)
    save_seconds = round(time.time() - t1, 1)
    log(f"export: {n_params / 1e9:.2f}B parameters, {weight_bytes / 2**30:.2f} GiB in {len(shards)} shard(s), "
        f"saved in {save_seconds:.0f}s ({weight_bytes / 2**30 / max(save_seconds, 1e-3):.2f} GiB/s)")
    cfg = net.config
    arch = {}
    if family == "gpt_oss":
        arch = {"layer_types": list(cfg.layer_types), "sliding_window": cfg.sliding_window,
                "num_local_experts": cfg.num_local_experts, "experts_per_token": cfg.num_experts_per_tok,
                "output_router_logits": bool(cfg.output_router_logits),
                "router_aux_loss_coef": cfg.router_aux_loss_coef}
    return {"num_layers": cfg.num_hidden_layers, "vocab_size": cfg.vocab_size, "params": n_params,
            "weight_bytes": weight_bytes, "shards": shards, "save_seconds": save_seconds, "arch": arch}


def export(out: str, model: str = "qwen3-14b", num_layers: int | None | str = "auto", tokens: int = 8192,
           steps: int = 6, mix: str = "realistic", lora_rank: int = 16, device: str | None = None,
           row_tokens: int | None = None) -> dict:
    """Write the shared inputs of the Unsloth peer into ``out`` (see the module docstring); returns meta.json.

    ``num_layers="auto"``: 8 for Qwen3, every layer for GPT-OSS (None: every layer); ``row_tokens`` None: the
    family's (one row for Qwen3, 4096-token rows for GPT-OSS, as the combined scenario's ``moe_row_tokens``)."""
    import torch

    import fastsft_lab
    from fastsft_lab.data import benchmark_batches
    from fastsft_lab.models import build_model, count_parameters, get_preset

    t0 = time.time()
    for stale in ("meta.json", "export_error.json"):  # whatever happens next, no stale export looks complete
        if os.path.isfile(os.path.join(out, stale)):
            os.remove(os.path.join(out, stale))
    preset = get_preset(model)
    if preset.family not in FAMILIES:
        raise ValueError(f"preset {model!r} is a {preset.family} model: the Unsloth peer covers dense Qwen3 presets "
                         "(FastLanguageModel runs them through FastQwen3Model, its hand-written packed path) and "
                         "GPT-OSS presets (FastModel, bf16 16-bit LoRA on attention)")
    defaults = family_defaults(preset.family, tokens, preset.config["num_hidden_layers"])
    num_layers, row_tokens = _check_arguments(preset, model, num_layers, tokens, steps, row_tokens, defaults)
    max_pos = preset.config["max_position_embeddings"]
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    _clear(out)
    expected = count_parameters(preset, num_layers=num_layers) * 2  # bf16, on the meta device: nothing allocated
    free = check_free_space(out, int(expected * 1.02) + 2**28)

    log(f"export: {model}, {num_layers or 'all'} layers, random bf16 weights on {device} "
        f"(~{expected / 2**30:.1f} GiB of shards, {free / 2**30:.0f} GiB free in {out})")
    net = build_model(model, weights="random", device=device, dtype=torch.bfloat16, num_layers=num_layers)
    saved = _save_model(net, out, preset.family)
    del net
    if device.type == "cuda":
        torch.cuda.empty_cache()

    vocab = saved["vocab_size"]
    tok = tokenizer(vocab, max_pos)
    if len(tok) != vocab:
        raise RuntimeError(f"tokenizer has {len(tok)} tokens, the model {vocab}")
    tok.save_pretrained(out)

    batches = benchmark_batches(tokens_per_step=tokens, row_tokens=row_tokens, steps=steps, vocab_size=vocab, mix=mix)
    write_json(os.path.join(out, "batches.json"), {"format": 1, "tokens_per_step": tokens, "row_tokens": row_tokens,
                                                   "mix": mix, "batches": batches_to_json(batches)})
    meta = {
        "preset": model, "family": preset.family, "hub_id": preset.hub_id, "num_layers": saved["num_layers"],
        "tokens": tokens, "row_tokens": row_tokens, "rows": tokens // row_tokens, "steps": steps, "mix": mix,
        "vocab_size": vocab, "pad_token_id": 0, "lora_rank": lora_rank, "lora_alpha": LORA_ALPHA,
        "lora_dropout": LORA_DROPOUT,
        "targets": list(defaults["targets"]), "load_in_4bit": defaults["load_in_4bit"], "dtype": "bfloat16",
        "params": saved["params"],
        "weights": "random, fastsft_lab.models.build_model seed 0 (the harness's init), bf16 safetensors",
        "weight_bytes": saved["weight_bytes"], "shards": saved["shards"], "save_seconds": saved["save_seconds"],
        **saved["arch"],
        "batches": [length_stats(b.seq_lengths, b.pad_lengths, row_tokens) for b in batches],
        "date": now(), "export_device": str(device), "export_seconds": round(time.time() - t0, 1),
        "versions": {"fastsft_lab": fastsft_lab.__version__, "torch": torch.__version__,
                     "transformers": dist_version("transformers"), "tokenizers": dist_version("tokenizers"),
                     "peft": dist_version("peft"), "python": platform.python_version()},
    }
    write_json(os.path.join(out, "meta.json"), meta)  # last: marks the export complete
    log(f"export: done in {meta['export_seconds']}s -> {out}")
    return meta
