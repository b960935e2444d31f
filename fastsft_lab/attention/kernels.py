"""Attention over packed rows, per backend, with GQA, sliding windows and GPT-OSS attention sinks.

Every function takes transformers' layout -- query (B, H, T, D), key/value (B, Hkv, T, D) -- plus the backend's
metadata object (a mask, ``cu_seqlens``, a ``BlockMask``...), and returns (B, T, H, D) as transformers' attention
functions do. Where the metadata comes from (cached once per batch, or rebuilt per layer) is not their business.

Attention sinks (GPT-OSS): one learned logit ``sink_h`` per head joins every softmax row and takes no value:
``p_ij = exp(s_ij) / (sum_j exp(s_ij) + exp(sink_h))``. Equivalently the plain attention output is scaled by
``sigmoid(lse_i - sink_h)`` where ``lse_i`` is the row's log-sum-exp. Per backend:

* SDPA: a virtual "sink key" per head (an extra head-dim coordinate: q' = [q, 1], k' = [k, 0], sink key
  [0, sink/scale], value 0), always visible: exact, and autograd differentiates it.
* varlen: a ``torch.autograd.Function`` that rescales by ``sigmoid(lse - sink)``; its backward runs the kernel's
  own backward with (out', lse' = logaddexp(lse, sink)), which gives exact dq, dk, dv, and
  d sink_h = -sum_i exp(sink_h - lse'_i) * rowsum(dout_i * out'_i).
* flex: ``out * sigmoid(lse - sink)`` with flex's differentiable ``lse``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import metadata as _metadata
from .metadata import _round_up, compile_headroom


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, T, D) -> (B, Hkv * groups, T, D), query head h reading kv head h // groups (transformers' order)."""
    if groups == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)


# --- dense masks: SDPA and the eager reference -------------------------------------------------------------------
def sdpa_attention(q, k, v, mask: torch.Tensor, *, scale: float, dropout: float = 0.0,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA with a dense additive mask. ``mask`` is (B, 1, T, T), or the sink layout of ``dense_mask(sink=True)``."""
    groups = q.shape[1] // k.shape[1]
    # A mask rules out SDPA's native GQA on CUDA (the memory-efficient kernel would fall back to math), so the
    # kv heads are expanded, as transformers does.
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    if sinks is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
        return out.transpose(1, 2)
    b, h, t, d = q.shape
    width = mask.shape[-1]
    dp = _round_up(d + 1, 8)  # one more coordinate for the sink, padded for aligned kernels
    qx = torch.cat([q, q.new_ones(b, h, t, 1), q.new_zeros(b, h, t, dp - d - 1)], dim=-1)
    sink_col = (sinks.to(q.dtype) / scale).view(1, h, 1, 1).expand(b, h, 1, 1)
    sink_key = torch.cat([k.new_zeros(b, h, 1, d), sink_col, k.new_zeros(b, h, 1, dp - d - 1)], dim=-1)
    kx = torch.cat([sink_key, F.pad(k, (0, dp - d)), k.new_zeros(b, h, width - t - 1, dp)], dim=2)
    vx = torch.cat([v.new_zeros(b, h, 1, dp), F.pad(v, (0, dp - d)), v.new_zeros(b, h, width - t - 1, dp)], dim=2)
    out = F.scaled_dot_product_attention(qx, kx, vx, attn_mask=mask, dropout_p=dropout, scale=scale)
    return out[..., :d].transpose(1, 2)


def eager_attention(q, k, v, mask: torch.Tensor, *, scale: float, dropout: float = 0.0, training: bool = False,
                    sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: matmul, additive (B, 1, T, T) mask, softmax (with the sink column as GPT-OSS eager does)."""
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    logits = torch.matmul(q, k.transpose(2, 3)) * scale + mask
    if sinks is None:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        b, h, t, _ = q.shape
        sink = sinks.reshape(1, h, 1, 1).expand(b, h, t, 1).to(logits.dtype)
        combined = torch.cat([logits, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    probs = F.dropout(probs, p=dropout, training=training).to(v.dtype)
    return torch.matmul(probs, v).transpose(1, 2), probs


# --- varlen: flash kernel on CUDA, a reference kernel on CPU ------------------------------------------------------
def _flash_schema_kwargs() -> set[str]:
    try:
        return {a.name for a in torch.ops.aten._flash_attention_forward.default._schema.arguments}
    except Exception:  # noqa: BLE001
        return set()


@functools.lru_cache(maxsize=1)
def _flash_has_window() -> bool:
    return "window_size_left" in _flash_schema_kwargs()


def _flash_window(window: int | None) -> dict:
    if window is None:
        return {"window_size_left": -1, "window_size_right": -1} if _flash_has_window() else {}
    if not _flash_has_window():
        raise NotImplementedError("this torch build's flash kernel takes no window_size: sliding windows need "
                                  "torch >= 2.5 (use the sdpa or flex backend)")
    # transformers keeps q - W < k <= q: W - 1 keys to the left, none to the right (flash's inclusive convention).
    return {"window_size_left": window - 1, "window_size_right": 0}


class CudaFlashVarlen:
    """``aten._flash_attention_forward/backward`` on (N, H, D) rows with ``cu_seqlens`` (GQA native)."""

    name = "flash"

    @staticmethod
    def forward(q, k, v, cu, max_len, scale, window):
        out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, True, False, scale=scale, **_flash_window(window))
        if lse.dim() == 2 and lse.shape[0] != q.shape[1]:  # some builds return (N, H)
            lse = lse.t()
        return out, lse.float().contiguous(), (rng_state, unused)

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu, max_len, scale, window, extra):
        rng_state, unused = extra
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, cu, cu, max_len, max_len, 0.0, True, rng_state, unused,
            scale=scale, **_flash_window(window))
        return dq, dk, dv


class ReferenceVarlen:
    """The same contract as the flash kernel, in plain PyTorch (exact, O(N^2) memory): makes the varlen backend's
    plumbing -- cu_seqlens, windows, GQA, the sink forward and backward formulas -- testable on a CPU.
    Its backward is flash's: recompute P = exp(S - lse) from the *given* lse, dS = P * (dP - rowsum(dO * O))."""

    name = "reference"

    @staticmethod
    def _logits(q, k, cu, scale, window):
        n, h, _ = q.shape
        groups = h // k.shape[1]
        kk = k.repeat_interleave(groups, dim=1)
        ids = torch.searchsorted(cu[1:].to(torch.long), torch.arange(n, device=q.device), right=True)
        i = torch.arange(n, device=q.device)
        allowed = (ids[:, None] == ids[None, :]) & (i[None, :] <= i[:, None])
        if window is not None:
            allowed = allowed & (i[:, None] - i[None, :] < window)
        s = torch.einsum("qhd,khd->hqk", q.float(), kk.float()) * scale
        return s.masked_fill(~allowed, -math.inf), groups

    @staticmethod
    def forward(q, k, v, cu, max_len, scale, window):
        # flash kernels size their tiles by max_seqlen: one below the longest segment drops its last tile
        torch._assert_async((cu[1:] - cu[:-1]).max() <= max_len,
                            f"varlen max_seqlen={max_len} is below the longest segment")
        s, groups = ReferenceVarlen._logits(q, k, cu, scale, window)
        lse = torch.logsumexp(s, dim=-1)                                   # (H, N)
        p = torch.exp(s - lse[..., None])
        out = torch.einsum("hqk,khd->qhd", p, v.float().repeat_interleave(groups, dim=1))
        return out.to(q.dtype), lse, None

    @staticmethod
    def backward(dout, q, k, v, out, lse, cu, max_len, scale, window, extra):
        s, groups = ReferenceVarlen._logits(q, k, cu, scale, window)
        n, hkv, d = k.shape
        vv = v.float().repeat_interleave(groups, dim=1)
        p = torch.exp(s - lse[..., None])                                  # (H, N, N)
        dout = dout.float()
        dp = torch.einsum("qhd,khd->hqk", dout, vv)
        delta = (dout * out.float()).sum(-1).t()                           # (H, N)
        ds = p * (dp - delta[..., None])
        dq = torch.einsum("hqk,khd->qhd", ds, k.float().repeat_interleave(groups, dim=1)) * scale
        dk = torch.einsum("hqk,qhd->khd", ds, q.float()) * scale
        dv = torch.einsum("hqk,qhd->khd", p, dout)
        dk = dk.view(n, hkv, groups, d).sum(2)
        dv = dv.view(n, hkv, groups, d).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _VarlenAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, cu, max_len, scale, window, kernel):
        out, lse, extra = kernel.forward(q, k, v, cu, max_len, scale, window)
        if sinks is not None:
            sink = sinks.float()[:, None]                                  # (H, 1)
            lse_sink = torch.logaddexp(lse, sink)
            out = (out.float() * torch.exp(lse - lse_sink).t()[..., None]).to(q.dtype)
            lse = lse_sink
        ctx.save_for_backward(q, k, v, out, lse, cu, sinks)
        ctx.meta = (max_len, scale, window, kernel, extra)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu, sinks = ctx.saved_tensors
        max_len, scale, window, kernel, extra = ctx.meta
        # With (out', lse') the kernel's own backward is exact: the sink column has no value, so it only shifts
        # the row normaliser, and rowsum(dO * O') already accounts for it.
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, cu, max_len, scale, window, extra)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            delta = (dout.float() * out.float()).sum(-1).t()              # (H, N)
            dsinks = -(torch.exp(sinks.float()[:, None] - lse) * delta).sum(-1).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None, None, None, None


def varlen_kernel_for(device: torch.device):
    return CudaFlashVarlen if device.type == "cuda" else ReferenceVarlen


def varlen_attention(q, k, v, cu: torch.Tensor, max_len: int, *, scale: float, window: int | None = None,
                     sinks: torch.Tensor | None = None, kernel=None) -> torch.Tensor:
    """Varlen attention over the rows flattened to (B*T, H, D): each segment attends causally to itself."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    kernel = kernel or varlen_kernel_for(q.device)
    qf = q.transpose(1, 2).reshape(b * t, h, d)
    kf = k.transpose(1, 2).reshape(b * t, hkv, d)
    vf = v.transpose(1, 2).reshape(b * t, hkv, d)
    out = _VarlenAttention.apply(qf, kf, vf, sinks, cu, int(max_len), float(scale), window, kernel)
    return out.view(b, t, h, d)


# --- flex attention ----------------------------------------------------------------------------------------------
def _flex_frame(q, k, v, **kwargs):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, **kwargs)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    # Uncompiled flex materialises the full score matrix; compiled, it is a fused kernel (and needs no T^2 memory).
    # Compiled through a frame of our own, not ``torch.compile(flex_attention)``: dynamo keeps its guards, cache
    # entries and automatic-dynamic shape state per code object, so compiling flex_attention itself would share them
    # with transformers' flex path (``torch.compile(flex_attention)``, dynamic shapes). Seen on the H200 with torch
    # 2.11: once that path had run one row length, the next length failed to compile for every caller
    # (Unsupported ``_safe_softmax``); without it, 4k then 8k compiled fine (benchmarks/results/h200-2026-12-03).
    return torch.compile(_flex_frame, dynamic=False)


def _call_flex(fn, *args, **kwargs):
    if fn is _compiled_flex():
        import torch._dynamo.config as dynamo_config
        import torch._dynamo.exc as dynamo_exc

        limit = max(dynamo_config.recompile_limit, _metadata.FLEX_RECOMPILE_LIMIT)
        try:
            with compile_headroom():
                return fn(*args, **kwargs)
        except dynamo_exc.FailOnRecompileLimitHit as e:
            raise RuntimeError(
                f"compiled flex attention hit {limit} recompilations (one per packed shape, window and "
                "grad mode): pack to a few fixed row shapes (the packer pads every row to max_tokens), or use the varlen "
                "backend, whose kernels take any shape") from e
        except dynamo_exc.Unsupported as e:
            q = args[0]
            raise RuntimeError(
                f"torch {torch.__version__} could not compile flex attention for q of shape {tuple(q.shape)} "
                f"({str(e).splitlines()[0][:160]}). Seen on the H200 with torch 2.11 after transformers' own flex path "
                "(attn_implementation='flex_attention') had compiled flex for another row length in the same "
                "process: keep to one flex path per process, or use the varlen backend (or sdpa)") from e
    return fn(*args, **kwargs)


@functools.lru_cache(maxsize=1)
def _flex_lse_kwargs() -> tuple[str, object]:
    from torch.nn.attention import flex_attention as fa

    if "return_aux" in inspect.signature(fa.flex_attention).parameters and hasattr(fa, "AuxRequest"):
        return "return_aux", fa.AuxRequest(lse=True)
    return "return_lse", True


def _outside_sync_counter():
    """Run a flex kernel outside ``fastsft_lab.profiling.SyncCounter``'s dispatch mode.

    The counter's ``TorchDispatchMode`` cannot take the flex higher-order operator (NotImplementedError), and
    under any dispatch mode ``torch.compile`` runs eagerly -- flex would then materialise the T x T scores of
    every head. The flex kernel itself never syncs, so nothing the counter should see is hidden.
    """
    from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

    if any(type(m).__name__ == "_SyncMode" for m in _get_current_dispatch_mode_stack()):
        return _disable_current_modes()
    return contextlib.nullcontext()


def flex_attention_packed(q, k, v, block_mask, *, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """flex attention with a packed ``BlockMask``; sinks by rescaling with ``sigmoid(lse - sink)``."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = _compiled_flex() if q.device.type == "cuda" else flex_attention
    enable_gqa = q.shape[1] != k.shape[1]
    t = q.shape[2]
    padded = block_mask.seq_lengths[0]       # a multiple of 128 (see metadata.FLEX_BLOCK); the tail is its own segment
    if padded < t:
        raise ValueError(f"flex BlockMask covers {padded} tokens, the rows have {t}: built for another batch")
    if padded != t:
        q, k, v = (F.pad(x, (0, 0, 0, padded - t)) for x in (q, k, v))
    if sinks is None:
        with _outside_sync_counter():
            out = _call_flex(fn, q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
        return out[:, :, :t].transpose(1, 2)
    name, value = _flex_lse_kwargs()
    with _outside_sync_counter():
        out, aux = _call_flex(fn, q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, **{name: value})
    lse = aux if isinstance(aux, torch.Tensor) else aux.lse                # (B, H, T), natural log
    out, lse = out[:, :, :t], lse[..., :t]
    factor = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
    return (out.float() * factor[..., None]).to(q.dtype).transpose(1, 2)


# --- xFormers and flash-attn (optional packages) ----------------------------------------------------------------
def xformers_attention(q, k, v, bias, *, scale: float, dropout: float = 0.0,
                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """xFormers memory-efficient attention with a ``BlockDiagonalCausalMask`` over the flattened rows."""
    if sinks is not None:
        raise NotImplementedError("the xformers backend does not implement attention sinks (GPT-OSS): "
                                  "use sdpa, varlen or flex")
    import xformers.ops as xops

    b, h, t, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    # BMGHK layout: G groups of kv heads, each shared by H/G query heads (query head h -> kv head h // g).
    qx = q.transpose(1, 2).reshape(1, b * t, hkv, g, d)
    kx = k.transpose(1, 2).reshape(1, b * t, hkv, 1, d).expand(1, b * t, hkv, g, d)
    vx = v.transpose(1, 2).reshape(1, b * t, hkv, 1, d).expand(1, b * t, hkv, g, d)
    try:
        out = xops.memory_efficient_attention(qx, kx, vx, attn_bias=bias, p=dropout, scale=scale)
    except NotImplementedError as e:
        raise RuntimeError("xFormers is installed but none of its attention kernels runs here "
                           f"({str(e).splitlines()[0]}); use another backend") from e
    return out.reshape(b, t, h, d)


def flash_attn_attention(q, k, v, cu: torch.Tensor, max_len: int, *, scale: float, window: int | None = None,
                         dropout: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The ``flash_attn`` package's varlen kernel (only where that package is installed)."""
    if sinks is not None:
        raise NotImplementedError("the flash backend (flash_attn package) does not take attention sinks here: "
                                  "use varlen (torch's flash kernel, sinks supported)")
    from flash_attn import flash_attn_varlen_func

    b, h, t, d = q.shape
    hkv = k.shape[1]
    out = flash_attn_varlen_func(
        q.transpose(1, 2).reshape(b * t, h, d), k.transpose(1, 2).reshape(b * t, hkv, d),
        v.transpose(1, 2).reshape(b * t, hkv, d), cu, cu, int(max_len), int(max_len), dropout_p=dropout,
        softmax_scale=scale, causal=True, window_size=(-1, -1) if window is None else (window - 1, 0))
    return out.view(b, t, h, d)


# --- which backend runs where --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BackendStatus:
    """Whether a backend runs on a device: ``available`` (forward), ``training`` (backward too), and why.

    Unpacks as ``available, reason = status`` (what ``python -m fastsft_lab info`` prints).
    """

    name: str
    available: bool
    training: bool
    reason: str

    def __iter__(self):
        return iter((self.available, self.reason))


BACKENDS = ("sdpa", "eager", "varlen", "flex", "xformers", "flash")


@contextlib.contextmanager
def _quiet_logger(name: str):
    # xFormers logs a multi-line warning when its extensions do not load; we report the reason ourselves.
    import logging

    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _xformers_status(device: torch.device) -> BackendStatus:
    try:
        with _quiet_logger("xformers"):
            import xformers
            import xformers.ops as xops
            from xformers.ops.fmha.attn_bias import BlockDiagonalCausalMask
    except Exception as e:  # noqa: BLE001 - any import failure means "not here"
        return BackendStatus("xformers", False, False, f"xformers does not import: {type(e).__name__}: {e}")
    if getattr(xformers, "_has_cpp_library", True) is False and device.type == "cuda":
        return BackendStatus("xformers", False, False, "xformers imports, but its C++/CUDA extensions do not load "
                                                       "(built for another torch/CUDA version)")
    try:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        x = torch.zeros(1, 4, 1, 8, device=device, dtype=dtype)
        xops.memory_efficient_attention(x, x, x, attn_bias=BlockDiagonalCausalMask.from_seqlens([2, 2]))
    except Exception as e:  # noqa: BLE001
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return BackendStatus("xformers", False, False, f"xformers imports but its kernels do not run on "
                                                        f"{device.type}: {first}")
    return BackendStatus("xformers", True, True, "xFormers memory-efficient attention, BlockDiagonalCausalMask")


@functools.lru_cache(maxsize=8)
def _status(device_type: str) -> dict[str, BackendStatus]:
    device = torch.device(device_type)
    cuda = device_type == "cuda"
    out = {
        "sdpa": BackendStatus("sdpa", True, True, "F.scaled_dot_product_attention with the cached dense mask"),
        "eager": BackendStatus("eager", True, True, "reference: matmul + softmax with the dense mask (exact; "
                                                    "T^2 memory per head)"),
    }
    if cuda:
        ok = hasattr(torch.ops.aten, "_flash_attention_forward") and torch.backends.cuda.is_flash_attention_available() \
            and torch.cuda.get_device_capability() >= (8, 0)
        out["varlen"] = BackendStatus("varlen", ok, ok, "torch's flash varlen kernel (aten._flash_attention_forward)"
                                      if ok else "torch's flash attention kernel is not available on this GPU/build")
    else:
        out["varlen"] = BackendStatus("varlen", True, True, "reference kernel on CPU (pure PyTorch, for tests: "
                                                            "same plumbing and sink formulas as the CUDA path)")
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401

        if cuda:
            from torch.utils._triton import has_triton

            ok = has_triton()
            out["flex"] = BackendStatus("flex", ok, ok, "compiled flex attention with a cached BlockMask" if ok
                                        else "flex attention needs triton on CUDA, and it is missing")
        else:
            out["flex"] = BackendStatus("flex", True, False, "forward only: FlexAttention has no CPU backward")
    except Exception as e:  # noqa: BLE001
        out["flex"] = BackendStatus("flex", False, False, f"torch.nn.attention.flex_attention missing: {e}")
    out["xformers"] = _xformers_status(device)
    try:
        import flash_attn  # noqa: F401

        ok = cuda
        out["flash"] = BackendStatus("flash", ok, ok, "flash_attn varlen kernel" if ok
                                     else "flash_attn needs CUDA")
    except Exception:  # noqa: BLE001
        out["flash"] = BackendStatus("flash", False, False, "the flash_attn package is not installed")
    return out


def available_backends(device: torch.device | str | None = None) -> dict[str, BackendStatus]:
    """Which packed-attention backends run on ``device`` (default: CUDA if present), with the reason for each."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return dict(_status(torch.device(device).type))


__all__ = ["repeat_kv", "sdpa_attention", "eager_attention", "varlen_attention", "flex_attention_packed",
           "xformers_attention", "flash_attn_attention", "CudaFlashVarlen", "ReferenceVarlen", "BackendStatus",
           "BACKENDS", "available_backends", "varlen_kernel_for"]
