"""Device selection for notebooks and scripts, tested on a CPU with faked GPU properties."""

from types import SimpleNamespace

import pytest
import torch

from fastsft_lab import env

GPUS = {  # name: (major, minor, GiB, integrated) -> (dtype, flash)
    "Tesla T4": ((7, 5, 15, 0), (torch.float16, False)),
    "NVIDIA L4": ((8, 9, 22, 0), (torch.bfloat16, True)),
    "NVIDIA A100-SXM4-40GB": ((8, 0, 40, 0), (torch.bfloat16, True)),
    "NVIDIA H200": ((9, 0, 139, 0), (torch.bfloat16, True)),
    "NVIDIA GB10 (DGX Spark)": ((12, 1, 119, 1), (torch.bfloat16, True)),
}


@pytest.mark.parametrize("name", list(GPUS))
def test_device_profile_picks_dtype_backends_and_sizes(monkeypatch, name):
    (major, minor, gib, integrated), (dtype, flash) = GPUS[name]
    props = SimpleNamespace(name=name, major=major, minor=minor, total_memory=gib * 2**30,
                            is_integrated=integrated)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    p = env.device_profile("cuda")
    assert (p.dtype, p.flash, p.unified_memory) == (dtype, flash, bool(integrated))
    assert p.packed_backends == (["varlen", "sdpa", "flex"] if flash else ["sdpa"])
    sizes = {"qwen3-14b": 40, "qwen3-0.6b": 6}
    assert p.pick(sizes) == ("qwen3-14b" if gib >= 40 else "qwen3-0.6b")
    assert name in p.describe()


def test_cpu_profile():
    p = env.device_profile("cpu")
    assert p.device == "cpu" and p.dtype == torch.float32 and p.packed_backends == ["sdpa"]
    assert p.pick({"qwen3-0.6b": 6}) is None


def test_emulated_device_profiles_refuse_in_one_line_where_they_cannot_apply(monkeypatch):
    from fastsft_lab.env import EMULATED_PROFILES, PROFILE_ENV, DeviceProfile, device_profile, need_fits

    assert set(EMULATED_PROFILES) == {"t4", "24gb"}
    assert EMULATED_PROFILES["t4"]["dtype"] == torch.float16 and not EMULATED_PROFILES["t4"]["flash"]
    assert EMULATED_PROFILES["24gb"]["memory_gib"] == 22.0
    monkeypatch.setenv(PROFILE_ENV, "a100")
    with pytest.raises(ValueError, match="is not a device profile; valid: t4, 24gb"):
        device_profile("cpu")
    monkeypatch.setenv(PROFILE_ENV, "t4")
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        device_profile("cpu")
    monkeypatch.delenv(PROFILE_ENV)
    assert device_profile("cpu").device == "cpu"
    t4 = DeviceProfile("cuda", "T4-class (emulated)", (7, 5), 15.0, False, torch.float16, False)
    assert t4.packed_backends == ["sdpa"] and t4.pick({"qwen3-14b": 40, "qwen3-0.6b": 12}) == "qwen3-0.6b"
    need_fits(t4, 12, "qwen3-0.6b")
    with pytest.raises(ValueError, match="qwen3-14b needs 40 GiB; T4-class \\(emulated\\) has 15 GiB"):
        need_fits(t4, 40, "qwen3-14b")


@pytest.mark.parametrize("device, index", [("cuda", 0), ("cuda:1", 1)])
def test_an_emulated_profile_caps_the_memory_of_the_named_device(monkeypatch, device, index):
    """torch's memory cap takes a device index: "cuda" (no index, what the notebooks pass) means the current device
    (the H200 run of both profiles stopped here with "Expected a torch.device with a specified index")."""
    from torch._utils import _get_device_index

    props = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, total_memory=140 * 2**30, is_integrated=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    caps = []

    def cap(fraction, device=None):
        caps.append((fraction, _get_device_index(device, optional=False)))   # what torch's own check does

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", cap)
    monkeypatch.setenv(env.PROFILE_ENV, "24gb")
    p = env.device_profile(device)
    assert p.memory_gib == 22.0 and p.dtype == torch.bfloat16
    assert caps == [(22.0 / 140, index)]


def test_double_buffer_warns_once_on_unified_memory():
    from fastsft_lab.offload.switch import _WARNED_UNIFIED, resolve_device, warn_unified_memory

    dev = torch.device("cuda", 7)
    _WARNED_UNIFIED.discard(dev)
    with pytest.warns(UserWarning, match="unified memory"):
        assert warn_unified_memory(dev, 2, integrated=True)
    assert not warn_unified_memory(dev, 2, integrated=True)          # once per device
    assert not warn_unified_memory(torch.device("cuda", 6), 1, integrated=True)   # one buffer: nothing to warn
    assert not warn_unified_memory(torch.device("cuda", 5), 2, integrated=False)
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
