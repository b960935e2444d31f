FILENAME = "03_moe_routing.ipynb"

# where the committed outputs come from (appended to the first cell by build.py)
OUTPUTS = """**The outputs below** come from one run on an NVIDIA H200 (`SMOKE=0`, torch 2.11, transformers 5.17, 2026-12-05;
run `benchmarks/results/h200-2026-12-05b`, whose README has the log). CI re-runs every cell in smoke mode on a CPU
(nbval, lax: the outputs are not compared)."""

CELLS = [
("md", r'''
# 03 — MoE routing for GPT-OSS: group once, then never ask the host

[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fastsft-lab/fastsft_lab/blob/main/notebooks/03_moe_routing.ipynb)

**What you will learn**
- why the common mixture-of-experts loop stalls the GPU: it asks, for every expert, *which tokens did you get?*,
  and every such question is a device→host read (we count them, and look at them on a timeline);
- the fix in two steps: **grouped** (sort the (token, expert) pairs once, bring the per-expert offsets to the host
  once per layer) and **sync-free** (keep the offsets on the device and let one grouped matmul do all experts);
- how to prove the new paths change no numbers (outputs and gradients against transformers' own eager experts),
  and what they cost (one host read per layer; `grouped_mm` needs bf16 on an sm80+ GPU; NF4 experts).

**Prerequisites.** Runs anywhere. Without a GPU it runs in *smoke mode* (a tiny GPT-OSS with the real structure:
8 experts, top-2, biases, clamped gate), in well under two minutes. With a GPU it builds layers of the real
GPT-OSS-20B architecture (random weights, 32 experts, top-4): four of them on a large GPU, one on a small one such
as Colab's T4 (the parameters cell says which, and prints the peak memory the committed H200 run of the larger
configuration measured). Switch with `SMOKE=1`/`SMOKE=0`. `sync_free` needs a grouped matmul (bf16 on an sm80+
GPU); on an older GPU it falls back to `grouped` and says so.

**The problem.** GPT-OSS-20B has 32 experts in each of its 24 layers. transformers' `eager` experts (and most MoE
code written by hand) loop over the experts that received tokens and, for each, run `torch.where(mask)` to find
their tokens and compare the expert id on the host. Each of those is a sync: the CPU stops issuing kernels until the
GPU has finished everything queued, the queue drains, and the GPU idles while Python decides what to launch next.
The committed H200 results at the end of this notebook put numbers on it: host syncs and time per step for each
mode, at GPT-OSS-20B width.
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
Everything below is derived from these. The cell also prints what each GPU choice needs: the peak the committed H200
run of the larger one measured, the weights and logits of the smaller one.
'''),
("code", r'''
# GiB each GPU choice needs: the committed H200 peak of the 4-layer training step (next cell) plus headroom; the
# 1-layer choice was not run on the H200 (next cell: its weights, counted, and the logits it adds).
CHOICES = {"4 layers, 8192 tokens": dict(layers=4, tokens=8192, row=2048, gib=56),    # 4 of 24 layers, real width
           "1 layer, 2048 tokens": dict(layers=1, tokens=2048, row=1024, gib=14)}     # fits a 16 GB T4
DEVICE, DTYPE = PROFILE.device, PROFILE.dtype   # bf16 from sm80 on, fp16 on a T4, float32 on a CPU
CHOICE = PROFILE.pick({name: c["gib"] for name, c in CHOICES.items()}) if not SMOKE else None
if not SMOKE and CHOICE is None:
    print(f"{PROFILE.name}: {PROFILE.memory_gib:.0f} GiB is less than the smallest choice needs: smoke sizes instead")
    SMOKE = True
if SMOKE:
    PRESET, NUM_LAYERS, TOKENS, ROW_TOKENS, STEPS = "tiny-gpt-oss", None, 256, 128, 3
    MICRO_TOKENS, MICRO_REPS = 256, 3
    why = "smoke mode: a tiny GPT-OSS with the real structure"
else:
    c = CHOICES[CHOICE]
    PRESET, NUM_LAYERS, TOKENS, ROW_TOKENS, STEPS = "gpt-oss-20b", c["layers"], c["tokens"], c["row"], 6
    MICRO_TOKENS, MICRO_REPS = c["tokens"], 10
    why = f"GPT-OSS-20B, {CHOICE}: the largest choice whose need ({c['gib']} GiB) fits in {PROFILE.memory_gib:.0f} GiB"
LORA_RANK = 16
if DEVICE == "cpu":
    torch.set_num_threads(1)  # tiny models: threads only add noise on a small shared CPU
print(PROFILE.describe())
print(why)
print(dict(PRESET=PRESET, NUM_LAYERS=NUM_LAYERS, TOKENS=TOKENS, ROW_TOKENS=ROW_TOKENS, DEVICE=DEVICE, DTYPE=str(DTYPE)))
# what the GPU choices need: the committed H200 peaks of the 4-layer configuration, and the 1-layer one's sizes
from fastsft_lab.models import count_parameters
for mode in ("train", "forward"):
    peak, doc = results.newest_peak_gib("moe-routing", model="gpt-oss-20b", num_layers=4, tokens_per_step=8192, mode=mode)
    print(f"gpt-oss-20b, 4 layers, 8192 tokens, {mode:7s} step: "
          + (f"{peak:5.1f} GiB peak on the H200  [{results.describe_run(doc)}]" if doc else "not committed"))
weights = count_parameters("gpt-oss-20b", num_layers=1) * 2 / 2**30          # bf16/fp16, counted on the meta device
logits = 2048 * 201088 * (2 + 4 + 4) / 2**30                                  # logits, their fp32 upcast and its grad
print(f"gpt-oss-20b, 1 layer, 2048 tokens: weights {weights:.1f} GiB + logits {logits:.1f} GiB (+ activations); "
      f"needs {CHOICES['1 layer, 2048 tokens']['gib']} GiB here")
'''),
("md", r'''
## The naive path: one question per expert
This is transformers' eager `GptOssExperts.forward` (5.17), the loop the issue calls *naive*. Look for the lines
that need an answer from the GPU before Python can continue: `nonzero()` (how many experts were hit?), `expert_idx
== self.num_experts` (a tensor compared on the host), `torch.where(expert_mask[expert_idx])` (how many tokens, and
which?) — and, on the GPU, indexing a weight with a 0-d device tensor.
'''),
("code", r'''
import inspect
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

src = inspect.getsource(GptOssExperts.forward.__wrapped__).splitlines()
print("\n".join(src[1:21]))
'''),
("md", r'''
We build the model (LoRA r=16 on the attention projections; GPT-OSS attention in stock transformers is `eager`),
pack a batch, and count host syncs per decoder layer with `SyncCounter` — it counts the operations that would sync
on a GPU, on a CPU too. `routing_stats` tells how many experts each layer's router actually used. The cell then
checks what the table shows, and stops with an error where a count does not hold.
'''),
("code", r'''
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

## The fix, step 2: sync-free
**`sync_free`** keeps the offsets on the device and hands them to `torch.nn.functional.grouped_mm`, which runs all
experts' matmuls in one kernel (bf16 on sm80+ GPUs; PyTorch ≥ 2.9 also has a CPU kernel). transformers' own
`grouped_mm` experts do the same grouping; `sync_free` trims the glue around the matmuls:
- no expert-parallel sentinel masking (three `masked_fill` passes over (S, H)-sized tensors; we run no EP);
- the gate/up bias added by one `addmm` against a one-hot (S, E) matrix instead of gathering an (S, 2I) bias;
- the down bias folded into a tiny (T, E)·(E, H) matmul of the routing weights instead of an (S, H) gather;
- the routing weights applied inside the k-way reduction (one `bmm`) instead of multiply + gather + sum;
- GPT-OSS's clamped gate as one fused Triton kernel each way on a GPU (read gate_up once, write the output once,
  save only gate_up for backward) instead of six eager kernels forward and about a dozen backward.

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

## The fix measured
Live, on this machine: whole-model steps — a no-grad forward (a validation step) and a full training step (forward,
backward, AdamW on the LoRA adapters) — for the three modes and transformers' two stock paths, interleaved step by
step. Then one layer's experts alone, with the *expert matmuls alone* (two grouped matmuls on pre-sorted rows, no
routing at all) as the zero-overhead limit. On a CPU the numbers say little about a GPU (there is no launch queue to
drain); the sync counts are the same.
'''),
("code", r'''
from fastsft_lab.lab.harness import run_variants, make_result, format_table

variants = routing_variants("gpt_oss")
live = {}
for mode in ("forward", "train"):
    rows = run_variants(model, batches, variants, steps=STEPS - 1, warmup=1, mode=mode, progress=False)
    live[mode] = make_result("moe-routing", {"model": PRESET, "num_layers": info.num_layers, "tokens_per_step": TOKENS,
                                             "mode": mode, "routing": stats}, rows, DEVICE)
    print(f"--- {mode} ({TOKENS} tokens per step)\n" + format_table(live[mode]) + "\n")
    fig = plots.plot_result(live[mode], phases=("forward",) if mode == "forward" else ("forward", "step"),
                            title=f"measured here: {PRESET} x{info.num_layers} layers, {mode} step, {TOKENS} tokens, "
                                  f"{PROFILE.name}")
    display(fig); plt.close(fig)
micro = experts_microbenchmark(model, tokens=MICRO_TOKENS, reps=MICRO_REPS)
micro_res = make_result("moe-experts-layer", {"model": PRESET, "tokens_per_step": MICRO_TOKENS}, micro, DEVICE)
print(format_table(micro_res))
fig = plots.plot_result(micro_res, phases=("forward", "step"), limit="expert matmuls alone",
                        title=f"measured here: one MoE layer's experts, {MICRO_TOKENS} tokens, {PROFILE.name} "
                              f"(step = forward + backward)")
display(fig); plt.close(fig)
'''),
("md", r'''
### On the H200 (committed results)
`python -m fastsft_lab bench --only moe` on a GPU writes one JSON and one chart per configuration; the committed
ones are read here through `fastsft_lab.lab.results` (a clone's `benchmarks/results/`, or the copy packaged with
the library): every configuration of the newest run as a table, then the 8192-token ones as charts. Each variant is
given against two baselines. **vs naive** is against the eager per-expert loop: the syncs *and* the launches it
pays. **vs default** is against transformers' `grouped_mm`, what transformers 5.x runs unless told otherwise; it
pays no sync either, so what `sync_free` gains over it is fewer kernels around the same grouped matmuls, not syncs.

**Closer to the limit: the glue around the grouped matmuls.** With the syncs gone, what is left between sync_free
and the two grouped matmuls is glue: gathering tokens into expert order and back, the gate, the bias, the k-way
combine. On CUDA that glue is a few fused Triton kernels (`fastsft_lab/moe/kernels.py`, `gate.py`; the eager
expressions they replace sit beside them and run on a CPU). `benchmarks/experts_profile.py` times one layer's
experts with them on and off against the matmuls alone, and profiles where the rest goes. It is a later run than
the routing tables (each caption names its run): the gate kernels changed in between, so the experts-alone
`sync_free` of the routing run sits further above the matmuls alone than the profile's.
'''),
("code", r'''
from fastsft_lab.lab import report

gpu_results = results.load_results(["moe-routing", "moe-experts-layer"], newest_run=True)
print(report.moe_runs_text(gpu_results))
for r in (r for r in gpu_results if r["config"].get("tokens_per_step") == 8192):
    c = r["config"]
    fig = plots.plot_result(r, phases=("forward",) if c.get("mode") == "forward" else ("forward", "step"),
                            limit="expert matmuls alone" if r["scenario"] == "moe-experts-layer" else None,
                            title=f"H200: {r['scenario']} | {c.get('model')} | {c.get('tokens_per_step')} tokens | "
                                  f"{c.get('mode', 'experts alone')} | {results.describe_run(r)}")
    display(fig); plt.close(fig)
prof = results.experts_profile()
print("\n" + report.experts_profile_text(prof))
if prof is not None:
    fig = plots.plot_experts_profile(prof)
    display(fig); plt.close(fig)
'''),
("md", r'''
The glue is memory-bound, so its floor is the bytes it has to move (`fastsft_lab.lab.flops.moe_glue_bytes`: each
glue tensor read or written once, 4TH + 5RH + 8RI elements for T tokens, R = T·k routed rows, hidden H, expert
intermediate I) at the GPU's HBM bandwidth. Added to the grouped-matmul kernels, that floor is the best a glue
made of separate kernels can do. On the H200 it is 11% over the grouped-matmul kernels for GPT-OSS-20B and 20–24%
for Qwen3-30B-A3B, whose 8 of 128 small experts move more bytes per FLOP. Going below it takes a grouped GEMM that gathers its rows in
its prologue and combines them in its epilogue (ScatterMoE, MegaBlocks).
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
  `torch.where`); the GPU idles in every one.
- One stable sort + `searchsorted` groups the tokens by expert with no sync; `grouped` then needs exactly one host
  read per layer, `sync_free` none (grouped matmul on device offsets).
- Outputs and gradients equal transformers' eager experts (bit-identical for `naive`, float32 rounding for the others),
  for GPT-OSS and Qwen3-MoE, with LoRA on attention and on the expert weights, and with NF4 experts.
- Against transformers' default `grouped_mm`, which pays no sync either, the gain left is fewer kernel launches
  around the grouped matmuls (the "vs default" column), smaller than against the naive loop.

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
