"""The restore log (``fastsft_lab.restore``): every kind of change is undone to exactly what was there, in reverse
order, one switch at a time or all at once; a switch's record goes with it; an empty log leaves the model."""

from __future__ import annotations

import torch
from torch import nn

from fastsft_lab.restore import changes, entries, is_on, log_of, on_records, record, undo


class _Config:
    """A config whose ``impl`` is a property over an internal field, as transformers' ``_attn_implementation``."""

    def __init__(self):
        self.impl_internal = "eager"

    @property
    def impl(self):
        return self.impl_internal

    @impl.setter
    def impl(self, value):
        self.impl_internal = value


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = _Config()
        self.layer = nn.Linear(2, 2)
        self.flag = False


class _Record:
    def __init__(self):
        self.closed = False

    def state(self):
        return {"example": True}

    def close(self):
        self.closed = True


def _dicts(model):
    return [dict(vars(m)) for m in model.modules()] + [dict(vars(model.config))]


def test_every_kind_of_change_comes_back_in_reverse_order():
    model = _Model()
    before, cls, registry = _dicts(model), type(model.layer), {"kept": 1}
    calls = []
    log = changes(model, "a")
    log.set(model, "flag", True)
    log.set(model, "flag", "again")                       # set twice: the first entry keeps the original
    log.set(model.config, "impl", "ours")                 # a property: through its setter
    log.item(registry, "kept", 2)
    log.item(registry, "new", 3)
    log.hook(model.layer.register_forward_pre_hook(lambda m, a: None))
    log.swap_class(model.layer, type("Subclass", (nn.Linear,), {}))
    log.forward(model.layer, lambda module, original, x: original(x) * 2)
    log.callback(lambda: calls.append("callback"))
    assert model.flag == "again" and model.config.impl_internal == "ours" and registry == {"kept": 2, "new": 3}
    x = torch.ones(1, 2)
    assert torch.equal(model.layer(x), 2 * nn.functional.linear(x, model.layer.weight, model.layer.bias))
    assert [e.kind for e in entries(model, "a")] == ["set", "set", "item", "item", "hook", "class", "set", "callback"]
    undo(model, "a")
    assert calls == ["callback"]
    assert _dicts(model) == before and type(model.layer) is cls and registry == {"kept": 1}
    assert log_of(model) is None and "_fastsft_restore_log" not in vars(model)


def test_a_switch_undone_alone_leaves_the_others_and_revert_takes_all():
    model = _Model()
    changes(model, "a").set(model, "flag", True)
    b = changes(model, "b")
    b.keep(model.layer, "training")                      # a framework call is about to write it
    model.layer.training = False
    b.record = rec = _Record()
    assert is_on(model, "a") and is_on(model, "b") and on_records(model) == [rec]
    undo(model, "a")
    assert model.flag is False and not is_on(model, "a") and is_on(model, "b") and not rec.closed
    undo(model)                                          # revert: every switch, every record
    assert model.layer.training is True and rec.closed and log_of(model) is None


def test_a_kept_record_outlives_its_changes_until_dropped():
    model = _Model()
    log = changes(model, "a")
    log.set(model, "flag", True)
    log.record = rec = _Record()
    undo(model, "a", keep_record=True)                   # off, its record kept for the next on
    assert model.flag is False and record(model, "a") is rec and not is_on(model, "a") and on_records(model) == []
    undo(model, "a")
    assert rec.closed and log_of(model) is None


def test_reading_the_log_makes_none():
    model = _Model()
    assert record(model, "a") is None and entries(model, "a") == [] and not is_on(model, "a")
    changes(model, "a")                                  # a writer that writes nothing
    assert log_of(model) is None
