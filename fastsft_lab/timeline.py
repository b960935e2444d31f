"""Copy/compute timelines of offloaded checkpointing: measured intervals, overlap metrics, a schedule model, plots.

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


def plot_timeline(events: Sequence[dict], ax=None, *, title: str | None = None, label_layers: bool = True,
                  xlim: tuple[float, float] | None = None):
    """Two lanes (compute stream above, copy stream below), one bar per interval, coloured by kind."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(11, 2.2))
    lanes = {"compute": 1, "copy": 0}
    t0 = min((e["start_ms"] for e in events), default=0.0)
    span = max(span_ms(events), 1e-9)
    seen = set()
    for e in events:
        y = lanes.get(e["lane"], 0)
        w = e["end_ms"] - e["start_ms"]
        label = KIND_LABELS.get(e["kind"], e["kind"]) if e["kind"] not in seen else None
        seen.add(e["kind"])
        ax.broken_barh([(e["start_ms"] - t0, max(w, span * 1e-4))], (y - 0.35, 0.7),
                       facecolors=KIND_COLORS.get(e["kind"], "#333"), edgecolor="white", linewidth=0.4,
                       label=label)
        if label_layers and e.get("layer", -1) >= 0 and w > span * 0.025:
            ax.text(e["start_ms"] - t0 + w / 2, y, str(e["layer"]), ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_yticks([0, 1])
    ax.set_yticklabels(["copy stream", "compute stream"], fontsize=8)
    ax.set_xlabel("ms", fontsize=8)
    ax.set_ylim(-0.6, 1.6)
    if xlim:
        ax.set_xlim(*xlim)
    if title:
        ax.set_title(title, fontsize=9)
    return ax


def plot_timelines(named: dict[str, Sequence[dict]], path: str | None = None, *, suptitle: str | None = None,
                   share_x: bool = True):
    """One timeline per entry (e.g. single buffer / double buffer), stacked with a common time axis."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(named)
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.9 * len(names) + 0.8), sharex=share_x, squeeze=False)
    longest = max((span_ms(v) for v in named.values()), default=1.0)
    for ax, name in zip(axes[:, 0], names):
        ev = named[name]
        plot_timeline(ev, ax, title=f"{name}  ({span_ms(ev):.1f} ms)", xlim=(0, longest * 1.02))
    handles, labels = axes[0, 0].get_legend_handles_labels()
    for ax in axes[1:, 0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=min(5, len(labels)), fontsize=8, frameon=False)
    if suptitle:
        fig.suptitle(suptitle, fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    if path is not None:
        from .bench import save_figure

        save_figure(fig, path)
    return fig


# --- Stream-order model: is every cross-stream hazard ordered? --------------------------------------------------
def check_stream_order(ops: Sequence[tuple]) -> list[str]:
    """Check a log of stream operations (:attr:`fastsft_lab.offload.OffloadManager.stream_log`) for races.

    A happens-before model of CUDA streams with vector clocks. Operations, in the order the host issued them:

    * ``("wait_stream", a, b)``: stream ``a`` waits for everything issued on ``b`` so far;
    * ``("record", event, s)`` / ``("wait_event", s, event)``: a wait orders ``s`` after the event's most recent
      record *at the time of the wait* (a later re-record does not matter; an event never recorded is a no-op);
    * ``("access", s, buffer, "r" | "w")``: kernels issued on ``s`` read or write ``buffer``;
    * ``("record_stream", buffer, s)``: the caching allocator will not reuse ``buffer``'s memory before the work
      issued on ``s`` up to its free has completed;
    * ``("free", s, buffer)``: ``buffer``'s memory goes back to the allocator's pool of stream ``s``; it may be
      handed to the next allocation on ``s`` at once, so any access on another stream that is neither ordered
      before the free nor covered by ``record_stream`` is a hazard; any later access is a use after free.

    A problem is reported for every pair of accesses to one buffer on different streams, at least one a write,
    where the earlier-issued one does not happen before the later one, and for every unsafe free.

    Returns:
        Human-readable problems (empty: every hazard in the log is ordered).
    """
    clocks: dict[str, dict[str, int]] = {}
    events: dict = {}
    history: dict = {}
    protected: dict = {}
    freed: dict = {}
    problems: list[str] = []

    def clock(s: str) -> dict[str, int]:
        return clocks.setdefault(s, {})

    def tick(s: str) -> int:
        c = clock(s)
        c[s] = c.get(s, 0) + 1
        return c[s]

    def join(s: str, other: dict[str, int]) -> None:
        c = clock(s)
        for k, v in other.items():
            if v > c.get(k, 0):
                c[k] = v

    for i, op in enumerate(ops):
        kind = op[0]
        if kind == "wait_stream":
            _, a, b = op
            join(a, dict(clock(b)))
            tick(a)
        elif kind == "record":
            _, ev, s = op
            tick(s)
            events[ev] = dict(clock(s))
        elif kind == "wait_event":
            _, s, ev = op
            if ev in events:
                join(s, events[ev])
            tick(s)
        elif kind == "record_stream":
            _, buf, s = op
            protected.setdefault(buf, set()).add(s)
        elif kind == "access":
            _, s, buf, mode = op
            n = tick(s)
            if buf in freed:
                problems.append(f"op {i}: {s} {'writes' if mode == 'w' else 'reads'} {buf} after it was freed "
                                f"(op {freed[buf]})")
            for ps, pn, pmode, pi in history.get(buf, ()):
                if ps != s and "w" in (mode, pmode) and clock(s).get(ps, 0) < pn:
                    problems.append(f"op {i}: {s} {'writes' if mode == 'w' else 'reads'} {buf} while op {pi} "
                                    f"({ps} {'write' if pmode == 'w' else 'read'}) may not have run yet")
            history.setdefault(buf, []).append((s, n, mode, i))
        elif kind == "free":
            _, s, buf = op
            tick(s)
            for ps, pn, pmode, pi in history.get(buf, ()):
                if ps != s and ps not in protected.get(buf, ()) and clock(s).get(ps, 0) < pn:
                    problems.append(f"op {i}: {buf} freed for reuse on {s} while op {pi} ({ps} "
                                    f"{'write' if pmode == 'w' else 'read'}) may not have run yet and no "
                                    f"record_stream({ps}) protects it")
            freed[buf] = i
        else:
            raise ValueError(f"unknown stream operation {op!r}")
    return problems


__all__ = ["copy_overlap", "simulate_schedule", "span_ms", "plot_timeline", "plot_timelines", "check_stream_order",
           "KIND_COLORS"]
