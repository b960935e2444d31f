"""The pinned pool and the staging buffers on a model: no leak, growth only to the largest input, slots returned
as soon as they are reloaded, prefetch issued and hit, the one-buffer fallback on an out-of-memory error, and
the pool's host-memory check."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from fastsft_lab import offload as O
from fastsft_lab.offload import StreamOps
from fastsft_lab.structure import decoder_layers

from _offload_helpers import _batch, _step, _assert_same, _enable, _model, SecondBufferFails

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# --- no leak -------------------------------------------------------------------------------------------------------
def test_pool_flat_after_first_step_and_registry_empty():
    model = _model("tiny-qwen3", True)
    inputs = _batch().model_inputs()
    O.disable_offloaded_checkpointing(model, release_pool=True)     # a fresh manager and pool
    manager = _enable(model)
    try:
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        seen = []
        for step in range(25):
            model(**inputs).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert manager.pending == 0 and manager.pool.in_use == 0 and not manager._pending
            seen.append((manager.pool.allocations, manager.pool.nbytes, tuple(manager.staging_bytes)))
        assert len(set(seen)) == 1, f"pool or staging changed after step 1: {seen[0]} -> {seen[-1]}"
        assert manager.pool.num_slots == len(decoder_layers(model))
    finally:
        O.disable_offloaded_checkpointing(model, release_pool=True)


def test_pool_grows_only_to_the_largest_input():
    model = _model("tiny-qwen3", True)
    small, big = _batch(tokens=64, row=64).model_inputs(), _batch(tokens=192, row=96).model_inputs()
    manager = _enable(model)
    try:
        model(**big).loss.backward()
        after_big = (manager.pool.allocations, manager.pool.nbytes, tuple(manager.staging_bytes))
        for inputs in (small, big, small, small, big):
            model(**inputs).loss.backward()
        assert (manager.pool.allocations, manager.pool.nbytes, tuple(manager.staging_bytes)) == after_big
        model.zero_grad(set_to_none=True)
    finally:
        O.disable_offloaded_checkpointing(model, release_pool=True)


def test_dropped_graph_returns_its_slots():
    model = _model("tiny-qwen3", True)
    manager = _enable(model)
    try:
        loss = model(**_batch().model_inputs()).loss
        assert manager.pending == len(decoder_layers(model))
        del loss
        gc.collect()
        assert manager.pending == 0 and manager.pool.in_use == 0
    finally:
        O.disable_offloaded_checkpointing(model, release_pool=True)


def test_prefetch_is_issued_and_hit_on_cpu():
    # The CPU runs the same bookkeeping: with two buffers and prefetch, the reload of layer k-1 is issued while layer
    # k's backward starts, and layer k-1's backward then finds its input staged.
    layers = 4
    model = _model("tiny-qwen3", True, num_layers=layers)
    inputs = _batch().model_inputs()
    for buffers, prefetch, want in ((2, True, layers - 1), (2, False, 0), (1, False, 0)):
        O.disable_offloaded_checkpointing(model, release_pool=True)
        manager = _enable(model, buffers=buffers, prefetch=prefetch)
        manager.stream_log = []
        try:
            model(**inputs).loss.backward()
            st = manager.stats
            assert (st.prefetches, st.prefetch_hits, st.reloads) == (want, want, layers), (buffers, prefetch)
            # before the first recompute reads a staging buffer, the copy stream has written one (reactive) or two
            # (its own input and the next layer's, prefetched) staging buffers
            log = manager.stream_log
            first_read = next(i for i, op in enumerate(log) if op[:2] == ("access", "compute")
                              and op[2][0] == "staging" and op[3] == "r")
            reloads = [op for op in log[:first_read] if op[:2] == ("access", "copy") and op[2][0] == "pool"
                       and op[3] == "r"]      # a host->device copy reads its pool slot on the copy stream
            assert len(reloads) == (2 if prefetch else 1), reloads
        finally:
            manager.stream_log = None
            O.disable_offloaded_checkpointing(model, release_pool=True)
            model.zero_grad(set_to_none=True)


class _PoolWatch(StreamOps):
    """Records the pinned pool's slots in use each time a layer's backward has been issued."""

    def __init__(self, device, manager_ref):
        super().__init__(device)
        self.manager_ref, self.in_use = manager_ref, []

    def staged(self, entry, x, phase):
        if phase == "after_backward":
            self.in_use.append(self.manager_ref().pool.in_use)


def test_each_pool_slot_is_free_as_soon_as_its_layer_is_reloaded():
    # A slot goes back to the pool when its input has been staged, not when the step's graph dies: an interleaved
    # forward can then reuse it, and a long backward does not hold every slot to the end.
    layers = 4
    model = _model("tiny-qwen3", True, num_layers=layers)
    holder = {}
    watch = _PoolWatch(torch.device("cpu"), lambda: holder["m"])
    O.enable_offloaded_checkpointing(model, 2, True, streams=watch)
    holder["m"] = O.offload_manager(model)
    try:
        model(**_batch().model_inputs()).loss.backward()
        assert watch.in_use == list(range(layers - 1, -1, -1))
    finally:
        O.disable_offloaded_checkpointing(model, release_pool=True)
        model.zero_grad(set_to_none=True)


# --- the OOM fallback ----------------------------------------------------------------------------------------------
class AllocationFails(StreamOps):
    def allocate(self, nbytes, stream):
        raise torch.cuda.OutOfMemoryError("injected")


@pytest.mark.parametrize("num_layers", [3, 4], ids=["odd-layers", "even-layers"])
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "reactive"])
def test_second_buffer_oom_falls_back_to_one(prefetch, num_layers):
    # even layer count: slot 1 is allocated first and slot 0 is the one that does not fit (the fallback used to
    # treat that as a genuine OOM and raise)
    model = _model("tiny-qwen3", True, num_layers=num_layers)
    inputs = _batch().model_inputs()
    reference = _step(model, inputs)
    O.disable_offloaded_checkpointing(model, release_pool=True)     # a fresh manager
    calls = []
    manager = _enable(model, buffers=2, prefetch=prefetch, streams=SecondBufferFails(torch.device("cpu"), calls))
    try:
        with pytest.warns(RuntimeWarning, match="falling back to ONE buffer"):
            got = _step(model, inputs)
        _assert_same(reference, got)
        assert manager.active_buffers == 1 and manager.stats.fallbacks == 1
        kept = (num_layers - 1) % 2                      # the last layer's slot was allocated first and is kept
        assert manager.policy.slots == [kept]
        assert manager.staging_bytes[1 - kept] == 0 and manager.staging_bytes[kept] > 0
        with warnings.catch_warnings():
            warnings.simplefilter("error")    # no second warning: it stays on one buffer
            _assert_same(reference, _step(model, inputs))
    finally:
        O.disable_offloaded_checkpointing(model, release_pool=True)


def test_first_buffer_oom_is_a_real_oom():
    model = _model("tiny-qwen3", True)
    O.enable_offloaded_checkpointing(model, buffers=1, prefetch=False, streams=AllocationFails(torch.device("cpu")))
    try:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            model(**_batch().model_inputs()).loss.backward()
    finally:
        O.disable_offloaded_checkpointing(model, release_pool=True)
        model.zero_grad(set_to_none=True)
        gc.collect()


# --- host memory ---------------------------------------------------------------------------------------------------
def test_the_pool_refuses_in_one_line_before_host_memory_runs_out(monkeypatch):
    """The pinned pool checks the node's available memory before each new slot and names what it needs per rank and
    for every rank on the node, rather than letting the host run out of memory."""
    from fastsft_lab.offload import pool as P

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(P, "host_memory_available", lambda: P.HOST_RESERVE_BYTES + 3 * 2**20)
    p = P.PinnedPool(pin=False)
    p.acquire(2**20)                                           # 1 MiB fits next to the reserve
    with pytest.raises(RuntimeError, match=r"host memory would run out: .* needs 4\.00 GiB more .* 4 rank\(s\)"):
        p.acquire(4 * 2**30)
    assert p.num_slots == 1                                    # nothing allocated by the refused request
    monkeypatch.setattr(P, "host_memory_available", lambda: None)   # unknown (not Linux): no check
    assert P.local_ranks() == 4 and p.acquire(2**20) == 1


def test_host_memory_available_is_capped_by_the_cgroup_limit(monkeypatch):
    import io

    from fastsft_lab.offload import pool

    files = {"/proc/meminfo": "MemTotal: 100000000 kB\nMemAvailable: 80000000 kB\n",
             "/sys/fs/cgroup/memory.max": str(16 * 2**30), "/sys/fs/cgroup/memory.current": str(6 * 2**30)}

    def fake_open(path, *args, **kwargs):
        if path not in files:
            raise FileNotFoundError(path)
        return io.StringIO(files[path])

    monkeypatch.setattr(pool, "open", fake_open, raising=False)
    assert pool.host_memory_available() == 10 * 2**30              # the container's 16 GiB, 6 used
    files["/sys/fs/cgroup/memory.max"] = "max"
    assert pool.host_memory_available() == 80000000 * 1024         # no limit: the host's MemAvailable
    del files["/proc/meminfo"]
    files["/sys/fs/cgroup/memory.max"] = str(16 * 2**30)
    assert pool.host_memory_available() == 10 * 2**30
