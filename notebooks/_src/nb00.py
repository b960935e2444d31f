FILENAME = "00_naive_path_profiled.ipynb"

# where the committed outputs come from (appended to the first cell by build.py)
OUTPUTS = """**The outputs below** come from a CPU run in smoke mode (`SMOKE=1`, tiny models, torch 2.13, 2026-12-04); every
GPU figure in them is read from the committed H200 results. On a GPU the same cells run at real width."""

CELLS = [
("md", r'''
# 00 — The naive path, profiled

[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fastsft-lab/fastsft_lab/blob/main/notebooks/00_naive_path_profiled.ipynb)

**What you will learn**
- how packed SFT batches look (several sequences per row, `position_ids` restarting per sequence, no padding waste);
- how to measure a QLoRA training step the way the rest of this series does: phases (forward, backward,
  optimizer) as median and p20–p80 over interleaved steps, host syncs per step and per decoder layer, peak memory;
- where the time goes (profiler top ops), and the three pieces of *glue code* that notebooks 01–03 fix.

**Prerequisites.** Runs anywhere. Without a GPU it runs in *smoke mode* (tiny models, seconds). With a GPU it builds
the largest real architecture that fits (random weights, NF4 + LoRA r=16): Qwen3-14B with all its layers on a large
GPU, Qwen3-0.6B on a small one such as Colab's T4. The parameters cell prints what it picked and why; the cell after
it prints what each choice needs, next to the peak memory the committed H200 runs of the same configurations
measured.

**The problem.** Once attention and matmul kernels are fast, a fine-tuning step still pays for the code *between*
kernels: metadata rebuilt in every layer, device→host reads that stall the launch queue, memory copies that do not
overlap compute, and Python loops over experts. This notebook measures the unoptimized path so that the next ones
have a baseline.
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
that fit in its memory (`PROFILE.pick` takes the first choice whose need fits).
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
'''),
("code", r'''
# What the GPU choices need, against what the committed H200 runs of the closest configurations measured
# (fastsft_lab.lab.results: the clone's benchmarks/results, or the copy packaged with the library).
def h200_peak(scenario, **config):
    """(largest peak_mem_bytes in GiB, its document) of the newest committed GPU run of `scenario` matching `config`."""
    docs = [d for d in results.load_results(scenario) if all(d["config"].get(k) == v for k, v in config.items())]
    if not docs:
        return None, None
    return max(v.get("peak_mem_bytes") or 0 for v in docs[0]["variants"]) / 2**30, docs[0]

reference = [
    ("qwen3-14b", "8 of its 40 layers, 8192 tokens", h200_peak("packed_metadata", model="qwen3-14b", num_layers=8,
                                                                tokens_per_step=8192, mix="realistic", backend="sdpa")),
    ("qwen3-14b", "all 40 layers, 16384 tokens", h200_peak("offload_vram", model="qwen3-14b", num_layers=40,
                                                            tokens_per_step=16384)),
    ("qwen3-0.6b", "all 28 layers, 4096 tokens", h200_peak("packed_metadata", model="qwen3-0.6b", num_layers=28,
                                                            tokens_per_step=4096, mix="realistic", backend="sdpa")),
    ("gpt-oss-20b", "4 layers, 8192 tokens, forward", h200_peak("moe-routing", model="gpt-oss-20b",
                                                                 tokens_per_step=8192, mode="forward")),
]
for name, c in CHOICES.items():
    print(f"{name}: all layers, {c['tokens']} tokens -> needs {c['gib']} GiB here")
for name, gib in MOE_CHOICES.items():
    print(f"gpt-oss-20b: {name} -> needs {gib} GiB here")
print("committed H200 peaks (one training step; QLoRA, checkpointing, as here):")
for name, what, (peak, doc) in reference:
    print(f"  {name:11s} {what:32s} {peak:5.1f} GiB   [{results.describe_run(doc)}]" if doc else
          f"  {name:11s} {what:32s} not in the committed results")
'''),
("md", r'''
## The data: packed rows
A deterministic synthetic instruction corpus (log-normal prompt and response lengths, median ≈ 360 tokens, long tail;
see `fastsft_lab.data.LENGTH_MIXES`) packed best-fit-decreasing into rows. Each row keeps its sequence lengths as
host-side integers — that matters in notebook 01.
'''),
("code", r'''
from fastsft_lab.data import benchmark_batches

batches = benchmark_batches(tokens_per_step=TOKENS, row_tokens=ROW_TOKENS, steps=STEPS, vocab_size=151936 if not SMOKE else 256,
                            mix="realistic" if not SMOKE else "short")
b0 = batches[0]
print("batch shape", b0.shape, "| sequences per step:", b0.num_sequences, "| fill:", f"{b0.num_real_tokens / b0.num_tokens:.1%}")
print("row 0 segment lengths:", b0.seq_lengths[0][:12], "..." if len(b0.seq_lengths[0]) > 12 else "")
print("position_ids restart per sequence:", b0.position_ids[0, b0.seq_lengths[0][0] - 3: b0.seq_lengths[0][0] + 3].tolist())
'''),
("code", r'''
# This notebook's own picture (the lab's plots module has no packed-row chart): one bar per sequence
fig, ax = plt.subplots(figsize=(9, max(1.8, 0.9 + 0.4 * b0.shape[0])))
for r, (row, pad) in enumerate(zip(b0.seq_lengths, b0.pad_lengths)):
    start = 0
    for j, n in enumerate(row):
        is_pad = pad and j == len(row) - 1
        ax.barh(r, n, left=start, color="lightgray" if is_pad else plt.cm.tab20(j % 20), edgecolor="white")
        start += n
ax.set_yticks(range(b0.shape[0])); ax.set_yticklabels([f"row {r}" for r in range(b0.shape[0])])
ax.set_xlabel("token position"); ax.set_title("One packed batch: each colour is one sequence (grey: padding tail)", fontsize=9)
fig.tight_layout()
display(fig); plt.close(fig)
'''),
("md", r'''
## The model: QLoRA on the real architecture
`build_model` builds the architecture straight on the target device from its published hyper-parameters with
random weights (speed does not depend on weight values), quantizes every linear layer to NF4 and adds LoRA adapters
on all attention and MLP projections. Gradient checkpointing is on, as in any long-context SFT recipe.
'''),
("code", r'''
from fastsft_lab.models import build_model, LoraSettings
from fastsft_lab.profiling import peak_memory, reset_peak_memory

t = time.time()
model = build_model(MODEL, device=DEVICE, dtype=DTYPE, quant="nf4", lora=LoraSettings(rank=LORA_RANK),
                    num_layers=NUM_LAYERS, gradient_checkpointing=True)
info = model.fastsft_info
print(f"{info.preset}: {info.num_layers} layers, {info.params_total/1e6:.1f}M parameters stored "
      f"({info.params_trainable/1e6:.2f}M trainable LoRA), built in {time.time()-t:.1f}s")
if DEVICE == "cuda":
    print(f"GPU memory after build (NF4 weights, bf16/fp16 embeddings and LM head, LoRA): "
          f"{torch.cuda.memory_allocated()/2**30:.1f} GiB")
batches = [b.to(DEVICE) for b in batches]
'''),
("md", r'''
## A training step on the stock path
Stock transformers (`sdpa` attention) given packed `position_ids` and no mask: Qwen3's model detects the packing
once per forward and builds one block-diagonal mask (that detection reads one boolean back from the GPU). Next to
it, the per-layer "naive" path notebook 01 replaces: the same attention kernel, with its metadata rebuilt from
`position_ids` in every layer. The harness interleaves the variants step by step and reports median [p20–p80].
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
'''),
("code", r'''
fig = plots.plot_result(result, phases=("forward", "step"),
                        title=f"stock path vs metadata rebuilt per layer: {MODEL} ({info.num_layers} layers), "
                              f"{TOKENS} tokens/step, {PROFILE.name} (measured here)")
display(fig); plt.close(fig)
'''),
("md", r'''
## Host syncs, per step and per layer
A host sync is any operation whose result the CPU must read before it can continue (`.item()`, `.tolist()`,
`nonzero`, boolean indexing, printing a tensor…). While the CPU waits, it issues no kernels; afterwards the GPU waits
for the CPU to refill the launch queue. One per step is harmless; one per layer per step is not.
'''),
("code", r'''
from fastsft_lab.profiling import SyncCounter

for v in variants:
    v.enable(model)
    counter = SyncCounter.for_decoder_layers(model, device=DEVICE)
    with counter:
        loss = model(**v.inputs(batches[0], v.prepare(batches[0]) if v.prepare else None)).loss
        loss.backward()
    v.disable(model)
    model.zero_grad(set_to_none=True)
    per_layer = counter.per_module()
    print(f"{v.name:32s} syncs/step={counter.total:4d}  inside layers={counter.in_modules:4d}  "
          f"first layers: {list(per_layer.values())[:4]}  kinds={dict(counter.by_kind)}")
'''),
("md", r'''
## Where the time goes
`torch.profiler` over one step; the trace (open it in `chrome://tracing` or Perfetto) lands in `runs/`.
'''),
("code", r'''
import os
from fastsft_lab.profiling import profile

os.makedirs("runs", exist_ok=True)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)

def one_step():
    loss = model(**batches[0].model_inputs()).loss
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

prof = profile(one_step, trace_path="runs/00_stock_step_trace.json", top=12)
print("GPU kernels by device time" if DEVICE == "cuda" else "host ops by self time (a CPU: no kernels, no launch queue)",
      "- each entry counted once:")
for op in prof.top_ops:
    print(f"{op['self_ms']:10.2f} ms  {op['calls']:6d} calls  {op['name'][:110]}")
if prof.queue_full_ms:
    print(f"the CPU also waited {prof.queue_full_ms:.1f} ms on a full launch queue (CUPTI's 'Command Buffer Full'): "
          "the GPU, not the host, set the pace there")
'''),
("md", r'''
## Memory: what checkpointing buys, and what offloading would add
Checkpointing keeps one tensor per decoder layer (its input) instead of every activation. Offloading those inputs
to pinned CPU memory (notebook 02) removes even that — if the copies hide behind compute. Without checkpointing a
large model at long sequences may not fit at all: the cell says so when the step runs out of memory.
'''),
("code", r'''
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
histogram + grouped matmul); notebook 03 measures both against our grouping. The Qwen3 model is freed first.
'''),
("code", r'''
from fastsft_lab.models import decoder_layers

del model, opt, counter, loss, batches     # free the dense model before building the MoE one
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
## Summary: what stock transformers already does, and the three costs this series removes
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
