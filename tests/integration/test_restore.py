"""The way back, as a property: any sequence of ``apply`` / ``revert`` / one switch on and off, over every switch
and through every wrapper a user puts on (PEFT, DDP on a one-process gloo group, ``torch.compile``), with training
steps in between, leaves the model bitwise what it was -- its outputs and gradients, the instance ``__dict__`` of
every module and config, its hooks, its classes -- once every switch is off again (``revert``, or each switch off
alone). A call refused with an error changes nothing. And what a new switch costs: one ``Optimization`` beside the
code it switches, one ``register``."""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import fastsft_lab
from fastsft_lab import toggles
from fastsft_lab.data import benchmark_batches
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.restore import Optimization, changes, entries, log_of
from fastsft_lab.structure import base_model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

_PLAIN = (str, int, float, bool, type(None))


def _value(v):
    if isinstance(v, dict):              # hooks, parameters, submodules: the same objects under the same keys
        return tuple((k, id(x)) for k, x in v.items())
    if isinstance(v, (list, tuple)):
        return tuple(x if isinstance(x, _PLAIN) else id(x) for x in v)
    return v if isinstance(v, _PLAIN) else id(v)


def snapshot(model: torch.nn.Module) -> dict:
    """Every module's class and instance ``__dict__`` (hook tables included), and every config's ``__dict__``."""
    out = {}
    for name, m in model.named_modules(remove_duplicate=False):
        out[name] = (type(m), {k: _value(v) for k, v in vars(m).items()})
        config = getattr(m, "config", None)
        if config is not None and not isinstance(config, torch.nn.Module):
            out[f"{name}.config"] = {k: _value(v) for k, v in vars(config).items()}
    return out


def _differences(a: dict, b: dict) -> list[str]:
    found = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key), b.get(key)
        if x == y:
            continue
        if isinstance(x, tuple) and isinstance(y, tuple):
            found += [f"{key}: class {x[0].__name__} -> {y[0].__name__}"] if x[0] is not y[0] else []
            x, y = x[1], y[1]
        if isinstance(x, dict) and isinstance(y, dict):
            found += [f"{key}.{k}" for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
        else:
            found.append(key)
    return found


def _step(wrapper, model, batch) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    out = wrapper(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


def _outputs(model, batch):
    """Logits (no grad) and one step's loss and gradients: what the model computes."""
    with torch.no_grad():
        logits = model(**batch).logits.detach().clone()
    return logits, _step(model, model, batch)


def _assert_bitwise(ref, got):
    (l0, (loss0, g0)), (l1, (loss1, g1)) = ref, got
    assert torch.equal(l0, l1), "logits differ from the original model's"
    assert torch.equal(loss0, loss1), "loss differs from the original model's"
    assert g0.keys() == g1.keys(), "another set of parameters received gradients"
    for name in g0:
        assert torch.equal(g0[name], g1[name]), f"gradient of {name} differs from the original model's"


# -- the models, their wrappers, and the switches each takes ------------------------------------------------------
SWITCHES = {
    "moe": {"packed_attention": ["sdpa", "eager"], "offload_buffers": [0, 1, 2], "memory_budget": [16],
            "moe_routing": ["naive", "grouped", "sync_free", "eager"], "fused_loss": [True], "fused_lora": [True]},
    "qlora": {"packed_attention": ["sdpa"], "offload_buffers": [0, 2], "memory_budget": [16], "fused_loss": [True],
              "fused_lora": [True], "fused_dequant": [True]},
}
OFF = {"packed_attention": "off", "offload_buffers": "off", "memory_budget": "off", "moe_routing": "off",
       "fused_loss": False, "fused_lora": False, "fused_dequant": False}
MODES = {"packed_metadata_cache": [True, False], "prefetch": [True, False], "max_tokens": [4096]}


@pytest.fixture(scope="module")
def gloo():
    """A one-process gloo group, for DDP in this process."""
    if dist.is_initialized():
        yield
        return
    path = tempfile.mktemp(prefix="fastsft-gloo-")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if os.path.exists(path):
            os.remove(path)


@pytest.fixture(scope="module")
def models(gloo):
    out = {}
    for kind, (preset, quant) in {"moe": ("tiny-gpt-oss", None), "qlora": ("tiny-qwen3", "nf4")}.items():
        model = build_model(preset, device="cpu", dtype=torch.float32, quant=quant, lora=LoraSettings(rank=4),
                            num_layers=2, seed=1)
        for n, p in model.named_parameters():             # PEFT starts lora_B at zero: give each adapter a gradient
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.05)
        model.train()
        batch = benchmark_batches(tokens_per_step=128, row_tokens=64, steps=1, vocab_size=256,
                                  mix="short")[0].model_inputs()
        wrappers = {"peft": model, "ddp": torch.nn.parallel.DistributedDataParallel(model),
                    "compile": torch.compile(model, backend="eager")}
        out[kind] = (model, batch, wrappers, snapshot(model), _outputs(model, batch))
    return out


def _ops(kind: str):
    switch = st.sampled_from(sorted(SWITCHES[kind]))
    wrapper = st.sampled_from(["peft", "ddp", "compile"])
    on = switch.flatmap(lambda s: st.tuples(st.just("on"), st.just(s), st.sampled_from(SWITCHES[kind][s]), wrapper))
    off = st.tuples(st.just("off"), switch, wrapper)
    several = st.tuples(st.just("apply"), st.dictionaries(
        switch, st.just(None), min_size=2, max_size=4).flatmap(
            lambda d: st.fixed_dictionaries({s: st.sampled_from([*SWITCHES[kind][s], OFF[s]]) for s in d})), wrapper)
    mode = st.tuples(st.just("mode"), st.sampled_from(sorted(MODES)).flatmap(
        lambda m: st.tuples(st.just(m), st.sampled_from(MODES[m]))), wrapper)
    step = st.tuples(st.just("step"), wrapper)
    return st.lists(st.one_of(on, on, off, several, mode, step, st.tuples(st.just("revert"), wrapper)),
                    min_size=1, max_size=6)


def _run(op, model, batch, wrappers) -> None:
    what, *args, name = op
    w = wrappers[name]
    if what == "step":
        _step(w, model, batch)
        return
    if what == "revert":
        fastsft_lab.revert(w)
        return
    kwargs = ({args[0]: args[1]} if what == "on" else {args[0]: OFF[args[0]]} if what == "off"
              else dict(args[0]) if what == "apply" else {args[0][0]: args[0][1]})
    before_state, before = fastsft_lab.state(model), snapshot(model)
    try:
        fastsft_lab.apply(w, **kwargs)
    except (ValueError, NotImplementedError) as e:       # refused (a mode without its switch, ...): nothing changed
        assert "\n" not in str(e), f"not a one-line error: {e}"
        assert fastsft_lab.state(model) == before_state, f"{kwargs} raised and left the model switched: {e}"
        assert not _differences(before, snapshot(model)), f"{kwargs} raised and changed the model: {e}"


@pytest.mark.parametrize("kind", ["moe", "qlora"])
@pytest.mark.parametrize("way_back", ["revert", "each_switch_off"])
@settings(max_examples=6, deadline=None, derandomize=True, phases=(Phase.explicit, Phase.reuse, Phase.generate),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_any_sequence_of_switches_and_wrappers_comes_back_bitwise(models, kind, way_back, data):
    model, batch, wrappers, original, reference = models[kind]
    ops = data.draw(_ops(kind), label="ops")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                    # "set by hand replaces memory_budget", fallbacks
        try:
            for op in ops:
                _run(op, model, batch, wrappers)
        finally:
            if way_back == "revert":
                fastsft_lab.revert(wrappers["compile"])
            else:
                for switch in reversed(toggles.OPTIMIZATIONS):
                    if switch.name in SWITCHES[kind]:
                        fastsft_lab.apply(wrappers["ddp"], **{switch.name: OFF[switch.name]})
    assert fastsft_lab.state(model) == fastsft_lab.ModelState(), fastsft_lab.state(model)
    assert log_of(model) is None, "the restore log still holds something"
    found = _differences(original, snapshot(model))
    assert not found, "not the original model after the way back:\n" + "\n".join(found[:20])
    _assert_bitwise(reference, _outputs(model, batch))


# -- what a new switch costs -------------------------------------------------------------------------------------------
def test_a_new_switch_is_one_optimization_and_one_register(models):
    """A no-op switch added from outside the package: its validate, its enable (one change, through the log, and a
    record with its state), registered -- then ``apply`` turns it on and off, ``state`` and ``revert`` know it."""
    model, batch, wrappers, original, _ = models["moe"]

    class Example:                                          # the switch's record: what state() reports
        def state(self) -> dict:
            return {}

    def validate(model, value, options):
        if not isinstance(value, bool):
            raise ValueError(f"example_switch must be True or False, got {value!r}")
        return value

    def enable(model, value):
        log = changes(model, "example_switch")
        log.set(base_model(model), "fastsft_example", True)     # every change through the log
        log.record = Example()

    toggles.register(Optimization("example_switch", validate, enable, off=(False,)))
    try:
        fastsft_lab.apply(wrappers["compile"], example_switch=True)
        assert [e.kind for e in entries(model, "example_switch")] == ["set"]
        assert base_model(model).fastsft_example is True
        with pytest.raises(ValueError, match="example_switch must be True or False"):
            fastsft_lab.apply(model, example_switch="yes")
        fastsft_lab.apply(model, example_switch=False)
        assert log_of(model) is None and not hasattr(base_model(model), "fastsft_example")
        fastsft_lab.apply(model, example_switch=True, fused_loss=True)
        fastsft_lab.revert(model)
    finally:
        toggles.unregister("example_switch")
    assert not _differences(original, snapshot(model))
    with pytest.raises(TypeError, match="unknown switch.*example_switch"):
        fastsft_lab.apply(model, example_switch=True)
