"""Packed-sequence attention metadata: built once per batch on the host, or rebuilt per layer (the naive path).

A packed row holds several sequences back to back. Every attention layer needs the same facts about it: where
each sequence starts (``cu_seqlens``), the longest one (``max_seqlen``, a Python int for varlen kernels), and,
depending on the kernel, a dense block-diagonal causal mask (SDPA), a flex ``BlockMask`` or an xFormers bias.

Two ways to get them:

* :class:`PackedMetadata` (the fast path) is built from the packer's *host-side* segment lengths, so nothing is
  read back from the GPU. Device tensors are made lazily on first use with one pinned, non-blocking copy per device,
  and each backend object is built once and cached, keyed by what changes it (backend, dtype, sliding window,
  device). Lengths are tuples of ints and the object is frozen: editing a batch's tensors in place cannot serve
  a stale mask (a cache keyed on a tensor's identity can).
* ``naive_*`` functions (the plain fallback) rebuild the same objects from ``position_ids`` inside every layer,
  paying the device->host syncs that per-layer code pays (each listed in its docstring). A sync stalls the CPU
  until the GPU has drained its queue; the CPU then cannot enqueue the next kernels, so the GPU idles too.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

# Builds of backend objects by the naive path, per kind (tests count them; nothing reads them otherwise).
NAIVE_BUILDS: Counter = Counter()


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or isinstance(value, torch.Tensor):
        # A tensor element would be read back with a sync; a bool is almost always a bug.
        raise ValueError(f"{what} must be a Python int, got {type(value).__name__} {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be a Python int, got {type(value).__name__} {value!r}") from None


def normalize_row_lengths(seq_lengths: Sequence[int] | Sequence[Sequence[int]],
                          row_tokens: int | None = None) -> tuple[tuple[tuple[int, ...], ...], int]:
    """Validate segment lengths (one flat row, or one list per row) against the row width.

    Returns ``(rows, row_tokens)`` as nested tuples of ints. Raises ``ValueError`` with a message that says what
    is wrong: an empty batch or row, a non-integer, a segment < 1 token, rows that do not sum to ``row_tokens``.
    """
    if isinstance(seq_lengths, torch.Tensor):
        raise ValueError("seq_lengths must be host-side Python ints (a tuple or list), not a tensor: reading a "
                         "tensor back would cost the device->host sync this metadata exists to avoid")
    seq = list(seq_lengths)
    if not seq:
        raise ValueError("seq_lengths is empty: a packed batch needs at least one row with one segment")
    flat = not isinstance(seq[0], (list, tuple))
    raw_rows = [seq] if flat else seq
    rows = []
    for b, row in enumerate(raw_rows):
        if isinstance(row, (int,)) or not isinstance(row, (list, tuple)):
            raise ValueError(f"row {b} of seq_lengths is {row!r}; give one flat list of ints or one list per row")
        ints = tuple(_as_int(x, f"segment {i} of row {b}") for i, x in enumerate(row))
        if not ints:
            raise ValueError(f"row {b} has no segments")
        bad = [x for x in ints if x < 1]
        if bad:
            raise ValueError(f"row {b} has a segment of length {bad[0]}; every segment must hold >= 1 token")
        rows.append(ints)
    if row_tokens is None:
        row_tokens = sum(rows[0])
    row_tokens = _as_int(row_tokens, "row_tokens")
    for b, row in enumerate(rows):
        if sum(row) != row_tokens:
            raise ValueError(
                f"row {b}: segment lengths sum to {sum(row)} but the row holds {row_tokens} tokens "
                "(give the padding tail as its own segment)"
            )
    return tuple(rows), row_tokens


@dataclass(frozen=True)
class DeviceTensors:
    """The metadata on one device. Shapes use N = rows * row_tokens (rows concatenated), S = segments."""

    cu_seqlens: torch.Tensor    # (S + 1,) int32: segment starts in the flattened batch, then N
    seq_ids: torch.Tensor       # (N,) int64: which segment each token belongs to (unique across rows)
    position_ids: torch.Tensor  # (rows, row_tokens) int64: position inside its segment


@dataclass(frozen=True, eq=False, repr=False)
class PackedMetadata:
    """Attention metadata of one packed batch, computed on the host, moved to devices lazily.

    Args:
        seq_lengths: per row, the segment lengths in order (padding tail included as its own segment).
        row_tokens: tokens per row (T); default: the sum of the first row.

    Build one per batch (:meth:`from_batch`, :meth:`from_lengths`, or the :class:`~fastsft_lab.packed.PackedCollator`)
    and pass it to the model as ``packed_metadata=``: transformers forwards it to every attention layer.

    Example::

        meta = PackedMetadata.from_lengths([[3, 5, 2]])
        meta.cu_seqlens            # (0, 3, 8, 10), host ints
        meta.tensors("cuda")       # one pinned non-blocking copy, then cached
    """

    seq_lengths: tuple[tuple[int, ...], ...]
    row_tokens: int
    lengths: tuple[int, ...] = field(init=False)      # all segments, rows concatenated
    cu_seqlens: tuple[int, ...] = field(init=False)   # (0, l0, l0+l1, ..., N)
    max_seqlen: int = field(init=False)
    _cache: dict = field(init=False, repr=False)
    builds: Counter = field(init=False, repr=False)   # backend objects built, per kind (tests count them)

    def __post_init__(self) -> None:
        rows, row_tokens = normalize_row_lengths(self.seq_lengths, self.row_tokens)
        lengths = tuple(x for row in rows for x in row)
        cu = [0]
        for x in lengths:
            cu.append(cu[-1] + x)
        object.__setattr__(self, "seq_lengths", rows)
        object.__setattr__(self, "row_tokens", row_tokens)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "cu_seqlens", tuple(cu))
        object.__setattr__(self, "max_seqlen", max(lengths))
        object.__setattr__(self, "_cache", {})
        object.__setattr__(self, "builds", Counter())

    # -- constructors
    @classmethod
    def from_lengths(cls, seq_lengths: Sequence[int] | Sequence[Sequence[int]],
                     row_tokens: int | None = None) -> "PackedMetadata":
        """From host lengths: one flat list (one row) or one list per row. Validates them."""
        rows, row_tokens = normalize_row_lengths(seq_lengths, row_tokens)
        return cls(rows, row_tokens)

    @classmethod
    def from_batch(cls, batch) -> "PackedMetadata":
        """From a :class:`~fastsft_lab.data.PackedBatch` (its host-side ``seq_lengths``): no device access."""
        return cls(batch.seq_lengths, batch.shape[1])

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor | None, *, shape: tuple[int, int] | None = None,
                          attention_mask: torch.Tensor | None = None) -> "PackedMetadata":
        """Recover the segments from ``position_ids`` (a new segment starts where ``pos[t] != pos[t-1] + 1``,
        transformers' rule), for callers that have no host lengths. Costs exactly ONE device->host sync
        (position ids and mask are read back together). A 2-D ``attention_mask`` must be right-padded
        (ones then zeros); the padding becomes its own segment.
        """
        if position_ids is None and attention_mask is None:
            if shape is None:
                raise ValueError("from_position_ids needs position_ids, an attention_mask or a shape")
            b, t = shape
            return cls(((t,),) * b, t)
        ref = position_ids if position_ids is not None else attention_mask
        if ref.dim() != 2:
            raise ValueError(f"position_ids/attention_mask must be 2-D (rows, tokens), got shape {tuple(ref.shape)}")
        b, t = shape if shape is not None else tuple(ref.shape)
        parts = []
        if position_ids is not None:
            parts.append(position_ids.expand(b, t).to(torch.long))
        if attention_mask is not None:
            parts.append(attention_mask.to(device=ref.device, dtype=torch.long).expand(b, t))
        host = torch.stack(parts).tolist()  # the one sync
        pos_rows = host[0] if position_ids is not None else [list(range(t))] * b
        mask_rows = host[-1] if attention_mask is not None else None
        rows = []
        for r in range(b):
            pos = pos_rows[r]
            real = t
            if mask_rows is not None:
                m = mask_rows[r]
                real = sum(1 for x in m if x)
                if any(m[i] for i in range(real, t)) or not all(m[:real]):
                    raise ValueError(f"row {r} of attention_mask is not right-padded (ones, then zeros); packed "
                                     "attention supports right padding only")
            segs, start = [], 0
            for i in range(1, real):
                if pos[i] != pos[i - 1] + 1:
                    segs.append(i - start)
                    start = i
            if real:
                segs.append(real - start)
            if real < t:
                segs.append(t - real)
            rows.append(tuple(segs))
        return cls(tuple(rows), t)

    # -- host-side facts
    @property
    def num_rows(self) -> int:
        return len(self.seq_lengths)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_rows, self.row_tokens)

    @property
    def num_tokens(self) -> int:
        return self.num_rows * self.row_tokens

    @property
    def num_segments(self) -> int:
        return len(self.lengths)

    def __repr__(self) -> str:
        return (f"PackedMetadata(rows={self.num_rows}, row_tokens={self.row_tokens}, segments={self.num_segments}, "
                f"max_seqlen={self.max_seqlen}, cached={sorted(map(str, self._cache))})")

    def __getstate__(self):
        # Device tensors and backend objects stay where they were built (pickling is for DataLoader workers).
        return {"seq_lengths": self.seq_lengths, "row_tokens": self.row_tokens}

    def __setstate__(self, state):
        object.__setattr__(self, "seq_lengths", state["seq_lengths"])
        object.__setattr__(self, "row_tokens", state["row_tokens"])
        self.__post_init__()

    def check_shape(self, rows: int, tokens: int) -> None:
        """Raise if this metadata does not describe a (rows, tokens) batch (host ints only: no sync)."""
        if (rows, tokens) != self.shape:
            raise ValueError(f"packed_metadata describes a {self.shape} batch, but the model got ({rows}, {tokens}) "
                             "tokens: build the metadata from the same batch")

    # -- device side (lazy, cached)
    def _cached(self, key: tuple, build):
        hit = self._cache.get(key)
        if hit is None:
            hit = build()
            self._cache[key] = hit
            self.builds[key[0]] += 1
        return hit

    def tensors(self, device: torch.device | str) -> DeviceTensors:
        """cu_seqlens, per-token segment ids and position ids on ``device``: one copy, then cached."""
        device = _norm_device(device)
        return self._cached(("tensors", device), lambda: self._build_tensors(device))

    def _build_tensors(self, device: torch.device) -> DeviceTensors:
        n, s = self.num_tokens, self.num_segments
        host = torch.tensor(self.cu_seqlens, dtype=torch.int32)
        if device.type == "cuda":
            # Pinned memory makes the copy truly asynchronous: the CPU queues it and moves on, no sync.
            host = host.pin_memory()
        cu = host.to(device, non_blocking=True)
        lengths = cu[1:] - cu[:-1]
        # output_size is a host int, so repeat_interleave does not read the total back from the device.
        seq_ids = torch.repeat_interleave(torch.arange(s, device=device), lengths, output_size=n)
        starts = cu[:-1].to(torch.long)
        position_ids = (torch.arange(n, device=device) - starts[seq_ids]).view(self.num_rows, self.row_tokens)
        return DeviceTensors(cu, seq_ids, position_ids)

    def allowed(self, device, window: int | None = None) -> torch.Tensor:
        """Boolean (rows, 1, T, T) mask: key kept iff same segment and ``q - window < k <= q`` (not cached)."""
        return _allowed_from_ids(self.tensors(device).seq_ids.view(self.shape), _norm_window(window, self.row_tokens))

    def dense_mask(self, device, dtype: torch.dtype, window: int | None = None, *, sink: bool = False) -> torch.Tensor:
        """Additive float mask (rows, 1, T, L): 0 where attention is allowed, -inf elsewhere.

        ``sink=True`` gives the layout of :func:`~fastsft_lab.attention.kernels.sdpa_attention` with sinks: one
        always-visible column first (the virtual sink key), then the T keys, then masked padding columns up to a
        multiple of 8 (aligned rows for the memory-efficient kernel). Float, not bool: SDPA turns a bool mask
        into a float one on every call, in every layer; this one is converted once.
        """
        window = _norm_window(window, self.row_tokens)
        device = _norm_device(device)
        key = ("dense_sink" if sink else "dense", device, dtype, window)
        return self._cached(key, lambda: _additive(self.allowed(device, window), dtype, sink))

    def block_mask(self, device, window: int | None = None):
        """A flex-attention ``BlockMask`` for the packed rows, its block structure computed on the host.

        Which 128 x 128 tiles are empty, partial or full follows from the host-side lengths alone (see
        :func:`host_block_tables`), so nothing here runs ``mask_mod`` over T x T positions, compiles anything, or
        reads from the device: one pinned, non-blocking copy of the tables, then ``BlockMask.from_kv_blocks``
        derives the transposed (backward) tables on the device. ``create_block_mask`` -- what transformers and
        the naive path run -- compiles a T x T reduction for every new shape (measured on the H200, torch 2.11:
        about 160 s of Triton compilation for the first 16k-token row).
        """
        window = _norm_window(window, self.row_tokens)
        device = _norm_device(device)
        key = ("block_mask", device, window)
        return self._cached(key, lambda: self._build_block_mask(device, window))

    def _build_block_mask(self, device: torch.device, window: int | None):
        from torch.nn.attention.flex_attention import BlockMask

        rows, t = self.shape
        padded = _round_up(t, FLEX_BLOCK)
        nb = padded // FLEX_BLOCK
        partial_num, partial_idx, full_num, full_idx = host_block_tables(self.seq_lengths, t, window)
        flat = torch.cat([x.reshape(-1) for x in (partial_num, partial_idx, full_num, full_idx)])
        if device.type == "cuda":
            flat = flat.pin_memory()
        flat = flat.to(device, non_blocking=True)
        sizes = [rows * nb, rows * nb * nb, rows * nb, rows * nb * nb]
        pn, pi, fn, fi = torch.split(flat, sizes)
        ids = self.tensors(device).seq_ids.view(self.shape)
        if padded != t:
            # padded to whole blocks as in _block_mask_from_ids (the padding is its own segment, id -1)
            ids = torch.cat([ids, ids.new_full((rows, padded - t), -1)], dim=1)
        return BlockMask.from_kv_blocks(pn.view(rows, 1, nb), pi.view(rows, 1, nb, nb), fn.view(rows, 1, nb),
                                        fi.view(rows, 1, nb, nb), BLOCK_SIZE=FLEX_BLOCK,
                                        mask_mod=_mask_mod(ids, window), seq_lengths=(padded, padded))

    def xformers_bias(self, device, window: int | None = None):
        """An xFormers ``BlockDiagonalCausalMask`` over all segments (rows concatenated), local if windowed."""
        window = _norm_window(window, self.row_tokens)
        device = _norm_device(device)
        key = ("xformers", device, window)
        return self._cached(key, lambda: _xformers_bias(list(self.lengths), window, device))

    def prepare(self, device, *, backend: str, dtype: torch.dtype = torch.float32,
                windows: Sequence[int | None] = (None,), sink: bool = False) -> "PackedMetadata":
        """Build everything ``backend`` will ask for now (the oracle does this outside the timed region)."""
        self.tensors(device)
        for w in windows:
            if backend in ("sdpa", "eager"):
                self.dense_mask(device, dtype, w, sink=sink and backend == "sdpa")
            elif backend == "flex":
                self.block_mask(device, w)
            elif backend == "xformers":
                self.xformers_bias(device, w)
        return self


# --- builders shared by both paths -----------------------------------------------------------------------------
def _norm_device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _norm_window(window: int | None, tokens: int) -> int | None:
    """transformers' sliding window W keeps key k for query q iff q - W < k <= q; W >= T changes nothing."""
    if window is None:
        return None
    window = int(window)
    if window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {window}")
    return None if window >= tokens else window


def _allowed_from_ids(ids: torch.Tensor, window: int | None) -> torch.Tensor:
    rows, t = ids.shape
    i = torch.arange(t, device=ids.device)
    causal = i[:, None] >= i[None, :]                        # (T, T): k <= q
    if window is not None:
        causal = causal & (i[:, None] - i[None, :] < window)  # q - W < k
    same = ids[:, :, None] == ids[:, None, :]               # (rows, T, T)
    return (same & causal)[:, None]                          # (rows, 1, T, T)


def _additive(allowed: torch.Tensor, dtype: torch.dtype, sink: bool) -> torch.Tensor:
    rows, _, t, _ = allowed.shape
    if not sink:
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, -math.inf)
    width = _round_up(t + 1, 8)
    mask = torch.full((rows, 1, t, width), -math.inf, dtype=dtype, device=allowed.device)
    mask[..., 0] = 0.0                                       # the sink key is always visible
    mask[..., 1:t + 1].masked_fill_(allowed, 0.0)
    return mask


FLEX_RECOMPILE_LIMIT = 64
FLEX_BLOCK = 128          # flex attention's default block size: BlockMasks are built for a multiple of it


def compile_headroom():
    """Room for one compiled flex kernel per shape, and a loud error instead of the silent eager fallback.

    ``torch.compile`` keeps at most ``recompile_limit`` (8) kernels per function, and every caller of
    ``flex_attention`` shares them (transformers' own flex path too). A benchmark sweep or a training run whose packed
    shape changes (rows x tokens, window, sinks, grad mode) passes 8 quickly; dynamo then silently runs flex
    *eagerly*, which materialises every head's T x T scores (shown on a CPU: the 9th shape falls back with only a
    warning). Within this context the limit is raised for the flex call only, and hitting it raises
    ``FailOnRecompileLimitHit`` rather than degrading silently. (It was suspected, but is not, the cause of the
    flex failure at a second row length on the H200: that was transformers' flex path compiling ``flex_attention``'s
    own code object with dynamic shapes; see benchmarks/results/h200-2026-12-03/README.md.)
    """
    import torch._dynamo.config as dynamo_config

    return dynamo_config.patch(recompile_limit=max(dynamo_config.recompile_limit, FLEX_RECOMPILE_LIMIT),
                               fail_on_recompile_limit_hit=True)


def _mask_mod(ids: torch.Tensor, window: int | None):
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
    padded = _round_up(row_tokens, block)
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


def _block_mask_from_ids(ids: torch.Tensor, window: int | None, device: torch.device):
    from torch.nn.attention.flex_attention import create_block_mask

    rows, t = ids.shape
    padded = _round_up(t, FLEX_BLOCK)
    if padded != t:
        # Compiled flex (torch 2.11, H200) fails to lower for lengths that are not a multiple of its 128-token block
        # (T = 37: "NoValidChoicesError"). The kernel pads q/k/v to this length; the padding is its own segment (id -1,
        # never equal to a real segment's id), so no real token sees it, and the output is cut back to T.
        ids = torch.cat([ids, ids.new_full((rows, padded - t), -1)], dim=1)
        t = padded
    # The naive path's mask: create_block_mask, as transformers builds it. On CUDA it is compiled (as transformers
    # does): otherwise it materialises T x T on the side.
    if device.type != "cuda":
        return create_block_mask(_mask_mod(ids, window), rows, None, t, t, device=device)
    with compile_headroom():
        return create_block_mask(_mask_mod(ids, window), rows, None, t, t, device=device, _compile=True)


def _xformers_bias(lengths: list[int], window: int | None, device: torch.device):
    from .kernels import _quiet_logger

    with _quiet_logger("xformers"):
        from xformers.ops.fmha.attn_bias import BlockDiagonalCausalMask

    bias = BlockDiagonalCausalMask.from_seqlens(lengths)
    if window is not None:
        # xFormers' local window keeps q - W < k <= q: the same semantics as transformers' sliding window.
        bias = bias.make_local_attention(window)
    if device.type != "cpu" and hasattr(bias, "to"):
        bias = bias.to(device)
    return bias


# --- the naive path: rebuilt from position_ids in every layer --------------------------------------------------
def naive_varlen_args(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_seqlen)`` exactly as transformers' flash-attention packed path derives them per layer.

    Faithful to ``modeling_flash_attention_utils`` (5.x), which every attention layer runs when it gets packed
    ``position_ids`` and no ``cu_seq_lens``; we call its own functions. Syncs per layer: 3 --
    ``_is_packed_sequence`` returns a device bool that Python branches on (1), ``prepare_fa_kwargs_from_position_ids``
    calls ``nonzero`` whose output size lives on the device (2), and the kernel takes ``max_seqlen`` as a Python
    int, read back from the device (3).
    """
    from transformers.modeling_flash_attention_utils import _is_packed_sequence, prepare_fa_kwargs_from_position_ids

    NAIVE_BUILDS["varlen"] += 1
    flat = position_ids.reshape(1, -1)
    if not _is_packed_sequence(flat, batch_size=1):  # sync 1
        n = flat.shape[1]
        return torch.tensor([0, n], dtype=torch.int32, device=flat.device), n
    (cu, _), (max_len, _) = prepare_fa_kwargs_from_position_ids(flat)  # sync 2 (nonzero)
    return cu, int(max_len)  # sync 3


def _naive_lengths(position_ids: torch.Tensor) -> torch.Tensor:
    flat = position_ids.reshape(-1)
    starts = (flat == 0).nonzero().view(-1)  # sync: the number of segments lives on the device
    ends = torch.cat([starts[1:], torch.tensor([flat.numel()], device=flat.device)])
    return ends - starts


def naive_dense_mask(position_ids: torch.Tensor, dtype: torch.dtype, window: int | None = None, *,
                     sink: bool = False) -> torch.Tensor:
    """The additive mask rebuilt in a layer, faithful to Unsloth's pre-cache ``utils/packing.py`` builders.

    Syncs per layer: 4 -- segment starts by ``nonzero`` (1), ``max().item()`` of the lengths (its
    ``get_packed_info``) (2), ``sum().item()`` for the mask size (3), ``tolist()`` to loop over the lengths (4);
    then a Python loop fills the T x T mask block by block (~6 small kernels per segment, per layer).
    """
    NAIVE_BUILDS["dense"] += 1
    rows, t = position_ids.shape
    device = position_ids.device
    lengths = _naive_lengths(position_ids)                   # sync 1
    _max_seqlen = int(lengths.max().item())                  # sync 2 (kept: per-layer code computes it)
    total = int(lengths.sum().item())                        # sync 3
    if total != rows * t:
        raise ValueError(f"position_ids segments cover {total} tokens, expected {rows * t}")
    width = _round_up(t + 1, 8) if sink else t
    off = 1 if sink else 0
    mask = torch.full((rows, 1, t, width), -math.inf, dtype=dtype, device=device)
    if sink:
        mask[..., 0] = 0.0
    offset = 0
    for length in lengths.tolist():                          # sync 4
        row, start = divmod(offset, t)
        block = torch.zeros((length, length), dtype=dtype, device=device)
        upper = torch.triu(torch.ones((length, length), device=device), diagonal=1).bool()
        block = block.masked_fill(upper, -math.inf)
        if window is not None and length > window:
            idx = torch.arange(length, device=device)
            block = block.masked_fill((idx[:, None] - idx[None, :]) >= window, -math.inf)
        mask[row, 0, start:start + length, off + start:off + start + length] = block
        offset += length
    return mask


def naive_block_mask(position_ids: torch.Tensor, window: int | None = None):
    """A flex ``BlockMask`` built inside the layer from ``position_ids``.

    Segment ids by transformers' ``find_packed_sequence_indices`` rule (diff != 1, cumsum), including its
    "is this packed at all?" check (1 sync per layer), then ``create_block_mask`` in every layer: a layer-local
    attention function has nowhere to keep it.
    """
    NAIVE_BUILDS["block_mask"] += 1
    rows, t = position_ids.shape
    first = position_ids[:, :1] - 1
    ids = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    _packed = not bool((ids[:, -1] == 0).all())              # sync 1 (transformers' check)
    window = _norm_window(window, t)
    return _block_mask_from_ids(ids, window, position_ids.device)


def naive_xformers_bias(position_ids: torch.Tensor, window: int | None = None):
    """An xFormers bias rebuilt in the layer: ``nonzero`` (1) and ``tolist()`` (2) syncs per layer."""
    NAIVE_BUILDS["xformers"] += 1
    lengths = _naive_lengths(position_ids).tolist()
    return _xformers_bias(lengths, _norm_window(window, position_ids.shape[1]), position_ids.device)


__all__ = ["PackedMetadata", "DeviceTensors", "normalize_row_lengths", "naive_varlen_args", "naive_dense_mask",
           "naive_block_mask", "host_block_tables", "naive_xformers_bias", "NAIVE_BUILDS"]
