"""Why an MoE step's `vs ref` is large in bf16: routing decisions that flip at near-ties, counted per layer.

Two experts implementations that compute the same sums in another order (transformers' ``grouped_mm`` glue and
``sync_free``'s) give hidden states one rounding apart. In float32 that rounding is ~1e-7 and nothing else moves. In
bf16 it is ~1e-2 of a value, enough to swap the router's k-th and (k+1)-th expert of a token whose two logits were
that close (random router weights make many such near-ties): that token then goes through another expert, its output
changes by O(1), and so does every gradient it touches. The step's largest relative difference reads 1e-1, not 1e-3,
although neither path is wrong.

:func:`routing_agreement` measures it on one step: the reference variant and the other variant run at the same
weights, each layer's top-k choices are recorded, and the tokens whose chosen experts differ are counted per layer;
then the other variant runs again with the reference's choices forced in every layer (:func:`force_routing`: the
router's own weights recomputed at the forced experts, so gradients still flow through the router). What is left
then is the rounding of the kernels alone::

    agreement = routing_agreement(model, batch, reference_variant, other_variant)
    agreement["flipped_tokens"]      # per layer: tokens whose set of experts differs from the reference's
    agreement["free"]["rel"]         # loss and gradients as run (what the chain's vs ref column shows)
    agreement["forced"]["rel"]       # the same with the reference's routing forced: the kernels' rounding only
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

from ..structure import decoder_layers, family_of
from ..moe import experts_modules
from .harness import Variant, _forward_loss

__all__ = ["routers", "record_routing", "force_routing", "routing_weights_at", "flipped_tokens", "routing_agreement",
           "agreement_text"]


def routers(model: nn.Module) -> list[nn.Module]:
    """The router of every MoE layer of ``model``, in layer order (the family record names the attribute)."""
    family = family_of(model)
    if family.experts is None:
        raise ValueError(f"{family.name} has no mixture-of-experts layers: no routing to compare")
    out = [getattr(layer.mlp, family.experts.router, None) for layer in decoder_layers(model)]
    return [r for r in out if r is not None]


def _softmax_of_chosen(router: nn.Module, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    # GPT-OSS: softmax over the chosen experts' logits
    return torch.softmax(logits.gather(-1, index), dim=1, dtype=logits.dtype)


def _chosen_of_softmax(router: nn.Module, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    # Qwen3-MoE, Mixtral: softmax over every expert in float32, the chosen ones kept (renormalized where the
    # config says so), back in the logits' dtype
    top = torch.softmax(logits, dim=-1, dtype=torch.float).gather(-1, index)
    if getattr(router, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype)


_WEIGHTS = {"GptOssTopKRouter": _softmax_of_chosen, "Qwen3MoeTopKRouter": _chosen_of_softmax,
            "MixtralTopKRouter": _chosen_of_softmax}


def routing_weights_at(router: nn.Module, logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The routing weights ``router`` gives the experts ``index`` (T, k) from its ``logits`` (T, E): what its own
    forward returns when its top-k picks ``index``."""
    fn = _WEIGHTS.get(type(router).__name__)
    if fn is None:
        raise ValueError(f"no routing-weight rule for {type(router).__name__}; known: {', '.join(_WEIGHTS)}")
    return fn(router, logits, index)


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[dict[int, dict]]:
    """Within the block, each MoE layer's first routing of a forward: ``{layer: {"index": (T, k), "logits": (T, E)}}``
    -- the experts each token was sent to, as the experts module received them (after any hook on the router), and
    the router's logits (a checkpointed layer's recompute routes again; the first call is the forward's)."""
    seen: dict[int, dict] = {}

    def on_router(i):
        def fn(module, args, out):
            seen.setdefault(i, {}).setdefault("logits", out[0].detach().reshape(-1, out[0].shape[-1]).clone())
        return fn

    def on_experts(i):
        def fn(module, args, kwargs):
            index = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
            seen.setdefault(i, {}).setdefault("index", index.detach().clone())
        return fn

    handles = [r.register_forward_hook(on_router(i)) for i, r in enumerate(routers(model))]
    handles += [e.register_forward_pre_hook(on_experts(i), with_kwargs=True)
                for i, e in enumerate(experts_modules(model))]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def force_routing(model: nn.Module, index: dict[int, torch.Tensor]) -> Iterator[None]:
    """Within the block, every MoE layer ``i`` of ``index`` routes its tokens to the experts ``index[i]`` (T, k) with
    the weights its router gives them from its own logits (:func:`routing_weights_at`): the same decisions as a
    reference run, the same gradient path through the router."""
    def hook(i):
        def fn(module, args, out):
            logits, _, own = out
            forced = index[i].to(own.device)
            if forced.shape != own.shape:
                raise ValueError(f"layer {i}: forced routing {tuple(forced.shape)} does not fit this batch's "
                                 f"{tuple(own.shape)}")
            return logits, routing_weights_at(module, logits.reshape(-1, logits.shape[-1]), forced), forced
        return fn

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers(model)) if i in index]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def flipped_tokens(a: torch.Tensor, b: torch.Tensor) -> int:
    """Tokens whose set of chosen experts differs between two routings (T, k) (the order of the k slots aside)."""
    return int((a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1).sum())


def _gap_ulps(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Per token, the gap between its k-th and (k+1)-th largest router logit in units of the logits' own rounding
    there (one ulp of the logits' dtype at that magnitude)."""
    top = logits.float().topk(k + 1, dim=-1).values
    ulp = torch.finfo(logits.dtype).eps * top[:, k - 1:k + 1].abs().amax(-1).clamp_min(torch.finfo(torch.float).tiny)
    return (top[:, k - 1] - top[:, k]) / ulp


def _one_step(model: nn.Module, batch, variant: Variant, params: list, extra=contextlib.nullcontext):
    """Loss and gradients of one step of ``variant`` at the current weights (no optimizer step)."""
    variant.enable(model)
    try:
        state = variant.prepare(batch) if variant.prepare else None
        ctx = variant.context(model) if variant.context is not None else contextlib.nullcontext()
        torch.manual_seed(0)
        model.zero_grad(set_to_none=True)
        with ctx, extra():
            loss = _forward_loss(model, variant.inputs(batch, state))
            loss.backward()
        grads = [p.grad.detach().clone() if p.grad is not None else None for p in params]
        model.zero_grad(set_to_none=True)
        return loss.detach().float(), grads
    finally:
        variant.disable(model)


def _rel(a: tuple, b: tuple) -> dict:
    """The harness's ``vs ref`` measure: relative loss difference and the largest per-tensor max|g - g_ref| /
    max|g_ref|; ``rel`` the larger of the two."""
    (loss, grads), (loss0, grads0) = a, b
    grad_rel = 0.0
    for g, g0 in zip(grads, grads0):
        if g is None or g0 is None:
            continue
        scale = g0.float().abs().max().clamp_min(torch.finfo(torch.float32).tiny)
        grad_rel = max(grad_rel, float((g.float() - g0.float()).abs().max() / scale))
    loss_rel = float((loss - loss0).abs() / loss0.abs().clamp_min(1e-30))
    bitwise = torch.equal(loss, loss0) and all(
        (g is None and g0 is None) or (g is not None and g0 is not None and torch.equal(g, g0))
        for g, g0 in zip(grads, grads0))
    return {"bitwise": bitwise, "loss_rel": loss_rel, "grad_rel": grad_rel, "rel": max(loss_rel, grad_rel)}


def routing_agreement(model: nn.Module, batch, reference: Variant, other: Variant) -> dict:
    """One step of ``reference`` and of ``other`` (harness variants, e.g. two steps of the attribution chain) at the
    same weights: per MoE layer, how many tokens ``other`` routes to another set of experts than ``reference`` does
    (``flipped_tokens``), how many of the reference's tokens sit at a near-tie (``near_ties``: k-th and (k+1)-th
    logit within 4 ulps of the logits' dtype) and the widest reference gap among the flipped tokens in those ulps
    (``flip_gap_ulps``, None where none flipped); the loss and gradients of ``other`` against ``reference`` as run
    (``free``) and with the reference's routing forced in every layer (``forced``). Untimed; the model is left as
    it was."""
    params = [p for p in model.parameters() if p.requires_grad]
    with record_routing(model) as ref_routes:
        ref = _one_step(model, batch, reference, params)
    ref_routes = dict(ref_routes)
    with record_routing(model) as routes:
        free = _one_step(model, batch, other, params)
    routes = dict(routes)
    forced_index = {i: r["index"] for i, r in ref_routes.items()}
    forced = _one_step(model, batch, other, params, lambda: force_routing(model, forced_index))
    layers = sorted(ref_routes)
    flips, ties, gaps = [], [], []
    for i in layers:
        a, b = ref_routes[i]["index"], routes[i]["index"]
        k = a.shape[-1]
        flips.append(flipped_tokens(a, b))
        gap = _gap_ulps(ref_routes[i]["logits"], k)
        ties.append(int((gap <= 4).sum()))
        moved = (a.sort(-1).values != b.sort(-1).values).any(-1)
        gaps.append(round(float(gap[moved].max()), 1) if moved.any() else None)
    logits_dtype = ref_routes[layers[0]]["logits"].dtype if layers else None
    return {"reference": reference.name, "other": other.name, "tokens": int(ref_routes[layers[0]]["index"].shape[0])
            if layers else 0, "top_k": int(ref_routes[layers[0]]["index"].shape[1]) if layers else 0,
            "logits_dtype": str(logits_dtype).replace("torch.", ""), "flipped_tokens": flips, "near_ties": ties,
            "flip_gap_ulps": gaps, "free": _rel(free, ref), "forced": _rel(forced, ref)}


def agreement_text(agreement: dict) -> str:
    """:func:`routing_agreement` in three lines: the flips per layer, the difference as run, the difference with the
    reference's routing forced."""
    a = agreement
    flips = a["flipped_tokens"]
    gaps = [g for g in a["flip_gap_ulps"] if g is not None]
    out = [f"{a['other']} against {a['reference']}, one step ({a['tokens']} tokens, top-{a['top_k']}, router logits in "
           f"{a['logits_dtype']}):",
           f"  tokens routed to other experts, per MoE layer: {flips} ({sum(flips)} of {a['tokens'] * len(flips)} "
           f"token-layers)" + (f"; each was a near-tie, its two logits at most {max(gaps):.0f} ulps apart" if gaps
                               else ""),
           f"  loss and gradients as run:                      largest relative difference {a['free']['rel']:.1e}",
           f"  the same with the reference's routing forced:   largest relative difference {a['forced']['rel']:.1e}"
           + (" (bitwise)" if a["forced"]["bitwise"] else "")]
    return "\n".join(out)
