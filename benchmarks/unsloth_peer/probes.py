"""What Unsloth actually did, read off the live model and its modules' globals, or measured: the code paths a
GPT-OSS model runs, the fused LoRA kernels, where LoRA sits, how often each packed-attention entry point ran, the
host syncs CUDA reported, the offloaded checkpointing's state (offload observed, double buffer per step), a GPU
profile, and two probes that measure what the attention keeps apart (``isolation_probe`` for packed GPT-OSS rows,
``padded_probe`` for the padded layout). No claim of the result rests on a reading of Unsloth's source alone
where one of these can check it.

Torch and Unsloth's modules are passed in or looked up in ``sys.modules``: importing this module imports neither.
"""

from __future__ import annotations

import os
import sys

from .layouts import real_segments

PROBE_SAME, PROBE_CHANGED = 1e-3, 1e-2  # relative L2 change: <= SAME is unchanged, > CHANGED is changed
SINK_ENTRY_POINTS = ("flex_attention", "reused_compiled_create_block_mask", "compiled_create_block_mask")
PACKED_ENTRY_POINTS = ("_sdpa_packed_segments", "_torch_varlen_packed", "build_sdpa_packed_attention_mask",
                       "build_xformers_block_causal_mask")  # unsloth.utils.attention_dispatch


# --- the live model ---------------------------------------------------------------------------------------------
def base_model(model):
    """The transformers model under PEFT's wrappers."""
    base = model
    for _ in range(3):
        base = base.get_base_model() if hasattr(base, "get_base_model") else base
    return base


def check_lora_placement(lora_modules, trainable_names, targets, num_layers: int) -> str | None:
    """None if LoRA sits on exactly ``targets`` in every layer and nothing but adapters trains; else why not."""
    off = [n for n in lora_modules if n.rsplit(".", 1)[-1] not in targets]
    want = len(targets) * num_layers
    frozen_touched = [n for n in trainable_names if "lora_" not in n]
    why = []
    if off:
        why.append(f"LoRA on modules outside {list(targets)} (e.g. {off[:2]})")
    if len(lora_modules) - len(off) != want:
        why.append(f"{len(lora_modules) - len(off)} LoRA modules on the targets, want {want} "
                   f"({len(targets)} x {num_layers} layers)")
    if frozen_touched:
        why.append(f"{len(frozen_touched)} non-adapter tensors train (e.g. {frozen_touched[:2]})")
    return "; ".join(why) or None


def fused_lora_layers(layers) -> dict:
    """How many layers run Unsloth's fused LoRA autograd functions for QKV, O and the MLP."""
    return {"qkv": sum(getattr(getattr(l.self_attn, "apply_qkv", None), "__name__", "") == "apply_lora_qkv"
                       for l in layers),
            "o": sum(getattr(getattr(l.self_attn, "apply_o", None), "__name__", "") == "apply_lora_o" for l in layers),
            "mlp": sum("lora_mlp" in getattr(getattr(l.mlp, "forward", None), "__name__", "") for l in layers)}


def gpt_oss_paths(model, layers, torch) -> dict:
    """Which GPT-OSS code the loaded model runs, read off the live objects (no claim from the docstring)."""
    import inspect

    zoo = sys.modules.get("unsloth_zoo.temporary_patches.gpt_oss")
    moe = sys.modules.get("unsloth_zoo.temporary_patches.moe_utils")
    out: dict = {"flex_sink_attention_installed": bool(getattr(zoo, "_GPT_OSS_FLEX_SINK_ATTENTION_INSTALLED", False)),
                 "moe_backend": getattr(moe, "_SELECTED_MOE_BACKEND", None),
                 "unsloth_model_name_env": os.environ.get("UNSLOTH_MODEL_NAME"),
                 "high_precision_layernorm": os.environ.get("UNSLOTH_HIGH_PRECISION_LAYERNORM")}
    if not len(layers):
        return out
    name = lambda f: f"{getattr(f, '__module__', '?')}.{getattr(f, '__qualname__', '?')}"  # noqa: E731
    attn, experts = layers[0].self_attn, layers[0].mlp.experts
    fwd = type(attn).forward
    out.update({
        "attention_class": name(type(attn)), "attention_forward": name(fwd),
        "flex_sink_attention_on_model": bool(zoo is not None and out["flex_sink_attention_installed"]
                                             and getattr(fwd, "__module__", None) == zoo.__name__),
        "sliding_windows": [getattr(layer.self_attn, "sliding_window", None) for layer in layers[:2]],
        "experts_class": name(type(experts)), "experts_forward": name(type(experts).forward),
        "experts_lora_patched": bool(getattr(type(experts), "_unsloth_lora_patched", False)),
        "experts_dtypes": {n: str(p.dtype).replace("torch.", "") for n, p in experts.named_parameters()},
        "experts_trainable": any(p.requires_grad for p in experts.parameters()),
        "router_class": name(type(layers[0].mlp.router))})
    inner = getattr(getattr(model, "base_model", None), "model", model)
    inner = getattr(inner, "model", None)
    if inner is not None:
        out["model_forward"] = name(type(inner).forward)
        out["zoo_model_forward"] = bool(zoo is not None and getattr(type(inner).forward, "__module__", None)
                                        == zoo.__name__)
    try:
        out["fused_ce_in_forward"] = "unsloth_fused_ce_loss" in inspect.getsource(type(base_model(model)).forward)
    except (OSError, TypeError):
        out["fused_ce_in_forward"] = None
    return out


# --- Unsloth's module globals -----------------------------------------------------------------------------------
def packing_flags(adispatch, torch, cuda: bool) -> dict:
    """Which packed-attention backends ``unsloth.utils.attention_dispatch`` found, and torch's SDPA switches."""
    packing = {"torch_varlen_attn": getattr(adispatch, "_TORCH_VARLEN_ATTN", None) is not None,
               "sdpa_packed_segments_enabled": bool(getattr(adispatch, "_SDPA_PACKED_SEGMENTS", False)),
               "has_flash_attention": bool(getattr(adispatch, "HAS_FLASH_ATTENTION", False)),
               "has_xformers": bool(getattr(adispatch, "HAS_XFORMERS", False))}
    if cuda:
        packing.update(sdpa_flash_enabled=torch.backends.cuda.flash_sdp_enabled(),
                       sdpa_cudnn_enabled=torch.backends.cuda.cudnn_sdp_enabled(),
                       sdpa_mem_efficient_enabled=torch.backends.cuda.mem_efficient_sdp_enabled())
    return packing


def offload_state(gcmod, torch, db_measured: list) -> dict:
    """What ``unsloth_zoo.gradient_checkpointing`` did: whether it offloaded (it clears ``USE_UNSLOTH_GC`` once it
    has), the double buffer as read at each measured step, its second buffer, prefetch, the last layer index."""
    return {"checkpoint_function": torch.utils.checkpoint.CheckpointFunction.__name__,
            "offload_observed": getattr(gcmod, "USE_UNSLOTH_GC", True) is False,
            "double_buffer_effective": bool(db_measured) and all(db_measured),
            "double_buffer_per_measured_step": db_measured,
            "buffer_b_allocated": getattr(gcmod, "GPU_BUFFERS_B", None) is not None,
            "gc_prefetch": bool(getattr(gcmod, "GC_PREFETCH", False)),
            "last_gc_index": getattr(gcmod, "LAST_GC_INDEX", None)}


def count_calls(module, names, counts: dict):
    """Wrap ``module``'s functions ``names`` with counters (looked up at call time by their callers); returns undo."""
    saved = {}
    for name in names if module is not None else ():
        fn = getattr(module, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def wrapper(*args, _fn=fn, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _fn(*args, **kwargs)

        setattr(module, name, wrapper)

    def undo():
        for name, fn in saved.items():
            setattr(module, name, fn)

    return undo


def count_attention_calls(adispatch, counts: dict):
    """Wrap Unsloth's packed-attention entry points with counters; returns an undo function."""
    return count_calls(adispatch, PACKED_ENTRY_POINTS, counts)


# --- CUDA's own reports ---------------------------------------------------------------------------------------
def sync_warnings(fn, torch) -> tuple[int, dict]:
    """Run ``fn`` under sync-debug mode "warn": (syncs CUDA reported, {site: count}).

    A sync's warning reads "called a synchronizing CUDA operation"; the one-time notice that the debug
    mode is a prototype (torch/cuda/__init__.py) also says "Synchronization" and is not counted.
    """
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    sites: dict = {}
    n = 0
    for w in caught:
        if "called a synchronizing CUDA operation" in str(w.message):
            n += 1
            key = f"{os.path.basename(str(w.filename))}:{w.lineno}"
            sites[key] = sites.get(key, 0) + 1
    return n, dict(sorted(sites.items(), key=lambda kv: -kv[1])[:12])


def profile_gpu(fn, top: int = 40) -> dict:
    """GPU time of one call of ``fn`` (``fastsft_lab.profiling.profile``): the busy total, and the top aten ops (their
    own device time) and kernels, in ms. What each side's step is made of, by name."""
    from fastsft_lab.profiling import profile  # after unsloth's import: it imports transformers

    r = profile(fn, steps=1, top=top)
    return {"what": "one untimed forward+backward of batch 0 under torch.profiler", "gpu_busy_ms": r.device_busy_ms,
            "ops": r.ops_per_step, "kernels": r.kernels_per_step}


# --- measured: what the attention keeps apart ---------------------------------------------------------------------
def _combine(verdicts) -> bool | None:
    verdicts = list(verdicts)
    if any(v is False for v in verdicts):
        return False
    return True if verdicts and all(v is True for v in verdicts) else None


def _verdict(changed: float | None, same_ok: bool = True) -> bool | None:
    if changed is None or not same_ok:
        return None
    return True if changed <= PROBE_SAME else False if changed > PROBE_CHANGED else None


def padded_probe(forward, feed: dict, lengths, modules: dict, vocab_size: int, torch) -> dict:
    """For the padded layout (one sequence per row, right padding), measured on the outputs of ``modules`` (e.g.
    layer 0's attention and the final norm): a row's real positions must not move when another row's tokens change
    (rows are independent; control: the changed row moves) nor when its own pads after them change (right padding
    with a causal mask is exact; control: the pad positions move)."""
    width = feed["input_ids"].shape[1]
    rows = len(lengths)
    padded_rows = [i for i, n in enumerate(lengths) if n < width]
    r = min(padded_rows, key=lambda i: lengths[i]) if padded_rows else 0
    o = max((i for i in range(rows) if i != r), key=lambda i: lengths[i], default=None)
    pick = [r] if o is None else [r, o]
    captured: dict = {}

    def hook_for(name):
        def hook(module, args, output):
            t = output[0] if isinstance(output, tuple) else output
            captured.setdefault(name, t[pick].detach().float().cpu())
        return hook

    def outputs(ids):
        captured.clear()
        with torch.no_grad():
            forward({**feed, "input_ids": ids})
        missing = [n for n in modules if n not in captured]
        if missing:
            raise RuntimeError(f"{missing} never ran under the probe's hooks")
        return dict(captured)

    def rel(a, b, row, lo, hi):
        d, ref = a[row, lo:hi] - b[row, lo:hi], b[row, lo:hi]
        return round(float(d.norm() / ref.norm().clamp_min(1e-30)), 6)

    ids = feed["input_ids"]
    other, pads = ids.clone(), ids.clone()
    if o is not None:
        other[o, :lengths[o]] = (other[o, :lengths[o]] + 1) % vocab_size
    pads[r, lengths[r]:] = (pads[r, lengths[r]:] + 1) % vocab_size
    handles = [m.register_forward_hook(hook_for(n)) for n, m in modules.items()]
    try:
        base, again = outputs(ids), outputs(ids)
        changed_other = outputs(other) if o is not None else None
        changed_pads = outputs(pads) if lengths[r] < width else None
    finally:
        for h in handles:
            h.remove()
    out = {"row": r, "row_length": lengths[r], "other_row": o, "other_length": lengths[o] if o is not None else None,
           "width": width, "thresholds": {"unchanged_at_most": PROBE_SAME, "changed_above": PROBE_CHANGED},
           "what": "relative L2 change of the modules' outputs (batch 0) on a row's real positions when another "
                   "row's tokens change, and when its own pad tokens change", "modules": {}}
    rows_v, pads_v = [], []
    for name in modules:
        m = {"rerun_noise": rel(again[name], base[name], 0, 0, lengths[r])}
        quiet = m["rerun_noise"] <= PROBE_SAME
        if changed_other is not None:
            m["row_change_other_row"] = rel(changed_other[name], base[name], 0, 0, lengths[r])
            m["row_change_control"] = rel(changed_other[name], base[name], 1, 0, lengths[o])
            rows_v.append(_verdict(m["row_change_other_row"], quiet and m["row_change_control"] > PROBE_CHANGED))
        if changed_pads is not None:
            m["pad_change_real_positions"] = rel(changed_pads[name], base[name], 0, 0, lengths[r])
            m["pad_change_control"] = rel(changed_pads[name], base[name], 0, lengths[r], width)
            pads_v.append(_verdict(m["pad_change_real_positions"], quiet and m["pad_change_control"] > PROBE_CHANGED))
        out["modules"][name] = m
    out["rows_independent"] = _combine(rows_v)
    out["right_padding_exact"] = _combine(pads_v)
    if o is None:
        out["rows_independent_note"] = "one row only: nothing to compare"
    if changed_pads is None:
        out["right_padding_note"] = "no row of batch 0 is padded"
    return out


def isolation_probe(forward, feed: dict, seq_lengths, pad_lengths, layers, layer_types, sliding_window,
                    vocab_size: int, torch) -> dict:
    """Whether packed segments of one row are kept apart, measured: the first layer's attention output (its input
    is the embedding, so nothing but attention mixes positions) with the first segment's tokens changed must stay
    unchanged where a later segment could see it (its window after the segment), and change on the segment itself
    (the control); with the last segment changed, every earlier position must stay unchanged (causality)."""
    row = next((r for r, (lens, pad) in enumerate(zip(seq_lengths, pad_lengths))
                if len(real_segments(lens, pad)) >= 2), None)
    if row is None:
        return {"segments_isolated": None, "causal": None, "error": "no row of batch 0 holds two segments"}
    spans = real_segments(seq_lengths[row], pad_lengths[row])
    (s0, e0), (sl, el) = spans[0], spans[-1]
    window = sliding_window if layer_types and layer_types[0] == "sliding_attention" else None
    later = (e0, el if window is None else min(el, e0 + window))
    captured = []

    def hook(module, args, output):
        captured.append((output[0] if isinstance(output, tuple) else output)[row].detach().float().cpu())

    def attention_output(ids):
        captured.clear()
        with torch.no_grad():
            forward({**feed, "input_ids": ids})
        if not captured:
            raise RuntimeError("the first layer's attention never ran under the probe's hook")
        return captured[0]

    def rel(a, b, lo, hi):
        d, ref = a[lo:hi] - b[lo:hi], b[lo:hi]
        return round(float(d.norm() / ref.norm().clamp_min(1e-30)), 6)

    ids = feed["input_ids"]
    first, last = ids.clone(), ids.clone()
    first[row, s0:e0] = (first[row, s0:e0] + 1) % vocab_size
    last[row, sl:el] = (last[row, sl:el] + 1) % vocab_size
    handle = layers[0].self_attn.register_forward_hook(hook)
    try:
        base, again = attention_output(ids), attention_output(ids)
        changed_first, changed_last = attention_output(first), attention_output(last)
    finally:
        handle.remove()
    noise = rel(again, base, 0, el)
    out = {"row": row, "segments": len(spans), "first_segment": [s0, e0], "last_segment": [sl, el],
           "window_layer0": window, "compared_after_first": list(later), "rerun_noise": noise,
           "first_segment_own_change": rel(changed_first, base, s0, e0),
           "after_first_segment_change": rel(changed_first, base, *later),
           "before_last_segment_change": rel(changed_last, base, 0, sl),
           "thresholds": {"unchanged_at_most": PROBE_SAME, "changed_above": PROBE_CHANGED},
           "what": "relative L2 change of layer 0's attention output (batch 0) when one segment's token ids change"}
    quiet = noise <= PROBE_SAME
    out["segments_isolated"] = _verdict(out["after_first_segment_change"],
                                        quiet and out["first_segment_own_change"] > PROBE_CHANGED)
    out["causal"] = _verdict(out["before_last_segment_change"], quiet)
    return out
