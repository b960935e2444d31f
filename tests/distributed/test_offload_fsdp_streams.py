"""Offloaded checkpointing beside FSDP2's streams, in the stream-order model (fastsft_lab.offload.streams).

FSDP2 (``fully_shard``) issues its own cross-stream work around every decoder layer: an all-gather on two side
streams before the layer runs (forward, and again for the recompute in backward), a copy-out into the unsharded
parameters on the compute stream, a free of the unsharded parameters after the forward, and after the layer's
backward a reduce-scatter of the unsharded gradients on a third stream. This file logs those operations, as FSDP2
issues them (torch 2.11-2.13, ``_fsdp_param_group.py`` and ``_fsdp_collectives.py``: ``unshard``,
``wait_for_unshard``, ``reshard``, ``post_backward`` / ``foreach_reduce``), into the very log the offload manager
writes while a real model trains on the CPU, at the points where FSDP2's hooks run: before each layer's forward and
recompute, after its forward, after its backward. The merged log must have no race -- our copies, staging buffers and
events never order against FSDP's in a way that lets one stream touch what another still uses -- and removing one of
FSDP's own orderings must be reported (the model sees FSDP's hazards, not only ours).

What it does not show: that FSDP2 runs these operations in this order on a GPU (read from its source, not traced),
and anything about NCCL itself. The CPU equality tests (tests/distributed/test_distributed.py) show the numbers.
"""

from __future__ import annotations

import pytest
import torch

from fastsft_lab import offload as O
from fastsft_lab.data import benchmark_batches
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.structure import decoder_layers
from fastsft_lab.offload import StreamOps, check_stream_order

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


class FSDP2Streams(StreamOps):
    """The offload's stream operations, with FSDP2's logged beside them at its hook points.

    ``drop``: one of FSDP2's orderings to leave out (negative controls): ``"compute-waits-all-gather"``,
    ``"all-gather-waits-copy-out"``, ``"reduce-scatter-waits-compute"``, ``"compute-waits-reduce-scatter"``."""

    def __init__(self, device: torch.device, drop: str | None = None):
        super().__init__(device)
        self.drop = drop
        self.gen: dict[int, int] = {}
        self.recomputing: set[int] = set()

    def _fsdp(self, *op) -> None:
        if self.log is not None:
            self.log.append(op)

    def unshard(self, layer: int) -> None:
        """``unshard`` + ``wait_for_unshard``: all-gather on the side streams, copy-out on the compute stream."""
        g = self.gen[layer] = self.gen.get(layer, 0) + 1
        ag_in, ag_out, param = ("fsdp_ag_in", layer, g), ("fsdp_ag_out", layer, g), ("fsdp_param", layer, g)
        # resharded parameter data is used by the all-gather streams: they wait for the reshard
        self._fsdp("wait_event", "fsdp_ag_copy_in", ("fsdp_reshard", layer))
        self._fsdp("wait_event", "fsdp_ag", ("fsdp_reshard", layer))
        self._fsdp("access", "fsdp_ag_copy_in", ("fsdp_shard", layer), "r")
        self._fsdp("access", "fsdp_ag_copy_in", ag_in, "w")
        self._fsdp("wait_stream", "fsdp_ag", "fsdp_ag_copy_in")
        self._fsdp("access", "fsdp_ag", ag_in, "r")
        self._fsdp("access", "fsdp_ag", ag_out, "w")
        self._fsdp("record", ("fsdp_ag", layer, g), "fsdp_ag")
        if self.drop != "compute-waits-all-gather":
            self._fsdp("wait_event", "compute", ("fsdp_ag", layer, g))
        self._fsdp("access", "compute", ag_out, "r")           # copy-out into the unsharded parameters
        self._fsdp("access", "compute", param, "w")
        self._fsdp("record", ("fsdp_copy_out", layer, g), "compute")
        if self.drop != "all-gather-waits-copy-out":
            self._fsdp("wait_event", "fsdp_ag_copy_in", ("fsdp_copy_out", layer, g))
            self._fsdp("wait_event", "fsdp_ag", ("fsdp_copy_out", layer, g))
        self._fsdp("free", "fsdp_ag_copy_in", ag_in)           # the all-gather buffers go back to their pools
        self._fsdp("free", "fsdp_ag", ag_out)

    def layer_runs(self, layer: int) -> None:
        self._fsdp("access", "compute", ("fsdp_param", layer, self.gen[layer]), "r")

    def reshard(self, layer: int) -> None:
        self._fsdp("free", "compute", ("fsdp_param", layer, self.gen[layer]))
        self._fsdp("record", ("fsdp_reshard", layer), "compute")

    def post_backward(self, layer: int) -> None:
        """The layer's gradients (written on the compute stream by its backward) reduce-scattered on their stream,
        then the unsharded parameters and gradients freed."""
        g = self.gen[layer]
        grad, out = ("fsdp_grad", layer, g), ("fsdp_rs_out", layer, g)
        self._fsdp("access", "compute", grad, "w")
        if self.drop != "reduce-scatter-waits-compute":
            self._fsdp("wait_stream", "fsdp_rs", "compute")
        self._fsdp("access", "fsdp_rs", grad, "r")
        self._fsdp("access", "fsdp_rs", out, "w")
        self._fsdp("record", ("fsdp_post_reduce", layer, g), "fsdp_rs")
        self.reshard(layer)
        if self.drop != "compute-waits-reduce-scatter":
            self._fsdp("wait_event", "compute", ("fsdp_post_reduce", layer, g))
        self._fsdp("free", "compute", grad)
        self._fsdp("access", "compute", ("fsdp_sharded_grad", layer), "w")    # accumulated into the sharded .grad
        self._fsdp("access", "compute", out, "r")

    # the offload manager's observation points: where FSDP2's backward hooks run around our recompute
    def staged(self, entry, x, phase: str) -> None:
        if phase == "reload":
            self.recomputing.add(entry.layer)
        else:
            self.recomputing.discard(entry.layer)
            self.post_backward(entry.layer)


def _hooks(model, streams: FSDP2Streams) -> list:
    """FSDP2's module hooks: unshard before a layer's forward (and its recompute), reshard after its forward."""
    handles = []
    for i, layer in enumerate(decoder_layers(model)):
        def pre(module, args, kwargs, i=i):
            streams.unshard(i)
            streams.layer_runs(i)

        def post(module, args, output, i=i):
            if i not in streams.recomputing:       # after the recompute FSDP keeps them for the layer's backward
                streams.reshard(i)

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post))
    return handles


_MODEL: dict = {}


def _model():
    if "m" not in _MODEL:
        m = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4), num_layers=4)
        m.train()
        _MODEL["m"] = m
    return _MODEL["m"]


def _log(buffers: int, prefetch: bool, drop: str | None = None) -> list:
    model = _model()
    batches = [benchmark_batches(tokens_per_step=192, row_tokens=96, steps=1, vocab_size=256, mix="short",
                                 seed=s)[0].model_inputs() for s in (1, 2)]
    streams = FSDP2Streams(torch.device("cpu"), drop)
    O.enable_offloaded_checkpointing(model, buffers, prefetch, streams=streams)
    manager = O.offload_manager(model)
    manager.stream_log = []
    handles = _hooks(model, streams)
    try:
        for inputs in batches:                     # two steps: buffers, events and pool slots reused
            model(**inputs).loss.backward()
        O.disable_offloaded_checkpointing(model)
        return manager.stream_log
    finally:
        for h in handles:
            h.remove()
        manager.stream_log = None
        O.disable_offloaded_checkpointing(model, release_pool=True)
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("buffers, prefetch", [(1, False), (2, False), (2, True)], ids=["x1", "x2", "x2-prefetch"])
def test_offload_and_fsdp2_streams_together_have_no_race(buffers, prefetch):
    log = _log(buffers, prefetch)
    streams = {op[1] for op in log if op[0] in ("access", "free")}
    assert {"compute", "copy", "fsdp_ag", "fsdp_ag_copy_in", "fsdp_rs"} <= streams, streams
    # every layer unsharded in forward and again for its recompute, in both steps
    unshards = sum(1 for op in log if op[0] == "record" and op[1][0] == "fsdp_ag")
    assert unshards == 2 * 2 * 4, unshards
    assert check_stream_order(log) == []


@pytest.mark.parametrize("drop, buffer", [("compute-waits-all-gather", "fsdp_ag_out"),
                                          ("all-gather-waits-copy-out", "fsdp_ag_out"),
                                          ("reduce-scatter-waits-compute", "fsdp_grad"),
                                          ("compute-waits-reduce-scatter", "fsdp_grad")])
def test_the_model_reports_each_fsdp_ordering_left_out(drop, buffer):
    problems = check_stream_order(_log(2, True, drop))
    assert any(buffer in p for p in problems), f"{drop}: no race on {buffer} reported: {problems[:3]}"
    # only FSDP's own buffers: leaving out one of FSDP's orderings never makes one of ours race
    assert all("'fsdp_" in p and "staging" not in p and "input" not in p for p in problems), problems[:3]
