FILENAME = "00_naive_path_profiled.ipynb"

# where the committed outputs come from (appended to the first cell by build.py)
OUTPUTS = """**The outputs below** come from a CPU run in smoke mode (`SMOKE=1`, torch 2.13, transformers 5.17, 2026-12-06):
tiny models, so the live timings show the mechanisms, not GPU speed. Every GPU figure is read from the committed
results and names its card and run. CI re-runs every cell in smoke mode (nbval, lax: the outputs are not compared)."""

CELLS = [
("md", r'''
# 00 — The stock step, profiled: where the time goes, and the glue

[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fastsft-lab/fastsft_lab/blob/main/notebooks/00_naive_path_profiled.ipynb)
(the badge and the install cell name the GitHub repository the project will have; it is not published yet: the
install cell says how to give it your copy)

**What you will learn**
- where each gain of the series comes from: one chain of changes from transformers' default step, each step one
  change, with what it removes -- compute, memory bandwidth or host overhead, measured kernel by kernel (the later
  notebooks explain each one);
- how to measure a QLoRA training step the way this series does: interleaved steps, median and p20–p80, host syncs
  per step and per decoder layer, peak memory;
- where the stock step's time goes, by the module that launched each kernel, and how to read a host–GPU timeline;
- where the first glue cost (attention metadata rebuilt per layer) sits on that timeline, and where stock
  transformers has already removed the MoE one.

**Prerequisites.** Runs anywhere. Without a GPU it runs in *smoke mode* (tiny models, seconds; on a CPU "idle" is
Python between ops, not a waiting GPU). With a GPU it builds the largest real architecture that fits (random
weights, NF4 + LoRA r=16): Qwen3-14B with all its layers on a large GPU, Qwen3-0.6B on a T4.

**The problem.** Once attention and matmul kernels are fast, a fine-tuning step still pays for the code *between*
kernels: metadata rebuilt in every layer, device→host reads that stall the launch queue, copies that do not overlap
compute, loops of small kernels. Before fixing any of it, find it: this notebook measures the stock step. **Every
live step here runs under `torch.autocast(bfloat16)` on a GPU** (what `SFTTrainer(bf16=True)` does): the chain, the
profile, the timeline and the memory cell measure the same step.
'''),
("colab", ""),                # the shared Colab install cell (build.py)
("code", r'''
import warnings
warnings.filterwarnings("ignore", message="IProgress not found")       # tqdm without ipywidgets: before any import of tqdm
warnings.filterwarnings("ignore", message=".*Profiler clears events")  # torch.profiler's notice, once per profile
import logging
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)   # its CPU build's notice about an optional kernel package
import contextlib, gc, time
import torch
import matplotlib.pyplot as plt
from IPython.display import display
from IPython.core.pylabtools import select_figure_formats
from fastsft_lab.env import describe, smoke_mode, device_profile
from fastsft_lab.lab import plots, results
from fastsft_lab.lab.nbparams import parameters

select_figure_formats(get_ipython(), {"png"})   # display(fig) embeds a PNG under any matplotlib backend (CI: Agg)
SMOKE = smoke_mode()          # SMOKE=1/0 in the environment overrides; default: on without a GPU
PROFILE = device_profile()    # the GPU's name, capability and memory, and the choices they imply
T0 = time.time()
print(describe())
'''),
("md", r'''
## Parameters
Tiny sizes in smoke mode; on a GPU the largest choice that fits its memory (`fastsft_lab/lab/nbparams.py` lists
them, with the memory each needs).
'''),
("code", r'''
globals().update(parameters("00", PROFILE, SMOKE))   # MODEL, TOKENS, MOE_MODEL, ..., AUTOCAST, and why
'''),
("md", r'''
## Where each gain comes from, at a glance
One cumulative chain from transformers' default step, each step one change, interleaved step by step on the same
batches (`bench --only attribution`): each bar is what that change is worth *here* and nothing else. The `removes`
column says what it takes away and how (the mechanism); the `measured` lines under the table say what fell: one
more warm step of each bar under `torch.profiler` (the same batches and autocast, after its timed steps), every
kernel classified by what bounds it -- its FLOPs and bytes against the card's peaks: **compute**-bound,
**memory**-bound, or **latency**-bound (near neither peak: too small to fill the GPU, launch-bound) -- not by the
module that launched it, plus **idle** (the GPU waiting for the host). Each bar names the kind whose time fell most:
idle and latency-bound kernels are host overhead. The packed kernel comes
first (with its metadata rebuilt per layer, the "before" of fix 1), then fix 1 (metadata cached), on GPT-OSS fix 3
in two steps against transformers' default `grouped_mm` experts (sync-free grouping with eager glue, then the fused
gate/combine kernels), fix 2 (offload with one buffer, then two), the fused loss and the checkpointing plan for a
memory budget.

`vs ref` checks each step against exact packing. Stock GPT-OSS attention lets packed sequences see each other (its
row says so). On GPT-OSS in bf16 the MoE steps read 1e-1 or more: a rounding-level difference between two correct
kernels flips the top-k choice of tokens whose router logits are near-ties, and a token sent to another expert
changes by O(1). Chains that carry the routing check count those tokens and give the difference with the reference's
routing forced (notebook 03 runs the check on any machine; float32 CPU tests are the exactness proof).

A chain committed from a GPU run is shown as committed, the same one the README table and notebooks 03 and 04 read;
a live chain runs only for a configuration with no committed chain (smoke mode, a smaller GPU). Under each chain,
its first step -- the stock step, under autocast like every bar -- by what bounds it: its idle time and its
latency-bound kernels are all that any glue fix can win on it; the rest only fewer FLOPs, fewer bytes or faster
kernels shorten. A committed run from before the chain profiled its steps says "not profiled".
'''),
("code", r'''
import io
from fastsft_lab.lab.scenarios import run_scenario
from fastsft_lab.lab.report import attribution_text, stock_step_text

chains = []
for model, layers, tokens in ((MODEL, NUM_LAYERS, TOKENS), (MOE_MODEL, MOE_LAYERS, MOE_TOKENS)):
    committed = None if SMOKE else results.attribution_for(model, "none")
    if committed is None:                                  # measured here: no committed chain of this configuration
        with contextlib.redirect_stdout(io.StringIO()):    # the scenario's own table: attribution_text says it
            committed = run_scenario("attribution", device=DEVICE, smoke=SMOKE, out_dir="runs/00_attribution",
                                     progress=False, models=[model], num_layers=layers, tokens=[tokens],
                                     kernels=["none"], budget=BUDGET, steps=STEPS, autocast=AUTOCAST)[0]
    chains.append(committed)
if SMOKE:   # the same chains on a GPU at full depth, committed (on a GPU they are the ones shown above)
    chains += [d for d in (results.attribution_for(m, "none") for m in ("qwen3-14b", "gpt-oss-20b")) if d]
for doc in chains:
    print(attribution_text(doc) + "\n")
    print(stock_step_text(doc) + "\n")                    # the stock step's idle: the most a glue fix can win
    fig = plots.plot_waterfall(doc)
    display(fig); plt.close(fig)
'''),
("md", r'''
## Before, measured: the stock step
A deterministic synthetic instruction corpus packed best-fit-decreasing into rows (several sequences per row,
`position_ids` restarting per sequence, a padding tail in grey), and the model built straight on the device from
its published hyper-parameters, random weights (speed does not depend on weight values), NF4 + LoRA on every
projection, gradient checkpointing on. Two ways to run it: **stock transformers** (`sdpa`, packed `position_ids`,
no mask: Qwen3 detects the packing once per forward, one boolean read back from the GPU, and builds one
block-diagonal mask) and **metadata rebuilt per layer** (the same kernel, its packing metadata derived from
`position_ids` in every layer, as transformers' flash packed path and Unsloth's pre-cache builders do: the "before"
of notebook 01).
'''),
("code", r'''
from fastsft_lab.data import benchmark_batches
from fastsft_lab.models import build_model, LoraSettings
from fastsft_lab.lab.harness import Variant, make_optimizer, with_autocast
from fastsft_lab.lab.scenarios.packed import naive_variants

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
model = build_model(MODEL, device=DEVICE, dtype=DTYPE, quant="nf4", lora=LoraSettings(rank=16),
                    num_layers=NUM_LAYERS, gradient_checkpointing=True)
info = model.fastsft_info
print(f"{info.preset}: {info.num_layers} layers, {info.params_total/1e6:.1f}M parameters stored "
      f"({info.params_trainable/1e6:.2f}M trainable LoRA), built in {time.time()-t:.1f}s")
batches = [b.to(DEVICE) for b in batches]
variants = with_autocast([Variant("stock transformers sdpa", toggles={"attn": "sdpa"})]
                         + naive_variants(model, backends=["sdpa"]), AUTOCAST)   # the step the chain starts from
step_context = lambda v: v.context(model) if v.context else contextlib.nullcontext()
opt = make_optimizer(model, lr=1e-6)
'''),
("md", r'''
## Where the time goes
`torch.profiler` over one stock step (the chain's first step: same model, batch and autocast), its device time split
by the module that launched each kernel (`fastsft_lab.lab.breakdown`: attention, dense matmuls, LoRA, the loss,
norms and elementwise ops, copies, the optimizer) and idle, the device waiting for the host. A category is *who
launched* the kernels, not *what bounds* them: the LoRA category, for one, holds the casts and additions around its
small matmuls, memory-bound work; what bounds each kernel is the chain's measured view above. Idle is the share a
glue fix can win back: removing host overhead gains at most the time the device waits for it.
'''),
("code", r'''
from fastsft_lab.lab.breakdown import breakdown_variant, describe_bottleneck, format_breakdown

bd = breakdown_variant(model, batches, variants[0], optimizer=opt, device=DEVICE, steps=1)
print(f"the stock step, autocast {AUTOCAST}:\n" + format_breakdown(bd))
idle = next((r for r in bd["categories"] if r["category"] == "idle"), None)
if idle is not None:
    print(f"idle: {idle['ms']:.1f} ms of {bd['step_ms']:.1f} ({idle['share']:.1%}): the most host overhead could cost here")
print(describe_bottleneck(bd))
'''),
("md", r'''
## The host–GPU timeline, and the metadata cost on it
One step of each path as two lanes: host ops (grey; **red where the host waits for the device**: a `nonzero`, an
`.item()`, a `.tolist()`) and, on a GPU, the kernels (blue). Each red mark is a **host sync**: the launch queue runs
dry behind it, and the GPU idles until the host refills it. Stock transformers pays one per step (its packing
check); the per-layer metadata path pays several in every layer, twice under checkpointing (forward and
recompute). The counter below counts the syncs themselves (one op can hold several). On a CPU there is no GPU lane:
the red marks show where a GPU run would stall. The other two glue costs are drawn where they are fixed: the
offload copies in notebook 02, the expert loop in notebook 03.
'''),
("code", r'''
from fastsft_lab.profiling import SyncCounter, host_device_timeline

lines = {}
for v in variants:
    v.enable(model)
    inputs = v.inputs(batches[0], v.prepare(batches[0]) if v.prepare else None)
    def one_step():
        with step_context(v):
            model(**inputs).loss.backward()
    one_step(); model.zero_grad(set_to_none=True)                     # warm: no first-call allocations in the trace
    lines[v.name] = host_device_timeline(one_step, DEVICE)
    model.zero_grad(set_to_none=True)
    counter = SyncCounter.for_decoder_layers(model, device=DEVICE)
    with counter:
        one_step()
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
from fastsft_lab.profiling import peak_memory, reset_peak_memory

def one_step():
    with step_context(variants[0]):
        loss = model(**batches[0].model_inputs()).loss
        loss.backward()
    opt.step(); opt.zero_grad(set_to_none=True)

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
histogram + grouped matmul, no sync): there the glue left is kernel launches, not syncs, and that default is the
"before" fix 3 is measured against (notebook 03). The Qwen3 model is freed first.
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
## Summary and next bottleneck
The stock step is not the slow path everywhere: Qwen3 with `sdpa` detects the packing once per forward, and
transformers 5.x routes GPT-OSS experts through `grouped_mm` with no sync inside the layers. The three glue costs are
those of the paths people run when that is not what they get:

1. **Attention metadata rebuilt in every layer** (notebook 01): transformers' flash packed path and Unsloth's
   pre-cache builders derive `cu_seqlens` from `position_ids` in every layer, with host syncs, twice per step under
   checkpointing. Fix: build it once per batch from the host-side lengths. Most of what a fast kernel gains over
   stock `sdpa` is the kernel itself, the chain's first step.
2. **Offloaded checkpoint reloads that do not overlap** (notebook 02): one staging buffer makes copies and compute
   take turns. Fix: two buffers with events, reloads prefetched on a side stream.
3. **MoE glue around the expert matmuls** (notebook 03): against the `grouped_mm` default, which pays no sync, what
   is left is kernels: sync-free grouping with leaner glue, then fused gate/combine kernels.

Each notebook proves its fix changes no numbers before it shows a speedup. The stock step's idle time and its
latency-bound kernels (under each chain above) are the ceiling of every glue fix together; where they are small,
the next gains are in the kernels.

**Further reading.** PyTorch's [profiler recipe](https://pytorch.org/tutorials/recipes/recipes/profiler_recipe.html)
and [CUDA semantics](https://pytorch.org/docs/stable/notes/cuda.html) (asynchronous execution, what synchronizes);
the QLoRA paper (Dettmers et al., 2023); `fastsft_lab.profiling.SyncCounter` for how syncs are counted.
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
