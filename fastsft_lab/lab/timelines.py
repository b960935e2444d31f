"""Copy/compute timelines of offloaded checkpointing: overlap metrics of measured intervals, and a schedule model.

An *event* is a dict ``{kind, lane, layer, seq, start_ms, end_ms}``:

* ``kind``: ``fwd`` / ``bwd`` (a layer's forward, or its recompute + backward), ``d2h`` (offload copy),
  ``h2d`` (reload copy), ``other`` (work outside the layers, in the model only);
* ``lane``: the stream it ran on, ``compute`` or ``copy``.

Measured events come from :meth:`fastsft_lab.offload.OffloadManager.tracing` (CUDA events on a GPU: real stream
timestamps; ``perf_counter`` on a CPU, where everything is synchronous and nothing can overlap).
:func:`simulate_schedule` produces the same shape from the dependency rules the offload code issues, for given
copy and compute durations: a *model*, labelled as such wherever it is drawn.
"""

from __future__ import annotations

from typing import Iterable, Sequence

KIND_COLORS = {"fwd": "#4C72B0", "bwd": "#55A868", "d2h": "#DD8452", "h2d": "#C44E52", "other": "#9A9A9A"}
KIND_LABELS = {"fwd": "layer forward", "bwd": "layer recompute + backward", "d2h": "offload copy (device->host)",
               "h2d": "reload copy (host->device)", "other": "outside the layers"}


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _overlap(s: float, e: float, union: Sequence[tuple[float, float]]) -> float:
    total = 0.0
    for us, ue in union:
        if ue <= s:
            continue
        if us >= e:
            break
        total += min(e, ue) - max(s, us)
    return total


def copy_overlap(events: Sequence[dict]) -> dict:
    """How much copy time ran while the compute stream was busy with a layer (i.e. was hidden).

    Method: the union of the ``fwd``/``bwd`` intervals is the compute stream's busy time; each copy's hidden part
    is its intersection with that union. ``reload_stall_ms`` adds, for each layer backward, the time the compute
    stream sat idle between the previous layer's end and this layer's start while this layer's reload was still
    running (what a reload that is not hidden costs). Copies that overlap only work outside the traced layers
    (the loss, the LM head) count as exposed: the share is a lower bound.
    """
    compute = [(e["start_ms"], e["end_ms"]) for e in events if e["kind"] in ("fwd", "bwd", "other")]
    busy = _union(compute)
    out: dict = {}
    for kind in ("d2h", "h2d"):
        copies = [e for e in events if e["kind"] == kind]
        total = sum(e["end_ms"] - e["start_ms"] for e in copies)
        hidden = sum(_overlap(e["start_ms"], e["end_ms"], busy) for e in copies if e["lane"] == "copy")
        out[f"{kind}_ms"] = round(total, 4)
        out[f"{kind}_hidden_ms"] = round(hidden, 4)
        out[f"{kind}_count"] = len(copies)
    for kind in ("fwd", "bwd"):
        out[f"{kind}_ms"] = round(sum(e["end_ms"] - e["start_ms"] for e in events if e["kind"] == kind), 4)
    out["copy_ms"] = round(out["d2h_ms"] + out["h2d_ms"], 4)
    out["hidden_ms"] = round(out["d2h_hidden_ms"] + out["h2d_hidden_ms"], 4)
    out["hidden_share"] = round(out["hidden_ms"] / out["copy_ms"], 4) if out["copy_ms"] > 0 else None
    out["h2d_hidden_share"] = round(out["h2d_hidden_ms"] / out["h2d_ms"], 4) if out["h2d_ms"] > 0 else None
    out["d2h_hidden_share"] = round(out["d2h_hidden_ms"] / out["d2h_ms"], 4) if out["d2h_ms"] > 0 else None
    # compute-stream idle time spent waiting on reloads
    h2d_end = {e["seq"]: e["end_ms"] for e in events if e["kind"] == "h2d"}
    stall, prev_end = 0.0, None
    for e in sorted((e for e in events if e["lane"] == "compute"), key=lambda e: e["start_ms"]):
        if e["kind"] == "bwd" and prev_end is not None and e["seq"] in h2d_end:
            stall += max(0.0, min(h2d_end[e["seq"]], e["start_ms"]) - prev_end)
        prev_end = e["end_ms"] if prev_end is None else max(prev_end, e["end_ms"])
    out["reload_stall_ms"] = round(stall, 4)
    return out


def simulate_schedule(num_layers: int, *, fwd_ms: float, bwd_ms: float, copy_ms: float, buffers: int,
                      serial_forward: bool = False, head_ms: float = 0.0) -> list[dict]:
    """The timeline the offload code's stream dependencies produce for given durations (a model, not a run).

    Rules (as issued by :class:`fastsft_lab.offload.OffloadManager`): the offload copy of layer k starts with
    layer k's forward, on the copy stream (or before it on the compute stream when ``serial_forward``); the
    reload of layer k waits for its staging slot (slot ``k % buffers``) to be freed by the end of the backward of
    the last layer that used it, and for the copy stream; layer k's backward waits for its reload. The CPU is
    assumed to issue work ahead of the GPU, so prefetch and a reactive reload give the same schedule here.
    """
    if buffers not in (1, 2):
        raise ValueError(f"buffers must be 1 or 2, got {buffers}")
    ev: list[dict] = []
    t = 0.0
    copy_free = 0.0
    d2h_end: dict[int, float] = {}
    for k in range(num_layers):
        if serial_forward:
            ev.append(dict(kind="d2h", lane="compute", layer=k, seq=k, start_ms=t, end_ms=t + copy_ms))
            d2h_end[k] = t + copy_ms
            t += copy_ms
            ev.append(dict(kind="fwd", lane="compute", layer=k, seq=k, start_ms=t, end_ms=t + fwd_ms))
        else:
            ev.append(dict(kind="fwd", lane="compute", layer=k, seq=k, start_ms=t, end_ms=t + fwd_ms))
            s = max(copy_free, t)
            ev.append(dict(kind="d2h", lane="copy", layer=k, seq=k, start_ms=s, end_ms=s + copy_ms))
            copy_free = d2h_end[k] = s + copy_ms
        t += fwd_ms
    head_start = t
    if head_ms > 0:
        ev.append(dict(kind="other", lane="compute", layer=-1, seq=-1, start_ms=t, end_ms=t + head_ms))
        t += head_ms
    slot_free = {0: head_start, 1: head_start}
    for k in range(num_layers - 1, -1, -1):
        slot = k % buffers
        s = max(copy_free, slot_free[slot], d2h_end[k], head_start)
        ev.append(dict(kind="h2d", lane="copy", layer=k, seq=k, start_ms=s, end_ms=s + copy_ms))
        copy_free = s + copy_ms
        b = max(t, copy_free)
        ev.append(dict(kind="bwd", lane="compute", layer=k, seq=k, start_ms=b, end_ms=b + bwd_ms))
        t = slot_free[slot] = b + bwd_ms
    for e in ev:
        e["start_ms"] = round(e["start_ms"], 4)
        e["end_ms"] = round(e["end_ms"], 4)
    return ev


def span_ms(events: Sequence[dict]) -> float:
    """Time from the first start to the last end."""
    if not events:
        return 0.0
    return max(e["end_ms"] for e in events) - min(e["start_ms"] for e in events)


def per_layer_means(events: Sequence[dict], kinds: Sequence[str] = ("fwd", "bwd", "h2d", "d2h")) -> dict[str, float]:
    """Mean duration (ms) per event of each kind in ``kinds`` (a layer's forward, its recompute + backward, a reload,
    an offload copy): the per-layer durations :func:`simulate_schedule` takes. A kind with no event is left out."""
    out = {}
    for kind in kinds:
        spans = [e["end_ms"] - e["start_ms"] for e in events if e["kind"] == kind]
        if spans:
            out[kind] = sum(spans) / len(spans)
    return out


__all__ = ["copy_overlap", "simulate_schedule", "span_ms", "per_layer_means", "KIND_COLORS", "KIND_LABELS"]
