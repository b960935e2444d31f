"""Optimization 1: packed-sequence attention metadata built once per batch, zero host syncs inside the layers.

In packed SFT every attention layer needs the same metadata (segment starts ``cu_seqlens``, ``max_seqlen``, a
block-diagonal mask or a flex ``BlockMask``...). Common code rebuilds it in every layer from ``position_ids``,
paying device->host syncs each time (a ``nonzero``, a ``.max().item()``, a ``.tolist()``, a Python loop that
assembles a T x T mask). This module builds it once per batch on the host (:class:`PackedMetadata`) and hands it
to the layers as a keyword argument of the model call, the way transformers passes attention kwargs -- so it
survives PEFT wrappers, and gradient-checkpoint recompute reuses the same object instead of rebuilding it.

Usage::

    from fastsft_lab.packed import PackedCollator, enable_packed_attention

    enable_packed_attention(model, backend="sdpa")          # or "varlen", "flex", "xformers", "flash", "eager"
    batch = PackedCollator(max_tokens=4096, pad_token_id=0)(examples)
    loss = model(**batch).loss                               # batch holds packed_metadata=PackedMetadata(...)

The switch, on a live model (the naive and the cached path run the same backend kernels):

* ``set_packed_metadata_cache(model, True)``  -- cached (default): 0 syncs inside the layers, at most 1 per
  step (0 when the batch carries ``packed_metadata``; 1 when it must be recovered from ``position_ids``).
* ``set_packed_metadata_cache(model, False)`` -- naive: every layer rebuilds its metadata from ``position_ids``
  (faithful to transformers' flash-attention packed path and to Unsloth's pre-cache builders; see
  ``fastsft_lab.attention.metadata``), 1-4 syncs per layer depending on the backend.
* ``disable_packed_attention(model)`` -- back to the exact original ``config._attn_implementation``.

The backends are registered in transformers' ``AttentionInterface`` (``ATTN_NAMES``: sdpa is ``fastsft_dense``,
varlen ``fastsft_varlen``, flex ``fastsft_flex``...). Those names are not in ``ALL_MASK_ATTENTION_FUNCTIONS``, so transformers builds no mask of its own for them. Each handles GQA,
causal attention within each segment, per-layer sliding windows (transformers' semantics: key kept iff
q - W < k <= q) and GPT-OSS attention sinks -- which makes packed GPT-OSS training correct, where stock
transformers lets packed sequences attend to each other (see ``cross_contamination``).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .attention.kernels import (
    BACKENDS,
    BackendStatus,
    available_backends,
    eager_attention,
    flash_attn_attention,
    flex_attention_packed,
    sdpa_attention,
    varlen_attention,
    xformers_attention,
)
from .attention.metadata import (
    NAIVE_BUILDS,
    PackedMetadata,
    _norm_window,
    naive_block_mask,
    naive_dense_mask,
    naive_varlen_args,
    naive_xformers_bias,
)
from .data import IGNORE_INDEX, Example, PackedBatch, best_fit_decreasing, collate_rows, validate_lengths
from .models import base_model, decoder_layers

# Names in transformers' AttentionInterface. transformers reads meaning into substrings of these names: anything
# containing "sdpa" is refused by models without SDPA support (GPT-OSS), "flash" is treated as a flash-attention
# request (GPT-OSS would swap in a hub kernel), "flex_attention" runs flex checks. So the names avoid them.
ATTN_NAMES = {"sdpa": "fastsft_dense", "eager": "fastsft_eager", "varlen": "fastsft_varlen", "flex": "fastsft_flex",
              "xformers": "fastsft_xformers", "flash": "fastsft_fa2"}


def attn_implementation_name(backend: str) -> str:
    """The name ``backend`` is registered under in transformers' ``AttentionInterface`` (e.g. sdpa ->
    ``fastsft_dense``); usable as ``attn_implementation=`` in ``from_pretrained``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown packed-attention backend {backend!r}; known: {', '.join(BACKENDS)}")
    return ATTN_NAMES[backend]


# --- the attention functions transformers calls ---------------------------------------------------------------------
@dataclass
class _PackedState:
    backend: str
    cache: bool
    original_attn: Any
    hook: Any = None


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


def _packed_attention(backend: str, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float | None = None,
                      dropout: float = 0.0, sliding_window: int | None = None, s_aux: torch.Tensor | None = None,
                      packed_metadata: PackedMetadata | None = None, position_ids: torch.Tensor | None = None,
                      **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One attention layer over packed rows. query (B, H, T, D), key/value (B, Hkv, T, D) -> (B, T, H, D)."""
    b, h, t, d = query.shape
    if key.shape[2] != t:
        raise RuntimeError(f"packed attention is for training and prefill: got {t} queries but {key.shape[2]} keys "
                           "(a KV cache). Call disable_packed_attention(model) before generate().")
    state: _PackedState | None = getattr(module, "_fastsft_packed_state", None)
    cache = state.cache if state is not None else True
    scale = float(scaling) if scaling is not None else d ** -0.5
    window = _norm_window(sliding_window, t)
    sinks = s_aux
    device = query.device
    if cache and packed_metadata is None:
        # Only without enable_packed_attention (the name set by hand): nothing built the metadata for this step.
        _warn_once("no-meta", "fastsft packed attention got no packed_metadata: rebuilding it in every layer (the "
                              "naive path). Call enable_packed_attention(model) or pass packed_metadata=.")
        cache = False
    if cache:
        packed_metadata.check_shape(b, t)
    elif position_ids is None:
        raise ValueError("the naive packed path rebuilds the metadata from position_ids, and the layer got none")
    else:
        position_ids = position_ids.expand(b, t)
    dropout = dropout if module.training else 0.0

    if backend in ("sdpa", "eager"):
        with_sink = sinks is not None and backend == "sdpa"
        mask = (packed_metadata.dense_mask(device, query.dtype, window, sink=with_sink) if cache
                else naive_dense_mask(position_ids, query.dtype, window, sink=with_sink))
        if backend == "sdpa":
            return sdpa_attention(query, key, value, mask, scale=scale, dropout=dropout, sinks=sinks), None
        return eager_attention(query, key, value, mask, scale=scale, dropout=dropout, training=module.training,
                               sinks=sinks)
    if backend == "varlen":
        if dropout:
            raise NotImplementedError("the varlen backend runs without attention dropout")
        if cache:
            cu, max_len = packed_metadata.tensors(device).cu_seqlens, packed_metadata.max_seqlen
        else:
            cu, max_len = naive_varlen_args(position_ids)
        return varlen_attention(query, key, value, cu, max_len, scale=scale, window=window, sinks=sinks), None
    if backend == "flex":
        if dropout:
            raise NotImplementedError("the flex backend runs without attention dropout")
        if device.type == "cpu" and torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
            raise RuntimeError("the flex backend cannot train on a CPU (FlexAttention has no CPU backward): run it "
                               "under torch.no_grad(), or use the sdpa or varlen backend")
        block_mask = packed_metadata.block_mask(device, window) if cache else naive_block_mask(position_ids, window)
        return flex_attention_packed(query, key, value, block_mask, scale=scale, sinks=sinks), None
    if backend == "xformers":
        bias = packed_metadata.xformers_bias(device, window) if cache else naive_xformers_bias(position_ids, window)
        return xformers_attention(query, key, value, bias, scale=scale, dropout=dropout, sinks=sinks), None
    if backend == "flash":
        if cache:
            cu, max_len = packed_metadata.tensors(device).cu_seqlens, packed_metadata.max_seqlen
        else:
            cu, max_len = naive_varlen_args(position_ids)
        return flash_attn_attention(query, key, value, cu, max_len, scale=scale, window=window, dropout=dropout,
                                    sinks=sinks), None
    raise ValueError(f"unknown packed-attention backend {backend!r}")


def _make_attention(backend: str) -> Callable:
    def attention(module, query, key, value, attention_mask, **kwargs):
        return _packed_attention(backend, module, query, key, value, attention_mask, **kwargs)

    attention.__name__ = f"{ATTN_NAMES[backend]}_attention"
    attention.__doc__ = f"Packed attention, backend {backend!r} (registered as {ATTN_NAMES[backend]})."
    return attention


def register_packed_backends() -> list[str]:
    """Register every backend in transformers' ``AttentionInterface`` (done on import; idempotent)."""
    from transformers import AttentionInterface

    names = []
    for backend in BACKENDS:
        name = attn_implementation_name(backend)
        AttentionInterface.register(name, _make_attention(backend))
        names.append(name)
    return names


register_packed_backends()


# --- the switch on a live model ------------------------------------------------------------------------------------
def _inner_model(model: nn.Module) -> nn.Module:
    inner = base_model(model)
    return getattr(inner, "model", inner)


def _inject_metadata(state: _PackedState):
    """Forward pre-hook on the decoder stack: the cached path needs one PackedMetadata per step."""

    def hook(module, args, kwargs):
        if not state.cache:
            return None  # naive: each layer rebuilds from position_ids, by design
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        shape = tuple((ids if ids is not None else embeds).shape[:2])
        meta = kwargs.get("packed_metadata")
        if meta is not None:
            if not isinstance(meta, PackedMetadata):
                raise TypeError(f"packed_metadata must be a PackedMetadata, got {type(meta).__name__}")
            meta.check_shape(*shape)
            return None
        mask = kwargs.get("attention_mask")
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            raise ValueError("packed attention builds its own masks: pass packed_metadata or packed position_ids, "
                             "not a prepared 4-D/dict attention_mask")
        # One sync for the whole step (not one per layer): read position_ids (and the mask) back once.
        kwargs["packed_metadata"] = PackedMetadata.from_position_ids(kwargs.get("position_ids"), shape=shape,
                                                                     attention_mask=mask)
        return args, kwargs

    return hook


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        if p.device.type != "meta":
            return p.device
    return torch.device("cpu")


def enable_packed_attention(model: nn.Module, backend: str = "sdpa", *, cache: bool = True,
                            check_available: bool = True) -> nn.Module:
    """Run ``model``'s attention over packed rows with ``backend``; ``cache`` picks the cached or the naive path.

    Args:
        model: a transformers causal LM, PEFT-wrapped or not (Qwen3, GPT-OSS, Llama-like families).
        backend: ``"sdpa"`` (dense mask; runs anywhere), ``"varlen"`` (torch's flash varlen kernel on CUDA; a
            reference kernel on CPU), ``"flex"`` (flex attention + BlockMask), ``"xformers"``, ``"flash"``
            (the flash_attn package) or ``"eager"`` (the exact reference).
        cache: True builds the metadata once per batch (0 syncs in the layers); False rebuilds it in every layer
            from ``position_ids`` (the naive path, for comparison). Switch later with
            :func:`set_packed_metadata_cache`.
        check_available: raise if ``backend`` cannot run on the model's device (see :func:`available_backends`).

    Calling it again switches the backend; :func:`disable_packed_attention` restores the original.
    """
    name = attn_implementation_name(backend)
    if check_available:
        status = available_backends(_model_device(model))[backend]
        if not status.available:
            raise RuntimeError(f"packed-attention backend {backend!r} is not available here: {status.reason}")
    base = base_model(model)
    state: _PackedState | None = getattr(base, "_fastsft_packed_state", None)
    if state is None:
        state = _PackedState(backend=backend, cache=cache, original_attn=base.config._attn_implementation)
        state.hook = _inner_model(model).register_forward_pre_hook(_inject_metadata(state), with_kwargs=True)
        base._fastsft_packed_state = state
        for layer in decoder_layers(model):
            attn = getattr(layer, "self_attn", None)
            if attn is not None:
                attn._fastsft_packed_state = state
    state.backend, state.cache = backend, bool(cache)
    if base.config._attn_implementation != name:
        base.set_attn_implementation(name)
    return model


def set_packed_metadata_cache(model: nn.Module, enabled: bool) -> None:
    """Toggle ``packed_metadata_cache`` on a live model: True = cached path, False = naive per-layer rebuild."""
    state = getattr(base_model(model), "_fastsft_packed_state", None)
    if state is None:
        raise RuntimeError("packed attention is not enabled on this model: call enable_packed_attention() first")
    state.cache = bool(enabled)


def disable_packed_attention(model: nn.Module) -> None:
    """Undo :func:`enable_packed_attention`: the exact original ``config._attn_implementation``, no hook left."""
    base = base_model(model)
    state: _PackedState | None = getattr(base, "_fastsft_packed_state", None)
    if state is None:
        return
    # The setter, not set_attn_implementation(): it would "adjust" some values (e.g. sdpa -> eager on GPT-OSS).
    base.config._attn_implementation = state.original_attn
    state.hook.remove()
    for layer in decoder_layers(model):
        attn = getattr(layer, "self_attn", None)
        if attn is not None and hasattr(attn, "_fastsft_packed_state"):
            del attn._fastsft_packed_state
    del base._fastsft_packed_state


def packed_attention_state(model: nn.Module) -> dict | None:
    """``{"backend", "cache", "attn_implementation", "original_attn_implementation"}`` or None when off."""
    base = base_model(model)
    state = getattr(base, "_fastsft_packed_state", None)
    if state is None:
        return None
    return {"backend": state.backend, "cache": state.cache, "attn_implementation": base.config._attn_implementation,
            "original_attn_implementation": state.original_attn}


# --- a collator for TRL's SFTTrainer (or any training loop) --------------------------------------------------------
def _ints(x) -> list[int]:
    if isinstance(x, torch.Tensor):
        return x.tolist()  # collate time, host tensors: no device involved
    return [int(v) for v in x]


class PackedCollator:
    """Pack tokenized examples into rows and attach the batch's :class:`PackedMetadata`.

    Args:
        max_tokens: tokens per row. Examples are packed best-fit-decreasing into rows of this width (the rest of
            a row is a padding tail with no loss). ``None``: all examples of the batch in one row, no padding
            (padding-free), optionally rounded up to ``pad_to_multiple_of``.
        pad_token_id: token id of the padding tail.
        pad_to_multiple_of: with ``max_tokens=None``, pad the single row to a multiple of this.

    Takes ``{"input_ids": [...]}`` examples, with optional ``"labels"`` (-100 = no loss), ``"completion_mask"``,
    and TRL's ``"seq_lengths"`` (an example that is already several packed sequences). Returns ``input_ids``,
    ``labels``, ``position_ids`` (B, T) and ``packed_metadata``: every sequence's first label is -100, so the
    packed loss equals the per-sequence one. ``Trainer._prepare_inputs`` moves the tensors and passes the
    metadata through untouched; it copies itself to the model's device on first use.
    """

    def __init__(self, max_tokens: int | None = None, pad_token_id: int = 0, *,
                 pad_to_multiple_of: int | None = None):
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens}")
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.max_tokens = max_tokens
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def examples(self, features: Sequence[dict]) -> list[Example]:
        out = []
        for i, f in enumerate(features):
            if "input_ids" not in f:
                raise ValueError(f"example {i} has no 'input_ids' (keys: {sorted(f)})")
            ids = _ints(f["input_ids"])
            if "labels" in f and f["labels"] is not None:
                labels = _ints(f["labels"])
            elif "completion_mask" in f and f["completion_mask"] is not None:
                labels = [t if m else IGNORE_INDEX for t, m in zip(ids, _ints(f["completion_mask"]))]
            else:
                labels = list(ids)
            if len(labels) != len(ids):
                raise ValueError(f"example {i}: {len(ids)} input_ids but {len(labels)} labels")
            segs = _ints(f["seq_lengths"]) if f.get("seq_lengths") is not None else [len(ids)]
            if sum(segs) != len(ids):
                raise ValueError(f"example {i}: seq_lengths sum to {sum(segs)} but it has {len(ids)} tokens")
            start = 0
            for n in segs:
                if n < 1:
                    raise ValueError(f"example {i} has an empty sequence; drop empty examples before collating")
                out.append(Example(tuple(ids[start:start + n]), tuple(labels[start:start + n])))
                start += n
        if not out:
            raise ValueError("no examples to collate")
        return out

    def pack(self, features: Sequence[dict]) -> PackedBatch:
        examples = self.examples(features)
        if self.max_tokens is None:
            total = sum(len(e) for e in examples)
            row = total if self.pad_to_multiple_of is None else -(-total // self.pad_to_multiple_of) * \
                self.pad_to_multiple_of
            return collate_rows(examples, [list(range(len(examples)))], row, self.pad_token_id)
        lengths = [len(e) for e in examples]
        validate_lengths(lengths, self.max_tokens)
        return collate_rows(examples, best_fit_decreasing(lengths, self.max_tokens), self.max_tokens,
                            self.pad_token_id)

    def __call__(self, features: Sequence[dict]) -> dict:
        batch = self.pack(features)
        return {**batch.model_inputs(), "packed_metadata": PackedMetadata.from_batch(batch)}


def packed_inputs(batch: PackedBatch) -> dict:
    """A packer batch as model kwargs for the cached path: stock inputs plus its ``packed_metadata``."""
    return {**batch.model_inputs(), "packed_metadata": PackedMetadata.from_batch(batch)}


# --- evidence helpers (tests and notebook) --------------------------------------------------------------------------
def packed_vs_alone(model: nn.Module, batch: PackedBatch, inputs: dict | None = None) -> float:
    """Largest |logit difference| between the packed forward and each sequence run alone (no grad)."""
    from .data import unpack

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
    from .moe import experts_modules

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
    from .data import unpack

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


# --- the benchmark scenario -------------------------------------------------------------------------------------------
def _windows_and_sinks(model: nn.Module) -> tuple[tuple[int | None, ...], bool]:
    windows, sinks = set(), False
    for layer in decoder_layers(model):
        attn = layer.self_attn
        windows.add(getattr(attn, "sliding_window", None))
        sinks = sinks or getattr(attn, "sinks", None) is not None
    return tuple(sorted(windows, key=lambda w: -1 if w is None else w)), sinks


def _compute_dtype(model: nn.Module) -> torch.dtype:
    emb = base_model(model).get_input_embeddings()
    return emb.weight.dtype


def packed_variants(model: nn.Module, backend: str, device: torch.device, *, stock: str | None = None) -> list:
    """naive, cached and oracle variants of ``backend`` (+ the stock transformers path ``stock``) for run_variants."""
    from .bench import Variant

    windows, sinks = _windows_and_sinks(model)
    dtype = _compute_dtype(model)
    name = attn_implementation_name(backend)
    syncs = {"sdpa": "4 (nonzero, max().item(), sum().item(), tolist()) + a per-segment Python loop",
             "eager": "4 (as sdpa)", "varlen": "3 (bool(), nonzero, max_seqlen as int)",
             "flex": "1 (transformers' packed check) + create_block_mask in every layer",
             "xformers": "2 (nonzero, tolist())", "flash": "3 (as varlen)"}[backend]

    def on(cache: bool):
        return lambda m: enable_packed_attention(m, backend, cache=cache, check_available=False)

    def prepared(batch: PackedBatch) -> PackedMetadata:
        meta = PackedMetadata.from_batch(batch).prepare(device, backend=backend, dtype=dtype, windows=windows,
                                                        sink=sinks)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return meta

    variants = [
        Variant(f"{backend} naive", {"attn_implementation": name, "packed_metadata_cache": False}, on(False),
                disable_packed_attention, None, lambda b, s: b.model_inputs(),
                note=f"metadata rebuilt from position_ids in every layer (and again in each checkpoint recompute); "
                     f"syncs per layer: {syncs}. Faithful to transformers' flash-attention packed path "
                     f"(modeling_flash_attention_utils) and Unsloth's pre-cache utils/packing.py builders."),
        Variant(f"{backend} cached", {"attn_implementation": name, "packed_metadata_cache": True}, on(True),
                disable_packed_attention, None, lambda b, s: packed_inputs(b),
                note="PackedMetadata built from the packer's host lengths inside the timed step; device tensors "
                     "(one pinned non-blocking copy) and the backend object built lazily by the first layer, then "
                     "reused by every layer and by the checkpoint recompute. 0 syncs."),
        Variant(f"{backend} oracle", {"attn_implementation": name, "packed_metadata_cache": True, "oracle": True},
                on(True), disable_packed_attention, prepared,
                lambda b, s: {**b.model_inputs(), "packed_metadata": s},
                note="everything prebuilt outside the timed region (Variant.prepare): the zero-overhead limit."),
    ]
    if stock:
        def stock_on(m, impl=stock):
            disable_packed_attention(m)
            base = base_model(m)
            base._fastsft_stock_prev = base.config._attn_implementation
            if base.config._attn_implementation != impl:
                base.set_attn_implementation(impl)

        def stock_off(m):
            base = base_model(m)
            prev = getattr(base, "_fastsft_stock_prev", None)
            if prev is not None:
                base.config._attn_implementation = prev
                del base._fastsft_stock_prev

        leak = " (GPT-OSS: no packing detection, sequences attend across boundaries)" if sinks else ""
        variants.append(Variant(
            f"stock {stock}", {"attn_implementation": stock, "packed_metadata_cache": None}, stock_on, stock_off,
            None, lambda b, s: b.model_inputs(),
            note=f"stock transformers {stock} given packed position_ids and no mask: masking_utils detects the "
                 f"packing from position_ids once per forward (one sync) and builds the mask once{leak}."))
    return variants


def naive_variants(model: nn.Module, backends: Sequence[str] = ("sdpa",), device=None) -> list:
    """Only the naive per-layer variant of each backend (notebook 00 measures it next to the stock path)."""
    device = torch.device(device) if device is not None else _model_device(model)
    return [packed_variants(model, b, device)[0] for b in backends]


def _stock_for(backend: str, family: str) -> str | None:
    """The stock path a user of ``backend`` would otherwise run (None: the same as another config's stock)."""
    if backend == "flex":
        return "flex_attention"
    if backend == "varlen":
        return None   # stock transformers has no torch-varlen path; its stock sdpa/eager is timed in the sdpa config
    return "eager" if family == "gpt_oss" else "sdpa"


def _result_name(model: str, tokens: int, mix: str, backend: str) -> str:
    size = f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
    return f"packed_{model}_{size}_{mix}_{backend}"


def _speedups(result: dict) -> dict:
    rows = {r["name"].split(" ", 1)[1] if " " in r["name"] else r["name"]: r for r in result["variants"]
            if "error" not in r}
    out = {}
    naive = rows.get("naive")
    for key in ("cached", "oracle"):
        if naive and key in rows:
            for phase in ("forward", "step"):
                if f"{phase}_ms" in naive and f"{phase}_ms" in rows[key]:
                    out[f"{key}_{phase}_speedup"] = round(naive[f"{phase}_ms"]["median"] /
                                                          rows[key][f"{phase}_ms"]["median"], 4)
    if "cached" in rows and "oracle" in rows and "step_ms" in rows["cached"]:
        out["cached_vs_oracle_step"] = round(rows["cached"]["step_ms"]["median"] /
                                             rows["oracle"]["step_ms"]["median"], 4)
    return out


def plot_regime(summary: list[dict], path: str, x: str = "tokens_per_step") -> str:
    """The regime map: speedup of the cached path over the naive one (forward, step) against ``x``.

    One column per model and depth (``num_layers``), one line per (backend, length mix); the naive path is 1.0x.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = sorted({(s["model"], s.get("num_layers") or 0) for s in summary})
    fig, axes = plt.subplots(2, len(columns), figsize=(5.2 * len(columns), 7.0), squeeze=False, sharey="row")
    for col, (model, layers) in enumerate(columns):
        groups: dict[tuple, list[dict]] = {}
        for s in summary:
            if (s["model"], s.get("num_layers") or 0) == (model, layers):
                groups.setdefault((s["backend"], s["mix"]), []).append(s)
        for row, phase in enumerate(("forward", "step")):
            ax = axes[row][col]
            for (backend, mix), rows in sorted(groups.items()):
                rows = sorted(rows, key=lambda r: r[x])
                pts = [(r[x], r.get(f"cached_{phase}_speedup")) for r in rows if r.get(f"cached_{phase}_speedup")]
                if not pts:
                    continue
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=f"{backend} | {mix}")
                for xi, yi in pts:
                    ax.annotate(f"{yi:.2f}x", (xi, yi), textcoords="offset points", xytext=(0, 5), fontsize=7,
                                ha="center")
            ax.axhline(1.0, color="gray", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{model} ({layers} layers): {phase}, cached vs naive", fontsize=9)
            if row == 1:
                ax.set_xlabel(x.replace("_", " "))
            if col == 0:
                ax.set_ylabel(f"{phase} speedup over the naive path")
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.tight_layout()
    from .bench import save_figure

    return save_figure(fig, path)


def _default_options(device: torch.device, smoke: bool) -> dict:
    if smoke:
        return dict(models=["tiny-qwen3", "tiny-gpt-oss"], tokens=[512], backends=["sdpa", "varlen"],
                    mix="short", num_layers=None, quant=None, lora_rank=8, gradient_checkpointing=True,
                    dtype=torch.float32 if device.type == "cpu" else torch.bfloat16, steps=3, warmup=1, stock=True,
                    mixes=None)
    return dict(models=["qwen3-14b"], tokens=[4096, 16384], backends=["sdpa", "varlen", "flex"], mix="realistic",
                num_layers=8, quant="nf4", lora_rank=16, gradient_checkpointing=True, dtype=torch.bfloat16,
                steps=4, warmup=2, stock=True, mixes=None)


def _sweep_options() -> dict:
    return dict(models=["qwen3-0.6b", "qwen3-14b"], tokens=[2048, 4096, 8192, 16384], backends=["sdpa", "varlen"],
                mixes=["short", "realistic", "long"], num_layers={"qwen3-0.6b": None, "qwen3-14b": 8},
                steps=4, warmup=1, stock=False)


def bench_scenario(*, device, smoke: bool, out_dir: str, steps: int | None = None, warmup: int | None = None,
                   progress: bool = True, **options) -> list[dict]:
    """Time naive / cached / oracle (+ stock) packed attention per backend and tokens per step.

    Defaults -- GPU: Qwen3-14B width, ``num_layers=8``, NF4 + LoRA r16 on all projections, gradient
    checkpointing, tokens per step {4096, 16384} from the realistic mix, backends sdpa, varlen, flex
    (xformers/flash are added when asked and available), warmup 2, steps 4 -- roughly 3-5 min on an H200, a good
    part of it torch.compile for flex (``--set packed.backends=sdpa,varlen`` skips it). Each configuration's JSON
    and the regime summary are written as soon as it finishes, so a time limit keeps what was done. Smoke/CPU: tiny-qwen3 and
    tiny-gpt-oss, 512 tokens of short sequences, sdpa and varlen (reference kernel), float32.

    Options (all optional): ``models``, ``tokens`` (list of tokens per step), ``backends``, ``mix`` or ``mixes``,
    ``num_layers`` (int, or dict per model), ``quant``, ``lora_rank``, ``gradient_checkpointing``, ``row_tokens``
    (default: one row per step), ``stock`` (also time the stock transformers path), ``sweep=True`` (the regime
    map: qwen3-0.6b vs qwen3-14b x {2k..16k} x {short, realistic, long} x {sdpa, varlen}, naive/cached/oracle).

    Writes one JSON + PNG per configuration and ``packed_regime.json``/``.png`` (speedup vs tokens per step)
    into ``out_dir``; returns the result dicts.
    """
    from .bench import format_table, make_result, plot_result, run_variants, write_json
    from .data import benchmark_batches
    from .models import LoraSettings, build_model, get_preset

    device = torch.device(device)
    opts = _default_options(device, smoke)
    if options.get("sweep"):
        opts.update(_sweep_options())
    opts.update({k: v for k, v in options.items() if k != "sweep"})
    for key in ("models", "tokens", "backends", "mixes"):  # `--set packed.tokens=4096` gives a scalar
        if opts.get(key) is not None and not isinstance(opts[key], (list, tuple)):
            opts[key] = [opts[key]]
    unknown = [b for b in opts["backends"] if b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown packed-attention backend(s) {unknown}; known: {', '.join(BACKENDS)}")
    steps = steps if steps is not None else opts["steps"]
    warmup = warmup if warmup is not None else opts["warmup"]
    mixes = opts.get("mixes") or [opts["mix"]]
    status = available_backends(device)
    results, summary = [], []
    os.makedirs(out_dir, exist_ok=True)
    for model_name in opts["models"]:
        preset = get_preset(model_name)
        layers = opts["num_layers"].get(model_name) if isinstance(opts["num_layers"], dict) else opts["num_layers"]
        model = build_model(model_name, device=device, dtype=opts["dtype"], quant=opts["quant"],
                            lora=LoraSettings(rank=opts["lora_rank"]), num_layers=layers,
                            gradient_checkpointing=opts["gradient_checkpointing"])
        for p in model.parameters():  # LoRA B starts at zero; give the adapters a real gradient path
            if p.requires_grad and p.dim() == 2 and not p.any():
                nn.init.normal_(p, std=0.01)
        vocab = model.config.vocab_size
        for mix in mixes:
            for tokens in opts["tokens"]:
                row = opts.get("row_tokens") or tokens
                batches = [b.to(device) for b in benchmark_batches(tokens_per_step=tokens, row_tokens=row,
                                                                   steps=max(steps, 2), vocab_size=vocab, mix=mix)]
                for backend in opts["backends"]:
                    st = status[backend]
                    mode = "train"
                    if not st.available or not st.training:
                        print(f"[packed] skip {model_name} {backend}: {st.reason}")
                        continue
                    stock = _stock_for(backend, preset.family) if opts["stock"] else None
                    if stock == "flex_attention" and device.type == "cpu":
                        stock = None
                    variants = packed_variants(model, backend, device, stock=stock)
                    label = f"{model_name} {tokens} {mix} {backend}"
                    rows = run_variants(model, batches, variants, steps=steps, warmup=warmup, mode=mode,
                                        progress=progress, label=label)
                    config = {"model": model_name, "num_layers": model.config.num_hidden_layers,
                              "tokens_per_step": tokens, "row_tokens": row, "mix": mix, "backend": backend,
                              "quant": opts["quant"], "lora_rank": opts["lora_rank"],
                              "gradient_checkpointing": opts["gradient_checkpointing"],
                              "dtype": str(opts["dtype"]).replace("torch.", ""), "steps": steps, "warmup": warmup,
                              "mode": mode, "batch": batches[0].length_stats(),
                              "segments_per_step": [b.num_sequences for b in batches]}
                    result = make_result("packed_metadata", config, rows, device,
                                         notes="baseline = the naive path (first variant); speedups are naive/x.")
                    result["speedups"] = _speedups(result)
                    name = _result_name(model_name, tokens, mix, backend)
                    write_json(result, os.path.join(out_dir, name + ".json"))
                    plot_result(result, os.path.join(out_dir, name + ".png"),
                                title=f"packed metadata: {model_name} ({config['num_layers']} layers) | {tokens} "
                                      f"tok/step | {mix} | {backend} | {result['env'].get('gpu_name') or 'CPU'}")
                    print(f"\n{label}\n{format_table(result)}")
                    results.append(result)
                    summary.append({"model": model_name, "backend": backend, "mix": mix, "tokens_per_step": tokens,
                                    "num_layers": config["num_layers"], **result["speedups"]})
                    _write_regime(summary, results, out_dir)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def _write_regime(summary: list[dict], results: list[dict], out_dir: str) -> None:
    from .bench import write_json

    write_json({"scenario": "packed_metadata_regime", "summary": summary, "env": results[0]["env"]},
               os.path.join(out_dir, "packed_regime.json"))
    plot_regime(summary, os.path.join(out_dir, "packed_regime.png"))


__all__ = [
    "PackedMetadata", "PackedCollator", "BackendStatus", "BACKENDS", "ATTN_NAMES", "available_backends",
    "attn_implementation_name", "enable_packed_attention", "disable_packed_attention", "set_packed_metadata_cache",
    "packed_attention_state", "register_packed_backends", "packed_inputs", "packed_vs_alone", "packed_vs_alone_moe", "cross_contamination",
    "packed_variants", "naive_variants", "plot_regime", "bench_scenario", "NAIVE_BUILDS",
]
