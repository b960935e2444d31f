"""The checkpointing plan for a memory budget on a live model: every per-layer choice and every mix of them computes
what plain training computes, under wrappers and compile; the measured bytes order the choices."""

from __future__ import annotations

import pytest
import torch

import fastsft_lab
from fastsft_lab.data import benchmark_batches
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.structure import decoder_layers
from fastsft_lab.offload import plan as P

from _plan_helpers import GiB, _assert_bitwise, _batch, _model, _step

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


# -- exactness -------------------------------------------------------------------------------------------------------
PLANS = {"keep": ("keep",) * 4, "selective": ("selective",) * 4, "checkpoint": ("checkpoint",) * 4,
         "offload": ("offload",) * 4, "mixed": ("keep", "offload", "selective", "checkpoint"),
         "mixed-2": ("offload", "selective", "offload", "keep"), "offload_saved": ("offload_saved",) * 4,
         "mixed-3": ("offload_saved", "selective", "keep", "offload_saved")}


def _plan_on(model, **kw):
    """apply(memory_budget=16) with offload_saved moving every saved activation (the tiny models' are all under the
    default 1 MiB it leaves on the device)."""
    state = fastsft_lab.apply(model, memory_budget=16, **kw)
    P.memory_planner(model).saved.min_bytes = 0
    return state


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gpt-oss"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full-ft"])
def test_every_choice_and_mix_equals_plain_training(preset, lora):
    model = _model(preset, lora)
    inputs = _batch()
    reference = _step(model, inputs)            # no checkpointing: nothing of ours touches it
    _plan_on(model)
    try:
        for choices in PLANS.values():
            P.set_plan(model, choices)
            _assert_bitwise(reference, _step(model, inputs))
        assert P.memory_planner(model).saved.stats.bytes_loaded > 0     # offload_saved moved what it saved
    finally:
        fastsft_lab.revert(model)
    _assert_bitwise(reference, _step(model, inputs))


def test_plans_compose_with_packed_metadata_sync_free_routing_and_fused_loss():
    model = _model("tiny-gpt-oss", True)
    inputs = _batch()
    fastsft_lab.apply(model, packed_attention="sdpa", moe_routing="sync_free", fused_loss=True)
    try:
        reference = _step(model, inputs)
        _plan_on(model)
        for choices in (PLANS["mixed"], PLANS["mixed-2"], PLANS["selective"], PLANS["mixed-3"]):
            P.set_plan(model, choices)
            _assert_bitwise(reference, _step(model, inputs))
    finally:
        fastsft_lab.revert(model)


def test_dropout_is_replayed_in_every_recompute():
    model = _model("tiny-qwen3", True, dropout=0.3)
    inputs = _batch()
    reference = _step(model, inputs, seed=3)
    _plan_on(model)
    try:
        for plan in (PLANS["mixed"], PLANS["mixed-3"]):
            P.set_plan(model, plan)
            _assert_bitwise(reference, _step(model, inputs, seed=3))
    finally:
        fastsft_lab.revert(model)


def test_the_measuring_step_and_the_solved_plan_equal_plain_training():
    # step 1 measures each kind of layer inside the step (RNG and output collectors kept out of it), step 2 runs the
    # solved plan: both steps compute what plain training computes
    model = _model("tiny-qwen3", True, dropout=0.3)
    inputs = _batch()
    reference = _step(model, inputs, seed=5)
    state = fastsft_lab.apply(model, memory_budget=16)
    try:
        assert state.checkpointing == "plan" and "measuring" in state.memory_plan
        _assert_bitwise(reference, _step(model, inputs, seed=5))
        planner = P.memory_planner(model)
        assert set(planner.costs) == {"Qwen3DecoderLayer:full_attention"}
        _assert_bitwise(reference, _step(model, inputs, seed=5))
        assert planner.plan is not None and len(planner.plan.choices) == 4
        # 16 GiB holds everything on a CPU: every layer takes its fastest measured choice (timings decide which)
        cost = planner.costs["Qwen3DecoderLayer:full_attention"]
        best = min(cost.seconds.values())
        assert all(cost.seconds[c] == best for c in planner.plan.choices), (planner.plan, cost.seconds)
        shown = fastsft_lab.state(model).memory_plan
        assert planner.plan.describe() in shown
        # and why: every choice's measured time and bytes for the layer kind
        assert all(f"{c} {cost.seconds[c] * 1e3:.1f} ms" in shown for c in P.CHOICES), shown
    finally:
        fastsft_lab.revert(model)
    assert fastsft_lab.state(model).checkpointing == "none"
    assert all(not layer.gradient_checkpointing for layer in decoder_layers(model))


def test_the_measuring_step_leaves_nothing_of_its_measurement_alive():
    # step 1 runs each kind of layer once more under saved-tensor hooks and an op recorder, with no backward: what
    # they hold must go with them (a saved output returned as itself, or an op output kept with its grad_fn, is a
    # cycle through autograd's C++ nodes that stays allocated for the process's life: one layer's activations)
    from _offload_helpers import graph_tensors

    model = _model("tiny-qwen3", True)
    inputs = _batch()
    _step(model, inputs)
    before = graph_tensors()             # (an earlier test's, if any)
    fastsft_lab.apply(model, memory_budget=16)
    try:
        _step(model, inputs)
        assert "Qwen3DecoderLayer:full_attention" in P.memory_planner(model).costs
        leaked = graph_tensors(besides=before)
        assert leaked == [], f"{len(leaked)} tensors of the measurement's graph outlive it"
    finally:
        fastsft_lab.revert(model)


def test_each_layer_runs_the_choice_its_plan_names():
    # what plain autograd keeps is seen by a saved-tensors hook around the step; a checkpointed, selective or
    # offloaded layer keeps its activations behind its own hooks (or none): only kept layers add to the count
    model = _model("tiny-qwen3", True)
    inputs = _batch()

    def kept_bytes(choices):
        seen: dict = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        P.set_plan(model, choices)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**inputs).loss          # the forward only: a recompute in backward saves for a moment
        loss.backward()
        model.zero_grad(set_to_none=True)
        return sum(seen.values())

    fastsft_lab.apply(model, memory_budget=16)
    try:
        _step(model, inputs)         # step 1 measures outside the counted steps
        none = kept_bytes(("checkpoint", "selective", "offload", "checkpoint"))
        one = kept_bytes(("checkpoint", "keep", "offload", "checkpoint"))
        two = kept_bytes(("checkpoint", "keep", "keep", "checkpoint"))
        every = kept_bytes(("keep",) * 4)
    finally:
        fastsft_lab.revert(model)
    # each kept layer adds its activations (kept neighbours share the residual stream: not a fixed amount)
    assert none < one < two < every, (none, one, two, every)
    assert two - none > 1.5 * (one - none) and every - none > 3 * (one - none), (none, one, two, every)


# -- what each choice holds -----------------------------------------------------------------------------------------
def test_measured_bytes_order_the_choices_and_grow_with_tokens():
    model = _model("tiny-qwen3", False)
    layer = decoder_layers(model)[0]
    costs = {}
    for tokens in (256, 512):
        x = torch.randn(1, tokens, model.config.hidden_size)
        pos = torch.arange(tokens)[None]
        rope = model.model.rotary_emb(x, pos)
        fn = lambda h, layer=layer, rope=rope, pos=pos: layer(h, position_embeddings=rope, position_ids=pos)
        costs[tokens] = P.measure_layer(fn, x, [p for p in layer.parameters() if p.requires_grad], repeats=1)
    c = costs[256]
    in_bytes = 256 * model.config.hidden_size * 4
    assert c.held["checkpoint"] == in_bytes and c.held["offload"] == 0
    # selective keeps the input and the matmul / attention outputs: more than the input, less than everything
    assert in_bytes < c.held["selective"] < c.held["keep"], c.held
    # the q/k/v/o, gate/up/down outputs alone are at least this many bytes
    h, inter = model.config.hidden_size, model.config.intermediate_size
    assert c.held["selective"] >= in_bytes + 256 * 4 * (2 * h + 3 * inter)
    for choice in ("keep", "selective", "checkpoint"):
        assert costs[512].held[choice] >= 2 * c.held[choice] * 0.95, choice
    assert set(c.seconds) == set(P.CHOICES) and all(s > 0 for s in c.seconds.values())


def test_the_plan_under_torch_compile_equals_plain_training():
    # dynamo traces the model; the plan's bookkeeping runs eagerly (torch.compiler.disable), the layers as planned
    model = _model("tiny-qwen3", True)
    inputs = _batch()
    reference = _step(model, inputs)
    compiled = torch.compile(model, backend="eager")
    fastsft_lab.apply(compiled, memory_budget=16)
    try:
        for _ in range(2):                                   # the measuring step, then the solved plan
            _assert_bitwise(reference, _step(compiled, inputs))
        assert P.memory_planner(model).plan is not None
        P.memory_planner(model).saved.min_bytes = 0
        for plan in (PLANS["mixed"], PLANS["mixed-3"]):
            P.set_plan(model, plan)
            _assert_bitwise(reference, _step(compiled, inputs))
    finally:
        fastsft_lab.revert(compiled)
        torch.compiler.reset()


def test_a_solved_plan_pays_no_host_sync_in_the_layers():
    from fastsft_lab.packing import packed_inputs
    from fastsft_lab.profiling import SyncCounter

    model = _model("tiny-gpt-oss", True)
    batch = benchmark_batches(tokens_per_step=192, row_tokens=96, steps=1, vocab_size=256, mix="short")[0]
    fastsft_lab.apply(model, packed_attention="sdpa", moe_routing="sync_free", fused_loss=True, memory_budget=16)
    try:
        for _ in range(2):                         # step 1 measures (it syncs to time), step 2 solves
            model(**packed_inputs(batch)).loss.backward()
        for choices in (P.memory_planner(model).plan.choices, PLANS["mixed"]):
            P.set_plan(model, choices)
            with SyncCounter.for_decoder_layers(model, device="cpu") as syncs:
                model(**packed_inputs(batch)).loss.backward()
            assert syncs.in_modules == 0, (choices, dict(syncs.by_kind))
    finally:
        model.zero_grad(set_to_none=True)
        fastsft_lab.revert(model)


def test_frozen_weights_autograd_saves_are_not_counted_as_held():
    # LoRA: the frozen base weights are saved by the matmuls for the input's gradient, but the GPU holds them anyway
    model = _model("tiny-qwen3", True)
    layer = decoder_layers(model)[0]
    x = torch.randn(1, 128, model.config.hidden_size)
    pos = torch.arange(128)[None]
    rope = model.base_model.model.model.rotary_emb(x, pos)
    fn = lambda h: layer(h, position_embeddings=rope, position_ids=pos)   # noqa: E731
    trainable = [p for p in layer.parameters() if p.requires_grad]
    frozen = [p for p in layer.parameters() if not p.requires_grad]
    counted = P.measure_layer(fn, x, trainable, repeats=1)
    resident = P.measure_layer(fn, x, trainable, repeats=1, resident=[*frozen, *layer.buffers()])
    frozen_bytes = sum(p.numel() * p.element_size() for p in frozen if p.dim() == 2)
    assert counted.held["keep"] - resident.held["keep"] >= 0.9 * frozen_bytes, (counted.held, resident.held)
    assert resident.held["keep"] > resident.held["checkpoint"]


def test_selective_saves_the_nf4_matmuls_and_stays_exact():
    """QLoRA's NF4 projections are one custom op (``bitsandbytes::gemm_4bit``) to a dispatch mode: the selective
    choice saves their outputs as it saves aten matmuls, so its recompute in backward runs no NF4 matmul (a full
    checkpoint runs every one again), and the step equals plain training's to the bit."""
    pytest.importorskip("bitsandbytes")
    from fastsft_lab._compat import TorchDispatchMode

    model = build_model("tiny-qwen3", device="cpu", dtype=torch.bfloat16, num_layers=2, quant="nf4",
                        lora=LoraSettings(rank=4))
    model.train()
    gemm = torch.ops.bitsandbytes.gemm_4bit
    assert gemm in P.saved_ops()
    inputs = _batch()

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func.overloadpacket is gemm
            return func(*args, **(kwargs or {}))

    def backward_gemms(choices):
        P.set_plan(model, choices)
        loss = model(**inputs).loss
        with Count() as count:
            loss.backward()
        model.zero_grad(set_to_none=True)
        return count.n

    reference = _step(model, inputs)
    fastsft_lab.apply(model, memory_budget=16)
    try:
        _step(model, inputs)                                     # step 1 measures
        per_layer = backward_gemms(("checkpoint", "keep")) - backward_gemms(("keep", "keep"))
        assert per_layer == 7, per_layer                        # q, k, v, o, gate, up, down recomputed
        assert backward_gemms(("selective", "keep")) == backward_gemms(("keep", "keep"))
        for choices in [("selective", "selective"), ("selective", "offload")]:
            P.set_plan(model, choices)
            _assert_bitwise(reference, _step(model, inputs))
    finally:
        fastsft_lab.revert(model)


def test_the_allocated_reading_counts_only_what_a_kept_layer_holds(monkeypatch):
    """A kept layer's bytes are also read from the allocator (CUDA: ``memory_allocated`` after a forward), for what
    autograd keeps outside saved tensors. That reading must come from a plain forward: the selective choice's op-
    output records hold every matmul output, saved or not, and read under them a MoE layer's unsaved expert outputs
    counted as kept (the H200's GPT-OSS plan predicted 1.21 GB a layer; it held about 0.9). Here an allocator
    stand-in counts the live op outputs (weakly, as the allocator sees them): the reading equals what autograd saves."""
    import weakref

    from fastsft_lab._compat import TorchDispatchMode, pytree

    class Allocator(TorchDispatchMode):
        def __init__(self, exclude):
            super().__init__()
            self.refs, self.exclude = [], exclude

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.refs += [weakref.ref(t) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            return out

        def allocated(self, device):
            live = {}
            for ref in self.refs:
                if (t := ref()) is not None and t.untyped_storage().data_ptr() not in self.exclude:
                    live[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return sum(live.values())

    model = build_model("tiny-gpt-oss", device="cpu", dtype=torch.float32, num_layers=1)
    layer = decoder_layers(model)[0]
    x = torch.randn(1, 256, model.config.hidden_size)
    pos = torch.arange(256)[None]
    rotary = model.model.rotary_emb(x, pos)
    resident = [*layer.parameters(), *layer.buffers()]
    allocator = Allocator({t.untyped_storage().data_ptr() for t in resident})
    monkeypatch.setattr(P, "_allocated_now", allocator.allocated)
    with allocator:
        cost = P.measure_layer(lambda h: layer(h, position_embeddings=rotary, position_ids=pos, attention_mask=None),
                               x, [], resident=resident, repeats=1)
    # what autograd saves, less the layer's input (allocated before the reading began)
    assert cost.readings["allocated"] + x.numel() * x.element_size() == cost.readings["saved"], cost.readings
    assert cost.held["keep"] == cost.readings["saved"]
