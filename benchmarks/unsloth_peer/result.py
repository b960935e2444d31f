"""The result JSON in the harness's format (``scenario``/``env``/``config``/``variants``), and what is known when a
run fails: the ``config`` block of an export, a variant's name, toggles and note, the ``env`` block, the error
result, and the one summary line the stage script prints per result."""

from __future__ import annotations

import json
import os
import platform
import sys

from .common import (FLEX_PAD_MULTIPLE, LORA_ALPHA, LORA_DROPOUT, LR, SCENARIO, dist_version, now, one_line)
from .layouts import check_layout, default_layout, layout_stats
from .stats import length_stats


def environment(torch=None) -> dict:
    env = {"device": None, "gpu_name": None, "cpu": platform.processor() or platform.machine(),
           "cpu_count": os.cpu_count(), "python": platform.python_version()}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "trl", "unsloth", "unsloth_zoo", "triton",
                 "accelerate", "datasets", "xformers", "flash_attn"):
        env[name] = dist_version(name)
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
    env["date"] = now()
    return env


def variant_name(double_buffer: str, checkpointing: str = "unsloth") -> str:
    if checkpointing == "off":
        return "unsloth (checkpointing off)"
    return f"unsloth (double buffer {double_buffer})"


def note(family: str, double_buffer: str, lengths_device: str, layout: str = "packed") -> str:
    if family == "gpt_oss" and layout == "padded":
        return (f"Unsloth {dist_version('unsloth')} FastLanguageModel -> FastModel (GPT-OSS): bf16 weights, 16-bit "
                "LoRA on q/k/v/o, experts frozen (torch._grouped_mm when available), unsloth_zoo "
                "flex_attention_with_sink (causal / sliding-window mask over each padded row), padded layout: one "
                "sequence per row, right padding, attention_mask passed (dropped by its training forward), bf16 "
                f"autocast; offloaded gradient checkpointing, double buffer {double_buffer}; tokens_per_s on real "
                "tokens; host syncs from torch.cuda sync-debug warnings")
    if family == "gpt_oss":
        return (f"Unsloth {dist_version('unsloth')} FastLanguageModel -> FastModel (GPT-OSS): bf16 weights, 16-bit "
                "LoRA on q/k/v/o, experts frozen (torch._grouped_mm when available), unsloth_zoo "
                "flex_attention_with_sink (causal / sliding-window mask over each 4096-token row: packed segments NOT "
                "kept apart), restarting position_ids for RoPE, bf16 autocast; offloaded gradient checkpointing, "
                f"double buffer {double_buffer}; host syncs from torch.cuda sync-debug warnings")
    return (f"Unsloth {dist_version('unsloth')} FastLanguageModel (FastQwen3Model): NF4 QLoRA quantized on load, "
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

GPT_OSS_PADDED_REASON = (
    "padded layout: each sequence is its own row, right-padded, so no two sequences share a row. Unsloth 2026.10.9's "
    "training attention (unsloth_zoo flex_attention_with_sink) drops attention_mask but is causal (full layers) or "
    "causal sliding-window 128 (q - kv < 128) over the row: a real token attends only to earlier tokens of its own "
    "sequence and never to a pad after it, the sinks rescale each query by sigmoid(lse - sink) over those same keys, "
    "RoPE gets the model's default position_ids 0..n-1 on the real tokens, pads carry labels -100; so the real "
    "tokens' outputs and the loss are those of each sequence alone. Checked by variants[0].packing.probe.")


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



def error_result(ctx: dict, message: str, double_buffer: str, lengths_device: str, tb: str | None,
                 checkpointing: str = "unsloth") -> dict:
    env = ctx.get("env")
    if not env:
        torch = sys.modules.get("torch")
        try:
            if torch is None:
                import torch  # torch before unsloth is harmless; the env block wants the device
            env = environment(torch)
        except Exception:  # noqa: BLE001 - the error result must be written whatever else fails
            env = environment(None)
    variant = {"name": variant_name(double_buffer, checkpointing), "error": message, "stage": ctx.get("stage"),
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


def summary_line(path: str) -> str:
    """One line for a result JSON (the stage's summary): step median [p20-p80], phases, syncs, peak; or its error."""
    try:
        with open(path) as f:
            doc = json.load(f)
        v = doc["variants"][0]
    except Exception as e:  # noqa: BLE001
        return f"{os.path.basename(path)}: ERROR: no readable result ({one_line(e, 200)})"
    if "error" in v:
        return f"{v.get('name', '?')}: ERROR: {one_line(v['error'], 400)}"
    st = v["step_ms"]
    peak = v.get("peak_mem_bytes") or 0
    return (f"{v['name']}: step {st['median']:.1f} ms [{st['p20']:.1f}-{st['p80']:.1f}] n={st['n']}, fwd "
            f"{v['forward_ms']['median']:.1f}, bwd {v['backward_ms']['median']:.1f}, opt "
            f"{v['optimizer_ms']['median']:.1f} ms, {v.get('tokens_per_s')} tok/s, syncs {v.get('host_syncs_per_step')}"
            f", peak {peak / 2**30:.2f} GiB, loss {v.get('loss_median')}, double buffer effective "
            f"{v.get('double_buffer_effective')}")


def result_notes(family: str, layout: str) -> str:
    """The result's ``notes``: which Unsloth path ran on what."""
    if family == "gpt_oss" and layout == "padded":
        what = ("Unsloth's own 16-bit LoRA path for GPT-OSS (bf16 weights, attention LoRA) on the combined "
                "benchmark's architecture and the sequences of its batches, padded as an Unsloth user trains "
                "GPT-OSS (one right-padded row per sequence; padding-free packing is blocklisted for "
                "gpt_oss); tokens_per_s counts real tokens")
    elif family == "gpt_oss":
        what = ("Unsloth's own 16-bit LoRA path for GPT-OSS (bf16 weights, attention LoRA) on the combined "
                "benchmark's architecture and batches; packed segments are not kept apart by its attention "
                "(config.segments_isolated, measured)")
    else:
        what = "Unsloth's own QLoRA path on the combined benchmark's architecture and batches"
    return what + " (benchmarks/unsloth_peer); one variant per process (double buffer on/off)."
