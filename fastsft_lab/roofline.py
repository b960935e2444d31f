"""What bounds each kernel: compute, memory bandwidth, or latency -- the roofline, kernel by kernel.

A kernel that does ``F`` floating-point operations and moves ``B`` bytes takes, at best, on this device::

    ideal = max(F / peak_flops, B / peak_bandwidth)          # its roofline time

and a kernel of measured time ``t`` gets one class (:func:`classify`):

    latency   ideal < LATENCY_FRACTION (10%) of t and each kernel shorter than LATENCY_MAX_S (50 us): it comes near
              neither peak -- too small to fill the device or too short to hide its launch (launch-bound). Fewer,
              larger kernels (fusion, CUDA graphs) help; faster math or fewer bytes do not. A longer kernel near
              neither peak is ``unknown``: its estimate is missing or it uses the device badly -- not launch overhead.
    compute   otherwise, where F / peak_flops >= B / peak_bandwidth (arithmetic intensity F / B at or above the
              ridge peak_flops / peak_bandwidth): only fewer FLOPs or faster math help.
    memory    otherwise: bandwidth-bound; only fewer bytes moved (fusion, smaller dtypes) help.

A kernel with neither estimate (no launching op recorded: a Triton kernel launched from Python) is latency when it is
shorter than :data:`UNKNOWN_LATENCY_S`, else ``unknown`` -- reported as such, never guessed.

FLOPs (:func:`op_flops`): the launching op's formula -- matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``, in place
too, ``_grouped_mm``: 2·M·N·K) and attention (SDPA's flash / efficient / cuDNN / CPU kernels, flash and efficient
attention: 2·B·H·L·S·(D + Dv), halved when causal, x2.5 for a backward; varlen rows counted as if every sequence were
``max_seqlen`` long and windows ignored, so an upper bound) -- else the profiler's own count (``with_flops``), else 0.
Bytes (:func:`op_bytes`): the op's tensor inputs (``record_shapes``; a tensor list's elements taken as 16-bit on a GPU,
32-bit on a CPU: the profiler records their shapes, not their dtype) plus its output -- a matmul's product; an
in-place op writes its first input back; any other op is taken to write as much as its largest input (elementwise ops,
copies; a reduction writes less, so it is called memory-bound a little early). Device memcpy / memset are memory.

Peaks (:func:`device_peaks`): the data sheets of known GPUs (:data:`CARDS`: dense tensor-core math, HBM bandwidth);
any other device -- every CPU among them -- is measured once per process: a large matmul in 16-bit and in float32, and
a large copy (read + write). ``Peaks.source`` says which.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch

LATENCY_FRACTION = 0.10       # below this share of its roofline time a kernel is latency-bound ...
LATENCY_MAX_S = 50e-6         # ... if it is short: a longer one near neither peak is "unknown" (an estimate missing,
                              # or a kernel that uses the device badly), never launch overhead
UNKNOWN_LATENCY_S = 10e-6     # a kernel with no estimate is latency below this, else "unknown"
BOUNDS = ("compute", "memory", "latency", "unknown")


@dataclass(frozen=True)
class Peaks:
    """A device's peaks: ``flops`` per precision (``"16-bit"``: bf16/fp16 tensor cores, ``"tf32"``, ``"fp32"``) in
    FLOP/s, ``bandwidth`` in bytes/s, and where they come from (``source``: a data sheet, or measured here)."""

    flops: dict
    bandwidth: float
    source: str

    def flops_for(self, precision: str) -> float:
        return self.flops.get(precision) or self.flops["fp32"]

    def as_dict(self) -> dict:
        return {"flops": dict(self.flops), "bandwidth": self.bandwidth, "source": self.source}


# Data-sheet peaks, dense (no sparsity): (16-bit, TF32, FP32) FLOP/s and HBM bytes/s. A GPU matches the first entry
# whose words all appear in its name (so "H100 PCIe" before "H100", "L40S" before "L4").
CARDS: list[tuple[tuple[str, ...], str, tuple[float, float, float], float]] = [
    (("H200",), "H200", (989e12, 495e12, 67e12), 4.8e12),
    (("H100", "PCIe"), "H100 PCIe", (756e12, 378e12, 51e12), 2.0e12),
    (("H100", "NVL"), "H100 NVL", (835e12, 418e12, 60e12), 3.9e12),
    (("H100",), "H100 SXM", (989e12, 495e12, 67e12), 3.35e12),
    (("B200",), "B200", (2250e12, 1100e12, 80e12), 8.0e12),
    (("A100", "80GB"), "A100 80GB", (312e12, 156e12, 19.5e12), 2.039e12),
    (("A100",), "A100 40GB", (312e12, 156e12, 19.5e12), 1.555e12),
    (("L40S",), "L40S", (362e12, 183e12, 91.6e12), 0.864e12),
    (("L4",), "L4", (121e12, 60e12, 30.3e12), 0.3e12),
    (("A10G",), "A10G", (70e12, 35e12, 31.2e12), 0.6e12),
    (("T4",), "T4", (65e12, 8.1e12, 8.1e12), 0.32e12),                # fp16 tensor cores; no TF32
    (("RTX 4090",), "RTX 4090", (165e12, 82.6e12, 82.6e12), 1.008e12),
    (("RTX 3090",), "RTX 3090", (71e12, 35.6e12, 35.6e12), 0.936e12),
]


def card_peaks(gpu_name: str | None) -> Peaks | None:
    """The data-sheet :class:`Peaks` of a GPU by its name (``torch.cuda.get_device_name``), None if not in CARDS."""
    for words, label, (f16, tf32, fp32), bandwidth in CARDS:
        if gpu_name and all(w in gpu_name for w in words):
            return Peaks({"16-bit": f16, "tf32": tf32, "fp32": fp32}, bandwidth,
                         f"data sheet: {label} ({f16 / 1e12:g} TFLOP/s 16-bit, {bandwidth / 1e12:g} TB/s)")
    return None


_MEASURED: dict[str, Peaks] = {}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(fn, device: torch.device, reps: int = 3) -> float:
    fn()
    best = math.inf
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of the largest square matmul tried (doubling until one takes 20 ms)."""
    n, top = 256, (8192 if device.type == "cuda" else 2048)
    while True:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        seconds = _best_seconds(lambda: a @ b, device)
        if seconds > 0.02 or n >= top:
            return 2 * n ** 3 / seconds
        n *= 2


def _copy_rate(device: torch.device) -> float:
    """bytes/s of a large device-to-device copy (read + write)."""
    size = 64 << 20
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        size = int(min(1 << 30, free // 4))
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * size / _best_seconds(lambda: dst.copy_(src), device, reps=5)


def measure_peaks(device: torch.device | str) -> Peaks:
    """Peaks measured on ``device`` (once per process and device): a 16-bit and a float32 matmul, and a copy."""
    device = torch.device(device)
    key = str(device) if device.type != "cuda" else f"{device}:{torch.cuda.get_device_name(device)}"
    if key not in _MEASURED:
        half = torch.bfloat16 if device.type != "cuda" or torch.cuda.is_bf16_supported() else torch.float16
        fp32 = _matmul_rate(device, torch.float32)       # under this process's TF32 setting
        flops = {"16-bit": _matmul_rate(device, half), "tf32": fp32, "fp32": fp32}
        bandwidth = _copy_rate(device)
        _MEASURED[key] = Peaks(flops, bandwidth, f"measured on {key}: {flops['16-bit'] / 1e12:.3g} TFLOP/s 16-bit, "
                                                 f"{fp32 / 1e12:.3g} fp32, {bandwidth / 1e12:.3g} TB/s copy")
    return _MEASURED[key]


def device_peaks(device: torch.device | str) -> Peaks:
    """The peaks of ``device``: a known GPU's data sheet (:data:`CARDS`), else measured (:func:`measure_peaks`)."""
    device = torch.device(device)
    if device.type == "cuda":
        card = card_peaks(torch.cuda.get_device_name(device))
        if card is not None:
            return card
    return measure_peaks(device)


# --- FLOPs and bytes of one op, from its recorded input shapes ------------------------------------------------------
ITEMSIZE = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8, "long int": 8, "int": 4, "short int": 2,
            "signed char": 1, "unsigned char": 1, "bool": 1, "c10::Float8_e4m3fn": 1, "c10::Float8_e5m2": 1,
            "c10::complex<float>": 8}


def precision(dtype: str | None, device_type: str = "cuda") -> str:
    """The peak an op of input dtype ``dtype`` (the profiler's name) runs against: 16-bit, tf32 or fp32."""
    if dtype in ("c10::BFloat16", "c10::Half"):
        return "16-bit"
    if dtype == "float" and device_type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def _numel(shape) -> int:
    return math.prod(shape) if isinstance(shape, (list, tuple)) and all(isinstance(d, int) for d in shape) else 0


# attention ops: (index of the query, layout of q / k / v, index of is_causal, backward)
_ATTENTION = {
    "_scaled_dot_product_flash_attention": (0, "BHLD", 4, False),
    "_scaled_dot_product_flash_attention_backward": (1, "BHLD", 11, True),
    "_scaled_dot_product_efficient_attention": (0, "BHLD", 6, False),
    "_scaled_dot_product_efficient_attention_backward": (1, "BHLD", 11, True),
    "_scaled_dot_product_cudnn_attention": (0, "BHLD", 6, False),
    "_scaled_dot_product_cudnn_attention_backward": (1, "BHLD", 14, True),
    "_cudnn_attention_forward": (0, "BHLD", 10, False),            # what SDPA's cuDNN path launches (torch 2.9+)
    "_cudnn_attention_backward": (1, "BHLD", 14, True),
    "_scaled_dot_product_flash_attention_for_cpu": (0, "BHLD", 4, False),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (1, "BHLD", 7, True),
    "_flash_attention_forward": (0, "BLHD", 8, False),
    "_flash_attention_backward": (1, "BLHD", 11, True),
    "_efficient_attention_forward": (0, "BLHD", 9, False),     # custom_mask_type: 0 none, else causal
    "_efficient_attention_backward": (1, "BLHD", 14, True),
}
ATTENTION_OPS = frozenset(_ATTENTION)
# varlen (3-D q: total tokens, heads, dim): the index of max_seqlen_k
_VARLEN_MAX_K = {"_flash_attention_forward": 6, "_flash_attention_backward": 9, "_efficient_attention_forward": 7,
                 "_efficient_attention_backward": 9, "_cudnn_attention_forward": 7, "_cudnn_attention_backward": 12}


def _attention_flops(name: str, shapes: Sequence, concrete: Sequence) -> float:
    qi, layout, ci, backward = _ATTENTION[name]
    q, k, v = (list(shapes[qi + j]) if len(shapes) > qi + j else [] for j in range(3))
    varlen = len(q) == 3 and len(k) == 3                   # (T, H, D): packed sequences of at most max_seqlen
    if varlen:
        mk = concrete[_VARLEN_MAX_K[name]] if len(concrete) > _VARLEN_MAX_K.get(name, 99) else None
        b, heads, lq, d = 1, q[1], q[0], q[2]
        s = mk if isinstance(mk, int) and mk > 0 else k[0]
        dv = v[2] if len(v) == 3 else d
    elif len(q) == 4 and len(k) == 4:
        b, d, dv = q[0], q[3], (v[3] if len(v) == 4 else q[3])
        heads, lq, s = (q[1], q[2], k[2]) if layout == "BHLD" else (q[2], q[1], k[1])
    else:
        return 0.0
    flops = 2.0 * b * heads * lq * s * (d + dv)
    causal = concrete[ci] if len(concrete) > ci else None
    if (causal is True or (isinstance(causal, int) and not isinstance(causal, bool) and causal > 0)) \
            and (varlen or lq <= s):
        flops /= 2
    return flops * (2.5 if backward else 1.0)


def _matmul_dims(name: str, s: list) -> tuple[float, int] | None:
    """(FLOPs, output elements) of a matmul op, None for any other op."""
    try:
        if name == "mm":
            (m, k), n = s[0], s[1][1]
            return 2.0 * m * k * n, m * n
        if name in ("addmm", "addmm_"):
            (m, k), n = s[1], s[2][1]
            return 2.0 * m * k * n, m * n
        if name in ("bmm", "baddbmm", "baddbmm_"):
            a, b = (s[0], s[1]) if name == "bmm" else (s[1], s[2])
            return 2.0 * a[0] * a[1] * a[2] * b[2], a[0] * a[1] * b[2]
        if name == "_grouped_mm":
            a, b = s[0], s[1]
            if len(a) == 2 and len(b) == 3:                      # (tokens, K) x (E, K, N): each row one expert
                return 2.0 * a[0] * a[1] * b[2], a[0] * b[2]
            if len(a) == 2 and len(b) == 2:                      # (K, tokens) x (tokens, N) -> (E, K, N)
                groups = s[2][0] if len(s) > 2 and len(s[2]) == 1 else 1
                return 2.0 * a[0] * a[1] * b[1], groups * a[0] * b[1]
            if len(a) == 3 and len(b) == 3:
                return 2.0 * a[0] * a[1] * a[2] * b[2], a[0] * a[1] * b[2]
    except (IndexError, TypeError):
        return None
    return None


def op_flops(name: str, shapes: Sequence, concrete: Sequence = (), profiler_flops: float = 0.0) -> float:
    """FLOPs of one call of op ``name`` with input ``shapes`` (the module docstring's formulas)."""
    short = name.removeprefix("aten::")
    s = [list(x) if isinstance(x, (list, tuple)) else [] for x in shapes]
    if short in _ATTENTION:
        return _attention_flops(short, s, list(concrete))
    mm = _matmul_dims(short, s)
    if mm is not None:
        return mm[0]
    return float(profiler_flops or 0.0)


def op_bytes(name: str, shapes: Sequence, dtypes: Sequence, list_itemsize: int = 2) -> float:
    """Bytes one call of op ``name`` reads and writes: its tensor inputs and its output (module docstring). The
    profiler records a tensor list's shapes (``structured_input_shapes``) but not its dtype: ``list_itemsize``."""
    short = name.removeprefix("aten::")
    sizes = [(sum(_numel(x) for x in s) if d == "TensorList" and isinstance(s, (list, tuple)) else _numel(s),
              list_itemsize if d == "TensorList" else ITEMSIZE.get(d, 0)) for s, d in zip(shapes, dtypes)]
    tensors = [n * size for n, size in sizes if size and isinstance(n, int)]
    if not tensors:
        return 0.0
    first = next(size for _, size in sizes if size)
    if short == "copy_":
        return 2.0 * (tensors[1] if len(tensors) > 1 else tensors[0])
    mm = _matmul_dims(short, [list(x) if isinstance(x, (list, tuple)) else [] for x in shapes])
    if mm is not None:
        out = mm[1] * first
    elif short.endswith("_"):
        out = tensors[0]
    else:
        out = max(tensors)
    return float(sum(tensors) + out)


def classify(seconds: float, flops: float, nbytes: float, peaks: Peaks, precision: str = "16-bit",
             kernels: int = 1) -> str:
    """``"compute"``, ``"memory"``, ``"latency"`` or ``"unknown"`` for a kernel (or an op's ``kernels`` together) of
    ``seconds`` that does ``flops`` and moves ``nbytes`` (the module docstring's rule)."""
    if seconds <= 0:
        return "latency"
    if not flops and not nbytes:
        return "latency" if seconds < UNKNOWN_LATENCY_S else "unknown"
    t_compute = flops / peaks.flops_for(precision)
    t_memory = nbytes / peaks.bandwidth
    if max(t_compute, t_memory) < LATENCY_FRACTION * seconds:
        return "latency" if seconds / max(kernels, 1) < LATENCY_MAX_S else "unknown"
    return "compute" if t_compute >= t_memory else "memory"


def achieved(seconds: float, flops: float, nbytes: float) -> dict[str, Any]:
    """FLOP/s and bytes/s a kernel reached."""
    return {"flops_per_s": flops / seconds if seconds > 0 else 0.0, "bytes_per_s": nbytes / seconds if seconds > 0 else 0.0}


__all__ = ["LATENCY_FRACTION", "LATENCY_MAX_S", "UNKNOWN_LATENCY_S", "BOUNDS", "Peaks", "CARDS", "card_peaks", "measure_peaks",
           "device_peaks", "precision", "op_flops", "op_bytes", "classify", "achieved", "ITEMSIZE", "ATTENTION_OPS"]
