"""The three experts forwards of the ``moe_routing`` switch, side by side (transformers' experts signature:
hidden (T, H), top_k_index (T, k), top_k_weights (T, k) -> (T, H); a family whose record says its router hands over
dense (T, E) scores has them gathered to (T, k) first, :func:`.modules.top_k_weights`).

* ``naive``     - the per-expert loop, op for op transformers' own eager ``GptOssExperts.forward`` /
  ``Qwen3MoeExperts.forward`` / ``MixtralExperts.forward`` (one_hot -> expert_hit.nonzero() -> for each hit expert:
  ``torch.where`` -> gather -> matmuls -> ``index_add_``). The "before": 2+ host syncs per hit expert and layer.
* ``grouped``   - group once (:mod:`.grouping`): stable sort, per-expert end offsets by ``searchsorted``, ONE
  ``.tolist()`` of the offsets per MoE layer (exactly one host sync), one matmul pair per non-empty expert on its
  contiguous slice, a deterministic reduction of each token's k expert outputs.
* ``sync_free`` - the same grouping with the offsets left on the device, feeding a grouped matmul
  (:mod:`.matmul`): zero host syncs. Where no grouped matmul runs it falls back to ``grouped`` (and says so).
  Against transformers' own ``grouped_mm`` experts (same idea) it trims the glue around the two matmuls: no
  expert-parallel sentinel masking, biases folded into small GEMMs instead of (S, .) gathers, the routing weights
  applied inside the k-way reduction, gathers whose backward is a gather, and on CUDA the gates, the combine and the
  token gather's backward as fused Triton kernels (:mod:`.gate`, :mod:`.kernels`).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .._compat import experts_gate
from .gate import GATES, fused_glu_available
from .grouping import combine, group_by_expert, inverse_permutation, tokens_in_expert_order
from .matmul import ContiguousGrad, grouped_mm, grouped_mm_unavailable
from .modules import spec_of
from .modules import top_k_weights as routing_top_k
from .nf4 import NF4_ATTR, NF4GroupedMM, NF4Weight, expert_matmul, expert_weight, is_nf4, mat_b, nf4_checked

HOST_READ_LABEL = "fastsft::expert_offsets_to_host"  # profiler label of grouped's one host read per layer


def grouped_proj(module: nn.Module, name: str, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x`` (rows sorted by expert) through every expert's ``name`` projection in one grouped matmul."""
    if is_nf4(module):
        return grouped_mm_nf4(x, offs, NF4Weight(module, name))
    return grouped_mm(x, mat_b(module, expert_weight(module, name)).to(x.dtype), offs)


def grouped_mm_nf4(x: torch.Tensor, offs: torch.Tensor, store: NF4Weight) -> torch.Tensor:
    return ContiguousGrad.apply(NF4GroupedMM.apply(x, offs, store))


def naive_experts_forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """The per-expert loop, op for op transformers' eager ``GptOssExperts.forward`` / ``Qwen3MoeExperts.forward``.

    Per hit expert: a host read of the expert id (``expert_idx == num_experts``) and a ``torch.where`` on its mask
    (``nonzero``) - the syncs this module removes. Bit-identical to the stock eager path on plain weights; on NF4
    weights it dequantizes only the experts that were hit.
    """
    nf4 = nf4_checked(self)
    bias = spec_of(self).bias
    top_k_weights = routing_top_k(self, top_k_index, top_k_weights)
    final_hidden_states = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=self.num_experts)
        expert_mask = expert_mask.permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    w_gate_up = None if nf4 else expert_weight(self, "gate_up_proj")
    w_down = None if nf4 else expert_weight(self, "down_proj")
    for expert_idx in expert_hit:
        expert_idx = expert_idx[0]
        if expert_idx == self.num_experts:  # host read: skip the EP sentinel
            continue
        top_k_pos, token_idx = torch.where(expert_mask[expert_idx])  # host read: how many tokens?
        current_state = hidden_states[token_idx]
        e = int(expert_idx) if nf4 else expert_idx
        gate_up = expert_matmul(self, "gate_up_proj", current_state, e, w_gate_up)
        if bias:
            gate_up = gate_up + self.gate_up_proj_bias[expert_idx]
        current = experts_gate(self, gate_up)
        current = expert_matmul(self, "down_proj", current, e, w_down)
        if bias:
            current = current + self.down_proj_bias[expert_idx]
        current = current * top_k_weights[token_idx, top_k_pos, None]
        final_hidden_states.index_add_(0, token_idx, current.to(final_hidden_states.dtype))
    return final_hidden_states


def grouped_experts_forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """Group once, one host sync per layer: sort, end offsets, ONE ``.tolist()``, per-expert slices.

    The matmuls stay per expert (ordinary GEMMs with the bias fused by ``addmm``), but the host already knows every
    slice boundary, so it launches them back to back without waiting for the GPU. On NF4 weights only the hit
    experts are dequantized.
    """
    num_tokens, k = top_k_index.shape
    if num_tokens == 0:
        return torch.zeros_like(hidden_states)
    nf4 = nf4_checked(self)
    spec = spec_of(self)
    biased_addmm = spec.bias and not nf4 and spec.transposed      # the bias folded into the matmul
    top_k_weights = routing_top_k(self, top_k_index, top_k_weights)
    sorted_ids, perm, ends = group_by_expert(top_k_index, self.num_experts)
    with torch.profiler.record_function(HOST_READ_LABEL):
        ends_host = ends.tolist()  # THE host sync of this layer: every slice boundary at once
    inv = inverse_permutation(perm)
    x = tokens_in_expert_order(hidden_states, perm, inv, k)  # (S, H) rows in expert order
    w_gate_up = None if nf4 else expert_weight(self, "gate_up_proj")
    w_down = None if nf4 else expert_weight(self, "down_proj")
    outputs = []
    start = 0
    for e, end in enumerate(ends_host):
        if end == start:  # an expert that got no tokens: nothing to launch
            continue
        xe = x[start:end]
        if biased_addmm:
            gate_up = torch.addmm(self.gate_up_proj_bias[e], xe, w_gate_up[e])
        else:
            gate_up = expert_matmul(self, "gate_up_proj", xe, e, w_gate_up)
            if spec.bias:
                gate_up = gate_up + self.gate_up_proj_bias[e]
        act = experts_gate(self, gate_up)
        if biased_addmm:
            out = torch.addmm(self.down_proj_bias[e], act, w_down[e])
        else:
            out = expert_matmul(self, "down_proj", act, e, w_down)
            if spec.bias:
                out = out + self.down_proj_bias[e]
        outputs.append(out)
        start = end
    y = torch.cat(outputs) if len(outputs) > 1 else outputs[0]  # (S, H) in sorted order
    return combine(y, perm, inv, top_k_weights).to(hidden_states.dtype)


_FALLBACK_WARNED: set[str] = set()


def sync_free_experts_forward(self: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """Group once and never ask the host: offsets stay on the device and feed one grouped matmul per projection.

    Compared with transformers' ``grouped_mm`` experts (same sort + grouped matmuls), the glue around the matmuls
    does less work: end offsets by ``searchsorted`` (no histc + cumsum), no expert-parallel sentinel masking
    (three ``masked_fill`` passes over (S, H)/(S, 2I) - we do not run expert parallelism), the gate_up bias added
    by one ``addmm`` against a one-hot (S, E) matrix (no per-row bias gather), the down bias folded into a tiny
    (T, E) @ (E, H) matmul of the routing weights (no (S, H) gather + add), the routing weights applied inside the
    k-way reduction, and on CUDA fused Triton kernels each way for the gate (GPT-OSS's, reading the gate_up bias
    in place; the SiLU gate), the combine (gather + weighting + k-way sum) and the token gather's backward
    (:mod:`.gate`, :mod:`.kernels`; one batched matmul, a gather and a sum elsewhere).
    Falls back to :func:`grouped_experts_forward` (one host sync) where no grouped matmul runs, with a warning.
    """
    num_tokens, k = top_k_index.shape
    if num_tokens == 0:
        return torch.zeros_like(hidden_states)
    nf4 = nf4_checked(self)
    if nf4:
        dtype = getattr(self, NF4_ATTR)["dtype"]
        reason = grouped_mm_unavailable(hidden_states.to(dtype) if hidden_states.dtype != dtype else hidden_states,
                                        self.down_proj_nf4.new_empty(0, dtype=dtype))
    else:
        reason = grouped_mm_unavailable(hidden_states, expert_weight(self, "down_proj"))
    if reason is not None:
        if reason not in _FALLBACK_WARNED:
            _FALLBACK_WARNED.add(reason)
            warnings.warn(f"moe_routing='sync_free' falls back to 'grouped' (one host sync per MoE layer): {reason}",
                          stacklevel=2)
        return grouped_experts_forward(self, hidden_states, top_k_index, top_k_weights)

    top_k_weights = routing_top_k(self, top_k_index, top_k_weights)
    num_experts = self.num_experts
    sorted_ids, perm, offs = group_by_expert(top_k_index, num_experts, int32=True)
    inv = inverse_permutation(perm)
    x = tokens_in_expert_order(hidden_states, perm, inv, k)  # (S, H) rows in expert order
    gate_up = grouped_proj(self, "gate_up_proj", x, offs)  # (S, 2I)
    spec = spec_of(self)
    gate = GATES[spec.gate]                                # the record's gate kind
    if spec.bias and gate.apply_with_bias is not None and fused_glu_available(gate_up):
        # the fused gate adds each row's expert bias as it reads gate_up: no (S, 2I) biased copy
        act = gate.apply_with_bias(self, gate_up, sorted_ids)
    else:
        if spec.bias:
            # Per-row bias of the row's expert = one_hot(expert) @ bias: one GEMM over (S, E) x (E, 2I) that reads
            # and writes gate_up once, instead of gathering an (S, 2I) bias tensor and adding it.
            # (A comparison, not scatter_(..., 1.0): torch 2.11's inductor lowers that scatter to a float32 tensor
            # in a bf16 graph, and the addmm then fails on mixed dtypes inside a compiled layer.)
            experts = torch.arange(num_experts, device=sorted_ids.device, dtype=sorted_ids.dtype)
            one_hot = (sorted_ids.unsqueeze(1) == experts).to(gate_up.dtype)
            gate_up = torch.addmm(gate_up, one_hot, self.gate_up_proj_bias.to(gate_up.dtype))
        act = gate.apply(self, gate_up)  # (S, I); a fused Triton kernel on CUDA (GPT-OSS's GLU, the SiLU gate)
    y = grouped_proj(self, "down_proj", act, offs)  # (S, H)
    out = combine(y, perm, inv, top_k_weights)  # (T, H)
    if spec.bias:
        # sum_j w_tj * b[e_tj] = (routing weights scattered to (T, E)) @ bias: exact, and tiny next to (S, H).
        dense = top_k_weights.new_zeros(num_tokens, num_experts).scatter(1, top_k_index, top_k_weights)
        out = torch.addmm(out, dense.to(out.dtype), self.down_proj_bias.to(out.dtype))
    return out.to(hidden_states.dtype)


FORWARDS = {"naive": naive_experts_forward, "grouped": grouped_experts_forward, "sync_free": sync_free_experts_forward}

__all__ = ["naive_experts_forward", "grouped_experts_forward", "sync_free_experts_forward", "FORWARDS",
           "grouped_proj", "HOST_READ_LABEL"]
