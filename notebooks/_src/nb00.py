FILENAME = "00_naive_path_profiled.ipynb"

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
the real Qwen3-14B architecture (random weights, NF4 + LoRA r=16) — about 10 GB of GPU memory for the weights; on
GPUs under 40 GB it falls back to Qwen3-0.6B.

**The problem.** Once attention and matmul kernels are fast, a fine-tuning step still pays for the code *between*
kernels: metadata rebuilt in every layer, device→host reads that stall the launch queue, memory copies that do not
overlap compute, and Python loops over experts. This notebook measures the unoptimized path so that the next ones
have a baseline.
'''),
("colab", ""),                # the shared Colab install cell (build.py)
("code", r'''
import time
import torch
import fastsft_lab
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
GPU_GB = torch.cuda.get_device_properties(0).total_memory / 2**30 if has_cuda() else 0
if SMOKE:
    MODEL, NUM_LAYERS, TOKENS, ROW_TOKENS, STEPS = "tiny-qwen3", None, 1024, 512, 4
    MOE_MODEL, MOE_LAYERS, MOE_TOKENS = "tiny-gpt-oss", None, 512
else:
    MODEL = "qwen3-14b" if GPU_GB >= 40 else "qwen3-0.6b"
    NUM_LAYERS, TOKENS, ROW_TOKENS, STEPS = None, 8192, 8192, 4     # None = all layers (40 for Qwen3-14B)
    MOE_MODEL, MOE_LAYERS, MOE_TOKENS = "gpt-oss-20b", 4, 8192       # 4 of GPT-OSS-20B's 24 layers, real width
LORA_RANK = 16
DEVICE = "cuda" if has_cuda() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
print(dict(MODEL=MODEL, NUM_LAYERS=NUM_LAYERS, TOKENS=TOKENS, ROW_TOKENS=ROW_TOKENS, DEVICE=DEVICE))
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
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(9, 0.5 + 0.35 * b0.shape[0]))
for r, (row, pad) in enumerate(zip(b0.seq_lengths, b0.pad_lengths)):
    start = 0
    for j, n in enumerate(row):
        is_pad = pad and j == len(row) - 1
        ax.barh(r, n, left=start, color="lightgray" if is_pad else plt.cm.tab20(j % 20), edgecolor="white")
        start += n
ax.set_yticks(range(b0.shape[0])); ax.set_yticklabels([f"row {r}" for r in range(b0.shape[0])])
ax.set_xlabel("token position"); ax.set_title("One packed batch: each colour is one sequence (grey: padding tail)")
plt.tight_layout(); plt.show()
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
    print(f"GPU memory after build: {torch.cuda.memory_allocated()/2**30:.1f} GiB")
batches = [b.to(DEVICE) for b in batches]
'''),
("md", r'''
## A training step on the stock path
Stock transformers (`sdpa` attention) given packed `position_ids` and no mask: Qwen3's model detects the packing
once per forward and builds one block-diagonal mask (that detection reads one boolean back from the GPU).
The harness interleaves variants, so here it simply repeats the step; it reports median [p20–p80].
'''),
("code", r'''
from fastsft_lab.bench import Variant, run_variants, make_result, format_table

variants = [Variant("stock transformers sdpa", toggles={"attn": "sdpa"},
                    note="transformers 5.x Qwen3 + sdpa, packed position_ids, no attention mask")]
try:  # optimization 1's naive path: metadata rebuilt in every layer (see notebook 01)
    from fastsft_lab import packed
    variants += packed.naive_variants(model, backends=["sdpa"])
except (ImportError, AttributeError) as e:
    print("per-layer naive variant not available:", e)
res = run_variants(model, batches, variants, steps=STEPS - 1, warmup=1, progress=False)
result = make_result("00-naive-path", {"model": MODEL, "num_layers": info.num_layers, "tokens_per_step": TOKENS,
                                       "quant": "nf4", "lora_rank": LORA_RANK, "gradient_checkpointing": True}, res, DEVICE)
print(format_table(result))
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
for op in prof.top_ops:
    print(f"{op['self_ms']:10.2f} ms  {op['calls']:6d} calls  {op['name']}")
'''),
("md", r'''
## Memory: what checkpointing buys, and what offloading would add
Checkpointing keeps one tensor per decoder layer (its input) instead of every activation. Offloading those inputs
to pinned CPU memory (notebook 02) removes even that — if the copies hide behind compute.
'''),
("code", r'''
if DEVICE == "cuda":
    rows = []
    for ckpt in (True, False):
        if ckpt: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else: model.gradient_checkpointing_disable()
        torch.cuda.synchronize(); reset_peak_memory()
        try:
            t = time.time(); one_step(); torch.cuda.synchronize()
            rows.append((ckpt, time.time() - t, peak_memory() / 2**30))
        except torch.cuda.OutOfMemoryError:
            rows.append((ckpt, float("nan"), float("nan"))); opt.zero_grad(set_to_none=True); torch.cuda.empty_cache()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for ckpt, sec, gib in rows:
        print(f"gradient checkpointing={ckpt!s:5s}  step {sec*1e3:8.1f} ms (single run)  peak {gib:6.1f} GiB")
else:
    print("CPU run: no device memory to report (peak memory is a CUDA statistic)")
'''),
("md", r'''
## The MoE expert loop (GPT-OSS)
transformers' eager `GptOssExperts` asks, for every expert that got tokens, *which* tokens (`torch.where` on a mask):
host syncs per expert hit, per layer. transformers 5.x defaults to its `grouped_mm` experts path instead (sort +
histogram + grouped matmul); notebook 03 measures both against our grouping.
'''),
("code", r'''
from fastsft_lab.models import decoder_layers

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
## The three bottlenecks this series fixes
1. **Attention metadata rebuilt in every layer** (notebook 01). Packed batches need `cu_seqlens`, `max_seqlen` or a
   block-diagonal mask. Per-layer code derives them from `position_ids` with host syncs (`nonzero`, `.item()`,
   `.tolist()`) — dozens per step. Fix: build once per batch from the host-side lengths, reuse in every layer.
2. **Offloaded checkpoint reloads that do not overlap** (notebook 02). Offloading checkpointed layer inputs to CPU
   saves GPU memory, but a single staging buffer makes copies and compute take turns (and `save_on_cpu` copies on the
   compute stream). Fix: two buffers with events, reloads prefetched on a side stream.
3. **MoE routing that asks per expert** (notebook 03). The eager loop syncs once per hit expert per layer. Fix: sort
   tokens by expert once (argsort + counts + offsets); then a sync-free grouped matmul.

Each notebook proves its fix changes no numbers before it shows a speedup.
'''),
("code", r'''
print(f"notebook ran in {time.time() - T0:.0f} s on: {describe()}")
if DEVICE == "cuda":
    print(f"peak GPU memory over the notebook: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
'''),
]
