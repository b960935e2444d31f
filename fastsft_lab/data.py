"""Packed SFT batches: a best-fit-decreasing packer, a synthetic instruction corpus, and a ``datasets`` adapter.

A packed row holds several sequences back to back (plus, when the row is not full, a padding tail that is its
own segment with no loss). Each batch keeps the sequence lengths as *host-side Python integers*, known at
collate time: attention metadata can then be built without ever asking the GPU (see ``fastsft_lab.packing``).

Loss equivalence: transformers shifts labels by one across the whole row, so the last token of sequence A would
be scored against the first token of sequence B. The packer sets the label of every sequence's first token to
-100, which makes the packed loss the sum of the per-sequence losses.
"""

from __future__ import annotations

import bisect
import math
import random
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from ._util import quantile

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Example:
    """One tokenized training example: ``labels`` is -100 where no loss is taken (the prompt)."""

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]

    def __post_init__(self):
        if len(self.input_ids) != len(self.labels):
            raise ValueError(f"input_ids ({len(self.input_ids)}) and labels ({len(self.labels)}) differ in length")

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class PackedBatch:
    """A batch of packed rows, shape (B, T).

    ``seq_lengths[b]`` lists the segment lengths of row ``b`` in order, padding tail included (as its own
    segment); they sum to T. ``pad_lengths[b]`` is the length of that tail (0 when the row is full).
    """

    input_ids: torch.Tensor      # (B, T) int64
    labels: torch.Tensor         # (B, T) int64, -100 where no loss
    position_ids: torch.Tensor   # (B, T) int64, restarting at 0 in every segment
    seq_lengths: tuple[tuple[int, ...], ...]
    pad_lengths: tuple[int, ...]
    example_ids: tuple[tuple[int, ...], ...] = ()   # which corpus example sits in each non-padding segment

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)  # type: ignore[return-value]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_real_tokens(self) -> int:
        return self.num_tokens - sum(self.pad_lengths)

    @property
    def num_sequences(self) -> int:
        return sum(len(r) for r in self.seq_lengths) - sum(1 for p in self.pad_lengths if p)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> "PackedBatch":
        def move(t: torch.Tensor) -> torch.Tensor:
            if torch.device(device).type == "cuda" and t.device.type == "cpu":
                t = t.pin_memory()
            return t.to(device, non_blocking=non_blocking)

        return PackedBatch(move(self.input_ids), move(self.labels), move(self.position_ids),
                           self.seq_lengths, self.pad_lengths, self.example_ids)

    def model_inputs(self) -> dict:
        """What a stock transformers model takes: no attention mask, restarting ``position_ids``."""
        return {"input_ids": self.input_ids, "labels": self.labels, "position_ids": self.position_ids}

    def length_stats(self) -> dict:
        real = [length for row, pad in zip(self.seq_lengths, self.pad_lengths)
                for length in (row[:-1] if pad else row)]
        return _stats(real) | {"rows": self.shape[0], "row_tokens": self.shape[1],
                               "fill": self.num_real_tokens / self.num_tokens}


def _stats(lengths: Sequence[int]) -> dict:
    if not lengths:
        return {"count": 0}
    s = sorted(lengths)
    return {"count": len(s), "min": s[0], "median": round(quantile(s, 0.5), 1), "mean": round(sum(s) / len(s), 1),
            "p90": round(quantile(s, 0.9), 1), "max": s[-1]}


def validate_lengths(lengths: Sequence[int], max_tokens: int) -> None:
    """Raise a clear ``ValueError`` for lengths a packed row cannot hold."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens}")
    for i, length in enumerate(lengths):
        if not isinstance(length, int) or isinstance(length, bool):
            raise ValueError(f"sequence {i} has a non-integer length {length!r}")
        if length <= 0:
            raise ValueError(f"sequence {i} is empty (length {length}); drop empty examples before packing")
        if length > max_tokens:
            raise ValueError(
                f"sequence {i} has {length} tokens, more than a packed row holds (max_tokens={max_tokens}); "
                "truncate it or raise max_tokens"
            )


def best_fit_decreasing(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Pack items into bins of ``max_tokens`` (best fit, longest first). Returns lists of item indices."""
    validate_lengths(lengths, max_tokens)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (remaining capacity, bin index)
    for i in order:
        n = lengths[i]
        k = bisect.bisect_left(free, (n, -1))
        if k < len(free):
            remaining, b = free.pop(k)
            bins[b].append(i)
            if remaining - n > 0:
                bisect.insort(free, (remaining - n, b))
        else:
            bins.append([i])
            if max_tokens - n > 0:
                bisect.insort(free, (max_tokens - n, len(bins) - 1))
    return bins


def collate_rows(examples: Sequence[Example], rows: Sequence[Sequence[int]], max_tokens: int,
                 pad_token_id: int = 0) -> PackedBatch:
    """Lay out the given rows (lists of example indices) into one (len(rows), max_tokens) batch."""
    ids, labels, pos, seq_lengths, pads, ex_ids = [], [], [], [], [], []
    for row in rows:
        r_ids: list[int] = []
        r_lab: list[int] = []
        r_pos: list[int] = []
        lens: list[int] = []
        for i in row:
            ex = examples[i]
            n = len(ex)
            r_ids.extend(ex.input_ids)
            # The first token is never a target when the sequence runs alone; in a packed row it would be the
            # target of the previous sequence's last token, so it takes no loss.
            r_lab.append(IGNORE_INDEX)
            r_lab.extend(ex.labels[1:])
            r_pos.extend(range(n))
            lens.append(n)
        used = sum(lens)
        if used > max_tokens:
            raise ValueError(f"row holds {used} tokens, more than max_tokens={max_tokens}")
        pad = max_tokens - used
        if pad:
            r_ids.extend([pad_token_id] * pad)
            r_lab.extend([IGNORE_INDEX] * pad)
            r_pos.extend(range(pad))  # the tail is its own segment
            lens.append(pad)
        ids.append(r_ids)
        labels.append(r_lab)
        pos.append(r_pos)
        seq_lengths.append(tuple(lens))
        pads.append(pad)
        ex_ids.append(tuple(row))
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.long),
        labels=torch.tensor(labels, dtype=torch.long),
        position_ids=torch.tensor(pos, dtype=torch.long),
        seq_lengths=tuple(seq_lengths),
        pad_lengths=tuple(pads),
        example_ids=tuple(ex_ids),
    )


def pack_examples(examples: Sequence[Example], max_tokens: int, rows_per_batch: int = 1,
                  pad_token_id: int = 0, drop_last: bool = False) -> list[PackedBatch]:
    """Pack examples into rows of ``max_tokens`` (best-fit decreasing), then rows into batches."""
    if rows_per_batch < 1:
        raise ValueError(f"rows_per_batch must be >= 1, got {rows_per_batch}")
    lengths = [len(e) for e in examples]
    bins = best_fit_decreasing(lengths, max_tokens)
    # Keep a deterministic, well-mixed order of rows (fullest rows first would bias the first batches).
    rng = random.Random(len(bins))
    rng.shuffle(bins)
    batches = []
    for start in range(0, len(bins), rows_per_batch):
        rows = bins[start:start + rows_per_batch]
        if len(rows) < rows_per_batch and drop_last:
            break
        batches.append(collate_rows(examples, rows, max_tokens, pad_token_id))
    return batches


# --- A synthetic instruction-tuning corpus ---------------------------------------------------------------------
#
# Length model (per example = prompt + response), both log-normal and clipped to [min_len, max_len]:
#   "realistic": prompt median 96 (sigma 1.0), response median 224 (sigma 0.9): total median ~360 tokens,
#                mean ~520, p90 ~1.1k -- the shape of open chat/instruction SFT sets (short prompts, longer
#                answers, a long tail), not a fit to any one of them (no dataset hub is reachable here).
#   "short":     prompt median 24, response median 48 (many short examples: metadata-heavy, many segments)
#   "long":      prompt median 512, response median 1024 (few long examples: attention-heavy)
LENGTH_MIXES: dict[str, tuple[float, float, float, float]] = {
    # name: (prompt median, prompt sigma, response median, response sigma)
    "realistic": (96.0, 1.0, 224.0, 0.9),
    "short": (24.0, 0.7, 48.0, 0.7),
    "long": (512.0, 0.6, 1024.0, 0.6),
}


def sample_lengths(n: int, mix: str = "realistic", *, max_len: int = 4096, min_len: int = 4,
                   seed: int = 0) -> list[tuple[int, int]]:
    """(prompt, response) token counts for ``n`` synthetic examples, deterministic in ``seed``."""
    if mix not in LENGTH_MIXES:
        raise ValueError(f"unknown length mix {mix!r}; known: {', '.join(LENGTH_MIXES)}")
    pm, ps, rm, rs = LENGTH_MIXES[mix]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = max(1, int(round(rng.lognormvariate(math.log(pm), ps))))
        r = max(1, int(round(rng.lognormvariate(math.log(rm), rs))))
        total = min(max(p + r, min_len), max_len)
        p = min(p, total - 1) if total > 1 else 0
        out.append((p, total - p))
    return out


def synthetic_corpus(n: int, *, vocab_size: int, mix: str = "realistic", max_len: int = 4096,
                     seed: int = 0, reserved_ids: int = 4) -> list[Example]:
    """``n`` deterministic instruction-tuning examples: random token ids, labels -100 on the prompt."""
    if vocab_size <= reserved_ids + 1:
        raise ValueError(f"vocab_size={vocab_size} leaves no room for ordinary tokens")
    rng = random.Random(seed + 1)
    examples = []
    for p, r in sample_lengths(n, mix, max_len=max_len, seed=seed):
        ids = tuple(rng.randrange(reserved_ids, vocab_size) for _ in range(p + r))
        labels = (IGNORE_INDEX,) * p + ids[p:]
        examples.append(Example(ids, labels))
    return examples


def benchmark_batches(*, tokens_per_step: int, row_tokens: int | None = None, steps: int, vocab_size: int,
                      mix: str = "realistic", seed: int = 0, pad_token_id: int = 0) -> list[PackedBatch]:
    """``steps`` packed batches of ``tokens_per_step`` tokens each (rows of ``row_tokens``, default one row)."""
    row_tokens = row_tokens or tokens_per_step
    if tokens_per_step % row_tokens:
        raise ValueError(f"tokens_per_step={tokens_per_step} is not a multiple of row_tokens={row_tokens}")
    rows_per_batch = tokens_per_step // row_tokens
    need_rows = rows_per_batch * steps
    mean_len = sum(p + r for p, r in sample_lengths(2000, mix, max_len=row_tokens, seed=seed)) / 2000
    n = int(need_rows * row_tokens / mean_len * 1.15) + 8
    while True:
        corpus = synthetic_corpus(n, vocab_size=vocab_size, mix=mix, max_len=row_tokens, seed=seed)
        batches = pack_examples(corpus, row_tokens, rows_per_batch, pad_token_id=pad_token_id, drop_last=True)
        if len(batches) >= steps:
            # The last packed rows are the emptiest (best-fit leftovers): keep the fullest batches.
            batches.sort(key=lambda b: -b.num_real_tokens)
            return batches[:steps]
        n = int(n * 1.3) + 8


# --- A user's `datasets` dataset through their tokenizer ----------------------------------------------------------
def tokenize_example(record: dict, tokenizer, *, text_field: str = "text", prompt_field: str = "prompt",
                     completion_field: str = "completion", add_eos: bool = True) -> Example:
    """One record -> Example. ``prompt``/``completion`` records take loss on the completion only;
    ``text`` records take loss on every token; ``messages`` records use the tokenizer's chat template."""
    eos = [tokenizer.eos_token_id] if add_eos and tokenizer.eos_token_id is not None else []
    if prompt_field in record and completion_field in record:
        p = tokenizer(record[prompt_field], add_special_tokens=False)["input_ids"]
        c = tokenizer(record[completion_field], add_special_tokens=False)["input_ids"] + eos
        return Example(tuple(p + c), (IGNORE_INDEX,) * len(p) + tuple(c))
    if "messages" in record:
        msgs = record["messages"]
        ids = tokenizer.apply_chat_template(msgs, tokenize=True)
        prefix = tokenizer.apply_chat_template(msgs[:-1], tokenize=True, add_generation_prompt=True)
        n_prompt = len(prefix) if ids[:len(prefix)] == prefix else 0
        return Example(tuple(ids), (IGNORE_INDEX,) * n_prompt + tuple(ids[n_prompt:]))
    if text_field in record:
        ids = tokenizer(record[text_field], add_special_tokens=False)["input_ids"] + eos
        return Example(tuple(ids), tuple(ids))
    raise ValueError(
        f"record has none of the supported layouts ({prompt_field!r}+{completion_field!r}, 'messages', "
        f"{text_field!r}); its keys are {sorted(record)}"
    )


def pack_dataset(dataset: Iterable[dict], tokenizer, max_tokens: int, rows_per_batch: int = 1, *,
                 truncate: bool = False, drop_empty: bool = True, **field_names) -> list[PackedBatch]:
    """Tokenize a ``datasets`` dataset (or any iterable of dicts) and pack it.

    Over-long examples raise (or are truncated to ``max_tokens`` with ``truncate=True``); empty ones are
    dropped unless ``drop_empty=False``, in which case they raise.
    """
    examples = []
    for record in dataset:
        ex = tokenize_example(record, tokenizer, **field_names)
        if len(ex) == 0 and drop_empty:
            continue
        if truncate and len(ex) > max_tokens:
            ex = Example(ex.input_ids[:max_tokens], ex.labels[:max_tokens])
        examples.append(ex)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return pack_examples(examples, max_tokens, rows_per_batch, pad_token_id=pad)


@dataclass
class SequenceRun:
    """One sequence on its own, for packed-vs-alone checks: (1, n) tensors."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    row: int
    start: int
    length: int


def unpack(batch: PackedBatch) -> list[SequenceRun]:
    """The non-padding segments of a packed batch, each as its own (1, n) sequence."""
    out = []
    for b, (row, pad) in enumerate(zip(batch.seq_lengths, batch.pad_lengths)):
        start = 0
        segments = row[:-1] if pad else row
        for n in segments:
            labels = batch.labels[b, start:start + n].clone()
            out.append(SequenceRun(batch.input_ids[b:b + 1, start:start + n], labels[None], b, start, n))
            start += n
    return out


__all__ = [
    "IGNORE_INDEX", "Example", "PackedBatch", "validate_lengths", "best_fit_decreasing",
    "collate_rows", "pack_examples", "LENGTH_MIXES", "sample_lengths", "synthetic_corpus", "benchmark_batches",
    "tokenize_example", "pack_dataset", "SequenceRun", "unpack",
]
