"""The statistics of a result, from the harness's own implementation (no copy to keep equal).

``percentiles`` is ``fastsft_lab.profiling.percentiles`` itself: it lives in ``fastsft_lab._util``, which imports
nothing but the standard library, so Unsloth's environment reads it without importing torch or transformers before
unsloth (``fastsft_lab/__init__.py`` loads its submodules lazily)."""

from __future__ import annotations

from fastsft_lab._util import percentiles, quantile


def length_stats(seq_lengths, pad_lengths, row_tokens: int) -> dict:
    """The harness's ``PackedBatch.length_stats`` from plain lists (segments without the padding tails)."""
    real = [n for row, pad in zip(seq_lengths, pad_lengths) for n in (row[:-1] if pad else row)]
    rows = len(seq_lengths)
    out = {"rows": rows, "row_tokens": row_tokens, "fill": (rows * row_tokens - sum(pad_lengths)) / (rows * row_tokens)}
    if not real:
        return {"count": 0, **out}
    s = sorted(real)
    return {"count": len(s), "min": s[0], "median": round(quantile(s, 0.5), 1), "mean": round(sum(s) / len(s), 1),
            "p90": round(quantile(s, 0.9), 1), "max": s[-1], **out}


__all__ = ["percentiles", "length_stats"]
