"""Where are we running? Device detection, smoke mode and the version stamp every figure carries."""

from __future__ import annotations

import datetime as _dt
import importlib
import os
import platform

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


def _version(module: str) -> str | None:
    try:
        mod = importlib.import_module(module)
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
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "bitsandbytes": _version("bitsandbytes"),
        "trl": _version("trl"),
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
