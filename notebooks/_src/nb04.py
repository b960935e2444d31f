FILENAME = "04_all_three_together.ipynb"

CELLS = [
("md", r'''
# 04 — All three together: one training run, against stock transformers, TRL and Unsloth

[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fastsft-lab/fastsft_lab/blob/main/notebooks/04_all_three_together.ipynb)

**What you will learn**
- what the three fixes of notebooks 01–03 give *together*, in a real training step, and where each part of the
  gain comes from (a waterfall from stock transformers to "all fast", and an ablation that turns one fix back at a
  time);
- how that compares with what a user would otherwise run: stock transformers, TRL's activation offloading, and
  Unsloth — the system that published these fixes;
- that the combined path still trains the same model: bitwise where a switch moves no arithmetic, within a
  derived float32 bound where it reorders sums;
- how to flip every switch on a live model (the switchboard), and where the time goes now.

**Prerequisites.** Notebooks 00–03. Runs anywhere: without a GPU in *smoke mode* (tiny Qwen3 and GPT-OSS, about a
minute); with a GPU at real width (the parameters cell picks what fits and says why). Every figure of the H200
runs is read from the committed results (`fastsft_lab.lab.results`, also shipped inside the package for Colab).

**The outputs below** come from one H200 run (`SMOKE=0`, torch 2.11, transformers 5.17, 2026-12-04), except three
cells rewritten after it: the full-depth summary, which only reads the committed results (the same on any machine),
and the training check, which runs on the CPU in every run, both re-executed on a CPU (torch 2.13, 2026-12-04); and
the closing cell, whose memory line was corrected and has not run on a GPU since (no output). The live waterfall in
the first section was drawn on the H200 with the earlier chain of bars (default -> packed with cached metadata ->
+ sync-free experts -> all fast); `plots.plot_waterfall` now draws default -> all naive -> all fast, as in the
full-depth section.

**The problem.** Each fix was measured alone at reduced depth. A user trains with all of them, at full depth, inside
a trainer, with a fused loss and fast kernels underneath. The published figure for the combination is ~25% per step
(Unsloth's blog post on packed-sequence training; a later revision of the same post says ~15%). Whether that holds
depends on what else the step spends time on: this notebook measures it.
'''),
("colab", ""),
("code", r'''
import warnings
warnings.filterwarnings("ignore", message="IProgress not found")       # tqdm without ipywidgets: before any import of tqdm
warnings.filterwarnings("ignore", category=RuntimeWarning, module="peft")
warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
import logging
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
import time
import torch
import matplotlib.pyplot as plt
from IPython.display import display
from IPython.core.pylabtools import select_figure_formats
import fastsft_lab
from fastsft_lab.env import describe, smoke_mode, device_profile
from fastsft_lab.lab import plots, results

select_figure_formats(get_ipython(), {"png"})   # display(fig) embeds a PNG under any matplotlib backend (CI: Agg)
SMOKE = smoke_mode()          # SMOKE=1/0 in the environment overrides; default: on without a GPU
PROFILE = device_profile()
T0 = time.time()
print(describe())
'''),
("md", r'''
## Parameters
The live measurements below use a model that fits this machine; the committed H200 results use the full models
(Qwen3-14B, all 40 layers; GPT-OSS-20B, all 24 layers).
'''),
("code", r'''
CHOICES = {"qwen3-14b, 8 layers": dict(preset="qwen3-14b", layers=8, tokens=8192, gib=24),   # NF4 + LoRA, real width
           "qwen3-0.6b, all layers": dict(preset="qwen3-0.6b", layers=None, tokens=4096, gib=10)}
DEVICE, DTYPE = PROFILE.device, PROFILE.dtype
CHOICE = PROFILE.pick({k: c["gib"] for k, c in CHOICES.items()}) if not SMOKE else None
if not SMOKE and CHOICE is None:
    print(f"{PROFILE.name}: {PROFILE.memory_gib:.0f} GiB is less than the smallest choice needs: smoke sizes instead")
    SMOKE = True
if SMOKE:
    PRESET, NUM_LAYERS, TOKENS, MOE_PRESET, STEPS, BACKEND = "tiny-qwen3", None, 512, "tiny-gpt-oss", 3, "sdpa"
    why = "smoke mode: tiny models with the real structure"
else:
    c = CHOICES[CHOICE]
    PRESET, NUM_LAYERS, TOKENS, MOE_PRESET, STEPS = c["preset"], c["layers"], c["tokens"], None, 4
    BACKEND = PROFILE.packed_backends[0]
    why = f"{CHOICE}: the largest choice whose need ({c['gib']} GiB) fits in {PROFILE.memory_gib:.0f} GiB"
if DEVICE == "cpu":
    torch.set_num_threads(1)
print(PROFILE.describe())
print(why)
print(dict(PRESET=PRESET, NUM_LAYERS=NUM_LAYERS, TOKENS=TOKENS, BACKEND=BACKEND, DEVICE=DEVICE, DTYPE=str(DTYPE)))
'''),
("md", r'''
## Before and after, measured: the stock step and the fixes, one at a time
The harness interleaves the variants step by step on the same batches (notebook 00). `combined_variants` is the
benchmark's own list: transformers' default path, all naive (each fix in its "before" form), the waterfall
(packed attention with cached metadata → + sync-free experts → + double-buffered offload = all fast), and the
ablation (all fast with one fix turned back). On a CPU the timings show the mechanisms (host syncs gone), not GPU
speed.
'''),
("code", r'''
from fastsft_lab.models import build_model, LoraSettings
from fastsft_lab.data import benchmark_batches
from fastsft_lab.lab.harness import run_variants, make_result, format_table
from fastsft_lab.lab.scenarios.combined import combined_variants

def build(preset, layers):
    family = fastsft_lab.models.get_preset(preset).family
    m = build_model(preset, device=DEVICE, dtype=DTYPE, num_layers=layers,
                    quant="nf4" if family == "qwen3" and not SMOKE else None,
                    lora=LoraSettings(rank=16, target_modules=None if family == "qwen3" else
                                      ["q_proj", "k_proj", "v_proj", "o_proj"]), gradient_checkpointing=True)
    for p in m.parameters():           # PEFT starts lora_B at zero: give the adapters a real gradient path
        if p.requires_grad and p.dim() == 2 and not p.any():
            torch.nn.init.normal_(p, std=0.01)
    return m

live = {}
for preset in [PRESET] + ([MOE_PRESET] if MOE_PRESET else []):
    model = build(preset, NUM_LAYERS if preset == PRESET else None)
    is_moe = fastsft_lab.models.get_preset(preset).is_moe
    batches = [b.to(DEVICE) for b in benchmark_batches(tokens_per_step=TOKENS, row_tokens=TOKENS // (2 if is_moe else 1),
                                                       steps=2, vocab_size=model.config.vocab_size,
                                                       mix="short" if SMOKE else "realistic")]
    variants = combined_variants(model, is_moe=is_moe, packed=BACKEND, trl=DEVICE == "cuda")
    rows = run_variants(model, batches, variants, steps=STEPS, warmup=1, progress=False, label=preset)
    live[preset] = make_result("combined", {"model": preset, "num_layers": model.config.num_hidden_layers,
                                            "tokens_per_step": TOKENS, "kernels": "none"}, rows, DEVICE)
    print(f"\n{preset}\n" + format_table(live[preset]))
    del model
'''),
("code", r'''
# NBVAL_CHECK_OUTPUT
# The count that does not depend on the machine: host syncs per step of each path (0 = the GPU never waits for the CPU).
# One line for every live model, so that this output is the same on a CPU (two tiny models) and a GPU (one real one).
by = [{v["name"]: v for v in res["variants"]} for res in live.values()]
print("every live model: all naive syncs > 0:", all(b["all naive"]["host_syncs_per_step"] > 0 for b in by),
      "| all fast syncs:", sorted({b["all fast"]["host_syncs_per_step"] for b in by}))
'''),
("code", r'''
for preset, res in live.items():
    fig = plots.plot_waterfall(res)
    display(fig); plt.close(fig)
'''),
("md", r'''
## On the H200, at full depth
The committed runs of `python -m fastsft_lab bench --only combined`: both models at all their layers, the variant
set above on stock kernels and on the fast-kernel floor (`kernels=liger`: Liger-Kernel's RMSNorm, SwiGLU and RoPE,
and fastsft_lab's fused linear cross-entropy, which never holds the logits and never reads back the token count).
One table per model, both floors side by side, and one waterfall. Read each gain against the row it replaces: at
Qwen3-14B most of the distance from the default to all fast is already in "all naive" (the packed attention kernel,
with its metadata rebuilt per layer); the cache, the double buffer and the fused kernels are the rest. Every other
configuration (16k tokens, without autocast, 8 layers) is in `docs/results.md`.
'''),
("code", r'''
# One table and one waterfall per model, at full depth, 8192 tokens per step, under autocast (what SFTTrainer(bf16=True)
# runs): the committed JSON, read by fastsft_lab.lab.report (the same figures on any machine).
from fastsft_lab.lab import report

summary = report.combined_summary()
if not summary:
    print("No committed GPU run of the combined scenario yet (python -m fastsft_lab bench --only combined).")
for model, table, doc in summary:
    print(table)
    fig = plots.plot_waterfall(doc)
    display(fig); plt.close(fig)
'''),
("md", r'''
## Against Unsloth
Unsloth runs in a process of its own (it patches transformers at import) on the same architecture saved as a
random-weight checkpoint, the same packed batches and the same LoRA settings, with its own packing and its
offloaded checkpointing, double buffer on and off (`benchmarks/unsloth_peer.py`). Without flash-attn or xFormers
on this torch its packed SDPA attends segment by segment. On GPT-OSS, Unsloth cannot keep packed sequences apart:
its flex attention with sinks is causal over the whole row, and its trainer blocklists padding-free packing for
`gpt_oss`. So the GPT-OSS peer feeds it the same sequences, one per right-padded row, as its users train; on the
realistic mix, 34–69% of each padded step is padding.
'''),
("code", r'''
comparisons = results.peer_results()    # per model: both sides from the peer's own session (GPU, day, batches)
if not comparisons:
    print("No committed Unsloth run yet (benchmarks/unsloth_peer.sh on the GPU machine).")
for peer, same in comparisons:
    c = peer[0]["config"]
    print(f"== {c.get('model')} x{c.get('num_layers')}, {c.get('tokens_per_step')} tokens "
          f"[{results.describe_run(peer[0])}]")
    if c.get("layout") == "padded":
        print(f"   Unsloth on padded rows: {c['padded_tokens_per_step']:.0f} tokens computed per step for "
              f"{c['real_tokens_per_step']:.0f} real ones ({100 * c['padding_fraction']:.0f}% padding)")
    for doc in peer:
        for v in doc["variants"]:
            if "step_ms" not in v:
                print(f"{v['name']}: {v.get('error')}")
    rows = plots.peer_rows(peer, same)
    for name, ms, peak, syncs in rows:
        print(f"  {name:60s} {ms:8.1f} ms   {peak / 2**30 if peak else float('nan'):6.1f} GiB   syncs {syncs}")
    # who leads: the fastest peer run against our fastest all-fast run at the same shape
    peers = [v for d in peer for v in d["variants"] if "step_ms" in v]
    ours = [v for d in same for v in d["variants"] if v["name"] == "all fast" and "step_ms" in v]
    if peers and ours:
        p, o = min(peers, key=lambda v: v["step_ms"]["median"]), min(ours, key=lambda v: v["step_ms"]["median"])
        print(f"  ours (all fast) vs {p['name']}: {p['step_ms']['median'] / o['step_ms']['median']:.2f}x the speed by "
              f"medians ({p['step_ms']['n']} and {o['step_ms']['n']} steps) at "
              f"{o['peak_mem_bytes'] / p['peak_mem_bytes']:.2f}x the peak memory")
        steps = p.get("samples_ms", {}).get("step")
        if steps:
            mean = sum(steps) / len(steps)
            print(f"  by {p['name']}'s mean step ({mean:.1f} ms, what a run's wall clock pays): "
                  f"{mean / o['step_ms']['median']:.2f}x")
        for who, v in (("peer", p), ("ours", o)):
            parts = [v.get(k) for k in ("resident_mem_bytes", "forward_peak_mem_bytes", "peak_mem_bytes")]
            if all(parts):
                print(f"  {who} memory, resident -> after forward -> peak: "
                      + " -> ".join(f"{b / 2**30:.2f}" for b in parts) + " GiB")
    # A median says little when the steps spread: print every measured step of each side.
    for doc in peer + same:
        for v in doc["variants"]:
            if results.unsettled(v):
                steps = v.get("samples_ms", {}).get("step")
                print(f"  note: {v['name']} spread {results.step_spread(v):.1f}x from p20 to p80 over "
                      f"{v['step_ms']['n']} steps" + (f" (steps, ms: {', '.join(f'{x:.0f}' for x in steps)})" if steps
                                                      else "") + ": the medians above do not settle which is faster.")
fig = plots.plot_peer(comparisons)
if fig is not None:
    display(fig); plt.close(fig)
'''),
("md", r'''
## Still the same training run
Does the fast path train the same model? Drawing two loss curves over each other proves less than it seems: two
float32 runs that differ by one rounding in step 3 drift apart by an amount that depends on the CPU's kernels and the
GPU, so no tolerance can be derived for the gap between curves. The check is split by what each switch does to the
arithmetic (`fastsft_lab.lab.convergence`):

- **exact switches** (the metadata cache, the second staging buffer) move no floating-point operation: the curve with
  them on equals the naive curve to the bit, every step, on any machine;
- **reordering switches** (the fused loss; `sync_free` routing on GPT-OSS) compute the same sums in another order. At
  the same weights, at points all along the naive run, the loss and every gradient with every switch on stay within
  the float32 rounding bound of the longest sum of the step: `2·n·u`, with `u` the unit roundoff (half of float32's
  machine epsilon) and `n` the longest reduction, relative to each quantity's size at the first step.

Live on the tiny Qwen3 in float32 on the CPU (exactness is a property of the arithmetic, not of the GPU); the
committed GPU run below is at real width in bf16.
'''),
("code", r'''
from fastsft_lab.lab import convergence
from fastsft_lab.packing import packed_inputs      # packed rows -> model kwargs (the cells below use it too)
make = lambda: build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=None, seed=2)
exact = convergence.exact_curves(make, "qwen3", 100)
along = convergence.along_the_curve(make, "qwen3", 100, every=25)
fig = plots.plot_training_check(exact, along, "tiny Qwen3, float32, CPU, 100 AdamW steps of full fine-tuning")
display(fig); plt.close(fig)
'''),
("code", r'''
# NBVAL_CHECK_OUTPUT
print("exact switches, 100 steps, losses and weights bitwise equal:", exact["bitwise_equal"] and exact["params_bitwise_equal"])
print("every switch on, loss and gradients within the float32 bound at steps", [p["step"] for p in along["points"]], ":",
      along["within"])
'''),
("code", r'''
gpu_curves = results.load_results("convergence", newest_run=True)
if not gpu_curves:
    print("No committed GPU loss curves yet (benchmarks/soak.py --what curves).")
for doc in gpu_curves:
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for name, ys in doc["losses"].items():
        ax.plot(ys, label=name, ls="--" if "fast" in name else "-")
    ax.set_xlabel("step"); ax.set_ylabel("loss"); ax.legend(fontsize=8)
    ax.set_title(f"{doc['config']['preset']} x{doc['config']['num_layers']}, {doc['config']['tokens_per_step']} tokens, "
                 f"{doc['config']['dtype']} | {results.describe_run(doc)}", fontsize=8)
    display(fig); plt.close(fig)
    print(f"max |all fast - all naive| = {doc['max_abs_diff_fast_vs_naive']:.2e}; "
          f"noise floor (one ulp apart) = {doc['max_abs_diff_noise_floor']:.2e}")
'''),
("md", r'''
## The switchboard
Every switch on a live model, through `fastsft_lab.apply`: attention backend and metadata cache, offload buffers
and prefetch, MoE routing, the fused loss; "run N steps" adds a bar per setting. Here it is also driven from code,
so that the notebook shows a result without a widget frontend.
'''),
("code", r'''
from fastsft_lab.lab.switchboard import Switchboard

sb_model = build(MOE_PRESET or PRESET, None if SMOKE else NUM_LAYERS)
sb_batches = [b.to(DEVICE) for b in benchmark_batches(tokens_per_step=TOKENS, row_tokens=TOKENS // 2, steps=2,
                                                      vocab_size=sb_model.config.vocab_size, mix="short" if SMOKE else "realistic")]
sb = Switchboard(sb_model, sb_batches)
sb.set(backend=BACKEND, cache=False, buffers=1, moe="naive" if sb.is_moe else "off")
sb.run(2)
sb.set(cache=True, buffers=2, prefetch=True, moe="sync_free" if sb.is_moe else "off", fused_loss=True)
sb.run(2)
panel = sb.show()
fig = sb.figure()
display(fig); plt.close(fig)
'''),
("md", r'''
## Where the time goes now
The all-fast step under `torch.profiler`: its top operations by device time (self time on a CPU). What remains is
the next bottleneck: the matmuls (dense layers, LoRA, experts), attention, the loss.
'''),
("code", r'''
from fastsft_lab.profiling import profile

fastsft_lab.apply(sb_model, packed_attention=BACKEND, offload_buffers=2, fused_loss=True,
                  **({"moe_routing": "sync_free"} if sb.is_moe else {}))
opt = torch.optim.AdamW([p for p in sb_model.parameters() if p.requires_grad], lr=1e-6)

def one_step():
    loss = sb_model(**packed_inputs(sb_batches[0])).loss
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

one_step()
prof = profile(one_step, top=12)
total = sum(op["self_ms"] for op in prof.top_ops)
for op in prof.top_ops:
    print(f"{op['self_ms']:9.2f} ms {op['self_ms'] / total:6.1%}  {op['calls']:5d} calls  {op['name'][:70]}")
'''),
("md", r'''
## Where the time goes: the all-fast step at full depth
The committed runs of `python -m fastsft_lab bench --only breakdown`: the all-fast step of both models at all their
layers (8192 tokens; stock kernels and the Liger floor) under `torch.profiler`, its device time split by who
launched each kernel -- the innermost module scope (forward, and the checkpoint recompute), or in the backward the
forward op that created the autograd node (its sequence number). Attention, MoE experts, dense matmuls (NF4 dequant
apart), LoRA, loss + LM head, norms & elementwise, copies & offload, optimizer, other, and idle (no kernel running
on any stream) sum to the profiled step (`fastsft_lab.lab.breakdown` says how each is found).

The profiler is not free: it records every op and launch on the host, so wherever the step is bound by the host
the GPU waits longer than it would unprofiled, and that wait shows up as idle. Kernel durations are stamped on the
device and barely change. So the tables and the chart re-base each breakdown on the step timed without the
profiler (`breakdown.step_view`): every work category keeps its ms, and idle becomes the unprofiled step minus the
busy time. The largest part is the next bottleneck. Without a committed run, the cell runs the smoke breakdown of
the tiny models live: on a CPU the parts are host ops' self time and idle is Python between ops, not GPU idleness.
'''),
("code", r'''
import contextlib, io, tempfile
from fastsft_lab.lab.breakdown import describe_bottleneck, format_breakdown, step_view
from fastsft_lab.lab.scenarios import run_scenario

breakdowns = results.breakdown_results()
if not breakdowns:
    print("No committed GPU run of the breakdown scenario yet (python -m fastsft_lab bench --only breakdown): "
          f"the smoke breakdown of the tiny models, live on {DEVICE}, instead.")
    with contextlib.redirect_stdout(io.StringIO()):
        breakdowns = run_scenario("breakdown", device=DEVICE, smoke=True, out_dir=tempfile.mkdtemp(), progress=False)
for doc in breakdowns:
    c, bd = doc["config"], doc["breakdown"]
    where = results.describe_run(doc) if "_path" in doc else f"live, {DEVICE}"
    print(f"\n{c['model']} x{c['num_layers']} | {c['tokens_per_step']} tokens | kernels: {c['kernels']} | {where}")
    if bd is None:
        print(f"  all fast failed: {doc['variants'][0].get('error')}")
        continue
    print(f"step {doc['variants'][0]['step_ms']['median']:.1f} ms without the profiler, {bd['step_ms']:.1f} ms under it")
    view = step_view(doc)
    print(format_breakdown(view))
    print(describe_bottleneck(view))
fig = plots.plot_breakdown(breakdowns)
display(fig); plt.close(fig)
'''),
("md", r'''
## What it costs
All fast trades host resources and constraints for GPU time: pinned host memory for every offloaded layer input
(tokens x hidden x 2 bytes per layer, per rank; the pool refuses in one line before the node runs out), one more
staging buffer on the GPU, packed rows from a collator that keeps sequence lengths on the host, and the fused loss,
which returns no logits with labels. Its peak GPU memory stands beside each variant in the tables above; against
Unsloth, in its own table. Every switch turns off on its own, back to the original model to the bit.
'''),
("md", r'''
## Summary
- Together, the three fixes remove every host sync from the step and keep the numbers (equivalence per fix in
  notebooks 01–03; loss curves here). How much time that buys depends on what else the step does: the waterfall
  shows each fix's share, the ablation what each one is worth on top of the others.
- Against stock transformers the gain is large where stock transformers is slow (GPT-OSS's eager attention over
  whole packed rows); against a careful baseline (all naive) it is the three fixes' own share; under fast kernels (the
  fused loss, fused LoRA, Liger's norms, SwiGLU and RoPE) the glue is a larger share of the step, as the published
  fixes assume. Run the step under `torch.autocast(bfloat16)` as `SFTTrainer(bf16=True)` does: without it PEFT
  computes QLoRA's float32 adapters in float32 (the breakdown's "LoRA" row without autocast).
- The peer to beat is Unsloth. The cell above puts both on the same batches and says who leads, by medians and by
  the peer's mean step. A ratio is only as good as the spread of the steps: a peer still compiling in its measured
  steps needs a longer run before the ratio means anything. At Qwen3-14B x8 the two are level by medians; the
  matmul kernels take the same time, and the visible differences are Unsloth's NF4 dequantisation and its cuDNN
  attention (README). On GPT-OSS-20B, Unsloth trains on padded rows, because it cannot keep packed sequences apart.
  Per computed token the two are level there too, so exact packing is the whole lead.

**Further reading.** `python -m fastsft_lab bench --only combined --help`; the library: `fastsft_lab.apply`,
`fastsft_lab.loss`, `fastsft_lab.lora`, `fastsft_lab.callbacks.StepStatsCallback` (for TRL's `SFTTrainer`, see the README's recipe);
`tests/test_training.py` (the 200-step curves in CI).
'''),
("code", r'''
print(f"notebook ran in {time.time() - T0:.0f} s on: {describe()}")
if DEVICE == "cuda":   # the harness resets the allocator's peak per variant: the largest of the measured peaks
    peak = max((v.get("peak_mem_bytes") or 0) for res in live.values() for v in res["variants"])
    print(f"largest peak GPU memory of the live measurements above: {peak / 2**30:.1f} GiB")
'''),
]
