"""MoE expert routing for GPT-OSS (and Qwen3-MoE): the per-expert loop, grouped once, then sync-free.

The problem. The common expert loop (transformers' ``eager`` experts, and the pattern most MoE code copies) asks,
for every expert, *which tokens did you get?* (``nonzero`` / ``torch.where`` on a mask) and checks the expert id on
the host. Each question is a device->host read: the CPU stops issuing kernels until the GPU has caught up, the
launch queue drains, and the GPU idles while Python decides what to launch next. Two or more syncs per expert per
layer, 32 experts, 24 layers: thousands of stalls per forward.

The fix, in two steps (the toggle ``moe_routing``):

* ``naive``     - the per-expert loop, op for op transformers' own eager ``GptOssExperts.forward`` /
  ``Qwen3MoeExperts.forward`` (one_hot -> expert_hit.nonzero() -> for each hit expert: ``torch.where`` ->
  gather -> matmuls -> ``index_add_``). The "before".
* ``grouped``   - group once: a stable sort of the flattened (token, slot) expert ids, the per-expert end offsets
  from ``searchsorted`` on the sorted ids (no ``bincount``: on CUDA it reads the maximum back), ONE ``.tolist()``
  of the offsets per MoE layer (exactly one host sync), contiguous per-expert slices of the sorted tokens, one
  matmul pair per non-empty expert, and a deterministic reduction of the k expert outputs of each token.
* ``sync_free`` - the same grouping with the offsets left on the device, feeding a grouped matmul
  (``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``: bf16 on CUDA sm80+, and a CPU kernel in
  torch >= 2.9): zero host syncs. Where no grouped matmul runs it falls back to ``grouped`` (and says so).
  Against transformers' own ``grouped_mm`` experts (same idea) it trims the glue around the two matmuls: no
  expert-parallel sentinel masking, biases folded into small GEMMs instead of (S, .) gathers, the routing weights
  applied inside the k-way reduction, gathers whose backward is a gather, and GPT-OSS's clamped gate fused into one
  Triton kernel each way on CUDA.

Usage::

    from fastsft_lab.moe import set_moe_routing, quantize_experts_nf4
    set_moe_routing(model, "sync_free")   # or "grouped" / "naive"; None or "off" restores the original
    quantize_experts_nf4(model)           # optional: NF4 expert weights for a QLoRA memory budget

Switching is done through transformers' own extension point, the experts registry
(``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`` and ``config._experts_implementation``), so the
decorated ``GptOssExperts`` / ``Qwen3MoeExperts`` dispatch to our functions; ``set_moe_routing(model, None)``
puts back exactly the implementation the model had (``grouped_mm`` for models built by ``from_config`` in
transformers 5.x, ``eager`` if it was asked for).

NF4 experts. GPT-OSS expert weights are 3-D ``nn.Parameter`` s, so bitsandbytes' ``Linear4bit`` does not apply.
``quantize_experts_nf4`` stores each 3-D weight as NF4 (bitsandbytes ``quantize_4bit``, blocksize 64, one
absmax per block, frozen) and our three modes compute through it without ever keeping a bf16 copy for backward:
``naive``/``grouped`` dequantize only the experts that were hit, ``sync_free`` dequantizes the whole layer once
per forward (and once more in backward) so that one grouped matmul can run.

Equivalence (float32, CPU) with transformers' eager experts - outputs and gradients - is proven in
``tests/test_moe.py``; notebook 03 walks through it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import time
import warnings
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("naive", "grouped", "sync_free")
# Names under which our forwards are registered in transformers' experts registry.
IMPLEMENTATIONS = {"naive": "fastsft_naive", "grouped": "fastsft_grouped", "sync_free": "fastsft_sync_free"}
STOCK_IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")

_ORIGINAL_ATTR = "_fastsft_moe_original_impl"  # stashed on each experts module by set_moe_routing
_NF4_ATTR = "_fastsft_nf4"                     # NF4 metadata on an experts module (see quantize_experts_nf4)
_HOST_READ_LABEL = "fastsft::expert_offsets_to_host"  # profiler label of grouped's one host read per layer


# =====================================================================================================================
# Expert weights: plain parameters (optionally PEFT-parametrized) or the NF4 store
# =====================================================================================================================
def _is_nf4(module: nn.Module) -> bool:
    return getattr(module, _NF4_ATTR, None) is not None


def _check_nf4_not_lora(module: nn.Module) -> None:
    # PEFT's target_parameters LoRA works by a parametrization of the 3-D nn.Parameter; an NF4 expert weight is a
    # packed uint8 buffer, so there is nothing for PEFT to parametrize: refuse clearly rather than compute without
    # the adapter.
    if hasattr(module, "parametrizations") and any(n in module.parametrizations for n in ("gate_up_proj", "down_proj")):
        raise NotImplementedError(
            "LoRA on NF4-quantized expert weights (PEFT target_parameters) is not supported: the NF4 store has no "
            "nn.Parameter for PEFT to parametrize. Use LoRA on the attention projections with NF4 experts, or keep "
            "the experts in bf16 to adapt them."
        )


def _nf4_checked(module: nn.Module) -> bool:
    """True when the experts hold NF4 weights; LoRA on NF4 expert weights is refused with a clear error."""
    nf4 = _is_nf4(module)
    if nf4:
        _check_nf4_not_lora(module)
    return nf4


def _weight(module: nn.Module, name: str) -> torch.Tensor:
    """The full (E, ., .) weight ``name`` in the module's own layout: PEFT-parametrized or NF4-dequantized."""
    return getattr(module, name)


def _mat_b(module: nn.Module, w: torch.Tensor) -> torch.Tensor:
    """(E, in, out) orientation for ``x @ w[e]`` / grouped_mm: GPT-OSS stores it so (``is_transposed``), Qwen3-MoE
    stores (E, out, in) for ``F.linear``; a transposed view costs nothing (grouped_mm takes either layout)."""
    return w if module.is_transposed else w.transpose(-2, -1)


class _NF4Weight:
    """Read access to one NF4-quantized 3-D expert weight registered as buffers on its experts module.

    Buffers (they move with ``module.to``): ``<name>_nf4`` (E, n/2) uint8 packed codes, ``<name>_absmax``
    (E, n/blocksize) float32, ``nf4_code`` (16,) the NF4 code book. ``n`` is the element count of one expert.
    """

    def __init__(self, module: nn.Module, name: str):
        self.module = module
        self.name = name
        meta = getattr(module, _NF4_ATTR)
        self.shape: torch.Size = meta["shapes"][name]
        self.blocksize: int = meta["blocksize"]
        self.dtype: torch.dtype = meta["dtype"]

    def _state(self, absmax: torch.Tensor, numel: int):
        from bitsandbytes.functional import QuantState

        # A flat shape: bitsandbytes' CPU kernel mis-assigns blocks when the last dimension is not a multiple of the
        # blocksize (seen with bitsandbytes 0.50.2); the codes are flat anyway, so dequantize flat and view.
        return QuantState(absmax=absmax, shape=torch.Size([numel]), code=self.module.nf4_code,
                          blocksize=self.blocksize, quant_type="nf4", dtype=self.dtype)

    def dequantize(self, expert: int | None = None) -> torch.Tensor:
        """All experts (E, ., .) or one expert (., .), in the module's layout and compute dtype."""
        from bitsandbytes.functional import dequantize_4bit

        packed = self.module._buffers[f"{self.name}_nf4"]
        absmax = self.module._buffers[f"{self.name}_absmax"]
        per_expert = math.prod(self.shape[1:])
        if expert is None:
            flat = dequantize_4bit(packed.reshape(-1), self._state(absmax.reshape(-1), packed.numel() * 2))
            return flat.view(self.shape)
        flat = dequantize_4bit(packed[expert], self._state(absmax[expert], per_expert))
        return flat.view(self.shape[1:])

    def mat_b(self, expert: int | None = None) -> torch.Tensor:
        w = self.dequantize(expert)
        if self.module.is_transposed:
            return w
        return w.transpose(-2, -1)


class _NF4ExpertMatmul(torch.autograd.Function):
    """``x @ W[e]`` for one NF4 expert; backward dequantizes again instead of keeping the bf16 weight alive."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, store: _NF4Weight, expert: int) -> torch.Tensor:
        ctx.store, ctx.expert = store, expert
        return x @ store.mat_b(expert).to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        w = ctx.store.mat_b(ctx.expert).to(grad.dtype)
        return grad @ w.transpose(-2, -1), None, None


class _NF4GroupedMM(torch.autograd.Function):
    """Grouped ``x[offs_e-1:offs_e] @ W[e]`` over all NF4 experts: the layer is dequantized once in forward and
    once in backward (never saved), so QLoRA memory stays at 4 bits per expert weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, offs: torch.Tensor, store: _NF4Weight) -> torch.Tensor:
        ctx.store = store
        ctx.save_for_backward(offs)
        return _grouped_mm(x, store.mat_b().to(x.dtype), offs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (offs,) = ctx.saved_tensors
        w = ctx.store.mat_b().to(grad.dtype)
        return _grouped_mm(grad.contiguous(), w.transpose(-2, -1), offs), None, None


def _expert_matmul(module: nn.Module, name: str, x: torch.Tensor, expert: int,
                   weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W[expert]`` (without bias) for a plain or an NF4 weight."""
    if weight is None:
        return _NF4ExpertMatmul.apply(x, _NF4Weight(module, name), expert)
    w = weight[expert]
    return x @ w if module.is_transposed else F.linear(x, w)


# =====================================================================================================================
# Grouped matmul: availability and the sync-free kernel
# =====================================================================================================================
def _grouped_mm_fn() -> Callable | None:
    fn = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    return fn


@functools.lru_cache(maxsize=None)
def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def grouped_mm_unavailable(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why no sync-free grouped matmul can run on these tensors here (None: it can).

    Conditions follow transformers' ``_can_use_grouped_mm`` and PyTorch's kernels: CUDA needs sm80+ and bfloat16
    (other dtypes go through a PyTorch fallback that reads the offsets back); the CPU kernel exists from torch 2.9
    (and wants 16-byte aligned pointers up to 2.10).
    """
    if _grouped_mm_fn() is None:
        return f"torch {torch.__version__} has no grouped_mm"
    if x.device.type == "cuda":
        if torch.cuda.get_device_capability(x.device) < (8, 0):
            return "grouped_mm needs a CUDA GPU with compute capability >= 8.0"
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
            return f"grouped_mm on CUDA runs sync-free in bfloat16 only (got {x.dtype})"
        return None
    if x.device.type == "cpu":
        version = _torch_version()
        if version < (2, 9):
            return f"torch {torch.__version__} has no CPU grouped_mm kernel (needs >= 2.9)"
        if version <= (2, 10) and (x.data_ptr() % 16 or weight.data_ptr() % 16):
            return "CPU grouped_mm of this torch needs 16-byte aligned tensors"
        return None
    return f"no grouped_mm kernel known for device type {x.device.type!r}"


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's backward rejects expanded
    (stride-0) gradients such as the one ``out.sum().backward()`` produces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped_mm(x: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(S, K) rows sorted by expert, (E, K, N) weights, int32 end offsets (E,) -> (S, N). No host sync."""
    return _ContiguousGrad.apply(_grouped_mm_fn()(x, mat_b, offs=offs))


def _grouped_proj(module: nn.Module, name: str, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if _is_nf4(module):
        return _ContiguousGrad.apply(_NF4GroupedMM.apply(x, offs, _NF4Weight(module, name)))
    return _grouped_mm(x, _mat_b(module, _weight(module, name)).to(x.dtype), offs)


# =====================================================================================================================
# Shared pieces of the grouped paths
# =====================================================================================================================
def group_by_expert(top_k_index: torch.Tensor, num_experts: int, *, int32: bool = False):
    """Sort the (token, slot) pairs by expert id, without a host sync.

    Args:
        top_k_index: (T, k) expert ids.
        num_experts: E.
        int32: return the offsets as int32 (what grouped_mm takes).

    Returns:
        ``sorted_ids`` (S,) expert id of each sorted pair, ``perm`` (S,) flat index ``t * k + j`` of each sorted
        pair, ``ends`` (E,) end offset of each expert's rows in the sorted order (= cumulative counts).

    Why ``searchsorted`` and not ``bincount`` + ``cumsum``: ``torch.bincount`` on CUDA reads the maximum id back to
    size its output (a sync, even with ``minlength``); on sorted ids the end offsets are a binary search each,
    sync-free and deterministic. The stable sort keeps each expert's pairs in token order.
    """
    flat = top_k_index.reshape(-1)
    sorted_ids, perm = torch.sort(flat, stable=True)
    experts = torch.arange(num_experts, device=flat.device, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, experts, right=True, out_int32=int32)  # (E,)
    return sorted_ids, perm, ends


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``: one scatter of an arange (no sort, no sync)."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


class _RowGather(torch.autograd.Function):
    """``x[index]`` for a gather whose inverse map is known, with a backward that is a gather too.

    Autograd's own backward of ``x[index]`` is an ``index_put_`` with accumulation (a sort of the indices on CUDA,
    then a scatter). Here every output row comes from a known source and ``inverse`` lists, for each source row and
    copy, where it went: the gradient is ``grad[inverse]`` summed over the ``repeat`` copies of each row - a gather
    and a fixed-order reduction, deterministic, no atomics.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor, repeat: int) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.repeat = repeat
        return x.index_select(0, index)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        g = grad.index_select(0, inverse)  # (rows * repeat, H), copies of one row adjacent
        if ctx.repeat > 1:
            g = g.view(-1, ctx.repeat, g.shape[-1]).sum(1)
        return g, None, None, None


def _tokens_in_expert_order(hidden_states: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor,
                            k: int) -> torch.Tensor:
    """(T, H) -> (S, H): row i is the token of sorted pair i; backward sums each token's k row gradients."""
    return _RowGather.apply(hidden_states, perm // k, inv, k)


def _combine(y_sorted: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """(S, H) expert outputs in sorted order -> (T, H): back to (T, k, H) by the inverse permutation, then the
    routing-weighted sum over the k slots as one batched (1 x k) @ (k x H) matmul per token.

    Deterministic: a gather and a reduction in a fixed order, no ``index_add_`` atomics; the weighting and the sum
    are one kernel (bf16 inputs accumulate in fp32 inside the matmul).
    """
    num_tokens, k = top_k_weights.shape
    y = _RowGather.apply(y_sorted, inv, perm, 1).view(num_tokens, k, -1)  # (T, k, H)
    return torch.bmm(top_k_weights.to(y.dtype).unsqueeze(1), y).squeeze(1)  # (T, 1, k) @ (T, k, H) -> (T, H)


def _is_gpt_oss_gate(module: nn.Module) -> bool:
    return (not getattr(module, "is_concatenated", True)) and hasattr(module, "alpha") and hasattr(module, "limit")


def _gpt_oss_glu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's gate: interleaved gate/up columns, gate clamped above at ``limit``, up clamped at +-limit,
    ``(up + 1) * gate * sigmoid(alpha * gate)``; six elementwise kernels instead of seven (``addcmul`` does the
    ``(up + 1) *`` in one)."""
    gate = gate_up[..., ::2].clamp(max=limit)
    up = gate_up[..., 1::2].clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return torch.addcmul(glu, up, glu)


# --- Fused GPT-OSS gate (Triton, CUDA) --------------------------------------------------------------------------
# The eager gate is six elementwise kernels forward (each reading/writing an (S, I) tensor, two of them reading the
# interleaved (S, 2I) input) and about a dozen backward, and autograd keeps four (S, I) intermediates. One Triton
# kernel each way reads gate_up once, writes the (S, I) output once, and saves only gate_up. Gate and up of output
# column j sit at flat positions 2n and 2n+1 of the contiguous (S, 2I) input, n = row * I + j: no row arithmetic.
_FUSED_GLU = [os.environ.get("FASTSFT_MOE_FUSED_GLU", "1").strip().lower() not in ("0", "false", "no", "off")]

try:  # Triton ships with CUDA builds of PyTorch; TRITON_INTERPRET=1 runs these kernels on CPU tensors (tests)
    import triton
    import triton.language as tl

    @triton.jit
    def _glu_fwd_kernel(gu_ptr, out_ptr, n, alpha, limit, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(gu_ptr + 2 * offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + 2 * offs + 1, mask=mask, other=0.0).to(tl.float32)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        sig = 1.0 / (1.0 + tl.exp(-alpha * g))
        out = (u + 1.0) * (g * sig)
        tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _glu_bwd_kernel(gu_ptr, grad_ptr, dgu_ptr, n, alpha, limit, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g_raw = tl.load(gu_ptr + 2 * offs, mask=mask, other=0.0).to(tl.float32)
        u_raw = tl.load(gu_ptr + 2 * offs + 1, mask=mask, other=0.0).to(tl.float32)
        dout = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.minimum(g_raw, limit)
        u = tl.minimum(tl.maximum(u_raw, -limit), limit)
        sig = 1.0 / (1.0 + tl.exp(-alpha * g))
        glu = g * sig
        # clamp passes the gradient where min <= x <= max (PyTorch's clamp backward), inclusive at the limits
        dg = tl.where(g_raw <= limit, dout * (u + 1.0) * (sig + g * sig * (1.0 - sig) * alpha), 0.0)
        du = tl.where((u_raw >= -limit) & (u_raw <= limit), dout * glu, 0.0)
        tl.store(dgu_ptr + 2 * offs, dg.to(dgu_ptr.dtype.element_ty), mask=mask)
        tl.store(dgu_ptr + 2 * offs + 1, du.to(dgu_ptr.dtype.element_ty), mask=mask)

    _HAS_TRITON = True
except Exception:  # noqa: BLE001 - no triton (CPU wheels): the eager gate runs
    _HAS_TRITON = False

_GLU_BLOCK = 1024


class _FusedGptOssGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        out = gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
        n = out.numel()
        if n:
            _glu_fwd_kernel[(triton.cdiv(n, _GLU_BLOCK),)](gate_up, out, n, float(alpha), float(limit),
                                                            BLOCK=_GLU_BLOCK)
        ctx.save_for_backward(gate_up)
        ctx.alpha, ctx.limit = float(alpha), float(limit)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (gate_up,) = ctx.saved_tensors
        grad = grad.contiguous()
        dgu = torch.empty_like(gate_up)
        n = grad.numel()
        if n:
            _glu_bwd_kernel[(triton.cdiv(n, _GLU_BLOCK),)](gate_up, grad, dgu, n, ctx.alpha, ctx.limit,
                                                            BLOCK=_GLU_BLOCK)
        return dgu, None, None


def fused_glu_available(t: torch.Tensor) -> bool:
    """Whether the fused Triton gate runs on ``t`` (CUDA + triton, and not switched off)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return _FUSED_GLU[0] and _HAS_TRITON and (t.device.type == "cuda" or interpret)


def set_fused_glu(enabled: bool) -> bool:
    """Turn the fused Triton GPT-OSS gate of ``sync_free`` on/off (env ``FASTSFT_MOE_FUSED_GLU``); returns the old."""
    old, _FUSED_GLU[0] = _FUSED_GLU[0], bool(enabled)
    return old


def gpt_oss_glu(gate_up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """GPT-OSS's gate on an (S, 2I) interleaved tensor: one fused Triton kernel on CUDA, six eager kernels elsewhere."""
    if fused_glu_available(gate_up):
        return _FusedGptOssGLU.apply(gate_up, alpha, limit)
    return _gpt_oss_glu(gate_up, alpha, limit)


# =====================================================================================================================
# The three forwards (signature of transformers' experts forward: hidden (T, H), top_k_index (T, k), weights (T, k))
# =====================================================================================================================
def naive_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """The per-expert loop, op for op transformers' eager ``GptOssExperts.forward`` / ``Qwen3MoeExperts.forward``.

    Per hit expert: a host read of the expert id (``expert_idx == num_experts``) and a ``torch.where`` on its mask
    (``nonzero``) - the syncs this module removes. Bit-identical to the stock eager path on plain weights; on NF4
    weights it dequantizes only the experts that were hit.
    """
    nf4 = _nf4_checked(self)
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    w_gate_up = None if nf4 else _weight(self, "gate_up_proj")
    w_down = None if nf4 else _weight(self, "down_proj")
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:  # host read: skip the EP sentinel
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])  # host read: how many tokens?
        current_state = hidden_states[token_idx]
        e = int(expert_idx) if nf4 else expert_idx
        gate_up = _expert_matmul(self, "gate_up_proj", current_state, e, w_gate_up)
        if self.has_bias:
            gate_up = gate_up + self.gate_up_proj_bias[expert_idx]
        current = self._apply_gate(gate_up)
        current = _expert_matmul(self, "down_proj", current, e, w_down)
        if self.has_bias:
            current = current + self.down_proj_bias[expert_idx]
        current = current * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
    return final_hidden_states


def grouped_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """Group once, one host sync per layer: sort, end offsets, ONE ``.tolist()``, per-expert slices.

    The matmuls stay per expert (ordinary GEMMs with the bias fused by ``addmm``), but the host already knows every
    slice boundary, so it launches them back to back without waiting for the GPU. On NF4 weights only the hit
    experts are dequantized.
    """
    num_tokens, k = top_k_index.shape
    if num_tokens == 0:
        return torch.zeros_like(hidden_states)
    nf4 = _nf4_checked(self)
    sorted_ids, perm, ends = group_by_expert(top_k_index, self.num_experts)
    with torch.profiler.record_function(_HOST_READ_LABEL):
        ends_host = ends.tolist()  # THE host sync of this layer: every slice boundary at once
    inv = inverse_permutation(perm)
    x = _tokens_in_expert_order(hidden_states, perm, inv, k)  # (S, H) rows in expert order
    w_gate_up = None if nf4 else _weight(self, "gate_up_proj")
    w_down = None if nf4 else _weight(self, "down_proj")
    outputs = []
    start = 0
    for e, end in enumerate(ends_host):
        if end == start:  # an expert that got no tokens: nothing to launch
            continue
        xe = x[start:end]
        if self.has_bias and not nf4 and self.is_transposed:
            gate_up = torch.addmm(self.gate_up_proj_bias[e], xe, w_gate_up[e])
        else:
            gate_up = _expert_matmul(self, "gate_up_proj", xe, e, w_gate_up)
            if self.has_bias:
                gate_up = gate_up + self.gate_up_proj_bias[e]
        act = self._apply_gate(gate_up)
        if self.has_bias and not nf4 and self.is_transposed:
            out = torch.addmm(self.down_proj_bias[e], act, w_down[e])
        else:
            out = _expert_matmul(self, "down_proj", act, e, w_down)
            if self.has_bias:
                out = out + self.down_proj_bias[e]
        outputs.append(out)
        start = end
    y = torch.cat(outputs) if len(outputs) > 1 else outputs[0]  # (S, H) in sorted order
    return _combine(y, perm, inv, top_k_weights).to(hidden_states.dtype)


_FALLBACK_WARNED: set[str] = set()


def sync_free_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """Group once and never ask the host: offsets stay on the device and feed one grouped matmul per projection.

    Compared with transformers' ``grouped_mm`` experts (same sort + grouped matmuls), the glue around the matmuls
    does less work: end offsets by ``searchsorted`` (no histc + cumsum), no expert-parallel sentinel masking
    (three ``masked_fill`` passes over (S, H)/(S, 2I) - we do not run expert parallelism), the gate_up bias added
    by one ``addmm`` against a one-hot (S, E) matrix (no per-row bias gather), the down bias folded into a tiny
    (T, E) @ (E, H) matmul of the routing weights (no (S, H) gather + add), the routing weights applied inside the
    k-way reduction (one batched matmul instead of multiply + gather + sum), and the GPT-OSS gate as one fused
    Triton kernel each way on CUDA (six eager kernels elsewhere).
    Falls back to :func:`grouped_experts_forward` (one host sync) where no grouped matmul runs, with a warning.
    """
    num_tokens, k = top_k_index.shape
    if num_tokens == 0:
        return torch.zeros_like(hidden_states)
    nf4 = _nf4_checked(self)
    if nf4:
        dtype = getattr(self, _NF4_ATTR)["dtype"]
        reason = grouped_mm_unavailable(hidden_states.to(dtype) if hidden_states.dtype != dtype else hidden_states,
                                        self.down_proj_nf4.new_empty(0, dtype=dtype))
    else:
        reason = grouped_mm_unavailable(hidden_states, _weight(self, "down_proj"))
    if reason is not None:
        if reason not in _FALLBACK_WARNED:
            _FALLBACK_WARNED.add(reason)
            warnings.warn(f"moe_routing='sync_free' falls back to 'grouped' (one host sync per MoE layer): {reason}",
                          stacklevel=2)
        return grouped_experts_forward(self, hidden_states, top_k_index, top_k_weights)

    num_experts = self.num_experts
    sorted_ids, perm, offs = group_by_expert(top_k_index, num_experts, int32=True)
    inv = inverse_permutation(perm)
    x = _tokens_in_expert_order(hidden_states, perm, inv, k)  # (S, H) rows in expert order
    gate_up = _grouped_proj(self, "gate_up_proj", x, offs)  # (S, 2I)
    if self.has_bias:
        # Per-row bias of the row's expert = one_hot(expert) @ bias: one GEMM over (S, E) x (E, 2I) that reads and
        # writes gate_up once, instead of gathering an (S, 2I) bias tensor and adding it.
        one_hot = gate_up.new_zeros(sorted_ids.numel(), num_experts).scatter_(1, sorted_ids.unsqueeze(1), 1.0)
        gate_up = torch.addmm(gate_up, one_hot, self.gate_up_proj_bias.to(gate_up.dtype))
    if _is_gpt_oss_gate(self):
        act = gpt_oss_glu(gate_up, self.alpha, self.limit)  # fused Triton kernel on CUDA
    else:
        act = self._apply_gate(gate_up)  # (S, I)
    y = _grouped_proj(self, "down_proj", act, offs)  # (S, H)
    out = _combine(y, perm, inv, top_k_weights)  # (T, H)
    if self.has_bias:
        # sum_j w_tj * b[e_tj] = (routing weights scattered to (T, E)) @ bias: exact, and tiny next to (S, H).
        dense = top_k_weights.new_zeros(num_tokens, num_experts).scatter(1, top_k_index, top_k_weights)
        out = torch.addmm(out, dense.to(out.dtype), self.down_proj_bias.to(out.dtype))
    return out.to(hidden_states.dtype)


_FORWARDS = {"naive": naive_experts_forward, "grouped": grouped_experts_forward,
             "sync_free": sync_free_experts_forward}


# =====================================================================================================================
# The switch on a live model
# =====================================================================================================================
def register_experts_implementations() -> None:
    """Register the three forwards in transformers' experts registry (idempotent)."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as e:  # pragma: no cover - transformers < 5
        raise ImportError("fastsft_lab.moe needs transformers >= 5 (the experts registry "
                          "transformers.integrations.moe.ExpertsInterface)") from e
    for mode, name in IMPLEMENTATIONS.items():
        ExpertsInterface.register(name, _FORWARDS[mode])


register_experts_implementations()


def is_experts_module(module: nn.Module) -> bool:
    """A transformers experts module whose forward dispatches on ``config._experts_implementation``."""
    return (getattr(type(module).forward, "__wrapped__", None) is not None and hasattr(type(module), "_apply_gate")
            and "is_transposed" in module.__dict__ and hasattr(module, "config") and hasattr(module, "num_experts"))


def experts_modules(model: nn.Module) -> list[nn.Module]:
    """Every experts module of ``model`` (PEFT wrappers see through to the wrapped module)."""
    return [m for m in model.modules() if is_experts_module(m)]


def _mode_of(impl: str | None) -> str | None:
    for mode, name in IMPLEMENTATIONS.items():
        if impl == name:
            return mode
    return None


def get_moe_routing(model: nn.Module) -> str | None:
    """The active mode (``naive``/``grouped``/``sync_free``), or None when the model runs a stock implementation."""
    mods = experts_modules(model)
    if not mods:
        return None
    return _mode_of(mods[0].config._experts_implementation)


def experts_implementation(model: nn.Module) -> str | None:
    """The raw ``config._experts_implementation`` of the model's experts (e.g. ``grouped_mm``, ``fastsft_grouped``)."""
    mods = experts_modules(model)
    return mods[0].config._experts_implementation if mods else None


def set_moe_routing(model: nn.Module, mode: str | None) -> str | None:
    """Switch the expert routing of a live model.

    Args:
        model: a transformers MoE model (GPT-OSS, Qwen3-MoE, ...), PEFT-wrapped or not.
        mode: ``"naive"`` (per-expert loop, ~2 host syncs per expert and layer), ``"grouped"`` (one host sync per
            layer), ``"sync_free"`` (no host sync; grouped matmul), or ``None``/``"off"`` to restore exactly the
            implementation the model had before the first switch. A stock name (``"eager"``, ``"grouped_mm"``,
            ``"batched_mm"``) is also accepted, for comparisons.

    Returns:
        The previous mode (as :func:`get_moe_routing` reports it, or the stock name).

    The experts' ``config`` is the model's config object in transformers 5 (one assignment switches every layer);
    the switch does not rely on that: it sets and records the value per experts module, so sub-configs and
    per-module configs are handled alike.
    """
    if mode == "off":
        mode = None
    if mode is not None and mode not in MODES and mode not in STOCK_IMPLEMENTATIONS:
        raise ValueError(f"moe_routing must be one of {MODES}, a stock implementation {STOCK_IMPLEMENTATIONS}, "
                         f"or None/'off'; got {mode!r}")
    mods = experts_modules(model)
    if not mods:
        raise ValueError(f"{type(model).__name__} has no transformers experts module (a class decorated with "
                         "@use_experts_implementation, such as GptOssExperts or Qwen3MoeExperts); nothing to switch")
    if mode in MODES:
        register_experts_implementations()
    previous_impl = mods[0].config._experts_implementation
    previous = _mode_of(previous_impl) or previous_impl
    if mode is None:
        # Restore every module's recorded value (a shared config gets the same value several times).
        for m in mods:
            if _ORIGINAL_ATTR in m.__dict__:
                m.config._experts_implementation_internal = m.__dict__.pop(_ORIGINAL_ATTR)
        return previous
    # Record all originals before assigning anything: when the config is shared, the first assignment would
    # otherwise be read back as the "original" of every later module.
    for m in mods:
        if _ORIGINAL_ATTR not in m.__dict__:
            m.__dict__[_ORIGINAL_ATTR] = m.config._experts_implementation
    for m in mods:
        m.config._experts_implementation_internal = IMPLEMENTATIONS.get(mode, mode)
    return previous


@contextlib.contextmanager
def moe_routing(model: nn.Module, mode: str | None) -> Iterator[nn.Module]:
    """``with moe_routing(model, "sync_free"): ...`` - switch, and put back what was there before."""
    mods = experts_modules(model)
    before = [(m, m.config._experts_implementation, _ORIGINAL_ATTR in m.__dict__,
               m.__dict__.get(_ORIGINAL_ATTR)) for m in mods]
    set_moe_routing(model, mode)
    try:
        yield model
    finally:
        for m, impl, had, orig in before:
            m.config._experts_implementation_internal = impl
            if had:
                m.__dict__[_ORIGINAL_ATTR] = orig
            else:
                m.__dict__.pop(_ORIGINAL_ATTR, None)


# =====================================================================================================================
# NF4 expert store
# =====================================================================================================================
@functools.lru_cache(maxsize=None)
def _nf4_class(base: type) -> type:
    """A subclass whose ``gate_up_proj`` / ``down_proj`` read the NF4 store (full dequantization on access), so that
    transformers' own forwards (``eager``, ``grouped_mm``) still run on an NF4 module - as a reference: they
    dequantize on every access and autograd keeps the bf16 copy for backward; our three modes do not."""

    def make(name: str):
        return property(lambda self: _NF4Weight(self, name).dequantize(),
                        doc=f"{name} dequantized from NF4 (all experts)")

    return type(f"NF4{base.__name__}", (base,), {"gate_up_proj": make("gate_up_proj"),
                                                 "down_proj": make("down_proj"), "__module__": base.__module__})


def quantize_experts_nf4(model: nn.Module, *, blocksize: int = 64, compute_dtype: torch.dtype | None = None) -> int:
    """Store every 3-D expert weight of ``model`` as NF4 (frozen), in place. Returns the number of modules changed.

    Args:
        model: a transformers MoE model (PEFT-wrapped or not); LoRA on the experts' own weights is not supported
            with NF4 (raises ``NotImplementedError``), LoRA on attention is.
        blocksize: NF4 block (64, QLoRA's). One float32 absmax per block, not double-quantized: each expert's
            blocks are then a contiguous slice, so ``naive``/``grouped`` can dequantize a single expert and
            ``sync_free`` the whole layer in one call (cost: 0.5 bit/parameter of absmax instead of ~0.13).
        compute_dtype: dtype the weights are dequantized to (default: the weights' dtype).

    The quantization runs where the weights live (GPU or CPU). Biases stay in their dtype.
    """
    from bitsandbytes.functional import get_4bit_type, quantize_4bit

    # PEFT's target_parameters LoRA (ParamWrapper) parametrizes the 3-D nn.Parameter during each forward; after NF4
    # there is no parameter left to parametrize, so refuse up front instead of failing inside PEFT's forward.
    lora_wrapped = {id(m.get_base_layer()) for m in model.modules()
                    if hasattr(m, "parameter_name") and hasattr(m, "get_base_layer")}
    count = 0
    for module in experts_modules(model):
        if _is_nf4(module):
            continue
        if id(module) in lora_wrapped:
            raise NotImplementedError(
                f"{type(module).__name__} carries PEFT LoRA on its expert weights (target_parameters; note that PEFT "
                "also maps gate_proj/up_proj/down_proj targets onto Qwen3-MoE experts). NF4 experts support LoRA on "
                "the attention projections only: pass target_modules=['q_proj', 'k_proj', 'v_proj', 'o_proj'], or "
                "keep the experts in bf16 to adapt them."
            )
        _check_nf4_not_lora(module)
        meta: dict[str, Any] = {"blocksize": blocksize, "shapes": {}, "dtype": None}
        for name in ("gate_up_proj", "down_proj"):
            param = module._parameters.get(name)
            if param is None:
                raise ValueError(f"{type(module).__name__} has no parameter {name!r} to quantize")
            per_expert = math.prod(param.shape[1:])
            if per_expert % blocksize or blocksize % 2:
                raise ValueError(f"{name}: {per_expert} elements per expert is not a multiple of the NF4 blocksize "
                                 f"{blocksize}")
            dtype = compute_dtype or param.dtype
            with torch.no_grad():
                packed, state = quantize_4bit(param.detach().reshape(-1).contiguous(), blocksize=blocksize,
                                              compress_statistics=False, quant_type="nf4")
            num_experts = param.shape[0]
            del module._parameters[name]
            module.register_buffer(f"{name}_nf4", packed.view(num_experts, per_expert // 2))
            module.register_buffer(f"{name}_absmax", state.absmax.view(num_experts, per_expert // blocksize))
            meta["shapes"][name] = param.shape
            meta["dtype"] = dtype
            del param, packed, state
        module.register_buffer("nf4_code", get_4bit_type("nf4", device=module.gate_up_proj_nf4.device))
        setattr(module, _NF4_ATTR, meta)
        module.__class__ = _nf4_class(type(module))
        count += 1
    return count


def dequantize_expert_weight(module: nn.Module, name: str, expert: int | None = None) -> torch.Tensor:
    """One NF4 expert weight (``gate_up_proj``/``down_proj``) dequantized: all experts, or one (module layout)."""
    if not _is_nf4(module):
        raise ValueError(f"{type(module).__name__} has no NF4 expert store; call quantize_experts_nf4 first")
    return _NF4Weight(module, name).dequantize(expert)


def nf4_expert_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by expert weights: NF4 store (codes + absmax) and what bf16 would take."""
    nf4 = bf16 = 0
    for m in experts_modules(model):
        if not _is_nf4(m):
            continue
        for name in ("gate_up_proj", "down_proj"):
            packed, absmax = m._buffers[f"{name}_nf4"], m._buffers[f"{name}_absmax"]
            nf4 += packed.numel() * packed.element_size() + absmax.numel() * absmax.element_size()
            bf16 += math.prod(getattr(m, _NF4_ATTR)["shapes"][name]) * 2
    return {"nf4_bytes": nf4, "bf16_bytes": bf16}



# =====================================================================================================================
# Measuring: routing statistics, the experts microbenchmark, and the benchmark scenario
# =====================================================================================================================
def _router_and_experts(mlp: nn.Module) -> tuple[nn.Module, nn.Module]:
    router = getattr(mlp, "router", None) or getattr(mlp, "gate", None)
    experts = getattr(mlp, "experts", None)
    if router is None or experts is None:
        raise ValueError(f"{type(mlp).__name__} has no router/gate and experts: not a supported MoE block")
    return router, experts


def routing_stats(model: nn.Module, inputs: dict) -> dict:
    """Tokens per expert in every MoE layer for one forward of ``inputs`` (untimed; reads the ids back once).

    Returns ``{"tokens_per_expert": [[...] per layer], "experts_hit": [...], "load_max_over_mean": [...]}``.
    """
    captured: list[torch.Tensor] = []

    def hook(module, args, kwargs):
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
        captured.append(index.detach().reshape(-1))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in experts_modules(model)]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for h in handles:
            h.remove()
    mods = experts_modules(model)
    num_experts = mods[0].num_experts if mods else 0
    per_layer = [torch.bincount(ids.cpu(), minlength=num_experts).tolist() for ids in captured]
    return {
        "num_experts": num_experts,
        "top_k": int(captured[0].numel() // max(1, inputs["input_ids"].numel())) if captured else None,
        "tokens_per_expert": per_layer,
        "experts_hit": [sum(1 for c in row if c) for row in per_layer],
        "load_max_over_mean": [round(max(row) / (sum(row) / len(row)), 3) if sum(row) else None for row in per_layer],
    }


def time_call_ms(fn: Callable[[], Any], device: torch.device, warmup: int, reps: int) -> dict:
    """median/p20/p80 milliseconds of ``fn`` (CUDA events on a GPU, one sync at the end; perf_counter on a CPU)."""
    from .profiling import percentiles

    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        pairs = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize(device)
        return percentiles(s.elapsed_time(e) for s, e in pairs)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return percentiles(times)


MICRO_IMPLEMENTATIONS = (
    ("naive", "naive", "fastsft naive = transformers' eager GptOssExperts/Qwen3MoeExperts loop, op for op"),
    ("grouped", "grouped", "sort + searchsorted offsets, ONE .tolist() per layer, per-expert addmm slices"),
    ("sync_free", "sync_free", "sort + searchsorted offsets on device, grouped_mm, lean glue; 0 host syncs"),
    ("transformers eager", "eager", "stock experts_implementation='eager' (the per-expert loop)"),
    ("transformers grouped_mm", "grouped_mm",
     "stock experts_implementation='grouped_mm' (transformers 5.x default): sort, histc, grouped_mm, sentinel "
     "masking, per-row bias gathers, weight multiply + inverse-permutation gather + sum"),
    ("sync_free, eager gate", "sync_free:eager_gate",
     "sync_free with the six-kernel eager GPT-OSS gate instead of the fused Triton kernel (shows the gate's share; "
     "only where the fused kernel runs)"),
)


def experts_microbenchmark(model: nn.Module, *, tokens: int, layer: int = 0, warmup: int = 2, reps: int = 5,
                           implementations: Sequence[tuple[str, str, str]] = MICRO_IMPLEMENTATIONS,
                           seed: int = 0) -> list[dict]:
    """Time one MoE layer's experts alone, per implementation, on the same input and routing.

    The router runs once (outside the timing) on a random (tokens, H) input; each implementation then runs the
    experts forward (no grad: a validation step) and forward + backward (gradients for the input and the routing
    weights; expert weights frozen, as under LoRA). The last row, "expert matmuls alone", is the zero-overhead
    limit: the two grouped matmuls on rows already sorted by expert (and, for training, their input gradients),
    with no routing, bias, gate or reduction at all.
    """
    from .models import decoder_layers
    from .profiling import SyncCounter

    mlp = decoder_layers(model)[layer].mlp
    router, experts = _router_and_experts(mlp)
    base = experts.get_base_layer() if hasattr(experts, "get_base_layer") else experts
    param = next(p for p in model.parameters() if p.is_floating_point())
    device = param.device
    dtype = getattr(base, _NF4_ATTR)["dtype"] if _is_nf4(base) else _weight(base, "down_proj").dtype
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(tokens, _hidden_size(base), device=device, dtype=dtype, generator=gen)
    with torch.no_grad():
        _, weights, index = router(hidden)
    grad_out = torch.randn(tokens, hidden.shape[1], device=device, dtype=dtype, generator=gen)
    rows = []
    for label, spec, note in implementations:
        impl, _, flag = spec.partition(":")
        if flag == "eager_gate" and not (_is_gpt_oss_gate(base) and fused_glu_available(hidden)):
            continue  # identical to sync_free here
        fused_before = set_fused_glu(False) if flag == "eager_gate" else None
        with moe_routing(model, impl):
            def forward():
                with torch.no_grad():
                    experts(hidden, index, weights)

            def train():
                h = hidden.detach().requires_grad_(True)
                w = weights.detach().requires_grad_(True)
                experts(h, index, w).backward(grad_out)

            toggles = {"experts_implementation": IMPLEMENTATIONS.get(impl, impl)}
            entry: dict[str, Any] = {"name": label, "toggles": toggles, "note": note}
            try:
                entry["forward_ms"] = time_call_ms(forward, device, warmup, reps)
                entry["step_ms"] = time_call_ms(train, device, warmup, reps)
                counter = SyncCounter(device=device, cross_check=device.type == "cuda")
                with counter:
                    forward()
                entry["host_syncs_per_step"] = counter.total
                entry["host_syncs_by_kind"] = dict(counter.by_kind)
                if counter.cuda_reported is not None:
                    entry["cuda_reported_syncs"] = counter.cuda_reported
            except torch.cuda.OutOfMemoryError as e:  # report, keep going
                entry = {"name": label, "note": note, "error": f"out of memory: {str(e).splitlines()[0]}"}
                torch.cuda.empty_cache()
            finally:
                if fused_before is not None:
                    set_fused_glu(fused_before)
        rows.append(entry)
    rows.append(_matmuls_alone(base, hidden, index, grad_out, device, warmup, reps))
    return rows


def _hidden_size(experts: nn.Module) -> int:
    return int(getattr(experts, "hidden_size", None) or getattr(experts, "hidden_dim"))


def _matmuls_alone(experts: nn.Module, hidden: torch.Tensor, index: torch.Tensor, grad_out: torch.Tensor,
                   device: torch.device, warmup: int, reps: int) -> dict:
    note = ("zero-overhead limit: grouped_mm(x_sorted, W_gate_up) and grouped_mm(act, W_down) on pre-sorted rows "
            "with device offsets; training adds their input gradients (weights frozen). No routing, bias, gate or "
            "reduction.")
    if _is_nf4(experts):
        w_gate_up, w_down = _NF4Weight(experts, "gate_up_proj").mat_b(), _NF4Weight(experts, "down_proj").mat_b()
        note += " NF4 experts: weights dequantized beforehand (not timed)."
    else:
        w_gate_up = _mat_b(experts, _weight(experts, "gate_up_proj")).detach()
        w_down = _mat_b(experts, _weight(experts, "down_proj")).detach()
    entry: dict[str, Any] = {"name": "expert matmuls alone", "toggles": {}, "note": note}
    if grouped_mm_unavailable(hidden, w_down) is not None:
        entry["error"] = f"no grouped_mm here: {grouped_mm_unavailable(hidden, w_down)}"
        return entry
    _, perm, offs = group_by_expert(index, experts.num_experts, int32=True)
    k = index.shape[1]
    x = hidden[perm // k].contiguous()
    act = torch.randn(x.shape[0], w_down.shape[1], device=device, dtype=hidden.dtype)
    g = grad_out.repeat_interleave(k, dim=0)

    def forward():
        with torch.no_grad():
            _grouped_mm(x, w_gate_up, offs)
            _grouped_mm(act, w_down, offs)

    def train():
        xr = x.detach().requires_grad_(True)
        ar = act.detach().requires_grad_(True)
        gu = _grouped_mm(xr, w_gate_up, offs)
        y = _grouped_mm(ar, w_down, offs)
        torch.autograd.backward([gu, y], [torch.ones_like(gu), g])

    entry["forward_ms"] = time_call_ms(forward, device, warmup, reps)
    entry["step_ms"] = time_call_ms(train, device, warmup, reps)
    entry["host_syncs_per_step"] = 0
    return entry


_SYNC_OP_NAMES = ("aten::nonzero", "aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::equal",
                  "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::bincount")


def timeline(fn: Callable[[], Any], device: torch.device | str) -> dict:
    """Profile one call of ``fn`` and return its host ops and (on CUDA) GPU kernels as ms intervals.

    Returns ``{"host": [(name, start_ms, end_ms, syncs)], "gpu": [(name, start_ms, end_ms)], "host_syncs": n}``;
    ``syncs`` marks host ops that wait for the device (a ``nonzero``, ``item``, ``.tolist()`` copy or stream sync
    anywhere below them). On a CPU there is no GPU lane: the marks show where a GPU run would stall.
    """
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    events = prof.events()

    def waits(evt) -> bool:
        if evt.name in _SYNC_OP_NAMES or evt.name == _HOST_READ_LABEL:
            return True
        if evt.name.startswith("cudaMemcpy") and "Async" not in evt.name:
            return True
        if device.type == "cpu" and evt.name == "aten::_grouped_mm":
            return False  # the CPU kernel reads its offsets from host memory; the CUDA kernel reads them on device
        return any(waits(c) for c in evt.cpu_children)

    host = [e for e in events if e.cpu_parent is None and e.device_type == torch.autograd.DeviceType.CPU
            and not e.name.startswith(("ProfilerStep", "cudaDeviceSynchronize"))]
    gpu = [e for e in events if e.device_type != torch.autograd.DeviceType.CPU]
    if not host:
        return {"host": [], "gpu": [], "host_syncs": 0}
    t0 = min([e.time_range.start for e in host] + [e.time_range.start for e in gpu])
    to_ms = lambda t: (t - t0) / 1e3  # noqa: E731
    host_rows = [(e.name, to_ms(e.time_range.start), to_ms(e.time_range.end), waits(e)) for e in host]
    gpu_rows = [(e.name, to_ms(e.time_range.start), to_ms(e.time_range.end)) for e in gpu]
    return {"host": host_rows, "gpu": gpu_rows, "host_syncs": sum(1 for r in host_rows if r[3])}


def plot_timeline(timelines: dict[str, dict], ax=None, title: str | None = None):
    """Draw host ops (grey; red where the host waits for the device) and GPU kernels (blue) per mode."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.9 + 0.75 * len(timelines) * 2))
    labels, y = [], 0
    for mode, tl in timelines.items():
        if tl["gpu"]:
            ax.broken_barh([(s, max(e - s, 1e-3)) for _, s, e in tl["gpu"]], (y - 0.35, 0.7), color="tab:blue")
            labels.append((y, f"{mode}: GPU kernels"))
            y += 1
        ax.broken_barh([(s, max(e - s, 1e-3)) for _, s, e, w in tl["host"] if not w], (y - 0.35, 0.7),
                       color="lightgray")
        ax.broken_barh([(s, max(e - s, 1e-3)) for _, s, e, w in tl["host"] if w], (y - 0.35, 0.7), color="tab:red")
        labels.append((y, f"{mode}: host ({tl['host_syncs']} waits)"))
        y += 1.4
    ax.set_yticks([p for p, _ in labels])
    ax.set_yticklabels([t for _, t in labels], fontsize=8)
    ax.set_xlabel("ms from the start of the experts forward")
    ax.set_title(title or "one MoE layer's experts forward: red = the host waits for the device", fontsize=9)
    return ax


def routing_variants(model_family: str = "gpt_oss", inputs: Callable | None = None) -> list:
    """The five benchmark variants (naive, grouped, sync_free, transformers eager, transformers grouped_mm).

    ``inputs(batch, state) -> model kwargs`` overrides the stock inputs (e.g. packed attention's metadata).
    """
    from .bench import Variant, default_inputs

    inputs = inputs or default_inputs

    def switch(mode):
        return lambda m: set_moe_routing(m, mode)

    def off(m):
        set_moe_routing(m, None)

    cls = "GptOssExperts" if model_family == "gpt_oss" else "Qwen3MoeExperts"
    return [
        Variant("naive", {"moe_routing": "naive"}, switch("naive"), off, inputs=inputs,
                note=f"before: transformers 5.17's eager {cls}.forward loop, re-registered op for op as "
                     "'fastsft_naive' (one_hot, nonzero, per hit expert: host read of the id, torch.where, gather, "
                     "matmuls, index_add_): 2+ host syncs per hit expert and layer"),
        Variant("grouped", {"moe_routing": "grouped"}, switch("grouped"), off, inputs=inputs,
                note="group once: stable sort of expert ids, searchsorted end offsets, ONE .tolist() per MoE layer, "
                     "per-expert addmm on contiguous slices, deterministic k-way reduction (inverse permutation + "
                     "one bmm); costs one host sync per layer"),
        Variant("sync_free", {"moe_routing": "sync_free"}, switch("sync_free"), off, inputs=inputs,
                note="the same grouping with offsets on the device feeding torch grouped_mm; one-hot addmm for the "
                     "gate_up bias, down bias folded into a (T,E)@(E,H) matmul, no sentinel masking, weighted k-way "
                     "sum as one bmm, GPT-OSS gate fused in one Triton kernel on CUDA; 0 host syncs (falls back to "
                     "'grouped' where grouped_mm cannot run)"),
        Variant("transformers eager", {"experts_implementation": "eager"}, switch("eager"), off, inputs=inputs,
                note="peer: stock transformers experts_implementation='eager' (the same loop, dispatched by "
                     "transformers)"),
        Variant("transformers grouped_mm", {"experts_implementation": "grouped_mm"}, switch("grouped_mm"), off,
                inputs=inputs,
                note="peer: stock transformers experts_implementation='grouped_mm' (the 5.x default): sort, histc "
                     "counts, cumsum offsets, grouped_mm, EP-sentinel masked_fill passes, per-row bias gathers, "
                     "inverse-permutation gather, weight multiply and sum over k"),
    ]


def _as_list(value, default):
    if value is None or value == "default":
        return list(default)
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in str(text))


@dataclasses.dataclass
class _Plan:
    """The resolved options of one ``bench_scenario`` run."""

    device: torch.device
    smoke: bool
    out_dir: str
    steps: int
    warmup: int
    progress: bool
    preset: Any
    num_layers: int | None
    tokens: list
    row_tokens: int
    modes: list
    quant: str | None
    lora_rank: int
    lora_experts: bool
    attn: str | None
    packed_backend: str | None
    micro: bool
    micro_presets: list
    micro_reps: int
    variants: list | None
    dtype: torch.dtype

    @property
    def gpu(self) -> bool:
        return self.device.type == "cuda"


def bench_scenario(*, device, smoke: bool, out_dir: str, steps: int | None = None, warmup: int | None = None,
                   progress: bool = True, **options) -> list[dict]:
    """Benchmark the routing modes on GPT-OSS (whole model steps + one layer's experts alone).

    Options (``--set moe.KEY=VALUE``; defaults GPU / smoke):
        preset: ``gpt-oss-20b`` / ``tiny-gpt-oss`` (``qwen3-30b-a3b`` and ``tiny-qwen3-moe`` work too).
        num_layers: decoder layers kept at real width, 4 / all (recorded in the JSON).
        tokens: tokens per step, ``[8192, 16384]`` / ``[256]``.
        row_tokens: tokens per packed row, 2048 / 128 (stock GPT-OSS attention is eager: T x T scores per row).
        modes: ``["forward", "train"]`` (forward = no-grad validation step; train = forward + backward + AdamW).
        quant: None (bf16 experts) or ``"nf4"`` (NF4 experts + NF4 attention linears, QLoRA).
        lora_rank: 16. lora_experts: False (True adds PEFT target_parameters LoRA on the expert weights; bf16 only).
        attn_implementation: the preset's stock one (GPT-OSS: ``eager``).
        packed_backend: None, or a backend name for ``fastsft_lab.packed.enable_packed_attention``.
        micro: True - also time one layer's experts alone per implementation, plus "expert matmuls alone".
        micro_presets: extra presets for the experts microbenchmark only (1 layer built),
            ``["qwen3-30b-a3b"]`` / ``["tiny-qwen3-moe"]``; ``none`` for no extra preset.
        micro_reps: 10 / 5.
        variants: subset of names to run (default all five).
        dtype: bfloat16 / float32.
    """
    from .models import get_preset

    device = torch.device(device)
    gpu = device.type == "cuda"
    dtype = options.pop("dtype", torch.bfloat16 if gpu else torch.float32)
    plan = _Plan(
        device=device, smoke=smoke, out_dir=out_dir, progress=progress,
        steps=steps if steps is not None else (2 if smoke else 6),
        warmup=warmup if warmup is not None else (1 if smoke else 2),
        preset=get_preset(options.pop("preset", "tiny-gpt-oss" if smoke else "gpt-oss-20b")),
        num_layers=options.pop("num_layers", None if smoke else 4),
        tokens=[int(t) for t in _as_list(options.pop("tokens", None), [256] if smoke else [8192, 16384])],
        row_tokens=int(options.pop("row_tokens", 128 if smoke else 2048)),
        modes=_as_list(options.pop("modes", None), ["forward", "train"]),
        quant=options.pop("quant", None),
        lora_rank=int(options.pop("lora_rank", 16)),
        lora_experts=bool(options.pop("lora_experts", False)),
        attn=options.pop("attn_implementation", None),
        packed_backend=options.pop("packed_backend", None),
        micro=bool(options.pop("micro", True)),
        micro_presets=_as_list(options.pop("micro_presets", "default") or [],  # None/false (CLI "none"): no extra
                               ["tiny-qwen3-moe"] if smoke else ["qwen3-30b-a3b"]),
        micro_reps=int(options.pop("micro_reps", 5 if smoke else 10)),
        variants=_as_list(options.pop("variants"), []) if "variants" in options else None,
        dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype,
    )
    if options:
        raise ValueError(f"unknown moe scenario option(s): {sorted(options)}")
    if plan.quant not in (None, "nf4"):
        raise ValueError(f"quant must be None or 'nf4', got {plan.quant!r}")
    if plan.quant == "nf4" and plan.lora_experts:
        raise ValueError("lora_experts=True needs bf16 experts (PEFT cannot parametrize NF4 expert weights)")
    bad = [m for m in plan.modes if m not in ("forward", "train")]
    if bad:
        raise ValueError(f"modes must be 'forward' and/or 'train', got {bad}")
    os.makedirs(out_dir, exist_ok=True)
    threads = torch.get_num_threads()
    if not gpu:
        # Tiny CPU models gain nothing from intra-op threads, and on a shared 2-core machine spinning OpenMP workers
        # turn every step into noise; one thread gives repeatable smoke numbers.
        torch.set_num_threads(1)
    try:
        return _bench(plan)
    finally:
        torch.set_num_threads(threads)


def _bench(plan: _Plan) -> list[dict]:
    from .bench import format_table, make_result, plot_result, run_variants, write_json
    from .data import benchmark_batches
    from .models import LoraSettings, build_model, get_preset

    preset, device, dtype, quant = plan.preset, plan.device, plan.dtype, plan.quant
    t0 = time.time()
    lora = LoraSettings(rank=plan.lora_rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        lora_experts=plan.lora_experts and preset.family == "gpt_oss")
    model = build_model(preset, device=device, dtype=dtype, quant=quant, lora=lora, num_layers=plan.num_layers,
                        attn_implementation=plan.attn)
    info = model.fastsft_info
    if quant == "nf4":
        quantize_experts_nf4(model, compute_dtype=dtype)
    attention = info.attn_implementation
    inputs_fn = None
    if plan.packed_backend:
        from . import packed  # optimization 1's attention backends (GPT-OSS sinks + sliding window)

        packed.enable_packed_attention(model, backend=plan.packed_backend)
        attention = f"packed:{plan.packed_backend} ({packed.attn_implementation_name(plan.packed_backend)})"
        inputs_fn = lambda batch, state=None: packed.packed_inputs(batch)  # noqa: E731 - metadata built once
    build_s = time.time() - t0
    if plan.progress:
        print(f"  built {preset.name} ({info.num_layers} layers, quant={quant}, attention={attention}) in "
              f"{build_s:.0f}s")

    variants = routing_variants(preset.family, inputs=inputs_fn)
    if plan.variants:
        variants = [v for v in variants if v.name in set(plan.variants)]
    elif quant == "nf4":
        # Stock eager reads self.gate_up_proj per expert: on NF4 that dequantizes the whole layer per expert and
        # autograd keeps every copy (out of memory in training); it is not a fair peer there.
        variants = [v for v in variants if v.name != "transformers eager"]
    results: list[dict] = []
    base_config = {
        "model": preset.name, "family": preset.family, "num_layers": info.num_layers,
        "num_layers_full": preset.config["num_hidden_layers"], "dtype": str(dtype).replace("torch.", ""),
        "quant": quant or "none", "expert_weights": "nf4" if quant == "nf4" else str(dtype).replace("torch.", ""),
        "lora_rank": plan.lora_rank, "lora_targets": list(lora.target_modules), "lora_experts": lora.lora_experts,
        "attn_implementation": attention, "row_tokens": plan.row_tokens, "steps": plan.steps, "warmup": plan.warmup,
        "num_experts": preset.config.get("num_local_experts", preset.config.get("num_experts")),
        "top_k": preset.config.get("num_experts_per_tok"), "build_seconds": round(build_s, 1),
        "params_total": info.params_total, "params_trainable": info.params_trainable,
        "sync_free_gate": "fused triton" if (preset.family == "gpt_oss" and plan.gpu and _HAS_TRITON
                                             and _FUSED_GLU[0]) else "eager",
    }
    if quant == "nf4":
        base_config.update(nf4_expert_bytes(model))
    for tokens in plan.tokens:
        rt = min(plan.row_tokens, tokens)
        batches = benchmark_batches(tokens_per_step=tokens, row_tokens=rt, steps=max(2, min(plan.steps, 4)),
                                    vocab_size=model.config.vocab_size, mix="short" if plan.smoke else "realistic")
        batches = [b.to(device) for b in batches]
        stats = routing_stats(model, inputs_fn(batches[0]) if inputs_fn else batches[0].model_inputs())
        for mode in plan.modes:
            label = f"{preset.name} {tokens} tok {mode}"
            rows = run_variants(model, batches, variants, steps=plan.steps, warmup=plan.warmup, mode=mode,
                                progress=plan.progress, label=label)
            config = dict(base_config, tokens_per_step=tokens, row_tokens=rt, mode=mode, routing=stats)
            notes = ("Whole-model steps; the variants differ only in the experts forward. 'naive' and "
                     "'transformers eager' run the same loop. Routing from random router weights (see "
                     "config.routing). GPT-OSS MoE layers are a part of each step: see the experts microbenchmark "
                     "JSON for the per-layer view.")
            result = make_result("moe-routing", config, rows, device, notes=notes)
            stem = _slug(f"moe_{preset.name}_L{info.num_layers}_{tokens}tok_{mode}" + ("_nf4" if quant else ""))
            write_json(result, os.path.join(plan.out_dir, stem + ".json"))
            plot_result(result, os.path.join(plan.out_dir, stem + ".png"),
                        phases=("forward",) if mode == "forward" else ("forward", "backward", "step"))
            if plan.progress:
                print(f"\n  {label}\n" + format_table(result))
            results.append(result)
        if plan.micro:
            results.append(_micro_result(model, preset.name, tokens, plan, num_layers=info.num_layers))
    del model
    if plan.gpu:
        torch.cuda.empty_cache()
    if plan.micro:
        for name in plan.micro_presets:
            mp = get_preset(name)
            m = build_model(mp, device=device, dtype=dtype, num_layers=1)
            if quant == "nf4":
                quantize_experts_nf4(m, compute_dtype=dtype)
            for tokens in plan.tokens:
                results.append(_micro_result(m, mp.name, tokens, plan, num_layers=1))
            del m
            if plan.gpu:
                torch.cuda.empty_cache()
    return results


def _micro_result(model: nn.Module, preset_name: str, tokens: int, plan: _Plan, *, num_layers: int) -> dict:
    from .bench import format_table, make_result, plot_result, write_json

    device, dtype, quant, warmup, reps = plan.device, plan.dtype, plan.quant, plan.warmup, plan.micro_reps
    rows = experts_microbenchmark(model, tokens=tokens, warmup=warmup, reps=reps)
    experts = experts_modules(model)[0]
    config = {"model": preset_name, "tokens_per_step": tokens, "mode": "one layer's experts (step = fwd+bwd)",
              "layer": 0, "num_experts": experts.num_experts,
              "top_k": model.config.num_experts_per_tok, "hidden_size": _hidden_size(experts),
              "dtype": str(dtype).replace("torch.", ""), "expert_weights": "nf4" if quant == "nf4" else
              str(dtype).replace("torch.", ""), "reps": reps, "warmup": warmup, "model_num_layers": num_layers,
              "phases": {"forward_ms": "experts forward, no grad", "step_ms": "experts forward + backward "
                         "(input and routing-weight grads; expert weights frozen)"}}
    result = make_result("moe-experts-layer", config, rows, device,
                         notes="One MoE layer's experts alone, same input and routing for every implementation; "
                               "the router runs outside the timing.")
    stem = _slug(f"moe_experts_{preset_name}_{tokens}tok" + ("_nf4" if quant else ""))
    write_json(result, os.path.join(plan.out_dir, stem + ".json"))
    plot_result(result, os.path.join(plan.out_dir, stem + ".png"), phases=("forward", "step"),
                title=f"one MoE layer's experts: {preset_name}, {tokens} tokens (step = forward + backward)")
    if plan.progress:
        print(f"\n  experts alone: {preset_name} {tokens} tok\n" + format_table(result))
    return result


__all__ = [
    "MODES", "IMPLEMENTATIONS", "STOCK_IMPLEMENTATIONS",
    "naive_experts_forward", "grouped_experts_forward", "sync_free_experts_forward",
    "group_by_expert", "inverse_permutation", "grouped_mm_unavailable", "register_experts_implementations",
    "is_experts_module", "experts_modules", "get_moe_routing", "experts_implementation", "set_moe_routing",
    "moe_routing", "quantize_experts_nf4", "dequantize_expert_weight", "nf4_expert_bytes", "routing_variants",
    "time_call_ms", "gpt_oss_glu", "fused_glu_available", "set_fused_glu", "routing_stats", "experts_microbenchmark",
    "MICRO_IMPLEMENTATIONS", "bench_scenario", "timeline", "plot_timeline",
]
