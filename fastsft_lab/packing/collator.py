"""A collator for TRL's ``SFTTrainer`` (or any training loop): packs examples and attaches their metadata.

With ``prebuild=``, the metadata's host side (cu_seqlens, segment and position ids, a backend's tables) is built
here, in the DataLoader worker processes, instead of inside the training step.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..data import IGNORE_INDEX, Example, PackedBatch, best_fit_decreasing, collate_rows, validate_lengths
from .metadata import PackedMetadata, norm_window
from .registry import prebuild_backends, prebuild_metadata


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
        prebuild: backend name(s) (``"flex"``, ``("sdpa", "flex")``...) whose host-side metadata to build here, in
            the DataLoader worker: the shared cu_seqlens / seq_ids / position_ids and the backend's own host part
            (flex: every BlockMask table; xformers: its bias). None (default): everything is built lazily in the
            step, by the first layer. Costs worker CPU time and a little pinned memory per batch (flex at 16k tokens:
            ~0.5 MB); saves the step that host work (flex: building its block tables). Pair it with
            ``DataLoader(num_workers=N, pin_memory=True)`` so the step's copies are asynchronous.
        windows: the model's attention windows to prebuild for (None: full attention). GPT-OSS alternates
            ``(None, config.sliding_window)``. A window left out is built in the step, correctly, as without
            prebuilding.

    Takes ``{"input_ids": [...]}`` examples, with optional ``"labels"`` (-100 = no loss), ``"completion_mask"``,
    and TRL's ``"seq_lengths"`` (an example that is already several packed sequences). Returns ``input_ids``,
    ``labels``, ``position_ids`` (B, T) and ``packed_metadata``: every sequence's first label is -100, so the
    packed loss equals the per-sequence one. ``Trainer._prepare_inputs`` moves the tensors and passes the
    metadata through untouched; it copies itself to the model's device on first use (or when accelerate's
    ``send_to_device`` calls its ``.to(device, non_blocking=...)``).
    """

    def __init__(self, max_tokens: int | None = None, pad_token_id: int = 0, *,
                 pad_to_multiple_of: int | None = None, prebuild: str | Sequence[str] | None = None,
                 windows: Sequence[int | None] = (None,)):
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive int or None, got {max_tokens!r}")
        if pad_to_multiple_of is not None and (isinstance(pad_to_multiple_of, bool)
                                               or not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1):
            raise ValueError(f"pad_to_multiple_of must be a positive int or None, got {pad_to_multiple_of!r}")
        self.max_tokens = max_tokens
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of
        self.prebuild = () if prebuild is None else prebuild_backends(prebuild)
        if isinstance(windows, (int, str)) or windows is None:
            raise ValueError(f"windows must be a sequence of window sizes or None, e.g. (None, 128); got {windows!r}")
        self.windows = tuple(windows)
        for w in self.windows:
            try:
                norm_window(w, 1 << 30)
            except (TypeError, ValueError):
                raise ValueError(f"windows must hold positive ints or None (full attention), got {windows!r}") \
                    from None

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
        return packed_inputs(self.pack(features), prebuild=self.prebuild, windows=self.windows)


def packed_inputs(batch: PackedBatch, *, prebuild: str | Sequence[str] | None = None,
                  windows: Sequence[int | None] = (None,)) -> dict:
    """A packer batch as model kwargs for the cached path: stock inputs plus its ``packed_metadata``, whose host
    side is prebuilt for the backends ``prebuild`` names (see :class:`PackedCollator`)."""
    meta = PackedMetadata.from_batch(batch)
    if prebuild:
        prebuild_metadata(meta, prebuild, windows=windows)
    return {**batch.model_inputs(), "packed_metadata": meta}


__all__ = ["PackedCollator", "packed_inputs"]
