"""Where are we running? Device detection, smoke mode and the version stamp every figure carries."""

from __future__ import annotations

import datetime as _dt
import importlib
import os
import platform
from dataclasses import dataclass

import torch


def has_cuda() -> bool:
    return torch.cuda.is_available()


def default_device() -> torch.device:
    return torch.device("cuda") if has_cuda() else torch.device("cpu")


def smoke_mode() -> bool:
    """Tiny sizes for a fast CPU run. ``SMOKE=1``/``0`` (or ``FASTSFT_SMOKE``) forces it; default: on without a GPU."""
    for name in ("FASTSFT_SMOKE", "SMOKE", "SMOKE_TEST"):
        value = os.environ.get(name)
        if value is not None and value != "":
            return value.strip().lower() not in ("0", "false", "no", "off")
    return not has_cuda()


@dataclass(frozen=True)
class DeviceProfile:
    """What a notebook or script can run here: the GPU's name, capability and memory, and the choices they imply.

    Attributes:
        device: ``"cuda"`` or ``"cpu"``.
        name: the GPU's name (``"CPU"`` without one).
        capability: CUDA compute capability, e.g. (7, 5) for a T4, (8, 9) for an L4, (9, 0) for an H100/H200.
        memory_gib: GPU memory (0 on a CPU).
        unified_memory: an integrated GPU sharing host memory (DGX Spark, Jetson): offloading copies to "host"
            memory there move nothing and only cost time, so notebooks skip the double buffer's benchmark.
        dtype: bfloat16 from sm80 (Ampere) on, float16 below (T4), float32 on a CPU.
        flash: torch's flash kernels (the varlen backend) and compiled flex attention need sm80+.
    """

    device: str
    name: str
    capability: tuple[int, int] | None
    memory_gib: float
    unified_memory: bool
    dtype: torch.dtype
    flash: bool

    @property
    def packed_backends(self) -> list[str]:
        """Packed-attention backends that train here, fastest first (sdpa everywhere; varlen and flex on sm80+)."""
        return ["varlen", "sdpa", "flex"] if self.flash else ["sdpa"]

    def pick(self, sizes: dict[str, float]) -> str | None:
        """The first preset of ``{preset: GiB it needs}`` (largest first) that fits in this GPU's memory."""
        for preset, need in sizes.items():
            if need <= self.memory_gib:
                return preset
        return None

    def describe(self) -> str:
        if self.device != "cuda":
            return "CPU: smoke sizes, float32"
        sm = "".join(map(str, self.capability))
        unified = ", unified memory" if self.unified_memory else ""
        return (f"{self.name} (sm{sm}, {self.memory_gib:.0f} GiB{unified}): {str(self.dtype).replace('torch.', '')}, "
                f"packed backends {', '.join(self.packed_backends)}")


# Smaller GPUs, emulated on a larger one (FASTSFT_DEVICE_PROFILE=NAME): their dtype, their kernels and their memory,
# the memory enforced with torch.cuda.set_per_process_memory_fraction, so that a run shows what fits there.
EMULATED_PROFILES: dict[str, dict] = {
    "t4": dict(name="T4-class (emulated)", capability=(7, 5), memory_gib=15.0, dtype=torch.float16, flash=False),
    "24gb": dict(name="24 GB consumer card (emulated)", capability=(8, 9), memory_gib=22.0, dtype=torch.bfloat16,
                 flash=True),
}
PROFILE_ENV = "FASTSFT_DEVICE_PROFILE"


def device_profile(device: torch.device | str | None = None) -> DeviceProfile:
    """The :class:`DeviceProfile` of ``device`` (default: the current CUDA device, else the CPU).

    With ``FASTSFT_DEVICE_PROFILE=t4`` or ``=24gb`` on a larger GPU, the profile of that smaller card instead: its
    dtype (float16 on a T4), its attention kernels (sdpa / eager below sm80) and its memory, capped for this process
    with ``torch.cuda.set_per_process_memory_fraction`` (15 and 22 GiB).
    """
    device = torch.device(device) if device is not None else default_device()
    emulate = os.environ.get(PROFILE_ENV, "").strip().lower()
    if emulate and emulate not in EMULATED_PROFILES:
        raise ValueError(f"{PROFILE_ENV}={emulate!r} is not a device profile; valid: {', '.join(EMULATED_PROFILES)}")
    if device.type != "cuda":
        if emulate:
            raise ValueError(f"{PROFILE_ENV}={emulate} emulates a smaller GPU on a larger one: it needs a CUDA GPU")
        return DeviceProfile("cpu", "CPU", None, 0.0, False, torch.float32, False)
    props = torch.cuda.get_device_properties(device)
    total = props.total_memory / 2**30
    if emulate:
        p = EMULATED_PROFILES[emulate]
        if p["memory_gib"] > total:
            raise ValueError(f"{PROFILE_ENV}={emulate} needs {p['memory_gib']:.0f} GiB; {props.name} has {total:.0f}")
        # the cap takes a device index ("cuda" alone names none: the current device's)
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch.cuda.set_per_process_memory_fraction(p["memory_gib"] / total, index)
        return DeviceProfile("cuda", p["name"], p["capability"], p["memory_gib"], False, p["dtype"], p["flash"])
    cap = (props.major, props.minor)
    sm80 = cap >= (8, 0)
    return DeviceProfile("cuda", props.name, cap, total, bool(getattr(props, "is_integrated", 0)),
                         torch.bfloat16 if sm80 else torch.float16, sm80)


def need_fits(profile: DeviceProfile, need_gib: float, what: str) -> None:
    """Refuse in one line a choice that needs more memory than ``profile`` has, naming both."""
    if profile.device == "cuda" and need_gib > profile.memory_gib:
        raise ValueError(f"{what} needs {need_gib:.0f} GiB; {profile.name} has {profile.memory_gib:.0f} GiB "
                         f"({PROFILE_ENV}={os.environ.get(PROFILE_ENV) or 'unset'}): pick a smaller choice")


def package_version(name: str) -> str | None:
    """The installed version of package ``name``: its distribution metadata (no import; for packages without
    ``__version__`` such as liger-kernel), else the imported module's ``__version__``; None when it is absent."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        pass
    try:
        mod = importlib.import_module(name.replace("-", "_"))
    except Exception:  # noqa: BLE001 - a broken optional package must not break the stamp
        return None
    return getattr(mod, "__version__", "unknown")


def gpu_name(device: torch.device | None = None) -> str | None:
    if not has_cuda():
        return None
    return torch.cuda.get_device_name(device or torch.cuda.current_device())


def environment(device: torch.device | str | None = None) -> dict:
    """The conditions a measurement was taken under (the ``env`` block of every result JSON)."""
    device = torch.device(device) if device is not None else default_device()
    env = {
        "device": device.type,
        "gpu_name": gpu_name() if device.type == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": package_version("transformers"),
        "peft": package_version("peft"),
        "bitsandbytes": package_version("bitsandbytes"),
        "trl": package_version("trl"),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["gpu_memory_bytes"] = props.total_memory
        env["gpu_sm_count"] = props.multi_processor_count
        env["driver"] = _nvidia_driver()
    return env


def _nvidia_driver() -> str | None:
    try:
        import subprocess

        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=False,
        )
        return out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    except Exception:  # noqa: BLE001
        return None


def describe() -> str:
    """One line for the top of a notebook: where this ran."""
    env = environment()
    where = f"GPU {env['gpu_name']}" if env["device"] == "cuda" else f"CPU ({env['cpu_count']} cores)"
    return (f"{where} | torch {env['torch']} | transformers {env['transformers']} | peft {env['peft']} | "
            f"bitsandbytes {env['bitsandbytes']} | smoke={smoke_mode()} | {env['date']}")
