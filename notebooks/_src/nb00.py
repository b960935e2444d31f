FILENAME = "00_naive_path_profiled.ipynb"

# where the committed outputs come from (appended to the first cell by build.py)
OUTPUTS = """**The outputs below** come from one run on an NVIDIA H200 (`SMOKE=0`, torch 2.11, transformers 5.17, 2026-12-05;
run `benchmarks/results/h200-2026-12-05b`, whose README has the log). CI re-runs every cell in smoke mode on a CPU
(nbval, lax: the outputs are not compared)."""

CELLS = [
("md", r'''
# 00 — The stock step, profiled: where the time goes, and the glue

[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fastsft-lab/fastsft_lab/blob/main/notebooks/00_naive_path_profiled.ipynb)

**What you will learn**
- where each gain of the series comes from, measured as one chain from the stock step (the later notebooks explain
  each step of it);
- how to measure a QLoRA training step the way the rest of this series does: interleaved steps, median and p20–p80,
  host syncs per step and per decoder layer, peak memory;
- where the stock step's time goes: compute-bound kernels, memory-bound kernels, and overhead (the device waiting
  for the host), and how to see it on a host–GPU timeline;
- where the three glue costs of notebooks 01–03 sit on that timeline, and where stock transformers has already
  removed one.

**Prerequisites.** Runs anywhere. Without a GPU it runs in *smoke mode* (tiny models, seconds; on a CPU "idle" is
Python between ops, not a waiting GPU). With a GPU it builds the largest real architecture that fits (random
weights, NF4 + LoRA r=16): Qwen3-14B with all its layers on a large GPU, Qwen3-0.6B on a T4. ~25 minutes.

**The problem.** Once attention and matmul kernels are fast, a fine-tuning step still pays for the code *between*
kernels: metadata rebuilt in every layer, device→host reads that stall the launch queue, copies that do not overlap
compute, Python loops over experts. Before fixing any of it, find it: this notebook measures the stock step.
'''),
("colab", ""),                # the shared Colab install cell (build.py)
("code", r'''
import warnings
warnings.filterwarnings("ignore", message="IProgress not found")       # tqdm without ipywidgets: before any import of tqdm
warnings.filterwarnings("ignore", message=".*Profiler clears events")  # torch.profiler's notice, once per profile
import logging
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)   # its CPU build's notice about an optional kernel package
import gc
import time
import torch
import matplotlib.pyplot as plt
from IPython.display import display
from IPython.core.pylabtools import select_figure_formats
from fastsft_lab.env import describe, smoke_mode, device_profile
from fastsft_lab.lab import plots, results

select_figure_formats(get_ipython(), {"png"})   # display(fig) embeds a PNG under any matplotlib backend (CI: Agg)
SMOKE = smoke_mode()          # SMOKE=1/0 in the environment overrides; default: on without a GPU
PROFILE = device_profile()    # the GPU's name, capability and memory, and the choices they imply
T0 = time.time()
print(describe())
'''),
("md", r'''
## Parameters
Everything below is derived from these. In smoke mode the sizes are tiny; on a GPU they are the largest real ones
that fit in its memory (`PROFILE.pick` takes the first choice whose need fits), printed beside the peak the
committed H200 runs of the closest configurations measured.
'''),
("code", r'''
# GiB each GPU choice needs: the committed H200 peak of the same (or the closest) configuration, printed by the next
# cell, plus headroom for the CUDA context and the allocator's fragmentation.
CHOICES = {"qwen3-14b": dict(tokens=8192, gib=40),      # all 40 layers; NF4 + LoRA r16, checkpointing
           "qwen3-0.6b": dict(tokens=4096, gib=12)}     # all 28 layers; fits a 16 GB T4
MOE_CHOICES = {"4 layers, 8192 tokens": 30, "1 layer, 2048 tokens": 12}   # GPT-OSS-20B at real width, no-grad forward
DEVICE, DTYPE = PROFILE.device, PROFILE.dtype   # bf16 from sm80 on, fp16 on a T4, float32 on a CPU
MODEL = PROFILE.pick({name: c["gib"] for name, c in CHOICES.items()}) if not SMOKE else None
if not SMOKE and MODEL is None:
    print(f"{PROFILE.name}: {PROFILE.memory_gib:.0f} GiB is less than the smallest choice needs: smoke sizes instead")
    SMOKE = True
if SMOKE:
    MODEL, NUM_LAYERS, TOKENS, ROW_TOKENS, STEPS = "tiny-qwen3", None, 1024, 512, 4
    MOE_MODEL, MOE_LAYERS, MOE_TOKENS = "tiny-gpt-oss", None, 512
    why = "smoke mode: tiny models with the real structure"
    if DEVICE == "cpu":
        torch.set_num_threads(1)   # tiny models: threads only add noise on a small shared CPU
else:
    NUM_LAYERS, TOKENS, STEPS = None, CHOICES[MODEL]["tokens"], 4      # None = all layers
    ROW_TOKENS = TOKENS
    moe_choice = PROFILE.pick(MOE_CHOICES) or "1 layer, 2048 tokens"
    MOE_MODEL, MOE_LAYERS, MOE_TOKENS = "gpt-oss-20b", (4 if moe_choice.startswith("4") else 1), \
        (8192 if moe_choice.startswith("4") else 2048)
    why = (f"{MODEL} is the largest choice whose need ({CHOICES[MODEL]['gib']} GiB) fits in "
           f"{PROFILE.memory_gib:.0f} GiB; GPT-OSS-20B: {moe_choice}")
LORA_RANK = 16
print(PROFILE.describe())
print(why)
print(dict(MODEL=MODEL, NUM_LAYERS=NUM_LAYERS, TOKENS=TOKENS, ROW_TOKENS=ROW_TOKENS, MOE_MODEL=MOE_MODEL,
           MOE_LAYERS=MOE_LAYERS, MOE_TOKENS=MOE_TOKENS, DEVICE=DEVICE, DTYPE=str(DTYPE)))
for name, c in CHOICES.items():
    print(f"{name}: all layers, {c['tokens']} tokens -> needs {c['gib']} GiB here")
print("committed H200 peaks of the closest configurations (one training step; QLoRA, checkpointing, as here):")
for name, what, config in [("qwen3-14b", "8 of 40 layers, 8192 tokens", dict(scenario="packed_metadata", model="qwen3-14b",
                            num_layers=8, tokens_per_step=8192, mix="realistic", backend="sdpa")),
                           ("qwen3-0.6b", "28 layers, 4096 tokens", dict(scenario="packed_metadata", model="qwen3-0.6b",
                            num_layers=28, tokens_per_step=4096, mix="realistic", backend="sdpa"))]:
    peak, doc = results.newest_peak_gib(**config)
    print(f"  {name:11s} {what:28s} " + (f"{peak:5.1f} GiB  [{results.describe_run(doc)}]" if doc else "not committed"))
'''),
("md", r'''
## Where each gain comes from, at a glance
The whole series in one measurement, before the details: one cumulative chain from the stock step, each step one
change, interleaved step by step on the same batches (`bench --only attribution`), so each bar is what that change
is worth *here* and nothing else: the packed kernel with its metadata rebuilt per layer (what a varlen kernel costs
and gains before any fix), then fix 1 (metadata cached), fix 3 (experts grouped once, then sync-free; MoE only),
fix 2 (offload with one buffer, then two), the fused loss, and the checkpointing plan for a memory budget. Every step
is checked against exact packing (`vs ref`): stock GPT-OSS attention lets packed sequences see each other, the
others compute the same numbers (on a GPU in bf16 the column is dominated by non-deterministic kernels and, in
GPT-OSS, by routing choices that flip: the CPU float32 tests are the exactness proof). On a CPU the times show the
mechanisms, not GPU speed; below them, the same chain on the H200 at full depth, read from the committed results,
with the published figure beside each fix.
'''),
("code", r'''
import contextlib, io
from fastsft_lab.lab.scenarios import run_scenario
from fastsft_lab.lab.report import attribution_text

BUDGET = 16.0 if SMOKE else round(min(80.0, 0.8 * PROFILE.memory_gib))   # GiB for the last step: the plan
chain_docs = []
for model, layers, tokens in ((MODEL, NUM_LAYERS, TOKENS), (MOE_MODEL, MOE_LAYERS, MOE_TOKENS)):
    with contextlib.redirect_stdout(io.StringIO()):       # the scenario's own table: the text below says it
        chain_docs += run_scenario("attribution", device=DEVICE, smoke=SMOKE, out_dir="runs/00_attribution",
                                   progress=False, models=[model], num_layers=layers, tokens=[tokens],
                                   kernels=["none"], budget=BUDGET, steps=STEPS)
for doc in chain_docs:
    print(attribution_text(doc) + "\n")
    fig = plots.plot_waterfall(doc)
    display(fig); plt.close(fig)
committed = results.load_results("attribution", newest_run=True)       # the same chain on the H200, at full depth
print("committed H200 runs of this chain:" if committed else "no H200 run of this chain committed yet")
for doc in sorted(committed, key=lambda d: d["config"]["model"], reverse=True):
    print("\n" + attribution_text(doc))
    fig = plots.plot_waterfall(doc)
    display(fig); plt.close(fig)
'''),
("md", r'''
## Before, measured: the stock step
A deterministic synthetic instruction corpus packed best-fit-decreasing into rows (several sequences per row,
`position_ids` restarting per sequence, a padding tail in grey), and the model built straight on the device from
its published hyper-parameters, random weights (speed does not depend on weight values), NF4 + LoRA on every
projection, gradient checkpointing on.

Two ways to run it. **Stock transformers** (`sdpa`) given packed `position_ids` and no mask: Qwen3 detects the packing
once per forward (one boolean read back from the GPU) and builds one block-diagonal mask. **Metadata rebuilt per
layer**: the same kernel, with its packing metadata derived from `position_ids` in every layer, as transformers'
flash packed path and Unsloth's pre-cache builders do: the "before" of notebook 01. The harness interleaves the two
step by step and reports median [p20–p80] (glossary).
'''),
("code", r'''
from fastsft_lab.data import benchmark_batches
from fastsft_lab.models import build_model, LoraSettings
from fastsft_lab.profiling import peak_memory, reset_peak_memory

batches = benchmark_batches(tokens_per_step=TOKENS, row_tokens=ROW_TOKENS, steps=STEPS, vocab_size=151936 if not SMOKE else 256,
                            mix="realistic" if not SMOKE else "short")
b0 = batches[0]
fig, ax = plt.subplots(figsize=(9, max(1.8, 0.9 + 0.4 * b0.shape[0])))
for r, (row, pad) in enumerate(zip(b0.seq_lengths, b0.pad_lengths)):       # one bar per sequence
    start = 0
    for j, n in enumerate(row):
        ax.barh(r, n, left=start, color="lightgray" if pad and j == len(row) - 1 else plt.cm.tab20(j % 20), edgecolor="white")
        start += n
ax.set_yticks(range(b0.shape[0])); ax.set_yticklabels([f"row {r}" for r in range(b0.shape[0])])
ax.set_xlabel("token position"); ax.set_title(f"one packed batch: {b0.num_sequences} sequences, fill {b0.num_real_tokens / b0.num_tokens:.0%}", fontsize=9)
fig.tight_layout(); display(fig); plt.close(fig)

t = time.time()
model = build_model(MODEL, device=DEVICE, dtype=DTYPE, quant="nf4", lora=LoraSettings(rank=LORA_RANK),
                    num_layers=NUM_LAYERS, gradient_checkpointing=True)
info = model.fastsft_info
print(f"{info.preset}: {info.num_layers} layers, {info.params_total/1e6:.1f}M parameters stored "
      f"({info.params_trainable/1e6:.2f}M trainable LoRA), built in {time.time()-t:.1f}s")
batches = [b.to(DEVICE) for b in batches]
'''),
("code", r'''
from fastsft_lab.lab.harness import Variant, run_variants, make_result, format_table
from fastsft_lab.lab.scenarios.packed import naive_variants

variants = [Variant("stock transformers sdpa", toggles={"attn": "sdpa"},
                    note="transformers 5.x Qwen3 + sdpa, packed position_ids, no attention mask")]
variants += naive_variants(model, backends=["sdpa"])   # optimization 1's "before" (notebook 01)
res = run_variants(model, batches, variants, steps=STEPS - 1, warmup=1, progress=False)
result = make_result("00-naive-path", {"model": MODEL, "num_layers": info.num_layers, "tokens_per_step": TOKENS,
                                       "quant": "nf4", "lora_rank": LORA_RANK, "gradient_checkpointing": True}, res, DEVICE)
print(format_table(result))
fig = plots.plot_result(result, phases=("forward", "step"),
                        title=f"stock path vs metadata rebuilt per layer: {MODEL} ({info.num_layers} layers), "
                              f"{TOKENS} tokens/step, {PROFILE.name} (measured here)")
display(fig); plt.close(fig)
'''),
("md", r'''
## Where the time goes: compute, memory, overhead
`torch.profiler` over one stock step, its time split by who launched each kernel (`fastsft_lab.lab.breakdown`:
attention, dense matmuls, LoRA, the loss, norms and elementwise ops, copies, the optimizer, and idle), then grouped by
what bounds each kind of kernel. Compute-bound work gets faster with faster kernels; memory-bound work with fewer
passes over memory (fused kernels); **overhead** -- the device idle while the host prepares the next kernel or waits
for a result -- with less host work between kernels. The glue fixes of this series remove overhead.
'''),
("code", r'''
from fastsft_lab.lab.breakdown import breakdown_variant, bound_by, describe_bottleneck, format_breakdown
from fastsft_lab.lab.harness import make_optimizer

opt = make_optimizer(model, lr=1e-6)
bd = breakdown_variant(model, batches, variants[0], optimizer=opt, device=DEVICE, steps=1)
print(format_breakdown(bd))
print("\nby what bounds it:")
for group, ms in bound_by(bd).items():
    print(f"  {group:62s} {ms:8.1f} ms  {ms / bd['step_ms']:6.1%}")
print("\nnext bottleneck --", describe_bottleneck(bd))
'''),
("md", r'''
## The host–GPU timeline, and the glue on it
One step of each path as two lanes: host ops (grey; **red where the host waits for the device**: a `nonzero`, an
`.item()`, a `.tolist()`) and, on a GPU, the kernels (blue). Each red mark is a **host sync**: the launch queue runs
dry behind it, and the GPU idles until the host refills it. Stock transformers pays one per step (its packing
check); the per-layer metadata path pays several in every layer, twice under checkpointing (forward and
recompute). A lane counts the host ops that waited (one op can hold several syncs: the counter below counts the
syncs themselves). On a CPU there is no GPU lane: the red marks show where a GPU run would stall.
'''),
("code", r'''
from fastsft_lab.profiling import SyncCounter, host_device_timeline

lines = {}
for v in variants:
    v.enable(model)
    inputs = v.inputs(batches[0], v.prepare(batches[0]) if v.prepare else None)
    one_step = lambda: model(**inputs).loss.backward()
    one_step(); model.zero_grad(set_to_none=True)                     # warm: no first-call allocations in the trace
    lines[v.name] = host_device_timeline(one_step, DEVICE)
    model.zero_grad(set_to_none=True)
    counter = SyncCounter.for_decoder_layers(model, device=DEVICE)
    with counter:
        model(**inputs).loss.backward()
    model.zero_grad(set_to_none=True)
    v.disable(model)
    print(f"{v.name:32s} syncs/step={counter.total:4d}  inside layers={counter.in_modules:4d}  "
          f"first layers: {list(counter.per_module().values())[:4]}  kinds={dict(counter.by_kind)}")
fig, ax = plt.subplots(figsize=(10, 3.2 if DEVICE == "cpu" else 4.5))
plots.plot_host_device_timeline(lines, ax=ax, title=f"one step, {MODEL}, {PROFILE.name}: red = the host waits for the device",
                                what="the step (forward + backward)")
fig.tight_layout(); display(fig); plt.close(fig)
'''),
("md", r'''
## What it costs: memory
Checkpointing keeps one tensor per decoder layer (its input) instead of every activation. Offloading those inputs
to pinned CPU memory (notebook 02) removes even that -- if the copies hide behind compute. Without checkpointing a
large model at long sequences may not fit at all: the cell says so when the step runs out of memory.
'''),
("code", r'''
def one_step():
    loss = model(**batches[0].model_inputs()).loss
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

OUT_OF_MEMORY = False
if DEVICE == "cuda":
    rows = []
    for ckpt in (True, False):
        if ckpt: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else: model.gradient_checkpointing_disable()
        torch.cuda.synchronize(); reset_peak_memory()
        try:
            t = time.time(); one_step(); torch.cuda.synchronize()
            rows.append((ckpt, f"step {(time.time() - t) * 1e3:8.1f} ms (single run)  peak {peak_memory() / 2**30:6.1f} GiB"))
        except torch.cuda.OutOfMemoryError:
            OUT_OF_MEMORY = True
            rows.append((ckpt, f"out of memory: the step needs more than the {PROFILE.memory_gib:.0f} GiB of this GPU "
                               f"(it had allocated {peak_memory() / 2**30:.1f} GiB when it failed)"))
            opt.zero_grad(set_to_none=True); model.zero_grad(set_to_none=True); gc.collect(); torch.cuda.empty_cache()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for ckpt, text in rows:
        print(f"gradient checkpointing={ckpt!s:5s}  {text}")
else:
    print("CPU run: no device memory to report (peak memory is a CUDA statistic)")
'''),
("md", r'''
## The MoE expert loop (GPT-OSS)
transformers' eager `GptOssExperts` asks, for every expert that got tokens, *which* tokens (`torch.where` on a mask):
host syncs per expert hit, per layer. transformers 5.x defaults to its `grouped_mm` experts path instead (sort +
histogram + grouped matmul, no sync): there the glue left is kernel launches, not syncs (notebook 03). The Qwen3
model is freed first.
'''),
("code", r'''
from fastsft_lab.models import decoder_layers

del model, opt, batches     # free the dense model before building the MoE one
gc.collect()
if DEVICE == "cuda":
    torch.cuda.empty_cache()
moe = build_model(MOE_MODEL, device=DEVICE, dtype=DTYPE, num_layers=MOE_LAYERS)
moe.eval()
print("transformers' default experts implementation:", moe.config._experts_implementation)
moe_batch = benchmark_batches(tokens_per_step=MOE_TOKENS, row_tokens=min(MOE_TOKENS, 2048), steps=1,
                              vocab_size=moe.config.vocab_size, mix="short" if SMOKE else "realistic")[0].to(DEVICE)
routed = []   # the router's choices per layer; experts hit are counted after the sync counter closes
handles = [layer.mlp.experts.register_forward_hook(lambda m, args, out: routed.append(args[1].detach()))
           for layer in decoder_layers(moe)]
moe_syncs = {}
for impl in ("eager", "grouped_mm"):
    moe.set_experts_implementation(impl)
    routed.clear()
    counter = SyncCounter.for_decoder_layers(moe, device=DEVICE)
    with torch.no_grad(), counter:
        moe(**moe_batch.model_inputs())
    moe_syncs[impl] = list(counter.per_module().values())
for h in handles: h.remove()
hits = [int(torch.unique(r).numel()) for r in routed]
print("experts per layer:", moe.config.num_local_experts, "| top-k:", moe.config.num_experts_per_tok,
      "| experts hit per layer:", hits)
for impl, per_layer in moe_syncs.items():
    print(f"{impl:10s} syncs per MoE layer: {per_layer}")
'''),
("code", r'''
# NBVAL_CHECK_OUTPUT
# The eager loop pays one sync to list the hit experts (`nonzero`), then per hit expert a `torch.where(mask)` (its
# output size lives on the device) and several 0-d tensor reads (`expert_idx == E` in an `if`, and every
# `weight[expert_idx]` turns the 0-d index tensor into a Python int). grouped_mm pays none inside the layers.
print("eager: syncs > 2 x experts hit, in every layer:", all(s > 2 * h for s, h in zip(moe_syncs["eager"], hits)))
print("grouped_mm: syncs inside MoE layers:", sum(moe_syncs["grouped_mm"]))
'''),
("md", r'''
## Summary and next bottleneck: what stock transformers already does, and the three costs this series removes
The stock step measured above is not the slow path everywhere. Qwen3 with `sdpa` detects the packing once per
forward (one sync per step) and builds one block-diagonal mask; transformers 5.x routes GPT-OSS experts through its
`grouped_mm` path by default, with no sync inside the layers. The three glue costs are those of the paths people run
when that is not what they get:

1. **Attention metadata rebuilt in every layer** (notebook 01). A varlen or flex kernel needs `cu_seqlens`,
   `max_seqlen` or block tables. transformers' flash packed path and Unsloth's pre-cache builders derive them from
   `position_ids` in every layer, with host syncs (`nonzero`, `.item()`, `.tolist()`), twice per step under
   checkpointing (forward and recompute): the "metadata rebuilt per layer" row above. Fix: build them once per batch
   from the host-side lengths. Most of what a fast kernel gains over stock `sdpa` is the kernel itself; notebook 01
   separates the two.
2. **Offloaded checkpoint reloads that do not overlap** (notebook 02). Offloading checkpointed layer inputs to CPU
   saves GPU memory, but a single staging buffer makes copies and compute take turns (and `save_on_cpu` copies on the
   compute stream). Fix: two buffers with events, reloads prefetched on a side stream.
3. **MoE routing that asks per expert** (notebook 03). transformers' eager experts loop syncs once per hit expert per
   layer (the count above). Its default `grouped_mm` does not sync; against it, what is left to gain is fewer,
   fused kernels around the grouped matmuls, not syncs. Fix: sort tokens by expert once (argsort + counts +
   offsets), then a sync-free grouped matmul with fused glue.

Each notebook proves its fix changes no numbers before it shows a speedup.

**Further reading.** PyTorch's [profiler recipe](https://pytorch.org/tutorials/recipes/recipes/profiler_recipe.html)
and [CUDA semantics](https://pytorch.org/docs/stable/notes/cuda.html) (asynchronous execution, what synchronizes);
the QLoRA paper (Dettmers et al., 2023); transformers' gradient checkpointing and packing docs
(`DataCollatorWithFlattening`); `fastsft_lab.profiling.SyncCounter` for how syncs are counted.
'''),
("code", r'''
print(f"notebook ran in {time.time() - T0:.0f} s on: {describe()}")
if DEVICE == "cuda":
    print(f"peak GPU memory over the notebook: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
          + (" (the no-checkpointing step that ran out of memory above filled the GPU)" if OUT_OF_MEMORY else ""))
else:
    print("peak memory: not tracked on a CPU (it is a CUDA allocator statistic)")
'''),
]
