"""Packed-sequence metadata: built once per batch from the packer's host-side lengths.

A packed row holds several sequences back to back. Every attention layer needs the same facts about it: where
each sequence starts (``cu_seqlens``), the longest one (``max_seqlen``, a Python int for varlen kernels), and,
depending on the kernel, a dense block-diagonal causal mask, a flex ``BlockMask`` or an xFormers bias.

:class:`PackedMetadata` holds the lengths as tuples of Python ints, so nothing is ever read back from the GPU.
Device tensors are made lazily on first use with one pinned, non-blocking copy per device, and each backend's
object is built once and cached under a key of what changes it (backend, device, dtype, window); the backends
(``fastsft_lab.packing.backends``) say how to build them. The object is frozen: editing a batch's tensors in place
cannot serve a stale mask (a cache keyed on a tensor's identity can).
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch


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
        if not isinstance(row, (list, tuple)):
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


def norm_device(device) -> torch.device:
    """``cuda`` -> ``cuda:<current>``: one cache key per physical device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def norm_window(window: int | None, tokens: int) -> int | None:
    """transformers' sliding window W keeps key k for query q iff q - W < k <= q; W >= T changes nothing."""
    if window is None:
        return None
    if isinstance(window, bool) or int(window) != window:
        raise ValueError(f"sliding_window must be a positive int or None, got {window!r}")
    window = int(window)
    if window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {window}")
    return None if window >= tokens else window


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
        pad_lengths: per row, the length of its padding tail (0: none; it is the row's last segment), so that what
            needs the real tokens (the MoE router's load-balancing loss) can leave it out. Default: no padding.

    Build one per batch (:meth:`from_batch`, :meth:`from_lengths`, or :class:`~fastsft_lab.packing.PackedCollator`)
    and pass it to the model as ``packed_metadata=``: transformers forwards it to every attention layer.

    Example::

        meta = PackedMetadata.from_lengths([[3, 5, 2]])
        meta.cu_seqlens            # (0, 3, 8, 10), host ints
        meta.tensors("cuda")       # one pinned non-blocking copy, then cached
    """

    seq_lengths: tuple[tuple[int, ...], ...]
    row_tokens: int
    pad_lengths: tuple[int, ...] | None = None
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
        pads = tuple(0 for _ in rows) if self.pad_lengths is None else \
            tuple(_as_int(p, f"pad_lengths[{b}]") for b, p in enumerate(self.pad_lengths))
        if len(pads) != len(rows):
            raise ValueError(f"pad_lengths has {len(pads)} entries for {len(rows)} rows")
        for b, (row, pad) in enumerate(zip(rows, pads)):
            if pad and row[-1] != pad:
                raise ValueError(f"row {b}: a padding tail of {pad} tokens must be the row's last segment "
                                 f"(it is {row[-1]})")
            if pad < 0:
                raise ValueError(f"pad_lengths[{b}] is {pad}; it must be >= 0")
        object.__setattr__(self, "seq_lengths", rows)
        object.__setattr__(self, "row_tokens", row_tokens)
        object.__setattr__(self, "pad_lengths", pads)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "cu_seqlens", tuple(cu))
        object.__setattr__(self, "max_seqlen", max(lengths))
        object.__setattr__(self, "_cache", {})
        object.__setattr__(self, "builds", Counter())

    # -- constructors
    @classmethod
    def from_lengths(cls, seq_lengths: Sequence[int] | Sequence[Sequence[int]],
                     row_tokens: int | None = None, pad_lengths: Sequence[int] | None = None) -> "PackedMetadata":
        """From host lengths: one flat list (one row) or one list per row. Validates them."""
        rows, row_tokens = normalize_row_lengths(seq_lengths, row_tokens)
        return cls(rows, row_tokens, tuple(pad_lengths) if pad_lengths is not None else None)

    @classmethod
    def from_batch(cls, batch) -> "PackedMetadata":
        """From a :class:`~fastsft_lab.data.PackedBatch` (its host-side ``seq_lengths``): no device access."""
        return cls(batch.seq_lengths, batch.shape[1], tuple(batch.pad_lengths))

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
        rows, pads = [], []
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
            pads.append(t - real)
        return cls(tuple(rows), t, tuple(pads))

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
        return {"seq_lengths": self.seq_lengths, "row_tokens": self.row_tokens, "pad_lengths": self.pad_lengths}

    def __setstate__(self, state):
        object.__setattr__(self, "seq_lengths", state["seq_lengths"])
        object.__setattr__(self, "row_tokens", state["row_tokens"])
        object.__setattr__(self, "pad_lengths", state.get("pad_lengths"))
        self.__post_init__()

    def check_shape(self, rows: int, tokens: int) -> None:
        """Raise if this metadata does not describe a (rows, tokens) batch (host ints only: no sync)."""
        if (rows, tokens) != self.shape:
            raise ValueError(f"packed_metadata describes a {self.shape} batch, but the model got ({rows}, {tokens}) "
                             "tokens: build the metadata from the same batch")

    # -- device side (lazy, cached)
    def cached(self, key: tuple, build: Callable[[], Any]) -> Any:
        """The object stored under ``key`` (``key[0]`` names its kind), built by ``build()`` on first use."""
        hit = self._cache.get(key)
        if hit is None:
            hit = build()
            self._cache[key] = hit
            self.builds[key[0]] += 1
        return hit

    def tensors(self, device: torch.device | str) -> DeviceTensors:
        """cu_seqlens, per-token segment ids and position ids on ``device``: one copy, then cached."""
        device = norm_device(device)
        return self.cached(("tensors", device), lambda: self._build_tensors(device))

    def real_tokens_mask(self, device: torch.device | str) -> torch.Tensor:
        """(rows, T) int64: 1 on real tokens, 0 on each row's padding tail (one pinned copy, then cached)."""
        device = norm_device(device)

        def build():
            host = torch.ones(self.shape, dtype=torch.long)
            for r, pad in enumerate(self.pad_lengths):
                if pad:
                    host[r, self.row_tokens - pad:] = 0
            if device.type == "cuda":
                host = host.pin_memory()
            return host.to(device, non_blocking=True)

        return self.cached(("real_tokens", device), build)

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


__all__ = ["PackedMetadata", "DeviceTensors", "normalize_row_lengths", "norm_window", "norm_device"]
