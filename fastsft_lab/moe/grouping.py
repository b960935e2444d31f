"""Grouping tokens by expert once per MoE layer: sort, end offsets, the inverse permutation, gathers, the combine.

All of it sync-free and deterministic (no ``bincount``, no ``index_add_`` atomics).
"""

from __future__ import annotations

import torch

from .kernels import FusedCombine, FusedTokenGather, fused_combine_available


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


def tokens_in_expert_order(hidden_states: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor,
                            k: int) -> torch.Tensor:
    """(T, H) -> (S, H): row i is the token of sorted pair i; backward sums each token's k row gradients (one fused
    gather-and-sum kernel on CUDA, :class:`.kernels.FusedTokenGather`; a gather and a sum over k elsewhere)."""
    if fused_combine_available(hidden_states):
        return FusedTokenGather.apply(hidden_states, perm, inv, k)
    return _RowGather.apply(hidden_states, perm // k, inv, k)


def combine(y_sorted: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor,
             top_k_weights: torch.Tensor) -> torch.Tensor:
    """(S, H) expert outputs in sorted order -> (T, H): back to (T, k, H) by the inverse permutation, then the
    routing-weighted sum over the k slots as one batched (1 x k) @ (k x H) matmul per token.

    Deterministic: a gather and a reduction in a fixed order, no ``index_add_`` atomics; the weighting and the sum
    are one kernel (bf16 inputs accumulate in fp32 inside the matmul). On CUDA the gather, weighting and sum are one
    Triton kernel each way (:class:`.kernels.FusedCombine`, same numerics).
    """
    if fused_combine_available(y_sorted):
        return FusedCombine.apply(y_sorted, perm, inv, top_k_weights.to(y_sorted.dtype))
    num_tokens, k = top_k_weights.shape
    y = _RowGather.apply(y_sorted, inv, perm, 1).view(num_tokens, k, -1)  # (T, k, H)
    return torch.bmm(top_k_weights.to(y.dtype).unsqueeze(1), y).squeeze(1)  # (T, 1, k) @ (T, k, H) -> (T, H)



__all__ = ["group_by_expert", "inverse_permutation", "tokens_in_expert_order", "combine"]
