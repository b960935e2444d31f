"""A fused, chunked linear cross-entropy: the LM head and the loss without ever holding the (tokens, vocab) logits.

A causal LM's step materialises ``logits = hidden @ W_head.T`` in float32 -- 8192 tokens x 151,936 words = 5 GB for
Qwen3 -- and autograd keeps it, and its gradient, for the backward. The fused loss walks the tokens in chunks: per
chunk it computes the logits, their log-sum-exp, the loss of the chunk and, right away, the gradient of the loss
with respect to the chunk's hidden states (and to the head's weight, when it trains); only those gradients are
kept. Peak memory then holds one chunk's logits, not all of them.

Per chunk, ``logits = h @ W.T`` comes out of the matmul in its dtype (bf16 for a bf16 model); everything after it is
elementwise work on a (chunk, V) tensor, two paths side by side:

* **kernel** (:func:`_fused_chunk`; Triton on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``): one program per
  row reads the row in blocks of columns for its running max and sum of exponentials (online softmax), then its
  log-sum-exp and its loss term ``(lse - logits[target]) * valid``, and in a second pass overwrites the logits in
  place with the gradient ``(softmax - onehot(target)) * valid``, computed in float32 and rounded to the logits'
  dtype. Two reads and one write of the logits, no float32 copy. ``grad_h`` of the chunk is one matmul written
  straight into its rows (``torch.mm(..., out=)``); ``grad_W``, when the head trains, comes from the same gradient.
* **eager** (:func:`_eager_chunk`; the CPU path and the kernel's reference): ``.float()``, ``logsumexp``, ``gather``,
  ``exp``, ``scatter_add_``, a mask and a cast -- about eight passes over a float32 (chunk, V) tensor.

Both read the same rounded logits and compute in float32, so they agree up to summation order. The kernel runs
where :func:`fused_ce_available` says so; ``FASTSFT_FUSED_CE=0`` or :func:`set_fused_ce` turns it off.

No host sync: the per-row losses are summed on the device, and the number of tokens that take a loss is either given
(``num_items_in_batch``, as transformers' Trainer passes it) or stays a device tensor that the sum is divided by.
(Liger-Kernel's fused loss reads it back with ``.item()``.)

The switch (:data:`FUSED_LOSS`, ``apply(fused_loss=True)``, or :func:`enable_fused_loss`) puts
:func:`fused_causal_lm_forward` in front of the forward of one model instance (not of its class), through the
model's restore log; it runs the model's decoder as it is and computes transformers'
``ForCausalLMLoss`` -- labels shifted by one, ``-100`` ignored, summed and divided by ``num_items_in_batch`` or
averaged -- plus, for MoE models, the same router load-balancing loss the model's own forward adds. With labels it
returns no logits (there are none); without labels it is the model's own forward. :func:`disable_fused_loss`
takes it back.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ._util import KernelSwitch, on_device_of
from .families import router_aux_loss
from .model_state import ModelState, state
from .restore import Optimization, changes, is_on, record
from .structure import base_model

IGNORE_INDEX = -100
SWITCH = "fused_loss"


# --- one chunk's loss and gradient of the logits: the eager expression and the Triton kernel ---------------------
def _eager_chunk(logits: torch.Tensor, target: torch.Tensor, grad_dtype: torch.dtype | None):
    """(c, V) logits as the matmul produced them, (c,) targets -> (c,) float32 loss terms and, with ``grad_dtype``,
    d loss / d logits = ``(softmax - onehot(target)) * valid`` in that dtype (else None)."""
    logits = logits.float()                                                # (c, V)
    valid = target != IGNORE_INDEX
    safe = torch.where(valid, target, torch.zeros_like(target))
    lse = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(1, safe[:, None]).squeeze(1)
    loss = (lse - picked) * valid
    if grad_dtype is None:
        return loss, None
    g = torch.exp(logits - lse[:, None])
    g.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
    g *= valid[:, None]
    return loss, g.to(grad_dtype)


_FUSED_CE = KernelSwitch("FASTSFT_FUSED_CE")

try:  # Triton ships with CUDA builds of PyTorch; TRITON_INTERPRET=1 runs the kernel on CPU tensors (tests)
    import triton
    import triton.language as tl

    @triton.jit
    def _ce_chunk_kernel(logits_ptr, target_ptr, loss_ptr, V, stride, IGNORE: tl.constexpr, GRAD: tl.constexpr,
                         BLOCK: tl.constexpr):
        # one program per row: loss[row] = (lse - x[target]) * valid; with GRAD, x <- (softmax(x) - onehot) * valid
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        tgt = tl.load(target_ptr + row).to(tl.int64)
        valid = (tgt != IGNORE).to(tl.float32)
        m = float("-inf")   # running max
        d = 0.0             # running sum of exp(x - m)
        for c0 in range(0, V, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        lse = m + tl.log(d)
        picked = tl.load(base + tl.where(tgt != IGNORE, tgt, 0)).to(tl.float32)
        tl.store(loss_ptr + row, (lse - picked) * valid)
        if GRAD:  # second pass, in place: each program reads and writes its own row only
            for c0 in range(0, V, BLOCK):
                cols = c0 + tl.arange(0, BLOCK)
                cmask = cols < V
                x = tl.load(base + cols, mask=cmask, other=0.0).to(tl.float32)
                grad = tl.exp(x - lse)
                grad = tl.where(cols == tgt, grad - 1.0, grad)
                grad = grad * valid
                tl.store(base + cols, grad.to(logits_ptr.dtype.element_ty), mask=cmask)

    _HAS_TRITON = True
except Exception:  # noqa: BLE001 - no triton (CPU wheels): the eager chunk runs
    _HAS_TRITON = False

_CE_BLOCK = 4096      # columns per iteration (151,936 words: 38 iterations per pass)
_CE_WARPS = 8


def fused_ce_available(t: torch.Tensor) -> bool:
    """Whether the fused cross-entropy kernel runs on ``t`` (CUDA + triton, and not switched off)."""
    return _FUSED_CE.runs_on(t, _HAS_TRITON)


def set_fused_ce(enabled: bool) -> bool:
    """Turn the fused cross-entropy kernel of :func:`linear_cross_entropy` on or off (env ``FASTSFT_FUSED_CE``; off
    runs :func:`_eager_chunk`, about eight passes over a float32 copy of each chunk's logits); returns the old."""
    return _FUSED_CE.set(enabled)


def _fused_chunk(logits: torch.Tensor, target: torch.Tensor, grad: bool, block: int = _CE_BLOCK):
    """:func:`_eager_chunk` as one Triton kernel: returns the (c,) float32 loss terms and, with ``grad``, the logits
    themselves overwritten with their gradient (same dtype); without ``grad`` the logits are left as they are."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        with on_device_of(logits):
            _ce_chunk_kernel[(rows,)](logits, target.contiguous(), loss, vocab, logits.stride(0),
                                      IGNORE=IGNORE_INDEX, GRAD=grad, BLOCK=block, num_warps=_CE_WARPS)
    return loss, (logits if grad else None)


class _LinearCrossEntropy(torch.autograd.Function):
    """sum over valid tokens of cross_entropy(hidden @ W.T, target); gradients computed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, chunk: int):
        # hidden (N, H), weight (V, H), target (N,) with IGNORE_INDEX where no loss
        n = hidden.shape[0]
        need_h = ctx.needs_input_grad[0]
        need_w = ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            h = hidden[start:start + chunk]
            t = target[start:start + chunk]
            logits = h @ weight.t()                                            # (c, V), the matmul's dtype
            if fused_ce_available(logits):
                loss, g = _fused_chunk(logits, t, need_h or need_w)            # g is logits, overwritten
            else:
                loss, g = _eager_chunk(logits, t, hidden.dtype if need_h or need_w else None)
            total += loss.sum()
            if need_h:
                rows = grad_h[start:start + chunk]
                if g.dtype == weight.dtype == rows.dtype and rows.is_contiguous():
                    torch.mm(g, weight, out=rows)                              # straight into grad_h, no copy
                else:  # mixed dtypes (autocast): let the matmul pick its dtype, then copy
                    rows.copy_(g @ weight)
            if need_w:
                grad_w += (g.t() @ h).float()
            del logits, g
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = (grad_w * grad_out).to(ctx.weight_dtype) if grad_w is not None else None
        return gh, gw, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         num_items_in_batch: int | torch.Tensor | None = None, chunk: int = 1024,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' causal-LM loss of ``hidden @ weight.T`` against ``labels`` (shifted by one), fused and chunked.

    Args:
        hidden: (B, T, H) final hidden states (after the final norm).
        weight: (V, H) the LM head's weight.
        labels: (B, T) token ids, ``-100`` where no loss is taken; shifted by one inside, as transformers does.
        num_items_in_batch: divide the summed loss by this (int or device tensor); default: the number of valid
            labels, kept on the device (no sync).
        chunk: tokens per chunk (peak extra memory: one chunk's logits in the matmul's dtype with the kernel,
            ``chunk x vocab x 2`` bytes in bf16; the eager path adds float32 copies, ``chunk x vocab x 4`` bytes each).
    """
    if bias is not None:
        raise NotImplementedError("the fused loss takes an LM head without bias")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)
    total = _LinearCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, shift, chunk)
    if num_items_in_batch is None:
        count = (shift != IGNORE_INDEX).sum()
        return total / count.clamp(min=1).to(total.dtype)
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


@dataclass
class FusedLoss:
    """The ``fused_loss`` switch's record in the model's restore log: the model's output class and where its router
    load-balancing loss is averaged (:func:`set_router_loss_scope`)."""

    output: Any
    router_loss: bool = False      # the family adds a router load-balancing loss (its record)
    scope: str = "rank"

    def state(self) -> dict:
        return {"fused_loss": True}


def fused_causal_lm_forward(fused: FusedLoss, self, original, input_ids=None, attention_mask=None, position_ids=None,
                            past_key_values=None, inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0,
                            **kwargs):
    """A transformers ``*ForCausalLM`` forward whose loss is :func:`linear_cross_entropy` (no logits with labels);
    ``original`` is the model's own forward, ``fused`` the switch's record."""
    if labels is None or past_key_values is not None:
        return original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                        use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
    moe = fused.router_loss
    if moe:
        kwargs.setdefault("output_router_logits", self.config.output_router_logits)
    router = kwargs.get("output_router_logits", False) if moe else False
    num_items = kwargs.pop("num_items_in_batch", None)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    head = self.get_output_embeddings()
    loss = linear_cross_entropy(outputs.last_hidden_state, head.weight, labels, num_items_in_batch=num_items,
                                bias=getattr(head, "bias", None))
    out = {"loss": loss, "logits": None, "past_key_values": outputs.past_key_values,
           "hidden_states": outputs.hidden_states, "attentions": outputs.attentions}
    if moe:
        aux = None
        if router:
            if fused.scope == "global" and _world_size() > 1:
                aux = load_balancing_loss_across_ranks(outputs.router_logits, self.num_experts,
                                                       self.num_experts_per_tok, attention_mask)
            else:
                balance = sys.modules[type(self).__module__].load_balancing_loss_func
                aux = balance(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)
            loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
        out.update(loss=loss, aux_loss=aux, router_logits=outputs.router_logits)
    return fused.output(**out)


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def load_balancing_loss_across_ranks(gate_logits, num_experts: int, top_k: int,
                                     attention_mask: torch.Tensor | None = None, group=None) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` (Switch Transformer, summed over layers) over the tokens of every
    rank of ``group``, as one process would compute it on the global batch: this rank's share of it.

    The loss is ``E * sum_e (T_e / R) * (P_e / R)`` with ``T_e`` the top-k assignments to expert ``e``, ``P_e`` the
    summed router probabilities and ``R`` the routed tokens (padding masked out), all summed over layers. ``T`` and
    ``R`` carry no gradient: one all-reduce of ``E + 1`` numbers makes them global. ``P`` stays this rank's own, so
    the shares of the ranks add up to the global loss and their gradients to its gradient -- the same convention as
    the language-model loss divided by the global token count (``num_items_in_batch``), whose sum over ranks (the
    wrapper averages gradients; Trainer multiplies the loss by the world size) is the global loss. Per rank, the
    stock function would count the router loss once per rank.
    """
    import torch.distributed as dist

    if not isinstance(gate_logits, tuple) or not gate_logits:
        raise ValueError("load_balancing_loss_across_ranks needs the router logits of every layer (a tuple)")
    device = gate_logits[0].device
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=device)
    prob = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    for layer_gate in gate_logits:
        weights = F.softmax(layer_gate.to(device), dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)
        if mask is None:
            assigned = assigned + torch.bincount(selected.reshape(-1), minlength=num_experts).float()
            prob = prob + weights.float().sum(dim=0)
            rows = rows + weights.shape[0]
        else:
            assigned = assigned + torch.zeros_like(assigned).scatter_add_(0, selected.reshape(-1),
                                                                          mask.repeat_interleave(top_k))
            prob = prob + (weights.float() * mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + mask.sum()
    counts = torch.cat([assigned, rows.reshape(1)]).detach()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, group=group)          # global assignments and routed tokens (no gradient)
    total = counts[-1]
    return torch.sum((counts[:-1] / total) * (prob / total)) * num_experts


def set_router_loss_scope(model: nn.Module, scope: str) -> None:
    """Where the fused loss's router load-balancing loss is averaged: ``"rank"`` (each rank over its own tokens, as
    stock transformers does; default) or ``"global"`` (over the tokens of every rank, equal to one process on the
    global batch: :func:`load_balancing_loss_across_ranks`; every rank must run the forward, as under DDP / FSDP).
    Needs the fused loss on (``apply(model, fused_loss=True)``)."""
    if scope not in ("rank", "global"):
        raise ValueError(f"router loss scope must be 'rank' or 'global', got {scope!r}")
    if not is_on(model, SWITCH):
        raise ValueError("the router loss across ranks is computed by the fused loss: apply(model, fused_loss=True) "
                         "first")
    record(model, SWITCH).scope = scope


def _output_class(router_loss: bool):
    import transformers.modeling_outputs as mo

    return mo.MoeCausalLMOutputWithPast if router_loss else mo.CausalLMOutputWithPast


# Config fields with which a transformers *ForCausalLM changes its logits between the LM head and the loss
# (Gemma 2's final tanh softcapping, Granite's division, Cohere's scale), and the value that means "unchanged".
LOGIT_TRANSFORMS = {"final_logit_softcapping": None, "logits_scaling": 1.0, "logit_scale": 1.0}


def check_fused_loss(model: nn.Module) -> None:
    """One line refusing a model whose loss :func:`fused_causal_lm_forward` would not compute exactly: no LM head,
    an LM head with a bias, or logits changed after the head (:data:`LOGIT_TRANSFORMS`). Changes nothing."""
    base = base_model(model)
    name = type(base).__name__
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None or not hasattr(base, "model") or getattr(head, "weight", None) is None:
        raise ValueError(f"{name} is not a transformers *ForCausalLM with an LM head: the fused loss replaces its loss")
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError(f"{name}'s LM head has a bias, which the fused loss does not take")
    config = getattr(base, "config", None)
    for field_name, unchanged in LOGIT_TRANSFORMS.items():
        value = getattr(config, field_name, unchanged)
        if value is not None and value != unchanged:
            raise NotImplementedError(f"{name} changes its logits after the LM head ({field_name}={value}), which "
                                      "the fused loss does not do: leave fused_loss off for this model")


def validate(model: nn.Module, value, options: dict) -> bool:
    """The ``fused_loss`` switch's checks: True or False, and a model whose loss it computes exactly."""
    if not isinstance(value, bool):
        raise ValueError(f"fused_loss must be True or False, got {value!r}")
    check_fused_loss(model)
    return value


def enable(model: nn.Module, value: bool = True) -> None:
    """Put :func:`fused_causal_lm_forward` in front of the model's forward (a no-op when it is there)."""
    log = changes(model, SWITCH)
    if log.record is not None:
        return
    base = base_model(model)
    moe = router_aux_loss(base.config)
    log.record = FusedLoss(_output_class(moe), moe)
    log.forward(base, functools.partial(fused_causal_lm_forward, log.record))


FUSED_LOSS = Optimization(SWITCH, validate, enable, off=(False,))


def enable_fused_loss(model: nn.Module) -> ModelState:
    """Compute the training loss with :func:`linear_cross_entropy` on this model instance (PEFT-wrapped or not)."""
    if not is_on(model, SWITCH):
        check_fused_loss(model)
        enable(model)
    return state(model)


def disable_fused_loss(model: nn.Module) -> ModelState:
    """Give the model back its own forward (a no-op when the fused loss is off)."""
    FUSED_LOSS.disable(model)
    return state(model)


__all__ = ["FUSED_LOSS", "FusedLoss", "check_fused_loss", "LOGIT_TRANSFORMS", "linear_cross_entropy", "enable_fused_loss", "disable_fused_loss",
           "fused_causal_lm_forward",
           "fused_ce_available", "set_fused_ce", "load_balancing_loss_across_ranks", "set_router_loss_scope"]
