"""Every chart of fastsft_lab, in one place. Each function returns a matplotlib ``Figure`` (shown inline in a
notebook); :func:`save_figure` writes it as PNG and closes it. Nothing here touches the matplotlib backend.

One convention for every comparison: *speed* relative to a baseline (baseline time / variant time), the baseline
at 1.00x, higher is better, the ratio written on each bar. Memory is in GiB, lower is better, and says so.
"""

from __future__ import annotations

import os
import re
from typing import Sequence

from .timelines import KIND_COLORS, KIND_LABELS, simulate_schedule, span_ms

HIGHER = "higher is better"
_BLUE, _GREY, _ORANGE, _RED = "#4C72B0", "#8C8C8C", "#DD8452", "#C44E52"


def _plt():
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str, dpi: int = 110) -> str:
    """Write ``fig`` as a PNG (folders created), close it, return ``path``."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    _plt().close(fig)
    return path


def _where(result: dict) -> str:
    env = result.get("env", {})
    return env.get("gpu_name") or f"CPU ({env.get('cpu_count')} cores)"


def _label_bars(ax, bars, values, tops, fmt="{:.2f}x") -> None:
    """Value labels just above each bar's error bar (so the bar's whisker never covers its label)."""
    for bar, value, top in zip(bars, values, tops):
        ax.annotate(fmt.format(value), (bar.get_x() + bar.get_width() / 2, top), xytext=(0, 2),
                    textcoords="offset points", ha="center", va="bottom", fontsize=7)


def plot_result(result: dict, phases: Sequence[str] = ("forward", "step"), title: str | None = None,
                limit: str | None = None):
    """Speed of each variant against the first successful one (1.00x) per phase, p20-p80 as whiskers.

    ``limit`` names a variant drawn as a dashed line instead of a bar (a zero-overhead limit that would flatten
    every other bar). Returns None when no variant succeeded (a configuration whose variants all failed keeps its
    JSON, with each error, and must not stop the rest of a benchmark run).
    """
    plt = _plt()
    ok = [r for r in result["variants"] if "error" not in r]
    rows = [r for r in ok if r["name"] != limit]
    lim = next((r for r in ok if r["name"] == limit), None)
    phases = [p for p in phases if rows and all(f"{p}_ms" in r for r in rows)]
    if not rows or not phases:
        return None
    fig, ax = plt.subplots(figsize=(min(12.0, max(6.5, 1.05 * len(rows) * len(phases) + 2)), 4.6))
    width = 0.8 / len(phases)
    for j, phase in enumerate(phases):
        base = rows[0][f"{phase}_ms"]["median"]
        xs = [i + (j - (len(phases) - 1) / 2) * width for i in range(len(rows))]
        ratios = [base / r[f"{phase}_ms"]["median"] for r in rows]
        lo = [base / r[f"{phase}_ms"]["p80"] for r in rows]
        hi = [base / r[f"{phase}_ms"]["p20"] for r in rows]
        err = [[max(0.0, a - b) for a, b in zip(ratios, lo)], [max(0.0, b - a) for a, b in zip(ratios, hi)]]
        bars = ax.bar(xs, ratios, width=width, label=f"{phase} (baseline {base:.1f} ms)", yerr=err, capsize=3,
                      error_kw={"elinewidth": 0.8, "alpha": 0.7})
        _label_bars(ax, bars, ratios, [r + e for r, e in zip(ratios, err[1])])
        if lim is not None and f"{phase}_ms" in lim:
            speed = base / lim[f"{phase}_ms"]["median"]
            ax.axhline(speed, color=bars[0].get_facecolor(), ls=":", lw=1.2,
                       label=f"{phase}: {limit} = {speed:.1f}x (the limit)")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["name"] for r in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(f"speed vs {rows[0]['name']} ({HIGHER})", fontsize=8)
    ax.margins(y=0.15)
    cfg = result.get("config", {})
    ax.set_title(title or f"{result.get('scenario')}: {cfg.get('model')} | {cfg.get('tokens_per_step')} tokens/step "
                 f"| {_where(result)}", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


# The chain a reader can attribute: what the stock step gains from the packed attention kernel and exact packing
# alone (all naive: every glue fix in its "before" form), then from the glue fixes together (all fast). Each label
# names what changed from the bar before; what each fix alone is worth is the ablation beside it (all fast without it).
WATERFALL = {"transformers default": "transformers default",
             "all naive": "+ packed attention kernel\n(metadata rebuilt per layer,\none buffer, default experts)",
             "all fast": "+ the glue fixes\n(metadata once, double buffer,\nsync-free experts)"}
# older combined runs ran transformers' eager per-expert loop in "all naive" (toggles moe=naive): their label says so
_LOOP_LABEL = "+ packed attention kernel\n(metadata rebuilt per layer,\none buffer, eager-loop experts)"


def plot_limit_gap(results: Sequence[dict], rows: Sequence[str] = ("cached", "cached (collated)"),
                   limit: str = "oracle", band: float = 0.005):
    """Step time of ``rows`` over the ``limit`` variant's, in percent, one group of bars per result.

    Variant names are ``"<backend> <row>"`` (the packed scenario's); a dotted band marks +-``band`` (the target).
    Returns None when no result has the limit and one of the rows.
    """
    plt = _plt()
    groups = []
    for r in results:
        by = {v["name"].split(" ", 1)[1]: v for v in r["variants"] if " " in v["name"] and "step_ms" in v}
        if limit in by and any(row in by for row in rows):
            lim = by[limit]["step_ms"]["median"]
            groups.append((f"{r['config']['backend']}\n{r['config']['tokens_per_step']} tok",
                           [100 * (by[row]["step_ms"]["median"] / lim - 1) if row in by else None for row in rows]))
    if not groups:
        return None
    fig, ax = plt.subplots(figsize=(max(6.5, 0.9 * len(groups) + 2), 4.2))
    width = 0.8 / len(rows)
    for j, (row, color) in enumerate(zip(rows, (_GREY, _BLUE, _ORANGE, _RED))):
        xs = [i + (j - (len(rows) - 1) / 2) * width for i, (_, vals) in enumerate(groups) if vals[j] is not None]
        vals = [vals[j] for _, vals in groups if vals[j] is not None]
        bars = ax.bar(xs, vals, width=width, color=color, label=row)
        _label_bars(ax, bars, vals, [max(v, 0) for v in vals if v is not None], fmt="{:+.2f}%")
    ax.axhspan(-100 * band, 100 * band, color=_GREY, alpha=0.15, label=f"+-{band:.1%} of the {limit}")
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([g for g, _ in groups], fontsize=8)
    ax.set_ylabel(f"step time over the {limit}, % (lower is better)", fontsize=8)
    ax.margins(y=0.15)
    ax.legend(fontsize=7)
    cfg, env = results[0].get("config", {}), results[0].get("env", {})
    ax.set_title(f"{cfg.get('model')} x{cfg.get('num_layers')} | {cfg.get('mix')} | {_where(results[0])} | "
                 f"{env.get('date', '')[:10]}", fontsize=9)
    fig.tight_layout()
    return fig


def plot_waterfall(result: dict):
    """From the stock path to all fast in the steps :data:`WATERFALL` names -- or, for a result whose config names
    its ``chain`` (the attribution scenario), in every step of that chain: each bar floats from the speed before it
    to the speed after it (1.00x = the first step), so its height is what that step adds, and its label says what
    changed. The other variants (TRL, the packed path without offload, the ablation: all fast without one fix)
    stand beside it as plain bars. A step that failed is left out and named in the title. A chain whose steps were
    profiled names under each bar's ratio what that step removed, measured (the kind whose time fell most, and by
    how much: :func:`.removes.chain_removed`); a chain without profiles says "not profiled" in its
    title. Returns None when nothing ran."""
    plt = _plt()
    rows = {r["name"]: r for r in result["variants"] if "step_ms" in r}
    cfg = result.get("config", {})
    chain = cfg.get("chain")
    first = chain[0] if chain else "transformers default"
    if first not in rows:
        return None
    base = rows[first]["step_ms"]["median"]
    measured: dict[str, str] = {}
    if chain:
        from .results import chain_steps
        from .removes import chain_removed

        labels = {n: n for n in chain_steps(result)}
        if any("profile" in r for r in rows.values()):
            every = {r["name"]: r for r in result["variants"]}
            measured = {n: r["short"] for n, r in chain_removed([every.get(n, {"name": n}) for n in labels]).items()}
    else:
        labels = dict(WATERFALL)
        if any(r["name"] == "all naive" and r.get("toggles", {}).get("moe") == "naive" for r in result["variants"]):
            labels["all naive"] = _LOOP_LABEL
    steps = [n for n in labels if n in rows]
    missing = [n for n in labels if n not in rows and n in {r["name"] for r in result["variants"]}]
    others = [n for n in rows if n not in steps]
    fig, ax = plt.subplots(figsize=(min(13.0, 1.1 * (len(steps) + len(others)) + 3), 4.8))
    prev = None
    for i, name in enumerate(steps):
        speed = base / rows[name]["step_ms"]["median"]
        low = 0.0 if prev is None else min(prev, speed)
        height = speed if prev is None else abs(speed - prev)
        color = _GREY if prev is None else (_BLUE if speed >= prev else _RED)
        ax.bar(i, height, bottom=low, color=color)
        text = f"{speed:.2f}x" if prev is None else f"{speed:.2f}x ({(speed / prev - 1) * 100:+.0f}%)"
        if name in measured:             # "host overhead -41.0 ms" in two lines: the kind, then the ms
            text += "\n" + re.sub(r" ([+-][\d.]+ ms)$", r"\n\1", measured[name])
        ax.annotate(text, (i, max(speed, prev or 0)), xytext=(0, 2), textcoords="offset points", ha="center",
                    va="bottom", fontsize=6.5 if measured else 7)
        prev = speed
    for j, name in enumerate(others):
        speed = base / rows[name]["step_ms"]["median"]
        x = len(steps) + 0.5 + j
        ax.bar(x, speed, color=_ORANGE if "naive" in name else "#A0A0A0")
        ax.annotate(f"{speed:.2f}x", (x, speed), xytext=(0, 2), textcoords="offset points", ha="center",
                    va="bottom", fontsize=7)
    ticks = list(range(len(steps))) + [len(steps) + 0.5 + j for j in range(len(others))]
    ax.set_xticks(ticks)
    ax.set_xticklabels([labels[n] for n in steps] + others, rotation=22, ha="right", fontsize=7)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_ylabel(f"step speed vs {first} ({HIGHER})", fontsize=8)
    ax.margins(y=0.15)
    what = "where each gain comes from" if chain else "all three together"
    ax.set_title(f"{what}: {cfg.get('model')} x{cfg.get('num_layers')} layers | {cfg.get('tokens_per_step')} "
                 f"tokens/step | kernels {cfg.get('kernels')} | autocast {cfg.get('autocast', 'none')} | "
                 f"{_where(result)}" + (f"\nfailed, not drawn: {', '.join(missing)}" if missing else "")
                 + ("\neach bar's label: what it removed, measured (one profiled step each"
                    + ("; on a CPU the profiled step's ms, not the bar's)" if result.get("env", {}).get("device") == "cpu"
                       else ")") if measured else
                    "\nwhat each bar removes: not profiled in this run" if chain else ""), fontsize=9)
    fig.tight_layout()
    return fig


def plot_regime(summary: list[dict], x: str = "tokens_per_step"):
    """The packed-metadata regime map: speed of the cached path over the naive one (forward, step) against ``x``.

    One column per model and depth, one line per (backend, length mix); the naive path is 1.0x. Where a column has a
    single ``x`` value, grouped bars replace the lines.
    """
    plt = _plt()
    columns = sorted({(s["model"], s.get("num_layers") or 0) for s in summary})
    fig, axes = plt.subplots(2, len(columns), figsize=(5.6 * len(columns), 7.4), squeeze=False, sharey="row")
    for col, (model, layers) in enumerate(columns):
        groups: dict[tuple, dict] = {}
        for s in summary:
            if (s["model"], s.get("num_layers") or 0) == (model, layers):
                groups.setdefault((s["backend"], s["mix"]), {})[s[x]] = s   # one point per x (the latest given)
        xs_all = sorted({xv for g in groups.values() for xv in g})
        for row, phase in enumerate(("forward", "step")):
            ax = axes[row][col]
            key = f"cached_{phase}_speedup"
            if len(xs_all) == 1:
                names = [f"{b} | {m}" for b, m in sorted(groups)]
                vals = [groups[g][xs_all[0]].get(key) or float("nan") for g in sorted(groups)]   # missing: no bar
                bars = ax.bar(range(len(vals)), vals, color=_BLUE)
                for bar, v in zip(bars, vals):
                    ax.annotate("missing" if v != v else f"{v:.2f}x", (bar.get_x() + bar.get_width() / 2,
                                0 if v != v else v), xytext=(0, 2), textcoords="offset points", ha="center",
                                va="bottom", fontsize=7)
                ax.set_xticks(range(len(vals)))
                ax.set_xticklabels(names, rotation=15, ha="right", fontsize=8)
                ax.set_xlabel(f"{x.replace('_', ' ')} = {xs_all[0]}", fontsize=8)
            else:
                for (backend, mix), pts in sorted(groups.items()):
                    line = [(xv, pts[xv].get(key)) for xv in sorted(pts) if pts[xv].get(key)]
                    if not line:
                        continue
                    xs, ys = zip(*line)
                    ax.plot(xs, ys, marker="o", label=f"{backend} | {mix}")
                    for xi, yi in line:
                        ax.annotate(f"{yi:.2f}x", (xi, yi), textcoords="offset points", xytext=(0, 5), fontsize=7,
                                    ha="center")
                ax.set_xscale("log", base=2)
                ax.set_xticks(xs_all)
                ax.set_xticklabels([f"{v // 1024}k" if v % 1024 == 0 else str(v) for v in xs_all], fontsize=8)
                if row == 1:
                    ax.set_xlabel(x.replace("_", " "), fontsize=8)
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=7)
            ax.axhline(1.0, color="gray", lw=0.8, ls="--")
            ax.margins(y=0.15)
            ax.set_title(f"{model} ({layers} layers): {phase}, cached vs naive", fontsize=9)
            if col == 0:
                ax.set_ylabel(f"{phase} speed over the naive path ({HIGHER})", fontsize=8)
    fig.tight_layout()
    return fig


def plot_offload_result(result: dict):
    """Speed against standard checkpointing (ratio labels) and, on a GPU, peak memory, one bar per variant."""
    plt = _plt()
    rows = [r for r in result["variants"] if "step_ms" in r]
    if not rows:
        return None
    base = rows[0]["step_ms"]["median"]
    names = [r["name"] for r in rows]
    peaks = [r.get("peak_mem_bytes") for r in rows]
    panels = 2 if any(peaks) else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.4 * panels, 4.6), squeeze=False)
    a1 = axes[0][0]
    speed = [base / r["step_ms"]["median"] for r in rows]
    err = [[max(0.0, s - base / r["step_ms"]["p80"]) for s, r in zip(speed, rows)],
           [max(0.0, base / r["step_ms"]["p20"] - s) for s, r in zip(speed, rows)]]
    bars = a1.bar(range(len(rows)), speed, color=[_GREY] + [_BLUE] * (len(rows) - 1), yerr=err, capsize=3,
                  error_kw={"elinewidth": 0.8, "alpha": 0.7})
    _label_bars(a1, bars, speed, [s + e for s, e in zip(speed, err[1])])
    a1.axhline(1.0, color="gray", lw=0.8, ls="--")
    a1.set_ylabel(f"step speed vs {names[0]}\n({HIGHER})", fontsize=8)
    a1.margins(y=0.15)
    if panels == 2:
        a2 = axes[0][1]
        gib = [(p or 0) / 2**30 for p in peaks]
        pb = a2.bar(range(len(rows)), gib, color=_ORANGE)
        _label_bars(a2, pb, gib, gib, fmt="{:.2f}")
        a2.set_ylabel("peak GPU memory, GiB (lower is better)", fontsize=8)
        a2.margins(y=0.12)
    for ax in axes[0]:
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    cfg = result.get("config", {})
    fig.suptitle(f"offloaded checkpointing: {cfg.get('model')} x{cfg.get('num_layers')} layers | "
                 f"{cfg.get('tokens_per_step')} tokens/step | {_where(result)}", fontsize=9)
    fig.tight_layout()
    return fig


def plot_across_tokens(results: Sequence[dict]):
    """Step speed relative to standard checkpointing and peak GPU memory, grouped by tokens per step."""
    plt = _plt()
    names = ["checkpointing (standard)", "no checkpointing", "transformers offload=True",
             "save_on_cpu(step) + ckpt", "offload x1 (single buffer)", "offload x2 (double buffer)",
             "offload x2 + prefetch"]
    present = [n for n in names if any(v["name"] == n and "step_ms" in v for r in results for v in r["variants"])]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.6))
    width = 0.8 / max(1, len(present))
    for j, n in enumerate(present):
        xs, speeds, peaks = [], [], []
        for i, r in enumerate(results):
            by = {v["name"]: v for v in r["variants"]}
            std = by.get("checkpointing (standard)", {}).get("step_ms", {}).get("median")
            v = by.get(n)
            if v is None or "step_ms" not in v or not std:
                continue
            xs.append(i + (j - (len(present) - 1) / 2) * width)
            speeds.append(std / v["step_ms"]["median"])
            peaks.append((v.get("peak_mem_bytes") or 0) / 2**30)
        bars = a1.bar(xs, speeds, width=width, label=n)
        _label_bars(a1, bars, speeds, speeds, fmt="{:.2f}")
        a2.bar(xs, peaks, width=width, label=n)
    for ax in (a1, a2):
        ax.set_xticks(range(len(results)))
        ax.set_xticklabels([f"{r['config']['tokens_per_step']} tokens" for r in results])
        ax.margins(y=0.12)
    a1.axhline(1.0, color="gray", lw=0.8, ls="--")
    a1.set_ylabel(f"step speed vs standard checkpointing ({HIGHER})", fontsize=8)
    a2.set_ylabel("peak GPU memory, GiB (lower is better)", fontsize=8)
    a1.legend(fontsize=7)
    env = results[0].get("env", {}) if results else {}
    cfg = results[0].get("config", {}) if results else {}
    fig.suptitle(f"{cfg.get('model')} x{cfg.get('num_layers')} layers, {cfg.get('quant')} + LoRA "
                 f"r{cfg.get('lora_rank')} | {env.get('gpu_name') or 'CPU'}", fontsize=9)
    fig.tight_layout()
    return fig


def plot_sweep(result: dict):
    """Gain of double buffer + prefetch over one buffer vs the measured copy/backward ratio, with the model curve."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    rs = [i / 100 for i in range(0, 101, 2)]
    model_gain = []
    for r in rs:
        one = span_ms(simulate_schedule(10, fwd_ms=0.5, bwd_ms=1.0, copy_ms=r, buffers=1))
        two = span_ms(simulate_schedule(10, fwd_ms=0.5, bwd_ms=1.0, copy_ms=r, buffers=2))
        model_gain.append((one / two - 1) * 100)
    ax.plot(rs, model_gain, color="gray", ls="--", label="schedule model (10 layers, fwd = bwd/2)")
    for p in result.get("points", []):
        if "copy_to_backward_ratio" in p and "gain_x2p_vs_x1" in p:
            ax.scatter([p["copy_to_backward_ratio"]], [p["gain_x2p_vs_x1"] * 100], color=_BLUE)
            ax.annotate(f"{p['preset']} {p['tokens']}", (p["copy_to_backward_ratio"], p["gain_x2p_vs_x1"] * 100),
                        fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("reload copy time / layer backward time")
    ax.set_ylabel(f"step-time gain of 2 buffers + prefetch\nover 1 buffer, % ({HIGHER})", fontsize=8)
    ax.axhline(6.7, color=_RED, lw=0.8, ls=":", label="Unsloth's published +6.7% (Qwen3-14B, B200)")
    ax.legend(fontsize=8)
    ax.set_title("Where the second buffer matters", fontsize=9)
    fig.tight_layout()
    return fig


def plot_timeline(events: Sequence[dict], ax=None, *, title: str | None = None, label_layers: bool = True,
                  xlim: tuple[float, float] | None = None):
    """Two lanes (compute stream above, copy stream below), one bar per interval, coloured by kind. Returns ax."""
    if ax is None:
        _, ax = _plt().subplots(figsize=(11, 2.2))
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


def plot_timelines(named: dict[str, Sequence[dict]], *, suptitle: str | None = None, share_x: bool = True):
    """One timeline per entry (e.g. single buffer / double buffer), stacked with a common time axis."""
    plt = _plt()
    names = list(named)
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 1.9 * len(names) + 0.9), sharex=share_x, squeeze=False)
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
    return fig


def plot_host_device_timeline(timelines: dict[str, dict], ax=None, title: str | None = None,
                              what: str = "the experts forward"):
    """Host ops (grey; red where the host waits for the device) and GPU kernels (blue) per mode
    (:func:`fastsft_lab.profiling.host_device_timeline`'s output). Returns ax."""
    if ax is None:
        _, ax = _plt().subplots(figsize=(10, 0.9 + 0.75 * len(timelines) * 2))
    labels: list = []
    y = 0.0
    for mode, tl in timelines.items():
        if tl["gpu"]:
            ax.broken_barh([(s, max(e - s, 1e-3)) for _, s, e in tl["gpu"]], (y - 0.35, 0.7), color="tab:blue")
            labels.append((y, f"{mode}: GPU kernels"))
            y += 1
        ax.broken_barh([(s, max(e - s, 1e-3)) for _, s, e, w in tl["host"] if not w], (y - 0.35, 0.7),
                       color="lightgray")
        ax.broken_barh([(s, max(e - s, 1e-3)) for _, s, e, w in tl["host"] if w], (y - 0.35, 0.7), color="tab:red")
        labels.append((y, f"{mode}: host ({tl['host_syncs']} waits)"))
        y += 1.4
    ax.set_yticks([p for p, _ in labels])
    ax.set_yticklabels([t for _, t in labels], fontsize=8)
    ax.set_xlabel(f"ms from the start of {what}")
    ax.set_title(title or "one MoE layer's experts forward: red = the host waits for the device", fontsize=9)
    return ax


def plot_offload_link(result: dict):
    """Offloaded checkpointing behind emulated host links (scenario ``offload_link``): left, step speed against
    plain checkpointing (1.00x: no copies, the same for every link) of x1 and x2 vs link bandwidth, measured
    (solid) and the timeline model (dashed); right, the gain of x2 over x1 with the published +6.7%. Log x; the
    top axis is the same link as copy/backward time per layer (a GPU ``native / bw`` times faster per byte at the
    native link has that ratio). Marked: the native link and a B200 at the same link (an estimate, a band)."""
    import numpy as np

    plt = _plt()
    pts = result.get("points", [])
    cfg, d = result.get("config", {}), result.get("derived", {})
    curve, minp = result.get("model_curve") or [], result.get("model_inputs") or {}
    native, band = d.get("native_link_gbps"), d.get("b200_equivalent_gbps")
    plain = next((p.get("plain_ms") for p in pts if p.get("plain_ms")), None)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.9))

    def x(p):
        return p.get("measured_gbps") or p.get("target_gbps")

    lines = (("offload1", _ORANGE, "offload x1"), ("offload2", _GREY, "offload x2"),
             ("offload2p", _BLUE, "offload x2 + prefetch"))
    if plain:
        a1.axhline(1.0, color="black", lw=1.0, label=f"plain checkpointing ({plain:.0f} ms, no copies)")
        for key, color, label in lines:
            line = sorted((x(p), plain / p[f"{key}_ms"]) for p in pts if x(p) and p.get(f"{key}_ms"))
            if line:
                a1.plot(*zip(*line), marker="o", color=color, label=f"{label} (measured)")
                for xi, yi in line:
                    a1.annotate(f"{yi:.2f}x", (xi, yi), xytext=(0, 4), textcoords="offset points", fontsize=7,
                                ha="center")
        for key, ck, color in (("offload1", "x1_ms", _ORANGE), ("offload2p", "x2_ms", _BLUE)):
            if curve:
                a1.plot([c["gbps"] for c in curve], [plain / c[ck] for c in curve], ls="--", color=color, lw=1,
                        label=f"model {'x1' if ck == 'x1_ms' else 'x2'}")
        budget = d.get("overhead_budget")
        if budget:
            a1.axhline(1 / (1 + budget), color=_RED, ls=":", lw=0.8, label=f"{budget:.0%} overhead budget")
    gain = sorted((x(p), p["gain_x2_vs_x1"] * 100) for p in pts if x(p) and p.get("gain_x2_vs_x1") is not None)
    if gain:
        a2.plot(*zip(*gain), marker="o", color=_BLUE, label="measured")
        for xi, yi in gain:
            a2.annotate(f"{yi:+.1f}%", (xi, yi), xytext=(0, 4), textcoords="offset points", fontsize=7, ha="center")
    if curve:
        a2.plot([c["gbps"] for c in curve], [c["gain_x2_vs_x1"] * 100 for c in curve], ls="--", color=_BLUE, lw=1,
                label=f"model, {cfg.get('num_layers')} layers")
        a2.plot([c["gbps"] for c in curve], [c["gain_x2_vs_x1_full_depth"] * 100 for c in curve], ls=":",
                color=_BLUE, lw=1, label=f"model, {cfg.get('full_depth')} layers")
    pub = d.get("published_gain")
    if pub:
        a2.axhline(pub * 100, color=_RED, lw=0.8, ls=":", label=f"published +{pub:.1%} (Qwen3-14B, B200)")
    begins = d.get("published_gain_regime_begins_gbps")
    if begins:
        a2.axvline(begins, color=_RED, lw=0.8, ls="--")
        a2.annotate(f"+{pub:.1%} from {begins:.0f} GB/s", (begins, pub * 100), xytext=(4, -12),
                    textcoords="offset points", fontsize=7, color=_RED)
    for ax in (a1, a2):
        if native:
            ax.axvline(native, color=_GREY, ls="-.", lw=0.9, label=f"native link ({native:.0f} GB/s)")
        if band:
            ax.axvspan(band[0], band[1], color=_RED, alpha=0.08, label="B200 at the native link (est.)")
        ticks = sorted({round(x(p), 1) for p in pts if x(p)})
        if ticks:
            ax.set_xscale("log")
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks], fontsize=7)
            ax.minorticks_off()
        ax.set_xlabel("host<->device link, GB/s (log; " + ("measured on the copy stream)" if native else
                                                           "nominal: a CPU run has no link)"), fontsize=8)
        ax.legend(fontsize=7, loc="lower right" if ax is a1 else "upper right")
        if minp.get("bwd_ms") and minp.get("layer_bytes") and native:
            k = minp["layer_bytes"] / (1e6 * minp["bwd_ms"])     # ratio = k / GB/s
            top = ax.secondary_xaxis("top", functions=(lambda b: k / np.clip(b, 1e-9, None),
                                                       lambda r: k / np.clip(r, 1e-9, None)))
            top.set_xticks([k / t for t in ticks], [f"{k / t:.2g}" for t in ticks], fontsize=7)
            top.minorticks_off()
            top.set_xlabel(f"copy / backward time per layer (= a GPU {native:.0f}/x times faster per byte at "
                           f"{native:.0f} GB/s)", fontsize=8)
    a1.set_ylabel(f"step speed vs plain checkpointing ({HIGHER})", fontsize=8)
    a2.set_ylabel(f"gain of x2 + prefetch over x1, % ({HIGHER})", fontsize=8)
    where = _where(result) + ("" if native else ": no link, not a measurement")
    fig.suptitle(f"offload behind emulated links: {cfg.get('model')} x{cfg.get('num_layers')} layers, "
                 f"{cfg.get('tokens_per_step')} tokens | {where}", fontsize=9)
    fig.tight_layout()
    return fig


# --- where the time goes (fastsft_lab.lab.breakdown) ---------------------------------------------------------------
BREAKDOWN_COLORS = {"attention": "#4C72B0", "experts": "#DD8452", "dense": "#55A868", "nf4_dequant": "#8DBF8B",
                    "lora": "#C44E52", "loss_head": "#8172B3", "elementwise": "#937860", "copies": "#DA8BC3",
                    "optimizer": "#CCB974", "other": "#64B5CD", "idle": "#D9D9D9"}


def plot_breakdown(results: Sequence[dict], *, min_label: float = 0.04):
    """One stacked horizontal bar per breakdown result (``scenario == "breakdown"``): the step split into its
    categories (on a device re-based on the unprofiled step, ``breakdown.step_view``), as a share of the step, each part wide enough (``min_label``) labelled with its ms and %. The step
    time and the named bottleneck are in each bar's label. Returns None when no result has a breakdown."""
    from .breakdown import step_view

    docs = [r for r in results if r.get("breakdown")]
    if not docs:
        return None
    plt = _plt()
    height = 1.6 + 0.9 * len(docs)
    fig, ax = plt.subplots(figsize=(12, height))
    seen: dict[str, str] = {}
    names = []
    for y, doc in enumerate(docs):
        bd, c = step_view(doc), doc["config"]
        assert bd is not None          # the docs were chosen for their breakdown
        left = 0.0
        for row in bd["categories"]:
            if row["ms"] <= 0:
                continue
            color = BREAKDOWN_COLORS.get(row["category"], _GREY)
            ax.barh(y, row["share"], left=left, color=color, edgecolor="white", linewidth=0.6, height=0.6)
            seen.setdefault(row["category"], row["label"])
            if row["share"] >= min_label:
                ax.text(left + row["share"] / 2, y, f"{row['ms']:.0f} ms\n{row['share']:.0%}" if row["ms"] >= 10
                        else f"{row['ms']:.1f} ms\n{row['share']:.0%}", ha="center", va="center", fontsize=7)
            left += row["share"]
        top = {r["category"]: r["label"] for r in bd["categories"]}[bd["bottleneck"]]
        when = (f"step {bd['step_ms']:.0f} ms unprofiled ({bd['profiled_step_ms']:.0f} profiled)"
                if "profiled_step_ms" in bd else f"step {bd['step_ms']:.0f} ms profiled")
        names.append(f"{c['model']} x{c['num_layers']}, {c['tokens_per_step']} tok, kernels {c.get('kernels', '-')}, "
                     f"autocast {c.get('autocast', 'none')}\n{when}; largest: {top}")
    ax.set_yticks(range(len(docs)))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0%}"))
    cuda = docs[0]["breakdown"].get("activity") == "cuda"
    ax.set_xlabel("share of the all-fast step: " + ("device time per category; idle = unprofiled step - busy time" if cuda
                  else "host ops' self time per category; idle = host time outside any op (a CPU run)"), fontsize=8)
    ax.set_title(f"Where the all-fast step goes | {_where(docs[0])}", fontsize=9)
    order = sorted(seen, key=lambda k: list(BREAKDOWN_COLORS).index(k) if k in BREAKDOWN_COLORS else len(seen))
    handles = [plt.Rectangle((0, 0), 1, 1, color=BREAKDOWN_COLORS.get(k, _GREY)) for k in order]
    fig.legend(handles, [seen[k] for k in order], ncol=min(6, len(seen)), fontsize=7, loc="lower center",
               frameon=False)
    fig.tight_layout(rect=(0, 0.42 / height, 1, 1))
    return fig


def plot_experts_profile(doc: dict):
    """One MoE layer's experts (``benchmarks/experts_profile.py``): per preset and token count, forward + backward ms
    of the grouped matmuls alone (the limit), sync_free, and sync_free with every fused kernel off; each bar labelled
    with its time over the limit, in percent (lower is better)."""
    from .results import experts_profile_rows

    plt = _plt()
    rows = experts_profile_rows(doc)
    bars = [("expert matmuls alone", None, "#55A868"), ("sync_free", "sync_free", "#4C72B0"),
            ("sync_free, eager glue", "sync_free:eager_glue", "#C44E52")]
    fig, ax = plt.subplots(figsize=(10, 3.6))
    width = 0.8 / len(bars)
    for i, (label, key, color) in enumerate(bars):
        xs, ys = [], []
        for j, r in enumerate(rows):
            ms = r["limit_ms"] if key is None else (r.get(key) or {}).get("step_ms")
            if ms is None:
                continue
            xs.append(j + (i - 1) * width)
            ys.append(ms)
            if key is not None and r["limit_ms"]:    # time over the limit in percent ("x" is kept for speed)
                ax.text(j + (i - 1) * width, ms, f"{100 * (ms / r['limit_ms'] - 1):+.0f}%", ha="center", va="bottom",
                        fontsize=7)
        ax.bar(xs, ys, width=width, color=color, label=label)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{r['preset']}\n{r['tokens']} tokens" for r in rows], fontsize=8)
    ax.set_ylabel("forward + backward, ms (lower is better)")
    ax.set_title(f"one MoE layer's experts against the grouped matmuls alone | {_where(doc)}", fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def plot_expert_grouping(expert_ids, sorted_ids, perm, ends, top_k: int | None = None):
    """The grouping of notebook 03's worked example: left, the router's choice per (token, slot) (``expert_ids``,
    tokens x top_k); right, the rows after one stable sort (``sorted_ids``, ``perm`` = flat position of each sorted
    row, so its token is ``perm // top_k``) with each expert's end offset (``ends``) marked. An expert that got no
    token shares its end with the one before: its label says so. Takes tensors or lists."""
    plt = _plt()
    ids, sorted_ids, perm, ends = (t.tolist() if hasattr(t, "tolist") else list(t)
                                   for t in (expert_ids, sorted_ids, perm, ends))
    tokens, k = len(ids), top_k or len(ids[0])
    colors = plt.cm.tab10.colors
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw={"width_ratios": [1, 2.2]})
    for t, row in enumerate(ids):
        for j, e in enumerate(row):
            a.add_patch(plt.Rectangle((j, tokens - 1 - t), 0.95, 0.95, color=colors[e % 10]))
            a.text(j + 0.47, tokens - 1 - t + 0.47, f"E{e}", ha="center", va="center", color="white", fontsize=9)
    a.set_xlim(0, k); a.set_ylim(0, tokens)
    a.set_xticks([j + 0.5 for j in range(k)]); a.set_xticklabels([f"slot {j}" for j in range(k)])
    a.set_yticks([tokens - 0.5 - t for t in range(tokens)]); a.set_yticklabels([f"token {t}" for t in range(tokens)])
    a.set_title(f"router output: top-{k} experts per token", fontsize=9)
    for r, (e, p) in enumerate(zip(sorted_ids, perm)):
        b.add_patch(plt.Rectangle((r, 0), 0.95, 1, color=colors[e % 10]))
        b.text(r + 0.47, 0.5, f"t{p // k}", ha="center", va="center", color="white", fontsize=9)
    empty = [e for e, end in enumerate(ends) if end == (ends[e - 1] if e else 0)]
    for e, end in enumerate(ends):
        b.axvline(end - 0.025, color="black", lw=1.2)
        level = ends[:e].count(end)     # an empty expert shares its end with the previous one: stack the labels
        b.text(end - 0.05, 1.06 + 0.12 * level, f"offs[{e}]={end}" + (f" (E{e} empty)" if e in empty else ""),
               ha="right", fontsize=8)
    b.set_xlim(-0.2, len(perm) + 0.2); b.set_ylim(0, 1.42); b.set_yticks([])
    b.set_xlabel("sorted rows: each expert's tokens are one contiguous slice"
                 + (f" (empty: {', '.join(f'E{e}' for e in empty)})" if empty else ""))
    b.set_title("after one sort: tokens grouped by expert", fontsize=9)
    fig.tight_layout()
    return fig


def plot_training_check(exact: dict, along: dict, title: str = ""):
    """Left: the naive loss curve with the exact switches' curve over it (equal to the bit). Right: at each checked
    step, the largest relative difference of the loss and of any gradient with every switch on, against the
    float32 rounding bound (:mod:`fastsft_lab.lab.convergence`), lower is better."""
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6))
    a.plot(exact["naive"], color=_BLUE, label="all naive")
    a.plot(exact["exact"], "--", color=_ORANGE, label="+ cache, double buffer (exact)")
    pts = along["points"]
    a.plot([p["step"] for p in pts], [p["loss"] for p in pts], "o", color=_RED, ms=4, label="checked steps")
    a.set_xlabel("step"); a.set_ylabel("loss"); a.legend(fontsize=8)
    a.set_title(f"exact switches: curves bitwise equal: {exact['bitwise_equal']}", fontsize=9)
    steps = [p["step"] for p in pts]
    nonzero = lambda v: v if v > 0 else float("nan")     # a bitwise-equal point has no place on a log axis
    b.semilogy(steps, [nonzero(p["loss_diff"]) for p in pts], "o-", color=_BLUE, label="loss (0 = equal, not drawn)")
    b.semilogy(steps, [nonzero(p["grad_diff"]) for p in pts], "s-", color=_ORANGE, label="worst gradient")
    b.axhline(along["tolerance"], color=_RED, ls="--", label=f"bound 2·n·u (n = {along['n']})")
    b.set_xlabel("step"); b.set_ylabel("relative difference (lower is better)"); b.legend(fontsize=8)
    b.set_title("every switch on vs naive, same weights", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_headline(rows: Sequence[dict]):
    """Per model: step-time speed of all fast and of Unsloth against stock transformers (1.00x), and peak memory,
    from ``report.headline_rows``."""
    plt = _plt()
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(10.5, 3.4))
    colors = {"stock": _GREY, "fastsft": _BLUE, "Unsloth": _ORANGE}
    width = 0.26
    for j, (ax, key, label) in enumerate(((axes[0], "speed", "speed vs stock transformers (higher is better)"),
                                          (axes[1], "peak_gib", "peak memory, GiB (lower is better)"))):
        for i, model in enumerate(models):
            mine = [r for r in rows if r["model"] == model]
            for k, r in enumerate(mine):
                color = next(c for name, c in colors.items() if name in r["system"])
                bar = ax.bar(i + (k - 1) * width, r[key], width, color=color,
                             label=r["system"].split(" (")[0] if i == 0 else None)
                _label_bars(ax, bar, [r[key]], [r[key]], fmt="{:.2f}x" if key == "speed" else "{:.1f}")
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels(models, fontsize=8)
        ax.set_title(label, fontsize=9)
        ax.set_ylim(0, 1.15 * max(r[key] for r in rows))     # room for the labels over the tallest bar
        if j == 0:
            ax.axhline(1.0, color=_GREY, lw=0.8, ls="--")
            ax.legend(fontsize=7, loc="upper right")
    env = rows[0]["env"]
    fig.suptitle(f"{env.get('gpu_name')}, same batches per model, medians of interleaved steps "
                 f"(runs {', '.join(sorted({r['run'] for r in rows}))})", fontsize=8)
    fig.tight_layout()
    return fig


_LABEL_SPOTS = ((4, 4), (4, -11), (4, 13), (4, -20), (4, 22))
"""Where a plan's label may go, in points from its marker, in the order tried."""


def _labels_apart(ax, points: Sequence[tuple[float, float, str]]) -> None:
    """Label each point (x, y, text) at the first of :data:`_LABEL_SPOTS` (above and to its right first) whose box
    overlaps no label already placed (neighbours close in memory stay readable); where every spot overlaps, the
    last."""
    renderer = ax.figure.canvas.get_renderer()
    placed: list = []
    for x, y, text in points:
        for spot in _LABEL_SPOTS:
            label = ax.annotate(text, (x, y), fontsize=6.5, xytext=spot, textcoords="offset points")
            box = label.get_window_extent(renderer)
            if spot == _LABEL_SPOTS[-1] or not any(box.overlaps(other) for other in placed):
                break
            label.remove()
        placed.append(box)


def _mfu_axis(ax, doc: dict, fastest_ms: float) -> None:
    """A right-hand axis of MFU for a frontier's step-time axis: one step's model FLOPs (the same for every row and
    peer on the same batches: :func:`.results.frontier_flops`) over the time and the card's dense bf16 peak -- each
    point's MFU read off beside its ms. None drawn where the FLOPs or the peak are unknown."""
    import numpy as np

    from .flops import peak_flops
    from .results import frontier_flops

    flops, peak = frontier_flops(doc), peak_flops(doc.get("env", {}).get("gpu_name"))
    if not flops or not peak:
        return
    scale = flops / peak * 1e3 * 100                # ms -> % of the peak, and back: the same reciprocal

    def turn(v):
        v = np.asarray(v, dtype=float)
        return scale / np.maximum(v, 1e-9)          # the axis starts at 0 ms: an MFU there is off any scale

    right = ax.secondary_yaxis("right", functions=(turn, turn))
    lowest, highest = scale / ax.get_ylim()[1], min(100.0, 1.25 * scale / fastest_ms)   # the axis's top, the best
    step = 10 if highest - lowest > 30 else 5
    ticks = [m for m in range(step, 101, step) if lowest <= m <= highest]
    right.set_yticks(ticks)
    right.set_yticklabels([f"{m}%" for m in ticks])
    right.set_ylabel("MFU, of the dense bf16 peak (model FLOPs)", fontsize=8)
    right.tick_params(labelsize=7)


def plot_frontier(docs: Sequence[dict], root=None):
    """Per memory-plan frontier (``results.budget_results``): step time against measured peak memory (predicted
    where none was measured), the plans joined by a line from the smallest (every layer offloaded) to keeping
    everything, the README recipe and no checkpointing as their own markers, each plan labelled with its choices;
    MFU on the right-hand axis (:func:`_mfu_axis`)."""
    from .results import frontier_peers, frontier_rows, run_of, weights_text
    plt = _plt()
    cols = min(3, len(docs))
    rows_ = -(-len(docs) // cols)
    fig, grid = plt.subplots(rows_, cols, figsize=(5.6 * cols, 4.9 * rows_), squeeze=False)
    for ax in grid.flat[len(docs):]:
        ax.remove()                                           # a short last row
    labels = []
    for ax, doc in zip(grid.flat, docs):
        rows = [r for r in frontier_rows(doc, frontier_peers(doc, root)) if r["ms"] is not None]
        searched = [r for r in rows if r["searched"] is not None and (r["peak"] or r["predicted"])]
        if searched:
            ax.plot([(r["peak"] or r["predicted"]) / 2**30 for r in searched], [r["ms"] for r in searched], ".",
                    color=_GREY, ms=5, label="exhaustive search: next-best plans per budget")
        for r, marker in zip((r for r in rows if r["peer"] and r["peak"]), "DPX*"):
            ax.plot([r["peak"] / 2**30], [r["ms"]], marker, color=_RED, ms=6, alpha=0.85, label=r["name"])
        plans = [r for r in rows if r["budget"] is not None]
        x = [(r["peak"] or r["predicted"]) / 2**30 for r in plans]
        ax.plot(x, [r["ms"] for r in plans], "o-", color=_BLUE, label="memory plan, per budget")
        labels.append((ax, [(xi, r["ms"], r["name"].split(": ", 1)[-1]) for xi, r in zip(x, plans, strict=True)]))
        for peer, marker, color in ((next((r for r in rows if r["name"].startswith("offload x2")), None), "s",
                                      _ORANGE),
                                     (next((r for r in rows if r["name"] == "no checkpointing"), None), "^", _GREY)):
            if peer is not None and (peer["peak"] or peer["predicted"]):
                ax.plot([(peer["peak"] or peer["predicted"]) / 2**30], [peer["ms"]], marker, color=color, ms=8,
                        label=peer["name"], alpha=0.8)
        c = doc["config"]
        floor = "Liger floor" if c.get("kernels") == "liger" else "default floor"
        ax.set_title(f"{c['model']} {weights_text(c)}, {c.get('num_layers')} layers, {c.get('tokens_per_step')} "
                     f"tokens/step, {floor}\n"
                     f"{_where(doc)} ({run_of(doc)})", fontsize=8.5)
        ax.set_xlabel("peak memory, GiB" + ("" if plans and plans[0]["peak"] else " (predicted)"), fontsize=8)
        ax.set_ylabel("step ms (median; lower is better)", fontsize=8)
        shown = [r for r in rows if r["budget"] is not None or r["searched"] is not None or r["peer"]
                 or r["name"].startswith("offload x2") or r["name"] == "no checkpointing"]
        ax.set_ylim(0, 1.12 * max(r["ms"] for r in shown or rows))
        ax.margins(x=0.15)                                   # room for the last plan's label
        _mfu_axis(ax, doc, min(r["ms"] for r in shown or rows))
        ax.legend(fontsize=6.5, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    fig.suptitle("the memory plan's frontier", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.985))                 # the title above the first row's panel titles
    for ax, points in labels:                                # after the layout: the overlaps are the final ones
        _labels_apart(ax, points)
    return fig


def peer_rows(peer: Sequence[dict], same: Sequence[dict]) -> list[tuple[str, float, int | None, int | None]]:
    """One comparison of :func:`.results.peer_results` as rows ``(name, median step ms, peak bytes, host syncs)``:
    the peer's runs first, then our transformers default / all naive / all fast per kernel floor."""
    from .results import PEER_OUR_VARIANTS
    rows = [(v["name"], v["step_ms"]["median"], v.get("peak_mem_bytes"), v.get("host_syncs_per_step"))
            for d in peer for v in d["variants"] if "step_ms" in v]
    def name(v):     # older runs' all naive ran transformers' eager per-expert loop: their label says so
        loop = v["name"] == "all naive" and v.get("toggles", {}).get("moe") == "naive"
        return v["name"] + (", eager-loop experts" if loop else "")

    rows += [(f"fastsft {name(v)} ({d['config']['kernels']}, autocast {d['config'].get('autocast', 'none')})",
              v["step_ms"]["median"], v.get("peak_mem_bytes"), v.get("host_syncs_per_step"))
             for d in same for v in d["variants"] if v["name"] in PEER_OUR_VARIANTS and "step_ms" in v]
    return rows


def plot_peer(comparisons: Sequence[tuple[Sequence[dict], Sequence[dict]]]):
    """Unsloth against our variants, one row of panels per model (:func:`.results.peer_results`): speed relative
    to the peer's first run, and peak GPU memory. None when nothing was measured."""
    charts = [(f"{p[0]['config'].get('model')} x{p[0]['config'].get('num_layers')}", peer_rows(p, s))
              for p, s in comparisons]
    charts = [(t, rows) for t, rows in charts if rows]
    if not charts:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(charts), 2, figsize=(12, 3.2 * len(charts)), squeeze=False)
    for (title, rows), (a1, a2) in zip(charts, axes):
        names = [r[0] for r in rows]
        a1.barh(names, [rows[0][1] / r[1] for r in rows], color=_BLUE)
        a1.set_xlabel(f"speed vs {rows[0][0]} ({HIGHER})")
        a1.set_title(f"{title} | {_where(comparisons[0][0][0])}", loc="left", fontsize=9)
        a2.barh(names, [r[2] / 2**30 if r[2] else float("nan") for r in rows], color=_ORANGE)
        for y, r in enumerate(rows):
            if not r[2]:                      # a peak the run did not record is drawn as missing, not as zero
                a2.text(0, y, " not recorded", va="center", fontsize=7, color=_GREY)
        a2.set_xlabel("peak GPU memory, GiB (lower is better)")
        a2.set_yticklabels([])
    fig.tight_layout()
    return fig


def plot_loss_curves(doc: dict):
    """A committed loss-curve run (``benchmarks/soak.py --what curves``): every curve it holds against the step, the
    fast path dashed; the title names the model, depth, tokens, kernel floor and autocast (soak.py sets neither), the
    number of steps and the run."""
    plt = _plt()
    c = doc["config"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    for name, ys in doc["losses"].items():
        ax.plot(ys, label=name, ls="--" if "fast" in name else "-")
    steps = len(next(iter(doc["losses"].values()), []))
    ax.set_xlabel("step"); ax.set_ylabel("loss (lower is better)"); ax.legend(fontsize=8)
    ax.set_title(f"{steps} steps: {c.get('preset')} x{c.get('num_layers')} layers | {c.get('tokens_per_step')} tokens/step "
                 f"| kernels none | autocast none ({c.get('dtype')} weights) | {_where(doc)}, "
                 f"{doc.get('env', {}).get('date', '')[:10]}", fontsize=8)
    fig.tight_layout()
    return fig


__all__ = ["save_figure", "plot_result", "plot_limit_gap", "plot_waterfall", "plot_regime", "plot_offload_result",
           "plot_across_tokens", "plot_sweep", "plot_timeline", "plot_timelines", "plot_host_device_timeline",
           "plot_offload_link", "plot_breakdown", "BREAKDOWN_COLORS", "plot_experts_profile", "plot_expert_grouping", "plot_frontier", "peer_rows", "plot_peer",
           "plot_loss_curves"]
