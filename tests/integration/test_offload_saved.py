"""The memory plan's ``offload_saved`` choice: every saved activation of a layer in host memory, double-buffered.

Exactness (plain training to the bit, every model and mix) is in ``test_plan.py``. Here: each storage view crosses the
link once per layer call and comes back once; with two buffers the previous layer's activations are on their way
while a layer's backward runs (and with one, they are not); the stream operations, checked in the model of CUDA
stream semantics, order every hazard (and a dropped ``record_stream`` or wait is caught); nothing is left waiting
after a step; a second backward (``retain_graph``) gets the same tensors; a layer that changes a saved activation in
place is refused; the solver picks the choice where the link hides its copies and not where it does not, and not at
all when the host could not hold the activations.
"""

import pytest
import torch

import fastsft_lab
from fastsft_lab.data import benchmark_batches
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.structure import decoder_layers
from fastsft_lab.offload import StreamOps, check_stream_order
from fastsft_lab.offload import plan as P
from fastsft_lab.offload.saved import SavedOffload

LAYERS = 4


def _model(preset="tiny-qwen3"):
    model = build_model(preset, device="cpu", dtype=torch.float32, num_layers=LAYERS, lora=LoraSettings(rank=4))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    return model.train()


def _inputs():
    return benchmark_batches(tokens_per_step=192, row_tokens=96, steps=1, vocab_size=256, mix="short")[0].model_inputs()


def _step(model, inputs, retain=False):
    loss = model(**inputs).loss
    loss.backward(retain_graph=retain)
    return loss


def _planned(model, choices=("offload_saved",) * LAYERS, **kw):
    fastsft_lab.apply(model, memory_budget=16, **kw)
    planner = P.memory_planner(model)
    planner.saved.min_bytes = 0
    P.set_plan(model, choices)
    return planner.saved


def test_each_view_crosses_the_link_once_and_comes_back_once():
    model = _model()
    saved = _planned(model)
    packs = []
    real = saved._pack

    def counting(group, exclude, t):
        out = real(group, exclude, t)
        packs.append(out is not t)
        return out

    saved._pack = counting
    try:
        _step(model, _inputs())
    finally:
        fastsft_lab.revert(model)
    s = saved.stats
    assert s.layers == LAYERS and s.tensors > 0
    assert sum(packs) > s.tensors            # q, k, v and the adapters save one normalised input: copied once
    assert s.bytes_loaded == s.bytes_stored > 0
    assert s.kept > 0                        # the weights autograd saves stay where they are


@pytest.mark.parametrize("buffers", [2, 1])
def test_two_buffers_reload_the_previous_layer_under_the_current_backward(buffers):
    model = _model()
    saved = _planned(model, offload_buffers=buffers)
    log = saved.ops.log = []
    try:
        _step(model, _inputs())
    finally:
        fastsft_lab.revert(model)
    s = saved.stats
    # at most `buffers` layers' stores in flight: each layer from the (buffers+1)-th waits for the stores of the
    # layer `buffers` back before it runs; the backward waits for the rest before its first read. Only then is an
    # activation let go (on the compute stream: the allocator's counters see every store in flight)
    records = {i: op[1][1] for i, op in enumerate(log) if op[0] == "record" and op[1][0] == "saved-stored"}
    stored, forward_end = list(records.values()), max(records)
    reload = next(i for i, op in enumerate(log) if op[0] == "access" and op[2][:2] == ("saved", "device"))
    waits = {i: op[2][1] for i, op in enumerate(log)
             if op[:2] == ("wait_event", "compute") and op[2][0] == "saved-stored"}
    assert [seq for i, seq in waits.items() if i < forward_end] == stored[:LAYERS - buffers], (waits, stored)
    assert [seq for i, seq in waits.items() if forward_end < i < reload] == stored[LAYERS - buffers:], waits
    for i, op in enumerate(log):
        if op[0] == "free" and op[2][:2] == ("saved", "activation"):
            assert op[1] == "compute" and any(j < i and seq == op[2][2] for j, seq in waits.items()), op
    if buffers == 1:
        assert s.prefetches == 0 and s.prefetch_hits == 0
        return
    assert s.prefetches == LAYERS - 1 and s.prefetch_hits == LAYERS - 1
    # layer k-1's reloads are issued when layer k's backward starts: before its first read, after layer k+1's
    first_read, first_load = {}, {}
    for i, op in enumerate(log):
        if op[0] == "access" and op[2][:2] == ("saved", "device"):
            (first_load if op[1] == "copy" else first_read).setdefault(op[2][2], i)
    seqs = sorted(first_load, reverse=True)          # backward order: the last layer first
    assert len(seqs) == LAYERS
    for newer, older in zip(seqs, seqs[1:]):
        assert first_read[newer] > first_load[older], (newer, older)
    for newest, newer, older in zip(seqs, seqs[1:], seqs[2:]):
        assert first_load[older] > first_read[newest], (newest, older)    # not before it is needed next


def test_stream_order_holds_and_a_dropped_protection_is_caught():
    class DropSavedRecordStream(StreamOps):
        def record_stream(self, tensor, buf, stream):
            if buf[0] != "saved":
                super().record_stream(tensor, buf, stream)

    class DropSavedWait(StreamOps):
        def wait_event(self, stream, key):
            if key[0] != "saved-ready":
                super().wait_event(stream, key)

    class DropStoredWait(StreamOps):   # an activation let go while its copy to the host may still read it
        def wait_event(self, stream, key):
            if key[0] != "saved-stored":
                super().wait_event(stream, key)

    for ops_cls, clean in ((StreamOps, True), (DropSavedRecordStream, False), (DropSavedWait, False),
                           (DropStoredWait, False)):
        model = _model()
        saved = _planned(model)
        saved.ops = ops_cls(torch.device("cpu"))
        saved.ops.log = []
        try:
            _step(model, _inputs())
        finally:
            fastsft_lab.revert(model)
        problems = check_stream_order(saved.ops.log)
        assert (problems == []) == clean, (ops_cls.__name__, problems[:3])


def test_nothing_waits_after_the_step_and_a_second_backward_gets_the_same_tensors():
    model = _model()
    inputs = _inputs()
    loss = model(**inputs).loss
    loss.backward(retain_graph=True)
    reference = {n: 2 * p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    saved = _planned(model)
    try:
        _step(model, inputs, retain=True).backward()
        assert not saved._waiting and not [k for k in saved.ops._events if k[0] == "saved-ready"]
        for n, g in reference.items():
            torch.testing.assert_close(dict(model.named_parameters())[n].grad, g, rtol=0, atol=0, msg=n)
    finally:
        fastsft_lab.revert(model)


def test_a_forward_without_backward_leaves_nothing_alive():
    # a loss computed under grad and dropped (a validation loss outside no_grad): what the hooks kept on the device
    # must not hold its own graph (a cycle through autograd's C++ nodes, freed by no garbage collection, growing by
    # one forward's activations each time)
    from _offload_helpers import assert_dropped_forwards_leave_nothing

    model, inputs = _model(), _inputs()
    _planned(model)
    try:
        P.memory_planner(model).saved.min_bytes = 1 << 12      # the small saved tensors stay on the device
        _step(model, inputs)
        model.zero_grad(set_to_none=True)
        assert_dropped_forwards_leave_nothing(model, inputs)
    finally:
        fastsft_lab.revert(model)


def test_a_layer_that_changes_a_saved_activation_in_place_is_refused():
    saved = SavedOffload("cpu", min_bytes=0)
    x = torch.randn(8, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="changed a saved activation in place"):
        with saved.layer(0, set()):
            y = x * 2
            z = y.sin()                  # saves y
            y.add_(1)                    # and changes it
    assert z is not None


def _cost(keep_s, saved_s, keep=1000):
    return P.LayerCost("layer", 1000, {"keep": keep_s, "selective": keep_s + 0.2, "checkpoint": keep_s + 0.4,
                                       "offload": keep_s + 0.5, "offload_saved": saved_s},
                       {"keep": keep, "selective": 400, "checkpoint": 100, "offload": 0, "offload_saved": 0})


def test_the_solver_picks_it_where_the_link_hides_the_copies_and_not_where_it_does_not():
    base = 10_000
    budget = base + 1000 + 2 * 1000          # room for two kept layers, or the prefetched layer's activations
    fast_link = [_cost(1.0, 1.0) for _ in range(6)]
    plan = P.solve(fast_link, budget, base, staging=100, saved_extra=1000)
    assert plan.choices.count("offload_saved") >= 4 and plan.peak <= budget, plan
    slow_link = [_cost(1.0, 3.0) for _ in range(6)]
    assert "offload_saved" not in P.solve(slow_link, budget, base, staging=100, saved_extra=1000).choices
    # the prefetched layer's activations are charged (and the input offload's staging buffers are not, when no layer
    # offloads its input): one byte short of room for them, no offload_saved
    plan = P.solve(fast_link, base - 100 + 1000, base, staging=100, saved_extra=1000)
    assert plan.choices == ("offload_saved",) * 6 and plan.peak == base - 100 + 1000
    assert "offload_saved" not in P.solve(fast_link, base - 100 + 999, base, staging=100, saved_extra=1000).choices


def test_the_layer_whose_backward_runs_first_pays_its_whole_reload():
    """The last layer's activations come back when its backward starts: no later layer's backward hides that
    reload, so offload_saved there costs what the other layers hide (measured as ``first_reload``)."""
    from dataclasses import replace

    base = 10_000
    budget = base + 1000                     # room for the prefetched layer's activations, for nothing kept
    layers = [replace(_cost(1.0, 1.0), first_reload=0.6) for _ in range(6)]
    plan = P.solve(layers, budget, base, staging=100, saved_extra=1000)
    # 1.6 s there, against checkpoint's 1.4 (its 100 bytes fit where no layer offloads its input: no staging)
    assert plan.choices == ("offload_saved",) * 5 + ("checkpoint",), plan
    cheap = [replace(c, first_reload=0.05) for c in layers]
    assert P.solve(cheap, budget, base, staging=100, saved_extra=1000).choices == ("offload_saved",) * 6
    assert layers[0].at(2000).first_reload == 1.2                     # scales with the tokens, as the copies do


def _measured_planner(model, **seconds):
    """The model's planner after its measuring step, with the layer kind's times for ``seconds``' choices replaced."""
    fastsft_lab.apply(model, memory_budget=16)
    _step(model, _inputs())
    planner = P.memory_planner(model)
    kind = next(iter(planner.costs))
    c = planner.costs[kind]
    planner.costs[kind] = P.LayerCost(c.kind, c.tokens, {**c.seconds, **seconds}, c.held, c.unsaved, c.readings)
    return planner, c.tokens


def test_a_host_that_could_not_hold_the_activations_gets_no_offload_saved(monkeypatch):
    from dataclasses import replace

    model = _model()
    try:
        planner, tokens = _measured_planner(model, offload_saved=0.0)
        # what the layer pins: its saved activations, each block rounded up to a power of two (here as a real-width
        # layer's would be; the tiny model's tensors are all below the size offload_saved moves)
        kind = planner.kinds[0]
        c = planner.costs[kind]
        planner.costs[kind] = replace(c, readings={**c.readings, "pinned": 2 * c.held["keep"]})
        keep_total, pinned_total = LAYERS * c.held["keep"], LAYERS * 2 * c.held["keep"]
        assert set(planner.solve(tokens).choices) == {"offload_saved"}      # free and fastest: taken
        monkeypatch.setattr(P, "host_memory_available", lambda: 1 << 10)
        assert "offload_saved" not in planner.solve(tokens).choices
        # the check counts the pinned blocks, not the activations' bytes: room for the bytes is not enough
        monkeypatch.setattr(P, "host_memory_available", lambda: 2 * keep_total + 2)
        assert "offload_saved" not in planner.solve(tokens).choices
        monkeypatch.setattr(P, "host_memory_available", lambda: 2 * pinned_total + 2)
        assert set(planner.solve(tokens).choices) == {"offload_saved"}
    finally:
        fastsft_lab.revert(model)


@pytest.mark.cuda
def test_cuda_offload_saved_equals_plain_training_and_holds_less():
    # real streams: stores behind the forward, reloads behind the next layer's backward; the numbers to the bit
    # 8 layers: the last two layers' stores stay allocated (in flight) until the backward begins
    layers = 8
    model = build_model("tiny-qwen3", device="cuda", dtype=torch.bfloat16, num_layers=layers,
                        lora=LoraSettings(rank=8)).train()
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in benchmark_batches(
        tokens_per_step=4096, row_tokens=1024, steps=1, vocab_size=256, mix="short")[0].model_inputs().items()}

    def step():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = model(**inputs).loss
        forward_held = torch.cuda.memory_allocated() - base
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads, forward_held

    ref_loss, ref, kept_held = step()
    saved = _planned(model, ("offload_saved",) * layers)
    saved.ops.log = []
    try:
        loss, got, saved_held = step()
    finally:
        fastsft_lab.revert(model)
    assert torch.equal(loss, ref_loss) and all(torch.equal(got[n], ref[n]) for n in ref)
    assert saved.stats.bytes_loaded == saved.stats.bytes_stored > 0
    assert saved_held < 0.5 * kept_held, (saved_held, kept_held)      # what the forward left on the GPU
    assert check_stream_order(saved.ops.log) == []


def test_a_gpu_that_shares_the_host_memory_gets_no_offloading():
    model = _model()
    try:
        planner, tokens = _measured_planner(model, offload=0.0, offload_saved=0.0)   # fastest, were memory separate
        assert set(planner.solve(tokens).choices) <= {"offload", "offload_saved"}
        planner.unified = True
        plan = planner.plan = planner.solve(tokens)
        assert not set(plan.choices) & {"offload", "offload_saved"}, plan
        assert "unified memory: no offloading" in fastsft_lab.state(model).memory_plan
    finally:
        fastsft_lab.revert(model)


def test_the_budget_scenario_variant_keeping_everything_on_the_host_trains_as_plain_training():
    from fastsft_lab.lab.scenarios.budget import _offload_saved_everywhere

    model = _model()
    inputs = _inputs()
    loss = _step(model, inputs)
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    variant = _offload_saved_everywhere(LAYERS)
    variant.enable(model)
    try:
        P.memory_planner(model).saved.min_bytes = 0
        assert torch.equal(_step(model, inputs), loss)
        assert all(torch.equal(p.grad, reference[n]) for n, p in model.named_parameters() if p.grad is not None)
        assert P.memory_planner(model).saved.stats.bytes_loaded > 0
    finally:
        variant.disable(model)
    assert fastsft_lab.state(model).checkpointing == "none"


def test_the_pinned_reading_counts_each_moved_activation_as_a_power_of_two_block():
    """What offload_saved pins for a layer: every saved activation it moves (1 MiB and more), each rounded up to a
    power of two as torch's pinned allocator does (1.28 MB -> 2 MiB here), parameters left out."""
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, num_layers=1)
    layer = decoder_layers(model)[0]
    x = torch.randn(1, 5000, model.config.hidden_size)        # 1.28 MB per hidden-sized activation
    pos = torch.arange(5000)[None]
    rotary = model.model.rotary_emb(x, pos)
    run = lambda h: layer(h, position_embeddings=rotary, position_ids=pos, attention_mask=None)   # noqa: E731
    resident = {t.untyped_storage().data_ptr() for t in [*layer.parameters(), *layer.buffers()]}
    sizes = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in resident:
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t.detach()         # as itself, a saved output would hold its own graph past this forward

    inp = x.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run(inp)
    moved = [b for b in sizes.values() if b >= 1 << 20]
    expected = sum(1 << (b - 1).bit_length() for b in moved)
    cost = P.measure_layer(run, x, [], resident=[*layer.parameters(), *layer.buffers()], repeats=1)
    assert moved and cost.readings["pinned"] == expected > sum(moved)
