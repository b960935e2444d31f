"""Where does compiled flex attention fail at 16k tokens on torch 2.11? (GPU diagnostic, ~1 min)

Qwen3-14B attention shapes (40 query heads, 8 kv heads, head dim 128), bf16, one packed row from the realistic mix;
flex forward + backward through fastsft_lab's kernel, plain and under non-reentrant checkpointing (which runs inside
torch._disable_dynamo). Prints one line per case: ok, or the exception's first line.
Usage: python benchmarks/flex_probe.py [--checkpoint-first] [TOKENS ...]   (default 4096 16384)
"""
import sys
import time
import traceback

import torch
import torch.utils.checkpoint as cp

from fastsft_lab.packing import PackedMetadata
from fastsft_lab.packing.backends import flex as FX
from fastsft_lab.data import benchmark_batches


def case(tokens: int, checkpointed: bool, sinks: bool) -> str:
    batch = benchmark_batches(tokens_per_step=tokens, row_tokens=tokens, steps=1, vocab_size=1000, mix="realistic")[0]
    meta = PackedMetadata.from_batch(batch)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 40, tokens, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k = torch.randn(1, 8, tokens, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    v = torch.randn(1, 8, tokens, 128, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    s = torch.zeros(40, device="cuda", dtype=torch.bfloat16, requires_grad=True) if sinks else None
    bm = FX.block_mask(meta, "cuda")

    def f(q, k, v):
        return FX.flex_attention_packed(q, k, v, bm, scale=128 ** -0.5, sinks=s)

    t = time.time()
    try:
        out = cp.checkpoint(f, q, k, v, use_reentrant=False) if checkpointed else f(q, k, v)
        out.float().sum().backward()
        torch.cuda.synchronize()
        return f"ok ({time.time() - t:.1f}s)"
    except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
        tb = traceback.extract_tb(e.__traceback__)
        where = next((f"{fr.filename.split('site-packages/')[-1]}:{fr.lineno}" for fr in reversed(tb)
                      if "torch" in fr.filename), "?")
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]} (last torch frame {where})"


if __name__ == "__main__":
    # --checkpoint-first: compile each shape for the first time inside checkpointing (the model benchmark's order;
    # the first run of this probe compiled outside it first and passed at 16k where the model run failed)
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    order = (True, False) if "--checkpoint-first" in sys.argv else (False, True)
    print(torch.__version__, torch.cuda.get_device_name(), "order: checkpoint", order)
    for tokens in [int(x) for x in (args or ["4096", "16384"])]:
        for checkpointed in order:
            for sinks in (False, True):
                print(f"T={tokens:6d} checkpoint={checkpointed!s:5} sinks={sinks!s:5}:", case(tokens, checkpointed, sinks),
                      flush=True)
