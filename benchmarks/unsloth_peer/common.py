"""Constants and small helpers of both environments (the standard library only: importable before unsloth)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import time
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
CHECKPOINTING = {"unsloth": "unsloth", "off": False}   # --checkpointing -> use_gradient_checkpointing


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def log(msg: str) -> None:
    print(f"[unsloth_peer {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def one_line(text, limit: int = 600) -> str:
    return " ".join(str(text).split())[:limit]


def write_json(path: str, doc: dict) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, default=str, allow_nan=True)
    os.replace(tmp, path)
    return path


def dist_version(name: str) -> str | None:
    module = sys.modules.get(name)
    if module is not None and getattr(module, "__version__", None):
        return str(module.__version__)
    try:
        return _metadata_version(name)
    except Exception:  # noqa: BLE001 - not installed
        return None
