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
