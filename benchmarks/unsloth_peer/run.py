"""The measured run, in Unsloth's environment, stage by stage.

``run --dir DIR --out RESULT.json`` (Unsloth's environment; of fastsft_lab only the torch-free statistics,
``fastsft_lab._util``, before unsloth is imported) measures one training step per batch of Unsloth 2026.10's own
QLoRA path (GPT-OSS: its 16-bit LoRA path) and writes it in the harness's result format
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

The stages, in order (each names itself in ``ctx["stage"]``, which an error result reports): ``plan_run`` (read
the export, check the arguments, the ``config`` block; nothing imported), ``set_environment``, ``import_unsloth``,
``load_model``, ``add_lora``, ``prepare_training``, ``measure_steps``, ``observe`` (host syncs, attention calls,
gradients, profile), ``probe``, then ``measured_variant``, ``check_path`` (the ``problems``: any one turns the
variant into an error) and ``path_warnings``, and ``assemble``.
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from . import probes
from .common import (CHECKPOINTING, FAMILIES, FLEX_PAD_MULTIPLE, LAYOUTS, LORA_TARGETS, LR, PAD_TOKEN_ID, SCENARIO,
                     dist_version, log, one_line, write_json)
from .export import read_export
from .layouts import check_layout, feeds, labelled_pairs_packed, labelled_pairs_padded, padded_layout, warmup_covering
from .result import environment, note, result_notes, run_config, variant_name, variant_toggles
from .stats import percentiles

PHASES = ("forward", "backward", "optimizer", "step")


class Interrupted(BaseException):
    """SIGINT or SIGTERM (this run's timeout, or the stage's) while running."""


class CheckFailed(RuntimeError):
    """The measured path is not the one the result would claim."""


@dataclass
class Plan:
    """What a run measures, decided from the export and the arguments before anything is imported."""

    folder: str
    meta: dict
    raw: list[dict]
    family: str
    layout: str
    double_buffer: str
    lengths_device: str
    checkpointing: str
    steps: int
    warmup_run: int
    pad_multiple: int
    config: dict
    layouts: list[dict]  # the padded layout of each batch; [] for the packed layout

    @property
    def gpt_oss(self) -> bool:
        return self.family == "gpt_oss"

    @property
    def padded(self) -> bool:
        return self.layout == "padded"

    @property
    def row_tokens(self) -> int:
        return len(self.raw[0]["input_ids"][0])

    @property
    def tokens(self) -> int:
        return len(self.raw[0]["input_ids"]) * self.row_tokens


@dataclass
class Session:
    """Unsloth's live objects, filled in stage by stage."""

    torch: Any
    fast: Any  # unsloth.FastLanguageModel
    cuda: bool
    device: Any
    timings: dict
    model: Any = None
    quantized: list = field(default_factory=list)
    trainable: list = field(default_factory=list)  # (name, parameter)
    lora_modules: list = field(default_factory=list)
    layers: Any = ()
    fused: dict = field(default_factory=dict)
    emb: Any = None
    model_info: dict = field(default_factory=dict)
    feeds: list = field(default_factory=list)
    optimizer: Any = None
    gcmod: Any = None  # unsloth_zoo.gradient_checkpointing: its globals say what the offloading did

    def forward(self, feed: dict):
        torch = self.torch
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.model(**feed).loss
        if loss is None:
            raise RuntimeError("the model returned no loss")
        return loss

    def forward_backward(self) -> None:
        self.forward(self.feeds[0]).backward()


@dataclass
class Steps:
    """The timed steps: per-phase samples, losses and memory of the measured steps, and what warmup took."""

    samples: dict = field(default_factory=lambda: {k: [] for k in PHASES})
    losses: list = field(default_factory=list)
    peaks: list = field(default_factory=list)  # every step's
    peaks_measured: list = field(default_factory=list)
    first_steps: list = field(default_factory=list)  # wall seconds of the warmup steps
    db_measured: list = field(default_factory=list)  # Unsloth's double buffer as each measured step read it
    resident: list = field(default_factory=list)  # allocated before each measured step
    forward_peaks: list = field(default_factory=list)  # the allocator's peak after each measured forward


@dataclass
class Observed:
    """What the untimed steps after the measurement saw."""

    adispatch: Any = None  # unsloth.utils.attention_dispatch
    attention_calls: dict = field(default_factory=dict)
    syncs: int | None = None
    sites: dict = field(default_factory=dict)
    syncs_opt: int | None = None
    no_grad: list = field(default_factory=list)
    zero_grad: list = field(default_factory=list)
    profiled: dict | None = None
    probe: dict | None = None


# --- before unsloth --------------------------------------------------------------------------------------------
def plan_run(folder: str, *, double_buffer: str, warmup: int, steps: int | None, lengths_device: str,
             layout: str | None, pad_multiple: int | None, checkpointing: str, ctx: dict) -> Plan:
    """Read and check the export and the arguments, build the ``config`` block; imports nothing."""
    ctx["stage"] = "read export"
    meta, raw = read_export(folder)
    steps = len(raw) if steps is None else steps
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    family = meta.get("family", "qwen3")
    if family not in FAMILIES:
        raise ValueError(f"{folder} holds a {family} export: the peer runs {', '.join(FAMILIES)}")
    row_tokens = len(raw[0]["input_ids"][0])
    if row_tokens != meta["row_tokens"]:
        raise ValueError(f"batches.json rows hold {row_tokens} tokens, meta.json says {meta['row_tokens']}")
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {', '.join(CHECKPOINTING)}, got {checkpointing!r}")
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
    return Plan(folder=folder, meta=meta, raw=raw, family=family, layout=layout, double_buffer=double_buffer,
                lengths_device=lengths_device, checkpointing=checkpointing, steps=steps, warmup_run=warmup_run,
                pad_multiple=pad_multiple, config=config, layouts=layouts)


def set_environment(plan: Plan, ctx: dict) -> None:
    """Offline, no statistics, the compile cache, and the double buffer as asked; before unsloth is imported."""
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
    os.environ["UNSLOTH_DISABLE_DOUBLE_BUFFER"] = "1" if plan.double_buffer == "off" else "0"
    ctx["env_requested"] = {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("UNSLOTH_", "HF_"))}


# --- Unsloth's model ---------------------------------------------------------------------------------------------
def import_unsloth(ctx: dict, allow_cpu: bool) -> Session:
    """``import unsloth`` (it patches transformers, so first), then torch; the device."""
    ctx["stage"] = "import unsloth"
    t = time.time()
    log("importing unsloth (before transformers)")
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

    ctx["env"] = environment(torch)
    timings = {"import_s": round(time.time() - t, 1)}
    ctx["timings_s"] = timings
    cuda = torch.cuda.is_available()
    if not cuda and not allow_cpu:
        raise RuntimeError("no CUDA device: the Unsloth peer measures the GPU path (--allow-cpu runs Unsloth's "
                           "CPU backend for a plumbing check, a different code path)")
    log(f"unsloth {dist_version('unsloth')}, torch {torch.__version__}, transformers "
        f"{dist_version('transformers')}, device {ctx['env'].get('gpu_name') or 'cpu'}")
    return Session(torch=torch, fast=FastLanguageModel, cuda=cuda, device=torch.device("cuda" if cuda else "cpu"),
                   timings=timings)


def load_model(s: Session, plan: Plan, ctx: dict) -> None:
    """``FastLanguageModel.from_pretrained`` on the export: NF4 for Qwen3, bf16 16-bit LoRA for GPT-OSS; checked."""
    torch, meta = s.torch, plan.meta
    ctx["stage"] = ("load (FastLanguageModel.from_pretrained, bf16 16-bit LoRA)" if plan.gpt_oss else
                    "load (FastLanguageModel.from_pretrained, 4-bit)")
    t = time.time()
    ugc = CHECKPOINTING[plan.checkpointing]
    if plan.gpt_oss:  # model_type gpt_oss -> FastModel.from_pretrained (loader.py); exact name: no hub-name mapping
        s.model, _tok = s.fast.from_pretrained(
            model_name=os.path.abspath(plan.folder), max_seq_length=_max_seq(plan), dtype=torch.bfloat16,
            load_in_4bit=False, load_in_16bit=True, local_files_only=True, fix_tokenizer=False,
            use_gradient_checkpointing=ugc, use_exact_model_name=True)
    else:
        s.model, _tok = s.fast.from_pretrained(
            model_name=os.path.abspath(plan.folder), max_seq_length=plan.tokens, dtype=torch.bfloat16,
            load_in_4bit=True, local_files_only=True, fix_tokenizer=False, use_gradient_checkpointing=ugc)
    s.timings["load_s"] = round(time.time() - t, 1)
    s.quantized = quantized = [n for n, m in s.model.named_modules() if type(m).__name__ == "Linear4bit"]
    n4 = sum(1 for n in quantized if n.rsplit(".", 1)[-1] in LORA_TARGETS)
    want4 = len(LORA_TARGETS) * meta["num_layers"]
    log(f"loaded in {s.timings['load_s']}s: {type(s.model).__name__}, {len(quantized)} Linear4bit layers"
        + (f", {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated" if s.cuda else ""))
    if plan.gpt_oss:
        if quantized:
            raise CheckFailed(f"{len(quantized)} bitsandbytes Linear4bit layers after a 16-bit load (e.g. "
                              f"{quantized[:2]}): the GPT-OSS peer runs bf16 weights, as our combined scenario")
        if getattr(s.model.config, "output_router_logits", None):
            raise CheckFailed("output_router_logits is on after the load: the loss would add the router aux loss, "
                              "which the combined scenario's loss does not")
    elif n4 != want4:
        raise CheckFailed(f"{n4} of the {want4} projections (7 x layers) are bitsandbytes Linear4bit after the "
                          "4-bit load: the base weights are not NF4")


def _max_seq(plan: Plan) -> int:
    return max([plan.row_tokens] + [p["width"] for p in plan.layouts])


def add_lora(s: Session, plan: Plan, ctx: dict) -> None:
    """``FastLanguageModel.get_peft_model`` on the export's targets, checked; LoRA B made non-zero (as the harness);
    what the model runs recorded in ``s.model_info``."""
    torch, meta, config = s.torch, plan.meta, plan.config
    ctx["stage"] = "get_peft_model"
    t = time.time()
    s.model = model = s.fast.get_peft_model(
        s.model, r=int(meta["lora_rank"]), target_modules=list(meta["targets"]),
        lora_alpha=config["lora_alpha"], lora_dropout=config["lora_dropout"], bias="none",
        use_gradient_checkpointing=CHECKPOINTING[plan.checkpointing], random_state=3407,
        max_seq_length=_max_seq(plan))
    s.timings["peft_s"] = round(time.time() - t, 1)
    s.trainable = trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise CheckFailed("get_peft_model left no trainable parameter")
    s.lora_modules = sorted(n for n, m in model.named_modules() if hasattr(m, "lora_A") and n.rsplit(".", 1)[-1]
                            not in ("lora_A", "lora_B"))
    lora_check = probes.check_lora_placement(s.lora_modules, [n for n, _ in trainable], meta["targets"],
                                             meta["num_layers"])
    if lora_check:
        raise CheckFailed(lora_check)
    with torch.no_grad():
        for _, p in trainable:  # LoRA B starts at zero; give the adapters a real gradient path (as the harness)
            if p.dim() == 2 and not p.any():
                p.normal_(std=0.01)
    s.layers = model.base_model.model.model.layers if hasattr(model, "base_model") else []
    s.fused = probes.fused_lora_layers(s.layers)
    s.emb = model.get_input_embeddings().weight
    s.model_info = {"class": type(model).__name__, "family": plan.family, "linear4bit": len(s.quantized),
                    "lora_modules": len(s.lora_modules),
                    "linear4bit_other": [n for n in s.quantized if n.rsplit(".", 1)[-1] not in LORA_TARGETS][:4],
                    "fused_lora_layers": s.fused,
                    "params_trainable": sum(p.numel() for _, p in trainable),
                    "trainable_dtypes": sorted({str(p.dtype).replace("torch.", "") for _, p in trainable}),
                    "embedding_device": str(s.emb.device), "max_seq_length": getattr(model, "max_seq_length", None)}
    if plan.gpt_oss:
        s.model_info.update(probes.gpt_oss_paths(model, s.layers, torch))
    ctx["model"] = s.model_info
    log(f"LoRA ready in {s.timings['peft_s']}s: {s.model_info['params_trainable'] / 1e6:.1f}M trainable "
        f"{s.model_info['trainable_dtypes']}, fused layers {s.fused}, embedding on {s.emb.device}")


def prepare_training(s: Session, plan: Plan, ctx: dict) -> None:
    """The batches as tensors, AdamW over the adapters (the harness's ``make_optimizer``), training mode."""
    ctx["stage"] = "batches"
    s.feeds = feeds(plan.raw, plan.layouts, plan.family, plan.lengths_device, s.device, s.torch)
    s.optimizer = s.torch.optim.AdamW([p for _, p in s.trainable], lr=LR)
    s.model.train()
    if s.cuda:  # its module globals say what the offloaded checkpointing did (loaded by unsloth's GPU init anyway)
        import unsloth_zoo.gradient_checkpointing as gcmod

        s.gcmod = gcmod


# --- the measurement ---------------------------------------------------------------------------------------------
def _timed_step(s: Session, feed: dict) -> dict:
    """One training step timed as the harness times it: CUDA events around forward, backward, optimizer (step +
    zero_grad) and the whole step, one sync after it; peak memory reset before it."""
    torch, cuda = s.torch, s.cuda
    before = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = int(torch.cuda.memory_allocated())
        ev = {k: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for k in PHASES}
        mark = lambda k, i: ev[k][i].record()  # noqa: E731
    else:
        ev = {k: [0.0, 0.0] for k in PHASES}

        def mark(k, i):
            ev[k][i] = time.perf_counter()
    t = time.time()
    mark("step", 0)
    mark("forward", 0)
    loss = s.forward(feed)
    mark("forward", 1)
    fwd_peak = int(torch.cuda.max_memory_allocated()) if cuda else None  # host-side counter: no sync
    mark("backward", 0)
    loss.backward()
    mark("backward", 1)
    mark("optimizer", 0)
    s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    mark("optimizer", 1)
    mark("step", 1)
    if cuda:
        torch.cuda.synchronize()
        times = {k: a.elapsed_time(b) for k, (a, b) in ev.items()}
        peak = int(torch.cuda.max_memory_allocated())
    else:
        times = {k: (b - a) * 1e3 for k, (a, b) in ev.items()}
        peak = None
    return {"started": t, "times": times, "loss": float(loss.detach()), "peak": peak, "before": before,
            "forward_peak": fwd_peak}


def measure_steps(s: Session, plan: Plan, ctx: dict) -> Steps:
    """``warmup_run`` untimed steps, then ``steps`` measured ones, batches cycled ``batch[s % n]``."""
    out = Steps()
    total = plan.warmup_run + plan.steps
    for i in range(total):
        measured = i >= plan.warmup_run
        ctx["stage"] = f"step {i + 1}/{total} ({'measured' if measured else 'warmup'})"
        step = _timed_step(s, s.feeds[i % len(s.feeds)])
        times, value, peak = step["times"], step["loss"], step["peak"]
        if not math.isfinite(value):
            raise CheckFailed(f"loss is {value} at step {i + 1}")
        out.peaks.append(peak)
        if measured:
            for k, ms in times.items():
                out.samples[k].append(ms)
            out.losses.append(value)
            out.peaks_measured.append(peak)
            if s.cuda:
                out.resident.append(step["before"])
                out.forward_peaks.append(step["forward_peak"])
            if s.gcmod is not None:  # set at the start of this step's forward (from the second forward on)
                out.db_measured.append(bool(getattr(s.gcmod, "USE_DOUBLE_BUFFER", False)))
        else:
            out.first_steps.append(round(time.time() - step["started"], 2))
        ctx["completed_steps"] = i + 1
        log(f"step {i + 1}/{total} {'measured' if measured else 'warmup  '} fwd {times['forward']:8.1f} ms  "
            f"bwd {times['backward']:8.1f} ms  opt {times['optimizer']:6.1f} ms  step {times['step']:8.1f} ms  "
            f"loss {value:.4f}" + (f"  peak {peak / 2**30:.2f} GiB" if peak else ""))
    s.timings["warmup_wall_s"] = out.first_steps
    return out


def observe(s: Session, plan: Plan, ctx: dict) -> Observed:
    """One untimed forward+backward of batch 0 under CUDA's sync-debug warnings with Unsloth's attention entry
    points counted, the gradients it left, the optimizer step's syncs apart, and a profile of one more."""
    torch, obs = s.torch, Observed()
    ctx["stage"] = "host-sync count step (untimed)"
    # Loaded by unsloth's GPU init (importing it on the CPU backend is a circular import): look it up, don't import.
    obs.adispatch = sys.modules.get("unsloth.utils.attention_dispatch")
    if obs.adispatch is None and s.cuda:
        raise CheckFailed("unsloth.utils.attention_dispatch is not loaded: this is not Unsloth's GPU path")
    undo = (probes.count_attention_calls(obs.adispatch, obs.attention_calls) if obs.adispatch is not None
            else (lambda: None))
    if plan.gpt_oss:
        undo_sink = probes.count_calls(sys.modules.get("unsloth_zoo.flex_attention.attention_sink"),
                                       probes.SINK_ENTRY_POINTS, obs.attention_calls)
        undo_qwen, undo = undo, lambda: (undo_qwen(), undo_sink())
    try:
        if s.cuda:
            obs.syncs, obs.sites = probes.sync_warnings(s.forward_backward, torch)
        else:
            s.forward_backward()
    finally:
        undo()
    obs.no_grad = [n for n, p in s.trainable if p.grad is None]
    obs.zero_grad = [n for n, p in s.trainable if p.grad is not None and not bool(p.grad.any())]
    if s.cuda:
        obs.syncs_opt, _ = probes.sync_warnings(s.optimizer.step, torch)
    else:
        s.optimizer.step()
    s.optimizer.zero_grad(set_to_none=True)
    if s.cuda and os.environ.get("UNSLOTH_PEER_PROFILE", "1") != "0":
        ctx["stage"] = "profiled forward+backward (untimed)"
        obs.profiled = probes.profile_gpu(s.forward_backward)
        s.optimizer.zero_grad(set_to_none=True)
    return obs


def probe(s: Session, plan: Plan, ctx: dict) -> dict | None:
    """Last (whatever it leaves behind touches nothing measured): the padded layout's probe, or packed GPT-OSS's
    isolation probe; its answer goes into ``config``. An unanswered probe is recorded, never claimed either way."""
    config = plan.config
    if plan.padded:
        ctx["stage"] = "padded-layout probe (untimed, no grad)"
        try:
            modules = {"layer0_attention": s.layers[0].self_attn, "final_norm": probes.base_model(s.model).model.norm}
            found = probes.padded_probe(s.forward, s.feeds[0], plan.layouts[0]["lengths"], modules,
                                        plan.meta["vocab_size"], s.torch)
        except Exception as e:  # noqa: BLE001
            found = {"rows_independent": None, "right_padding_exact": None,
                     "error": one_line(f"{type(e).__name__}: {e}", 300)}
        config["rows_independent_measured"] = found.get("rows_independent")
        config["right_padding_exact_measured"] = found.get("right_padding_exact")
        if False in (found.get("rows_independent"), found.get("right_padding_exact")):
            config["segments_isolated"] = False
            config["segments_isolated_source"] = "measured: variants[0].packing.probe (batch 0) contradicts the layout"
        elif found.get("rows_independent") and found.get("right_padding_exact"):
            config["segments_isolated_source"] = ("construction, confirmed by variants[0].packing.probe (batch 0)")
        log(f"padded probe: rows_independent={found.get('rows_independent')}, "
            f"right_padding_exact={found.get('right_padding_exact')}")
        return found
    if not plan.gpt_oss:
        return None
    ctx["stage"] = "segment-isolation probe (untimed, no grad)"
    meta = plan.meta
    try:
        found = probes.isolation_probe(s.forward, s.feeds[0], plan.raw[0]["seq_lengths"], plan.raw[0]["pad_lengths"],
                                       s.layers, meta.get("layer_types"), meta.get("sliding_window"),
                                       meta["vocab_size"], s.torch)
    except Exception as e:  # noqa: BLE001
        found = {"segments_isolated": None, "causal": None, "error": one_line(f"{type(e).__name__}: {e}", 300)}
    if found.get("segments_isolated") is not None:
        config["segments_isolated"] = found["segments_isolated"]
        config["segments_isolated_source"] = "measured: variants[0].packing.probe (batch 0)"
    else:
        config["segments_isolated_source"] = ("reading of Unsloth's source; the probe did not answer (see "
                                              "variants[0].packing.probe)")
    config["causal_measured"] = found.get("causal")
    log(f"isolation probe: segments_isolated={found.get('segments_isolated')}, causal={found.get('causal')}")
    return found


# --- the result ----------------------------------------------------------------------------------------------------
def measured_variant(s: Session, plan: Plan, steps: Steps, obs: Observed, ctx: dict) -> dict:
    """The variant's figures: phase percentiles, memory, loss, throughput, host syncs, attention calls, profile."""
    variant = {"name": variant_name(plan.double_buffer, plan.checkpointing), "toggles": ctx["toggles"],
               "note": note(plan.family, plan.double_buffer, plan.lengths_device, plan.layout)}
    for k in PHASES:
        variant[f"{k}_ms"] = percentiles(steps.samples[k])
    step_s = variant["step_ms"]["median"] / 1e3
    config, cuda = plan.config, s.cuda
    variant.update({
        "peak_mem_bytes": max(p for p in steps.peaks if p is not None) if cuda else None,
        "peak_mem_bytes_measured": max(p for p in steps.peaks_measured if p is not None) if cuda else None,
        "resident_mem_bytes": max(steps.resident) if steps.resident else None,
        "forward_peak_mem_bytes": max(steps.forward_peaks) if steps.forward_peaks else None,
        "loss_median": percentiles(steps.losses)["median"], "losses": [round(x, 5) for x in steps.losses],
        "tokens_per_s": round(config["real_tokens_per_step"] / step_s, 1) if step_s > 0 else None,
        "tokens_per_s_basis": "real tokens per step (mean over the exported batches) / median step",
        "padded_tokens_per_s": round(config["padded_tokens_per_step"] / step_s, 1) if step_s > 0 else None,
        "host_syncs_per_step": obs.syncs, "host_syncs_optimizer": obs.syncs_opt,
        "host_syncs_method": "torch.cuda.set_sync_debug_mode('warn'): warnings 'called a synchronizing CUDA "
                             "operation' over one untimed forward+backward (batch 0); optimizer step apart",
        "host_sync_sites": obs.sites, "attention_calls": obs.attention_calls,
        "samples_ms": {k: [round(x, 3) for x in v] for k, v in steps.samples.items()},
    })
    if obs.profiled is not None:
        variant["profile"] = obs.profiled
    return variant


def check_path(s: Session, plan: Plan, steps: Steps, obs: Observed, variant: dict) -> tuple[list[str], dict]:
    """The ``problems`` (any one makes the result an error: the measured path is not the one claimed) and the
    packed-attention flags; adds the offloaded checkpointing's state to ``variant`` on CUDA."""
    problems = []
    if obs.no_grad or obs.zero_grad:
        problems.append(f"{len(obs.no_grad)} trainable tensors got no gradient and {len(obs.zero_grad)} a zero one "
                        f"(e.g. {(obs.no_grad + obs.zero_grad)[:2]})")
    packing = probes.packing_flags(obs.adispatch, s.torch, s.cuda)
    if not s.cuda:
        return problems, packing
    if s.gcmod is None:
        raise CheckFailed("unsloth_zoo.gradient_checkpointing is not loaded: no Unsloth checkpointing ran")
    packed_calls = sum(obs.attention_calls.get(k, 0) for k in probes.PACKED_ENTRY_POINTS)
    if packed_calls == 0 and not plan.gpt_oss:
        problems.append("Unsloth's packed attention was never called: packed_seq_lengths did not reach it")
    info = s.model_info
    if plan.gpt_oss:
        info.update(probes.gpt_oss_paths(s.model, s.layers, s.torch))  # the MoE backend is chosen at the 1st forward
        weights = {n: d for n, d in info.get("experts_dtypes", {}).items() if not n.endswith("_bias")}
        if any(d != "bfloat16" for d in weights.values()):
            problems.append(f"expert weights are {weights}, not bf16")
        if not info.get("flex_sink_attention_on_model"):
            problems.append("unsloth_zoo's GPT-OSS attention (flex_attention_with_sink) is not the forward of the "
                            f"model's attention class ({info.get('attention_forward')}): not the path claimed")
    offload = probes.offload_state(s.gcmod, s.torch, steps.db_measured)
    variant.update(offload)
    if offload["offload_observed"] and plan.checkpointing == "off":
        problems.append("Unsloth offloaded a layer input with use_gradient_checkpointing=False")
    if not offload["offload_observed"] and plan.checkpointing == "unsloth":
        problems.append("Unsloth's offloaded checkpointing never offloaded a layer input")
    if plan.checkpointing == "unsloth" and any(state != (plan.double_buffer == "on") for state in steps.db_measured):
        problems.append(f"double buffer asked {plan.double_buffer} but Unsloth's was {steps.db_measured} over the "
                        "measured steps (it turns on from the second forward if > 512 MiB are free; off on OOM)")
    return problems, packing


def packing_block(plan: Plan, found: dict | None, flags: dict) -> dict:
    """``variant.packing``: the flags, and for GPT-OSS what its attention got and the probe's answer."""
    if plan.padded:
        return {"layout": "padded", "packed_seq_lengths": "not passed (one sequence per row)",
                "attention_mask": "passed (1 real, 0 pad); GptOssModel.forward sets it to None in training once "
                                  "the flex-sink attention is installed, and that attention builds its own mask",
                "position_ids": "not passed: GptOssModel.forward uses arange(width) (cache_position)",
                "attention": "flex_attention_with_sink (unsloth_zoo), causal / sliding-window BlockMask over "
                             "each padded row", "probe": found, **flags}
    if plan.gpt_oss:
        return {"layout": "packed", "packed_seq_lengths": "not passed (its GPT-OSS forward has no packed path)",
                "attention": "flex_attention_with_sink (unsloth_zoo), causal / sliding-window BlockMask over "
                             "each whole row", "probe": found, **flags}
    return flags


def path_warnings(s: Session, plan: Plan, obs: Observed) -> list[str]:
    """Deviations that do not invalidate the measurement, but a reader must see."""
    out, found, info, cuda, calls = [], obs.probe, s.model_info, s.cuda, obs.attention_calls
    if plan.padded:
        for key, what in (("rows_independent", "rows are NOT independent: a row's outputs moved when another row's "
                                               "tokens changed"),
                          ("right_padding_exact", "right padding is NOT exact: real positions moved when the pads "
                                                  "after them changed")):
            if found and found.get(key) is False:
                out.append(f"{what} (measured by the probe): the padded step is not each sequence alone")
            elif not found or found.get(key) is None:
                out.append(f"{key} could not be measured (probe inconclusive or failed): see packing.probe")
        if cuda and info.get("zoo_model_forward") is False:
            out.append(f"GptOssModel.forward is {info.get('model_forward')}, not unsloth_zoo's: the reading that "
                       "training drops attention_mask does not apply (its flex-sink attention ignores any mask in "
                       "training either way)")
    if plan.gpt_oss and not plan.padded:
        if found and found.get("segments_isolated") is False:
            out.append("packed segments are NOT isolated: later segments of a row attend to earlier ones (measured "
                       "by the probe). Unsloth's attention computes causal attention over each 4096-token row, not "
                       "per segment: not the same computation as our packed path, and its loss is not comparable")
        elif not found or found.get("segments_isolated") is None:
            out.append("segment isolation could not be measured (probe inconclusive or failed): see packing.probe")
        if found and found.get("causal") is False:
            out.append("the probe saw earlier positions change when a later segment changed: not causal")
    if plan.gpt_oss:
        if cuda and not calls.get("flex_attention"):
            out.append("no call of attention_sink.flex_attention was counted (its caller may have been traced by "
                       "torch.compile): the attention path rests on the class check alone")
        if cuda and info.get("moe_backend") not in ("grouped_mm", None):
            out.append(f"Unsloth's MoE backend is {info.get('moe_backend')}, not torch._grouped_mm")
    elif cuda and min(s.fused.values()) < plan.meta["num_layers"]:
        out.append(f"Unsloth's fused LoRA kernels are installed on only {s.fused} of {plan.meta['num_layers']} layers")
    if cuda and s.emb.device.type != "cuda":
        out.append(f"Unsloth offloaded the input embedding to {s.emb.device} (offload_embedding='auto')")
    if calls.get("build_sdpa_packed_attention_mask"):
        out.append("Unsloth fell back to SDPA over a dense (T, T) block-diagonal mask in some layers")
    if calls.get("_torch_varlen_packed"):
        out.append("attention ran torch's varlen kernel, not per-segment SDPA (a torch with "
                   "varlen_attn(enable_gqa=...)): the docstring's per-segment description does not apply")
    return out


UNVERIFIED = ("peak_mem_bytes", "peak_mem_bytes_measured", "loss_median", "tokens_per_s", "padded_tokens_per_s",
              "host_syncs_per_step")  # with every *_ms: moved aside when a check fails


def assemble(s: Session, plan: Plan, variant: dict, problems: list[str], ctx: dict) -> dict:
    """The result document; with ``problems`` the variant's figures move to ``unverified_measurements`` and the
    variant and the result carry the error."""
    ctx["env"] = environment(s.torch)
    if problems:
        msg = "; ".join(problems)
        unverified = {k: variant.pop(k) for k in list(variant) if k.endswith("_ms") or k in UNVERIFIED}
        variant.update(error=f"check failed: {msg}", unverified_measurements=unverified)
    config = plan.config
    config["timings_s"] = s.timings
    config["env_requested"] = ctx["env_requested"]
    result = {"scenario": SCENARIO, "env": ctx["env"], "config": config, "variants": [variant],
              "notes": result_notes(plan.family, plan.layout)}
    if problems:
        result["error"] = variant["error"]
    return result


def run(folder: str, out: str, double_buffer: str = "on", warmup: int = 2, steps: int | None = None,
        lengths_device: str = "cpu", allow_cpu: bool = False, ctx: dict | None = None, layout: str | None = None,
        pad_multiple: int | None = None, checkpointing: str = "unsloth") -> dict:
    """Measure Unsloth on an export folder and write ``out``; ``ctx`` collects what is known if it fails.

    ``checkpointing``: "unsloth" (``use_gradient_checkpointing="unsloth"``, its offloaded checkpointing) or "off"
    (``False``: every activation kept, the peer of our plan's largest budgets).

    ``layout``: "packed" (the export's rows; Qwen3 with packed_seq_lengths) or "padded" (GPT-OSS only: one
    right-padded row per sequence, ``pad_multiple`` default 128); None: the family's default."""
    ctx = ctx if ctx is not None else {}
    plan = plan_run(folder, double_buffer=double_buffer, warmup=warmup, steps=steps, lengths_device=lengths_device,
                    layout=layout, pad_multiple=pad_multiple, checkpointing=checkpointing, ctx=ctx)
    set_environment(plan, ctx)
    s = import_unsloth(ctx, allow_cpu)
    load_model(s, plan, ctx)
    add_lora(s, plan, ctx)
    prepare_training(s, plan, ctx)
    measured = measure_steps(s, plan, ctx)
    obs = observe(s, plan, ctx)
    obs.probe = probe(s, plan, ctx)
    variant = measured_variant(s, plan, measured, obs, ctx)
    ctx["stage"] = "checks"
    problems, flags = check_path(s, plan, measured, obs, variant)
    variant["packing"] = packing_block(plan, obs.probe, flags)
    variant["model"] = s.model_info
    variant["warnings"] = path_warnings(s, plan, obs)
    result = assemble(s, plan, variant, problems, ctx)
    write_json(out, result)
    return result
