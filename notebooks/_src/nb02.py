FILENAME = "02_double_buffered_offload.ipynb"

CELLS = [
("md", r'''
# 02 — Double-buffered checkpoint reloads

[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fastsft-lab/fastsft_lab/blob/main/notebooks/02_double_buffered_offload.ipynb)

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
numbers (Qwen3-14B width, NF4 + LoRA r=16, on an H200) are loaded from `benchmarks/results/` when that run is
present. With a GPU the notebook builds Qwen3-14B (10 layers, random weights; about 3 GB of GPU memory for weights
plus activations at 16k tokens).

**The problem.** Transformers' own offload option (`gradient_checkpointing_enable(offload=True)`) copies on the
compute stream ("the step gets slower", its docstring says); torchtune's and TRL's offloading allocate fresh pinned
and GPU tensors and reload only when autograd asks. With one staging buffer the reload of layer k-1 cannot start
before layer k's backward is done with the buffer:

```
compute  | bwd L9 |        | bwd L8 |        | bwd L7 |
copy     |        | h2d L8 |        | h2d L7 |            <- every reload is exposed
```
'''),
("colab", ""),                # the shared Colab install cell (build.py)
("code", r'''
import time
import torch
from fastsft_lab.env import describe, smoke_mode, has_cuda

SMOKE = smoke_mode()          # SMOKE=1/0 in the environment overrides; default: on without a GPU
T0 = time.time()
print(describe())
'''),
("md", r'''
## Parameters
Everything below is derived from these. In smoke mode the sizes are tiny; on a GPU they are the real ones.
'''),
("code", r'''
DEVICE = "cuda" if has_cuda() else "cpu"
if SMOKE:
    MODEL, NUM_LAYERS, QUANT, LORA_RANK = "tiny-qwen3", 6, None, 8
    TOKENS, ROW_TOKENS, EQ_TOKENS, STEPS = 512, 256, 256, 3
    DTYPE = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    if DEVICE == "cpu":
        torch.set_num_threads(1)   # tiny model: threads only add noise on a small shared CPU
else:
    MODEL, NUM_LAYERS, QUANT, LORA_RANK = "qwen3-14b", 10, "nf4", 16   # 10 of Qwen3-14B's 40 layers, real width
    TOKENS, ROW_TOKENS, EQ_TOKENS, STEPS = 16384, 8192, 8192, 4
    DTYPE = torch.bfloat16
print(dict(MODEL=MODEL, NUM_LAYERS=NUM_LAYERS, QUANT=QUANT, TOKENS=TOKENS, DEVICE=DEVICE, DTYPE=str(DTYPE)))
'''),
("md", r'''
### The schedule, in principle
Before measuring anything, here is what the stream dependencies the offload code issues *imply* for given copy
and compute durations (`fastsft_lab.timeline.simulate_schedule` — a **model**, not a run). The rule that matters:
the reload of layer k waits for its staging slot to be freed by the backward of the last layer that used it. With
one buffer that is layer k+1, the layer just before it in the backward; with two buffers it is layer k+2.
The durations come from the GPU run below when it is present, else from an illustrative ratio.
'''),
("code", r'''
import matplotlib.pyplot as plt
from fastsft_lab import offload as O
from fastsft_lab.timeline import simulate_schedule, plot_timelines, copy_overlap, span_ms

gpu = O.load_results(device_type="cuda")      # the H200 run, if benchmarks/results holds it
def per_layer(doc, name, kind):
    ev = [e for e in doc["timelines"][name] if e["kind"] == kind]
    return sum(e["end_ms"] - e["start_ms"] for e in ev) / max(1, len(ev))

if gpu["timeline"]:
    doc = gpu["timeline"][-1]
    name = "offload x1 (single buffer)"
    fwd, bwd, copy = (per_layer(doc, name, k) for k in ("fwd", "bwd", "h2d"))
    source = f"durations measured on {doc['env']['gpu_name']} at {doc['config']['tokens_per_step']} tokens"
else:
    fwd, bwd, copy = 0.5, 1.0, 0.35
    source = "illustrative durations (copy = 0.35 x backward): no GPU run found under benchmarks/results"
model_one = simulate_schedule(8, fwd_ms=fwd, bwd_ms=bwd, copy_ms=copy, buffers=1)
model_two = simulate_schedule(8, fwd_ms=fwd, bwd_ms=bwd, copy_ms=copy, buffers=2)
plot_timelines({"MODEL - one staging buffer": model_one, "MODEL - two staging buffers": model_two},
               suptitle=f"schedule model, 8 layers ({source})")
plt.show()
print(f"model: two buffers save {span_ms(model_one) - span_ms(model_two):.2f} ms of {span_ms(model_one):.2f} ms "
      f"({span_ms(model_one) / span_ms(model_two) - 1:+.1%})")
'''),
("md", r'''
## The naive path, measured
The model: QLoRA on the real architecture on a GPU (random weights: speed does not depend on weight values), a
tiny Qwen3 in float32 in smoke mode. Batches are packed rows from the synthetic corpus (see notebook 00).
`enable_offloaded_checkpointing(model, buffers=1, prefetch=False)` turns on the single-buffer "before": it plugs
into transformers' own hook (`GradientCheckpointingLayer._gradient_checkpointing_func`), so PEFT wrappers and every
layer kwarg (rotary cos/sin, masks, notebook 01's `packed_metadata`) pass through untouched.
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
'''),
("code", r'''
from fastsft_lab.bench import Variant

variants, _ = O.make_variants(model, ["offload1", "offload2p"])
single, double = variants
trace_single = O.trace_step(model, batches[0], single)     # one extra step, copy/compute intervals recorded
where = "CUDA events on the copy and compute streams" if DEVICE == "cuda" else \
        "CPU: no streams, every copy runs inline (nothing CAN overlap here)"
plot_timelines({"one staging buffer (measured here)": trace_single}, suptitle=f"{where}")
plt.show()
ov = copy_overlap(trace_single)
print(f"reload copies {ov['h2d_ms']:.3f} ms, hidden behind compute: {ov['h2d_hidden_share'] or 0:.0%}"
      + (f", compute waited {ov['reload_stall_ms']:.2f} ms for them" if DEVICE == "cuda" else ""))
'''),
("code", r'''
# The same picture from the H200 run (loaded, not re-run here)
if gpu["timeline"]:
    doc = gpu["timeline"][-1]
    env, c = doc["env"], doc["config"]
    plot_timelines({"one staging buffer": doc["timelines"]["offload x1 (single buffer)"]},
                   suptitle=f"measured on {env['gpu_name']}: {c['model']} x{c['num_layers']} layers, "
                            f"{c['tokens_per_step']} tokens (CUDA events)")
    plt.show()
    print("copy/compute overlap, one buffer:", doc["overlap"].get("offload x1 (single buffer)"))
else:
    print(f"No GPU timeline under {gpu['root']} yet: run `python -m fastsft_lab bench --only offload` on a GPU "
          "and copy its output folder there.")
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
  stream covers the reads when they are freed. (The first H200 run showed why this matters, below.)
- **Same kernels as standard checkpointing.** The offloaded forward runs with grad mode on but keeps nothing
  (a `saved_tensors_hooks` pair drops what autograd would save, as torch's non-reentrant checkpoint does):
  kernels whose choice can depend on whether inputs require grad (SDPA's backend and variant) choose the same.
- **Safe by construction.** Several forwards before one backward (gradient accumulation) are keyed by registry
  order, an owner check reloads anything overwritten, and if the second buffer does not fit in GPU memory the code
  warns and falls back to one buffer instead of crashing.

```
compute  | bwd L9 | bwd L8 | bwd L7 |
copy     | h2d L8 | h2d L7 | h2d L6 |                    <- hidden behind compute
```

### Correct before fast
Loss and every gradient of each mode against transformers' standard (non-reentrant) checkpointing and against a
run with no checkpointing at all — the reference that nothing here touches. LoRA adapters of the first layer get
their gradients even though that layer's input does not require grad (torch's reentrant checkpoint would silently
drop them).

**What the first H200 run showed.** Executed on an H200 at real size (Qwen3-14B width, 10 layers, NF4 + LoRA r16,
8192 tokens in one row, bf16), this check printed *standard == no checkpointing: True* but *False* for every offload
mode, the single buffer included, while the tiny CUDA tests passed on the same machine. The cell below reads those
lines from the committed GPU-executed copy of this notebook. The cause, found by reading the code against CUDA's
stream rules: the staging buffers were allocated on the **compute** stream but first written by the **copy**
stream. The caching allocator only orders a block's reuse for the stream it is allocated on, so the first reload of
a step could overwrite memory whose previous users — the loss and LM-head backward, still queued on the GPU when
the CPU reaches the last layer's backward — had not run yet. With microsecond kernels the GPU has finished them by
then, so only real sizes showed it. The buffers are now allocated on the copy stream. A second, possible
contributor was changed too: the offloaded forward ran under `no_grad`, where SDPA may pick another backend than
the standard forward does; it now runs with grad mode on (`check_transport` below tells, on a GPU, whether the
forward bits and the reloaded bits match). **Re-checked on the H200 after these fixes** (second session of
2026-12-02, this copy of the notebook): every mode now matches standard checkpointing and no checkpointing at
this size; the largest gradient difference from standard checkpointing (8.7e-05) is the size of standard
checkpointing's own difference from no checkpointing (9.2e-05), i.e. bf16 backward noise, and the reloads and the offloaded
forward are bitwise intact (cells below).
'''),
("code", r'''
# What the first H200 run printed (read from the committed GPU-executed notebook, not re-run here)
import json, pathlib
H200_NB = "benchmarks/results/h200-2026-12-02/notebooks/02_double_buffered_offload.h200.ipynb"
h200_nb = pathlib.Path(O.default_results_dir()).parents[1] / H200_NB
if h200_nb.exists():
    for c in json.loads(h200_nb.read_text())["cells"]:
        if c["cell_type"] == "code" and "check_equivalence" in "".join(c["source"]):
            for o in c.get("outputs", []):
                print("".join(o.get("text", "")), end="")
    print(f"(from {H200_NB}, before the fix)")
else:
    print(f"{H200_NB} is not in this checkout.")
'''),
("md", r'''
**The ordering, checked on any machine.** Every stream operation the manager issues (waits, event records, copies,
which buffer each one reads or writes, allocations and frees) is logged — on a CPU too, where the very same code
runs synchronously — and `fastsft_lab.timeline.check_stream_order` replays the log as a happens-before model of
CUDA streams: every pair of accesses to one buffer from two streams, at least one a write, must be ordered by a
stream wait or an event. The allocation pattern of the first version fails it (`tests/test_offload.py` has that
negative control and four more). Then the gradients of a tiny model in float32 on the CPU, which must be *exactly*
equal. Both print the same on every machine.
'''),
("code", r'''
# NBVAL_CHECK_OUTPUT
from fastsft_lab.timeline import check_stream_order
tiny = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=8))
tiny_inputs = benchmark_batches(tokens_per_step=256, row_tokens=128, steps=1, vocab_size=tiny.config.vocab_size,
                                mix="short")[0].model_inputs()
for buffers, prefetch in ((1, False), (2, False), (2, True)):
    manager = O.enable_offloaded_checkpointing(tiny, buffers, prefetch)
    manager.stream_log = []
    for _ in range(2):
        tiny(**tiny_inputs).loss.backward()
    O.disable_offloaded_checkpointing(tiny)
    problems = check_stream_order(manager.stream_log)
    manager.stream_log = None
    print(f"{'offload x%d' % buffers + (' + prefetch' if prefetch else ''):22s} unordered cross-stream accesses: "
          f"{len(problems)}")
tiny.zero_grad(set_to_none=True)
eq_tiny = O.check_equivalence(tiny, tiny_inputs)    # float32 on a CPU: exact
print("standard checkpointing == no checkpointing:", eq_tiny["standard_vs_no_checkpointing"])
for mode in ("offload x1", "offload x2", "offload x2 + prefetch"):
    r = eq_tiny[mode]
    print(f"{mode:22s} == standard: {r['vs_standard']}   == no checkpointing: {r['vs_no_checkpointing']}   "
          f"bitwise: {r['report']['vs_standard']['bitwise_equal']}")
O.disable_offloaded_checkpointing(tiny, release_pool=True)
del tiny
'''),
("md", r'''
The same check on this notebook's model (real size on a GPU: bf16, so within bf16 noise on the scale of each
tensor), with the worst tensor of every comparison: its max |diff|, its scale, what it is allowed. On a GPU it also
checks the two halves of the offload separately: the offloaded forward against a plain forward, and every reloaded
input, bit for bit, against a device copy taken in forward (`check_transport`). Not compared by nbval: the numbers
depend on the machine.
'''),
("code", r'''
eq_batch = benchmark_batches(tokens_per_step=EQ_TOKENS, row_tokens=min(ROW_TOKENS, EQ_TOKENS), steps=1,
                             vocab_size=vocab, mix="short" if SMOKE else "realistic")[0].to(DEVICE)
eq = O.check_equivalence(model, eq_batch.model_inputs())
print(f"{MODEL} x{cfg.num_hidden_layers} layers, {EQ_TOKENS} tokens, {str(DTYPE).replace('torch.', '')} on {DEVICE}:")
print(O.format_equivalence(eq))
if DEVICE == "cuda":
    for mode, r in O.check_transport(model, eq_batch.model_inputs()).items():
        print(f"{mode:22s} reloads bitwise intact: {r['transport_ok']} ({r['checked']} checks); offloaded forward "
              f"== plain forward bitwise: {r['forward_inputs_bitwise_equal']} (max |diff| "
              f"{r['forward_inputs_max_abs_diff']:.3g})")
'''),
("code", r'''
# NBVAL_CHECK_OUTPUT
leak = O.check_no_leak(model, batches[0].model_inputs(), steps=8)
print("pinned pool flat after step 1:", leak["pool_flat_after_step_1"])
print("registry empty after every backward:", leak["registry_empty_after_each_backward"])
'''),
("code", r'''
# (not compared by nbval: GPU only)
print("GPU allocated memory flat over the steps:", leak["gpu_allocated_flat"] if DEVICE == "cuda" else "n/a on a CPU")
print(f"pool: {leak['pool_allocations']} host allocations, {leak['pool_bytes'] / 2**20:.2f} MiB; "
      f"staging buffers: {[round(b / 2**20, 2) for b in leak['staging_bytes']]} MiB")
'''),
("md", r'''
## The fix, measured
The harness interleaves the variants step by step on the same batches (median and p20–p80 per phase); standard
checkpointing is the 1.00x baseline. On a CPU all copies are synchronous, so this table only shows that the
machinery costs little — the overlap is a GPU result (below).
'''),
("code", r'''
from fastsft_lab.bench import run_variants, make_result, format_table

keys = ["standard", "offload1", "offload2", "offload2p"] + (["none"] if SMOKE else [])
variants, toggles = O.make_variants(model, keys)
rows = run_variants(model, batches, variants, steps=STEPS, warmup=1, progress=False, count_syncs=False)
here = make_result("offload", {"model": MODEL, "num_layers": cfg.num_hidden_layers, "tokens_per_step": TOKENS}, rows,
                   DEVICE)
print(format_table(here))
'''),
("code", r'''
trace_double = O.trace_step(model, batches[0], double)
plot_timelines({"one staging buffer (measured here)": trace_single,
                "two buffers + prefetch (measured here)": trace_double}, suptitle=where)
plt.show()
for name, ev in (("one buffer", trace_single), ("two buffers + prefetch", trace_double)):
    ov = copy_overlap(ev)
    if DEVICE == "cuda":
        print(f"{name:24s} reload copies {ov['h2d_ms']:.2f} ms, hidden {ov['h2d_hidden_share'] or 0:.0%}, "
              f"compute waited {ov['reload_stall_ms']:.2f} ms")
    else:   # inline copies: the gaps between layers are Python time, not waiting on a copy
        print(f"{name:24s} reload copies {ov['h2d_ms']:.3f} ms in all (synchronous on a CPU: nothing to hide)")
'''),
("code", r'''
# The H200 run: the same two timelines, then every variant at every token count
if gpu["timeline"]:
    doc = gpu["timeline"][-1]
    env, c = doc["env"], doc["config"]
    tl = {k: doc["timelines"][k] for k in ("offload x1 (single buffer)", "offload x2 + prefetch")
          if k in doc["timelines"]}
    plot_timelines(tl, suptitle=f"measured on {env['gpu_name']}: {c['model']} x{c['num_layers']} layers, "
                                f"{c['tokens_per_step']} tokens (CUDA events)")
    plt.show()
    for k, ov in doc["overlap"].items():
        print(f"{k:28s} copies hidden behind compute: {ov['hidden_share']:.0%} "
              f"(reloads {ov['h2d_hidden_share']:.0%}), compute waited {ov['reload_stall_ms']:.1f} ms for reloads")
if gpu["offload"]:
    print(O.results_table(gpu["offload"]))
    O.plot_across_tokens(gpu["offload"])
    plt.show()
    for r in gpu["offload"]:
        print(r["config"]["tokens_per_step"], "tokens:", r.get("derived"))
else:
    print(f"No GPU results under {gpu['root']} yet.")
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
- **Time**: two copies per layer per step. When the copy is small next to the layer's compute (an H200 at long
  sequences), it is hidden and the second buffer buys little; offloading only pays when the memory it frees is
  needed. At short sequences the fixed costs (RNG state, events, a recompute launched from a nested backward) are a
  larger share of a short step.
'''),
("code", r'''
mem = toggles["offload x2 + prefetch"].last_memory
dtype_bytes = torch.finfo(DTYPE).bits // 8
print(f"here: second staging buffer {mem.get('staging_bytes_per_buffer', 0) / 2**20:.2f} MiB, "
      f"pinned pool {O.offload_manager(model).pool.nbytes / 2**20 if O.offload_manager(model) else 0:.2f} MiB "
      f"({'pinned' if DEVICE == 'cuda' else 'ordinary memory on a CPU'})")
for tokens in (8192, 16384, 32768):   # analytic: Qwen3-14B, all 40 layers
    est = O.vram_saved_estimate(40, tokens, 5120, 2, 2 * tokens * 5120 * 2)
    print(f"Qwen3-14B, 40 layers, {tokens:5d} tokens: checkpointing keeps {est['checkpoint_inputs_bytes'] / 1e9:5.2f} GB "
          f"of layer inputs; offload x2 keeps {est['offload2_staging_bytes'] / 1e9:.2f} GB of staging -> "
          f"saves {est['net_saved_bytes'] / 1e9:5.2f} GB")
if gpu["vram"]:
    for r in gpu["vram"]:
        print("measured at full depth:", r["config"]["num_layers"], "layers", r["config"]["tokens_per_step"], "tokens:",
              {v["name"]: round((v.get("peak_mem_bytes") or 0) / 2**30, 2) for v in r["variants"]}, "GiB peak")
'''),
("code", r'''
# Where does the second buffer matter? (regime sweep on the GPU, with the schedule model's curve)
import os, tempfile
if gpu["sweep"]:
    path = O.plot_sweep(gpu["sweep"][-1], os.path.join(tempfile.mkdtemp(), "sweep.png"))
    for p in gpu["sweep"][-1]["points"]:
        print({k: p.get(k) for k in ("preset", "hidden_size", "tokens", "copy_to_backward_ratio", "gain_x2p_vs_x1",
                                     "gain_x2p_vs_x1_serial")})
else:
    path = O.plot_sweep({"points": []}, os.path.join(tempfile.mkdtemp(), "sweep.png"))
    print("No GPU sweep found: showing the schedule model only (`--set offload.sweep=true` on a GPU adds the points).")
from IPython.display import Image, display
display(Image(path))
'''),
("md", r'''
## Summary and further reading
- Offloaded checkpointing keeps no activations on the GPU between a layer's forward and backward; the layer input
  goes to a reused pinned pool on a copy stream and comes back into a staging buffer.
- With one staging buffer, reloads and backward compute take turns; with two buffers (slot = parity, free/ready
  events per slot) and a prefetch the reload runs under the previous layer's backward. The gain is the exposed copy
  time: large when copies are slow relative to compute (narrow layers, short rows, slower links, or a design that
  also serialises the forward copies), small on an H200 at long sequences — the sweep shows the regime.
- Numbers unchanged (exact in float32 on a CPU; on a GPU, the real-size re-check after the staging-allocation fix
  is still to run), no leak, an exact way back: `disable_offloaded_checkpointing(model)`.
- Stream ordering is easy to get subtly wrong and only shows at real sizes: log the operations and check them
  (`check_stream_order`), and verify the reloaded bits on the GPU (`check_transport`).

Further reading: PyTorch's [pinned memory and non_blocking tutorial](https://pytorch.org/tutorials/intermediate/pinmem_nonblock.html),
`torch.autograd.graph.save_on_cpu`, torchtune's `OffloadActivations`, transformers'
`gradient_checkpointing_enable(offload=...)`, and `fastsft_lab/offload.py` (the manager, with its stream-order
log, is ~400 lines; `OffloadManager`'s docstring lists every cross-stream hazard and what orders it).
'''),
("code", r'''
O.disable_offloaded_checkpointing(model, release_pool=True)
if DEVICE == "cuda":
    print(f"peak GPU memory in this notebook: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
print(f"notebook ran in {time.time() - T0:.0f} s")
'''),
]
