FILENAME = "04_all_three_together.ipynb"

# where the committed outputs come from (appended to the first cell by build.py)
OUTPUTS = """**The outputs below** come from a CPU run in smoke mode (`SMOKE=1`, torch 2.13, transformers 5.17, 2026-12-06):
tiny models, so the live timings show the mechanisms, not GPU speed. Every full-depth figure is read from the
committed GPU results and names its card and run. CI re-runs every cell in smoke mode (nbval, lax: the outputs are
not compared)."""

CELLS = [
("md", r'''
# 04 — All three together: one training run, against stock transformers, TRL and Unsloth

[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fastsft-lab/fastsft_lab/blob/main/notebooks/04_all_three_together.ipynb)
(the repository is not published yet: the install cell says how to give it your copy)

**What you will learn**
- what the three fixes of notebooks 01–03 give *together* in a real training step, and which part of the gain each
  one earns: the chain from transformers' default on the fast-kernel floor, and an ablation that turns one fix back
  at a time;
- how that compares with stock transformers, TRL's activation offloading and Unsloth, which published these fixes;
- that the combined path still trains the same model: bitwise where a switch moves no arithmetic, within a derived
  float32 bound where it reorders sums;
- how to flip the switches one at a time on a live model (the switchboard), and where the step's time goes now.

**Prerequisites.** Notebooks 00–03. Runs anywhere: without a GPU in *smoke mode* (tiny Qwen3 and GPT-OSS, a few
minutes); with a GPU at real width (Qwen3-14B x8, and GPT-OSS-20B x4 where 40 GiB fit). Every live step runs under
`torch.autocast(bfloat16)` on a GPU, as `SFTTrainer(bf16=True)` does. The full-depth figures are read from the
committed results (`fastsft_lab.lab.results`).

**The problem.** Each fix was measured alone, at reduced depth. A user trains with all of them at full depth,
inside a trainer, with a fused loss and fast kernels underneath. The published figure for the three glue fixes
together is ~25% per step (Unsloth's blog post on packed-sequence training; a later revision says ~15%). Whether
that holds depends on what else the step spends its time on: this notebook measures it.
'''),
("colab", ""),                # the shared Colab install cell (build.py)
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
from fastsft_lab.env import describe, smoke_mode, device_profile
from fastsft_lab.lab import plots, report, results

select_figure_formats(get_ipython(), {"png"})   # display(fig) embeds a PNG under any matplotlib backend (CI: Agg)
SMOKE = smoke_mode()          # SMOKE=1/0 in the environment overrides; default: on without a GPU
PROFILE = device_profile()
T0 = time.time()
print(describe())
'''),
("md", r'''
## Parameters
The live cells use models that fit this machine (`fastsft_lab/lab/nbparams.py`); the committed results use the full
models (Qwen3-14B, all 40 layers; GPT-OSS-20B, all 24).
'''),
("code", r'''
from fastsft_lab.lab.nbparams import parameters

globals().update(parameters("04", PROFILE, SMOKE))   # MODELS, TOKENS, BACKEND, AUTOCAST, ..., and why
'''),
("md", r'''
## Before and after, measured: stock, all naive, all fast, and the ablation
The harness interleaves the variants step by step on the same batches (notebook 00). `combined_variants` is the
benchmark's own list: **transformers default** (its attention, `grouped_mm` experts and checkpointing; GPT-OSS's
eager attention lets packed sequences attend to each other), **all naive** (the packed attention kernel with each
glue fix in its "before" form: metadata rebuilt in every layer, one staging buffer, transformers' default experts),
**all fast**, and the ablation: all fast with one fix turned back. Default → all naive is the attention kernel
(and exact packing), all naive → all fast the three glue fixes. On a CPU the timings show the mechanisms (host syncs
gone), not GPU speed; the cell stops with an error where the sync counts do not hold.
'''),
("code", r'''
from fastsft_lab.models import build_model, get_preset, LoraSettings
from fastsft_lab.data import benchmark_batches
from fastsft_lab.lab.harness import run_variants, make_result, format_table, with_autocast
from fastsft_lab.lab.scenarios.combined import combined_variants

def build(preset, layers):
    """Qwen3: NF4 + LoRA r16 on every projection (QLoRA); GPT-OSS: LoRA r16 on attention; checkpointing on."""
    moe = get_preset(preset).is_moe
    m = build_model(preset, device=DEVICE, dtype=DTYPE, num_layers=layers, quant=None if moe or SMOKE else "nf4",
                    lora=LoraSettings(rank=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"] if moe else None),
                    gradient_checkpointing=True)
    for p in m.parameters():           # PEFT starts lora_B at zero: give the adapters a real gradient path
        if p.requires_grad and p.dim() == 2 and not p.any():
            torch.nn.init.normal_(p, std=0.01)
    return m

def batches_for(model, preset):
    rows = TOKENS // (2 if get_preset(preset).is_moe else 1)
    return [b.to(DEVICE) for b in benchmark_batches(tokens_per_step=TOKENS, row_tokens=rows, steps=2,
                                                    vocab_size=model.config.vocab_size,
                                                    mix="short" if SMOKE else "realistic")]

live = {}
for preset, layers in MODELS:
    model = build(preset, layers)
    variants = [v for v in combined_variants(model, is_moe=get_preset(preset).is_moe, packed=BACKEND,
                                             trl=DEVICE == "cuda") if v.name not in report.CHAIN_ROWS]
    variants = with_autocast(variants, AUTOCAST)    # the chain's steps: notebook 00 and the committed chain below
    # vs ref: against all naive, exact packing (on GPT-OSS the stock rows attend across packed sequences)
    rows = run_variants(model, batches_for(model, preset), variants, steps=STEPS, warmup=1, progress=False,
                        label=preset, check_equal="all naive")
    live[preset] = make_result("combined", {"model": preset, "num_layers": model.config.num_hidden_layers,
                                            "tokens_per_step": TOKENS, "kernels": "none", "autocast": AUTOCAST}, rows, DEVICE)
    print(report.config_header(live[preset], f"measured here, {PROFILE.name}") + "\n" + format_table(live[preset]) + "\n")
    fig = plots.plot_waterfall(live[preset])
    display(fig); plt.close(fig)
    del model
syncs = {p: {v["name"]: v.get("host_syncs_per_step") for v in r["variants"]} for p, r in live.items()}
assert all(s["all naive"] > 0 and s["all fast"] == 0 for s in syncs.values()), f"sync counts do not hold: {syncs}"
print("host syncs per step, every live model: all naive pays some, all fast none")
'''),
("md", r'''
## At full depth (committed)
Both models at all their layers, 8192 tokens, under autocast. First the chain on the fast-kernel floor (`kernels=
liger`: Liger-Kernel's RMSNorm, SwiGLU and RoPE, fastsft_lab's fused loss and LoRA): the same committed chain the
README table shows, each step over the one before with what it removes. Then `bench --only combined` on both kernel
floors: transformers' default, TRL's activation offloading, all naive, all fast and the ablation, closed by the glue
fixes' own share (all fast over all naive) beside the published ~25%. Every other configuration is in
[docs/results.md](../docs/results.md).
'''),
("code", r'''
for model in ("qwen3-14b", "gpt-oss-20b"):       # the committed chains (README, notebooks 00 and 03 read them too)
    chain = results.attribution_for(model, "liger")
    if chain is None:
        print(f"No committed attribution chain of {model} on the Liger floor.")
        continue
    print(report.attribution_text(chain) + "\n")
    fig = plots.plot_waterfall(chain)
    display(fig); plt.close(fig)
summary = report.combined_summary()
print("\n\n".join(table for _, table, _ in summary)
      or "No committed GPU run of the combined scenario yet (python -m fastsft_lab bench --only combined).")
'''),
("md", r'''
## Against Unsloth
Unsloth runs in a process of its own (it patches transformers at import) on the same architecture saved as a
random-weight checkpoint, the same batches and LoRA settings, with its own packing and offloaded checkpointing
(`benchmarks/unsloth_peer/`). On GPT-OSS it cannot keep packed sequences apart (its attention with sinks is causal
over the whole row, and its trainer blocklists padding-free packing for `gpt_oss`), so it gets the same sequences
one per right-padded row, as its users train. Both sides of each comparison come from one session.
'''),
("code", r'''
comparisons = results.peer_results()    # per model: both sides from the peer's own session (GPU, day, batches)
print("\n\n".join(report.peer_text(peer, same) for peer, same in comparisons)
      or "No committed Unsloth run yet (benchmarks/unsloth_peer.sh on the GPU machine).")
fig = plots.plot_peer(comparisons)
if fig is not None:
    display(fig); plt.close(fig)
'''),
("md", r'''
## Still the same training run
Two loss curves drawn over each other prove less than they seem: two float32 runs that differ by one rounding drift
apart by an amount that depends on the machine, so no tolerance can be derived for the gap. The check is split by
what each switch does to the arithmetic (`fastsft_lab.lab.convergence`):

- **exact switches** (the metadata cache, the second staging buffer) move no floating-point operation: with them
  on, the curve equals the naive one to the bit, every step, on any machine;
- **reordering switches** (the fused loss; `sync_free` routing on GPT-OSS) compute the same sums in another order.
  At the same weights, at points all along the naive run, the loss and every gradient with every switch on stay
  within `2·n·u` (`u` the unit roundoff, `n` the longest reduction) relative to each quantity's size at step 0.

Live on the tiny Qwen3 in float32 on the CPU (exactness is a property of the arithmetic, not of the GPU); below it,
the committed GPU curves at real width, whose length the caption states. The cell stops where a check fails.
'''),
("code", r'''
from fastsft_lab.lab import convergence

make = lambda: build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=None, seed=2)
threads = torch.get_num_threads()
torch.set_num_threads(1)   # ops this small gain nothing from threads, which wait on any other process on the cores
try:                       # (two such runs side by side on 2 cores: 60 s each instead of 3)
    exact = convergence.exact_curves(make, "qwen3", 100)
    along = convergence.along_the_curve(make, "qwen3", 100, every=25)
finally:
    torch.set_num_threads(threads)
same = exact["bitwise_equal"] and exact["params_bitwise_equal"]
print(f"exact switches, 100 steps: losses and weights bitwise equal to all naive: {'yes' if same else 'NO'}")
print(f"every switch on, at steps {[p['step'] for p in along['points']]}: loss and gradients within the float32 bound: "
      f"{'yes' if along['within'] else 'NO'}")
assert same and along["within"], "the fast path does not train the same model"
fig = plots.plot_training_check(exact, along, "tiny Qwen3, float32, CPU, 100 AdamW steps of full fine-tuning")
display(fig); plt.close(fig)
curves = results.load_results("convergence", newest_run=True)
print(report.loss_curves_text(curves[0] if curves else None))
for doc in curves:
    fig = plots.plot_loss_curves(doc)
    display(fig); plt.close(fig)
'''),
("md", r'''
## The switchboard
Every switch on a live model goes through `fastsft_lab.apply`: attention backend, metadata cache, offload buffers
and prefetch, MoE routing, the fused loss. The panel below drives GPT-OSS where this machine runs it (its MoE
control live), under the same autocast as the measured steps; the cell sets every switch to its fast position and
runs two steps (host syncs, step time, peak memory). In Jupyter, change a control and press "run N steps" to add a
row of your own: each row says what changed since the one before.
'''),
("code", r'''
from fastsft_lab.lab.switchboard import Switchboard

sb_preset, sb_layers = MODELS[-1]        # GPT-OSS where this machine runs it (its MoE switch live), else Qwen3
sb_model = build(sb_preset, sb_layers)
sb = Switchboard(sb_model, batches_for(sb_model, sb_preset), autocast=AUTOCAST)
sb.set(backend=BACKEND, cache=True, buffers=2, fused_loss=True, **({"moe": "sync_free"} if sb.is_moe else {}))
sb.run(steps=2)
SB_HEADER = report.config_header({"config": {"model": sb_preset, "num_layers": sb_model.config.num_hidden_layers,
                                             "tokens_per_step": TOKENS, "kernels": "none", "autocast": AUTOCAST}},
                                 f"measured here, {PROFILE.name}")
print(SB_HEADER)
panel = sb.show()
fig = sb.figure()
display(fig); plt.close(fig)
'''),
("md", r'''
## Where the time goes now
The all-fast step split by the module that launched each piece of work (`fastsft_lab.lab.breakdown`): attention, MoE experts,
dense matmuls (NF4 dequantisation apart), LoRA, loss + LM head, norms & elementwise, copies & offload, optimizer,
other, and idle (no kernel running). Each kernel is counted once, in the category of the module that launched it
(who launched it, not what bounds it: notebook 05 classifies each kernel).
First live, on the switchboard's model in its last setting (all fast; on a CPU the parts are host ops' self time);
then the committed GPU runs: each configuration's largest part here, every category in the chart (the tables are in
docs/results.md).

The profiler is not free: it records every op on the host, so a host-bound step waits longer under it, and that
wait shows as idle. Kernel durations barely change, so the committed breakdowns keep each work category's ms and
take idle as the step timed *without* the profiler minus the busy time. The largest part is the next bottleneck.
'''),
("code", r'''
from fastsft_lab.lab.breakdown import describe_bottleneck, format_breakdown, step_view

bd = sb.breakdown(steps=2)
print(f"{SB_HEADER}; {sb.setting.label()}\n{format_breakdown(bd)}\n{describe_bottleneck(bd)}\n")
breakdowns = results.breakdown_results()      # each configuration's table: docs/results.md (the breakdown)
for d in breakdowns:
    print(f"{report.config_header(d)}:\n  {describe_bottleneck(step_view(d))}")
fig = plots.plot_breakdown(breakdowns)
if fig is not None:
    display(fig); plt.close(fig)
'''),
("md", r'''
## What it costs
All fast trades host resources and constraints for GPU time: pinned host memory for every offloaded layer input
(tokens × hidden × 2 bytes per layer, per rank; the pool refuses in one line before the node runs out), one more
staging buffer on the GPU, packed rows from a collator that keeps sequence lengths on the host, and a fused loss
that returns no logits with labels. Peak GPU memory stands beside each variant in the tables above. Every switch
turns off on its own, back to the original model to the bit.

Memory buys time too. Checkpointing pays a second forward for every layer it recomputes; `fastsft_lab.apply(model,
memory_budget=...)` keeps the activations of as many layers as the budget holds and offloads the rest, each kept
layer one recompute fewer (notebook 02 says when to keep, recompute or offload). The committed frontier of
`python -m fastsft_lab bench --only budget` below runs each budget's plan against the README recipe (every layer
offloaded), no checkpointing and Unsloth's two settings on the same batches, with the peak the plan predicted beside
the one measured (the frontiers without a peer are in docs/results.md).
'''),
("code", r'''
# The memory plan's frontier at full depth: step time against peak memory, from every layer offloaded to every
# activation kept; the committed JSON, read by fastsft_lab.lab.report (the same figures on any machine).
frontier = [d for d in results.budget_results() if results.frontier_peers(d)]   # those run beside Unsloth
if not frontier:
    print("No committed GPU run of the budget scenario yet (python -m fastsft_lab bench --only budget).")
else:
    print("\n\n".join(report.frontier_text(doc) for doc in frontier))
    fig = plots.plot_frontier(frontier)
    display(fig); plt.close(fig)
'''),
("md", r'''
## Summary and next bottleneck
- Together the three fixes remove every host sync from the step and keep the numbers (bitwise for the exact
  switches, within float32 rounding for the reordering ones).
- Against stock transformers the gain is large where stock is slow: on GPT-OSS its eager attention over whole
  packed rows. Against a careful baseline (all naive: the same attention kernel, transformers' default experts) the
  glue fixes are the last line of each committed table, beside the published ~25%: at Qwen3-14B the step is spent
  in matmuls, so the glue is a small share; under fast kernels it is a larger one, as the published fixes assume.
- Run the step under `torch.autocast(bfloat16)` as `SFTTrainer(bf16=True)` does; without it PEFT computes QLoRA's
  float32 adapters in float32.
- Against Unsloth: the comparison lines above say who leads by medians and by its mean step; a peer whose steps
  spread widely needs a longer run before its ratio means anything. On GPT-OSS-20B, where it trains on padded rows,
  exact packing is the lead.
- Spare memory buys speed: the frontier puts each budget's plan beside Unsloth's two settings on the same batches,
  and its last lines say how each plan fares at Unsloth's own peak and with 2.5 times it.

**Next bottleneck.** The breakdown names it: the largest part of each committed step. Where that is kernel work
(matmuls, the experts' grouped matmuls), the next gains are in the kernels themselves, not the glue.

**Further reading.** `python -m fastsft_lab bench --only combined --help`; `fastsft_lab.apply`, `fastsft_lab.loss`,
`fastsft_lab.lora`, `fastsft_lab.callbacks.StepStatsCallback` (TRL's `SFTTrainer`: the README's recipe);
`tests/test_training.py` (the 200-step curves in CI).
'''),
("code", r'''
print(f"notebook ran in {time.time() - T0:.0f} s on: {describe()}")
if DEVICE == "cuda":   # each live measurement resets the allocator's peak: the largest of all of them
    peaks = [v.get("peak_mem_bytes") or 0 for res in live.values() for v in res["variants"]]
    peaks += [r["peak_mem_bytes"] or 0 for r in sb.records]
    print(f"largest peak GPU memory of the live measurements above (the measured steps, the switchboard): "
          f"{max(peaks) / 2**30:.1f} GiB")
'''),
]
