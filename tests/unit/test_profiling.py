"""The host-sync counter counts known syncs exactly, sees none in sync-free code, and attributes per layer."""

import pytest
import torch

from fastsft_lab.models import build_model
from fastsft_lab.profiling import PhaseTimer, SyncCounter, count_syncs, percentiles, profile

x = torch.arange(12.0)
mask = x > 3

SYNCING = {
    "item": lambda: x.sum().item(),
    "bool": lambda: bool(x.sum() > 0),
    "if_tensor": lambda: 1 if x.max() > 2 else 0,
    "int": lambda: int(x[3]),
    "tolist": lambda: x.tolist(),
    "nonzero": lambda: mask.nonzero(),
    "where_1arg": lambda: torch.where(mask),
    "bool_index": lambda: x[mask],
    "bool_setitem": lambda: x.clone().__setitem__(mask, 0.0),
    "masked_select": lambda: x.masked_select(mask),
    "unique": lambda: torch.unique(x),
    "bincount": lambda: torch.bincount(x.long()),
    "repeat_interleave": lambda: torch.repeat_interleave(x, x.long()),
    "print": lambda: str(x),
    "format": lambda: f"{x}",
    "cpu": lambda: x.cpu(),
    "numpy": lambda: x.numpy(),
    "equal": lambda: torch.equal(x, x),
}

SYNC_FREE = {
    "sort": lambda: torch.sort(x),
    "argsort": lambda: torch.argsort(x, stable=True),
    "cumsum": lambda: x.cumsum(0),
    "histc": lambda: torch.histc(x, bins=4, min=0, max=11),
    "where_3arg": lambda: torch.where(mask, x, 0.0),
    "masked_fill": lambda: x.masked_fill(mask, 0.0),
    "repeat_interleave_sized": lambda: torch.repeat_interleave(x, x.long(), output_size=int(66)),
    "index_long": lambda: x[torch.tensor([1, 2])],
    "scatter_add": lambda: torch.zeros(4).scatter_add_(0, torch.tensor([0, 1, 1]), torch.ones(3)),
    "matmul": lambda: x.view(3, 4) @ x.view(4, 3),
}


@pytest.mark.parametrize("name", sorted(SYNCING))
def test_known_syncs_count_exactly_once(name):
    assert count_syncs(SYNCING[name], device="cpu") == 1


@pytest.mark.parametrize("name", sorted(SYNC_FREE))
def test_sync_free_ops_count_zero(name):
    assert count_syncs(SYNC_FREE[name], device="cpu") == 0


def test_python_ints_and_host_tensors_of_another_device_are_free():
    assert count_syncs(lambda: sum(range(10)), device="cpu") == 0
    # counting CUDA syncs: CPU tensors are host data, not device reads
    assert count_syncs(lambda: x.sum().item() + len(x.tolist()), device="cuda") == 0


def test_counts_accumulate_and_nest():
    with SyncCounter(device="cpu") as outer:
        x.sum().item()
        with SyncCounter(device="cpu") as inner:
            x.tolist()
            x.nonzero()
    assert inner.total == 2
    assert outer.total == 3
    assert outer.by_kind == {"item": 1, "tolist": 1, "nonzero": 1}


def test_hooks_are_removed_after_exit():
    original = torch.Tensor.tolist
    with SyncCounter(device="cpu"):
        assert torch.Tensor.tolist is not original
    assert torch.Tensor.tolist is original


def test_per_layer_attribution():
    class Layer(torch.nn.Module):
        def __init__(self, syncs):
            super().__init__()
            self.syncs = syncs

        def forward(self, h):
            for _ in range(self.syncs):
                h.sum().item()
            return h + 1

    layers = torch.nn.ModuleList([Layer(0), Layer(2), Layer(1)])
    counter = SyncCounter(device="cpu", modules={f"layer{i}": m for i, m in enumerate(layers)})
    with counter:
        h = torch.ones(3)
        for layer in layers:
            h = layer(h)
        h.max().item()  # outside any layer
    assert counter.per_module() == {"layer0": 0, "layer1": 2, "layer2": 1}
    assert counter.in_modules == 3 and counter.total == 4


def test_stock_model_forward_syncs_outside_layers_only():
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    ids = torch.randint(4, 256, (1, 16))
    pos = torch.cat([torch.arange(6), torch.arange(10)])[None]
    with SyncCounter.for_decoder_layers(model, device="cpu") as c:
        model(input_ids=ids, position_ids=pos)
    # stock sdpa: transformers checks once per forward whether position_ids are packed
    assert c.in_modules == 0
    assert c.total == 1


@pytest.mark.cuda
def test_cuda_counts_agree_with_sync_debug_mode():
    y = torch.arange(12.0, device="cuda")
    m = y > 3
    for fn in (lambda: y.sum().item(), lambda: m.nonzero(), lambda: y[m], lambda: y.tolist(), lambda: y.cpu(),
               lambda: torch.unique(y)):
        with SyncCounter(device="cuda", cross_check=True) as c:
            fn()
        assert c.total == 1
        assert c.cuda_reported >= 1
    with SyncCounter(device="cuda", cross_check=True) as c:
        torch.sort(y)
        y.cumsum(0)
    assert c.total == 0 and c.cuda_reported == 0


def test_phase_timer_and_percentiles(monkeypatch):
    clock = iter([1.0, 1.25, 2.0, 2.5, 3.0, 3.125])     # a fake perf_counter: the timer's arithmetic, exactly
    monkeypatch.setattr("fastsft_lab.profiling.time.perf_counter", lambda: next(clock))
    timer = PhaseTimer("cpu")
    with timer.phase("a"):
        pass
    with timer.phase("b"):
        pass
    with timer.phase("a"):                              # a repeated phase is summed
        pass
    assert timer.collect() == {"a": 375.0, "b": 500.0}
    assert timer.collect() == {}                        # collect clears
    p = percentiles([5, 1, 3, 2, 4])
    assert p["median"] == 3 and p["p20"] == pytest.approx(1.8) and p["p80"] == pytest.approx(4.2)


def test_profile_returns_top_ops(tmp_path):
    res = profile(lambda: torch.randn(64, 64) @ torch.randn(64, 64), trace_path=str(tmp_path / "t.json"), top=5)
    assert (tmp_path / "t.json").exists()
    assert any("mm" in op["name"] for op in res.top_ops)


def test_cuda_cross_check_counts_syncs_not_the_prototype_notice():
    import warnings
    from fastsft_lab.profiling import cuda_sync_warnings

    def record(text):
        return warnings.WarningMessage(UserWarning(text), UserWarning, "f.py", 1)

    notice = record("Synchronization debug mode is a prototype feature and does not yet detect all "
                    "synchronizing operations (Triggered internally at Module.cpp)")
    sync = record("called a synchronizing CUDA operation (Triggered internally at CUDAFunctions.cpp:162.)")
    other = record("some unrelated warning")
    assert cuda_sync_warnings([notice, sync, other, sync]) == [sync, sync]


def test_profile_reports_each_ops_own_time_per_step():
    from fastsft_lab.profiling import profile

    a = torch.randn(256, 256)
    r = profile(lambda: a @ a, steps=4, top=10)
    per_step = {o["name"]: o["ms"] for o in r.ops_per_step}
    total = {o["name"]: o["self_ms"] for o in r.top_ops}
    assert per_step["aten::mm"] > 0 and abs(per_step["aten::mm"] * 4 - total["aten::mm"]) <= 0.01 + 0.01 * total["aten::mm"]
    assert r.kernels_per_step == [] and r.device_busy_ms is None      # a CPU run: no kernels, no GPU busy time


def test_profile_summary_counts_each_kernel_once_and_keeps_the_queue_wait_apart():
    """On CUDA, aten::mm's self device time *is* its kernel's time: the top entries list the kernel, not both; the
    launch-queue wait is reported apart and is not GPU busy time."""
    from types import SimpleNamespace as E

    from fastsft_lab.profiling import QUEUE_FULL, summarize_events

    ev = [E(key="aten::mm", count=4, device_type="DeviceType.CUDA", self_device_time_total=8000.0),
          E(key="sm90_xmma_gemm_bf16", count=4, device_type="DeviceType.CUDA", self_device_time_total=8000.0),
          E(key="aten::add_", count=2, device_type="DeviceType.CPU", self_device_time_total=1000.0),
          E(key="elementwise_kernel", count=2, device_type="DeviceType.CUDA", self_device_time_total=1000.0),
          E(key=QUEUE_FULL, count=1, device_type="DeviceType.CUDA", self_device_time_total=0.0,
            cpu_time_total=392000.0)]
    top, ops, kernels, queue = summarize_events(ev, cuda=True, steps=2, top=10)
    assert [t["name"] for t in top] == ["sm90_xmma_gemm_bf16", "elementwise_kernel"]
    assert sum(t["self_ms"] for t in top) == 9.0                      # 8 + 1 ms, not 18
    assert kernels == {"sm90_xmma_gemm_bf16": 4.0, "elementwise_kernel": 0.5}
    assert queue == 196.0 and QUEUE_FULL not in kernels
    top_cpu, _, kernels_cpu, queue_cpu = summarize_events(
        [E(key="aten::mm", count=1, device_type="DeviceType.CPU", self_cpu_time_total=3000.0)], cuda=False)
    assert top_cpu == [{"name": "aten::mm", "calls": 1, "self_ms": 3.0}] and kernels_cpu == {} and queue_cpu == 0.0
    # a CPU model profiled on a GPU machine launches no kernel: its host ops are the work, not an empty table
    host_only = [E(key="aten::mm", count=1, device_type="DeviceType.CPU", self_cpu_time_total=3000.0,
                   self_device_time_total=0.0)]
    assert summarize_events(host_only, cuda=True)[0] == top_cpu


def test_timeline_marks_the_waits_a_gpu_would_pay_and_no_others():
    """The timeline's red marks agree with the sync counter: a read-back is a wait, a device-side assert and a
    grouped matmul are not (on CUDA neither touches the host), and each waiting host op is marked once."""
    from fastsft_lab import _compat
    from fastsft_lab.profiling import host_device_timeline

    def reads_back():
        return x.sum().item() + int(x.max())

    def device_side():
        _compat.assert_async((x >= 0).all(), "non-negative")
        return x * 2

    tl = host_device_timeline(reads_back, "cpu")
    assert tl["host_syncs"] == 2 and tl["gpu"] == []
    assert all(end >= start >= 0 for _, start, end, _ in tl["host"])
    assert host_device_timeline(device_side, "cpu")["host_syncs"] == 0
    assert count_syncs(device_side, device="cpu") == 0 and count_syncs(reads_back, device="cpu") == 2


def test_timeline_of_a_packed_forward_matches_the_sync_counter():
    """One forward of the tiny Qwen3, naive and cached packed metadata (notebook 01's timeline): the cached path
    waits nowhere, the naive one in every layer, as :class:`SyncCounter` counts."""
    import fastsft_lab
    from fastsft_lab.data import benchmark_batches
    from fastsft_lab.packing import packed_inputs
    from fastsft_lab.profiling import host_device_timeline

    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32).eval()
    batch = benchmark_batches(tokens_per_step=256, steps=1, vocab_size=model.config.vocab_size, mix="short")[0]
    layers = model.config.num_hidden_layers
    waits = {}
    for cache in (False, True):
        fastsft_lab.apply(model, packed_attention="sdpa", packed_metadata_cache=cache)
        kwargs = packed_inputs(batch) if cache else batch.model_inputs()
        with torch.no_grad():
            waits[cache] = host_device_timeline(lambda: model(**kwargs), "cpu")["host_syncs"]
            with SyncCounter.for_decoder_layers(model, device="cpu") as counter:
                model(**kwargs)
        fastsft_lab.apply(model, packed_attention="off")
        assert (waits[cache] == 0) == (counter.total == 0)
    assert waits[True] == 0 and waits[False] >= layers
