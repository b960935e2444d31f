#!/usr/bin/env python3
"""Unsloth as a peer: the combined benchmark's model, packed batches and LoRA settings, run through Unsloth.

Two commands, two processes, two site folders (Unsloth patches transformers when it is imported, so it never
shares a process with fastsft_lab's own environment):

``export --out DIR`` (our environment) writes what both sides share: the preset's architecture with random bf16
weights (``fastsft_lab.models.build_model``, the harness's seed-0 init; safetensors shards), a WordLevel tokenizer
whose vocabulary is the model's (Unsloth's loader needs one in the folder), the packed batches of
``fastsft_lab.data.benchmark_batches`` as plain lists (``batches.json``) and ``meta.json`` (written last: its
presence means the export is complete). Families: dense Qwen3 (default 8 layers, one row of ``tokens`` per step,
QLoRA on all seven projections) and GPT-OSS (default every layer, rows of 4096 tokens, bf16, LoRA on q/k/v/o;
``output_router_logits`` written false). The export first checks the file system can hold the bf16 shards
(GPT-OSS-20B x24: ~21B parameters, ~39 GiB).

``run --dir DIR --out RESULT.json`` (Unsloth's environment; imports nothing of fastsft_lab) measures one
training step per batch of Unsloth 2026.10's own QLoRA path (GPT-OSS: its 16-bit LoRA path) and writes it in the harness's result format
(``scenario``/``env``/``config``/``variants`` with ``forward_ms``/``backward_ms``/``optimizer_ms``/``step_ms`` as
median/p20/p80/n, ``peak_mem_bytes``, ``host_syncs_per_step``, ``loss_median``). What runs:

* ``FastLanguageModel.from_pretrained(DIR, load_in_4bit=True, dtype=bf16, max_seq_length=tokens,
  local_files_only=True)``: the loader reads config.json (model_type qwen3 -> ``FastQwen3Model``) and has
  transformers/bitsandbytes quantize the bf16 shards on the fly (NF4, double quant, bf16 compute; lm_head and the
  embedding stay bf16) -- the NF4 scheme of our ``quantize_nf4`` QLoRA, on the same seed-0 weights.
* ``get_peft_model(r, alpha 32, dropout 0, q/k/v/o/gate/up/down, use_gradient_checkpointing="unsloth")``:
  Unsloth's own Qwen3 attention/decoder/model forwards, Triton RMSNorm and RoPE kernels, fused LoRA autograd
  functions for QKV, O and the SwiGLU MLP (NF4 dequantized inside), LoRA weights upcast to fp32; the forward runs
  under bf16 autocast as its Trainer (bf16=True) runs it. LoRA B starts non-zero (normal, std 0.01), as in the
  combined scenario.
* Packing: each batch is one row fed as ``input_ids``/``labels``/``position_ids`` (restarting at 0 per segment,
  which Unsloth's Qwen3 RoPE reads) plus ``packed_seq_lengths`` (int32 segment lengths, pad tail included; a host
  tensor as its collator builds it, or on the GPU with ``--seq-lengths-device cuda`` as HF Trainer's
  ``_prepare_inputs`` would move it). Attention reads the segment boundaries from ``packed_seq_lengths`` only.
  Without flash-attn or xformers, and with torch 2.11's ``varlen_attn`` lacking ``enable_gqa`` (Unsloth wants
  2.12), Unsloth runs *one SDPA call per run of equal-length segments in every layer* (``_sdpa_packed_segments``)
  in the forward, the recompute and the backward -- where our packed path runs one varlen flash call per layer
  on metadata built once per batch. ``attention_calls`` in the result says which path ran.
* Offloaded checkpointing (``UnslothCheckpointFunction``, reentrant): each decoder layer's input (after the
  first pass, not the last layer's) is copied to pinned host memory on a side stream in the forward and reloaded
  in the backward through a GPU staging buffer. Double buffer (default; ``UNSLOTH_DISABLE_DOUBLE_BUFFER=1`` turns
  it off; read once, when the first checkpoint is initialised; set here before ``import unsloth``): two staging
  buffers alternate, so a reload waits only for the compute that last used its buffer, not for all prior work;
  Unsloth turns it on from the second forward if more than 512 MiB are free (``double_buffer_per_measured_step``
  records what happened). No prefetch (``UNSLOTH_GC_PREFETCH`` unset), unlike our double buffer.
* Loss: Unsloth's chunked fused linear cross-entropy (``unsloth_fused_ce_loss``, torch.compile'd chunks; the full
  logits never exist), the mean over labelled tokens (our stock path materialises the logits). Its per-block
  torch.compile (torch >= 2.11) is bypassed for batches with ``packed_seq_lengths``: the decoder runs eagerly.
* ``torch.optim.AdamW(lr=1e-6)`` over the trainable parameters, as the harness's ``make_optimizer``.

GPT-OSS (``gpt-oss-20b``; read from the 2026.10.9 wheels, checked on the live model where the result says so):

* Load: ``FastLanguageModel.from_pretrained`` sends any model_type other than llama/mistral/gemma/qwen2/qwen3 to
  ``FastModel.from_pretrained`` (unsloth/models/loader.py), here with ``load_in_4bit=False, load_in_16bit=True``,
  bf16, ``use_exact_model_name=True`` (no hub-name mapping of the folder). A config without
  ``quantization_config`` counts as fused experts (``gpt_oss_checkpoint_has_fused_experts``,
  unsloth/models/loader_utils.py), which a 16-bit load accepts; the folder needs config.json, the safetensors and
  tokenizer files (no chat template). For gpt_oss the loader sets ``UNSLOTH_HIGH_PRECISION_LAYERNORM=1`` and
  registers an fp32 upcast of the expert biases; SDPA, flash and flex are excluded as the *config's* attention
  (unsloth/models/_utils.py), so transformers is configured "eager" and Unsloth's patch replaces the forward.
* Attention (unsloth_zoo/temporary_patches/gpt_oss.py, ``patch_GptOssAttention`` / ``patch_GptOssModel``,
  installed when ``UNSLOTH_MODEL_NAME`` names gpt_oss): in training ``flex_attention_with_sink(self, q, k, v)``
  (unsloth_zoo/flex_attention/attention_sink.py): torch's compiled flex attention over a BlockMask that is causal
  (``q >= kv``, full layers) or causal sliding-window 128 (``q - kv < 128``, the ``sliding_window`` layers, every
  other one), built once per shape and broadcast over batch and heads, sinks applied by rescaling each query's
  output with ``sigmoid(lse - sink)`` (lse over that query's allowed keys). In training ``GptOssModel.forward``
  sets ``attention_mask = None`` (no mask factory runs) and the attention is called without one; ``position_ids``
  reach only RoPE (default ``arange(width)``). No mask of segments exists on this path and ``packed_seq_lengths``
  is read nowhere: **packed segments of a row attend to each other**; unsloth/trainer.py lists gpt_oss in
  ``PADDING_FREE_BLOCKLIST`` and turns ``packing``/``padding_free`` off for it, so TRL's collator pads: one row
  per sequence, right padding, labels -100 and ``attention_mask`` 0 on the pads, no position_ids, padded to a
  multiple of 128 (Unsloth's SFTConfig sets ``pad_to_multiple_of`` to the flex block size when flex attention is
  on, unsloth/models/rl.py).
* Layout ``--layout padded`` (the default for GPT-OSS): what an Unsloth user trains. Each real segment of our
  packed batch becomes its own row (same sequences per step, in packed order), right-padded with the pad token to
  the step's longest sequence rounded up to ``--pad-to-multiple-of`` (128), its labels the packed labels of its
  tokens (the first is -100 there, so the HF shift gives the same (position, target) pairs: checked per batch)
  and -100 on pads, ``attention_mask`` 1/0 (dropped in training, see above). Right padding with a causal or causal
  sliding-window mask is exact for the real tokens: none attends to a pad after it, the sink rescale reads only
  the keys it attends to, and the loss is the mean over the same labelled tokens as our packed step
  (``segments_isolated`` True by construction; ``padded_probe`` measures it after the timed steps: a row's real
  outputs at layer 0's attention and the final norm must not move when another row's tokens change, nor when its
  own pads change). What is compared: our packed step against Unsloth's padded step over the same sequences;
  the padding waste (``padded_tokens_per_step`` against ``real_tokens_per_step``, ``padding_fraction``: rows x
  the longest sequence) is part of what an Unsloth user pays. One forward per step, no micro-batches. Every new
  padded shape recompiles Unsloth's GPT-OSS pieces (batch dimension marked static) and builds a BlockMask, so
  warmup runs until every batch shape a measured step meets has run once (``config.warmup_run``).
* Layout ``--layout packed``: the export's ``(rows, 4096)`` ``input_ids``/``labels``/``position_ids`` without
  ``packed_seq_lengths``. ``config.segments_isolated`` is False by the reading above and replaced by what a
  probe measures after the timed steps (``isolation_probe``: layer 0's attention output with the first segment's
  ids changed must not move after it; ``causal_measured``: with the last segment changed nothing before it may
  move), with ``segments_isolated_reason``. The measured step does causal-over-the-row attention, other work than
  our per-segment varlen, and its loss is not comparable.
* Experts (frozen, bf16): ``patch_gpt_oss_moe_for_lora`` replaces ``GptOssExperts.forward`` with
  ``forward_native_grouped_mm`` (unsloth_zoo/temporary_patches/moe_utils.py: ``torch._grouped_mm`` when a probe
  finds it supported, as on H100/H200; GPT-OSS's interleaved gate_up never takes its Triton grouped GEMM, else
  ``forward_native_moe_loop``); the router is transformers' unless ``UNSLOTH_MOE_FUSED_ROUTER=1``. The result's
  ``model`` block records the live attention/experts forwards, ``moe_backend`` and the expert dtypes.
* LoRA r16 alpha 32 on q/k/v/o of every layer (``FastLlamaModel.get_peft_model`` -> ``FastBaseModel``, checked:
  4 x layers adapters, nothing else trains); offloaded checkpointing is the same ``unsloth_zoo``
  gradient_checkpointing as for Qwen3 (``use_gradient_checkpointing="unsloth"``, ``max_seq_length`` = 4096 >=
  512), checked the same way. Loss: cross-entropy only, ``output_router_logits=False`` (no router aux loss),
  as our combined scenario's GPT-OSS.

``tokens_per_s``: real tokens per step (mean over the exported batches, pad tails and pads left out) over the
median step; ``padded_tokens_per_s`` counts what the model computes on (rows x width).

Timing as the harness: CUDA events around forward, backward, optimizer (step + zero_grad) and the whole step,
one sync after each step, ``warmup`` untimed steps first, batches cycled ``batch[s % n]``; peak memory is
``max_memory_allocated`` reset before each step (max over all steps, as the harness). Host syncs are counted over
one extra untimed step (batch 0) as the ``torch.cuda.set_sync_debug_mode("warn")`` warnings reading
"called a synchronizing CUDA operation" (not our dispatch-mode counter), the optimizer apart. Every failure --
and a run where the
measured path is not the claimed one (no 4-bit layers, packed attention not reached, no offload, double buffer
not as asked, adapters without gradients, a non-finite loss; for GPT-OSS also 4-bit layers, router logits on,
LoRA off its four targets, non-bf16 expert weights, Unsloth's flex-sink attention not on the model) -- writes a
result whose variant carries ``error``. ``--layout padded`` is refused for Qwen3: Unsloth packs Qwen3 itself
(``packed_seq_lengths``), which is what that peer measures.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import signal
import sys
import time
import traceback
from importlib.metadata import version as _metadata_version

SCENARIO = "peer-unsloth"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GPT_OSS_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")  # attention only, experts frozen (combined.py)
MOE_ROW_TOKENS = 4096  # the combined scenario's moe_row_tokens
FAMILIES = ("qwen3", "gpt_oss")
LORA_ALPHA = 32
LORA_DROPOUT = 0.0
LR = 1e-6
LAYOUTS = ("packed", "padded")
IGNORE_INDEX = -100
PAD_TOKEN_ID = 0  # the export's pad token ("t0"), benchmark_batches' pad_token_id
# Unsloth's SFTConfig sets pad_to_multiple_of to torch's flex block size (_DEFAULT_SPARSE_BLOCK_SIZE, 128) when
# flex attention is on, as for GPT-OSS (unsloth/models/rl.py, "pad_to_multiple_of = FLEX_ATTENTION_BLOCK_SIZE").
FLEX_PAD_MULTIPLE = 128
EXPORT_FILES = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
                "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "batches.json")


# --- pure helpers (both environments) ---------------------------------------------------------------------------
def _quantile(sorted_values, p: float) -> float:
    """Linear-interpolation quantile ``p`` of already sorted values (numpy's default method)."""
    x = p * (len(sorted_values) - 1)
    lo = int(x)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (x - lo)


def percentiles(values) -> dict:
    """median, p20, p80 (linear interpolation) and n, rounded as the harness reports them."""
    v = sorted(float(x) for x in values)
    if not v:
        return {"median": float("nan"), "p20": float("nan"), "p80": float("nan"), "n": 0}
    return {"median": round(_quantile(v, 0.5), 4), "p20": round(_quantile(v, 0.2), 4),
            "p80": round(_quantile(v, 0.8), 4), "n": len(v)}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _log(msg: str) -> None:
    print(f"[unsloth_peer {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _one_line(text: str, limit: int = 600) -> str:
    return " ".join(str(text).split())[:limit]


def _write_json(path: str, doc: dict) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, default=str, allow_nan=True)
    os.replace(tmp, path)
    return path


def _dist_version(name: str) -> str | None:
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__version__", None):
        return str(module.__version__)
    try:
        return _metadata_version(name)
    except Exception:  # noqa: BLE001 - not installed
        return None


def length_stats(seq_lengths, pad_lengths, row_tokens: int) -> dict:
    """The harness's ``PackedBatch.length_stats`` from plain lists (segments without the padding tails)."""
    real = [n for row, pad in zip(seq_lengths, pad_lengths) for n in (row[:-1] if pad else row)]
    rows = len(seq_lengths)
    out = {"rows": rows, "row_tokens": row_tokens, "fill": (rows * row_tokens - sum(pad_lengths)) / (rows * row_tokens)}
    if not real:
        return {"count": 0, **out}
    s = sorted(real)
    return {"count": len(s), "min": s[0], "median": round(_quantile(s, 0.5), 1), "mean": round(sum(s) / len(s), 1),
            "p90": round(_quantile(s, 0.9), 1), "max": s[-1], **out}


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
                why = "; export failed: " + _one_line(json.load(f).get("error", "?"), 300)
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


# --- export (our environment) -----------------------------------------------------------------------------------
def _tokenizer(vocab_size: int, model_max_length: int):
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


def _check_free_space(folder: str, need_bytes: int) -> int:
    """Free bytes under ``folder``; raises before anything is built if the shards cannot fit."""
    import shutil

    free = shutil.disk_usage(folder).free
    if free < need_bytes:
        raise OSError(f"{folder} has {free / 2**30:.1f} GiB free, the bf16 shards need ~{need_bytes / 2**30:.1f} GiB "
                      "(set UNSLOTH_PEER_EXPORT_DIR to a larger file system, e.g. /dev/shm if it is big enough)")
    return free


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
    targets = defaults["targets"]
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):  # only what an export writes: a stale meta.json must never survive a failure
        if name in EXPORT_FILES or (name.startswith("model-") and name.endswith(".safetensors")):
            os.remove(os.path.join(out, name))
    expected = count_parameters(preset, num_layers=num_layers) * 2  # bf16, on the meta device: nothing allocated
    free = _check_free_space(out, int(expected * 1.02) + 2**28)

    _log(f"export: {model}, {num_layers or 'all'} layers, random bf16 weights on {device} "
         f"(~{expected / 2**30:.1f} GiB of shards, {free / 2**30:.0f} GiB free in {out})")
    net = build_model(model, weights="random", device=device, dtype=torch.bfloat16, num_layers=num_layers)
    vocab = net.config.vocab_size
    net.config.pad_token_id, net.config.eos_token_id, net.config.bos_token_id = 0, 1, None
    if preset.family == "gpt_oss":
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
    _log(f"export: {n_params / 1e9:.2f}B parameters, {weight_bytes / 2**30:.2f} GiB in {len(shards)} shard(s), "
         f"saved in {save_seconds:.0f}s ({weight_bytes / 2**30 / max(save_seconds, 1e-3):.2f} GiB/s)")
    num_layers_built = net.config.num_hidden_layers
    cfg = net.config
    arch = {}
    if preset.family == "gpt_oss":
        arch = {"layer_types": list(cfg.layer_types), "sliding_window": cfg.sliding_window,
                "num_local_experts": cfg.num_local_experts, "experts_per_token": cfg.num_experts_per_tok,
                "output_router_logits": bool(cfg.output_router_logits),
                "router_aux_loss_coef": cfg.router_aux_loss_coef}
    del net, cfg
    if device.type == "cuda":
        torch.cuda.empty_cache()

    tok = _tokenizer(vocab, max_pos)
    if len(tok) != vocab:
        raise RuntimeError(f"tokenizer has {len(tok)} tokens, the model {vocab}")
    tok.save_pretrained(out)

    batches = benchmark_batches(tokens_per_step=tokens, row_tokens=row_tokens, steps=steps, vocab_size=vocab, mix=mix)
    _write_json(os.path.join(out, "batches.json"), {"format": 1, "tokens_per_step": tokens, "row_tokens": row_tokens,
                                                    "mix": mix, "batches": batches_to_json(batches)})
    meta = {
        "preset": model, "family": preset.family, "hub_id": preset.hub_id, "num_layers": num_layers_built,
        "tokens": tokens, "row_tokens": row_tokens, "rows": tokens // row_tokens, "steps": steps, "mix": mix,
        "vocab_size": vocab, "pad_token_id": 0, "lora_rank": lora_rank, "lora_alpha": LORA_ALPHA,
        "lora_dropout": LORA_DROPOUT,
        "targets": list(targets), "load_in_4bit": defaults["load_in_4bit"], "dtype": "bfloat16", "params": n_params,
        "weights": "random, fastsft_lab.models.build_model seed 0 (the harness's init), bf16 safetensors",
        "weight_bytes": weight_bytes, "shards": shards, "save_seconds": save_seconds, **arch,
        "batches": [length_stats(b.seq_lengths, b.pad_lengths, row_tokens) for b in batches],
        "date": _now(), "export_device": str(device), "export_seconds": round(time.time() - t0, 1),
        "versions": {"fastsft_lab": fastsft_lab.__version__, "torch": torch.__version__,
                     "transformers": _dist_version("transformers"), "tokenizers": _dist_version("tokenizers"),
                     "peft": _dist_version("peft"), "python": platform.python_version()},
    }
    _write_json(os.path.join(out, "meta.json"), meta)  # last: marks the export complete
    _log(f"export: done in {meta['export_seconds']}s -> {out}")
    return meta


# --- run (Unsloth's environment) --------------------------------------------------------------------------------
class Interrupted(BaseException):
    """SIGINT or SIGTERM (this run's timeout, or the stage's) while running."""


class CheckFailed(RuntimeError):
    """The measured path is not the one the result would claim."""


def _environment(torch=None) -> dict:
    env = {"device": None, "gpu_name": None, "cpu": platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count(), "python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "trl", "unsloth", "unsloth_zoo", "triton",
                 "accelerate", "datasets", "xformers", "flash_attn"):
        env[name] = _dist_version(name)
    if torch is not None:
        env["torch"], env["cuda"] = torch.__version__, torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env.update(device="cuda", gpu_name=props.name, gpu_memory_bytes=props.total_memory,
                       gpu_sm_count=props.multi_processor_count, gpu_capability=f"{props.major}.{props.minor}")
            try:
                import subprocess

                res = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=10, check=False)
                env["driver"] = res.stdout.strip().splitlines()[0] if res.stdout.strip() else None
            except Exception:  # noqa: BLE001
                env["driver"] = None
        else:
            env["device"] = "cpu"
    unsloth = sys.modules.get("unsloth")
    if unsloth is not None:
        env["unsloth_path"] = os.path.dirname(getattr(unsloth, "__file__", "") or "")
    env["unsloth_env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("UNSLOTH_")}
    env["date"] = _now()
    return env


CHECKPOINTING = {"unsloth": "unsloth", "off": False}   # --checkpointing -> use_gradient_checkpointing


def _variant_name(double_buffer: str, checkpointing: str = "unsloth") -> str:
    if checkpointing == "off":
        return "unsloth (checkpointing off)"
    return f"unsloth (double buffer {double_buffer})"


def _note(family: str, double_buffer: str, lengths_device: str, layout: str = "packed") -> str:
    if family == "gpt_oss" and layout == "padded":
        return (f"Unsloth {_dist_version('unsloth')} FastLanguageModel -> FastModel (GPT-OSS): bf16 weights, 16-bit "
                "LoRA on q/k/v/o, experts frozen (torch._grouped_mm when available), unsloth_zoo "
                "flex_attention_with_sink (causal / sliding-window mask over each padded row), padded layout: one "
                "sequence per row, right padding, attention_mask passed (dropped by its training forward), bf16 "
                f"autocast; offloaded gradient checkpointing, double buffer {double_buffer}; tokens_per_s on real "
                "tokens; host syncs from torch.cuda sync-debug warnings")
    if family == "gpt_oss":
        return (f"Unsloth {_dist_version('unsloth')} FastLanguageModel -> FastModel (GPT-OSS): bf16 weights, 16-bit LoRA "
                "on q/k/v/o, experts frozen (torch._grouped_mm when available), unsloth_zoo flex_attention_with_sink "
                "(causal / sliding-window mask over each 4096-token row: packed segments NOT kept apart), "
                "restarting position_ids for RoPE, bf16 autocast; offloaded gradient checkpointing, double buffer "
                f"{double_buffer}; host syncs from torch.cuda sync-debug warnings")
    return (f"Unsloth {_dist_version('unsloth')} FastLanguageModel (FastQwen3Model): NF4 QLoRA quantized on load, "
            "fused LoRA QKV/O/MLP, Triton RMSNorm/RoPE, chunked fused CE (compiled), bf16 autocast, fp32 LoRA; "
            f"packed_seq_lengths ({lengths_device}) + restarting position_ids, per-segment SDPA without "
            f"flash-attn/xformers; offloaded gradient checkpointing, double buffer {double_buffer}; host syncs "
            "from torch.cuda sync-debug warnings")


GPT_OSS_ISOLATION_REASON = (
    "Unsloth 2026.10.9 cannot keep packed GPT-OSS segments apart: in training, the GptOssAttention.forward that "
    "unsloth_zoo/temporary_patches/gpt_oss.py installs (patch_GptOssAttention) calls flex_attention_with_sink(self, "
    "q, k, v) with no mask, its GptOssModel.forward (patch_GptOssModel) drops attention_mask, and "
    "unsloth_zoo/flex_attention/attention_sink.py then builds a causal (full layers) or sliding-window-128 "
    "BlockMask over the whole row; position_ids reach only RoPE and packed_seq_lengths is read nowhere on this "
    "path. unsloth/trainer.py lists gpt_oss in PADDING_FREE_BLOCKLIST for that reason ('Flex Attention which "
    "doesn't handle padding_free correctly'). One segment per row is not possible with these batches (rows of "
    "4096 tokens holding several segments), so the run measures Unsloth's path as it is and segments_isolated "
    "is what the probe measured on batch 0.")
SINK_ENTRY_POINTS = ("flex_attention", "reused_compiled_create_block_mask", "compiled_create_block_mask")
PROBE_SAME, PROBE_CHANGED = 1e-3, 1e-2  # relative L2 change: <= SAME is unchanged, > CHANGED is changed


def variant_toggles(family: str, double_buffer: str, lengths_device: str, layout: str | None = None,
                    checkpointing: str = "unsloth") -> dict:
    layout = default_layout(family) if layout is None else layout
    if checkpointing == "off":
        double_buffer = "n/a"        # nothing is offloaded without checkpointing
    if family == "gpt_oss":
        return {"double_buffer": double_buffer, "gradient_checkpointing": checkpointing, "packed_seq_lengths": None,
                "load_in_4bit": False, "load_in_16bit": True, "layout": layout}
    return {"double_buffer": double_buffer, "gradient_checkpointing": checkpointing,
            "packed_seq_lengths": lengths_device, "load_in_4bit": True, "layout": layout}


GPT_OSS_PADDED_REASON = (
    "padded layout: each sequence is its own row, right-padded, so no two sequences share a row. Unsloth 2026.10.9's "
    "training attention (unsloth_zoo flex_attention_with_sink) drops attention_mask but is causal (full layers) or "
    "causal sliding-window 128 (q - kv < 128) over the row: a real token attends only to earlier tokens of its own "
    "sequence and never to a pad after it, the sinks rescale each query by sigmoid(lse - sink) over those same keys, "
    "RoPE gets the model's default position_ids 0..n-1 on the real tokens, pads carry labels -100; so the real "
    "tokens' outputs and the loss are those of each sequence alone. Checked by variants[0].packing.probe.")


def layout_stats(raw: list[dict], layout: str, multiple: int) -> dict:
    """Tokens per step for a layout: real (the sequences), fed (what the model computes on: rows x row tokens for
    packed, rows x padded width for padded), per exported batch and their mean."""
    real = [sum(n for lens, pad in zip(b["seq_lengths"], b["pad_lengths"]) for n in (lens[:-1] if pad else lens))
            for b in raw]
    if layout == "padded":
        shapes = [(len(p["lengths"]), p["width"]) for p in (padded_layout(b, multiple=multiple) for b in raw)]
    else:
        shapes = [(len(b["input_ids"]), len(b["input_ids"][0])) for b in raw]
    fed = [r * w for r, w in shapes]
    return {"real_tokens_per_step": round(sum(real) / len(real), 1),
            "padded_tokens_per_step": round(sum(fed) / len(fed), 1),
            "padding_fraction": round(1 - sum(real) / sum(fed), 4),
            "real_tokens_per_batch": real, "padded_tokens_per_batch": fed,
            "shapes_per_batch": [list(x) for x in shapes]}


def run_config(meta: dict, raw: list[dict], folder: str, *, double_buffer: str, lengths_device: str, steps: int,
               warmup: int, layout: str | None = None, pad_multiple: int | None = None) -> dict:
    """The result's ``config`` block for an export (both families); what the run measures is added later."""
    family = meta.get("family", "qwen3")
    layout = check_layout(family, layout)
    pad_multiple = (FLEX_PAD_MULTIPLE if layout == "padded" else 1) if pad_multiple is None else pad_multiple
    rows = len(raw[0]["input_ids"])
    row_tokens = len(raw[0]["input_ids"][0])
    config = {"model": meta["preset"], "family": family, "num_layers": meta["num_layers"],
              "tokens_per_step": rows * row_tokens, "row_tokens": meta["row_tokens"], "rows": rows, "mix": meta["mix"],
              "quant": "nf4 (unsloth 4-bit)", "load_in_4bit": True,
              "lora_rank": meta["lora_rank"], "lora_alpha": meta.get("lora_alpha", LORA_ALPHA),
              "lora_dropout": meta.get("lora_dropout", LORA_DROPOUT), "lora_targets": meta["targets"],
              "lora_b_init": "normal(0, 0.01) where zero (as the harness)", "gradient_checkpointing": "unsloth",
              "double_buffer": double_buffer, "packed_seq_lengths_device": lengths_device, "autocast": "bf16",
              "dtype": "bfloat16", "optimizer": "torch.optim.AdamW", "lr": LR, "steps": steps, "warmup": warmup,
              "batch": length_stats(raw[0]["seq_lengths"], raw[0]["pad_lengths"], meta["row_tokens"]),
              "export": {k: meta.get(k) for k in ("weights", "params", "date", "versions", "vocab_size")},
              "export_dir": os.path.abspath(folder), "layout": layout,
              **layout_stats(raw, layout, pad_multiple)}
    if layout == "padded":
        config.update({
            "pad_to_multiple_of": pad_multiple,
            "padded_inputs": "one row per sequence of the packed batch (same sequences per step, packed order), "
                             "right-padded with the pad token to the step's longest sequence rounded up to "
                             f"pad_to_multiple_of ({pad_multiple}: Unsloth's SFTConfig default for GPT-OSS, torch's "
                             "flex block size), labels -100 on pads and the packed labels on real tokens (the same "
                             "(position, target) pairs), attention_mask 1/0, no position_ids (the model's default "
                             "arange, as TRL's collator feeds it)",
            "tokens_per_step_note": "tokens_per_step is the packed batch's rows x row_tokens; the padded step computes "
                                    "on padded_tokens_per_step tokens"})
    if family == "gpt_oss":
        config.update({
            "quant": "none: bf16 weights (FastModel 16-bit LoRA, load_in_4bit=False, load_in_16bit=True), as our "
                     "combined scenario's GPT-OSS", "load_in_4bit": False, "packed_seq_lengths_device": None,
            "experts": "frozen (LoRA on attention only)",
            "output_router_logits": bool(meta.get("output_router_logits", False)),
            "router_aux_loss": "off: output_router_logits=False, the loss is the cross-entropy alone (transformers "
                               "adds router_aux_loss_coef x load-balancing loss only when it is on); the combined "
                               "scenario's GPT-OSS loss is the same",
            "attention": "unsloth_zoo flex_attention_with_sink: causal / sliding-window BlockMask over each row, "
                         "sinks by sigmoid(lse - sink) rescaling",
            "segments_isolated": False, "segments_isolated_reason": GPT_OSS_ISOLATION_REASON,
            "segments_isolated_source": "reading of Unsloth's source (not measured in this run)",
            "causal_measured": None})
        if layout == "padded":
            config.update({
                "attention": "unsloth_zoo flex_attention_with_sink: causal / sliding-window BlockMask over each "
                             "padded row (attention_mask passed, dropped in training), sinks by sigmoid(lse - sink) "
                             "rescaling",
                "segments_isolated": True, "segments_isolated_reason": GPT_OSS_PADDED_REASON,
                "segments_isolated_source": "construction (one sequence per row, right padding); the probe's "
                                            "measurement is added after the run",
                "rows_independent_measured": None, "right_padding_exact_measured": None})
    return config


def check_lora_placement(lora_modules, trainable_names, targets, num_layers: int) -> str | None:
    """None if LoRA sits on exactly ``targets`` in every layer and nothing but adapters trains; else why not."""
    off = [n for n in lora_modules if n.rsplit(".", 1)[-1] not in targets]
    want = len(targets) * num_layers
    frozen_touched = [n for n in trainable_names if "lora_" not in n]
    why = []
    if off:
        why.append(f"LoRA on modules outside {list(targets)} (e.g. {off[:2]})")
    if len(lora_modules) - len(off) != want:
        why.append(f"{len(lora_modules) - len(off)} LoRA modules on the targets, want {want} "
                   f"({len(targets)} x {num_layers} layers)")
    if frozen_touched:
        why.append(f"{len(frozen_touched)} non-adapter tensors train (e.g. {frozen_touched[:2]})")
    return "; ".join(why) or None


def gpt_oss_paths(model, layers, torch) -> dict:
    """Which GPT-OSS code the loaded model runs, read off the live objects (no claim from the docstring)."""
    import inspect

    zoo = sys.modules.get("unsloth_zoo.temporary_patches.gpt_oss")
    moe = sys.modules.get("unsloth_zoo.temporary_patches.moe_utils")
    out: dict = {"flex_sink_attention_installed": bool(getattr(zoo, "_GPT_OSS_FLEX_SINK_ATTENTION_INSTALLED", False)),
                 "moe_backend": getattr(moe, "_SELECTED_MOE_BACKEND", None),
                 "unsloth_model_name_env": os.environ.get("UNSLOTH_MODEL_NAME"),
                 "high_precision_layernorm": os.environ.get("UNSLOTH_HIGH_PRECISION_LAYERNORM")}
    if not len(layers):
        return out
    name = lambda f: f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', '?')}"  # noqa: E731
    attn, experts = layers[0].self_attn, layers[0].mlp.experts
    fwd = type(attn).forward
    out.update({
        "attention_class": name(type(attn)), "attention_forward": name(fwd),
        "flex_sink_attention_on_model": bool(zoo is not None and out["flex_sink_attention_installed"]
                                             and getattr(fwd, "__module__", None) == zoo.__name__),
        "sliding_windows": [getattr(layer.self_attn, "sliding_window", None) for layer in layers[:2]],
        "experts_class": name(type(experts)), "experts_forward": name(type(experts).forward),
        "experts_lora_patched": bool(getattr(type(experts), "_unsloth_lora_patched", False)),
        "experts_dtypes": {n: str(p.dtype).replace("torch.", "") for n, p in experts.named_parameters()},
        "experts_trainable": any(p.requires_grad for p in experts.parameters()),
        "router_class": name(type(layers[0].mlp.router))})
    inner = getattr(getattr(model, "base_model", None), "model", model)
    inner = getattr(inner, "model", None)
    if inner is not None:
        out["model_forward"] = name(type(inner).forward)
        out["zoo_model_forward"] = bool(zoo is not None and getattr(type(inner).forward, "__module__", None)
                                        == zoo.__name__)
    base = model
    for _ in range(3):
        base = base.get_base_model() if hasattr(base, "get_base_model") else base
    try:
        out["fused_ce_in_forward"] = "unsloth_fused_ce_loss" in inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        out["fused_ce_in_forward"] = None
    return out


def real_segments(seq_lengths, pad_length: int) -> list[tuple[int, int]]:
    """(start, end) of each real segment of one row (the padding tail left out)."""
    spans, start = [], 0
    for n in seq_lengths:
        spans.append((start, start + n))
        start += n
    return spans[:-1] if pad_length else spans


def default_layout(family: str) -> str:
    """padded for GPT-OSS (Unsloth blocklists padding-free packing for it), packed for Qwen3."""
    return "padded" if family == "gpt_oss" else "packed"


def check_layout(family: str, layout: str | None) -> str:
    """The layout a run uses (None: the family's default); raises on one the peer does not run."""
    layout = default_layout(family) if layout is None else layout
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if family != "gpt_oss" and layout == "padded":
        raise ValueError("layout 'padded' is for GPT-OSS only: Unsloth packs Qwen3 itself (packed_seq_lengths, "
                         "per-segment attention), which is what the Qwen3 peer measures")
    return layout


def padded_layout(batch: dict, pad_token_id: int = PAD_TOKEN_ID, multiple: int = 1) -> dict:
    """One packed batch (batches.json) as an Unsloth GPT-OSS user feeds it: every real segment its own row, in the
    packed order, right-padded with ``pad_token_id`` to the step's longest sequence (rounded up to ``multiple``, as
    TRL's collator with Unsloth's ``pad_to_multiple_of``), labels the segment's own slice of the packed labels
    (its first token is already -100 there) and -100 on the pads, ``attention_mask`` 1 on real tokens, 0 on pads.
    The model's default position_ids (arange over the row: 0..n-1 on the real tokens) are what RoPE needs, so none
    are built. Plain lists: both environments use it. Raises if a segment's first label is not -100 or a padding
    tail carries a label (the labelled (position, target) pairs would then differ from the packed batch's)."""
    if multiple < 1:
        raise ValueError(f"pad multiple must be >= 1, got {multiple}")
    ids, labels, lengths, origin = [], [], [], []
    for r, (lens, pad) in enumerate(zip(batch["seq_lengths"], batch["pad_lengths"])):
        spans = real_segments(lens, pad)
        end = spans[-1][1] if spans else 0
        if any(x != IGNORE_INDEX for x in batch["labels"][r][end:]):
            raise ValueError(f"row {r}: the padding tail carries labels")
        for s, e in spans:
            seg_labels = batch["labels"][r][s:e]
            if seg_labels[0] != IGNORE_INDEX:
                raise ValueError(f"row {r}: the segment at {s} has label {seg_labels[0]} on its first token: in the "
                                 "packed row the previous sequence's last token is scored on it, alone it is not")
            ids.append(batch["input_ids"][r][s:e])
            labels.append(seg_labels)
            lengths.append(e - s)
            origin.append([r, s])
    if not lengths:
        raise ValueError("the batch holds no real segment")
    longest = max(lengths)
    width = -(-longest // multiple) * multiple
    pad = lambda row, value: list(row) + [value] * (width - len(row))  # noqa: E731
    return {"input_ids": [pad(x, pad_token_id) for x in ids], "labels": [pad(x, IGNORE_INDEX) for x in labels],
            "attention_mask": [[1] * n + [0] * (width - n) for n in lengths], "lengths": lengths, "width": width,
            "longest": longest, "origin": origin, "real_tokens": sum(lengths), "padded_tokens": width * len(lengths)}


def labelled_pairs_packed(batch: dict) -> list[tuple[int, int, int]]:
    """(sequence, position in it, target) of every labelled prediction of a packed batch under the HF causal-LM
    shift over each whole row (position t predicts labels[t + 1]); sequences numbered in row order. A pair whose
    position and target lie in different segments is returned with position -1 (it must not exist)."""
    out, seq = [], 0
    for r, (lens, pad) in enumerate(zip(batch["seq_lengths"], batch["pad_lengths"])):
        spans = real_segments(lens, pad)
        row_labels = batch["labels"][r]
        for t in range(len(row_labels) - 1):
            target = row_labels[t + 1]
            if target == IGNORE_INDEX:
                continue
            i = next((i for i, (s, e) in enumerate(spans) if s <= t + 1 < e), None)
            if i is None or not spans[i][0] <= t < spans[i][1]:
                out.append((seq + (i if i is not None else len(spans)), -1, target))
                continue
            out.append((seq + i, t - spans[i][0], target))
        seq += len(spans)
    return sorted(out)


def labelled_pairs_padded(padded: dict) -> list[tuple[int, int, int]]:
    """The same pairs for a padded layout (one sequence per row, the shift within each row)."""
    return sorted((r, t, row[t + 1]) for r, row in enumerate(padded["labels"]) for t in range(len(row) - 1)
                  if row[t + 1] != IGNORE_INDEX)


def warmup_covering(shapes: list, warmup: int, steps: int) -> int:
    """The fewest warmup steps >= ``warmup`` after which every batch shape a measured step meets (batch
    ``s % len(shapes)`` at step ``s``) has already run once: Unsloth's compiled GPT-OSS pieces keep the batch
    dimension static (mark_static) and build a BlockMask per length, so a new padded shape recompiles."""
    n = len(shapes)
    for w in range(warmup, warmup + n + 1):
        seen = {shapes[s % n] for s in range(w)}
        if all(shapes[s % n] in seen for s in range(w, w + steps)):
            return w
    return warmup + n


def _combine(verdicts) -> bool | None:
    verdicts = list(verdicts)
    if any(v is False for v in verdicts):
        return False
    return True if verdicts and all(v is True for v in verdicts) else None


def padded_probe(forward, feed: dict, lengths, modules: dict, vocab_size: int, torch) -> dict:
    """For the padded layout (one sequence per row, right padding), measured on the outputs of ``modules`` (e.g.
    layer 0's attention and the final norm): a row's real positions must not move when another row's tokens change
    (rows are independent; control: the changed row moves) nor when its own pads after them change (right padding
    with a causal mask is exact; control: the pad positions move)."""
    width = feed["input_ids"].shape[1]
    rows = len(lengths)
    padded_rows = [i for i, n in enumerate(lengths) if n < width]
    r = min(padded_rows, key=lambda i: lengths[i]) if padded_rows else 0
    o = max((i for i in range(rows) if i != r), key=lambda i: lengths[i], default=None)
    pick = [r] if o is None else [r, o]
    captured: dict = {}

    def hook_for(name):
        def hook(module, args, output):
            t = output[0] if isinstance(output, tuple) else output
            captured.setdefault(name, t[pick].detach().float().cpu())
        return hook

    def outputs(ids):
        captured.clear()
        with torch.no_grad():
            forward({**feed, "input_ids": ids})
        missing = [n for n in modules if n not in captured]
        if missing:
            raise RuntimeError(f"{missing} never ran under the probe's hooks")
        return dict(captured)

    def rel(a, b, row, lo, hi):
        d, ref = a[row, lo:hi] - b[row, lo:hi], b[row, lo:hi]
        return round(float(d.norm() / ref.norm().clamp_min(1e-30)), 6)

    ids = feed["input_ids"]
    other, pads = ids.clone(), ids.clone()
    if o is not None:
        other[o, :lengths[o]] = (other[o, :lengths[o]] + 1) % vocab_size
    pads[r, lengths[r]:] = (pads[r, lengths[r]:] + 1) % vocab_size
    handles = [m.register_forward_hook(hook_for(n)) for n, m in modules.items()]
    try:
        base, again = outputs(ids), outputs(ids)
        changed_other = outputs(other) if o is not None else None
        changed_pads = outputs(pads) if lengths[r] < width else None
    finally:
        for h in handles:
            h.remove()
    out = {"row": r, "row_length": lengths[r], "other_row": o, "other_length": lengths[o] if o is not None else None,
           "width": width, "thresholds": {"unchanged_at_most": PROBE_SAME, "changed_above": PROBE_CHANGED},
           "what": "relative L2 change of the modules' outputs (batch 0) on a row's real positions when another "
                   "row's tokens change, and when its own pad tokens change", "modules": {}}
    rows_v, pads_v = [], []
    for name in modules:
        m = {"rerun_noise": rel(again[name], base[name], 0, 0, lengths[r])}
        quiet = m["rerun_noise"] <= PROBE_SAME
        if changed_other is not None:
            m["row_change_other_row"] = rel(changed_other[name], base[name], 0, 0, lengths[r])
            m["row_change_control"] = rel(changed_other[name], base[name], 1, 0, lengths[o])
            rows_v.append(_verdict(m["row_change_other_row"], quiet and m["row_change_control"] > PROBE_CHANGED))
        if changed_pads is not None:
            m["pad_change_real_positions"] = rel(changed_pads[name], base[name], 0, 0, lengths[r])
            m["pad_change_control"] = rel(changed_pads[name], base[name], 0, lengths[r], width)
            pads_v.append(_verdict(m["pad_change_real_positions"], quiet and m["pad_change_control"] > PROBE_CHANGED))
        out["modules"][name] = m
    out["rows_independent"] = _combine(rows_v)
    out["right_padding_exact"] = _combine(pads_v)
    if o is None:
        out["rows_independent_note"] = "one row only: nothing to compare"
    if changed_pads is None:
        out["right_padding_note"] = "no row of batch 0 is padded"
    return out


def _verdict(changed: float | None, same_ok: bool = True) -> bool | None:
    if changed is None or not same_ok:
        return None
    return True if changed <= PROBE_SAME else False if changed > PROBE_CHANGED else None


def isolation_probe(forward, feed: dict, seq_lengths, pad_lengths, layers, layer_types, sliding_window,
                    vocab_size: int, torch) -> dict:
    """Whether packed segments of one row are kept apart, measured: the first layer's attention output (its input
    is the embedding, so nothing but attention mixes positions) with the first segment's tokens changed must stay
    unchanged where a later segment could see it (its window after the segment), and change on the segment itself
    (the control); with the last segment changed, every earlier position must stay unchanged (causality)."""
    row = next((r for r, (lens, pad) in enumerate(zip(seq_lengths, pad_lengths))
                if len(real_segments(lens, pad)) >= 2), None)
    if row is None:
        return {"segments_isolated": None, "causal": None, "error": "no row of batch 0 holds two segments"}
    spans = real_segments(seq_lengths[row], pad_lengths[row])
    (s0, e0), (sl, el) = spans[0], spans[-1]
    window = sliding_window if layer_types and layer_types[0] == "sliding_attention" else None
    later = (e0, el if window is None else min(el, e0 + window))
    captured = []

    def hook(module, args, output):
        captured.append((output[0] if isinstance(output, tuple) else output)[row].detach().float().cpu())

    def attention_output(ids):
        captured.clear()
        with torch.no_grad():
            forward({**feed, "input_ids": ids})
        if not captured:
            raise RuntimeError("the first layer's attention never ran under the probe's hook")
        return captured[0]

    def rel(a, b, lo, hi):
        d, ref = a[lo:hi] - b[lo:hi], b[lo:hi]
        return round(float(d.norm() / ref.norm().clamp_min(1e-30)), 6)

    ids = feed["input_ids"]
    first, last = ids.clone(), ids.clone()
    first[row, s0:e0] = (first[row, s0:e0] + 1) % vocab_size
    last[row, sl:el] = (last[row, sl:el] + 1) % vocab_size
    handle = layers[0].self_attn.register_forward_hook(hook)
    try:
        base, again = attention_output(ids), attention_output(ids)
        changed_first, changed_last = attention_output(first), attention_output(last)
    finally:
        handle.remove()
    noise = rel(again, base, 0, el)
    out = {"row": row, "segments": len(spans), "first_segment": [s0, e0], "last_segment": [sl, el],
           "window_layer0": window, "compared_after_first": list(later), "rerun_noise": noise,
           "first_segment_own_change": rel(changed_first, base, s0, e0),
           "after_first_segment_change": rel(changed_first, base, *later),
           "before_last_segment_change": rel(changed_last, base, 0, sl),
           "thresholds": {"unchanged_at_most": PROBE_SAME, "changed_above": PROBE_CHANGED},
           "what": "relative L2 change of layer 0's attention output (batch 0) when one segment's token ids change"}
    quiet = noise <= PROBE_SAME
    out["segments_isolated"] = _verdict(out["after_first_segment_change"],
                                        quiet and out["first_segment_own_change"] > PROBE_CHANGED)
    out["causal"] = _verdict(out["before_last_segment_change"], quiet)
    return out


def _count_calls(module, names, counts: dict):
    """Wrap ``module``'s functions ``names`` with counters (looked up at call time by their callers); returns undo."""
    saved = {}
    for name in names if module is not None else ():
        fn = getattr(module, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def wrapper(*args, _fn=fn, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*args, **kwargs)

        setattr(module, name, wrapper)

    def undo():
        for name, fn in saved.items():
            setattr(module, name, fn)

    return undo


def _count_attention_calls(adispatch, counts: dict):
    """Wrap Unsloth's packed-attention entry points with counters; returns an undo function."""
    return _count_calls(adispatch, ("_sdpa_packed_segments", "_torch_varlen_packed",
                                    "build_sdpa_packed_attention_mask", "build_xformers_block_causal_mask"), counts)


def profile_gpu(fn, top: int = 40) -> dict:
    """GPU time of one call of ``fn`` (``fastsft_lab.profiling.profile``): the busy total, and the top aten ops (their
    own device time) and kernels, in ms. What each side's step is made of, by name."""
    from fastsft_lab.profiling import profile  # after unsloth's import: it imports transformers

    r = profile(fn, steps=1, top=top)
    return {"what": "one untimed forward+backward of batch 0 under torch.profiler", "gpu_busy_ms": r.device_busy_ms,
            "ops": r.ops_per_step, "kernels": r.kernels_per_step}


def _sync_warnings(fn, torch) -> tuple[int, dict]:
    """Run ``fn`` under sync-debug mode "warn": (syncs CUDA reported, {site: count}).

    A sync's warning reads "called a synchronizing CUDA operation"; the one-time notice that the debug
    mode is a prototype (torch/cuda/__init__.py) also says "Synchronization" and is not counted.
    """
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    sites: dict = {}
    n = 0
    for w in caught:
        if "called a synchronizing CUDA operation" in str(w.message):
            n += 1
            key = f"{os.path.basename(str(w.filename))}:{w.lineno}"
            sites[key] = sites.get(key, 0) + 1
    return n, dict(sorted(sites.items(), key=lambda kv: -kv[1])[:12])


def run(folder: str, out: str, double_buffer: str = "on", warmup: int = 2, steps: int | None = None,
        lengths_device: str = "cpu", allow_cpu: bool = False, ctx: dict | None = None, layout: str | None = None,
        pad_multiple: int | None = None, checkpointing: str = "unsloth") -> dict:
    """Measure Unsloth on an export folder and write ``out``; ``ctx`` collects what is known if it fails.

    ``checkpointing``: "unsloth" (``use_gradient_checkpointing="unsloth"``, its offloaded checkpointing) or "off"
    (``False``: every activation kept, the peer of our plan's largest budgets).

    ``layout``: "packed" (the export's rows; Qwen3 with packed_seq_lengths) or "padded" (GPT-OSS only: one
    right-padded row per sequence, ``pad_multiple`` default 128); None: the family's default."""
    ctx = ctx if ctx is not None else {}
    ctx["stage"] = "read export"
    meta, raw = read_export(folder)
    steps = len(raw) if steps is None else steps
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    family = meta.get("family", "qwen3")
    if family not in FAMILIES:
        raise ValueError(f"{folder} holds a {family} export: the peer runs {', '.join(FAMILIES)}")
    gpt_oss = family == "gpt_oss"
    rows = len(raw[0]["input_ids"])
    row_tokens = len(raw[0]["input_ids"][0])
    tokens = rows * row_tokens
    if row_tokens != meta["row_tokens"]:
        raise ValueError(f"batches.json rows hold {row_tokens} tokens, meta.json says {meta['row_tokens']}")
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {', '.join(CHECKPOINTING)}, got {checkpointing!r}")
    ugc = CHECKPOINTING[checkpointing]
    ctx["toggles"] = variant_toggles(family, double_buffer, lengths_device,
                                     layout if layout in LAYOUTS else None, checkpointing)
    layout = check_layout(family, layout)
    padded = layout == "padded"
    if pad_multiple is not None and not padded:
        raise ValueError("a pad multiple applies to the padded layout only")
    pad_multiple = (FLEX_PAD_MULTIPLE if padded else 1) if pad_multiple is None else pad_multiple
    if pad_multiple < 1:
        raise ValueError(f"pad multiple must be >= 1, got {pad_multiple}")
    config = run_config(meta, raw, folder, double_buffer=double_buffer, lengths_device=lengths_device, steps=steps,
                        warmup=warmup, layout=layout, pad_multiple=pad_multiple)
    ctx["config"] = config
    layouts = [padded_layout(b, meta.get("pad_token_id", PAD_TOKEN_ID), pad_multiple) for b in raw] if padded else []
    for i, (b, p) in enumerate(zip(raw, layouts)):  # the same labelled (position, target) pairs as the packed batch
        if labelled_pairs_padded(p) != labelled_pairs_packed(b):
            raise ValueError(f"batch {i}: the padded layout's labelled pairs differ from the packed batch's")
    shapes = [tuple(x) for x in config["shapes_per_batch"]]
    warmup_run = warmup_covering(shapes, warmup, steps) if padded else warmup
    config["warmup_run"] = warmup_run
    if warmup_run != warmup:
        config["warmup_note"] = (f"{warmup_run} warmup steps instead of {warmup}: every padded batch shape a measured "
                                 "step meets runs once untimed first (a new shape recompiles Unsloth's GPT-OSS pieces "
                                 "and builds a new BlockMask)")

    ctx["stage"] = "environment"
    if "transformers" in sys.modules:
        raise RuntimeError("transformers was imported before unsloth: run this command in its own process")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", "/tmp/unsloth_compiled_cache")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # "1": off; any other value forces it on (unset: off only on integrated GPUs). Read at the first checkpoint init.
    os.environ["UNSLOTH_DISABLE_DOUBLE_BUFFER"] = "1" if double_buffer == "off" else "0"
    ctx["env_requested"] = {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("UNSLOTH_", "HF_"))}

    ctx["stage"] = "import unsloth"
    t = time.time()
    _log("importing unsloth (before transformers)")
    try:
        import unsloth  # noqa: F401 - patches transformers, must come first
        from unsloth import FastLanguageModel
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] in ("unsloth", "unsloth_zoo"):
            raise ModuleNotFoundError(f"unsloth is not importable ({e}); run in the Unsloth site folder: "
                                      "pip install --target /tmp/site-unsloth .whl-unsloth/*.whl and "
                                      "PYTHONPATH=/tmp/site-unsloth:$PWD") from None
        raise
    import torch

    ctx["env"] = _environment(torch)
    timings = {"import_s": round(time.time() - t, 1)}
    ctx["timings_s"] = timings
    cuda = torch.cuda.is_available()
    if not cuda and not allow_cpu:
        raise RuntimeError("no CUDA device: the Unsloth peer measures the GPU path (--allow-cpu runs Unsloth's "
                           "CPU backend for a plumbing check, a different code path)")
    device = torch.device("cuda" if cuda else "cpu")
    _log(f"unsloth {_dist_version('unsloth')}, torch {torch.__version__}, transformers "
         f"{_dist_version('transformers')}, device {ctx['env'].get('gpu_name') or 'cpu'}")

    ctx["stage"] = ("load (FastLanguageModel.from_pretrained, bf16 16-bit LoRA)" if gpt_oss else
                    "load (FastLanguageModel.from_pretrained, 4-bit)")
    t = time.time()
    max_seq = max([row_tokens] + [p["width"] for p in layouts])
    if gpt_oss:  # model_type gpt_oss -> FastModel.from_pretrained (loader.py); exact name: no hub-name mapping
        model, _tok = FastLanguageModel.from_pretrained(
            model_name=os.path.abspath(folder), max_seq_length=max_seq, dtype=torch.bfloat16, load_in_4bit=False,
            load_in_16bit=True, local_files_only=True, fix_tokenizer=False, use_gradient_checkpointing=ugc,
            use_exact_model_name=True)
    else:
        model, _tok = FastLanguageModel.from_pretrained(
            model_name=os.path.abspath(folder), max_seq_length=tokens, dtype=torch.bfloat16, load_in_4bit=True,
            local_files_only=True, fix_tokenizer=False, use_gradient_checkpointing=ugc)
    timings["load_s"] = round(time.time() - t, 1)
    quantized = [n for n, m in model.named_modules() if type(m).__name__ == "Linear4bit"]
    n4 = sum(1 for n in quantized if n.rsplit(".", 1)[-1] in LORA_TARGETS)
    want4 = len(LORA_TARGETS) * meta["num_layers"]
    _log(f"loaded in {timings['load_s']}s: {type(model).__name__}, {len(quantized)} Linear4bit layers"
         + (f", {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated" if cuda else ""))
    if gpt_oss:
        if quantized:
            raise CheckFailed(f"{len(quantized)} bitsandbytes Linear4bit layers after a 16-bit load (e.g. "
                              f"{quantized[:2]}): the GPT-OSS peer runs bf16 weights, as our combined scenario")
        if getattr(model.config, "output_router_logits", None):
            raise CheckFailed("output_router_logits is on after the load: the loss would add the router aux loss, "
                              "which the combined scenario's loss does not")
    elif n4 != want4:
        raise CheckFailed(f"{n4} of the {want4} projections (7 x layers) are bitsandbytes Linear4bit after the "
                          "4-bit load: the base weights are not NF4")

    ctx["stage"] = "get_peft_model"
    t = time.time()
    model = FastLanguageModel.get_peft_model(
        model, r=int(meta["lora_rank"]), target_modules=list(meta["targets"]),
        lora_alpha=config["lora_alpha"], lora_dropout=config["lora_dropout"], bias="none",
        use_gradient_checkpointing=ugc, random_state=3407, max_seq_length=max_seq)
    timings["peft_s"] = round(time.time() - t, 1)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise CheckFailed("get_peft_model left no trainable parameter")
    lora_modules = sorted(n for n, m in model.named_modules() if hasattr(m, "lora_A") and n.rsplit(".", 1)[-1]
                          not in ("lora_A", "lora_B"))
    lora_check = check_lora_placement(lora_modules, [n for n, _ in trainable], meta["targets"], meta["num_layers"])
    if lora_check:
        raise CheckFailed(lora_check)
    with torch.no_grad():
        for _, p in trainable:  # LoRA B starts at zero; give the adapters a real gradient path (as the harness)
            if p.dim() == 2 and not p.any():
                p.normal_(std=0.01)
    layers = model.base_model.model.model.layers if hasattr(model, "base_model") else []
    fused = {"qkv": sum(getattr(getattr(l.self_attn, "apply_qkv", None), "__name__", "") == "apply_lora_qkv"
                        for l in layers),
             "o": sum(getattr(getattr(l.self_attn, "apply_o", None), "__name__", "") == "apply_lora_o" for l in layers),
             "mlp": sum("lora_mlp" in getattr(getattr(l.mlp, "forward", None), "__name__", "") for l in layers)}
    emb = model.get_input_embeddings().weight
    model_info = {"class": type(model).__name__, "family": family, "linear4bit": len(quantized),
                  "lora_modules": len(lora_modules),
                  "linear4bit_other": [n for n in quantized if n.rsplit(".", 1)[-1] not in LORA_TARGETS][:4],
                  "fused_lora_layers": fused,
                  "params_trainable": sum(p.numel() for _, p in trainable),
                  "trainable_dtypes": sorted({str(p.dtype).replace("torch.", "") for _, p in trainable}),
                  "embedding_device": str(emb.device), "max_seq_length": getattr(model, "max_seq_length", None)}
    if gpt_oss:
        model_info.update(gpt_oss_paths(model, layers, torch))
    ctx["model"] = model_info
    _log(f"LoRA ready in {timings['peft_s']}s: {model_info['params_trainable'] / 1e6:.1f}M trainable "
         f"{model_info['trainable_dtypes']}, fused layers {fused}, embedding on {emb.device}")

    ctx["stage"] = "batches"
    feeds = []
    for p in layouts:  # what TRL's collator gives an Unsloth GPT-OSS user: right padding, attention_mask, labels
        feeds.append({key: torch.tensor(p[key], dtype=torch.long, device=device)
                      for key in ("input_ids", "attention_mask", "labels")} | {"use_cache": False})
    for b in raw if gpt_oss and not padded else []:  # (rows, row_tokens): no packed_seq_lengths for GPT-OSS
        feeds.append({key: torch.tensor(b[key], dtype=torch.long, device=device)
                      for key in ("input_ids", "labels", "position_ids")} | {"use_cache": False})
    for b in [] if gpt_oss else raw:  # rows laid end to end: Unsloth's packed path takes one (1, T) row
        flat = lambda key: torch.tensor([x for row in b[key] for x in row], dtype=torch.long)[None]  # noqa: E731
        lengths = torch.tensor([n for row in b["seq_lengths"] for n in row], dtype=torch.int32)
        feeds.append({"input_ids": flat("input_ids").to(device), "labels": flat("labels").to(device),
                      "position_ids": flat("position_ids").to(device),
                      "packed_seq_lengths": lengths.to(device) if lengths_device == "cuda" else lengths,
                      "use_cache": False})
    optimizer = torch.optim.AdamW([p for _, p in trainable], lr=LR)
    model.train()

    def forward(feed):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**feed).loss
        if loss is None:
            raise RuntimeError("the model returned no loss")
        return loss

    gcmod = None
    if cuda:  # its module globals say what the offloaded checkpointing did (loaded by unsloth's GPU init anyway)
        import unsloth_zoo.gradient_checkpointing as gcmod
    samples = {k: [] for k in ("forward", "backward", "optimizer", "step")}
    losses, peaks, peaks_measured, first_steps, db_measured = [], [], [], [], []
    resident, forward_peaks = [], []  # allocated before each measured step; the allocator's peak after its forward
    total = warmup_run + steps
    for s in range(total):
        measured = s >= warmup_run
        ctx["stage"] = f"step {s + 1}/{total} ({'measured' if measured else 'warmup'})"
        feed = feeds[s % len(feeds)]
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = int(torch.cuda.memory_allocated())
            ev = {k: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for k in samples}
            mark = lambda k, i: ev[k][i].record()  # noqa: E731
        else:
            ev = {k: [0.0, 0.0] for k in samples}

            def mark(k, i):
                ev[k][i] = time.perf_counter()
        t = time.time()
        mark("step", 0)
        mark("forward", 0)
        loss = forward(feed)
        mark("forward", 1)
        fwd_peak = int(torch.cuda.max_memory_allocated()) if cuda else None  # host-side counter: no sync
        mark("backward", 0)
        loss.backward()
        mark("backward", 1)
        mark("optimizer", 0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mark("optimizer", 1)
        mark("step", 1)
        if cuda:
            torch.cuda.synchronize()
            times = {k: a.elapsed_time(b) for k, (a, b) in ev.items()}
            peak = int(torch.cuda.max_memory_allocated())
        else:
            times = {k: (b - a) * 1e3 for k, (a, b) in ev.items()}
            peak = None
        value = float(loss.detach())
        if not math.isfinite(value):
            raise CheckFailed(f"loss is {value} at step {s + 1}")
        peaks.append(peak)
        if measured:
            for k, ms in times.items():
                samples[k].append(ms)
            losses.append(value)
            peaks_measured.append(peak)
            if cuda:
                resident.append(before)
                forward_peaks.append(fwd_peak)
            if gcmod is not None:  # set at the start of this step's forward (from the second forward on)
                db_measured.append(bool(getattr(gcmod, "USE_DOUBLE_BUFFER", False)))
        else:
            first_steps.append(round(time.time() - t, 2))
        ctx["completed_steps"] = s + 1
        _log(f"step {s + 1}/{total} {'measured' if measured else 'warmup  '} fwd {times['forward']:8.1f} ms  "
             f"bwd {times['backward']:8.1f} ms  opt {times['optimizer']:6.1f} ms  step {times['step']:8.1f} ms  "
             f"loss {value:.4f}" + (f"  peak {peak / 2**30:.2f} GiB" if peak else ""))
    timings["warmup_wall_s"] = first_steps

    ctx["stage"] = "host-sync count step (untimed)"
    # Loaded by unsloth's GPU init (importing it on the CPU backend is a circular import): look it up, don't import.
    adispatch = sys.modules.get("unsloth.utils.attention_dispatch")
    if adispatch is None and cuda:
        raise CheckFailed("unsloth.utils.attention_dispatch is not loaded: this is not Unsloth's GPU path")
    attention_calls: dict = {}
    undo = _count_attention_calls(adispatch, attention_calls) if adispatch is not None else (lambda: None)
    if gpt_oss:
        undo_sink = _count_calls(sys.modules.get("unsloth_zoo.flex_attention.attention_sink"), SINK_ENTRY_POINTS,
                                 attention_calls)
        undo_qwen, undo = undo, lambda: (undo_qwen(), undo_sink())

    def forward_backward():
        forward(feeds[0]).backward()

    try:
        if cuda:
            syncs, sites = _sync_warnings(forward_backward, torch)
        else:
            forward_backward()
            syncs, sites = None, {}
    finally:
        undo()
    no_grad = [n for n, p in trainable if p.grad is None]
    zero_grad = [n for n, p in trainable if p.grad is not None and not bool(p.grad.any())]
    if cuda:
        syncs_opt, _ = _sync_warnings(optimizer.step, torch)
    else:
        optimizer.step()
        syncs_opt = None
    optimizer.zero_grad(set_to_none=True)
    profiled = None
    if cuda and os.environ.get("UNSLOTH_PEER_PROFILE", "1") != "0":
        ctx["stage"] = "profiled forward+backward (untimed)"
        profiled = profile_gpu(forward_backward)
        optimizer.zero_grad(set_to_none=True)
    probe = None
    if padded:  # last: whatever it leaves behind touches nothing measured
        ctx["stage"] = "padded-layout probe (untimed, no grad)"
        try:
            base = model
            for _ in range(3):
                base = base.get_base_model() if hasattr(base, "get_base_model") else base
            probe = padded_probe(forward, feeds[0], layouts[0]["lengths"],
                                 {"layer0_attention": layers[0].self_attn, "final_norm": base.model.norm},
                                 meta["vocab_size"], torch)
        except Exception as e:  # noqa: BLE001 - an unanswered probe is recorded, never claimed either way
            probe = {"rows_independent": None, "right_padding_exact": None,
                     "error": _one_line(f"{type(e).__name__}: {e}", 300)}
        config["rows_independent_measured"] = probe.get("rows_independent")
        config["right_padding_exact_measured"] = probe.get("right_padding_exact")
        if False in (probe.get("rows_independent"), probe.get("right_padding_exact")):
            config["segments_isolated"] = False
            config["segments_isolated_source"] = "measured: variants[0].packing.probe (batch 0) contradicts the layout"
        elif probe.get("rows_independent") and probe.get("right_padding_exact"):
            config["segments_isolated_source"] = ("construction, confirmed by variants[0].packing.probe (batch 0)")
        _log(f"padded probe: rows_independent={probe.get('rows_independent')}, "
             f"right_padding_exact={probe.get('right_padding_exact')}")
    elif gpt_oss:
        ctx["stage"] = "segment-isolation probe (untimed, no grad)"
        try:
            probe = isolation_probe(forward, feeds[0], raw[0]["seq_lengths"], raw[0]["pad_lengths"], layers,
                                    meta.get("layer_types"), meta.get("sliding_window"), meta["vocab_size"], torch)
        except Exception as e:  # noqa: BLE001 - an unanswered probe is recorded, never claimed either way
            probe = {"segments_isolated": None, "causal": None, "error": _one_line(f"{type(e).__name__}: {e}", 300)}
        if probe.get("segments_isolated") is not None:
            config["segments_isolated"] = probe["segments_isolated"]
            config["segments_isolated_source"] = "measured: variants[0].packing.probe (batch 0)"
        else:
            config["segments_isolated_source"] = ("reading of Unsloth's source; the probe did not answer (see "
                                                  "variants[0].packing.probe)")
        config["causal_measured"] = probe.get("causal")
        _log(f"isolation probe: segments_isolated={probe.get('segments_isolated')}, causal={probe.get('causal')}")

    variant = {"name": _variant_name(double_buffer, checkpointing), "toggles": ctx["toggles"],
               "note": _note(family, double_buffer, lengths_device, layout)}
    for k in ("forward", "backward", "optimizer", "step"):
        variant[f"{k}_ms"] = percentiles(samples[k])
    step_s = variant["step_ms"]["median"] / 1e3
    variant.update({
        "peak_mem_bytes": max(p for p in peaks if p is not None) if cuda else None,
        "peak_mem_bytes_measured": max(p for p in peaks_measured if p is not None) if cuda else None,
        "resident_mem_bytes": max(resident) if resident else None,
        "forward_peak_mem_bytes": max(forward_peaks) if forward_peaks else None,
        "loss_median": percentiles(losses)["median"], "losses": [round(x, 5) for x in losses],
        "tokens_per_s": round(config["real_tokens_per_step"] / step_s, 1) if step_s > 0 else None,
        "tokens_per_s_basis": "real tokens per step (mean over the exported batches) / median step",
        "padded_tokens_per_s": round(config["padded_tokens_per_step"] / step_s, 1) if step_s > 0 else None,
        "host_syncs_per_step": syncs, "host_syncs_optimizer": syncs_opt,
        "host_syncs_method": "torch.cuda.set_sync_debug_mode('warn'): warnings 'called a synchronizing CUDA operation' over one "
                             "untimed forward+backward (batch 0); optimizer step apart",
        "host_sync_sites": sites, "attention_calls": attention_calls,
        "samples_ms": {k: [round(x, 3) for x in v] for k, v in samples.items()},
    })
    if profiled is not None:
        variant["profile"] = profiled

    ctx["stage"] = "checks"
    problems = []
    if no_grad or zero_grad:
        problems.append(f"{len(no_grad)} trainable tensors got no gradient and {len(zero_grad)} a zero one "
                        f"(e.g. {(no_grad + zero_grad)[:2]})")
    packing = {"torch_varlen_attn": getattr(adispatch, "_TORCH_VARLEN_ATTN", None) is not None,
               "sdpa_packed_segments_enabled": bool(getattr(adispatch, "_SDPA_PACKED_SEGMENTS", False)),
               "has_flash_attention": bool(getattr(adispatch, "HAS_FLASH_ATTENTION", False)),
               "has_xformers": bool(getattr(adispatch, "HAS_XFORMERS", False))}
    if cuda:
        packing.update(sdpa_flash_enabled=torch.backends.cuda.flash_sdp_enabled(),
                       sdpa_cudnn_enabled=torch.backends.cuda.cudnn_sdp_enabled(),
                       sdpa_mem_efficient_enabled=torch.backends.cuda.mem_efficient_sdp_enabled())
        if gcmod is None:
            raise CheckFailed("unsloth_zoo.gradient_checkpointing is not loaded: no Unsloth checkpointing ran")

        packed_calls = sum(attention_calls.get(k, 0) for k in ("_sdpa_packed_segments", "_torch_varlen_packed",
                                                                "build_sdpa_packed_attention_mask",
                                                                "build_xformers_block_causal_mask"))
        if packed_calls == 0 and not gpt_oss:
            problems.append("Unsloth's packed attention was never called: packed_seq_lengths did not reach it")
        if gpt_oss:
            model_info.update(gpt_oss_paths(model, layers, torch))  # the MoE backend is chosen at the first forward
            weights = {n: d for n, d in model_info.get("experts_dtypes", {}).items() if not n.endswith("_bias")}
            if any(d != "bfloat16" for d in weights.values()):
                problems.append(f"expert weights are {weights}, not bf16")
        if gpt_oss and not model_info.get("flex_sink_attention_on_model"):
            problems.append("unsloth_zoo's GPT-OSS attention (flex_attention_with_sink) is not the forward of the "
                            f"model's attention class ({model_info.get('attention_forward')}): not the path claimed")
        offload = {"checkpoint_function": torch.utils.checkpoint.CheckpointFunction.__name__,
                   "offload_observed": getattr(gcmod, "USE_UNSLOTH_GC", True) is False,
                   "double_buffer_effective": bool(db_measured) and all(db_measured),
                   "double_buffer_per_measured_step": db_measured,
                   "buffer_b_allocated": getattr(gcmod, "GPU_BUFFERS_B", None) is not None,
                   "gc_prefetch": bool(getattr(gcmod, "GC_PREFETCH", False)),
                   "last_gc_index": getattr(gcmod, "LAST_GC_INDEX", None)}
        variant.update(offload)
        if offload["offload_observed"] and checkpointing == "off":
            problems.append("Unsloth offloaded a layer input with use_gradient_checkpointing=False")
        if not offload["offload_observed"] and checkpointing == "unsloth":
            problems.append("Unsloth's offloaded checkpointing never offloaded a layer input")
        if checkpointing == "unsloth" and any(state != (double_buffer == "on") for state in db_measured):
            problems.append(f"double buffer asked {double_buffer} but Unsloth's was {db_measured} over the measured "
                            "steps (it turns on from the second forward if > 512 MiB are free; off on OOM)")
    if padded:
        packing = {"layout": "padded", "packed_seq_lengths": "not passed (one sequence per row)",
                   "attention_mask": "passed (1 real, 0 pad); GptOssModel.forward sets it to None in training once "
                                     "the flex-sink attention is installed, and that attention builds its own mask",
                   "position_ids": "not passed: GptOssModel.forward uses arange(width) (cache_position)",
                   "attention": "flex_attention_with_sink (unsloth_zoo), causal / sliding-window BlockMask over "
                                "each padded row", "probe": probe, **packing}
    elif gpt_oss:
        packing = {"layout": "packed", "packed_seq_lengths": "not passed (its GPT-OSS forward has no packed path)",
                   "attention": "flex_attention_with_sink (unsloth_zoo), causal / sliding-window BlockMask over "
                                "each whole row", "probe": probe, **packing}
    variant["packing"] = packing
    variant["model"] = model_info
    warnings_ = []  # deviations that do not invalidate the measurement, but a reader must see
    if padded:
        for key, what in (("rows_independent", "rows are NOT independent: a row's outputs moved when another row's "
                                               "tokens changed"),
                          ("right_padding_exact", "right padding is NOT exact: real positions moved when the pads "
                                                  "after them changed")):
            if probe and probe.get(key) is False:
                warnings_.append(f"{what} (measured by the probe): the padded step is not each sequence alone")
            elif not probe or probe.get(key) is None:
                warnings_.append(f"{key} could not be measured (probe inconclusive or failed): see packing.probe")
        if cuda and model_info.get("zoo_model_forward") is False:
            warnings_.append(f"GptOssModel.forward is {model_info.get('model_forward')}, not unsloth_zoo's: the "
                             "reading that training drops attention_mask does not apply (its flex-sink attention "
                             "ignores any mask in training either way)")
    if gpt_oss and not padded:
        if probe and probe.get("segments_isolated") is False:
            warnings_.append("packed segments are NOT isolated: later segments of a row attend to earlier ones "
                             "(measured by the probe). Unsloth's attention computes causal attention over each "
                             "4096-token row, not per segment: not the same computation as our packed path, and "
                             "its loss is not comparable")
        elif not probe or probe.get("segments_isolated") is None:
            warnings_.append("segment isolation could not be measured (probe inconclusive or failed): see "
                             "packing.probe")
        if probe and probe.get("causal") is False:
            warnings_.append("the probe saw earlier positions change when a later segment changed: not causal")
    if gpt_oss:
        if cuda and not attention_calls.get("flex_attention"):
            warnings_.append("no call of attention_sink.flex_attention was counted (its caller may have been "
                             "traced by torch.compile): the attention path rests on the class check alone")
        if cuda and model_info.get("moe_backend") not in ("grouped_mm", None):
            warnings_.append(f"Unsloth's MoE backend is {model_info.get('moe_backend')}, not torch._grouped_mm")
    elif cuda and min(fused.values()) < meta["num_layers"]:
        warnings_.append(f"Unsloth's fused LoRA kernels are installed on only {fused} of {meta['num_layers']} layers")
    if cuda and emb.device.type != "cuda":
        warnings_.append(f"Unsloth offloaded the input embedding to {emb.device} (offload_embedding='auto')")
    if attention_calls.get("build_sdpa_packed_attention_mask"):
        warnings_.append("Unsloth fell back to SDPA over a dense (T, T) block-diagonal mask in some layers")
    if attention_calls.get("_torch_varlen_packed"):
        warnings_.append("attention ran torch's varlen kernel, not per-segment SDPA (a torch with "
                         "varlen_attn(enable_gqa=...)): the docstring's per-segment description does not apply")
    variant["warnings"] = warnings_
    ctx["env"] = _environment(torch)
    env = ctx["env"]
    if problems:
        msg = "; ".join(problems)
        unverified = {k: variant.pop(k) for k in list(variant) if k.endswith("_ms") or k in (
            "peak_mem_bytes", "peak_mem_bytes_measured", "loss_median", "tokens_per_s", "padded_tokens_per_s",
            "host_syncs_per_step")}
        variant.update(error=f"check failed: {msg}", unverified_measurements=unverified)
    config["timings_s"] = timings
    config["env_requested"] = ctx["env_requested"]
    result = {"scenario": SCENARIO, "env": env, "config": config, "variants": [variant],
              "notes": ("Unsloth's own 16-bit LoRA path for GPT-OSS (bf16 weights, attention LoRA) on the combined "
                        "benchmark's architecture and the sequences of its batches, padded as an Unsloth user trains "
                        "GPT-OSS (one right-padded row per sequence; padding-free packing is blocklisted for "
                        "gpt_oss); tokens_per_s counts real tokens" if padded else
                        "Unsloth's own 16-bit LoRA path for GPT-OSS (bf16 weights, attention LoRA) on the combined "
                        "benchmark's architecture and batches; packed segments are not kept apart by its attention "
                        "(config.segments_isolated, measured)" if gpt_oss else
                        "Unsloth's own QLoRA path on the combined benchmark's architecture and batches") +
                       " (benchmarks/unsloth_peer.py); one variant per process (double buffer on/off)."}
    if problems:
        result["error"] = variant["error"]
    _write_json(out, result)
    return result


def error_result(ctx: dict, message: str, double_buffer: str, lengths_device: str, tb: str | None) -> dict:
    env = ctx.get("env")
    if not env:
        torch = sys.modules.get("torch")
        try:
            if torch is None:
                import torch  # torch before unsloth is harmless; the env block wants the device
            env = _environment(torch)
        except Exception:  # noqa: BLE001 - the error result must be written whatever else fails
            env = _environment(None)
    variant = {"name": _variant_name(double_buffer), "error": message, "stage": ctx.get("stage"),
               "toggles": ctx.get("toggles") or variant_toggles("qwen3", double_buffer, lengths_device),
               "note": "failed: " + message, "completed_steps": ctx.get("completed_steps", 0)}
    if ctx.get("model"):
        variant["model"] = ctx["model"]
    config = dict(ctx.get("config") or {"double_buffer": double_buffer})
    if ctx.get("timings_s"):
        config["timings_s"] = ctx["timings_s"]
    if ctx.get("env_requested"):
        config["env_requested"] = ctx["env_requested"]
    doc = {"scenario": SCENARIO, "env": env, "config": config, "variants": [variant], "error": message,
           "stage": ctx.get("stage"), "notes": "the Unsloth peer failed; see error and stage"}
    if tb:
        doc["traceback"] = tb.splitlines()[-40:]
    return doc


_SIGNALLED = [False]


def _on_signal(signum, frame):
    if _SIGNALLED[0]:  # timeout and the stage's timeout may both signal: one interruption is enough
        return
    _SIGNALLED[0] = True
    limit = os.environ.get("UNSLOTH_PEER_TIMEOUT_S")
    raise Interrupted(f"{signal.Signals(signum).name} received" + (f" (this run's timeout is {limit} s, or the "
                                                                   "stage's ran out)" if limit else ""))


def _cli_run(args) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    ctx: dict = {}
    _log(f"run: {args.dir} -> {args.out} (double buffer {args.double_buffer}, warmup {args.warmup}, layout "
         f"{args.layout or 'the family default'})")
    try:
        result = run(args.dir, args.out, double_buffer=args.double_buffer, warmup=args.warmup, steps=args.steps,
                     lengths_device=args.seq_lengths_device, allow_cpu=args.allow_cpu, ctx=ctx, layout=args.layout,
                     pad_multiple=args.pad_to_multiple_of, checkpointing=args.checkpointing)
    except BaseException as e:  # noqa: BLE001 - every failure becomes an error result
        _SIGNALLED[0] = True  # from here on a late signal must not interrupt writing the error result
        interrupted = isinstance(e, (KeyboardInterrupt, Interrupted))
        kind = "interrupted" if interrupted else type(e).__name__
        message = _one_line(f"{ctx.get('stage', '?')}: {kind}: {e}")
        tb = None
        if not (isinstance(e, ModuleNotFoundError) and ctx.get("stage") == "import unsloth"):
            tb = traceback.format_exc()
            print(tb, flush=True)
        try:
            _write_json(args.out, error_result(ctx, message, args.double_buffer, args.seq_lengths_device, tb))
        except Exception as w:  # noqa: BLE001
            message += f" (and the error JSON could not be written: {w})"
        print(f"unsloth_peer run: error: {message}", file=sys.stderr, flush=True)
        return 130 if interrupted else 1
    v = result["variants"][0]
    if "error" in v:
        print(f"unsloth_peer run: error: {v['error']}", file=sys.stderr, flush=True)
        return 2
    _log(f"{summary_line(args.out)} -> {args.out}")
    return 0


def _cli_export(args) -> int:
    try:
        export(args.out, model=args.model, num_layers=args.num_layers, tokens=args.tokens, steps=args.steps,
               mix=args.mix, lora_rank=args.lora_rank, device=args.device, row_tokens=args.row_tokens)
    except BaseException as e:  # noqa: BLE001
        message = _one_line(f"{type(e).__name__}: {e}")
        print(traceback.format_exc(), flush=True)
        try:
            _write_json(os.path.join(args.out, "export_error.json"), {"error": message, "date": _now()})
        except Exception:  # noqa: BLE001
            pass
        print(f"unsloth_peer export: error: {message}", file=sys.stderr, flush=True)
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    return 0


def summary_line(path: str) -> str:
    """One line for a result JSON (the stage's summary): step median [p20-p80], phases, syncs, peak; or its error."""
    try:
        with open(path) as f:
            doc = json.load(f)
        v = doc["variants"][0]
    except Exception as e:  # noqa: BLE001
        return f"{os.path.basename(path)}: ERROR: no readable result ({_one_line(e, 200)})"
    if "error" in v:
        return f"{v.get('name', '?')}: ERROR: {_one_line(v['error'], 400)}"
    st = v["step_ms"]
    peak = v.get("peak_mem_bytes") or 0
    return (f"{v['name']}: step {st['median']:.1f} ms [{st['p20']:.1f}-{st['p80']:.1f}] n={st['n']}, fwd "
            f"{v['forward_ms']['median']:.1f}, bwd {v['backward_ms']['median']:.1f}, opt "
            f"{v['optimizer_ms']['median']:.1f} ms, {v.get('tokens_per_s')} tok/s, syncs {v.get('host_syncs_per_step')}"
            f", peak {peak / 2**30:.2f} GiB, loss {v.get('loss_median')}, double buffer effective "
            f"{v.get('double_buffer_effective')}")


def _layers_arg(text: str):
    if text in ("auto", "all"):
        return None if text == "all" else "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, 'all' or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"num-layers must be >= 1, got {value}")
    return value


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="our environment: weights, tokenizer, batches and meta.json into --out")
    ex.add_argument("--out", required=True)
    ex.add_argument("--model", default="qwen3-14b")
    ex.add_argument("--num-layers", type=_layers_arg, default="auto",
                    help="decoder layers: an int, 'all', or 'auto' (default: 8 for Qwen3, all for GPT-OSS)")
    ex.add_argument("--tokens", type=int, default=8192)
    ex.add_argument("--row-tokens", type=int, default=None,
                    help=f"tokens per packed row (default: --tokens for Qwen3, {MOE_ROW_TOKENS} for GPT-OSS)")
    ex.add_argument("--steps", type=int, default=6, help="packed batches to export")
    ex.add_argument("--mix", default="realistic")
    ex.add_argument("--lora-rank", type=int, default=16)
    ex.add_argument("--device", default=None, help="where the random weights are built (default cuda if any)")
    rn = sub.add_parser("run", help="Unsloth's environment: measure the export in --dir, write --out")
    rn.add_argument("--dir", required=True)
    rn.add_argument("--out", required=True)
    rn.add_argument("--double-buffer", choices=("on", "off"), default="on")
    rn.add_argument("--checkpointing", choices=tuple(CHECKPOINTING), default="unsloth",
                    help="unsloth: use_gradient_checkpointing='unsloth' (offloaded); off: False (every activation kept)")
    rn.add_argument("--warmup", type=int, default=2)
    rn.add_argument("--steps", type=int, default=None, help="measured steps (default: one per exported batch)")
    rn.add_argument("--seq-lengths-device", choices=("cpu", "cuda"), default="cpu",
                    help="where packed_seq_lengths lives: the collator's host tensor, or moved as HF Trainer does")
    rn.add_argument("--layout", choices=LAYOUTS, default=None,
                    help="packed: the export's rows (Qwen3 with packed_seq_lengths; GPT-OSS segments then attend "
                         "across a row); padded (GPT-OSS only): one right-padded row per sequence, as Unsloth trains "
                         "GPT-OSS. Default: padded for GPT-OSS, packed for Qwen3")
    rn.add_argument("--pad-to-multiple-of", type=int, default=None,
                    help=f"padded layout: round the padded width up to this (default {FLEX_PAD_MULTIPLE}, Unsloth's "
                         "SFTConfig value for GPT-OSS; 1: the step's longest sequence)")
    rn.add_argument("--allow-cpu", action="store_true", help="development only: Unsloth's CPU backend")
    er = sub.add_parser("error-json", help="write an error result (for the stage script when a run left none)")
    er.add_argument("--out", required=True)
    er.add_argument("--message", required=True)
    er.add_argument("--double-buffer", choices=("on", "off"), default="on")
    er.add_argument("--stage", default="stage script")
    sm = sub.add_parser("summary", help="one line per result JSON")
    sm.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)
    if args.cmd == "export":
        return _cli_export(args)
    if args.cmd == "run":
        return _cli_run(args)
    if args.cmd == "error-json":
        _write_json(args.out, error_result({"stage": args.stage}, _one_line(args.message), args.double_buffer,
                                           "cpu", None))
        return 0
    lines = [summary_line(path) for path in args.paths]
    print("\n".join(lines), flush=True)
    return 1 if any(": ERROR: " in line for line in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
