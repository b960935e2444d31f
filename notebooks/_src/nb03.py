FILENAME = "03_moe_routing.ipynb"

# where the committed outputs come from (appended to the first cell by build.py)
OUTPUTS = """**The outputs below** come from a CPU run in smoke mode (`SMOKE=1`, torch 2.13, transformers 5.17, 2026-12-06):
tiny models, so the live timings show the mechanisms, not GPU speed. Every GPU figure is read from the committed
results and names its card and run. CI re-runs every cell in smoke mode (nbval, lax: the outputs are not compared)."""

CELLS = [
("md", r'''
# 03 — MoE routing for GPT-OSS: group once, then never ask the host

[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fastsft-lab/fastsft_lab/blob/main/notebooks/03_moe_routing.ipynb)
(the repository is not published yet: the install cell says how to give it your copy)

**What you will learn**
- why the common mixture-of-experts loop stalls the GPU: it asks, for every expert, *which tokens did you get?*,
  and every such question is a device→host read (we count them, and look at them on a timeline);
- why removing those syncs alone buys little when the host is busy *launching* a loop of small kernels: count the
  launches beside the syncs ("grouped once": one sync per layer, yet slower than transformers' default);
- the fix, measured against what transformers runs by default (`grouped_mm`, no sync either): tokens grouped on
  the device feeding one grouped matmul (**sync-free**), then its glue fused into a few Triton kernels;
- why a bf16 step's gradients differ between two correct MoE kernels (routing decisions that flip at near-ties:
  counted), and the exactness where it can be shown (float32; the same routing decisions forced).

**Prerequisites.** Runs anywhere. Without a GPU it runs in *smoke mode* (a tiny GPT-OSS with the real structure:
8 experts, top-2, biases, clamped gate). With a GPU it builds layers of the real GPT-OSS-20B architecture (random
weights, 32 experts, top-4): four of them on a large GPU, one on a T4. `sync_free` needs a grouped matmul (bf16 on an
sm80+ GPU, or a CPU); elsewhere it falls back to `grouped` and says so.

**The problem.** GPT-OSS-20B has 32 experts in each of its 24 layers. transformers' `eager` experts (and most MoE
code written by hand) loop over the experts that received tokens and, for each, run `torch.where(mask)` to find
their tokens and compare the expert id on the host: syncs. transformers 5.x defaults to `grouped_mm` instead, which
pays none; what is left there is glue: a dozen kernels around the grouped matmuls.
'''),
("colab", ""),                # the shared Colab install cell (build.py)
("code", r'''
import warnings
warnings.filterwarnings("ignore", message="IProgress not found")       # tqdm without ipywidgets: before any import of tqdm
warnings.filterwarnings("ignore", category=RuntimeWarning, module="peft")
import logging
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)   # its CPU build's notice about an optional kernel package
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
Tiny sizes in smoke mode; on a GPU the largest choice that fits (`fastsft_lab/lab/nbparams.py`).
'''),
("code", r'''
from fastsft_lab.lab.nbparams import parameters

globals().update(parameters("03", PROFILE, SMOKE))   # PRESET, NUM_LAYERS, TOKENS, ..., and why
'''),
("md", r'''
## The naive path: one question per expert
This is transformers' eager `GptOssExperts.forward` (5.17), the loop the issue calls *naive*; the cell prints it
first. Look for the lines that need an answer from the GPU before Python can continue: `nonzero()`, `expert_idx ==
self.num_experts` (a tensor compared on the host), `torch.where(expert_mask[expert_idx])`, and on the GPU, indexing
a weight with a 0-d device tensor. Then we build the model (LoRA r=16 on attention; GPT-OSS attention in stock
transformers is `eager`), pack a batch, and count host syncs per decoder layer with `SyncCounter` (on a CPU too);
`routing_stats` says how many experts each layer's router used. The cell stops with an error where a count does not
hold.
'''),
("code", r'''
import inspect
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

print("\n".join(inspect.getsource(GptOssExperts.forward.__wrapped__).splitlines()[1:21]) + "\n")

from fastsft_lab.models import build_model, LoraSettings
from fastsft_lab.data import benchmark_batches
from fastsft_lab.profiling import SyncCounter
from fastsft_lab import moe
from fastsft_lab.lab.scenarios.moe import routing_stats, routing_variants, experts_microbenchmark

model = build_model(PRESET, device=DEVICE, dtype=DTYPE, num_layers=NUM_LAYERS,
                    lora=LoraSettings(rank=LORA_RANK, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
info = model.fastsft_info
print(f"{info.preset}: {info.num_layers} layers, {info.params_total/1e6:,.1f}M parameters, "
      f"experts implementation as built: {moe.experts_implementation(model)!r}")
batches = [b.to(DEVICE) for b in benchmark_batches(tokens_per_step=TOKENS, row_tokens=ROW_TOKENS, steps=STEPS,
                                                   vocab_size=model.config.vocab_size,
                                                   mix="short" if SMOKE else "realistic")]
inputs = batches[0].model_inputs()
stats = routing_stats(model, inputs)
syncs = {}
for mode in moe.MODES:
    with moe.moe_routing(model, mode), SyncCounter.for_decoder_layers(model) as counter, torch.no_grad():
        model(**inputs)
    syncs[mode] = list(counter.per_module().values())
print(f"{'layer':>5} {'experts hit':>11} {'naive':>6} {'grouped':>8} {'sync_free':>9}   host syncs per layer, one forward")
for i, hit in enumerate(stats["experts_hit"]):
    print(f"{i:5d} {hit:11d} {syncs['naive'][i]:6d} {syncs['grouped'][i]:8d} {syncs['sync_free'][i]:9d}")
hits = stats["experts_hit"]
probe = torch.empty(1, 1, dtype=DTYPE, device=DEVICE)
fallback = moe.grouped_mm_unavailable(probe, probe)     # e.g. float16 (a T4): sync_free runs as grouped, and warns
claims = {"naive: at least one host sync per hit expert in every layer": all(s >= h for s, h in zip(syncs["naive"], hits)),
          "grouped: exactly one host sync per MoE layer": syncs["grouped"] == [1] * len(hits)}
if fallback is None:
    claims["sync_free: no host sync at all"] = sum(syncs["sync_free"]) == 0
else:
    claims[f"sync_free falls back to grouped here ({fallback}): one host sync per MoE layer"] = \
        syncs["sync_free"] == [1] * len(hits)
for claim, holds in claims.items():
    print(f"{claim}: {holds}")
assert all(claims.values()), "a sync count above does not hold"
'''),
("md", r'''
### What a sync looks like on a timeline
One MoE layer's experts, profiled with `torch.profiler`: host operations in grey, host operations that wait for the
device in red, and (on a GPU) the kernels in blue. On a GPU the naive lane is a comb: the host launches a few kernels
for one expert, waits until the GPU has run them, then launches the next expert's — the GPU is idle in every gap.
On a CPU run there is no GPU lane; the red marks show where a GPU would stall.
'''),
("code", r'''
from fastsft_lab.models import decoder_layers
from fastsft_lab.profiling import host_device_timeline

mlp = decoder_layers(model)[0].mlp
x = torch.randn(TOKENS, model.config.hidden_size, device=DEVICE, dtype=DTYPE)
with torch.no_grad():
    _, w, idx = mlp.router(x)
lines = {}
for mode in moe.MODES:
    with moe.moe_routing(model, mode), torch.no_grad():
        mlp.experts(x, idx, w)  # warm-up
        lines[mode] = host_device_timeline(lambda: mlp.experts(x, idx, w), DEVICE, wait_labels=(moe.HOST_READ_LABEL,))
fig, ax = plt.subplots(figsize=(10, 3.6 if DEVICE == "cpu" else 5))
plots.plot_host_device_timeline(lines, ax=ax, title=f"layer 0 experts forward, {TOKENS} tokens, {PROFILE.name}: "
                                                     f"red = the host waits for the device")
fig.tight_layout()
display(fig); plt.close(fig)
'''),
("md", r'''
## The fix, step 1: group once
Flatten the (token, slot) expert ids, sort them (stable, so each expert's tokens stay in order), and find where each
expert's run of rows ends with a binary search on the sorted ids (`searchsorted`). Those end offsets are the
cumulative per-expert counts; expert *e*'s rows are `sorted[offsets[e-1]:offsets[e]]`. A worked example: 6 tokens,
top-2, 4 experts (expert 2 gets nothing), printed and drawn.

Why not `bincount` + `cumsum`, as the published fix does? `torch.bincount` on CUDA reads the largest id back to size
its output — a sync, even with `minlength`; `searchsorted` on the sorted ids gives the offsets directly, on the device.
'''),
("code", r'''
# NBVAL_CHECK_OUTPUT
idx_ex = torch.tensor([[0, 3], [1, 0], [3, 1], [0, 1], [3, 0], [1, 3]])      # (tokens=6, top_k=2)
sorted_ids, perm, ends = moe.group_by_expert(idx_ex, num_experts=4)
counts = torch.diff(ends, prepend=ends.new_zeros(1))
print("expert ids, flattened (token*2 + slot):", idx_ex.flatten().tolist())
print("sorted expert ids:                      ", sorted_ids.tolist())
print("perm (flat position of each sorted row):", perm.tolist())
print("token of each sorted row (perm // 2):   ", (perm // 2).tolist())
print("tokens per expert:                      ", counts.tolist())
print("end offsets (searchsorted, = cumsum):   ", ends.tolist())
fig = plots.plot_expert_grouping(idx_ex, sorted_ids, perm, ends)
display(fig); plt.close(fig)
'''),
("md", r'''
**`grouped`** brings the offsets to the host *once per layer* (`ends.tolist()`: one sync, all boundaries at once),
then launches one matmul pair per non-empty expert on contiguous slices, back to back, and combines the k outputs of
each token deterministically (inverse permutation, then one batched `(1×k)·(k×H)` matmul — no `index_add_` atomics).

Grouped once pays one sync per layer where the loop paid hundreds, but it still launches a loop of kernels per
expert. The measurements below count both.

## The fix, step 2: sync-free, against transformers' default
**`sync_free`** keeps the offsets on the device and hands them to `torch.nn.functional.grouped_mm`, which runs all
experts' matmuls in one kernel (bf16 on sm80+ GPUs; PyTorch ≥ 2.9 also has a CPU kernel). transformers' default
`grouped_mm` experts do the same grouping, with no sync either: the "before" of this fix is that default, and what
`sync_free` removes is glue around the matmuls, in two steps (the chain's two MoE steps). With its Triton kernels off
(**eager glue**):
- no expert-parallel sentinel masking (three `masked_fill` passes over (S, H)-sized tensors; we run no EP);
- the gate/up bias added by one `addmm` against a one-hot (S, E) matrix instead of gathering an (S, 2I) bias;
- the down bias folded into a tiny (T, E)·(E, H) matmul of the routing weights instead of an (S, H) gather;
- the routing weights applied inside the k-way reduction (one `bmm`) instead of multiply + gather + sum.

Then the **fused gate/combine kernels** (CUDA only): GPT-OSS's clamped gate as one Triton kernel each way (read
gate_up once, write the output once) instead of six eager kernels forward and about a dozen backward, and the k-way
combine and the token-gather backward as one kernel each.

Switching is one call on a live model, through transformers' experts registry; `None` puts back what was there:
```python
import fastsft_lab
fastsft_lab.apply(model, moe_routing="sync_free")   # or "grouped", "naive"; "off" restores the original
```

## Correct before fast
A tiny GPT-OSS and a tiny Qwen3-MoE in float32 on the CPU (on any machine, so the answer is the same everywhere):
logits and every gradient (LoRA adapters on attention and on the expert weights through PEFT, or a full fine-tune
with router gradients) of each mode against the untouched stock `eager` experts. "Equal" means bit-identical for
`naive` and within 5e-5 (relative) for the others; the cell stops with an error where one is not. The test suite
(`tests/test_moe.py`) adds hypothesis-random shapes and routings, zero-token experts and top-k up to all experts.
'''),
("code", r'''
def outputs_and_grads(m, ids):
    m.zero_grad(set_to_none=True)
    out = m(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.requires_grad}

def max_rel_diff(a, b):
    return ((a - b).abs().max() / (1 + b.abs().max())).item()

checks, diffs = {}, {}
for preset, lora in [("tiny-gpt-oss", LoraSettings(rank=4, target_modules=["q_proj", "v_proj"], lora_experts=True)),
                     ("tiny-gpt-oss", None), ("tiny-qwen3-moe", None)]:
    m = build_model(preset, device="cpu", dtype=torch.float32, lora=lora, seed=1)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n or "bias" in n:
                p.normal_(0, 0.05)
    ids = torch.randint(4, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with moe.moe_routing(m, "eager"):
        ref_logits, ref_grads = outputs_and_grads(m, ids)
    label = f"{preset} {'LoRA attn+experts' if lora else 'full fine-tune'}"
    for mode in moe.MODES:
        with moe.moe_routing(m, mode):
            logits, grads = outputs_and_grads(m, ids)
        d = max([max_rel_diff(logits, ref_logits)] + [max_rel_diff(grads[n], ref_grads[n]) for n in ref_grads])
        diffs[(label, mode)] = d
        checks[(label, mode)] = d < 5e-5 if mode != "naive" else (torch.equal(logits, ref_logits)
                                                                and all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads))
for (label, mode), d in diffs.items():
    print(f"{label:32s} {mode:9s} max relative diff vs stock eager (logits and all grads): {d:.1e}  "
          f"equal: {checks[(label, mode)]}")
assert all(checks.values()), f"not equal to stock eager: {[k for k, ok in checks.items() if not ok]}"
'''),
("md", r'''
`naive` is bit-identical (it *is* the stock loop, registered under our name so both can be measured); `grouped` and
`sync_free` agree to float32 rounding (sums in another order).

### In bf16: routing decisions that flip at near-ties
On a GPU the step runs in bf16, and there two correct kernels differ by a rounding (~1e-2 of a value, not ~1e-7).
Where a token's k-th and (k+1)-th router logits are that close (random router weights make many near-ties), the
next layer's top-k picks another expert for it, and that token's output changes by O(1): the attribution chain's
`vs ref` for the MoE steps reads 1e-1 or more. `fastsft_lab.lab.routing.routing_agreement` measures it on one step:
transformers' default against `sync_free`, the tokens routed to other experts counted per layer, the difference as
run and with the default's routing decisions forced into the `sync_free` step (its router's own weights recomputed at
the forced experts, so gradients still flow). On the tiny model, in float32 and under bf16 autocast:
'''),
("code", r'''
from fastsft_lab.lab.harness import Variant, with_autocast
from fastsft_lab.lab.routing import routing_agreement, agreement_text

def routing_variant(mode):
    return Variant(f"moe_routing={mode}", enable=lambda m: moe.set_moe_routing(m, mode),
                   disable=lambda m: moe.set_moe_routing(m, None))

tiny = build_model("tiny-gpt-oss", device="cpu", dtype=torch.float32, seed=0,
                   lora=LoraSettings(rank=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
tiny_batch = benchmark_batches(tokens_per_step=512, row_tokens=256, steps=1, vocab_size=tiny.config.vocab_size,
                               mix="short")[0]
for autocast in ("none", "bf16"):
    pair = with_autocast([routing_variant("off"), routing_variant("sync_free")], autocast)   # off: the default
    print(f"autocast {autocast}: " + agreement_text(routing_agreement(tiny.train(), tiny_batch, *pair)) + "\n")
'''),
("md", r'''
With the routing decisions forced, what is left is the kernels' rounding (the last line of each); in float32 nothing
flips and the two agree to float32 rounding. The committed GPT-OSS-20B chain below carries the same check where its
run made it.

## The fix measured: syncs *and* launches per layer
One MoE layer's experts alone, per implementation, on the same input and routing (`experts_microbenchmark`): the
chain from transformers' default, and beside it the loop and grouped once, each with its host syncs and its kernel
launches (forward / forward + backward; on a CPU the aten ops that would each launch a kernel). Launches hardly
depend on the width, so tiny models with GPT-OSS-20B's and Qwen3-30B-A3B's expert counts show the real counts on any
machine. The last lines of each table compare loop → grouped once (the syncs go, a loop of launches per expert
stays) and grouped once → sync-free (the loop goes): where the host is busy launching, a sync costs it little.
'''),
("code", r'''
from fastsft_lab.lab.harness import make_result
from fastsft_lab.lab.report import experts_layer_text

real_counts = {"tiny-gpt-oss": {"num_local_experts": 32, "num_experts_per_tok": 4},      # GPT-OSS-20B's
               "tiny-qwen3-moe": {"num_experts": 128, "num_experts_per_tok": 8}}         # Qwen3-30B-A3B's
for preset, counts in real_counts.items():
    m = build_model(preset, device=DEVICE, dtype=DTYPE, num_layers=1, seed=0, config_overrides=counts)
    rows = experts_microbenchmark(m, tokens=2048, reps=3)
    e = moe.experts_modules(m)[0]
    layer = make_result("moe-experts-layer", {"model": preset, "tokens_per_step": 2048,
                                              "num_experts": e.num_experts, "top_k": m.config.num_experts_per_tok},
                        rows, DEVICE)
    print(experts_layer_text(layer) + "\n")
    del m
fig = plots.plot_result(layer, phases=("forward", "step"), limit="expert matmuls alone",
                        title=f"measured here: {preset}, 128 experts top-8, 2048 tokens, {PROFILE.name}")
display(fig); plt.close(fig)
'''),
("md", r'''
### On the GPU (committed results)
The whole-model steps are the attribution chain's (`bench --only attribution`): the same committed GPT-OSS-20B chain
notebook 00 and the README show, here its MoE steps, each over the step before (a run before the chain took two MoE
steps shows them as one), with what fell where the run profiled its steps: idle and latency-bound kernels (a
launch-bound host) or the kernels' own compute and memory time. Then one layer's experts at real width from the newest committed `bench --only moe`, and
where sync-free's GPU time goes (`benchmarks/experts_profile.py`, with every fused kernel on and off, against the
two grouped matmuls alone); every other configuration is in [docs/results.md](../docs/results.md).
'''),
("code", r'''
from fastsft_lab.lab import report

chain = results.attribution_for("gpt-oss-20b", "none")
moe_steps = ["+ metadata cached", "+ sync-free routing, eager glue", "+ fused gate/combine kernels",
             "+ sync-free experts"]
print(report.attribution_text(chain, only=moe_steps) if chain else "No committed attribution chain of GPT-OSS-20B.")
layers = [d for d in results.load_results("moe-experts-layer", newest_run=True) if d["config"]["tokens_per_step"] == 8192]
print("\n" + ("\n\n".join(report.experts_layer_text(d) for d in layers) or "No committed GPU run of the experts."))
gpt_layer = next((d for d in layers if d["config"]["model"] == "gpt-oss-20b"), None)
if gpt_layer is not None:
    fig = plots.plot_result(gpt_layer, phases=("forward", "step"), limit="expert matmuls alone",
                            title=f"one MoE layer's experts: gpt-oss-20b, 8192 tokens | {results.describe_run(gpt_layer)}")
    display(fig); plt.close(fig)
prof = results.experts_profile()
print("\n" + report.experts_profile_text(prof, top=6))
if prof is not None:
    fig = plots.plot_experts_profile(prof)
    display(fig); plt.close(fig)
'''),
("md", r'''
The glue is memory-bound, so its floor is the bytes it has to move (`fastsft_lab.lab.flops.moe_glue_bytes`: each
glue tensor read or written once, 4TH + 5RH + 8RI elements for T tokens, R = T·k routed rows, hidden H, expert
intermediate I) at the GPU's HBM bandwidth: the profile above prints it beside the measured glue, and the
grouped-matmul kernels plus that floor, the best a glue made of separate kernels can do. Going below it takes a
grouped GEMM that gathers its rows in its prologue and combines them in its epilogue (ScatterMoE, MegaBlocks).
'''),
("md", r'''
## What it costs
- **`grouped`**: one host read per MoE layer (the offsets), one `torch.cat` of the per-expert outputs, and a loop of
  Python launches per expert — cheap next to a sync, but it grows with the number of experts (Qwen3-30B-A3B has 128).
- **`sync_free`**: needs a grouped matmul: bf16 on an sm80+ GPU, or PyTorch ≥ 2.9 on a CPU; elsewhere it falls back to
  `grouped` and warns. It does not handle expert-parallel sentinel ids (we run no expert parallelism).
- **NF4 experts** (`moe.quantize_experts_nf4`, for a QLoRA memory budget): GPT-OSS's experts are 3-D parameters, so
  bitsandbytes' `Linear4bit` does not apply; the store keeps 4-bit codes plus one fp32 absmax per 64 weights (not
  double-quantized, so one expert is a contiguous slice). `naive`/`grouped` dequantize only the experts that were hit;
  `sync_free` dequantizes the whole layer once per forward (and again in backward — never keeping a bf16 copy for
  autograd). LoRA on NF4 expert weights is refused (`NotImplementedError`): PEFT's `target_parameters` needs an
  `nn.Parameter` to parametrize; LoRA on attention works.
'''),
("code", r'''
import math
from fastsft_lab.profiling import time_ms

# one layer at this notebook's width (tiny in smoke mode, GPT-OSS-20B's on a GPU)
m = build_model(PRESET, device=DEVICE, dtype=DTYPE, num_layers=None if SMOKE else 1,
                lora=LoraSettings(rank=4, target_modules=["q_proj", "v_proj"]))
moe.quantize_experts_nf4(m)
sizes = moe.nf4_expert_bytes(m)
mib = lambda n: f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"
print(f"expert weights: {mib(sizes['nf4_bytes'])} in NF4 vs {mib(sizes['bf16_bytes'])} in bf16 "
      f"({sizes['nf4_bytes']/sizes['bf16_bytes']:.0%})")
experts0 = moe.experts_modules(m)[0]
dev = torch.device(DEVICE)
t_all = time_ms(lambda: moe.dequantize_expert_weight(experts0, "gate_up_proj"), dev, 2, 10)["median"]
t_one = time_ms(lambda: moe.dequantize_expert_weight(experts0, "gate_up_proj", 0), dev, 2, 10)["median"]
E = experts0.num_experts
print(f"dequantize gate_up_proj of one layer: all {E} experts in one call {t_all:.3f} ms, one expert {t_one:.3f} ms")
# k hit experts one by one cost k * t_one: cheaper than the whole layer while k * t_one < t_all
k_max = min(E, math.ceil(t_all / t_one) - 1)
if k_max >= 1:
    print(f"break-even: dequantizing the hit experts one by one is cheaper while at most {k_max} of {E} experts "
          f"{'is' if k_max == 1 else 'are'} hit (a training batch hits them all; a short decode step may not)")
else:
    print(f"break-even: none here: one expert alone takes as long as all {E} in one call (a fixed cost per call "
          f"dominates at this size), so dequantizing the whole layer at once is never slower")
'''),
("md", r'''
## Summary and next bottleneck
- The per-expert loop pays at least one host sync per hit expert per layer (here ≥ 2: the id check and the
  `torch.where`), and launches a handful of kernels per expert.
- Grouped once removes the syncs but keeps the loop of launches: where the host is launch-bound, that buys little
  (compare the loop → grouped once lines above). Fewer launches is what pays: one grouped matmul on device offsets.
- The "before" of the fix is transformers' default `grouped_mm`, which pays no sync either: against it `sync_free`
  removes glue kernels, then fuses what is left (the chain's two MoE steps, per layer and per step).
- Outputs and gradients equal transformers' eager experts (bit-identical for `naive`, float32 rounding for the
  others), for GPT-OSS and Qwen3-MoE; in bf16 the differences come from routing decisions that flip at near-ties,
  and with the same decisions forced only the rounding is left.

**Next bottleneck.** With the syncs gone and the glue fused, one layer's experts run close to the grouped matmuls
alone; what remains is memory-bound glue, whose floor is set by the bytes it moves. Going lower takes a grouped GEMM
that gathers and combines in its prologue and epilogue. In the whole step the experts are one part among attention,
the dense projections and the loss: notebook 04 puts the three fixes together and shows what each is worth there.

**Further reading**
- transformers' experts registry and its `grouped_mm` path: `transformers/integrations/moe.py`
- PyTorch `torch.nn.functional.grouped_mm` (jagged grouped GEMM for MoE)
- MegaBlocks (Gale et al., 2022): block-sparse MoE without token dropping
- Notebook 00 (the naive path, profiled) and the library: `fastsft_lab/moe/` (its docstring maps the files),
  tests in `tests/test_moe.py`
'''),
("code", r'''
print(f"notebook ran in {time.time() - T0:.0f} s on: {describe()}")
if DEVICE == "cuda":
    print(f"peak GPU memory over the notebook: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
else:
    print("peak memory: not tracked on a CPU (it is a CUDA allocator statistic)")
'''),
]
