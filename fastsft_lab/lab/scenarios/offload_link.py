"""Benchmark: the double buffer's regime beyond this GPU's link. Host<->device copies paced to slower links.

Why: the published +6.7% of a double buffer over one came from a B200 with the same ~55 GB/s pinned link an H200
has, so what decides the gain is the ratio of copy time to compute time per layer (on an H200 at Qwen3-14B width and
8k tokens: about 0.03, a 3-4% gain). This scenario moves that ratio on one H200 by slowing the link, and measures
plain checkpointing, offload x1 and offload x2 + prefetch at each link bandwidth, next to the timeline model's
prediction (:func:`fastsft_lab.lab.timelines.simulate_schedule`) fed with this run's own per-layer times.

How a link is emulated (:class:`PacedStreamOps`, the library's ``StreamOps`` seam, nothing else hooked): every
offload (D2H) and reload (H2D) copy is split into chunks (default 8 MiB), and after each chunk, on the same copy
stream, a delay makes the chunk's time on that stream ``bytes / target``. Two delays (``method``):

* ``pad`` (default): dummy bytes over the same link in the same direction, ``size * (native / target - 1)`` of them,
  from and to scratch buffers of the pacer's own. The copy engine and the link are busy for exactly the time a slow
  link would take; no SM is used and nothing depends on clocks. The result: a link of ``target`` GB/s.
* ``sleep``: ``torch.cuda._sleep`` (a spinning one-thread kernel) for the missing time, calibrated once in SM cycles
  per ms under a matmul load. No extra link traffic, but it is a kernel: it waits for an SM slot when compute
  fills the GPU, holds one while it spins, and counts SM cycles, whose rate moves with the clocks. On an H200
  (2026-12-03) it missed its targets by -14% to +19% and the backward of x2 ran 5% slower at 3 GB/s (the held SM
  slot, presumably); kept for comparison.

Either way compute on the main stream overlaps the delay as it would overlap a slow copy, and no host sync is
added. The traced step of every variant measures the bandwidth the paced copies really reached (copy-stream CUDA
events), and the charts use that.

"A faster GPU per byte": pacing can only slow a link, so bandwidths above the native one cannot be emulated. What
matters is the ratio copy time / compute time per layer: a GPU ``f`` times faster per copied byte at the native
link has the ratio this GPU has at ``native / f``. The x-axis is the link bandwidth with the ratio (and that
equivalent speed-up) on a second axis; a B200 at ~55 GB/s sits, by its spec sheet against the H200 (1.7x HBM
bandwidth, 2.3x dense bf16), at about ``native / 2.3 .. native / 1.7`` here (an estimate, drawn as a band).

GPU default (about 2 min of GPU time on an H200): Qwen3-14B width, 8 layers, NF4 + LoRA r16, sdpa, one row of 8192
tokens; native link and 40, 25, 12, 6, 3 GB/s; warm-up 1, 4 measured steps, all variants interleaved step by step in
one harness run; one traced step per offload variant. Smoke (CPU): tiny-qwen3, seconds. A CPU has no link and no
streams: the copies are chunked (the same code path, checked for bit-identical results) but not delayed, no
bandwidth is reported as measured, and the timeline model is fed CPU durations (a code-path check only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import statistics
from typing import Any, Sequence

import torch
from torch import nn

from ..._compat import cuda_sleep
from ...data import benchmark_batches
from ...models import LoraSettings, build_model, get_preset
from ...structure import base_model
from ...offload import OffloadSettings, PinnedPool, StreamOps
from ...toggles import apply
from ..harness import (Variant, count_step_syncs, format_derived, format_table, make_optimizer, make_result,
                       run_variants, write_json)
from ..plots import plot_offload_link, save_figure
from ..scenario import OptionError, Scenario, option
from ..timelines import copy_overlap, simulate_schedule, span_ms
from .offload import make_variants, measure_bandwidth, trace_step

PUBLISHED_GAIN = 0.067           # Unsloth's double buffer over one: Qwen3-14B on a B200 (~55 GB/s pinned link)
B200_VS_H200 = (1.7, 2.3)        # B200 / H200 per byte copied: HBM bandwidth (8 / 4.8 TB/s), dense bf16 (2.25 / 0.99 PF)
MODES = {"offload1": (1, False, "offload x1"), "offload2": (2, False, "offload x2"),
         "offload2p": (2, True, "offload x2 + prefetch")}


# --- pacing arithmetic ---------------------------------------------------------------------------------------------
def pace_plan(nbytes: int, *, target_gbps: float | None, native_gbps: float, chunk_bytes: int,
              method: str = "pad", cycles_per_ms: float | None = None) -> list[tuple[int, int, int]]:
    """``(offset, size, extra)`` per chunk of a copy of ``nbytes`` paced to ``target_gbps``.

    ``extra`` makes the chunk's time on the copy stream ``size / target_gbps`` on top of its native copy time
    ``size / native_gbps``: dummy bytes over the link (``method="pad"``: ``size * (native / target - 1)``) or SM
    clock cycles of sleep (``"sleep"``: the missing ms times ``cycles_per_ms``). ``target_gbps=None`` (native) is one
    chunk with nothing extra; a target at or above the native link gets nothing extra (a link cannot be sped up).
    """
    if nbytes < 0 or chunk_bytes <= 0:
        raise ValueError(f"need nbytes >= 0 and chunk_bytes > 0, got {nbytes}, {chunk_bytes}")
    if method not in ("pad", "sleep"):
        raise ValueError(f"method must be 'pad' or 'sleep', got {method!r}")
    if target_gbps is None:
        return [(0, nbytes, 0)]
    if target_gbps <= 0 or native_gbps <= 0 or (method == "sleep" and not (cycles_per_ms or 0) > 0):
        raise ValueError(f"bandwidths (and cycles_per_ms for 'sleep') must be > 0, got {target_gbps}, "
                         f"{native_gbps}, {cycles_per_ms}")
    plan = []
    for off in range(0, nbytes, chunk_bytes):
        size = min(chunk_bytes, nbytes - off)
        extra_ms = max(0.0, size / (target_gbps * 1e6) - size / (native_gbps * 1e6))     # bytes / (GB/s) -> ms
        extra = extra_ms * native_gbps * 1e6 if method == "pad" else extra_ms * (cycles_per_ms or 0.0)
        plan.append((off, size, round(extra)))
    return plan


@dataclasses.dataclass
class LinkPacer:
    """One emulated link: target bandwidth (None: the native link, unpaced), the native bandwidths the delay is
    computed against (per direction, measured with the same chunking), the chunk size, the method (``pad`` or
    ``sleep``, see the module docstring), the sleep calibration, and the pad scratch size (one pinned host and one
    device buffer, made on first use and shared by every :class:`PacedStreamOps` of this pacer)."""

    target_gbps: float | None
    native_gbps: dict = dataclasses.field(default_factory=lambda: {"d2h": 1.0, "h2d": 1.0})
    cycles_per_ms: float | None = None
    chunk_bytes: int = 8 << 20
    method: str = "pad"
    scratch_bytes: int = 64 << 20
    _scratch: tuple | None = dataclasses.field(default=None, repr=False)

    def plan(self, nbytes: int, kind: str) -> list[tuple[int, int, int]]:
        return pace_plan(nbytes, target_gbps=self.target_gbps, native_gbps=self.native_gbps[kind],
                         chunk_bytes=self.chunk_bytes, method=self.method, cycles_per_ms=self.cycles_per_ms)

    def scratch(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(host, device)`` byte buffers the pad copies read and write (their contents are never used)."""
        if self._scratch is None:
            self._scratch = (torch.empty(self.scratch_bytes, dtype=torch.uint8, pin_memory=True),
                             torch.empty(self.scratch_bytes, dtype=torch.uint8, device=device))
        return self._scratch


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("a paced copy needs contiguous tensors (the manager's pool and staging views are)")
    return t.reshape(-1).view(torch.uint8)


class PacedStreamOps(StreamOps):
    """:class:`~fastsft_lab.offload.StreamOps` whose copies are chunked and paced to ``pacer``'s link (CUDA).

    The log and the trace are the unpaced ones (the same ``access`` operations; one trace interval per copy, from
    before its first chunk to after its last delay). On a CPU the copies are chunked but not delayed. Counters (host
    integers, no sync) of the copies issued since construction: :meth:`counts`.
    """

    def __init__(self, device: torch.device, pacer: LinkPacer | None):
        super().__init__(device)
        self.pacer = pacer
        self.bytes = {"d2h": 0, "h2d": 0}
        self.copies = {"d2h": 0, "h2d": 0}
        self.chunks = 0
        self.pad_bytes = 0
        self.sleep_cycles = 0

    def counts(self) -> dict:
        return {"copy_bytes": dict(self.bytes), "copies": dict(self.copies), "chunks": self.chunks,
                "pad_bytes": self.pad_bytes, "sleep_cycles": self.sleep_cycles}

    def delay(self, kind: str, extra: int) -> None:
        """On the current (copy) stream: ``extra`` dummy bytes over the link in ``kind``'s direction (``pad``) or
        ``extra`` SM cycles of sleep. Nothing on a CPU (no link to emulate)."""
        if extra <= 0:
            return
        if self.pacer.method == "sleep":
            self.sleep_cycles += extra
            if self.cuda:
                cuda_sleep(int(extra))
            return
        self.pad_bytes += extra
        if not self.cuda:
            return
        host, dev = self.pacer.scratch(self.device)
        dst, src = (dev, host) if kind == "h2d" else (host, dev)
        while extra > 0:
            n = min(extra, dst.numel())
            dst[:n].copy_(src[:n], non_blocking=True)
            extra -= n

    def copy(self, stream: str, dst: torch.Tensor, src: torch.Tensor, reads: tuple, writes: tuple, kind: str,
             layer: int, seq: int) -> None:
        nbytes = src.numel() * src.element_size()
        self.bytes[kind] += nbytes
        self.copies[kind] += 1
        if self.pacer is None or self.pacer.target_gbps is None:
            self.chunks += 1
            return super().copy(stream, dst, src, reads, writes, kind, layer, seq)
        plan = self.pacer.plan(nbytes, kind)
        self.access(stream, reads, "r")
        self.access(stream, writes, "w")
        d, s_ = _flat_bytes(dst), _flat_bytes(src)
        trace = self.trace
        s = self.stream(stream) if self.cuda else None
        t0 = trace.mark(s) if trace else None
        with torch.cuda.stream(s) if self.cuda else contextlib.nullcontext():
            for off, size, extra in plan:
                d[off:off + size].copy_(s_[off:off + size], non_blocking=self.cuda)
                self.delay(kind, extra)
        self.chunks += len(plan)
        if trace:
            trace.add(kind, stream, layer, seq, t0, trace.mark(s))


# --- calibration (CUDA) --------------------------------------------------------------------------------------------
def calibrate_sleep(device: torch.device, cycles: tuple[int, int] = (1 << 20, 1 << 23), reps: int = 4,
                    load: bool = True) -> dict:
    """SM clock cycles per ms of ``torch.cuda._sleep`` on a side stream, optionally with matmuls on the main stream
    (a busy GPU's clocks). The slope between two lengths, so launch latency drops out."""
    side = torch.cuda.Stream(device=device)
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) if load else None
    if a is not None:
        for _ in range(20):      # bring the clocks up
            a @ a
    times = []
    for n in cycles:
        if a is not None:                    # load
            side.wait_stream(torch.cuda.current_stream(device))
            for _ in range(12 * reps):
                a @ a
        with torch.cuda.stream(side):
            cuda_sleep(n)            # warm-up of this length
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(side)
            for _ in range(reps):
                cuda_sleep(n)
            end.record(side)
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    torch.cuda.synchronize(device)
    slope = (cycles[1] - cycles[0]) / (times[1] - times[0])
    return {"cycles_per_ms": round(slope, 1), "sm_clock_mhz_equivalent": round(slope / 1e3, 1),
            "under_matmul_load": load, "sleep_ms": [round(t, 4) for t in times], "cycles": list(cycles)}


def measure_chunked_bandwidth(device: torch.device, chunk_bytes: int, nbytes: int = 256 << 20, reps: int = 3) -> dict:
    """Native GB/s per direction of back-to-back ``chunk_bytes`` copies on a side stream (the pacing's baseline)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(torch.cuda.current_stream(device))
    out = {}
    with torch.cuda.stream(side):
        for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            dst.copy_(src, non_blocking=True)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(side)
            for _ in range(reps):
                for off in range(0, nbytes, chunk_bytes):
                    dst[off:off + chunk_bytes].copy_(src[off:off + chunk_bytes], non_blocking=True)
            end.record(side)
            end.synchronize()
            out[name] = round(nbytes * reps / (start.elapsed_time(end) * 1e6), 2)
    torch.cuda.synchronize(device)
    del host, dev
    return out


def paced_copy_gbps(device: torch.device, pacer: LinkPacer, kind: str = "h2d", nbytes: int = 64 << 20,
                    reps: int = 3) -> float:
    """GB/s that :class:`PacedStreamOps` reaches on one isolated copy of ``nbytes`` (CUDA events on its stream)."""
    ops = PacedStreamOps(device, pacer)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst, src = (dev, host) if kind == "h2d" else (host, dev)
    s = ops.stream("copy")
    s.wait_stream(torch.cuda.current_stream(device))
    ops.copy("copy", dst, src, ("a",), ("b",), kind, 0, 0)          # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(s)
    for _ in range(reps):
        ops.copy("copy", dst, src, ("a",), ("b",), kind, 0, 0)
    end.record(s)
    end.synchronize()
    return nbytes * reps / (start.elapsed_time(end) * 1e6)


# --- the timeline model ----------------------------------------------------------------------------------------------
def model_step_ms(inputs: dict, copy_ms: float, buffers: int, num_layers: int | None = None) -> float:
    """Step time the timeline model predicts: plain checkpointing's measured step plus the copy time the schedule
    exposes (span with copies minus span without), for ``num_layers`` layers (default the measured depth)."""
    n = num_layers or inputs["num_layers"]
    kw = dict(fwd_ms=inputs["fwd_ms"], bwd_ms=inputs["bwd_ms"], head_ms=inputs["head_ms"], buffers=buffers)
    exposed = span_ms(simulate_schedule(n, copy_ms=copy_ms, **kw)) - span_ms(simulate_schedule(n, copy_ms=0.0, **kw))
    base = inputs["plain_step_ms"] + (n - inputs["num_layers"]) * (inputs["fwd_ms"] + inputs["bwd_ms"])
    return base + exposed


def model_inputs(events: Sequence[dict], plain_step_ms: float, layer_bytes: int) -> dict:
    """Per-layer forward and recompute+backward medians, the time between the last layer forward and the first
    layer backward (LM head, loss and their backward: ``head_ms``), from one traced step."""
    fwd = [e for e in events if e["kind"] == "fwd"]
    bwd = [e for e in events if e["kind"] == "bwd"]
    head = min(e["start_ms"] for e in bwd) - max(e["end_ms"] for e in fwd)
    return {"num_layers": len(fwd), "fwd_ms": round(statistics.median(e["end_ms"] - e["start_ms"] for e in fwd), 4),
            "bwd_ms": round(statistics.median(e["end_ms"] - e["start_ms"] for e in bwd), 4),
            "head_ms": round(max(0.0, head), 4), "plain_step_ms": plain_step_ms, "layer_bytes": layer_bytes}


def link_measured(events: Sequence[dict], counts: dict) -> dict:
    """Copy-stream time per byte of the traced step's copies: GB/s per direction and the per-copy median ms."""
    out: dict[str, Any] = {}
    for kind in ("d2h", "h2d"):
        ms = [e["end_ms"] - e["start_ms"] for e in events if e["kind"] == kind]
        total = sum(ms)
        out[f"{kind}_gbps"] = round(counts["copy_bytes"][kind] / (total * 1e6), 3) if total > 0 else None
        out[f"{kind}_copy_ms_median"] = round(statistics.median(ms), 4) if ms else None
    vals = [v for v in (out["d2h_gbps"], out["h2d_gbps"]) if v]
    out["gbps"] = round(statistics.mean(vals), 3) if vals else None
    meds = [v for v in (out["d2h_copy_ms_median"], out["h2d_copy_ms_median"]) if v is not None]
    out["copy_ms_per_layer"] = round(statistics.mean(meds), 4) if meds else None
    return out


def crossing(points: Sequence[tuple[float, float]], level: float) -> float | None:
    """The bandwidth at which ``y`` reaches ``level`` as the link slows (log-linear between the points around it).

    ``points``: ``(gbps, y)``, y growing as the bandwidth falls. Returns the first point's bandwidth when it is at
    ``level`` already, None when no point reaches it."""
    pts = sorted(points, key=lambda p: -p[0])
    if not pts:
        return None
    if pts[0][1] >= level:
        return pts[0][0]
    for (b0, y0), (b1, y1) in zip(pts, pts[1:]):
        if y0 < level <= y1:
            f = (level - y0) / (y1 - y0)
            return round(math.exp(math.log(b0) + f * (math.log(b1) - math.log(b0))), 3)
    return None


# --- variants ----------------------------------------------------------------------------------------------------
class _PacedOffload:
    """enable/disable of one offload mode behind one emulated link; keeps the copy counters of the last step."""

    def __init__(self, buffers: int, prefetch: bool, pacer: LinkPacer | None, device: torch.device,
                 pool: PinnedPool):
        self.buffers, self.prefetch, self.pacer, self.device, self.pool = buffers, prefetch, pacer, device, pool
        self.ops: PacedStreamOps | None = None
        self.last_counts: dict = {}

    def enable(self, model: nn.Module) -> None:
        self.ops = PacedStreamOps(self.device, self.pacer)
        apply(model, offload_buffers=OffloadSettings(self.buffers, self.prefetch, streams=self.ops, pool=self.pool))

    def disable(self, model: nn.Module) -> None:
        if self.ops is not None:
            self.last_counts = self.ops.counts()
        apply(model, offload_buffers="off")


def _label(target: float | None, paced: bool = True) -> str:
    """A variant's link label; on a CPU the copies are chunked but not paced, and the label says so."""
    if target is None:
        return "native"
    return f"{target:g} GB/s" if paced else f"{target:g} GB/s chunks, unpaced (CPU)"


def make_link_variants(model: nn.Module, device: torch.device, targets: Sequence[float | None], modes: Sequence[str],
                       pacer_for) -> tuple[list[Variant], dict]:
    """Plain checkpointing once, then every offload mode at every target (``pacer_for(target) -> LinkPacer``)."""
    plain, _ = make_variants(model, ("standard",), device)
    variants = list(plain)
    meta: dict[str, dict[str, Any]] = {plain[0].name: {"key": "plain", "target_gbps": None, "toggle": None}}
    pool = PinnedPool(pin=device.type == "cuda")        # every mode's, across steps
    for target in targets:
        for key in modes:
            buffers, prefetch, name = MODES[key]
            tog = _PacedOffload(buffers, prefetch, pacer_for(target), device, pool)
            v = Variant(f"{name} @ {_label(target, device.type == 'cuda')}",
                        {"checkpointing": "offload", "offload_buffers": buffers, "prefetch": prefetch,
                         "link_target_gbps": target},
                        enable=tog.enable, disable=tog.disable,
                        note=f"fastsft_lab.offload ({name}) with every D2H/H2D copy "
                             + ("unpaced: the native pinned link." if target is None else
                                f"paced to {target:g} GB/s: chunks on the copy stream, each followed by a delay "
                                "(dummy bytes over the link, or a sleep) that makes its stream time bytes / target "
                                "(CUDA only)."))
            variants.append(v)
            meta[v.name] = {"key": key, "target_gbps": target, "toggle": tog, "buffers": buffers}
    return variants, meta


# --- the run -----------------------------------------------------------------------------------------------------
def _bench(device: torch.device, opts, out_dir: str, progress: bool) -> dict:
    cuda = device.type == "cuda"
    dtype = getattr(torch, opts.dtype)
    quant = None if opts.quant in (None, "none") else opts.quant
    targets_req = [float(b) for b in _as_list(opts.bandwidths)]
    link: dict[str, Any] = {"chunk_bytes": opts.chunk_bytes, "method": opts.method}
    scratch = None
    if cuda:
        link["native_256MiB"] = measure_bandwidth(device)
        link["native_chunked_gbps"] = measure_chunked_bandwidth(device, opts.chunk_bytes)
        native = dict(link["native_chunked_gbps"])
        native_min = min(link["native_256MiB"]["h2d_gbps"], link["native_256MiB"]["d2h_gbps"])
        cycles = None
        if opts.method == "sleep":
            link["sleep_calibration"] = calibrate_sleep(device)
            cycles = link["sleep_calibration"]["cycles_per_ms"]
        else:
            scratch = (torch.empty(opts.scratch_bytes, dtype=torch.uint8, pin_memory=True),
                       torch.empty(opts.scratch_bytes, dtype=torch.uint8, device=device))
        link["how"] = ("chunked pinned copies, each followed on the copy stream by "
                       + ("dummy bytes over the link in the same direction (pad)" if opts.method == "pad" else
                          "torch.cuda._sleep (sleep)") + "; CUDA events on the copy stream measure what it reached")
    else:
        native, native_min, cycles = {"d2h": 1.0, "h2d": 1.0}, None, 1.0
        link["how"] = "CPU: no host-device link; copies chunked, not delayed, no bandwidth measured"
    targets: list[float | None] = [None]
    skipped = []
    for t in targets_req:
        if native_min is not None and t >= native_min:
            skipped.append({"target_gbps": t, "reason": f"at or above the native link ({native_min:.1f} GB/s): a "
                                                        "link can only be slowed; see the copy/compute ratio axis"})
        else:
            targets.append(t)
    print(f"  link: native {native} GB/s (chunks of {opts.chunk_bytes} B), targets "
          f"{[_label(t) for t in targets]}, " + (f"method {opts.method}" if cuda else "CPU: not paced"))

    def pacer_for(target: float | None) -> LinkPacer:
        return LinkPacer(target, native, cycles, opts.chunk_bytes, opts.method, opts.scratch_bytes, scratch)

    model = build_model(opts.preset, device=device, dtype=dtype, quant=quant,
                        lora=LoraSettings(rank=opts.lora_rank) if opts.lora_rank else None,
                        num_layers=opts.num_layers, attn_implementation=opts.attn)
    mcfg = base_model(model).config
    row = min(opts.row_tokens, opts.tokens)
    batches = [b.to(device) for b in benchmark_batches(tokens_per_step=opts.tokens, row_tokens=row,
                                                       steps=max(2, min(opts.steps, 4)),
                                                       vocab_size=mcfg.vocab_size, mix=opts.mix)]
    layer_bytes = opts.tokens * mcfg.hidden_size * torch.finfo(dtype).bits // 8
    variants, meta = make_link_variants(model, device, targets, opts.modes, pacer_for)
    rows = run_variants(model, batches, variants, steps=opts.steps, warmup=opts.warmup, count_syncs=False,
                        progress=progress, label="offload link")
    by = {r["name"]: r for r in rows}
    plain_name = variants[0].name
    plain_ms = by[plain_name].get("step_ms", {}).get("median")
    traces: dict[str, list] = {}
    for v in variants[1:]:
        r, m = by[v.name], meta[v.name]
        if "error" in r:
            continue
        events = trace_step(model, batches[0], v)
        traces[v.name] = events
        counts = m["toggle"].last_counts
        r["copy_overlap"] = copy_overlap(events)
        r["link"] = {"target_gbps": m["target_gbps"], "paced": cuda and m["target_gbps"] is not None,
                     "copy_bytes_per_step": sum(counts["copy_bytes"].values()), **counts}
        if cuda:
            r["link"]["measured"] = link_measured(events, counts)
    # the model's inputs: per-layer times of the native double buffer's traced step (its reloads are hidden)
    ref = next((n for n in (f"{MODES[k][2]} @ native" for k in ("offload2p", "offload2", "offload1")) if n in traces),
               None)
    minputs = model_inputs(traces[ref], plain_ms, layer_bytes) if ref and plain_ms else None
    if minputs:
        minputs["from"] = ref
    points = _points(targets, opts.modes, by, meta, traces, minputs, layer_bytes, cuda)
    syncs = _count_syncs(model, batches[0], variants, meta, targets) if opts.count_syncs else None
    config = {"model": opts.preset, "num_layers": mcfg.num_hidden_layers, "hidden_size": mcfg.hidden_size,
              "quant": quant, "lora_rank": opts.lora_rank, "attn_implementation": opts.attn, "dtype": opts.dtype,
              "tokens_per_step": opts.tokens, "row_tokens": row, "length_mix": opts.mix, "steps": opts.steps,
              "warmup": opts.warmup, "modes": list(opts.modes), "bandwidths_gbps": targets_req,
              "bandwidths_skipped": skipped, "layer_input_bytes": layer_bytes, "link": link,
              "full_depth": opts.full_depth}
    notes = ("Every variant interleaved step by step in one harness run; plain checkpointing has no copies (one "
             "measurement for every link). link.measured: copy-stream CUDA events of one extra traced step per "
             "variant. model_*: fastsft_lab.lab.timelines.simulate_schedule fed this run's per-layer times "
             "(model_inputs), plain checkpointing's step plus the copy time the schedule exposes.")
    if not cuda:
        notes += (" CPU smoke run: no link and no streams; copies chunked but not delayed, no bandwidth measured, "
                  "the model fed synchronous CPU durations (a code-path check, not a prediction).")
    result = make_result("offload_link", config, rows, device, notes)
    result["model_inputs"] = minputs
    result["points"] = points
    result["model_curve"] = _model_curve(minputs, native_min, targets, opts.full_depth) if minputs and cuda else []
    result["derived"] = _derived(points, minputs, native_min, opts, syncs)
    if result["model_curve"]:
        result["derived"]["published_gain_regime_begins_gbps_model_full_depth"] = crossing(
            [(c["gbps"], c["gain_x2_vs_x1_full_depth"]) for c in result["model_curve"]], PUBLISHED_GAIN)
    tag = f"{opts.preset}-{opts.tokens}"
    result["files"] = {"json": os.path.join(out_dir, f"offload-link-{tag}.json"),
                       "png": save_figure(plot_offload_link(result), os.path.join(out_dir, f"offload-link-{tag}.png"))}
    write_json(result, result["files"]["json"])
    if traces:
        write_json({"scenario": "offload_link_timeline", "env": result["env"], "config": config, "timelines": traces},
                   os.path.join(out_dir, f"offload-link-timeline-{tag}.json"))
    print(format_table(result))
    print(f"  {'link':>10s} {'x1 vs plain':>12s} {'x2+p vs plain':>14s} {'x2 over x1':>11s} {'copy/backward':>14s}")
    for p in points:
        where = "native" if p.get("target_gbps") is None else f"{p['target_gbps']:g} GB/s"
        pct = lambda k: f"{p[k] * 100:+.1f}%" if p.get(k) is not None else "-"     # noqa: E731
        print(f"  {where:>10s} {pct('offload1_vs_plain'):>12s} {pct('offload2p_vs_plain'):>14s} "
              f"{pct('gain_x2_vs_x1'):>11s} {p.get('copy_to_backward_ratio', float('nan')):>14.3f}")
    print("  " + format_derived(result["derived"]))
    for m in meta.values():
        if m["toggle"] is not None:
            m["toggle"].pool.clear()
    del model
    if cuda:
        torch.cuda.empty_cache()
    return result


def _points(targets, modes, by, meta, traces, minputs, layer_bytes, cuda) -> list[dict]:
    plain: dict = next((r for n, r in by.items() if meta.get(n, {}).get("key") == "plain"), {})
    plain_ms = plain.get("step_ms", {}).get("median")
    out = []
    for target in targets:
        p: dict[str, Any] = {"target_gbps": target, "plain_ms": plain_ms}
        for key in modes:
            name = f"{MODES[key][2]} @ {_label(target, cuda)}"
            r = by.get(name, {})
            ms = r.get("step_ms", {}).get("median")
            p[f"{key}_ms"] = ms
            p[f"{key}_vs_plain"] = round(ms / plain_ms - 1, 4) if ms and plain_ms else None
            meas = r.get("link", {}).get("measured", {})
            if meas.get("gbps") and "measured_gbps" not in p:
                p["measured_gbps"] = meas["gbps"]
                p["copy_ms_per_layer"] = meas["copy_ms_per_layer"]
            if not cuda and name in traces and "copy_ms_per_layer" not in p:
                p["copy_ms_per_layer"] = link_measured(traces[name], meta[name]["toggle"].last_counts)[
                    "copy_ms_per_layer"]
            if minputs and p.get("copy_ms_per_layer") is not None and ms:
                pred = model_step_ms(minputs, p["copy_ms_per_layer"], MODES[key][0])
                r["model_step_ms"] = p[f"{key}_model_ms"] = round(pred, 3)
                r["model_error"] = p[f"{key}_model_error"] = round(ms / pred - 1, 4)
                if target is not None:
                    r["model_step_ms_at_target"] = round(
                        model_step_ms(minputs, layer_bytes / (target * 1e6), MODES[key][0]), 3)
        if cuda and target is not None and p.get("measured_gbps"):
            p["link_error"] = round(p["measured_gbps"] / target - 1, 4)
        if minputs and p.get("copy_ms_per_layer") is not None:
            p["copy_to_backward_ratio"] = round(p["copy_ms_per_layer"] / minputs["bwd_ms"], 4)
        one, two = p.get("offload1_ms"), p.get("offload2p_ms") or p.get("offload2_ms")
        if one and two:
            p["gain_x2_vs_x1"] = round(one / two - 1, 4)
        m1, m2 = p.get("offload1_model_ms"), p.get("offload2p_model_ms") or p.get("offload2_model_ms")
        if m1 and m2:
            p["model_gain_x2_vs_x1"] = round(m1 / m2 - 1, 4)
        out.append(p)
    return out


def _model_curve(minputs: dict, native: float, targets, full_depth: int) -> list[dict]:
    """The model over a log grid of bandwidths, from the native link down past the slowest target."""
    lo = min([t for t in targets if t] or [native]) / 1.25
    n = 33
    out = []
    for i in range(n):
        gbps = native * (lo / native) ** (i / (n - 1))
        copy = minputs["layer_bytes"] / (gbps * 1e6)
        one, two = model_step_ms(minputs, copy, 1), model_step_ms(minputs, copy, 2)
        d1, d2 = (model_step_ms(minputs, copy, b, full_depth) for b in (1, 2))
        out.append({"gbps": round(gbps, 3), "copy_to_backward_ratio": round(copy / minputs["bwd_ms"], 4),
                    "x1_ms": round(one, 3), "x2_ms": round(two, 3), "gain_x2_vs_x1": round(one / two - 1, 4),
                    "x2_vs_plain": round(two / minputs["plain_step_ms"] - 1, 4),
                    "gain_x2_vs_x1_full_depth": round(d1 / d2 - 1, 4)})
    return out


def _derived(points, minputs, native, opts, syncs) -> dict:
    d: dict[str, Any] = {"published_gain": PUBLISHED_GAIN, "overhead_budget": opts.overhead_budget}
    if native is None:
        d["note"] = "CPU smoke run: no link; nothing here is a link measurement"
    else:
        d["native_link_gbps"] = native
        d["b200_equivalent_gbps"] = [round(native / B200_VS_H200[1], 2), round(native / B200_VS_H200[0], 2)]
    x = [(p.get("measured_gbps") or p["target_gbps"], p) for p in points]
    x = [(b, p) for b, p in x if b]
    gain = [(b, p["gain_x2_vs_x1"]) for b, p in x if p.get("gain_x2_vs_x1") is not None]
    mgain = [(b, p["model_gain_x2_vs_x1"]) for b, p in x if p.get("model_gain_x2_vs_x1") is not None]
    x2key = "offload2p" if "offload2p" in opts.modes else "offload2"
    over = [(b, p[f"{x2key}_vs_plain"]) for b, p in x if p.get(f"{x2key}_vs_plain") is not None]
    over1 = [(b, p["offload1_vs_plain"]) for b, p in x if p.get("offload1_vs_plain") is not None]
    if native is not None:
        d["published_gain_regime_begins_gbps"] = crossing(gain, PUBLISHED_GAIN)
        d["published_gain_regime_begins_gbps_model"] = crossing(mgain, PUBLISHED_GAIN)
        d["x2_stops_paying_gbps"] = crossing(over, opts.overhead_budget)
        d["x1_stops_paying_gbps"] = crossing(over1, opts.overhead_budget)
        errs = [abs(p[k]) for p in points for k in p if k.endswith("_model_error") and p[k] is not None]
        if errs:
            d["model_error_max_abs"] = max(errs)
        lerr = [abs(p["link_error"]) for p in points if p.get("link_error") is not None]
        if lerr:
            d["link_error_max_abs"] = max(lerr)
            d["pacing_within_15pct"] = max(lerr) <= 0.15
    if minputs:
        d["native_copy_to_backward_ratio"] = next((p.get("copy_to_backward_ratio") for p in points
                                                  if p["target_gbps"] is None), None)
    if syncs:
        d["host_syncs"] = syncs
        counts = [v.get("host_syncs_per_step") for v in syncs.values()]
        d["pacing_adds_no_host_syncs"] = len(set(counts)) == 1 and None not in counts
    return d


def _count_syncs(model, batch, variants, meta, targets) -> dict:
    """Host syncs of one untimed step of the native and the slowest paced double buffer (pacing must add none)."""
    offl = [v for v in variants if meta[v.name].get("buffers")]
    most = max((meta[v.name]["buffers"] for v in offl), default=0)
    offl = [v for v in offl if meta[v.name]["buffers"] == most]
    pick = [v for v in offl if meta[v.name]["target_gbps"] is None][:1]
    paced = [v for v in offl if meta[v.name]["target_gbps"] is not None]
    if paced:
        pick.append(min(paced, key=lambda v: meta[v.name]["target_gbps"]))
    opt = make_optimizer(model)
    out = {}
    for v in pick:
        try:
            c = count_step_syncs(model, batch, v, mode="train", optimizer=opt)
            out[v.name] = {"host_syncs_per_step": c["host_syncs_per_step"],
                           "host_syncs_in_layers": c["host_syncs_in_layers"]}
        except Exception as e:  # noqa: BLE001 - e.g. a dispatch mode the counter refuses
            out[v.name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    opt.zero_grad(set_to_none=True)
    return out


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclasses.dataclass
class OffloadLinkOptions:
    preset: str = option("qwen3-14b", kind="str", help="model preset")
    num_layers: int | None = option(8, kind="int?", help="decoder layers kept at real width (none: all)")
    quant: str | None = option("nf4", kind="str?", help="nf4 (QLoRA) or none")
    lora_rank: int = option(16, kind="int", help="LoRA rank (0: full fine-tuning)")
    attn: str = option("sdpa", kind="str", help="transformers attention implementation")
    dtype: str = option("bfloat16", kind="str", help="compute dtype")
    tokens: int = option(8192, kind="int", help="tokens per step")
    row_tokens: int = option(8192, kind="int", help="tokens per packed row")
    mix: str = option("realistic", kind="str", help="length mix")
    bandwidths: list = option([40, 25, 12, 6, 3], kind="any",
                              help="emulated link bandwidths, GB/s (the native link is always measured too; "
                                   "targets at or above it are skipped)")
    modes: list = option(["offload1", "offload2p"], kind="strs", help=f"offload modes, from {', '.join(MODES)}")
    chunk_bytes: int = option(8 << 20, kind="int", help="bytes per paced chunk (one delay after each)")
    method: str = option("pad", kind="str", help="delay: pad (dummy bytes over the link: no SM used, no clock "
                                                 "dependence) or sleep (torch.cuda._sleep: holds an SM slot)")
    scratch_bytes: int = option(64 << 20, kind="int", help="pad scratch buffers, bytes (one pinned, one on the GPU)")
    count_syncs: bool = option(True, kind="bool", help="count host syncs of the native and the slowest x2 (untimed)")
    overhead_budget: float = option(0.03, kind="float", help="x2's overhead over plain checkpointing at which "
                                                             "offload 'stops paying' (the project's 3% target)")
    full_depth: int = option(40, kind="int", help="depth of the model's full-depth gain curve (Qwen3-14B: 40)")
    steps: int = option(4, kind="int", help="measured steps per variant")
    warmup: int = option(1, kind="int", help="warm-up steps per variant")

    @classmethod
    def defaults(cls, device: torch.device, smoke: bool) -> "OffloadLinkOptions":
        if smoke:
            return cls(preset="tiny-qwen3", num_layers=None, lora_rank=8,
                       dtype="float32" if device.type == "cpu" else "bfloat16", tokens=256, row_tokens=128,
                       mix="short", bandwidths=[12, 3], count_syncs=False, steps=2, warmup=1,
                       # several chunks per tiny copy on a CPU (the slicing path); on a GPU chunks that small would
                       # be latency-bound, and the pad arithmetic assumes they move at the native bandwidth
                       chunk_bytes=(24 << 10) if device.type == "cpu" else (8 << 20))
        return cls()


class OffloadLinkScenario(Scenario):
    name = "offload_link"
    title = "offloaded checkpointing behind emulated slower host links (single vs double buffer vs plain)"
    Options = OffloadLinkOptions

    def validate(self, opts: OffloadLinkOptions, device: torch.device) -> None:
        super().validate(opts, device)
        get_preset(opts.preset)
        bws = _as_list(opts.bandwidths)
        if not all(isinstance(b, (int, float)) and not isinstance(b, bool) and b > 0 for b in bws):
            raise OptionError(f"bandwidths must be positive numbers (GB/s), got {opts.bandwidths!r}")
        bad = [m for m in opts.modes if m not in MODES]
        if bad or not opts.modes:
            raise OptionError(f"unknown offload mode(s) {bad or opts.modes!r}; known: {', '.join(MODES)}")
        if opts.chunk_bytes <= 0 or opts.scratch_bytes <= 0:
            raise OptionError(f"chunk_bytes and scratch_bytes must be > 0, got {opts.chunk_bytes}, "
                              f"{opts.scratch_bytes}")
        if opts.method not in ("pad", "sleep"):
            raise OptionError(f"method must be pad or sleep, got {opts.method!r}")
        if opts.quant not in (None, "nf4", "none"):
            raise OptionError(f"quant must be nf4 or none, got {opts.quant!r}")
        if opts.dtype not in ("bfloat16", "float16", "float32"):
            raise OptionError(f"dtype must be bfloat16, float16 or float32, got {opts.dtype!r}")

    def run(self, opts: OffloadLinkOptions, *, device: torch.device, out_dir: str, progress: bool = True) -> list[dict]:
        return [_bench(device, opts, out_dir, progress)]


__all__ = ["OffloadLinkScenario", "OffloadLinkOptions", "PacedStreamOps", "LinkPacer", "pace_plan",
           "calibrate_sleep", "measure_chunked_bandwidth", "paced_copy_gbps", "model_step_ms", "model_inputs",
           "link_measured", "crossing", "make_link_variants", "PUBLISHED_GAIN", "B200_VS_H200"]
