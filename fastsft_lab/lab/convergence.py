"""Does the fast path still train the same model? Two checks that hold on any machine, and the curves to look at.

A loss curve of all fast drawn over all naive looks convincing, but the gap between two float32 training runs is
chaotic: one different rounding in step 3 grows with every step, by an amount that depends on the CPU's kernels
(AVX-512 or not), the thread count and the GPU. No tolerance can be derived for it, and a "noise floor" taken from one
perturbed run moves with the machine. So the switches are split by what they do to the arithmetic:

* **exact switches** (the packed-metadata cache, the offload buffers) move no floating-point operation: the same
  kernels see the same inputs in the same order. Their curve equals the naive curve *bitwise*, every step
  (:func:`exact_curves`).
* **reordering switches** (the fused loss, ``sync_free`` expert routing) compute the same sums in another order or
  blocking. At the same weights, their loss and every gradient equal the naive ones within float32 rounding of the
  longest reduction, and that is checked at points all along the naive run's curve (:func:`along_the_curve`): a
  check per step, not a bound on chaos.

The tolerance (:func:`rounding_tolerance`) is the classic first-order bound on a sum of ``n`` terms, ``n * u`` times
the size of the terms (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 3.1), doubled
because both sides round. The size of the terms is taken at the first step, where the softmax is spread and no
gradient is a small difference of large numbers; later in training the gradients shrink while their rounding does
not, so a bound relative to the current gradient would be wrong, not strict.
"""

from __future__ import annotations

import random
from typing import Any, Callable

import torch
from torch import nn

import fastsft_lab
from fastsft_lab.data import Example, PackedBatch, pack_examples
from fastsft_lab.packing import packed_inputs

# The naive path of each family, and the two kinds of switch on top of it (fastsft_lab.apply's arguments).
NAIVE: dict[str, dict[str, Any]] = {"qwen3": dict(packed_attention="sdpa", packed_metadata_cache=False, offload_buffers=1),
         "gpt_oss": dict(packed_attention="sdpa", packed_metadata_cache=False, offload_buffers=1,
                         moe_routing="naive")}
EXACT: dict[str, Any] = dict(packed_metadata_cache=True, offload_buffers=2)        # no floating-point operation moves
REORDERING: dict[str, dict[str, Any]] = {"qwen3": dict(fused_loss=True),                       # the same sums in another order
              "gpt_oss": dict(fused_loss=True, moe_routing="sync_free")}


def switches(family: str, *kinds: str) -> dict:
    """The naive switches of ``family`` with ``"exact"`` and/or ``"reordering"`` switches on top."""
    if family not in NAIVE:
        raise ValueError(f"no training check for family {family!r}; valid: {', '.join(NAIVE)}")
    out = dict(NAIVE[family])
    for kind in kinds:
        if kind not in ("exact", "reordering"):
            raise ValueError(f"unknown kind of switch {kind!r}; valid: exact, reordering")
        out.update(EXACT if kind == "exact" else REORDERING[family])
    return out


def rounding_tolerance(dtype: torch.dtype, reduction_length: int) -> float:
    """Relative bound ``2 * n * u`` on the difference of two orders of a sum of ``n`` terms in ``dtype``, with
    ``u`` the unit roundoff (half the machine epsilon); relative to the size of the terms."""
    if not dtype.is_floating_point:
        raise ValueError(f"rounding_tolerance needs a floating-point dtype, got {dtype}")
    if reduction_length < 1:
        raise ValueError(f"reduction_length must be >= 1, got {reduction_length}")
    return 2 * reduction_length * torch.finfo(dtype).eps / 2


def longest_reduction(model: nn.Module, batch: PackedBatch) -> int:
    """The longest sum in one step of ``model``: a matmul over the hidden or intermediate size, the softmax over the
    vocabulary, attention over a row, or the loss over the batch's tokens."""
    c: Any = model.config
    sizes = [c.hidden_size, c.vocab_size, int(batch.input_ids.numel()), int(batch.input_ids.shape[-1])]
    sizes += [getattr(c, k) for k in ("intermediate_size", "moe_intermediate_size") if getattr(c, k, None)]
    return max(sizes)


def learnable_batches(*, rows: int = 2, row_tokens: int = 128, seed: int = 5) -> list[PackedBatch]:
    """Packed rows of counting sequences (each token the previous plus one): a tiny model learns them in a few
    hundred steps, so a falling curve means something."""
    rng = random.Random(seed)
    examples = []
    for _ in range(64):
        n, start = rng.randint(6, 40), rng.randrange(4, 256)
        ids = tuple(4 + (start - 4 + i) % 252 for i in range(n))
        examples.append(Example(ids, ids))
    return pack_examples(examples, row_tokens, rows_per_batch=rows)


def _loss_and_grads(model: nn.Module, batch: PackedBatch, sw: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    fastsft_lab.revert(model)
    fastsft_lab.apply(model, **sw)
    try:
        loss = model(**packed_inputs(batch)).loss
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
    finally:
        fastsft_lab.revert(model)
    return loss.detach(), grads


def train(model: nn.Module, batches: list[PackedBatch], sw: dict, steps: int, *, lr: float = 3e-3,
          every: int = 0, other: dict | None = None) -> dict:
    """``steps`` AdamW steps of ``model`` with switches ``sw``; with ``every`` and ``other``, before every
    ``every``-th step also the loss and gradients of switches ``other`` at the same weights.

    Returns ``{"losses": [...], "checks": [{"step", "loss", "other_loss", "grads", "other_grads"}, ...]}``.
    """
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    losses, checks = [], []
    for s in range(steps):
        b = batches[s % len(batches)]
        if every and other is not None and (s % every == 0 or s == steps - 1):
            l0, g0 = _loss_and_grads(model, b, sw)
            l1, g1 = _loss_and_grads(model, b, other)
            checks.append({"step": s, "loss": l0, "other_loss": l1, "grads": g0, "other_grads": g1})
        fastsft_lab.apply(model, **sw)
        loss = model(**packed_inputs(b)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        fastsft_lab.revert(model)
        losses.append(float(loss.detach()))
    return {"losses": losses, "checks": checks}


def exact_curves(make_model: Callable[[], nn.Module], family: str, steps: int,
                 batches: list[PackedBatch] | None = None) -> dict:
    """The naive curve and the curve with the exact switches on, from the same weights and batches.

    Returns ``{"naive": [...], "exact": [...], "bitwise_equal": bool, "params_bitwise_equal": bool}``.
    """
    batches = batches or learnable_batches()
    a, b = make_model(), make_model()
    naive = train(a, batches, switches(family), steps)["losses"]
    exact = train(b, batches, switches(family, "exact"), steps)["losses"]
    same_params = all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    return {"naive": naive, "exact": exact, "bitwise_equal": naive == exact, "params_bitwise_equal": same_params}


def along_the_curve(make_model: Callable[[], nn.Module], family: str, steps: int, *, every: int = 40,
                    batches: list[PackedBatch] | None = None) -> dict:
    """Train the naive path for ``steps``; every ``every`` steps, the loss and every gradient with all switches on
    (exact and reordering) at the same weights, against the naive ones.

    Each difference is measured relative to the size of that quantity at the first step (see the module docstring)
    and held against :func:`rounding_tolerance` of the step's longest reduction.

    Returns ``{"naive": [...], "tolerance": float, "n": int, "points": [{"step", "loss_diff", "grad_diff",
    "worst"}], "within": bool, "worst_ratio": float}`` (``*_diff`` relative; ``worst_ratio`` the largest difference
    over the tolerance).
    """
    batches = batches or learnable_batches()
    model = make_model()
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    n = longest_reduction(model, batches[0])
    tol = rounding_tolerance(dtype, n)
    run = train(model, batches, switches(family), steps, every=every,
                other=switches(family, "exact", "reordering"))
    first = run["checks"][0]
    loss_scale = float(first["loss"].abs())
    grad_scale = {k: float(g.abs().max()) for k, g in first["grads"].items()}
    points = []
    for c in run["checks"]:
        if set(c["grads"]) != set(c["other_grads"]):
            raise AssertionError(f"step {c['step']}: gradients on one side only: "
                                 f"{sorted(set(c['grads']) ^ set(c['other_grads']))}")
        loss_diff = float((c["other_loss"] - c["loss"]).abs()) / loss_scale
        diffs = {k: float((c["other_grads"][k] - g).abs().max()) / (grad_scale[k] or 1.0) for k, g in c["grads"].items()}
        worst = max(diffs, key=diffs.__getitem__)
        points.append({"step": c["step"], "loss": float(c["loss"]), "loss_diff": loss_diff,
                       "grad_diff": diffs[worst], "worst": worst})
    worst_ratio = max(max(p["loss_diff"], p["grad_diff"]) for p in points) / tol
    return {"naive": run["losses"], "tolerance": tol, "n": n, "points": points, "within": worst_ratio <= 1.0,
            "worst_ratio": worst_ratio}


__all__ = ["NAIVE", "EXACT", "REORDERING", "switches", "rounding_tolerance", "longest_reduction", "learnable_batches",
           "train", "exact_curves", "along_the_curve"]
