"""Packed attention with flex attention and a ``BlockMask`` (compiled on CUDA; forward only on a CPU).

* cached: :func:`block_mask`. Which 128 x 128 tiles are empty, partial or full follows from the host-side lengths
  alone (:func:`host_block_tables`), so the cached path runs no ``mask_mod`` over T x T positions, compiles nothing
  and reads nothing from the device: one pinned, non-blocking copy of the tables, then
  ``BlockMask.from_kv_blocks`` derives the transposed (backward) tables on the device.
* prebuilt (:func:`host_block_mask_tables`, the backend's ``host`` part, e.g. in a DataLoader worker): all eight
  tables, the backward ones included, on the host; in the step one non-blocking copy and a ``BlockMask`` assembled
  from views of it (no kernel, no host-side table work).
* naive: :func:`naive_block_mask`, segment ids by transformers' packed-sequence rule (with its "is this packed?"
  check: 1 sync per layer) and ``create_block_mask`` in every layer, compiled on CUDA as transformers does (a T x T
  reduction compiled for every new shape: minutes of Triton compilation for a first 16k-token row).
* kernel: :func:`flex_attention_packed`; sinks by rescaling with ``sigmoid(lse - sink)`` (flex's ``lse`` is
  differentiable). Rows are padded to whole 128-token blocks (compiled flex cannot lower other lengths); the
  padding is its own segment, so no real token sees it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Sequence

import torch
import torch.nn.functional as F

from ..._compat import (disable_dispatch_modes, dispatch_modes, dynamo_config, dynamo_errors, flex_block_transpose,
                        has_triton)
from ..._util import round_up
from ..metadata import PackedMetadata, norm_device, norm_window, note_build
from ..registry import Backend, BackendStatus, register_backend

FLEX_RECOMPILE_LIMIT = 64
FLEX_BLOCK = 128          # flex attention's default block size: BlockMasks are built for a multiple of it


def compile_headroom():
    """Room for one compiled flex kernel per shape, and a loud error instead of the silent eager fallback.

    ``torch.compile`` keeps at most ``recompile_limit`` (8) kernels per function. A training run whose packed shape
    changes (rows x tokens, window, sinks, grad mode) passes 8 quickly; dynamo then silently runs flex *eagerly*,
    which materialises every head's T x T scores. Within this context the limit is raised for the flex call only,
    and hitting it raises ``FailOnRecompileLimitHit`` rather than degrading silently.
    """
    config = dynamo_config()
    return config.patch(recompile_limit=max(config.recompile_limit, FLEX_RECOMPILE_LIMIT),
                        fail_on_recompile_limit_hit=True)


def mask_mod_for(ids: torch.Tensor, window: int | None):
    """flex's ``mask_mod`` of packed causal (windowed) attention over segment ids ``ids`` (rows, T)."""
    # One code object for every batch, so a compiled flex kernel is reused rather than recompiled.
    if window is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (ids[b, q_idx] == ids[b, kv_idx]) & (kv_idx <= q_idx)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (ids[b, q_idx] == ids[b, kv_idx]) & (kv_idx <= q_idx) & (q_idx - kv_idx < window)
    return mask_mod


def host_block_tables(seq_lengths: Sequence[Sequence[int]], row_tokens: int, window: int | None,
                      block: int = FLEX_BLOCK) -> tuple[torch.Tensor, ...]:
    """Partial and full tile tables of a packed causal (optionally sliding-window) mask, from host lengths.

    Query q may see key k iff both are in the same segment and ``lo(q) <= k <= q``, where ``lo(q)`` is the later of
    q's segment start and ``q - window + 1``. ``lo`` never decreases along a row, so for the tile of query block i
    and key block j (first/last query ``q0``/``q1``, first/last key ``k0``/``k1``):

    * some key is visible iff ``j <= i`` and ``lo(q0) <= k1`` (q0 is the query with the smallest ``lo``),
    * every key is visible to every query iff ``j < i`` and ``lo(q1) <= k0``.

    Rows are padded to a multiple of ``block``; the padding is one more segment. Returns ``(partial_num,
    partial_idx, full_num, full_idx)`` in flex's ordered layout (rows, 1, nb[, nb]) as int32 CPU tensors: per query
    block, the count and then the key-block indices in increasing order, unused slots after them.
    """
    rows = len(seq_lengths)
    padded = round_up(row_tokens, block)
    nb = padded // block
    lo = torch.empty(rows, padded, dtype=torch.int64)
    pos = torch.arange(padded)
    for r, lengths in enumerate(seq_lengths):
        segs = list(lengths) + ([padded - row_tokens] if padded != row_tokens else [])
        lens = torch.tensor(segs, dtype=torch.int64)
        starts = torch.cumsum(lens, 0) - lens
        lo[r] = torch.repeat_interleave(starts, lens, output_size=padded)
    if window is not None:
        lo = torch.maximum(lo, pos - window + 1)
    first = torch.arange(nb) * block
    q_lo_first = lo[:, first].unsqueeze(-1)                    # (rows, nb, 1): lo(q0) of query block i
    q_lo_last = lo[:, first + block - 1].unsqueeze(-1)         # lo(q1)
    i = torch.arange(nb).view(nb, 1)
    j = torch.arange(nb).view(1, nb)
    k0, k1 = j * block, j * block + block - 1
    any_ = (j <= i) & (q_lo_first <= k1)
    full = (j < i) & (q_lo_last <= k0)
    partial = any_ & ~full

    def ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        num = dense.sum(-1, dtype=torch.int32)
        idx = torch.argsort(dense.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
        return num.unsqueeze(1), idx.unsqueeze(1)

    return (*ordered(partial), *ordered(full))


def _padded_ids(ids: torch.Tensor) -> torch.Tensor:
    rows, t = ids.shape
    padded = round_up(t, FLEX_BLOCK)
    if padded == t:
        return ids
    # the padding is its own segment (id -1, never equal to a real segment's id): no real token sees it
    return torch.cat([ids, ids.new_full((rows, padded - t), -1)], dim=1)




def host_block_mask_tables(meta: PackedMetadata, window: int | None) -> torch.Tensor | None:
    """Every table of ``meta``'s BlockMask on the host, flattened into one int32 CPU tensor: the forward tables of
    :func:`host_block_tables`, then the backward (q-side) ones, by torch's own block-table transpose (flex_attention's
    helper, through ``_compat``) -- what ``BlockMask.from_kv_blocks`` runs on the device in the lazy path, so the
    values are the same."""
    transpose = flex_block_transpose()
    if transpose is None:
        return None
    pn, pi, fn, fi = host_block_tables(meta.seq_lengths, meta.row_tokens, norm_window(window, meta.row_tokens))
    tables = (pn, pi, fn, fi, *transpose(pn, pi), *transpose(fn, fi))
    return torch.cat([x.reshape(-1).to(torch.int32) for x in tables])


def _split_tables(flat: torch.Tensor, rows: int, nb: int) -> list[torch.Tensor]:
    """The flat tables back as (rows, 1, nb) counts and (rows, 1, nb, nb) indices, alternating (views, no copy)."""
    parts = torch.split(flat, [rows * nb, rows * nb * nb] * (flat.numel() // (rows * nb * (nb + 1))))
    return [p.view(rows, 1, nb) if i % 2 == 0 else p.view(rows, 1, nb, nb) for i, p in enumerate(parts)]


def block_mask(meta: PackedMetadata, device, window: int | None = None):
    """The cached path: ``meta``'s flex ``BlockMask``, its block structure computed on the host (see module doc);
    from the prebuilt tables when ``meta`` has them (:func:`~fastsft_lab.packing.prebuild_metadata`)."""
    from torch.nn.attention.flex_attention import BlockMask

    window = norm_window(window, meta.row_tokens)
    device = norm_device(device)

    def build():
        rows, t = meta.shape
        nb = round_up(t, FLEX_BLOCK) // FLEX_BLOCK
        ids = _padded_ids(meta.tensors(device).seq_ids.view(meta.shape))
        padded = (nb * FLEX_BLOCK,) * 2
        prebuilt = meta.host_part(("flex", window), device)
        if prebuilt is not None:
            pn, pi, fn, fi, qn, qi, fqn, fqi = _split_tables(prebuilt, rows, nb)
            return BlockMask(padded, pn, pi, fn, fi, qn, qi, fqn, fqi, BLOCK_SIZE=(FLEX_BLOCK, FLEX_BLOCK),
                             mask_mod=mask_mod_for(ids, window))
        partial_num, partial_idx, full_num, full_idx = host_block_tables(meta.seq_lengths, t, window)
        flat = torch.cat([x.reshape(-1) for x in (partial_num, partial_idx, full_num, full_idx)])
        if device.type == "cuda":
            flat = flat.pin_memory()
        flat = flat.to(device, non_blocking=True)
        pn, pi, fn, fi = _split_tables(flat, rows, nb)
        return BlockMask.from_kv_blocks(pn, pi, fn, fi, BLOCK_SIZE=FLEX_BLOCK, mask_mod=mask_mod_for(ids, window),
                                        seq_lengths=padded)

    return meta.cached(("block_mask", device, window), build)


def block_mask_from_ids(ids: torch.Tensor, window: int | None, device: torch.device):
    """``create_block_mask`` over segment ids, as transformers builds it (compiled on CUDA; T x T on the side
    otherwise). Rows are padded to whole blocks."""
    from torch.nn.attention.flex_attention import create_block_mask

    ids = _padded_ids(ids)
    rows, t = ids.shape
    if device.type != "cuda":
        return create_block_mask(mask_mod_for(ids, window), rows, None, t, t, device=device)
    with compile_headroom():
        return create_block_mask(mask_mod_for(ids, window), rows, None, t, t, device=device, _compile=True)


def naive_block_mask(position_ids: torch.Tensor, window: int | None = None):
    """A flex ``BlockMask`` built inside the layer from ``position_ids``.

    Segment ids by transformers' ``find_packed_sequence_indices`` rule (diff != 1, cumsum), including its
    "is this packed at all?" check (1 sync per layer), then ``create_block_mask`` in every layer: a layer-local
    attention function has nowhere to keep it.
    """
    note_build("naive", "block_mask")
    rows, t = position_ids.shape
    first = position_ids[:, :1] - 1
    ids = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    _packed = not bool((ids[:, -1] == 0).all())              # sync 1 (transformers' check)
    return block_mask_from_ids(ids, norm_window(window, t), position_ids.device)


# --- the kernel -----------------------------------------------------------------------------------------------------
def _flex_frame(q, k, v, **kwargs):
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, **kwargs)


@functools.lru_cache(maxsize=1)
def compiled_flex():
    """Flex attention compiled through a frame of our own (uncompiled, flex materialises the full score matrix).

    Not ``torch.compile(flex_attention)``: dynamo keeps guards, cache entries and automatic-dynamic shape state per
    code object, and transformers' flex path compiles ``flex_attention`` itself with dynamic shapes; sharing that
    state made a second row length fail to compile for every caller. A frame of our own keeps ours separate.
    """
    return torch.compile(_flex_frame, dynamic=False)


def _call_flex(fn, *args, **kwargs):
    if fn is compiled_flex():
        recompile_limit_hit, unsupported = dynamo_errors()
        limit = max(dynamo_config().recompile_limit, FLEX_RECOMPILE_LIMIT)
        try:
            with compile_headroom():
                return fn(*args, **kwargs)
        except recompile_limit_hit as e:
            raise RuntimeError(
                f"compiled flex attention hit {limit} recompilations (one per packed shape, window and grad mode): "
                "pack to a few fixed row shapes (PackedCollator(max_tokens=...) pads every row to one length), or "
                "use the varlen backend, whose kernels take any shape") from e
        except unsupported as e:
            q = args[0]
            raise RuntimeError(
                f"torch {torch.__version__} could not compile flex attention for q of shape {tuple(q.shape)} "
                f"({str(e).splitlines()[0][:160]}). transformers' own flex path "
                "(attn_implementation='flex_attention') compiles flex for any row length in the same process with "
                "dynamic shapes, and a later compile can fail after it: keep to one flex path per process, or use "
                "the varlen backend (or sdpa)") from e
    return fn(*args, **kwargs)


@functools.lru_cache(maxsize=1)
def _flex_lse_kwargs() -> tuple[str, object]:
    from torch.nn.attention import flex_attention as fa

    if "return_aux" in inspect.signature(fa.flex_attention).parameters and hasattr(fa, "AuxRequest"):
        return "return_aux", fa.AuxRequest(lse=True)
    return "return_lse", True


def _outside_sync_counter():
    """Run a flex kernel outside ``fastsft_lab.profiling.SyncCounter``'s dispatch mode; refuse any other mode.

    A ``TorchDispatchMode`` cannot take the flex higher-order operator (NotImplementedError), and after such a
    failure flex stays broken for the rest of the process (torch behaviour). So flex steps out of our own counting
    mode (the flex kernel itself never syncs, so nothing the counter should see is hidden), and under anyone else's
    dispatch mode it refuses before calling flex, with an error that says what to do.
    """
    from ...profiling import SyncCountingMode

    modes = dispatch_modes()
    foreign = [type(m).__name__ for m in modes if not isinstance(m, SyncCountingMode)]
    if foreign:
        raise RuntimeError(f"the flex backend cannot run under the TorchDispatchMode {', '.join(foreign)}: torch's "
                           "flex higher-order operator has no rule for it, and a failed attempt leaves flex broken for "
                           "the rest of the process. Leave the mode for the forward, or use the sdpa or varlen backend "
                           "(fastsft_lab.profiling.SyncCounter is handled)")
    if modes:
        return disable_dispatch_modes()
    return contextlib.nullcontext()


def flex_attention_packed(q, k, v, block_mask, *, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """flex attention with a packed ``BlockMask``; sinks by rescaling with ``sigmoid(lse - sink)``."""
    from torch.nn.attention.flex_attention import flex_attention

    fn = compiled_flex() if q.device.type == "cuda" else flex_attention
    enable_gqa = q.shape[1] != k.shape[1]
    t = q.shape[2]
    padded = block_mask.seq_lengths[0]       # a multiple of FLEX_BLOCK; the tail is its own segment
    if padded < t:
        raise ValueError(f"flex BlockMask covers {padded} tokens, the rows have {t}: built for another batch")
    if padded != t:
        q, k, v = (F.pad(x, (0, 0, 0, padded - t)) for x in (q, k, v))
    if sinks is None:
        with _outside_sync_counter():
            out = _call_flex(fn, q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
        return out[:, :, :t].transpose(1, 2)
    name, value = _flex_lse_kwargs()
    with _outside_sync_counter():
        out, aux = _call_flex(fn, q, k, v, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, **{name: value})
    lse = aux if isinstance(aux, torch.Tensor) else aux.lse                # (B, H, T), natural log
    out, lse = out[:, :, :t], lse[..., :t]
    factor = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
    return (out.float() * factor[..., None]).to(q.dtype).transpose(1, 2)


def _kernel(q, k, v, mask, *, scale, dropout, sinks, window, training):
    if dropout:
        raise NotImplementedError("the flex backend runs without attention dropout: set attention_dropout=0, or "
                                  "use the sdpa backend")
    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        raise RuntimeError("the flex backend cannot train on a CPU (FlexAttention has no CPU backward): run it "
                           "under torch.no_grad(), or use the sdpa or varlen backend")
    return flex_attention_packed(q, k, v, mask, scale=scale, sinks=sinks), None


def _status(device: torch.device) -> BackendStatus:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return BackendStatus("flex", False, False, f"torch.nn.attention.flex_attention missing: {e}")
    if device.type != "cuda":
        return BackendStatus("flex", True, False, "forward only: FlexAttention has no CPU backward")

    if not has_triton():
        return BackendStatus("flex", False, False, "flex attention needs triton on CUDA, and it is missing")
    if torch.cuda.get_device_capability(device) < (8, 0):
        return BackendStatus("flex", False, False, "compiled flex attention needs a GPU of compute capability 8.0+")
    return BackendStatus("flex", True, True, "compiled flex attention with a cached BlockMask")


BACKEND = register_backend(Backend(
    name="flex", attn_name="fastsft_flex",
    cached=lambda meta, spec: block_mask(meta, spec.device, spec.window),
    naive=lambda pos, spec: naive_block_mask(pos, spec.window),
    naive_syncs="1 (transformers' packed check) + create_block_mask in every layer",
    kernel=_kernel, status=_status,
    description="flex attention + BlockMask (compiled)",
    host=host_block_mask_tables,
))

__all__ = ["block_mask", "host_block_mask_tables", "naive_block_mask", "block_mask_from_ids", "host_block_tables",
           "mask_mod_for", "flex_attention_packed", "compiled_flex", "compile_headroom", "FLEX_BLOCK",
           "FLEX_RECOMPILE_LIMIT", "BACKEND"]
