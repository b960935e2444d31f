"""Two open flex questions of issue 3, on a GPU (diagnostic, not a test; ~2-3 min).

  python benchmarks/flex_diag.py gpt-oss    # why tiny GPT-OSS + flex misses packed == alone in bf16 (0.071 > 0.051)
  python benchmarks/flex_diag.py stall T    # where the first compiled flex call of T tokens inside checkpointing
                                            # spends its time (faulthandler dumps every thread's stack every 40 s)

gpt-oss prints, for sdpa / varlen / flex in bf16 and float32: the largest |packed - alone| logit difference, how
many tokens' MoE routing (top-k experts of any layer) differs between the packed and the alone runs, and, for flex,
every layer's attention output against a float32 reference computed from the same inputs and the same mask.
"""
import faulthandler
import os
import sys
import time

import torch

from fastsft_lab import packing as P
from fastsft_lab.evidence import packed_vs_alone
from fastsft_lab.packing.backends import eager as E, flex as FX
from fastsft_lab.data import pack_examples, synthetic_corpus, unpack
from fastsft_lab.models import LoraSettings, build_model


DEV = os.environ.get("DIAG_DEVICE", "cuda")


def batch():
    ex = synthetic_corpus(12, vocab_size=256, mix="short", max_len=60, seed=1)   # tests/_packed_helpers.py make_batch
    return pack_examples(ex, 128, rows_per_batch=2)[0].to(DEV)


def routing(model, call):
    """Top-k expert ids of every MoE router, per layer, for one forward."""
    got, hooks = [], []
    for name, mod in model.named_modules():
        if name.endswith("mlp.router"):
            hooks.append(mod.register_forward_hook(lambda m, i, o: got.append(o)))
    try:
        with torch.no_grad():
            call()
    finally:
        for h in hooks:
            h.remove()
    out = []
    for o in got:
        idx = [t for t in (o if isinstance(o, tuple) else (o,)) if t.dtype in (torch.int64, torch.int32)]
        out.append(idx[0] if idx else None)
    return out


def flips(model, b):
    """Tokens whose chosen experts differ (as a set) between the packed run and the sequence run alone."""
    inputs = P.packed_inputs(b)
    packed = routing(model, lambda: model(**{k: v for k, v in inputs.items() if k != "labels"}))
    if not packed or packed[0] is None:
        return "n/a"
    rows = b.input_ids.shape[0]
    n = 0
    for s in unpack(b):
        alone = routing(model, lambda: model(input_ids=s.input_ids))
        for pl, al in zip(packed, alone):
            pr = pl.reshape(rows, -1, pl.shape[-1])[s.row, s.start:s.start + s.length]
            ar = al.reshape(-1, al.shape[-1])
            n += int((pr.sort(-1).values != ar.sort(-1).values).any(-1).sum())
    return n


def flex_layer_errors(model, b):
    from torch.nn.attention.flex_attention import create_mask

    errs, orig = [], FX.flex_attention_packed

    def wrapped(q, k, v, block_mask, *, scale, sinks=None):
        out = orig(q, k, v, block_mask, scale=scale, sinks=sinks)
        t, tp = q.shape[2], block_mask.seq_lengths[0]
        allowed = create_mask(block_mask.mask_mod, q.shape[0], 1, tp, tp, q.device)[..., :t, :t]
        mask = torch.zeros(allowed.shape, device=q.device).masked_fill(~allowed, float("-inf"))
        ref = E.eager_attention(q.float(), k.float(), v.float(), mask, scale=scale,
                                sinks=None if sinks is None else sinks.float())[0]
        errs.append((t, (out.float() - ref).abs().max().item(), ref.abs().max().item()))
        return out

    FX.flex_attention_packed = wrapped
    try:
        with torch.no_grad():
            inputs = P.packed_inputs(b)
            model(**{k: v for k, v in inputs.items() if k != "labels"})
    finally:
        FX.flex_attention_packed = orig
    return errs


def gpt_oss():
    b = batch()
    print("rows", b.input_ids.shape, "lengths", b.seq_lengths, flush=True)
    for dtype in (torch.bfloat16, torch.float32):
        for backend in ("sdpa", "varlen", "flex"):
            t0 = time.time()
            try:
                model = build_model("tiny-gpt-oss", device=DEV, dtype=dtype, lora=LoraSettings(rank=4),
                                    gradient_checkpointing=True, seed=0)
                model.eval()
                with torch.no_grad():
                    scale = max(model(input_ids=s.input_ids).logits.abs().max().item() for s in unpack(b))
                P.enable_packed_attention(model, backend)
                d = packed_vs_alone(model, b)
                line = (f"{str(dtype):15} {backend:7} packed-vs-alone {d:.4g} (allowed {3e-2 * scale + 3e-2:.4g}, "
                        f"logit scale {scale:.3g}); tokens with other experts: {flips(model, b)}")
                if backend == "flex":
                    errs = flex_layer_errors(model, b)
                    line += "\n    flex layer |out - fp32 ref| (T, err, ref scale): " + \
                        ", ".join(f"({t}, {e:.3g}, {s:.3g})" for t, e, s in errs)
                print(line, f"({time.time() - t0:.0f}s)", flush=True)
            except Exception as e:  # noqa: BLE001 - a diagnostic: report and go on
                print(f"{str(dtype):15} {backend:7} {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)


def stall(tokens: int):
    faulthandler.dump_traceback_later(40, repeat=True)
    sys.argv = [sys.argv[0], "--checkpoint-first", str(tokens)]
    import runpy

    runpy.run_path(__file__.replace("flex_diag.py", "flex_probe.py"), run_name="__main__")


if __name__ == "__main__":
    if sys.argv[1:2] == ["gpt-oss"]:
        gpt_oss()
    elif sys.argv[1:2] == ["stall"]:
        stall(int(sys.argv[2]))
    else:
        raise SystemExit(__doc__)
