FILENAME = "01_packed_metadata.ipynb"

# where the committed outputs come from (appended to the first cell by build.py)
OUTPUTS = """**The outputs below** come from a CPU run in smoke mode (`SMOKE=1`, torch 2.13, transformers 5.17, 2026-12-06):
tiny models, so the live timings show the mechanisms, not GPU speed. Every GPU figure is read from the committed
results and names its card and run. CI re-runs every cell in smoke mode (nbval, lax: the outputs are not compared)."""

CELLS = [
("md", r'''
# 01 — Packed-sequence metadata caching

[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/fastsft-lab/fastsft_lab/blob/main/notebooks/01_packed_metadata.ipynb)
(the repository is not published yet: the install cell says how to give it your copy)

**What you will learn**
- what every attention layer needs to know about a packed row (`cu_seqlens`, `max_seqlen`, a block-diagonal mask),
  and what it costs to rebuild that in every layer from `position_ids` (host syncs, a Python loop, a T×T mask);
- a pitfall of stock transformers 5.x: given packed `position_ids`, some model/implementation pairs let a sequence
  attend to the one packed before it — exactly which ones;
- the fix: `PackedMetadata`, built once per batch from the packer's host-side lengths, passed to every layer as a
  keyword argument; attention backends registered through transformers' `AttentionInterface` (SDPA, torch varlen,
  flex, xFormers, flash-attn) that handle GQA, sliding windows and GPT-OSS attention sinks;
- how to check it changes no numbers (logits and LoRA gradients against each sequence run alone), then what it buys.

**Prerequisites.** Notebook 00 (how we measure). Runs anywhere: without a GPU in *smoke mode* (tiny Qwen3 and
GPT-OSS, seconds); on a GPU at Qwen3-14B width when it fits, else Qwen3-0.6B. The GPU figures further down are
read from the committed results (`fastsft_lab.lab.results`).

**The problem.** In packed SFT, several sequences share a row and must not see each other. The attention kernel
needs the segment boundaries. Common code derives them from `position_ids` *inside every layer*: transformers'
flash-attention path runs `_is_packed_sequence` (a `bool()` of a device tensor), `nonzero` and a `max()` read back
as a Python int in each layer; Unsloth's pre-cache builders read `.max().item()`, `.sum().item()`, `.tolist()` and
fill a T×T mask block by block in a Python loop, in each layer. Each read stalls the CPU until the GPU is idle.
Unsloth's blog post on packed-sequence training reports caching the metadata once per batch, on Qwen3-14B QLoRA
SFT, as +43.3% forward and +14.3% per batch. This notebook measures what the cache alone buys, and where.
'''),
("colab", ""),                # the shared Colab install cell (build.py)
("code", r'''
import warnings
warnings.filterwarnings("ignore", message="IProgress not found")       # tqdm without ipywidgets: before any import of tqdm
warnings.filterwarnings("ignore", message=".*Profiler clears events")  # torch.profiler's notice, once per profile
warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
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
The equivalence checks always use the tiny models (any machine, seconds, float32, tight tolerances). The speed
measurement uses the real width on a GPU: the largest choice that fits, the backends this GPU can train with
(torch's varlen kernel needs sm80+) and its dtype (`fastsft_lab/lab/nbparams.py` lists the choices).
'''),
("code", r'''
from fastsft_lab.lab.nbparams import parameters

globals().update(parameters("01", PROFILE, SMOKE))   # BENCH_MODEL, NUM_LAYERS, TOKENS, BACKENDS, ..., and why
'''),
("md", r'''
## A packed batch and its metadata
The packer (`fastsft_lab.data`) keeps each row's segment lengths as Python integers, padding tail included.
`PackedMetadata` turns them into what the kernels need, on the host: no device is touched until a layer asks,
and then it costs one pinned, non-blocking copy of `cu_seqlens` per device.
'''),
("code", r'''
from fastsft_lab.data import pack_examples, synthetic_corpus, unpack
from fastsft_lab.packing import PackedMetadata, available_backends

examples = synthetic_corpus(12, vocab_size=256, mix="short", max_len=60, seed=1)
batch = pack_examples(examples, 128, rows_per_batch=2)[0]
meta = PackedMetadata.from_batch(batch)
print("rows x tokens:", meta.shape, "| segments per row (padding tail last):", meta.seq_lengths)
print("cu_seqlens (host):", meta.cu_seqlens, "| max_seqlen:", meta.max_seqlen)
print("device objects built so far: none (the device side is built on first use, in the first layer)")
for name, st in available_backends(DEVICE).items():
    print(f"  {name:9s} {'runs' if st.available else 'no  '} {'(train)' if st.training else '       '} {st.reason}")
'''),
("md", r'''
## The pitfall: packed sequences that attend to each other in stock transformers
Stock transformers detects packing in `masking_utils` from `position_ids` (a new sequence starts where the position
does not increase by one) — but only when the model passes `position_ids` to `create_causal_mask` *and* no 2-D
`attention_mask` is given. We feed each model a packed batch as it is and compare each sequence's logits with the
same sequence run alone. A leak shows as a difference far above float32 noise. The cell stops with an error where a model does not behave as the
list after it says.
'''),
("code", r'''
from fastsft_lab.models import build_model, LoraSettings
from fastsft_lab.evidence import cross_contamination

def tiny(preset, **kw):
    model = build_model(preset, device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4), seed=0, **kw)
    torch.manual_seed(1)
    for name, p in model.named_parameters():   # PEFT starts lora_B at 0: give the A matrices a gradient path
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model.eval()

qwen, gpt = tiny("tiny-qwen3"), tiny("tiny-gpt-oss")
leaks = {}
for impl in ("eager", "sdpa"):   # flex_attention behaves the same (same masking_utils code; checked in the CUDA tests)
    qwen.get_base_model().set_attn_implementation(impl)
    leaks[f"Qwen3   + {impl:14s} no mask"] = cross_contamination(qwen, batch)
    leaks[f"Qwen3   + {impl:14s} all-ones attention_mask"] = cross_contamination(qwen, batch, attention_mask_ones=True)
qwen.get_base_model().set_attn_implementation("sdpa")
leaks[f"GPT-OSS + {'eager':14s} no mask"] = cross_contamination(gpt, batch)
leaks[f"GPT-OSS + {'eager':14s} all-ones attention_mask"] = cross_contamination(gpt, batch, attention_mask_ones=True)
leaking = {what: diff > 1e-3 for what, diff in leaks.items()}   # float32 noise is ~1e-7; a leak is ~1e-1
for what, diff in leaks.items():
    print(f"{what:55s} max |packed - alone| = {diff:.1e}  -> {'LEAK' if leaking[what] else 'kept apart'}")
# transformers 5.17, as the next cell explains: only Qwen3 without a 2-D mask keeps packed sequences apart
assert [w for w, leak in leaking.items() if not leak] == [w for w in leaks if w.startswith("Qwen3") and w.endswith("no mask")]
'''),
("md", r'''
What happens, precisely (transformers 5.17):
- **Qwen3** passes `position_ids` to `create_causal_mask`; with no 2-D mask, `find_packed_sequence_indices` finds
  the segments and the mask is block-diagonal (one host sync per forward for its `.all()` check). Correct.
- **Qwen3 with an all-ones `attention_mask`** (what a padding collator returns): `_preprocess_mask_arguments`
  only looks for packing when `attention_mask is None`, so the mask is plain causal across the whole row. Leak.
- **GPT-OSS** calls `create_causal_mask` / `create_sliding_window_causal_mask` *without* `position_ids`: packing is
  never detected, with `eager` (its default; it refuses `sdpa`) and with `flex_attention` alike (flex with sinks
  runs on CUDA only: `tests/test_packed_cuda.py::test_cuda_stock_flex_contamination_and_ours_does_not`). Leak.
  transformers' flash-attention path derives the boundaries from `position_ids` itself (in every layer: the naive
  path below), which would keep them apart; flash-attn is not installed on our machines.
'''),
("md", r'''
## The naive path measured: syncs in every layer
`fastsft_lab.apply(model, packed_attention=backend, packed_metadata_cache=False)` runs our backends with the metadata
rebuilt in every layer from `position_ids`, as the code we are replacing does (each backend's naive builder sits next
to its cached one in `fastsft_lab/packing/backends/<backend>.py`, with every sync it pays). `SyncCounter` counts,
per decoder layer, the operations that would sync a GPU (on a CPU too). Under gradient checkpointing they are paid
twice (forward and recompute), in every layer; the SDPA path also loops over the segments in Python and builds a
fresh T×T mask per layer.

The timeline draws one forward of each path at the width the speed measurement below uses (on a GPU four layers at
real width): host operations in grey, **red where the host waits for the device**, on a GPU the kernels in blue. A
red bar is a wait, as long as the GPU's backlog; the cost is the gap that follows on the GPU lane. The naive lane
stops in every layer; the cached lane builds the device side once, in the first layer, and never stops. The cell
stops with an error if a layer of the naive path pays no sync.
'''),
("code", r'''
import fastsft_lab
from fastsft_lab.data import benchmark_batches
from fastsft_lab.packing import packed_inputs
from fastsft_lab.profiling import SyncCounter, host_device_timeline

def syncs_per_layer(model, backend, cache, inputs):
    fastsft_lab.apply(model, packed_attention=backend, packed_metadata_cache=cache)
    with torch.no_grad(), SyncCounter.for_decoder_layers(model, device="cpu") as counter:
        model(**inputs)
    fastsft_lab.apply(model, packed_attention="off")
    return list(counter.per_module().values()), counter.total

naive_rows = {backend: syncs_per_layer(qwen, backend, False, batch.model_inputs()) for backend in ["sdpa", "varlen", "flex"]}
print("naive path, tiny Qwen3 (3 layers), one forward:")
for backend, (per_layer, total) in naive_rows.items():
    print(f"  {backend:7s} syncs per layer {per_layer}  total {total}")
assert all(min(per_layer) >= 1 for per_layer, _ in naive_rows.values()), "a layer of the naive path paid no sync"

wide = build_model(BENCH_MODEL, device=DEVICE, dtype=DTYPE, num_layers=None if SMOKE else 4, seed=0).eval()
wide_batch = benchmark_batches(tokens_per_step=TOKENS, steps=1, vocab_size=wide.config.vocab_size, mix=MIX)[0].to(DEVICE)

def forward_timeline(backend, cache):   # one forward, after a warm one; the cached path builds its metadata inside it
    fastsft_lab.apply(wide, packed_attention=backend, packed_metadata_cache=cache)
    make = (lambda: packed_inputs(wide_batch)) if cache else wide_batch.model_inputs
    run = lambda: wide(**{k: v for k, v in make().items() if k != "labels"}, logits_to_keep=1)   # the layers, no LM head
    with torch.no_grad():
        run()
        line = host_device_timeline(run, DEVICE)
    fastsft_lab.apply(wide, packed_attention="off")
    return line

lines = {f"{backend} {path}": forward_timeline(backend, path == "cached") for backend in BACKENDS for path in ("naive", "cached")}
layers = wide.config.num_hidden_layers
print(f"\none forward, {BENCH_MODEL} ({layers} layers), {TOKENS} tokens, {wide_batch.num_sequences} sequences:")
for name, line in lines.items():
    span = max([e for _, _, e, _ in line["host"]] + [e for _, _, e in line["gpu"]], default=0.0)
    print(f"  {name:14s} {span:7.2f} ms, {line['host_syncs']} host ops that waited for the device")
fig, ax = plt.subplots(figsize=(10, 3.4 if DEVICE == "cpu" else 5.5))
plots.plot_host_device_timeline(lines, ax=ax, what="one forward", title=f"one forward, {BENCH_MODEL} ({layers} layers), "
                                f"{TOKENS} tokens, {PROFILE.name}: red = the host waits for the device")
fig.tight_layout(); display(fig); plt.close(fig)
del wide
'''),
("md", r'''
## The fix
1. **Build once, on the host.** `PackedMetadata.from_batch(batch)` (or `PackedCollator`, for TRL) computes lengths,
   `cu_seqlens` and `max_seqlen` with Python ints. It is frozen: lengths are tuples, so an edited tensor can never be
   served a stale mask (the bug class of caches keyed on a tensor's identity).
2. **Move lazily, once.** The first layer that needs it triggers one pinned non-blocking copy of `cu_seqlens`;
   per-token segment ids and positions are derived on the device (no read-back). Each backend object (dense mask per
   dtype and window, flex `BlockMask`, xFormers bias) is built once and cached on the metadata object.
3. **Reach every layer the transformers way.** `model(**inputs, packed_metadata=meta)`: transformers forwards extra
   keyword arguments down to the attention function, PEFT passes them, and gradient checkpointing wraps them in a
   `functools.partial`, so the recompute sees the same object — nothing is rebuilt.
4. **Backends through `AttentionInterface`** (no edits to modeling files). Their names avoid the substrings
   transformers interprets (`sdpa`, `flash`, `flex_attention`), so GPT-OSS accepts them and no stock mask is built.

```python
import fastsft_lab
fastsft_lab.apply(model, packed_attention="varlen")   # metadata cached by default; returns the model's ModelState
loss = model(**batch, packed_metadata=meta).loss      # or: batch = PackedCollator(max_tokens=4096)(examples)
fastsft_lab.apply(model, packed_metadata_cache=False) # the naive path, live, for comparison
fastsft_lab.apply(model, packed_attention="off")      # exactly the original attn_implementation
```
'''),
("md", r'''
The cell below counts the syncs of the cached path (none inside the layers; one per step when the model hook has
to recover the metadata from `position_ids`). Then the recompute: gradient checkpointing recomputes each layer in the
backward pass, and the recompute must reuse the metadata, not rebuild it: one device copy and one mask per distinct window for the whole step, against two builds per layer on the
naive path.
'''),
("code", r'''
# NBVAL_CHECK_OUTPUT
from fastsft_lab.packing import BuildLog      # a debug hook: counts every metadata object built while open
from fastsft_lab.models import decoder_layers

cached_rows = {backend: syncs_per_layer(qwen, backend, True, packed_inputs(batch)) for backend in ["sdpa", "varlen", "flex"]}
recovered = syncs_per_layer(qwen, "sdpa", True, batch.model_inputs())   # no metadata given: recovered once per step
print("cached path, tiny Qwen3, one forward:")
for backend, (per_layer, total) in cached_rows.items():
    print(f"  {backend:7s} syncs per layer {per_layer}  total {total}")
print(f"  sdpa, metadata recovered from position_ids by the model hook: per layer {recovered[0]}  total {recovered[1]}")

ckpt = tiny("tiny-gpt-oss", gradient_checkpointing=True).train()
fastsft_lab.apply(ckpt, packed_attention="sdpa")
with BuildLog() as cached_log:
    ckpt(**packed_inputs(batch)).loss.backward()
fastsft_lab.apply(ckpt, packed_metadata_cache=False)
with BuildLog() as naive_log:
    ckpt(**packed_inputs(batch)).loss.backward()
state = fastsft_lab.apply(ckpt, packed_attention="off")   # every switch returns the model's ModelState
print(f"\ntiny GPT-OSS, {len(decoder_layers(ckpt))} layers (sliding + full), checkpointed forward + backward:")
print("  cached: builds per step", dict(cached_log.cached))
print("  naive : dense masks built per step", naive_log.naive["dense"])
print("after apply(packed_attention='off'): packed =", state.packed)
'''),
("md", r'''
## Equivalence first: every backend against each sequence run alone
Reference: the untouched stock model (sdpa for Qwen3, eager for GPT-OSS) on each sequence *alone*. We compare the
packed logits and the LoRA gradients of the summed token loss, cached and naive, float32. GPT-OSS exercises GQA, the
attention sinks and its sliding window (8 tokens in the tiny preset, shorter than most test sequences).
'''),
("code", r'''
# NBVAL_CHECK_OUTPUT
def lora_grads(model, runs):
    model.zero_grad(set_to_none=True)
    for kwargs in runs:
        model(**kwargs, num_items_in_batch=1).loss.backward()   # summed token losses
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

def rel_err(a, b):
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max()).item() for k in b)

checks = []
for name, model in (("tiny-qwen3", qwen), ("tiny-gpt-oss", gpt)):
    with torch.no_grad():
        alone_logits = [model(input_ids=s.input_ids).logits[0] for s in unpack(batch)]
    alone_grads = lora_grads(model, [{"input_ids": s.input_ids, "labels": s.labels} for s in unpack(batch)])
    for backend in ["eager", "sdpa", "varlen", "flex"]:
        for cache in (True, False):
            fastsft_lab.apply(model, packed_attention=backend, packed_metadata_cache=cache)
            with torch.no_grad():
                packed = model(input_ids=batch.input_ids, position_ids=batch.position_ids,
                               packed_metadata=PackedMetadata.from_batch(batch)).logits
            logit_err = max((packed[s.row, s.start:s.start + s.length] - a).abs().max().item()
                            for s, a in zip(unpack(batch), alone_logits))
            grad_err = None
            if available_backends("cpu")[backend].training:
                grad_err = rel_err(lora_grads(model, [packed_inputs(batch)]), alone_grads)
            fastsft_lab.apply(model, packed_attention="off")
            checks.append((name, backend, "cached" if cache else "naive", logit_err, grad_err))
print(f"{'model':13s} {'backend':8s} {'path':7s} logits == alone   LoRA grads == alone")
for name, backend, path, logit_err, grad_err in checks:
    grads = "n/a (no CPU backward)" if grad_err is None else str(grad_err < 2e-5)
    print(f"{name:13s} {backend:8s} {path:7s} {str(logit_err < 1e-5):17s} {grads}")
'''),
("md", r'''
## The fix measured
The shared harness (`fastsft_lab.lab.harness.run_variants`) interleaves, per backend: **naive** (rebuilt per
layer), **cached** (built from host lengths inside the timed step, first layer builds the device objects),
**oracle** (everything prebuilt outside the timed region: the zero-overhead limit, drawn as a dotted line) and
**stock** transformers (what a user would otherwise run). QLoRA on a GPU, gradient checkpointing on; median
[p20–p80] of each phase. On a CPU the numbers only show the harness working: a CPU has no launch queue to stall.
The GPU figures follow.
'''),
("code", r'''
from fastsft_lab.lab.harness import run_variants, make_result, format_table
from fastsft_lab.lab.scenarios.packed import packed_variants
from fastsft_lab.data import benchmark_batches

bench_model = build_model(BENCH_MODEL, device=DEVICE, dtype=DTYPE, quant=QUANT, lora=LoraSettings(rank=16),
                          num_layers=NUM_LAYERS, gradient_checkpointing=True)
for p in bench_model.parameters():
    if p.requires_grad and p.dim() == 2 and not p.any():
        torch.nn.init.normal_(p, std=0.01)
bench_batches = [b.to(DEVICE) for b in benchmark_batches(tokens_per_step=TOKENS, steps=STEPS,
                                                         vocab_size=bench_model.config.vocab_size, mix=MIX)]
print(f"{BENCH_MODEL}: {bench_model.config.num_hidden_layers} layers | {TOKENS} tokens/step | "
      f"{bench_batches[0].num_sequences} sequences in the first step")
for backend in BACKENDS:
    stock = "flex_attention" if backend == "flex" else "sdpa"
    rows = run_variants(bench_model, bench_batches, packed_variants(bench_model, backend, torch.device(DEVICE), stock=stock),
                        steps=STEPS - 1, warmup=1, progress=False)
    result = make_result("packed_metadata", {"model": BENCH_MODEL, "num_layers": bench_model.config.num_hidden_layers,
                                             "tokens_per_step": TOKENS, "backend": backend, "mix": MIX}, rows, DEVICE)
    print(f"\n{backend}\n{format_table(result)}")
    fig = plots.plot_result(result, phases=("forward", "step"), limit=f"{backend} oracle",
                            title=f"measured here: {backend} | {BENCH_MODEL} ({bench_model.config.num_hidden_layers} "
                                  f"layers) | {TOKENS} tokens/step | {PROFILE.name}")
    display(fig); plt.close(fig)
'''),
("md", r'''
### On the GPU (committed results)
The full benchmark (`python -m fastsft_lab bench --only packed`, `--set packed.sweep=true` for the regime map)
writes one JSON per configuration; every configuration, the newest measurement of each, is tabled in
[docs/results.md](../docs/results.md) (the regime table). Here: the headline configuration, Qwen3-14B width at 8192
tokens of realistic lengths, from the newest run that measured all three backends there: every variant's step time
against stock transformers, then one chart per backend. At this width what beats stock is the kernel (varlen or
flex against SDPA), far more than the cache. Last, what the committed runs say, computed from them.
'''),
("code", r'''
from fastsft_lab.lab import report

gpu = results.packed_configs()          # the newest measurement of each configuration that ran the naive path
headline = results.packed_headline("qwen3-14b", tokens=8192, mix="realistic")
print(report.packed_variants_text(headline))
for d in headline:
    c = d["config"]
    fig = plots.plot_result(d, phases=("forward", "step"), limit=f"{c['backend']} oracle",
                            title=f"{c['backend']} | {c['model']} ({c['num_layers']} layers) | {c['tokens_per_step']} "
                                  f"tokens | {c['mix']} | {results.describe_run(d)}")
    display(fig); plt.close(fig)
print("\n" + report.packed_findings_text(gpu))
'''),
("md", r'''
The regime map: the cached path's speed over the naive one against tokens per step, per model, backend and length
mix, from the regime sweeps (`results.packed_regime()`: the newest measurement of each point, so sessions are never
drawn on top of each other). A point whose newest run has no naive/cached ratio is drawn as missing: an older run's
ratio never stands in for it.

### Metadata built in the collator: the step pays nothing
`PackedCollator(prebuild=...)` builds every table (flex's `BlockMask` tables included) in the DataLoader worker,
pinned; the step only copies them. The packed benchmark times it as `<backend> cached (collated)` beside the cached
path and the oracle (metadata prebuilt outside the timed region), the newest run of each configuration that timed it.
Target: within 0.5% of the oracle on every backend from 4k to 16k tokens.
'''),
("code", r'''
regime = results.packed_regime()
print(report.packed_regime_text(regime))
fig = plots.plot_regime(regime)
display(fig); plt.close(fig)
collated = results.packed_configs(collated=True)
print("\n" + report.packed_collated_text(collated))
for model in sorted({results.packed_key(d)[:2] for d in collated}):
    fig = plots.plot_limit_gap([d for d in collated if results.packed_key(d)[:2] == model])
    if fig is not None:
        display(fig); plt.close(fig)
'''),
("md", r'''
### What the GPU runs say
- **Against the limit**: the findings above count the configurations where the cached path runs within 1% of the
  oracle (metadata prebuilt outside the timed region), and list those whose difference is larger than the oracle's
  own spread: there the cache still costs something measurable.
- **The gain is a regime result**, read in the largest and smallest gains above: the naive path pays most where it
  rebuilds more per layer (SDPA's T×T mask, the per-segment loop of `segments`) and where the layer's own work is
  small next to it; kernels that take `cu_seqlens` directly (varlen) leave little to win.
- **Against stock transformers** at Qwen3-14B width and 8k tokens, the backend choice (varlen or flex against SDPA)
  matters more than the cache (the headline table above).
- **flex**: packed GPT-OSS in bf16 can route a near-tie token to another expert than the same sequence run alone
  (in float32 packed == alone exactly; notebook 03 counts such flips), so the MoE test compares the tokens routed
  alike. At 16k tokens `create_block_mask` compiles for minutes; the cached path builds its `BlockMask` from host
  lengths instead. With flex, give the collator `max_tokens` (every row one length: one compiled shape).

Session notes: `benchmarks/results/<run>/README.md`.
'''),
("md", r'''
## What it costs
- **Memory.** The SDPA backend keeps one additive mask per distinct sliding window for the whole step:
  rows × T² × 2 bytes in bf16 — 32 MiB at T = 4096, 512 MiB at T = 16384 (stock transformers keeps a boolean mask
  of half that, but SDPA converts it to a float one in *every* call). varlen and flex keep only `cu_seqlens` and a
  `BlockMask` (a few MiB): prefer them for long rows.
- **Host work.** Building `PackedMetadata` is O(number of segments) in Python, done at collate time (in the
  `DataLoader` worker with `PackedCollator`).
- **API.** The metadata travels as a model keyword (`packed_metadata=`), so a custom training loop must pass it (or
  let the model hook recover it from `position_ids` at one sync per step). `generate()` and calls with a KV cache run
  the model's own attention, so training and sampling alternate on one model.
- **Where it does not help much.** If the kernel already takes `cu_seqlens` from the batch (TRL's padding-free
  collator with flash-attention) the per-layer syncs are gone; what remains is the mask or `BlockMask` build for
  SDPA/flex. The gain is largest with many short sequences, thin layers (small models) and SDPA.
'''),
("md", r'''
## Summary, next bottleneck and further reading
- Build packed-attention metadata **once per batch, on the host**; pass it to the layers as an attention kwarg;
  never derive it from device tensors inside a layer.
- Stock transformers 5.17 keeps packed Qwen3 rows apart only without a 2-D mask, and never keeps packed GPT-OSS rows
  apart with eager/flex attention; `fastsft_lab.packing` backends do, including GPT-OSS sinks and sliding windows.
- Proofs: `tests/test_packed_*.py` (every backend vs each sequence alone, logits and LoRA gradients; naive == cached;
  hypothesis over random lengths; sync counts; TRL `SFTTrainer` losses equal to the plain path).

**Next bottleneck.** With the metadata built once, the attention layers pay no sync, and what the step spends is
the kernels themselves: pick the one that takes `cu_seqlens` (varlen, flex) over SDPA's dense mask. Past attention,
the checkpointed step still holds one layer input per layer in GPU memory, and offloading those to the host must
not cost time: notebook 02.

Further reading: transformers' attention interface (`AttentionInterface`, `masking_utils.py`,
`modeling_flash_attention_utils.py`); FlashAttention-2 varlen API (Dao, 2023); *FlexAttention* (PyTorch blog, 2024);
xFormers `BlockDiagonalCausalMask`; Unsloth's blog post on packed-sequence training and `unsloth/utils/packing.py`;
attention sinks (Xiao et al., 2023) and the GPT-OSS model card.
'''),
("code", r'''
print(f"notebook ran in {time.time() - T0:.0f} s on: {describe()}")
if DEVICE == "cuda":
    print(f"peak GPU memory over the notebook: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
else:
    print("peak memory: not tracked on a CPU (it is a CUDA allocator statistic)")
'''),
]
