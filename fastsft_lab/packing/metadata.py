"""Packed-sequence metadata: built once per batch from the packer's host-side lengths.

A packed row holds several sequences back to back. Every attention layer needs the same facts about it: where
each sequence starts (``cu_seqlens``), the longest one (``max_seqlen``, a Python int for varlen kernels), and,
depending on the kernel, a dense block-diagonal causal mask, a flex ``BlockMask`` or an xFormers bias.

:class:`PackedMetadata` holds the lengths as tuples of Python ints, so nothing is ever read back from the GPU.
Device tensors are made lazily on first use with one pinned, non-blocking copy per device, and each backend's
object is built once and cached under a key of what changes it (backend, device, dtype, window); the backends
(``fastsft_lab.packing.backends``) say how to build them. The object is read-only (assigning a field raises
``dataclasses.FrozenInstanceError``): editing a batch's tensors in place cannot serve a stale mask (a cache keyed on
a tensor's identity can). It is not a ``frozen=True`` dataclass on purpose: torch.compile (torch 2.11) treats a
frozen dataclass passed into a compiled region as a constant and guards on every field -- the segment count, the
cached device tensors -- so a compiled decoder layer recompiled for every batch; a plain object passed through to
the (compile-disabled) attention gets a type check only.

Off the critical path: :func:`fastsft_lab.packing.prebuild_metadata` (what ``PackedCollator(prebuild=...)`` calls in
a DataLoader worker) builds the host side of everything the layers will need -- cu_seqlens, segment and position
ids, a backend's host tables -- as CPU tensors that pickle to the main process with the batch.
``DataLoader(pin_memory=True)`` pins them (its pin-memory thread calls :meth:`PackedMetadata.pin_memory`), and on
the device the step only queues non-blocking copies (:meth:`PackedMetadata.to`, or the first layer's lookup).
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import FrozenInstanceError, dataclass, field
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


class BuildLog:
    """A debug hook: while open, counts every packed-metadata object built, by path and kind --
    ``log.naive["dense"]`` (the naive path's per-layer rebuilds), ``log.cached["tensors"]`` (built once per batch by
    :class:`PackedMetadata`, then reused). Nothing is counted while no log is open::

        with BuildLog() as log:
            model(**batch).loss.backward()
        log.naive, log.cached
    """

    def __init__(self) -> None:
        self.naive: Counter = Counter()
        self.cached: Counter = Counter()

    def __enter__(self) -> "BuildLog":
        _OPEN_LOGS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _OPEN_LOGS.remove(self)


_OPEN_LOGS: list[BuildLog] = []


def note_build(path: str, kind: str) -> None:
    """Tell every open :class:`BuildLog` that ``path`` ("naive" or "cached") built an object of ``kind``."""
    for log in _OPEN_LOGS:
        (log.naive if path == "naive" else log.cached)[kind] += 1


@dataclass(init=False, eq=False, repr=False)
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

    Prebuilt (host parts made by :func:`~fastsft_lab.packing.prebuild_metadata`, e.g. in a DataLoader worker)::

        meta = prebuild_metadata(PackedMetadata.from_lengths([[3, 5, 2]]), "flex")
        meta = meta.pin_memory()   # what DataLoader(pin_memory=True) does
        meta.to("cuda")            # only non-blocking copies: no host work, no sync; the layers find it all cached
    """

    seq_lengths: tuple[tuple[int, ...], ...]
    row_tokens: int
    pad_lengths: tuple[int, ...] | None = None
    lengths: tuple[int, ...] = field(init=False)      # all segments, rows concatenated
    cu_seqlens: tuple[int, ...] = field(init=False)   # (0, l0, l0+l1, ..., N)
    max_seqlen: int = field(init=False)
    _cache: dict = field(init=False, repr=False)
    _host: dict = field(init=False, repr=False)       # prebuilt host parts: key -> CPU tensor(s) (see put_host)

    def __init__(self, seq_lengths: Sequence[Sequence[int]], row_tokens: int,
                 pad_lengths: Sequence[int] | None = None) -> None:
        object.__setattr__(self, "seq_lengths", seq_lengths)
        object.__setattr__(self, "row_tokens", row_tokens)
        object.__setattr__(self, "pad_lengths", pad_lengths)
        self.__post_init__()

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
        object.__setattr__(self, "_host", {})

    # Read-only without ``frozen=True`` (see the module docstring: a frozen dataclass is a constant to dynamo).
    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"PackedMetadata is read-only: cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"PackedMetadata is read-only: cannot delete field {name!r}")

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
        host = f", prebuilt={sorted(map(str, self._host))}" if self._host else ""
        return (f"PackedMetadata(rows={self.num_rows}, row_tokens={self.row_tokens}, segments={self.num_segments}, "
                f"max_seqlen={self.max_seqlen}, cached={sorted(map(str, self._cache))}{host})")

    def __getstate__(self):
        # Device tensors and backend objects stay where they were built; the prebuilt host parts travel (pickling
        # is for DataLoader workers, whose queues move CPU tensors through shared memory).
        return {"seq_lengths": self.seq_lengths, "row_tokens": self.row_tokens, "pad_lengths": self.pad_lengths,
                "host": dict(self._host)}

    def __setstate__(self, state):
        object.__setattr__(self, "seq_lengths", state["seq_lengths"])
        object.__setattr__(self, "row_tokens", state["row_tokens"])
        object.__setattr__(self, "pad_lengths", state.get("pad_lengths"))
        self.__post_init__()
        self._host.update(state.get("host") or {})

    # -- prebuilt host parts (built off the critical path, e.g. in a DataLoader worker)
    def put_host(self, key: tuple, part) -> None:
        """Store a host part under ``key`` (``key[0]`` names its kind): a CPU tensor or a tuple of them, which
        :meth:`host_part` copies to a device, or an object with ``.to(device)``. Host parts describe this batch's
        lengths only, so they never go stale; the backends' builders look them up before building anything."""
        if not isinstance(key, tuple) or not key:
            raise ValueError(f"a host part's key must be a non-empty tuple, got {key!r}")
        for t in _tensors_of(part):
            if t.device.type != "cpu":
                raise ValueError(f"host part {key!r} holds a tensor on {t.device}; host parts are CPU tensors")
        self._host[key] = part

    @property
    def prebuilt(self) -> tuple:
        """The keys of the host parts prebuilt for this batch (empty: everything is built lazily, in the step)."""
        return tuple(self._host)

    def is_pinned(self) -> bool:
        """True if every prebuilt host tensor is in pinned memory (False when nothing is prebuilt)."""
        tensors = [t for part in self._host.values() for t in _tensors_of(part)]
        return bool(tensors) and all(t.is_pinned() for t in tensors)

    def pin_memory(self, device=None) -> "PackedMetadata":
        """A copy whose prebuilt host tensors are pinned (page-locked), so copies to the GPU are truly asynchronous.

        ``DataLoader(pin_memory=True)`` calls it from its pin-memory thread (``torch.utils.data`` pins any object
        with a ``pin_memory()`` method), the only place pinning is allowed: DataLoader workers may not touch CUDA.
        Host parts that are objects (an xFormers bias) are kept as they are.
        """
        clone = PackedMetadata.__new__(PackedMetadata)
        clone.__setstate__({**self.__getstate__(), "host": {k: _map_tensors(p, lambda t: t if t.is_pinned() else
                                                                            t.pin_memory())
                                                            for k, p in self._host.items()}})
        return clone

    def host_part(self, key: tuple, device: torch.device | str):
        """The prebuilt host part ``key`` on ``device`` (one non-blocking copy per tensor, then cached), or None
        when it was not prebuilt. On the CPU it is the host part itself."""
        part = self._host.get(key)
        if part is None:
            return None
        device = norm_device(device)
        if device.type == "cpu":
            return part
        return self.cached(("host", device) + key, lambda: _part_to(part, device))

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "PackedMetadata":
        """Queue the copies of every prebuilt host part (and the shared tensors) to ``device``; returns ``self``.

        What the step pays with prebuilt, pinned metadata: a few ``cudaMemcpyAsync`` calls, no host-side building
        and no sync; the backends' objects are then assembled from the copies (Python only) by the first layer that
        asks. Without prebuilt parts it builds :meth:`tensors` now instead of in the first layer. Copies are always
        asynchronous: ``non_blocking`` is accepted for the ``Tensor.to`` signature (accelerate's ``send_to_device``
        calls ``.to(device, non_blocking=...)`` on the batch), and a blocking copy would only add a host sync --
        only kernels queued after it on the same stream read the copies, and the pinned sources stay alive with
        this object.
        """
        device = norm_device(device)
        for key in self._host:
            self.host_part(key, device)
        self.tensors(device)
        return self

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
            note_build("cached", key[0])
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
        prebuilt = self.host_part(HOST_TENSORS, device)
        if prebuilt is not None:
            return DeviceTensors(*prebuilt)
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

    def build_host_tensors(self) -> None:
        """Prebuild :meth:`tensors`' cu_seqlens, seq_ids and position_ids on the host (the same values: the same
        code, run on the CPU), so that on a device they are only copied."""
        if HOST_TENSORS not in self._host:
            t = self._build_tensors(torch.device("cpu"))
            self.put_host(HOST_TENSORS, (t.cu_seqlens, t.seq_ids, t.position_ids.contiguous()))


HOST_TENSORS = ("tensors",)   # the host-part key of the shared tensors (cu_seqlens, seq_ids, position_ids)


def _tensors_of(part) -> list[torch.Tensor]:
    if isinstance(part, torch.Tensor):
        return [part]
    if isinstance(part, tuple):
        return [t for p in part for t in _tensors_of(p)]
    return []


def _map_tensors(part, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``fn`` on every tensor of a host part (a tensor, a tuple of parts, or an object with ``.to``)."""
    if isinstance(part, torch.Tensor):
        return fn(part)
    if isinstance(part, tuple):
        return tuple(_map_tensors(p, fn) for p in part)
    return part


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and not t.is_pinned():
        t = t.pin_memory()   # not pinned by a DataLoader: pin here, as the lazy path does, so the copy stays async
    return t.to(device, non_blocking=True)


def _part_to(part, device: torch.device):
    """A host part on ``device``: its tensors copied (non-blocking), an object moved by its own ``.to``."""
    if isinstance(part, (torch.Tensor, tuple)):
        return _map_tensors(part, lambda t: _to_device(t, device))
    return part.to(device)


__all__ = ["PackedMetadata", "DeviceTensors", "normalize_row_lengths", "norm_window", "norm_device", "HOST_TENSORS",
           "BuildLog", "note_build"]
