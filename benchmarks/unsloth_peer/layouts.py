"""How the exported packed batches are fed to Unsloth: the layouts, their token counts and the tensors.

* ``packed`` (Qwen3's only layout; GPT-OSS with ``--layout packed``): the export's rows. Qwen3 gets them laid end
  to end as one ``(1, T)`` row with ``packed_seq_lengths`` (Unsloth's own packed path); GPT-OSS gets the
  ``(rows, 4096)`` ``input_ids``/``labels``/``position_ids`` without ``packed_seq_lengths`` (its segments then
  attend across a row: see ``probes.isolation_probe``).
* ``padded`` (GPT-OSS's default, what an Unsloth user trains: padding-free packing is blocklisted for gpt_oss):
  every real segment its own row, in the packed order, right-padded to the step's longest sequence rounded up to
  ``--pad-to-multiple-of`` (128), labels the segment's own packed labels (the same (position, target) pairs:
  ``labelled_pairs_packed`` == ``labelled_pairs_padded``, checked per batch) and -100 on pads.

Plain lists except ``feeds`` (which gets torch passed in): both environments import this module.
"""

from __future__ import annotations

from .common import IGNORE_INDEX, LAYOUTS, PAD_TOKEN_ID


def default_layout(family: str) -> str:
    """padded for GPT-OSS (Unsloth blocklists padding-free packing for it), packed for Qwen3."""
    return "padded" if family == "gpt_oss" else "packed"


def check_layout(family: str, layout: str | None) -> str:
    """The layout a run uses (None: the family's default); raises on one the peer does not run."""
    layout = default_layout(family) if layout is None else layout
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    if family != "gpt_oss" and layout == "padded":
        raise ValueError("layout 'padded' is for GPT-OSS only: Unsloth packs Qwen3 itself (packed_seq_lengths, "
                         "per-segment attention), which is what the Qwen3 peer measures")
    return layout


def real_segments(seq_lengths, pad_length: int) -> list[tuple[int, int]]:
    """(start, end) of each real segment of one row (the padding tail left out)."""
    spans, start = [], 0
    for n in seq_lengths:
        spans.append((start, start + n))
        start += n
    return spans[:-1] if pad_length else spans


def padded_layout(batch: dict, pad_token_id: int = PAD_TOKEN_ID, multiple: int = 1) -> dict:
    """One packed batch (batches.json) as an Unsloth GPT-OSS user feeds it: every real segment its own row, in the
    packed order, right-padded with ``pad_token_id`` to the step's longest sequence (rounded up to ``multiple``, as
    TRL's collator with Unsloth's ``pad_to_multiple_of``), labels the segment's own slice of the packed labels
    (its first token is already -100 there) and -100 on the pads, ``attention_mask`` 1 on real tokens, 0 on pads.
    The model's default position_ids (arange over the row: 0..n-1 on the real tokens) are what RoPE needs, so none
    are built. Plain lists: both environments use it. Raises if a segment's first label is not -100 or a padding
    tail carries a label (the labelled (position, target) pairs would then differ from the packed batch's)."""
    if multiple < 1:
        raise ValueError(f"pad multiple must be >= 1, got {multiple}")
    ids, labels, lengths, origin = [], [], [], []
    for r, (lens, pad) in enumerate(zip(batch["seq_lengths"], batch["pad_lengths"])):
        spans = real_segments(lens, pad)
        end = spans[-1][1] if spans else 0
        if any(x != IGNORE_INDEX for x in batch["labels"][r][end:]):
            raise ValueError(f"row {r}: the padding tail carries labels")
        for s, e in spans:
            seg_labels = batch["labels"][r][s:e]
            if seg_labels[0] != IGNORE_INDEX:
                raise ValueError(f"row {r}: the segment at {s} has label {seg_labels[0]} on its first token: in the "
                                 "packed row the previous sequence's last token is scored on it, alone it is not")
            ids.append(batch["input_ids"][r][s:e])
            labels.append(seg_labels)
            lengths.append(e - s)
            origin.append([r, s])
    if not lengths:
        raise ValueError("the batch holds no real segment")
    longest = max(lengths)
    width = -(-longest // multiple) * multiple
    pad = lambda row, value: list(row) + [value] * (width - len(row))  # noqa: E731
    return {"input_ids": [pad(x, pad_token_id) for x in ids], "labels": [pad(x, IGNORE_INDEX) for x in labels],
            "attention_mask": [[1] * n + [0] * (width - n) for n in lengths], "lengths": lengths, "width": width,
            "longest": longest, "origin": origin, "real_tokens": sum(lengths), "padded_tokens": width * len(lengths)}


def labelled_pairs_packed(batch: dict) -> list[tuple[int, int, int]]:
    """(sequence, position in it, target) of every labelled prediction of a packed batch under the HF causal-LM
    shift over each whole row (position t predicts labels[t + 1]); sequences numbered in row order. A pair whose
    position and target lie in different segments is returned with position -1 (it must not exist)."""
    out, seq = [], 0
    for r, (lens, pad) in enumerate(zip(batch["seq_lengths"], batch["pad_lengths"])):
        spans = real_segments(lens, pad)
        row_labels = batch["labels"][r]
        for t in range(len(row_labels) - 1):
            target = row_labels[t + 1]
            if target == IGNORE_INDEX:
                continue
            i = next((i for i, (s, e) in enumerate(spans) if s <= t + 1 < e), None)
            if i is None or not spans[i][0] <= t < spans[i][1]:
                out.append((seq + (i if i is not None else len(spans)), -1, target))
                continue
            out.append((seq + i, t - spans[i][0], target))
        seq += len(spans)
    return sorted(out)


def labelled_pairs_padded(padded: dict) -> list[tuple[int, int, int]]:
    """The same pairs for a padded layout (one sequence per row, the shift within each row)."""
    return sorted((r, t, row[t + 1]) for r, row in enumerate(padded["labels"]) for t in range(len(row) - 1)
                  if row[t + 1] != IGNORE_INDEX)


def layout_stats(raw: list[dict], layout: str, multiple: int) -> dict:
    """Tokens per step for a layout: real (the sequences), fed (what the model computes on: rows x row tokens for
    packed, rows x padded width for padded), per exported batch and their mean."""
    real = [sum(n for lens, pad in zip(b["seq_lengths"], b["pad_lengths"]) for n in (lens[:-1] if pad else lens))
            for b in raw]
    if layout == "padded":
        shapes = [(len(p["lengths"]), p["width"]) for p in (padded_layout(b, multiple=multiple) for b in raw)]
    else:
        shapes = [(len(b["input_ids"]), len(b["input_ids"][0])) for b in raw]
    fed = [r * w for r, w in shapes]
    return {"real_tokens_per_step": round(sum(real) / len(real), 1),
            "padded_tokens_per_step": round(sum(fed) / len(fed), 1),
            "padding_fraction": round(1 - sum(real) / sum(fed), 4),
            "real_tokens_per_batch": real, "padded_tokens_per_batch": fed,
            "shapes_per_batch": [list(x) for x in shapes]}


def warmup_covering(shapes: list, warmup: int, steps: int) -> int:
    """The fewest warmup steps >= ``warmup`` after which every batch shape a measured step meets (batch
    ``s % len(shapes)`` at step ``s``) has already run once: Unsloth's compiled GPT-OSS pieces keep the batch
    dimension static (mark_static) and build a BlockMask per length, so a new padded shape recompiles."""
    n = len(shapes)
    for w in range(warmup, warmup + n + 1):
        seen = {shapes[s % n] for s in range(w)}
        if all(shapes[s % n] in seen for s in range(w, w + steps)):
            return w
    return warmup + n


def feeds(raw: list[dict], layouts: list[dict], family: str, lengths_device: str, device, torch) -> list[dict]:
    """The model's keyword arguments per exported batch. Padded layout (``layouts``, one per batch): what TRL's
    collator gives an Unsloth GPT-OSS user (right padding, attention_mask, labels). Otherwise GPT-OSS gets its
    ``(rows, row_tokens)`` rows without packed_seq_lengths, and Qwen3 its rows laid end to end as one ``(1, T)`` row
    with ``packed_seq_lengths`` (int32, pad tails included; on the host as Unsloth's collator builds it, or on
    ``device`` with ``lengths_device`` "cuda", as HF Trainer's ``_prepare_inputs`` moves it)."""
    out = []
    gpt_oss = family == "gpt_oss"
    for p in layouts:
        out.append({key: torch.tensor(p[key], dtype=torch.long, device=device)
                    for key in ("input_ids", "attention_mask", "labels")} | {"use_cache": False})
    for b in raw if gpt_oss and not layouts else []:
        out.append({key: torch.tensor(b[key], dtype=torch.long, device=device)
                    for key in ("input_ids", "labels", "position_ids")} | {"use_cache": False})
    for b in [] if gpt_oss else raw:
        flat = lambda key: torch.tensor([x for row in b[key] for x in row], dtype=torch.long)[None]  # noqa: E731
        lengths = torch.tensor([n for row in b["seq_lengths"] for n in row], dtype=torch.int32)
        out.append({"input_ids": flat("input_ids").to(device), "labels": flat("labels").to(device),
                    "position_ids": flat("position_ids").to(device),
                    "packed_seq_lengths": lengths.to(device) if lengths_device == "cuda" else lengths,
                    "use_cache": False})
    return out
