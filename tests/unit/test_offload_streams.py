"""The stream-order model: every cross-stream hazard ordered, for every pattern (checked on a CPU); each missing
ordering caught; the checker's semantics."""

from __future__ import annotations

import gc

import pytest
import torch

from fastsft_lab import offload as O
from fastsft_lab.lab.scenarios.offload import SerialForwardCopies
from fastsft_lab.offload import StreamOps, check_stream_order

from _offload_helpers import MODES, MODE_IDS, _batch, _enable, _model, SecondBufferFails

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def _logged(model, buffers, prefetch, run, **kw):
    """Run ``run()`` with offload on and the manager's stream-operation log recording; return the log."""
    O.disable_offloaded_checkpointing(model, release_pool=True)      # fresh manager: first allocations included
    manager = _enable(model, buffers, prefetch, **kw)
    manager.stream_log = []
    try:
        run()
        O.disable_offloaded_checkpointing(model)                    # logs the staging buffers' release
        return manager.stream_log
    finally:
        manager.stream_log = None
        O.disable_offloaded_checkpointing(model, release_pool=True)
        model.zero_grad(set_to_none=True)


def _patterns(model):
    a, b, c = (_batch(seed=s).model_inputs() for s in (1, 2, 3))
    small, big = _batch(tokens=64, row=64).model_inputs(), _batch(tokens=256, row=128).model_inputs()

    def steps():
        for _ in range(2):
            model(**a).loss.backward()

    def accumulate():
        (model(**a).loss + model(**b).loss).backward()

    def forward_order():
        la, lb = model(**a).loss, model(**b).loss
        la.backward()
        lb.backward()

    def interleaved():
        la, lb = model(**a).loss, model(**b).loss
        lb.backward()
        lc = model(**c).loss
        la.backward()
        lc.backward()

    def growth():
        for x in (small, big, small):
            model(**x).loss.backward()

    def dropped_graph():
        loss = model(**a).loss
        del loss
        gc.collect()
        model(**b).loss.backward()

    return {"steps": steps, "accumulate": accumulate, "forward-order": forward_order, "interleaved": interleaved,
            "growth": growth, "dropped-graph": dropped_graph}


@pytest.mark.parametrize("serial", [False, True], ids=["copy-stream-fwd", "serial-fwd"])
@pytest.mark.parametrize("buffers,prefetch", MODES, ids=MODE_IDS)
def test_stream_order_model_has_no_race(buffers, prefetch, serial):
    model = _model("tiny-qwen3", True)
    for name, run in _patterns(model).items():
        log = _logged(model, buffers, prefetch, run,
                      streams=SerialForwardCopies(torch.device("cpu")) if serial else None)
        kinds = {op[0] for op in log}
        assert {"wait_stream", "record", "wait_event", "access", "free"} <= kinds, name
        assert check_stream_order(log) == [], name


def test_stream_order_model_with_fallback_has_no_race():
    model = _model("tiny-qwen3", True, num_layers=4)
    with pytest.warns(RuntimeWarning, match="ONE buffer"):
        log = _logged(model, 2, True, _patterns(model)["steps"], streams=SecondBufferFails(torch.device("cpu")))
    assert check_stream_order(log) == []


def _without(method, skip):
    """Stream operations with one kind of ``method`` call left out (where ``skip(*args)`` is true)."""
    real = getattr(StreamOps, method)

    def patched(self, *args):
        if not skip(*args):
            real(self, *args)
    return type(f"Without_{method}", (StreamOps,), {method: patched})(torch.device("cpu"))


class _AllocatedOnCompute(StreamOps):
    staging_alloc_stream = "compute"


@pytest.mark.parametrize("broken", ["staging-allocated-on-compute", "no-wait-for-free", "no-wait-for-ready",
                                    "no-record-stream-on-input", "no-copy-wait-for-producer"])
def test_stream_order_model_catches_each_missing_ordering(broken):
    # Negative controls: remove one ordering operation and the model must report a race. The first one is the
    # bug a GPU run exposed: staging buffers allocated on the compute stream but first written by the copy
    # stream, whose H2D could then overwrite memory still used by queued compute kernels (the loss/LM-head backward).
    streams = {
        "staging-allocated-on-compute": lambda: _AllocatedOnCompute(torch.device("cpu")),
        "no-wait-for-free": lambda: _without("wait_event", lambda stream, key: key[0] == "free"),
        "no-wait-for-ready": lambda: _without("wait_event", lambda stream, key: key[0] == "ready"),
        "no-record-stream-on-input": lambda: _without("record_stream", lambda tensor, buf, stream: buf[0] == "input"),
        "no-copy-wait-for-producer": lambda: _without("wait_stream",
                                                      lambda waiter, waitee: (waiter, waitee) == ("copy", "compute")),
    }[broken]()
    model = _model("tiny-qwen3", True)
    buffers, prefetch = (1, False) if broken == "no-wait-for-free" else (2, True)
    problems = check_stream_order(_logged(model, buffers, prefetch, _patterns(model)["steps"], streams=streams))
    assert problems, f"{broken}: the model found no race"
    where = {"staging-allocated-on-compute": "staging", "no-wait-for-free": "staging",
             "no-wait-for-ready": "staging", "no-record-stream-on-input": "input",
             "no-copy-wait-for-producer": "input"}[broken]
    assert any(where in p for p in problems), problems[:3]


def test_check_stream_order_semantics():
    ok = [("access", "compute", "x", "w"), ("wait_stream", "copy", "compute"), ("access", "copy", "x", "r"),
          ("record_stream", "x", "copy"), ("free", "compute", "x")]
    assert check_stream_order(ok) == []
    # a wait issued BEFORE the event is re-recorded orders only against the older record
    stale = [("record", "e", "compute"), ("wait_event", "copy", "e"), ("access", "compute", "b", "r"),
             ("record", "e", "compute"), ("access", "copy", "b", "w")]
    assert len(check_stream_order(stale)) == 1
    fresh = stale[:3] + [("record", "e", "compute"), ("wait_event", "copy", "e"), ("access", "copy", "b", "w")]
    assert check_stream_order(fresh) == []
    # waiting on an event never recorded orders nothing
    assert check_stream_order([("access", "compute", "b", "w"), ("wait_event", "copy", "never"),
                               ("access", "copy", "b", "r")])
    # reads on two streams do not conflict; use after free is reported
    assert check_stream_order([("access", "compute", "b", "r"), ("access", "copy", "b", "r")]) == []
    assert check_stream_order([("free", "compute", "b"), ("access", "compute", "b", "r")])
    with pytest.raises(ValueError, match="unknown stream operation"):
        check_stream_order([("sync",)])
