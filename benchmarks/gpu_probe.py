"""Probe a GPU machine for the APIs fastsft_lab's CUDA paths depend on (versions differ from the CPU dev box).

Run: python benchmarks/gpu_probe.py  (prints a report; nothing here is a benchmark figure).
"""

import inspect
import importlib
import time

import torch


def section(title):
    print(f"\n## {title}", flush=True)


def attempt(label, fn):
    try:
        out = fn()
        print(f"[ok] {label}: {out}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"[FAIL] {label}: {type(e).__name__}: {str(e)[:400]}", flush=True)


section("versions")
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.get_device_name(0),
      "cap", torch.cuda.get_device_capability(0))
for mod in ("transformers", "peft", "accelerate", "bitsandbytes", "trl", "datasets", "xformers", "triton",
            "flash_attn", "nbformat", "nbclient", "ipykernel"):
    attempt(mod, lambda m=mod: getattr(importlib.import_module(m), "__version__", "?"))

section("aten schemas")
for op in ("_flash_attention_forward", "_flash_attention_backward", "_scaled_dot_product_efficient_attention",
           "_scaled_dot_product_efficient_attention_backward", "_grouped_mm"):
    attempt(op, lambda o=op: str(getattr(torch.ops.aten, o).default._schema))

section("varlen")
try:
    from torch.nn.attention import varlen as V

    print("varlen_attn signature:", inspect.signature(V.varlen_attn))
    print("members:", [n for n in dir(V) if not n.startswith("__")])
except Exception as e:  # noqa: BLE001
    print("no varlen:", e)


def varlen_check():
    from torch.nn.attention.varlen import varlen_attn

    sig = inspect.signature(varlen_attn).parameters
    T, Hq, Hk, D = 96, 8, 2, 64
    q = torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(T, Hk, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(T, Hk, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 40, 96], device="cuda", dtype=torch.int32)
    kwargs = {}
    if "window_size" in sig:
        kwargs["window_size"] = (-1, 0)
    elif "is_causal" in sig:
        kwargs["is_causal"] = True
    if "enable_gqa" in sig:
        kwargs["enable_gqa"] = True
    if "return_aux" in sig:
        from torch.nn.attention.varlen import AuxRequest

        kwargs["return_aux"] = AuxRequest(lse=True)
    out = varlen_attn(q, k, v, cu, cu, 56, 56, **kwargs)
    o, lse = out if isinstance(out, tuple) else (out, None)
    o.float().sum().backward()
    return f"gqa out {tuple(o.shape)} lse {None if lse is None else (tuple(lse.shape), lse.dtype, lse.requires_grad)} kwargs {list(kwargs)}"


attempt("varlen GQA causal", varlen_check)


def aten_flash_gqa_window():
    T, Hq, Hk, D = 96, 8, 2, 64
    q = torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, Hk, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, Hk, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 40, 96], device="cuda", dtype=torch.int32)
    res = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, 56, 56, 0.0, True, False, scale=D ** -0.5,
                                                  window_size_left=7, window_size_right=0)
    out, lse = res[0], res[1]
    g = torch.randn_like(out)
    back = torch.ops.aten._flash_attention_backward(g, q, k, v, out, lse, cu, cu, 56, 56, 0.0, True, res[2], res[3],
                                                    scale=D ** -0.5, window_size_left=7, window_size_right=0)
    return f"out {tuple(out.shape)} lse {tuple(lse.shape)} grads {[tuple(t.shape) for t in back]}"


attempt("aten flash fwd/bwd GQA + window", aten_flash_gqa_window)

section("flex attention")


def flex_check():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, T, D = 1, 4, 256, 64
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    bm = create_block_mask(lambda b, h, qi, ki: qi >= ki, B, None, T, T, device="cuda")
    t = time.time()
    out, lse = flex_attention(q, k, v, block_mask=bm, return_lse=True)
    (out.float().sum() + lse.float().sum()).backward()
    torch.cuda.synchronize()
    gqa = "enable_gqa" in inspect.signature(flex_attention).parameters
    return f"lse grad ok, q.grad {q.grad.abs().sum().item():.3f}, {time.time() - t:.1f}s, enable_gqa={gqa}"


attempt("flex return_lse + backward through lse", flex_check)

section("grouped mm")


def gmm():
    E, K, N = 4, 128, 256
    x = torch.randn(64, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(E, K, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    offs = torch.tensor([10, 10, 40, 64], device="cuda", dtype=torch.int32)
    fn = getattr(torch.nn.functional, "grouped_mm", None) or torch._grouped_mm
    y = fn(x, w, offs=offs)
    y.float().sum().backward()
    ref = torch.cat([x[:10] @ w[0], x[10:40] @ w[2], x[40:] @ w[3]])
    return f"{fn.__module__}.{fn.__name__} max diff {(y - ref).abs().max().item():.3g} grads ok"


attempt("grouped_mm bf16 fwd/bwd", gmm)

section("bitsandbytes")


def bnb_check():
    import bitsandbytes as bnb

    lin = bnb.nn.Linear4bit(256, 128, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4", device="meta")
    lin.weight = bnb.nn.Params4bit(torch.randn(128, 256, device="cuda", dtype=torch.bfloat16), requires_grad=False,
                                   quant_type="nf4")
    lin = lin.to("cuda")
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    lin(x).sum().backward()
    return f"NF4 from a CUDA tensor ok, weight {lin.weight.dtype} {tuple(lin.weight.shape)}"


attempt("bnb NF4 quantize-on-device", bnb_check)

section("xformers")


def xf():
    from xformers.ops import fmha

    m = fmha.attn_bias.BlockDiagonalCausalMask.from_seqlens([3, 5])
    q = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    try:
        fmha.memory_efficient_attention(q, q, q, attn_bias=m)
        return "kernels run"
    except Exception as e:  # noqa: BLE001
        return f"mask ok, attention fails: {type(e).__name__}: {str(e)[:200]}"


attempt("xformers", xf)

section("sync debug mode")


def sync_debug():
    import warnings

    y = torch.arange(10.0, device="cuda")
    with warnings.catch_warnings(record=True) as log:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        y.sum().item()
        y.nonzero()
        torch.cuda.set_sync_debug_mode(0)
    return [str(w.message)[:80] for w in log]


attempt("set_sync_debug_mode warn", sync_debug)

section("pinned copy bandwidth")


def bw():
    n = 256 * 2**20
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d = torch.empty(n, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        d.copy_(h, non_blocking=True)
        h.copy_(d, non_blocking=True)
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); d.copy_(h, non_blocking=True); e.record(); torch.cuda.synchronize()
    h2d = n / (s.elapsed_time(e) / 1e3) / 1e9
    s.record(); h.copy_(d, non_blocking=True); e.record(); torch.cuda.synchronize()
    d2h = n / (s.elapsed_time(e) / 1e3) / 1e9
    return f"H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s"


attempt("pinned copies 256 MiB", bw)
print("\nprobe done", flush=True)
