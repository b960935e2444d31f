FILENAME = "05_diagnose_your_step.ipynb"

# where the committed outputs come from (appended to the first cell by build.py)
OUTPUTS = """**The outputs below** come from a CPU run in smoke mode (2026-12-06): a tiny Llama, so every figure is a CPU's --
the "kernels" are host ops and idle is host time between them. CI re-runs every cell in smoke mode (nbval, lax: the
outputs are not compared)."""

CELLS = [
("md", r'''
# 05 — Diagnose your own step

[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fastsft-lab/fastsft_lab/blob/main/notebooks/05_diagnose_your_step.ipynb)

**What you will learn**
- how to find what bounds *your* training step -- compute, memory bandwidth or host overhead -- before picking a fix:
  every kernel of one warm step classified by what it achieves against the GPU's peaks;
- where the step's host syncs come from (module and source line), how many kernels each decoder layer launches, how
  much of the step is recompute, and how much memory it leaves unused;
- which switches of `fastsft_lab.apply` apply to your model, what each is predicted to win *from the costs measured
  on your step*, and how to check a prediction against a measurement.

**Prerequisites.** Notebooks 00-04 explain each switch; this one needs none of them. Runs anywhere: without a GPU in
*smoke mode* (a tiny Llama, a few minutes on a CPU); on a GPU with Llama-3.1-8B's architecture (random weights, no
download), as many of its layers and tokens as half the GPU's free memory holds (the parameters cell says which).
`SMOKE=1`/`SMOKE=0` switches.

**The problem.** Notebooks 00-04 measured our fixes on our models. Your script is different: another architecture,
another trainer, another batch. A fix helps only where its cost is: removing host syncs wins nothing on a step whose
GPU is busy anyway, and a faster kernel wins nothing while the GPU waits for the host. So measure first -- one warm
step of the Trainer's own loop -- then fix what the measurement names.
'''),
("colab", ""),                # the shared Colab install cell (build.py)
("code", r'''
import warnings
warnings.filterwarnings("ignore", message="IProgress not found")       # tqdm without ipywidgets: before any import of tqdm
import logging
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)   # its CPU build's notice about an optional kernel package
import time
import torch
import transformers
import matplotlib.pyplot as plt
from IPython.display import display
from IPython.core.pylabtools import select_figure_formats
from fastsft_lab.env import describe, smoke_mode, device_profile

transformers.logging.set_verbosity_error()      # TRL's notices about the tokenizer's special tokens
import datasets
datasets.disable_progress_bars()                # TRL's dataset preparation, as plain outputs
select_figure_formats(get_ipython(), {"png"})   # display(fig) embeds a PNG under any matplotlib backend (CI: Agg)
SMOKE = smoke_mode()          # SMOKE=1/0 in the environment overrides; default: on without a GPU
PROFILE = device_profile()    # the GPU's name, capability and memory, and the choices they imply
T0 = time.time()
print(describe())
'''),
("md", r'''
## Parameters
The model is Llama-3.1-8B as its `config.json` describes it, built from that config with random weights (the step's
speed does not depend on their values). On a GPU the cell keeps the largest depth and batch whose rough need fits in
*half* of the free memory: the other half is left on purpose, to see what the diagnosis makes of it.
'''),
("code", r'''
from fastsft_lab.data import sample_lengths, synthetic_corpus

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0, original_max_position_embeddings=8192),
                rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
TINY = dict(LLAMA_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=256)       # the same code path, smoke sizes

def need_gib(c, layers, tokens):
    """A checkpointed LoRA step's most memory, roughly: 16-bit weights, logits, layer inputs, one layer's work."""
    h, i, v, kv = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_key_value_heads"] * c["head_dim"]
    weights = 2 * (layers * (2 * h * h + 2 * h * kv + 3 * h * i) + 2 * v * h)
    logits = tokens * v * (2 + 4 + 4)                  # 16-bit logits, their float32 copy and its gradient
    work = tokens * 2 * (layers * h + 12 * h + 3 * i)
    return (weights + logits + work) / 2**30

DEVICE, DTYPE = PROFILE.device, PROFILE.dtype        # bf16 from sm80 on, fp16 on a T4, float32 on a CPU
if not SMOKE:
    free = torch.cuda.mem_get_info()[0] / 2**30
    fits = [(n, t) for n, t in ((32, 8192), (16, 8192), (8, 4096), (4, 2048), (2, 1024))
            if need_gib(LLAMA_8B, n, t) <= free / 2]
    if not fits:
        print(f"{PROFILE.name}: {free:.0f} GiB free is too little for 2 layers: smoke sizes instead")
        SMOKE = True
if SMOKE:
    CONFIG, LAYERS, TOKENS, MIX = TINY, 2, 256, "short"
    why = "smoke mode: Llama-3.1-8B's structure at tiny widths"
else:
    CONFIG, (LAYERS, TOKENS), MIX = LLAMA_8B, fits[0], "realistic"
    why = (f"Llama-3.1-8B widths, {LAYERS} of its 32 layers, {TOKENS} tokens a step: needs about "
           f"{need_gib(LLAMA_8B, LAYERS, TOKENS):.0f} GiB of the {free:.0f} GiB free")
if DEVICE == "cpu":
    torch.set_num_threads(1)                          # tiny models: threads only add noise on a small shared CPU
STEPS = 6                                             # 2 warm-up, 1 profiled, 2 timed, 1 with its syncs counted
LONGEST = TOKENS // 4                                 # so that every row packs several sequences
mean = sum(p + r for p, r in sample_lengths(500, MIX, max_len=LONGEST)) / 500
CORPUS = synthetic_corpus(int(1.5 * STEPS * TOKENS / mean) + 8, vocab_size=CONFIG["vocab_size"], mix=MIX,
                          max_len=LONGEST)
print(PROFILE.describe())
print(why)
print(f"{len(CORPUS)} sequences of {MIX} lengths (mean {mean:.0f}, at most {LONGEST} tokens), packed into rows of "
      f"{TOKENS} tokens")
'''),
("md", r'''
## Your step, measured in the Trainer's own loop
The cell below is an ordinary LoRA SFT script: a Llama built from its config, PEFT LoRA (r=16 on every projection),
TRL's `SFTTrainer` with packing (TRL's best-fit packing: padding-free rows, `position_ids` restarting at each
sequence), its defaults otherwise (gradient checkpointing on, `bf16` autocast where the GPU has it). One line is
added: `DiagnoseCallback`. It lets the Trainer run two warm-up steps, times the next two, counts the host syncs
of the fifth, profiles the sixth kernel by kernel (last: the profiler's teardown can slow the step after it), and
prints the report.
'''),
("code", r'''
import trl
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, models as tok_models
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

import fastsft_lab
from fastsft_lab.callbacks import DiagnoseCallback

torch.manual_seed(0)
with torch.device(DEVICE):
    base = AutoModelForCausalLM.from_config(LlamaConfig(**{**CONFIG, "num_hidden_layers": LAYERS}), dtype=DTYPE)
model = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, task_type="CAUSAL_LM",
                                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                        "gate_proj", "up_proj", "down_proj"]))
# the dataset is tokenized already: the tokenizer only names the pad and end-of-sequence ids
tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tok_models.WordLevel({"<pad>": 0, "<eos>": 1,
                                    "<unk>": 2}, unk_token="<unk>")), pad_token="<pad>", eos_token="<eos>")
train = datasets.Dataset.from_dict({"input_ids": [list(e.input_ids) for e in CORPUS]})

def sft(callback, **changes):
    args = trl.SFTConfig(output_dir="runs/nb05", max_steps=STEPS, per_device_train_batch_size=1, packing=True,
                         max_length=TOKENS, learning_rate=1e-4, bf16=DTYPE == torch.bfloat16,
                         fp16=DTYPE == torch.float16, use_cpu=DEVICE == "cpu", logging_steps=STEPS,
                         report_to=[], save_strategy="no", disable_tqdm=True, **changes)
    return trl.SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer,
                          callbacks=[callback])

diag = DiagnoseCallback(step=2, repeats=2)
sft(diag).train()
'''),
("md", r'''
## Reading the report
- **step / busy / idle.** The step time is the median of the timed steps. *Busy* is the time at least one kernel
  runs; *idle* is the rest: the GPU waiting for the host (Python, launches, syncs). Idle is all that any host-side
  fix -- fewer syncs, fewer launches -- can win.
- **time by bound.** Each kernel is compared with the card's data-sheet peaks. It is *compute*-bound when its
  arithmetic would take at least as long as its memory traffic at peak rate, *memory*-bound otherwise, and *latency*
  when it reaches less than 10% of either peak: too small to fill the GPU, so its launch and tail are its cost. Only
  fewer FLOPs help the first, fewer bytes the second, fewer and larger kernels the third.
- **kernel launches** per step and per decoder layer, by phase: forward, backward, and *recompute* -- gradient
  checkpointing's second forward of each layer inside the backward.
- **host syncs**: each with the module it ran in and the line that read a value back. On a CPU nothing waits, but
  the count is the same as on a GPU.
- **memory**: the step's peak beside the memory a budget of 90% of the free memory allows.
- **where the time goes**: kernel time per part of the model, split by bound; *waits* is idle time charged to the
  kernel that ended it (the GPU was waiting for that launch).
- **switches**: for each switch of `fastsft_lab.apply`, the time it is predicted to save and the measured cost the
  prediction rests on -- or why it does not apply.

The cell below reads the same diagnosis for the few facts that decide what to do next.
'''),
("code", r'''
d = diag.diagnosis
b = d.bounds
top = max(("compute", "memory", "latency"), key=b.get)
print(f"the kernels' largest bound is {top}: {b[top]:.1f} of the step's {d.total_ms:.1f} ms "
      f"({b[top] / d.total_ms:.0%}); idle {d.idle_ms:.1f} ms ({d.idle_share:.0%})")
print(f"every host-side fix together can win at most the idle time: {d.idle_ms:.1f} ms")
for s in d.sync_sites[:3]:
    where = (f"decoder layer {s['layer']}" if s["layer"] is not None else
             "the training loop, outside the model" if s["module"] == "<outside>" else s["module"])
    print(f"{s['count']} host sync(s) per step in {where}, at {s['site']}")
print(f"recompute: {d.recompute_ms:.1f} ms, {d.recompute_share:.0%} of the step")
for p in d.predictions:
    if p.suggested:
        print(f"suggested {p.switch}={p.value!r}: {p.saving_ms:.1f} ms predicted, from: {p.rests_on}")
'''),
("md", r'''
## The fix: what the diagnosis suggests, applied
`d.suggested()` is `apply`'s arguments for every switch predicted to save time. Equivalence first: the loss of the
diagnosed batch, on the same weights, before and after the switches, within a few roundings of the dtype (each
switch is exact to the dtype's rounding; notebooks 01-04 check each one against its naive path). Then the same
Trainer runs again on the same model with a second `DiagnoseCallback`. A memory plan brings its own checkpointing,
so where `memory_budget` is suggested the second run leaves the Trainer's off (on, it would replace the plan).
'''),
("code", r'''
import contextlib

suggested = d.suggested()
cast = torch.autocast(DEVICE, dtype=DTYPE) if d.autocast else contextlib.nullcontext()

def loss_of(batch):
    with torch.no_grad(), cast:
        return float(model(**batch).loss)

before = loss_of(diag.batch)
print(fastsft_lab.apply(model, **suggested))
after = loss_of(diag.batch)
bound = 8 * torch.finfo(DTYPE).eps
diff = abs(after - before) / abs(before)
print(f"loss of the diagnosed batch: {before:.6f} before, {after:.6f} after: relative difference {diff:.1e} "
      f"(bound {bound:.1e})")
if diff > bound:
    raise AssertionError("the switches changed the loss by more than the dtype's rounding")
diag2 = DiagnoseCallback(step=2, repeats=2)
sft(diag2, **({"gradient_checkpointing": False} if "memory_budget" in suggested else {})).train()
result = d.compare(diag2.diagnosis)
print(result)
'''),
("md", r'''
## The fix measured: prediction beside measurement
Each switch's line pairs its predicted saving with the cost it rested on, before and after. The step's own line
puts the predicted step beside the measured one. They differ where the predictions overlap (the idle time a switch
removes was partly someone else's), where a switch adds kernels of its own (varlen's metadata, the memory plan's
kept activations), and where the step's shape moves (a shorter step leaves the GPU fewer chances to run ahead of
the host). A prediction that misses badly is a finding too: the cost it rested on was not what bounded the step.
On a shared CPU (smoke mode) the step times move by more than a switch's effect: there only the costs' own lines
(`lora_glue_ms` and the like) are worth reading; the committed GPU run is the one to read.
'''),
("code", r'''
a = diag2.diagnosis
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
bars = {"before\n(measured)": d.step_ms, "after\n(predicted)": result.predicted_step_ms,
        "after\n(measured)": a.step_ms}
rects = ax1.bar(list(bars), list(bars.values()), color=["#888888", "#9ecae1", "#3182bd"])
for r, v in zip(rects, bars.values()):
    ax1.text(r.get_x() + r.get_width() / 2, v, f"{v:.0f} ms\n{d.step_ms / v:.2f}x", ha="center", va="bottom")
ax1.set_ylabel("step time (ms)")
ax1.set_ylim(0, 1.3 * max(bars.values()))
ax1.set_title("the step: predicted beside measured")
left = [0.0, 0.0]
for key, color in (("compute", "#3182bd"), ("memory", "#6baed6"), ("latency", "#fd8d3c"), ("unknown", "#cccccc"),
                   ("idle", "#e6550d")):
    vals = [d.bounds.get(key, 0.0), a.bounds.get(key, 0.0)]
    ax2.barh(["before", "after"], vals, left=left, color=color, label=key)
    left = [x + y for x, y in zip(left, vals)]
ax2.invert_yaxis()
ax2.set_xlabel("ms per step")
ax2.set_title("what bounds the step's time")
ax2.legend(ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.22))
fig.tight_layout()
display(fig)
plt.close(fig)
'''),
("md", r'''
## What it costs
- **Six steps of your run.** Two warm up; the two timed ones come next, unaffected; the one whose syncs are
  counted runs slower (a dispatch mode sees every op), and so does the profiled one (the profiler records every op),
  last. The profiler holds the step's events on the host until the report is made.
- **What a prediction is.** A saving computed from a measured cost, not a promise: it assumes the removed cost was
  on the step's critical path and that the switches' savings add up. `packed_attention` predicts the attention work
  on pairs of tokens from different sequences, which varlen and flex skip (SDPA masks them and still computes them);
  `memory_budget` the recompute of the layers whose activations fit, measured one layer at a time; `fused_loss` and
  `fused_lora` the bytes their kernels no longer move.
- **What it cannot see.** A CPU has no device idle and no peak memory: there, idle is host time between ops and the
  memory plan is not predicted. Kernels no recorded op launched (Triton kernels started from Python) have no FLOP
  or byte count: they are reported as *unknown* when longer than 10 µs.
- **Outside a Trainer.** `fastsft_lab.diagnose(model, batch, autocast=torch.bfloat16)` measures the same things on
  a step of your own, and `.apply_and_measure(model, batch)` applies and measures in one call.
'''),
("md", r'''
## Summary and further reading
- Name what bounds the step before naming a fix: compute-bound kernels want fewer FLOPs, memory-bound ones fewer
  bytes, latency-bound ones fewer launches; idle time is the ceiling of every host-side fix.
- `DiagnoseCallback` (or `fastsft_lab.diagnose`) measures one warm step of your run: syncs with their source lines,
  launches per layer, recompute, memory headroom, time by bound, and a prediction for every switch that applies --
  each resting on a cost you can read in the report.
- Apply the suggestions, check the loss is unchanged, measure again: the report's comparison puts the prediction
  beside the measurement.

Further reading: Horace He, *Making Deep Learning Go Brrrr From First Principles* (compute, memory, overhead);
the roofline model (Williams, Waterman and Patterson, 2009); PyTorch's profiler recipe and
`torch.cuda.set_sync_debug_mode`; GPU MODE lecture 1 (profile a warm step, the step you time).
'''),
("code", r'''
print(f"notebook ran in {time.time() - T0:.0f} s on: {describe()}")
if DEVICE == "cuda":
    print(f"peak GPU memory over the notebook: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
else:
    print("peak memory: not tracked on a CPU (it is a CUDA allocator statistic)")
'''),
]
