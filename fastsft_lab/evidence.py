"""Evidence: checks that an optimization changes no numbers, for tests, notebooks and users' own models.

* packed attention: :func:`packed_vs_alone` (packed rows == each sequence run alone), its mixture-of-experts form
  :func:`packed_vs_alone_moe` (top-k routing near-ties counted, not hidden), :func:`cross_contamination` (stock
  transformers given packed rows without a mask);
* offloaded checkpointing: :func:`check_equivalence` (every mode against standard checkpointing and against no
  checkpointing, per tensor), :func:`check_transport` (the forward and the copies checked bitwise, apart),
  :func:`check_no_leak` (pool, staging and registry flat over steps);
* :func:`compare_grads`, the per-tensor comparison behind them, naming the worst tensor.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from .data import PackedBatch, unpack
from .structure import decoder_layers, model_device
from .moe.modules import experts_modules
from .offload import (CheckpointingSwitch, StreamOps, disable_offloaded_checkpointing, enable_offloaded_checkpointing,
                      is_offloaded, offload_manager)
from .packing.collator import packed_inputs


# --- packed attention ---------------------------------------------------------------------------------------------
def packed_vs_alone(model: nn.Module, batch: PackedBatch, inputs: dict | None = None) -> float:
    """Largest |logit difference| between the packed forward and each sequence run alone (no grad)."""
    inputs = inputs if inputs is not None else packed_inputs(batch)
    with torch.no_grad():
        packed = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        worst = 0.0
        for s in unpack(batch):
            alone = model(input_ids=s.input_ids).logits
            diff = (packed[s.row, s.start:s.start + s.length].float() - alone[0].float()).abs().max().item()
            worst = max(worst, diff)
    return worst


def _expert_choices(model: nn.Module, call: Callable[[], Any]) -> list[torch.Tensor]:
    """Per MoE layer, the experts each token was routed to (sorted, one row per token) during ``call()``."""
    got: list[torch.Tensor] = []

    def hook(module, args, kwargs):
        idx = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and not a.is_floating_point()]
        if idx:
            got.append(idx[0].reshape(-1, idx[0].shape[-1]).sort(-1).values)

    hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in experts_modules(model)]
    try:
        with torch.no_grad():
            call()
    finally:
        for h in hooks:
            h.remove()
    return got


def packed_vs_alone_moe(model: nn.Module, batch: PackedBatch) -> tuple[float, int, int]:
    """``packed_vs_alone`` for a mixture-of-experts model: ``(max |logit diff|, rerouted tokens, tokens)``.

    Top-k routing is discontinuous: when two experts' router scores nearly tie, the rounding difference between a
    packed and an unpacked bf16 run (another kernel, another summation order) can send a token to another expert,
    and its logits then differ by far more than rounding. Measured on the H200: tiny GPT-OSS, bf16, flex attention,
    1 of 216 tokens rerouted, its logits 0.071 apart while every attention layer's output stayed within 0.002 of a
    float32 reference (``benchmarks/flex_diag.py``). So the difference is taken over the tokens routed to the same
    experts in every layer of both runs, and the rerouted ones are counted for the caller to bound.
    """
    inputs = {k: v for k, v in packed_inputs(batch).items() if k != "labels"}
    out: dict[str, torch.Tensor] = {}
    packed_routes = _expert_choices(model, lambda: out.setdefault("packed", model(**inputs).logits))
    rows = batch.input_ids.shape[0]
    worst, rerouted, total = 0.0, 0, 0
    for s in unpack(batch):
        alone_routes = _expert_choices(model, lambda: out.__setitem__("alone", model(input_ids=s.input_ids).logits))
        same = torch.ones(s.length, dtype=torch.bool, device=batch.input_ids.device)
        for p, a in zip(packed_routes, alone_routes, strict=True):
            p = p.view(rows, -1, p.shape[-1])[s.row, s.start:s.start + s.length]
            same &= (p == a.view(-1, a.shape[-1])).all(-1)
        diff = (out["packed"][s.row, s.start:s.start + s.length].float() - out["alone"][0].float()).abs().amax(-1)
        kept = diff[same]
        worst = max(worst, kept.max().item() if kept.numel() else 0.0)
        rerouted += int((~same).sum())
        total += s.length
    return worst, rerouted, total


def cross_contamination(model: nn.Module, batch: PackedBatch, *, attention_mask_ones: bool = False) -> float:
    """The stock-transformers pitfall: feed packed ``position_ids`` and no mask (or an all-ones 2-D mask, as a
    padding collator gives) to the model as it is, and return max |packed - alone| logits. Zero: no leak."""
    inputs = batch.model_inputs()
    if attention_mask_ones:
        inputs["attention_mask"] = torch.ones_like(batch.input_ids)
    return packed_vs_alone(model, batch, inputs)


# --- offloaded checkpointing -------------------------------------------------------------------------------------
def _grads_of_step(model: nn.Module, inputs: dict, seed: int) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    # use_cache=False as in training (build_model sets it): a KV cache built in the reference forward, and not under
    # checkpointing (transformers turns it off there), would make the two runs compute different things
    loss = model(**{**inputs, "use_cache": False}).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def compare_grads(ref: tuple[torch.Tensor, dict], got: tuple[torch.Tensor, dict], *, rtol: float,
                  atol: float) -> dict:
    """Per-tensor comparison of two ``(loss, {name: grad})`` results: ``|a - b| <= atol + rtol * max|a|``.

    Returns ``{"ok", "bitwise_equal", "max_abs_diff", "n_tensors", "n_failing", "failing" (up to 8 names, worst
    first), "missing" (names with a gradient on one side only), "worst": {"name", "max_abs_diff", "scale",
    "allowed"}}``. ``worst`` is the tensor with the largest diff relative to what it is allowed, so a failure
    report names the tensor, its max |diff| and its scale (a near-zero tensor shows as scale ~0).
    """
    (la, ga), (lb, gb) = ref, got
    missing = sorted(set(ga) ^ set(gb))
    rows = []
    for name, a, b in [("loss", la, lb)] + [(n, ga[n], gb[n]) for n in ga if n in gb]:
        a, b = a.detach().float(), b.detach().float()
        diff = float((a - b).abs().max()) if a.numel() else 0.0
        scale = float(a.abs().max()) if a.numel() else 0.0
        rows.append((name, diff, scale, atol + rtol * scale))

    def severity(r) -> float:
        _, diff, _, allowed = r
        if diff != diff:        # NaN
            return float("inf")
        if diff == 0:
            return 0.0
        return diff / allowed if allowed > 0 else float("inf")

    failing = sorted((r for r in rows if not r[1] <= r[3]), key=severity, reverse=True)
    worst = max(rows, key=severity)
    return {"ok": not failing and not missing,
            "bitwise_equal": not missing and all(r[1] == 0 for r in rows),
            "max_abs_diff": max(r[1] for r in rows), "n_tensors": len(rows), "n_failing": len(failing),
            "failing": [r[0] for r in failing[:8]], "missing": missing[:8],
            "worst": {"name": worst[0], "max_abs_diff": worst[1], "scale": worst[2], "allowed": worst[3]}}


def _mode_name(buffers: int, prefetch: bool) -> str:
    return f"offload x{buffers}{' + prefetch' if prefetch else ''}"


def check_equivalence(model: nn.Module, inputs: dict, *, modes: Sequence[tuple[int, bool]] = ((1, False), (2, False),
                      (2, True)), rtol: float | None = None, atol: float | None = None, seed: int = 0,
                      forward_grad: bool = True) -> dict:
    """Loss and gradients of every offload mode against standard checkpointing and against no checkpointing.

    Tolerances default to exact in float32 on a CPU, and otherwise to bf16 noise on the scale of each tensor
    (``|a - b| <= atol + rtol * max|a|``; GPU attention backward kernels may accumulate in a different order from
    run to run).

    Returns:
        ``{"standard_vs_no_checkpointing": bool, "tolerance": {...}, "reports": {"standard_vs_no_checkpointing":
        report}, "offload x1": {"vs_standard": bool, "vs_no_checkpointing": bool, "max_abs_diff": float,
        "report": {"vs_standard": report, "vs_no_checkpointing": report}}, ...}`` with one entry per mode; each
        ``report`` is :func:`compare_grads`'s (worst tensor, its max |diff| and scale). :func:`format_equivalence`
        prints it.
    """
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    exact = dtype == torch.float32 and model_device(model).type == "cpu"
    rtol = rtol if rtol is not None else (0.0 if exact else 2e-2)
    atol = atol if atol is not None else (0.0 if exact else 1e-6)
    if is_offloaded(model):
        raise RuntimeError("turn offloaded checkpointing off before check_equivalence (it toggles it itself)")
    model.train()

    reference = _grads_of_step(model, inputs, seed)
    switch = CheckpointingSwitch(model)
    switch.enable()
    try:
        standard = _grads_of_step(model, inputs, seed)
    finally:
        switch.disable()
    std_rep = compare_grads(reference, standard, rtol=rtol, atol=atol)
    out: dict[str, Any] = {"standard_vs_no_checkpointing": std_rep["ok"],
                           "tolerance": {"rtol": rtol, "atol": atol, "exact": exact},
                           "reports": {"standard_vs_no_checkpointing": std_rep}}
    for buffers, prefetch in modes:
        enable_offloaded_checkpointing(model, buffers, prefetch, forward_grad=forward_grad)
        try:
            got = _grads_of_step(model, inputs, seed)
        finally:
            disable_offloaded_checkpointing(model)
        vs_std = compare_grads(standard, got, rtol=rtol, atol=atol)
        vs_ref = compare_grads(reference, got, rtol=rtol, atol=atol)
        out[_mode_name(buffers, prefetch)] = {
            "vs_standard": vs_std["ok"], "vs_no_checkpointing": vs_ref["ok"], "max_abs_diff": vs_std["max_abs_diff"],
            "report": {"vs_standard": vs_std, "vs_no_checkpointing": vs_ref}}
    return out


def _format_report(rep: dict) -> str:
    if rep["bitwise_equal"]:
        return f"bitwise equal ({rep['n_tensors']} tensors incl. the loss)"
    w = rep["worst"]
    text = (f"{'bitwise equal' if rep['bitwise_equal'] else 'max |diff| ' + format(rep['max_abs_diff'], '.3g')}; "
            f"worst {w['name']}: |diff| {w['max_abs_diff']:.3g}, scale {w['scale']:.3g}, allowed {w['allowed']:.3g}")
    if rep["n_failing"]:
        text += f"; {rep['n_failing']}/{rep['n_tensors']} tensors outside tolerance"
    if rep["missing"]:
        text += f"; gradient on one side only: {', '.join(rep['missing'])}"
    return text


def format_equivalence(eq: dict) -> str:
    """:func:`check_equivalence`'s result as text: verdicts, then the worst tensor of every comparison."""
    lines = [f"standard checkpointing == no checkpointing: {eq['standard_vs_no_checkpointing']}"]
    modes = [k for k in eq if k.startswith("offload")]
    for k in modes:
        lines.append(f"{k:22s} == standard: {eq[k]['vs_standard']}   == no checkpointing: "
                     f"{eq[k]['vs_no_checkpointing']}")
    tol = eq.get("tolerance", {})
    lines.append(f"per tensor |a - b| <= {tol.get('atol')} + {tol.get('rtol')} * max|a|"
                 + (" (exact)" if tol.get("exact") else ""))
    lines.append(f"  standard vs none: {_format_report(eq['reports']['standard_vs_no_checkpointing'])}")
    for k in modes:
        for against in ("vs_standard", "vs_no_checkpointing"):
            lines.append(f"  {k} {against.replace('_', ' ')}: {_format_report(eq[k]['report'][against])}")
    return "\n".join(lines)


class VerifyingStreams(StreamOps):
    """Stream operations that keep a device copy of every offloaded input and compare it, bitwise, with the staged
    input when the recompute reads it and again after the layer's backward (no host sync until :meth:`report`).
    Costs the GPU memory the offload saves: for checks, not for training."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self.references: dict[int, torch.Tensor] = {}   # seq -> device copy taken in forward
        self._log_rows: list = []

    def saved(self, entry, src: torch.Tensor) -> None:
        self.references[entry.seq] = src.clone()       # on the compute stream, after the producer

    def staged(self, entry, x: torch.Tensor, phase: str) -> None:
        ref = self.references.get(entry.seq)
        if ref is None:
            return
        a, b = x.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)
        self._log_rows.append((entry.layer, entry.seq, phase, (a != b).sum()))   # stays on the device
        if phase == "after_backward":
            del self.references[entry.seq]

    def report(self) -> dict:
        """``{"checked": n, "ok": bool, "mismatched": [{"layer", "seq", "phase", "mismatched_bytes"}]}`` (syncs)."""
        rows = [{"layer": layer, "seq": seq, "phase": phase, "mismatched_bytes": int(n)}
                for layer, seq, phase, n in self._log_rows]
        self._log_rows = []
        bad = [r for r in rows if r["mismatched_bytes"]]
        return {"checked": len(rows), "ok": not bad, "mismatched": bad}


def check_transport(model: nn.Module, inputs: dict, *, modes: Sequence[tuple[int, bool]] = ((1, False), (2, False),
                    (2, True)), seed: int = 0, forward_grad: bool = True) -> dict:
    """Where would a difference come from? Checks the offload's two halves separately, bitwise (debug; syncs).

    * forward: the layer inputs the offloaded forward produces (and copies to the host) against the layer inputs
      of a plain forward (no checkpointing, grad on): equal bits mean the offloaded forward runs the same kernels.
    * transport: with :class:`VerifyingStreams`, every staged input is compared with a device copy taken in
      forward, when the recompute reads it and again after the layer's backward (a stream-ordering or
      memory-lifetime race shows up here).

    Returns ``{mode: {"forward_inputs_bitwise_equal", "forward_inputs_max_abs_diff", "first_differing_layer",
    "loss_abs_diff", "transport_ok", "checked", "mismatched"}}``.
    """
    if is_offloaded(model):
        raise RuntimeError("turn offloaded checkpointing off before check_transport (it toggles it itself)")
    model.train()
    layers = decoder_layers(model)
    captured: dict[int, torch.Tensor] = {}

    def capture(i):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("hidden_states")
            if i not in captured and isinstance(x, torch.Tensor):
                captured[i] = x.detach().clone()
        return hook

    handles = [layer.register_forward_pre_hook(capture(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        model.zero_grad(set_to_none=True)
        torch.manual_seed(seed)
        ref_loss = model(**inputs).loss.detach()
    finally:
        for h in handles:
            h.remove()
    out: dict[str, Any] = {}
    for buffers, prefetch in modes:
        streams = VerifyingStreams(model_device(model))
        enable_offloaded_checkpointing(model, buffers, prefetch, forward_grad=forward_grad, streams=streams)
        manager = offload_manager(model)
        try:
            model.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            loss = model(**inputs).loss
            diffs = []
            for e in manager.pending_entries():
                ref, saved = captured.get(e.layer), streams.references.get(e.seq)
                if ref is None or saved is None or ref.shape != saved.shape:
                    continue
                diffs.append((e.layer, float((saved.float() - ref.float()).abs().max()), torch.equal(saved, ref)))
            loss.backward()
            rep = streams.report()
            model.zero_grad(set_to_none=True)
        finally:
            disable_offloaded_checkpointing(model, release_pool=True)
        differing = [layer for layer, _, same in diffs if not same]
        out[_mode_name(buffers, prefetch)] = {
            "forward_inputs_bitwise_equal": bool(diffs) and not differing,
            "forward_inputs_max_abs_diff": max((d for _, d, _ in diffs), default=0.0),
            "first_differing_layer": min(differing) if differing else None,
            "loss_abs_diff": float((loss.detach().float() - ref_loss.float()).abs()),
            "transport_ok": rep["ok"], "checked": rep["checked"], "mismatched": rep["mismatched"][:8]}
    return out


def check_no_leak(model: nn.Module, inputs: dict, *, steps: int = 10, buffers: int = 2,
                  prefetch: bool | None = None) -> dict:
    """Run ``steps`` training steps with offload on; report whether pool, staging and registry stay flat."""
    disable_offloaded_checkpointing(model, release_pool=True)
    enable_offloaded_checkpointing(model, buffers, prefetch)
    manager = offload_manager(model)
    cuda = manager.cuda
    seen, alloc, registry_empty = [], [], True
    try:
        for _ in range(steps):
            model(**inputs).loss.backward()
            model.zero_grad(set_to_none=True)
            registry_empty &= manager.pending == 0 and manager.pool.in_use == 0
            seen.append((manager.pool.allocations, manager.pool.nbytes, tuple(manager.staging_bytes)))
            if cuda:
                torch.cuda.synchronize(manager.device)
                alloc.append(torch.cuda.memory_allocated(manager.device))
    finally:
        disable_offloaded_checkpointing(model, release_pool=True)
    return {"pool_flat_after_step_1": len(set(seen[1:])) <= 1, "registry_empty_after_each_backward": registry_empty,
            "gpu_allocated_flat": (len(set(alloc[1:])) <= 1) if cuda else None,
            "pool_bytes": seen[-1][1], "pool_allocations": seen[-1][0], "staging_bytes": list(seen[-1][2])}


__all__ = ["packed_vs_alone", "packed_vs_alone_moe", "cross_contamination", "compare_grads", "check_equivalence",
           "format_equivalence", "check_transport", "VerifyingStreams", "check_no_leak"]
