FILENAME = "03_moe_routing.ipynb"

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
8 experts, top-2, biases, clamped gate), in well under two minutes. With a GPU it builds 4 layers of the real
GPT-OSS-20B architecture (random bf16 weights, 32 experts, top-4). Switch with `SMOKE=1`/`SMOKE=0`.

**The problem.** GPT-OSS-20B has 32 experts in each of its 24 layers. transformers' `eager` experts (and most MoE
code written by hand) loop over the experts that received tokens and, for each, run `torch.where(mask)` to find
their tokens and compare the expert id on the host. Each of those is a sync: the CPU stops issuing kernels until the
GPU has finished everything queued, the queue drains, and the GPU idles while Python decides what to launch next.
Measured on an H200 (transformers 5.17, 4×2048 tokens, no-grad forward of all 24 layers): over 5,000 host syncs,
1040 ms; transformers' own `grouped_mm` experts: 14 syncs, 741 ms.
'''),
("colab", ""),                # the shared Colab install cell (build.py)
("code", r'''
import time
import warnings
import torch
from fastsft_lab.env import describe, smoke_mode, has_cuda

SMOKE = smoke_mode()          # SMOKE=1/0 in the environment overrides; default: on without a GPU
T0 = time.time()
warnings.filterwarnings("ignore", category=RuntimeWarning, module="peft")
print(describe())
'''),
("md", r'''
## Parameters
Everything below is derived from these.
'''),
("code", r'''
if SMOKE:
    PRESET, NUM_LAYERS, TOKENS, ROW_TOKENS, STEPS = "tiny-gpt-oss", None, 256, 128, 3
    MICRO_TOKENS, MICRO_REPS = 256, 3
else:
    PRESET, NUM_LAYERS, TOKENS, ROW_TOKENS, STEPS = "gpt-oss-20b", 4, 8192, 2048, 6   # 4 of 24 layers, real width
    MICRO_TOKENS, MICRO_REPS = 8192, 10
DEVICE = "cuda" if has_cuda() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
LORA_RANK = 16
if DEVICE == "cpu":
    torch.set_num_threads(1)  # tiny models: threads only add noise on a small shared CPU
print(dict(PRESET=PRESET, NUM_LAYERS=NUM_LAYERS, TOKENS=TOKENS, ROW_TOKENS=ROW_TOKENS, DEVICE=DEVICE, DTYPE=DTYPE))
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
on a GPU, on a CPU too. `routing_stats` tells how many experts each layer's router actually used.
'''),
("code", r'''
from fastsft_lab.models import build_model, LoraSettings
from fastsft_lab.data import benchmark_batches
from fastsft_lab.profiling import SyncCounter
from fastsft_lab import moe

model = build_model(PRESET, device=DEVICE, dtype=DTYPE, num_layers=NUM_LAYERS,
                    lora=LoraSettings(rank=LORA_RANK, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
info = model.fastsft_info
print(f"{info.preset}: {info.num_layers} layers, {info.params_total/1e6:,.1f}M parameters, "
      f"experts implementation as built: {moe.experts_implementation(model)!r}")
batches = [b.to(DEVICE) for b in benchmark_batches(tokens_per_step=TOKENS, row_tokens=ROW_TOKENS, steps=STEPS,
                                                   vocab_size=model.config.vocab_size,
                                                   mix="short" if SMOKE else "realistic")]
inputs = batches[0].model_inputs()
stats = moe.routing_stats(model, inputs)
syncs = {}
for mode in moe.MODES:
    with moe.moe_routing(model, mode), SyncCounter.for_decoder_layers(model) as counter, torch.no_grad():
        model(**inputs)
    syncs[mode] = list(counter.per_module().values())
print(f"{'layer':>5} {'experts hit':>11} {'naive':>6} {'grouped':>8} {'sync_free':>9}   host syncs per layer, one forward")
for i, hit in enumerate(stats["experts_hit"]):
    print(f"{i:5d} {hit:11d} {syncs['naive'][i]:6d} {syncs['grouped'][i]:8d} {syncs['sync_free'][i]:9d}")
'''),
("code", r'''
# NBVAL_CHECK_OUTPUT
hits = stats["experts_hit"]
print("naive: at least one host sync per hit expert in every layer:", all(s >= h for s, h in zip(syncs["naive"], hits)))
print("grouped: exactly one host sync per MoE layer:", syncs["grouped"] == [1] * len(hits))
print("sync_free: no host sync at all:", sum(syncs["sync_free"]) == 0)
'''),
("md", r'''
### What a sync looks like on a timeline
One MoE layer's experts, profiled with `torch.profiler`: host operations in grey, host operations that wait for the
device in red, and (on a GPU) the kernels in blue. On a GPU the naive lane is a comb: the host launches a few kernels
for one expert, waits until the GPU has run them, then launches the next expert's — the GPU is idle in every gap.
On a CPU run there is no GPU lane; the red marks show where a GPU would stall.
'''),
("code", r'''
import matplotlib.pyplot as plt
from fastsft_lab.models import decoder_layers

mlp = decoder_layers(model)[0].mlp
x = torch.randn(TOKENS, model.config.hidden_size, device=DEVICE, dtype=DTYPE)
with torch.no_grad():
    _, w, idx = mlp.router(x)
lines = {}
for mode in moe.MODES:
    with moe.moe_routing(model, mode), torch.no_grad():
        mlp.experts(x, idx, w)  # warm-up
        lines[mode] = moe.timeline(lambda: mlp.experts(x, idx, w), DEVICE)
fig, ax = plt.subplots(figsize=(10, 3.6 if DEVICE == "cpu" else 5))
moe.plot_timeline(lines, ax=ax, title=f"layer 0 experts forward, {TOKENS} tokens, {DEVICE}: red = host waits")
plt.tight_layout(); plt.show()
'''),
("md", r'''
## The fix, step 1: group once
Flatten the (token, slot) expert ids, sort them (stable, so each expert's tokens stay in order), and find where each
expert's run of rows ends with a binary search on the sorted ids (`searchsorted`). Those end offsets are the
cumulative per-expert counts; expert *e*'s rows are `sorted[offsets[e-1]:offsets[e]]`. A worked example: 6 tokens,
top-2, 4 experts (expert 2 gets nothing).

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
'''),
("code", r'''
colors = plt.cm.tab10.colors
fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw={"width_ratios": [1, 2.2]})
for t in range(idx_ex.shape[0]):
    for j in range(idx_ex.shape[1]):
        e = int(idx_ex[t, j])
        a.add_patch(plt.Rectangle((j, 5 - t), 0.95, 0.95, color=colors[e]))
        a.text(j + 0.47, 5 - t + 0.47, f"E{e}", ha="center", va="center", color="white", fontsize=9)
a.set_xlim(0, 2); a.set_ylim(0, 6); a.set_xticks([0.5, 1.5]); a.set_xticklabels(["slot 0", "slot 1"])
a.set_yticks([5.5 - t for t in range(6)]); a.set_yticklabels([f"token {t}" for t in range(6)])
a.set_title("router output: top-2 experts per token", fontsize=9)
for r, (e, p) in enumerate(zip(sorted_ids.tolist(), perm.tolist())):
    b.add_patch(plt.Rectangle((r, 0), 0.95, 1, color=colors[e]))
    b.text(r + 0.47, 0.5, f"t{p // 2}", ha="center", va="center", color="white", fontsize=9)
ends_list = ends.tolist()
for e, end in enumerate(ends_list):
    b.axvline(end - 0.025, color="black", lw=1.2)
    level = ends_list[:e].count(end)  # an empty expert shares its end with the previous one: stack the labels
    b.text(end - 0.05, 1.06 + 0.12 * level, f"offs[{e}]={end}" + (f" (E{e} empty)" if level else ""), ha="right", fontsize=8)
b.set_xlim(-0.2, len(perm) + 0.2); b.set_ylim(0, 1.42); b.set_yticks([])
b.set_xlabel("sorted rows: each expert's tokens are one contiguous slice (expert 2: empty)")
b.set_title("after one sort: tokens grouped by expert", fontsize=9)
plt.tight_layout(); plt.show()
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
from fastsft_lab.moe import set_moe_routing
set_moe_routing(model, "sync_free")   # or "grouped", "naive"; None / "off" restores the original
```

## Correct before fast
A tiny GPT-OSS and a tiny Qwen3-MoE in float32 on the CPU (on any machine, so the answer is the same everywhere):
logits and every gradient (LoRA adapters on attention and on the expert weights through PEFT, or a full fine-tune
with router gradients) of each mode against the untouched stock `eager` experts. The test suite
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
    print(f"{label:32s} {mode:9s} max relative diff vs stock eager (logits and all grads): {d:.1e}")
'''),
("code", r'''
# NBVAL_CHECK_OUTPUT
for (label, mode), ok in checks.items():
    print(f"{label:32s} {mode:9s} equal to stock eager: {ok}")
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
from fastsft_lab.bench import run_variants, make_result, format_table, plot_result
import os, tempfile

variants = moe.routing_variants("gpt_oss")
live = {}
for mode in ("forward", "train"):
    rows = run_variants(model, batches, variants, steps=STEPS - 1, warmup=1, mode=mode, progress=False)
    live[mode] = make_result("moe-routing", {"model": PRESET, "num_layers": info.num_layers, "tokens_per_step": TOKENS,
                                             "mode": mode, "routing": stats}, rows, DEVICE)
    print(f"--- {mode} ({TOKENS} tokens per step)\n" + format_table(live[mode]) + "\n")
'''),
("code", r'''
from IPython.display import Image, display

tmp = tempfile.mkdtemp()
for mode, res in live.items():
    path = plot_result(res, os.path.join(tmp, f"{mode}.png"), phases=("forward",) if mode == "forward" else ("forward", "step"))
    display(Image(path))
micro = moe.experts_microbenchmark(model, tokens=MICRO_TOKENS, reps=MICRO_REPS)
micro_res = make_result("moe-experts-layer", {"model": PRESET, "tokens_per_step": MICRO_TOKENS}, micro, DEVICE)
print(format_table(micro_res))
display(Image(plot_result(micro_res, os.path.join(tmp, "micro.png"), phases=("forward", "step"),
                          title=f"one MoE layer's experts, {MICRO_TOKENS} tokens, {DEVICE} (step = forward + backward)")))
'''),
("md", r'''
### On the H200
`python -m fastsft_lab bench --only moe` on a GPU writes one JSON and one chart per configuration into its output
folder; the committed ones live in `benchmarks/results/`. This cell shows those that exist (it never invents numbers).
'''),
("code", r'''
import glob, json

found = sorted({p for d in ("benchmarks/results", "../benchmarks/results") for p in glob.glob(f"{d}/moe_*.json")})
gpu_results = [json.load(open(p)) for p in found]
gpu_results = [r for r in gpu_results if r.get("env", {}).get("device") == "cuda"]
if not gpu_results:
    print("No GPU results for this scenario in benchmarks/results/ yet. Run on a GPU:\n"
          "  python -m fastsft_lab bench --only moe --out benchmarks/results")
for r in gpu_results:
    c = r["config"]
    rows = [v for v in r["variants"] if "step_ms" in v]
    base = rows[0]["step_ms"]["median"] if rows else None
    print(f"\n{r['scenario']}: {c.get('model')} L={c.get('num_layers', c.get('model_num_layers'))} "
          f"{c.get('tokens_per_step')} tokens {c.get('mode', 'experts alone')} | {r['env'].get('gpu_name')}")
    for v in r["variants"]:
        if "step_ms" in v:
            print(f"   {v['name']:26s} {v['step_ms']['median']:9.2f} ms  {base / v['step_ms']['median']:5.2f}x   "
                  f"syncs {v.get('host_syncs_per_step', '-')}")
        else:
            print(f"   {v['name']:26s} {v.get('error', '-')}")
for r in gpu_results[:6]:
    display(Image(plot_result(r, os.path.join(tmp, f"gpu_{id(r)}.png"),
                              phases=("forward",) if r["config"].get("mode") == "forward" else ("forward", "step"))))
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
m = build_model("tiny-gpt-oss", device=DEVICE, dtype=DTYPE, lora=LoraSettings(rank=4, target_modules=["q_proj", "v_proj"]))
moe.quantize_experts_nf4(m)
sizes = moe.nf4_expert_bytes(m)
print(f"expert weights: {sizes['nf4_bytes']/1e3:.0f} kB in NF4 vs {sizes['bf16_bytes']/1e3:.0f} kB in bf16 "
      f"({sizes['nf4_bytes']/sizes['bf16_bytes']:.0%})")
experts0 = moe.experts_modules(m)[0]
dev = torch.device(DEVICE)
t_all = moe.time_call_ms(lambda: moe.dequantize_expert_weight(experts0, "gate_up_proj"), dev, 2, 10)["median"]
t_one = moe.time_call_ms(lambda: moe.dequantize_expert_weight(experts0, "gate_up_proj", 0), dev, 2, 10)["median"]
print(f"dequantize gate_up_proj of one layer: all {experts0.num_experts} experts in one call {t_all:.3f} ms, "
      f"one expert {t_one:.3f} ms")
print(f"break-even: dequantizing hit experts one by one is cheaper while fewer than {t_all / t_one:.1f} of "
      f"{experts0.num_experts} experts are hit (a training batch hits them all; a short decode step does not)")
'''),
("md", r'''
## Summary
- The per-expert loop pays at least one host sync per hit expert per layer (here ≥ 2: the id check and the
  `torch.where`); the GPU idles in every one.
- One stable sort + `searchsorted` groups the tokens by expert with no sync; `grouped` then needs exactly one host
  read per layer, `sync_free` none (grouped matmul on device offsets).
- Outputs and gradients equal transformers' eager experts (bit-identical for `naive`, float32 rounding for the others),
  for GPT-OSS and Qwen3-MoE, with LoRA on attention and on the expert weights, and with NF4 experts.

**Further reading**
- transformers' experts registry and its `grouped_mm` path: `transformers/integrations/moe.py`
- PyTorch `torch.nn.functional.grouped_mm` (jagged grouped GEMM for MoE)
- MegaBlocks (Gale et al., 2022): block-sparse MoE without token dropping
- Notebook 00 (the naive path, profiled) and the library: `fastsft_lab/moe.py`, tests in `tests/test_moe.py`
'''),
("code", r'''
from fastsft_lab.profiling import peak_memory
peak = peak_memory()
print(f"notebook ran in {time.time() - T0:.0f} s on {DEVICE}" + (f", peak GPU memory {peak / 2**30:.1f} GiB" if peak else ""))
'''),
]
