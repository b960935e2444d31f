FILENAME = "02_double_buffered_offload.ipynb"

# where the committed outputs come from (appended to the first cell by build.py)
OUTPUTS = """**The outputs below** come from a CPU run in smoke mode (`SMOKE=1`, torch 2.13, transformers 5.17, 2026-12-06):
tiny models, so the live timings show the mechanisms, not GPU speed. Every GPU figure is read from the committed
results and names its card and run. CI re-runs every cell in smoke mode (nbval, lax: the outputs are not compared)."""

CELLS = [
("md", r'''
# 02 — Double-buffered checkpoint reloads

[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fastsft-lab/fastsft_lab/blob/main/notebooks/02_double_buffered_offload.ipynb)
(the repository is not published yet: the install cell says how to give it your copy)

**What you will learn**
- how CPU-offloaded gradient checkpointing works: each decoder layer's input goes to pinned host memory in the
  forward and comes back in the backward, so the GPU keeps no activations between the two;
- why a *single* GPU staging buffer makes the copy stream and the compute stream take turns in the backward, and how
  a second buffer (slot = layer parity, one event per slot) plus a prefetch lets the reload of layer k-1 run under
  layer k's backward;
- how to check that an offload changes no numbers, does not leak, and what it costs in VRAM and host memory;
- where the second buffer matters and where it does not (the regime: copy time against compute time).

**Prerequisites.** Runs anywhere. Without a GPU it runs in *smoke mode*: a tiny Qwen3 on the CPU, where there are
no streams and every copy is synchronous, so CPU timelines show *what* runs, not overlap. The GPU pictures and
numbers (Qwen3-14B width, NF4 + LoRA r=16) are read from the committed results (`fastsft_lab.lab.results`). With a
GPU the notebook builds Qwen3-14B (10 of its layers at real width, random weights) when it fits, else Qwen3-0.6B.
On a GPU that shares its memory with the host (unified memory), offloading moves nothing, so the timing cells are
skipped there.

**The problem.** Transformers' own offload option (`gradient_checkpointing_enable(offload=True)`) copies on the
compute stream ("the step gets slower", its docstring says); torchtune's and TRL's offloading allocate fresh pinned
and GPU tensors and reload only when autograd asks. With one staging buffer the reload of layer k-1 cannot start
before layer k's backward is done with the buffer:

```
compute  | bwd L9 |        | bwd L8 |        | bwd L7 |
copy     |        | h2d L8 |        | h2d L7 |            <- every reload is exposed
```
(Not to scale: at Qwen3-14B width on the H200 a reload takes a few percent of a layer's backward; the schedule cell
below prints the measured durations, and the timelines draw them to scale.)
'''),
("colab", ""),                # the shared Colab install cell (build.py)
("code", r'''
import warnings
warnings.filterwarnings("ignore", message="IProgress not found")       # tqdm without ipywidgets: before any import of tqdm
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
Tiny sizes in smoke mode; on a GPU the largest choice that fits (`fastsft_lab/lab/nbparams.py`: each choice and the
memory it needs; the equivalence check's step without checkpointing is the largest).
'''),
("code", r'''
from fastsft_lab.lab.nbparams import parameters

globals().update(parameters("02", PROFILE, SMOKE))   # MODEL, NUM_LAYERS, TOKENS, ..., TIME_OFFLOAD, and why
'''),
("md", r'''
### The schedule, in principle
Before measuring anything, here is what the stream dependencies the offload code issues *imply* for given copy
and compute durations (`fastsft_lab.lab.timelines.simulate_schedule` — a **model**, not a run). The rule that
matters: the reload of layer k waits for its staging slot to be freed by the backward of the last layer that used
it. With one buffer that is layer k+1, the layer just before it in the backward; with two buffers it is layer k+2.
The durations are the per-layer means of the committed GPU timeline.
'''),
("code", r'''
from fastsft_lab.lab.timelines import simulate_schedule, copy_overlap, span_ms, per_layer_means

gpu = results.offload_results()      # the newest committed GPU run of each kind (offload, timeline, sweep, vram)
doc = gpu["timeline"][-1]
means = per_layer_means(doc["timelines"]["offload x1 (single buffer)"])
fwd, bwd, copy = means["fwd"], means["bwd"], means["h2d"]
print(f"per-layer means measured with one buffer at {doc['config']['tokens_per_step']} tokens: forward {fwd:.1f} ms, "
      f"backward {bwd:.1f} ms, reload {copy:.1f} ms  [{results.describe_run(doc)}]")
model_one = simulate_schedule(8, fwd_ms=fwd, bwd_ms=bwd, copy_ms=copy, buffers=1)
model_two = simulate_schedule(8, fwd_ms=fwd, bwd_ms=bwd, copy_ms=copy, buffers=2)
fig = plots.plot_timelines({"MODEL - one staging buffer": model_one, "MODEL - two staging buffers": model_two},
                           suptitle=f"schedule model, 8 layers, with the committed run's per-layer durations")
display(fig); plt.close(fig)
print(f"model: two buffers save {span_ms(model_one) - span_ms(model_two):.2f} ms of {span_ms(model_one):.2f} ms "
      f"({span_ms(model_one) / span_ms(model_two) - 1:+.1%})")
'''),
("md", r'''
## The naive path, measured
The model: QLoRA on the real architecture on a GPU (random weights: speed does not depend on weight values), a
tiny Qwen3 in float32 in smoke mode. Batches are packed rows from the synthetic corpus (see notebook 00).
`fastsft_lab.apply(model, offload_buffers=1)` turns on the single-buffer "before": it plugs
into transformers' own hook (`GradientCheckpointingLayer._gradient_checkpointing_func`), so PEFT wrappers and every
layer kwarg (rotary cos/sin, masks, notebook 01's `packed_metadata`) pass through untouched. The cell builds the
model and traces one step with one staging buffer after a warm-up step (the first step allocates the pinned pool,
and would draw that instead). The committed GPU trace of the same configuration follows the fix, beside the double
buffer's.
'''),
("code", r'''
from fastsft_lab.models import build_model, LoraSettings
from fastsft_lab.data import benchmark_batches

t = time.time()
model = build_model(MODEL, device=DEVICE, dtype=DTYPE, quant=QUANT, lora=LoraSettings(rank=LORA_RANK),
                    num_layers=NUM_LAYERS)
cfg = model.config
vocab = cfg.vocab_size
batches = [b.to(DEVICE) for b in benchmark_batches(tokens_per_step=TOKENS, row_tokens=ROW_TOKENS, steps=2,
                                                   vocab_size=vocab, mix="short" if SMOKE else "realistic")]
print(f"{MODEL}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, built in {time.time() - t:.1f}s; "
      f"one layer input = {TOKENS} x {cfg.hidden_size} x {torch.finfo(DTYPE).bits // 8} bytes "
      f"= {TOKENS * cfg.hidden_size * torch.finfo(DTYPE).bits // 8 / 2**20:.1f} MiB")

from fastsft_lab.lab.scenarios.offload import make_variants, trace_step

variants, _ = make_variants(model, ["offload1", "offload2p"])
single, double = variants
where = "CUDA events on the copy and compute streams" if DEVICE == "cuda" else \
        "CPU: no streams, every copy runs inline (nothing CAN overlap here)"
if TIME_OFFLOAD:
    trace_step(model, batches[0], single)                     # warm-up: the first step allocates the pinned pool
    trace_single = trace_step(model, batches[0], single)     # a warm step, copy/compute intervals recorded
    fig = plots.plot_timelines({"one staging buffer (measured here, warm step)": trace_single}, suptitle=where)
    display(fig); plt.close(fig)
    ov = copy_overlap(trace_single)
    print(f"reload copies {ov['h2d_ms']:.3f} ms, hidden behind compute: {ov['h2d_hidden_share'] or 0:.0%}"
          + (f", compute waited {ov['reload_stall_ms']:.2f} ms for them" if DEVICE == "cuda" else ""))
else:
    print("unified memory: no timeline measured here (an offload copy moves nothing on this GPU)")
'''),
("md", r'''
## The fix: two staging buffers, per-slot events, prefetch
- **Pinned pool, reused.** Forward copies go into a `PinnedPool` slot on a dedicated copy stream (`non_blocking`,
  the compute stream is not blocked; `record_stream` keeps the caching allocator from reusing the layer input
  before the copy has read it). Slots are sized to the largest input seen and reused every step: no per-step
  pinned allocation.
- **Two staging buffers.** Layer k reloads into slot `k % 2`. Each slot has a *ready* event (copy done; the compute
  stream waits on it) and a *free* event (recorded after the layer's backward; the next copy into that slot waits on
  it). So the reload of layer k-1 only waits for layer k+1 — already finished — and runs under layer k's backward.
- **Prefetch.** The backward of layer k knows which layer comes next (a per-step registry of offloaded inputs, in
  forward order), so it issues the reload of layer k-1 before launching its own kernels.
- **Staging buffers live on the copy stream.** They are allocated on the stream that writes them first, so the
  caching allocator's stream ordering covers the memory's previous users, and `record_stream` on the compute
  stream covers the reads when they are freed. (The first GPU run showed why this matters, below.)
- **Same kernels as standard checkpointing.** The offloaded forward runs with grad mode on but keeps nothing
  (a `saved_tensors_hooks` pair drops what autograd would save, as torch's non-reentrant checkpoint does):
  kernels whose choice can depend on whether inputs require grad (SDPA's backend and variant) choose the same.
- **Safe by construction.** Several forwards before one backward (gradient accumulation) are keyed by registry
  order, an owner check reloads anything overwritten, and if the second buffer does not fit in GPU memory the code
  warns and falls back to one buffer instead of crashing.

```
compute  | bwd L9 | bwd L8 | bwd L7 |
copy     | h2d L8 | h2d L7 | h2d L6 |                    <- hidden behind compute (not to scale)
```

```python
import fastsft_lab
from fastsft_lab.offload import offload_manager
fastsft_lab.apply(model, offload_buffers=2, prefetch=True)   # returns the model's ModelState
manager = offload_manager(model)                             # pool, staging buffers, stats, stream log
fastsft_lab.apply(model, offload_buffers="off")              # exactly what was there before
```

### Correct before fast
Loss and every gradient of each mode against transformers' standard (non-reentrant) checkpointing and against a
run with no checkpointing at all — the reference that nothing here touches. LoRA adapters of the first layer get
their gradients even though that layer's input does not require grad (torch's reentrant checkpoint would silently
drop them).

The first GPU run found a stream-ordering bug the tiny CUDA tests had missed (its history:
`benchmarks/results/h200-2026-12-02/README.md`); the next cell checks that ordering on any machine.
'''),
("md", r'''
**The ordering, checked on any machine.** Every stream operation the manager issues (waits, event records, copies,
which buffer each one reads or writes, allocations and frees) is logged — on a CPU too, where the very same code
runs synchronously — and `fastsft_lab.offload.check_stream_order` replays the log as a happens-before model of
CUDA streams: every pair of accesses to one buffer from two streams, at least one a write, must be ordered by a
stream wait or an event. The allocation pattern of the first version fails it (`tests/test_offload_streams.py` has that
negative control and four more). Then the gradients of a tiny model in float32 on the CPU, which must be *exactly*
equal. Both print the same on every machine.
'''),
("code", r'''
# NBVAL_CHECK_OUTPUT
import fastsft_lab
from fastsft_lab.offload import offload_manager, check_stream_order
from fastsft_lab.evidence import check_equivalence, format_equivalence, check_transport, check_no_leak

tiny = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=8))
tiny_inputs = benchmark_batches(tokens_per_step=256, row_tokens=128, steps=1, vocab_size=tiny.config.vocab_size,
                                mix="short")[0].model_inputs()
for buffers, prefetch in ((1, False), (2, False), (2, True)):
    fastsft_lab.apply(tiny, offload_buffers=buffers, prefetch=prefetch)
    manager = offload_manager(tiny)
    manager.stream_log = []
    for _ in range(2):
        tiny(**tiny_inputs).loss.backward()
    fastsft_lab.apply(tiny, offload_buffers="off")
    problems = check_stream_order(manager.stream_log)
    manager.stream_log = None
    print(f"{'offload x%d' % buffers + (' + prefetch' if prefetch else ''):22s} unordered cross-stream accesses: "
          f"{len(problems)}")
tiny.zero_grad(set_to_none=True)
eq_tiny = check_equivalence(tiny, tiny_inputs)    # float32 on a CPU: exact
print("standard checkpointing == no checkpointing:", eq_tiny["standard_vs_no_checkpointing"])
for mode in ("offload x1", "offload x2", "offload x2 + prefetch"):
    r = eq_tiny[mode]
    print(f"{mode:22s} == standard: {r['vs_standard']}   == no checkpointing: {r['vs_no_checkpointing']}   "
          f"bitwise: {r['report']['vs_standard']['bitwise_equal']}")
fastsft_lab.apply(tiny, offload_buffers="off")
del tiny
'''),
("md", r'''
The same check on this notebook's model (real size on a GPU: bf16, so within bf16 noise on the scale of each
tensor), with the worst tensor of every comparison: its max |diff|, its scale, what it is allowed. On a GPU it also
checks the two halves of the offload separately: the offloaded forward against a plain forward, and every reloaded
input, bit for bit, against a device copy taken in forward (`check_transport`). Not compared by nbval: the numbers
depend on the machine. Then eight steps check that nothing leaks: the pinned pool stops growing after the first
step and the registry of offloaded inputs is empty after every backward (the cell stops with an error otherwise).
'''),
("code", r'''
eq_batch = benchmark_batches(tokens_per_step=EQ_TOKENS, row_tokens=min(ROW_TOKENS, EQ_TOKENS), steps=1,
                             vocab_size=vocab, mix="short" if SMOKE else "realistic")[0].to(DEVICE)
eq = check_equivalence(model, eq_batch.model_inputs())
print(f"{MODEL} x{cfg.num_hidden_layers} layers, {EQ_TOKENS} tokens, {str(DTYPE).replace('torch.', '')} on {DEVICE}:")
print(format_equivalence(eq))
if DEVICE == "cuda":
    for mode, r in check_transport(model, eq_batch.model_inputs()).items():
        print(f"{mode:22s} reloads bitwise intact: {r['transport_ok']} ({r['checked']} checks); offloaded forward "
              f"== plain forward bitwise: {r['forward_inputs_bitwise_equal']} (max |diff| "
              f"{r['forward_inputs_max_abs_diff']:.3g})")

leak = check_no_leak(model, batches[0].model_inputs(), steps=8)
print("\nno leak over 8 steps: pinned pool flat after step 1:", leak["pool_flat_after_step_1"],
      "| registry empty after every backward:", leak["registry_empty_after_each_backward"],
      "| GPU allocated memory flat:", leak["gpu_allocated_flat"] if DEVICE == "cuda" else "n/a on a CPU")
print(f"pool: {leak['pool_allocations']} host allocations, {leak['pool_bytes'] / 2**20:.2f} MiB; "
      f"staging buffers: {', '.join(f'{b / 2**20:.2f}' for b in leak['staging_bytes'])} MiB")
assert leak["pool_flat_after_step_1"] and leak["registry_empty_after_each_backward"], "the offload leaks"
'''),
("md", r'''
## The fix, measured
The harness interleaves the variants step by step on the same batches (median and p20–p80 per phase); standard
checkpointing is the 1.00x baseline. Then one warm step of each buffer mode as a timeline. On a CPU all copies are
synchronous, so the table only shows that the machinery costs little, and the timelines what runs, not overlap:
the overlap is a GPU result (below).
'''),
("code", r'''
from fastsft_lab.lab.harness import run_variants, make_result, format_table

keys = ["standard", "offload1", "offload2", "offload2p"] + (["none"] if SMOKE else [])
variants, toggles = make_variants(model, keys)
if TIME_OFFLOAD:
    rows = run_variants(model, batches, variants, steps=STEPS, warmup=1, progress=False, count_syncs=False)
    here = make_result("offload", {"model": MODEL, "num_layers": cfg.num_hidden_layers, "tokens_per_step": TOKENS},
                       rows, DEVICE)
    print(format_table(here))
    fig = plots.plot_offload_result(here)
    display(fig); plt.close(fig)
else:
    print("unified memory: the offload modes are not timed here (an offload copy moves nothing on this GPU)")
if TIME_OFFLOAD:
    trace_step(model, batches[0], double)                     # warm-up, as for the single buffer above
    trace_double = trace_step(model, batches[0], double)
    fig = plots.plot_timelines({"one staging buffer (measured here)": trace_single,
                                "two buffers + prefetch (measured here)": trace_double}, suptitle=where)
    display(fig); plt.close(fig)
    for name, ev in (("one buffer", trace_single), ("two buffers + prefetch", trace_double)):
        ov = copy_overlap(ev)
        if DEVICE == "cuda":
            print(f"{name:24s} reload copies {ov['h2d_ms']:.2f} ms, hidden {ov['h2d_hidden_share'] or 0:.0%}, "
                  f"compute waited {ov['reload_stall_ms']:.2f} ms")
        else:   # inline copies: the gaps between layers are Python time, not waiting on a copy
            print(f"{name:24s} reload copies {ov['h2d_ms']:.3f} ms in all (synchronous on a CPU: nothing to hide)")
'''),
("md", r'''
### On the GPU (committed results)
The same two timelines (warm steps), then every variant at every token count of the newest committed offload run
(`results.offload_results` keeps one document per token count: the one with the most variants), with the figures
the benchmark derives from them and the targets of the issue. In the table each cell is the step time, the speed
over standard checkpointing ("x", higher is faster) and the peak memory; "-" where the run did not measure it.
'''),
("code", r'''
from fastsft_lab.lab import report
from fastsft_lab.lab.scenarios.offload import results_table

doc = gpu["timeline"][-1]
c = doc["config"]
tl = {k: doc["timelines"][k] for k in ("offload x1 (single buffer)", "offload x2 + prefetch") if k in doc["timelines"]}
fig = plots.plot_timelines(tl, suptitle=f"{results.describe_run(doc).split(',')[0]}: {c['model']} x{c['num_layers']} layers, {c['tokens_per_step']} tokens "
                                        f"(CUDA events, warm steps)")
display(fig); plt.close(fig)
print(report.offload_overlap_text(doc))
offload_docs = gpu["offload"]
print(f"\n{offload_docs[0]['config']['model']} x{offload_docs[0]['config']['num_layers']} layers  "
      f"[{results.describe_run(offload_docs[0])}]")
print(results_table(offload_docs))
fig = plots.plot_across_tokens(offload_docs)
display(fig); plt.close(fig)
print("\n".join(report.offload_derived_text(d) for d in offload_docs))
'''),
("md", r'''
## What it costs
- **VRAM of the second buffer**: one layer input, `tokens x hidden x 2` bytes in bf16 (Qwen3-14B: 84 MB at 8k tokens,
  168 MB at 16k, 336 MB at 32k) — the issue's budget is 0.5 GB.
- **Host memory**: one pinned slot per layer, rounded up to a power of two (PyTorch's pinned allocator rounds that
  way too). `save_on_cpu` around the whole step also pins the float32 log-softmax of the logits — twice, since
  `log_softmax` and `nll_loss` both save it: `2 x tokens x vocab x 4` bytes, 40 GB at 32k tokens for Qwen3's 152k
  vocabulary (64 GB after power-of-two rounding). That is what ran the issue's 32k run out of host memory; the
  benchmark estimates it and skips with a recorded reason instead of dying. Transformers' own `offload=True` wraps
  `save_on_cpu` around each layer's checkpoint only, so it pins just the layer inputs.
- **Time**: two copies per layer per step. When the copy is small next to the layer's compute (a fast GPU at long
  sequences), it is hidden and the second buffer buys little; offloading only pays when the memory it frees is
  needed. At short sequences the fixed costs (RNG state, events, a recompute launched from a nested backward) are a
  larger share of a short step.
'''),
("code", r'''
from fastsft_lab.lab.scenarios.offload import vram_saved_estimate

mem = toggles["offload x2 + prefetch"].last_memory
manager = offload_manager(model)
print(f"here: second staging buffer {mem.get('staging_bytes_per_buffer', 0) / 2**20:.2f} MiB, "
      f"pinned pool {manager.pool.nbytes / 2**20 if manager else 0:.2f} MiB "
      f"({'pinned' if DEVICE == 'cuda' else 'ordinary memory on a CPU'})")
for tokens in (8192, 16384, 32768):   # analytic: Qwen3-14B, all 40 layers
    est = vram_saved_estimate(40, tokens, 5120, 2, 2 * tokens * 5120 * 2)
    print(f"Qwen3-14B, 40 layers, {tokens:5d} tokens: checkpointing keeps {est['checkpoint_inputs_bytes'] / 1e9:5.2f} GB "
          f"of layer inputs; offload x2 keeps {est['offload2_staging_bytes'] / 1e9:.2f} GB of staging -> "
          f"saves {est['net_saved_bytes'] / 1e9:5.2f} GB")
print(report.offload_vram_text(gpu["vram"]))
'''),
("md", r'''
### Where does the second buffer matter?
The regime sweep of the committed GPU run (several widths and row lengths, a few layers each): the gain of two buffers +
prefetch over one buffer against the measured ratio of reload time to layer backward time, with the schedule
model's curve for comparison.

**Beyond this GPU: slower links.** The published +6.7% came from a B200, whose pinned host link is no faster than
an H200's; what decides the double buffer's worth is the copy time per layer against the layer's compute. The
`offload_link` scenario runs the same step behind emulated slower links (every offload copy padded with dummy bytes
over the same link, so it takes as long as it would at the target bandwidth, using no SM) and checks the timeline
model against every point: the second chart.
'''),
("code", r'''
sweep = gpu["sweep"][0] if gpu["sweep"] else None
print(report.offload_sweep_text(sweep))
if sweep is not None:
    fig = plots.plot_sweep(sweep)
    display(fig); plt.close(fig)
link = next(iter(results.load_results("offload_link", newest_run=True)), None)
print("\n" + report.offload_link_text(link))
if link is not None:
    fig = plots.plot_offload_link(link)
    display(fig); plt.close(fig)
'''),
("md", r'''
### When to offload, when to recompute, when neither
Offloading and recomputing both buy memory with time; with memory to spare, neither is worth its cost. Between
"everything kept" and "every layer offloaded" there is a whole frontier, layer by layer:
- **keep** a layer's activations while memory lasts: no recompute at all;
- **selective**: save only the matmul and attention outputs and recompute the cheap elementwise ops, norms and
  activations (on paper most of the recompute's time back for a fraction of the memory; the plan measures whether
  it pays on this GPU);
- **checkpoint** (input kept) or **offload** (input in pinned host memory, the double buffer of this notebook): the
  whole layer recomputed; offload also frees the input, at the price of the copies where they are not hidden;
- **offload_saved**: nothing recomputed, every saved activation in pinned host memory with the same double buffer;
  it moves a whole layer's activations, so it pays only on a much faster link or at short rows.

Where each choice goes matters too: the backward rebuilds the last layer first, beside everything the earlier layers
hold, so a kept *last* layer costs about nothing where that first recompute sets the peak, and a recompute costs
least in the *first* layers. `fastsft_lab.apply(model, memory_budget=80)` measures each choice on the first step and
picks the fastest mix that fits 80 GiB (`fastsft_lab.offload.plan`; every mix computes what plain training computes,
tested on the CPU). Notebook 04 draws the committed frontier (`bench --only budget`), each plan's step and peak
beside checkpointing off, the README recipe and Unsloth's, computed from the committed results.
'''),
("md", r'''
## Summary, next bottleneck and further reading
- Offloaded checkpointing keeps no activations on the GPU between a layer's forward and backward; the layer input
  goes to a reused pinned pool on a copy stream and comes back into a staging buffer.
- With one staging buffer, reloads and backward compute take turns; with two buffers (slot = parity, free/ready
  events per slot) and a prefetch the reload runs under the previous layer's backward. The gain is the exposed copy
  time, so it follows the ratio of reload to backward time: the emulated links show it growing as the link slows;
  on a fast link the sweep's gains are a few percent at most, whatever the width.
- Numbers unchanged: exact in float32 on a CPU, and within bf16 noise of standard checkpointing at real size on a
  GPU (the equivalence cell above, on the machine printed at the top, says so for this run); no leak; an exact way
  back: `fastsft_lab.apply(model, offload_buffers="off")`.
- Stream ordering is easy to get subtly wrong and only shows at real sizes: log the operations and check them
  (`check_stream_order`), and verify the reloaded bits on the GPU (`check_transport`).

**Next bottleneck.** With the reloads hidden, an offloaded step costs about what standard checkpointing costs, so
what is left is checkpointing's own price: every layer's forward runs twice. In a mixture-of-experts model the
next glue cost sits inside the layer: the per-expert loop of notebook 03.

Further reading: PyTorch's [pinned memory and non_blocking tutorial](https://pytorch.org/tutorials/intermediate/pinmem_nonblock.html),
`torch.autograd.graph.save_on_cpu`, torchtune's `OffloadActivations`, transformers'
`gradient_checkpointing_enable(offload=...)`, and `fastsft_lab/offload/` (the manager, its stream operations and
their log, the slot policy; `OffloadManager`'s docstring lists every cross-stream hazard and what orders it).
'''),
("code", r'''
fastsft_lab.apply(model, offload_buffers="off")
print(f"notebook ran in {time.time() - T0:.0f} s on: {describe()}")
if DEVICE == "cuda":
    print(f"peak GPU memory over the notebook: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
else:
    print("peak memory: not tracked on a CPU (it is a CUDA allocator statistic)")
'''),
]
