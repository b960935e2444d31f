"""A fused, chunked linear cross-entropy: the LM head and the loss without ever holding the (tokens, vocab) logits.

A causal LM's step materialises ``logits = hidden @ W_head.T`` in float32 -- 8192 tokens x 151,936 words = 5 GB for
Qwen3 -- and autograd keeps it, and its gradient, for the backward. The fused loss walks the tokens in chunks: per
chunk it computes the logits, their log-sum-exp, the loss of the chunk and, right away, the gradient of the loss
with respect to the chunk's hidden states (and to the head's weight, when it trains); only those gradients are
kept. Peak memory then holds one chunk's logits, not all of them.

No host sync: the number of tokens that take a loss is either given (``num_items_in_batch``, as transformers'
Trainer passes it) or stays a device tensor that the sum is divided by. (Liger-Kernel's fused loss reads it back
with ``.item()``.)

The switch :func:`enable_fused_loss` replaces the forward of one model instance (not of its class) by
:func:`fused_causal_lm_forward`, which runs the model's decoder as it is and computes transformers'
``ForCausalLMLoss`` -- labels shifted by one, ``-100`` ignored, summed and divided by ``num_items_in_batch`` or
averaged -- plus, for MoE models, the same router load-balancing loss the model's own forward adds. With labels it
returns no logits (there are none); without labels it is the model's own forward. :func:`disable_fused_loss`
removes the instance attribute.
"""

from __future__ import annotations

import sys
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

from .model_state import ModelState, register_state_reader, state
from .models import base_model

IGNORE_INDEX = -100
_ATTR = "_fastsft_fused_loss"


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
            logits = (h @ weight.t()).float()                                  # (c, V)
            valid = t != IGNORE_INDEX
            safe = torch.where(valid, t, torch.zeros_like(t))
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            total += ((lse - picked) * valid).sum()
            if need_h or need_w:
                # d loss / d logits = softmax - onehot(target), zero for ignored tokens
                g = torch.exp(logits - lse[:, None])
                g.scatter_add_(1, safe[:, None], -torch.ones_like(lse)[:, None])
                g *= valid[:, None]
                g = g.to(hidden.dtype)
                if need_h:
                    grad_h[start:start + chunk] = g @ weight
                if need_w:
                    grad_w += (g.t() @ h).float()
            del logits
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
        chunk: tokens per chunk (peak extra memory: ``chunk x vocab x 4`` bytes).
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


def fused_causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                            inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    """A transformers ``*ForCausalLM`` forward whose loss is :func:`linear_cross_entropy` (no logits with labels)."""
    original = self.__dict__[_ATTR]
    if labels is None or past_key_values is not None:
        return original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                        use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
    moe = hasattr(self.config, "router_aux_loss_coef") and hasattr(self, "num_experts")
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
            balance = sys.modules[type(self).__module__].load_balancing_loss_func
            aux = balance(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)
            loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
        out.update(loss=loss, aux_loss=aux, router_logits=outputs.router_logits)
    return self.__dict__[_ATTR + "_output"](**out)


def _output_class(model: nn.Module):
    import transformers.modeling_outputs as mo

    return mo.MoeCausalLMOutputWithPast if hasattr(model.config, "router_aux_loss_coef") else mo.CausalLMOutputWithPast


def enable_fused_loss(model: nn.Module) -> ModelState:
    """Compute the training loss with :func:`linear_cross_entropy` on this model instance (PEFT-wrapped or not)."""
    base = base_model(model)
    if _ATTR in base.__dict__:
        return state(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None or not hasattr(base, "model") or getattr(head, "weight", None) is None:
        raise ValueError(f"{type(base).__name__} is not a transformers *ForCausalLM with an LM head: the fused loss "
                         "replaces its loss")
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError(f"{type(base).__name__}'s LM head has a bias, which the fused loss does not take")
    base.__dict__[_ATTR] = base.forward
    base.__dict__[_ATTR + "_output"] = _output_class(base)
    base.forward = MethodType(fused_causal_lm_forward, base)
    return state(model)


def disable_fused_loss(model: nn.Module) -> ModelState:
    """Give the model back its own forward (a no-op when the fused loss is off)."""
    base = base_model(model)
    if _ATTR in base.__dict__:
        base.__dict__.pop("forward", None)
        base.__dict__.pop(_ATTR)
        base.__dict__.pop(_ATTR + "_output")
    return state(model)


def _read_state(model: nn.Module) -> dict:
    return {"fused_loss": True} if _ATTR in base_model(model).__dict__ else {}


register_state_reader("fused_loss", _read_state)

__all__ = ["linear_cross_entropy", "enable_fused_loss", "disable_fused_loss", "fused_causal_lm_forward"]
