"""The restore log: every change fastsft_lab's switches make to a model, and the way back.

One log per model (kept on the transformers ``*ForCausalLM`` under its wrappers), written through one helper. A
switch asks for its writer, ``log = changes(model, "packed_attention")``, and makes each change through it::

    log.set(config, ATTN_IMPLEMENTATION, "fastsft_sdpa")   # an attribute (or a config field) set
    log.hook(layer.register_forward_pre_hook(...))        # a hook registered
    log.forward(module, fused_forward)                     # an instance forward in front of the module's own
    log.item(registry, key, value)                         # a dict entry written
    log.swap_class(module, NF4Experts)                     # a class swapped
    log.keep(module, "gradient_checkpointing", ...)        # fields a framework call is about to write
    log.callback(release)                                  # anything else, undone by a function

Each entry remembers what was there before. :func:`undo` takes one switch's entries back in reverse order
(``disable``), or every switch's (``revert``); a switch's runtime object -- the offload manager, the memory planner,
packed attention's settings -- is its *record*, kept beside its entries (:meth:`Changes.record`, :func:`record`)
and dropped with them. :func:`fastsft_lab.model_state.state` reads the records. When the last entry and record go,
the log goes too: the model's ``__dict__`` is what it was.

The habits are the standard library's ``contextlib.ExitStack`` (undo callbacks pushed as changes are made, unwound
in reverse) and ``unittest.mock.patch`` (set an attribute, keep the original, put it back).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import MethodType
from typing import Any, Callable

from torch import nn

from .structure import base_model

_ABSENT = object()           # "the object had no instance value here": undo deletes it
_LOG_ATTR = "_fastsft_restore_log"


@dataclass(eq=False)
class Entry:
    """One change: ``kind`` (set, item, hook, class, keep, callback) of ``target`` / ``name``, what the switch put
    there (``value``) and what was there before (``before``)."""

    switch: str
    kind: str
    target: Any
    name: Any = None
    value: Any = None
    before: Any = _ABSENT

    def __repr__(self) -> str:
        return f"{self.switch}: {self.kind} {type(self.target).__name__}.{self.name}"


# -- how each kind of entry is made and undone: one function each, dispatched by kind ---------------------------------
def _is_property(obj: Any, name: str) -> bool:
    """A data descriptor on the class (transformers' config fields are properties over ``*_internal`` fields):
    written and restored through its setter, not the instance dict."""
    for cls in type(obj).__mro__:
        if name in vars(cls):
            return hasattr(vars(cls)[name], "__set__")
    return False


def _read(obj: Any, name: str) -> Any:
    if _is_property(obj, name):
        return getattr(obj, name)
    return vars(obj).get(name, _ABSENT)


def _write(obj: Any, name: str, value: Any) -> None:
    if _is_property(obj, name):
        setattr(obj, name, value)
    elif value is _ABSENT:
        vars(obj).pop(name, None)
    else:
        vars(obj)[name] = value


def _undo_set(e: Entry) -> None:
    _write(e.target, e.name, e.before)


def _undo_item(e: Entry) -> None:
    if e.before is _ABSENT:
        e.target.pop(e.name, None)
    else:
        e.target[e.name] = e.before


def _undo_hook(e: Entry) -> None:
    e.target.remove()


def _undo_class(e: Entry) -> None:
    e.target.__class__ = e.before


def _undo_keep(e: Entry) -> None:
    for name, before in e.before.items():
        _write(e.target, name, before)


def _undo_callback(e: Entry) -> None:
    e.target()


_UNDO: dict[str, Callable[[Entry], None]] = {"set": _undo_set, "item": _undo_item, "hook": _undo_hook,
                                             "class": _undo_class, "keep": _undo_keep, "callback": _undo_callback}


@dataclass(eq=False)
class RestoreLog:
    """The changes of every switch on one model, in the order they were made, and each switch's record."""

    entries: list[Entry] = field(default_factory=list)
    records: dict[str, Any] = field(default_factory=dict)

    def of(self, switch: str) -> list[Entry]:
        return [e for e in self.entries if e.switch == switch]

    def is_on(self, switch: str) -> bool:
        return any(e.switch == switch for e in self.entries)

    def switches(self) -> list[str]:
        """The switches with entries or a record, in the order they were first logged."""
        seen = dict.fromkeys(e.switch for e in self.entries)
        seen.update(dict.fromkeys(self.records))
        return list(seen)

    def undo(self, switch: str | None = None, *, keep_record: bool = False) -> None:
        """Undo ``switch``'s entries (every switch's when None), the last made first; drop its record unless
        ``keep_record``."""
        mine = [e for e in self.entries if switch is None or e.switch == switch]
        self.entries = [e for e in self.entries if not (switch is None or e.switch == switch)]
        for e in reversed(mine):
            _UNDO[e.kind](e)
        if not keep_record:
            dropped = list(self.records.values()) if switch is None else [self.records.get(switch)]
            if switch is None:
                self.records.clear()
            else:
                self.records.pop(switch, None)
            for rec in dropped:
                close = getattr(rec, "close", None)
                if close is not None:
                    close()             # a record holding memory (the offload manager's pinned pool) lets it go


def log_of(model: nn.Module) -> RestoreLog | None:
    """The model's restore log, or None when no switch changed anything on it."""
    return vars(base_model(model)).get(_LOG_ATTR)


def _log_for_writing(model: nn.Module) -> RestoreLog:
    owner = base_model(model)
    log = vars(owner).get(_LOG_ATTR)
    if log is None:
        log = RestoreLog()
        vars(owner)[_LOG_ATTR] = log        # plain instance data: nn.Module registers nothing for it
    return log


def _drop_if_empty(model: nn.Module) -> None:
    owner = base_model(model)
    log = vars(owner).get(_LOG_ATTR)
    if log is not None and not log.entries and not log.records:
        del vars(owner)[_LOG_ATTR]


class Changes:
    """The writer of one switch on one model: every change it makes goes through here (see the module docstring)."""

    def __init__(self, model: nn.Module, switch: str):
        self.model = model
        self.switch = switch

    @property
    def _log(self) -> RestoreLog:
        return _log_for_writing(self.model)      # made on the first change

    def _add(self, kind: str, target: Any, name: Any = None, value: Any = None, before: Any = _ABSENT) -> Entry:
        entry = Entry(self.switch, kind, target, name, value, before)
        self._log.entries.append(entry)
        return entry

    def _mine(self, kind: str, target: Any, name: Any) -> Entry | None:
        for e in entries(self.model, self.switch):
            if e.switch == self.switch and e.kind == kind and e.target is target and e.name == name:
                return e
        return None

    def set(self, obj: Any, name: str, value: Any) -> None:
        """``obj.name = value``; undone to what ``obj`` had (its instance value, or none). Setting it again keeps the
        first entry, which holds the original."""
        entry = self._mine("set", obj, name)
        if entry is None:
            entry = self._add("set", obj, name, value, _read(obj, name))
        entry.value = value
        if _is_property(obj, name):
            setattr(obj, name, value)
        else:
            vars(obj)[name] = value

    def forward(self, module: nn.Module, forward: Callable) -> None:
        """Run ``forward(module, original, *args, **kwargs)`` in place of ``module.forward`` (on the instance; its
        class stays), ``original`` being the forward it had."""
        if self._mine("set", module, "forward") is not None:
            return
        original = module.forward
        self.set(module, "forward", MethodType(functools.partial(_call_with_original, forward, original), module))

    def item(self, mapping: dict, key: Any, value: Any) -> None:
        """``mapping[key] = value``; undone to the entry it had (or none)."""
        if self._mine("item", mapping, key) is None:
            self._add("item", mapping, key, value, mapping.get(key, _ABSENT))
        mapping[key] = value

    def hook(self, handle: Any) -> Any:
        """A hook's ``RemovableHandle``: removed on undo. Returns it."""
        self._add("hook", handle)
        return handle

    def swap_class(self, obj: Any, cls: type) -> None:
        """``obj.__class__ = cls``; undone to the class it had."""
        if self._mine("class", obj, "__class__") is None:
            self._add("class", obj, "__class__", cls, type(obj))
        obj.__class__ = cls

    def keep(self, obj: Any, *names: str) -> None:
        """Before a framework call that writes ``names`` of ``obj`` (``gradient_checkpointing_enable``, say): what
        they hold now comes back on undo (kept once: a second call keeps the first, which holds the original)."""
        if self._mine("keep", obj, names) is None:
            self._add("keep", obj, names, None, {name: _read(obj, name) for name in names})

    def callback(self, undo: Callable[[], None]) -> None:
        """Anything else: ``undo()`` is called in its turn."""
        self._add("callback", undo)

    @property
    def record(self) -> Any:
        """This switch's runtime object (None when it has none)."""
        return record(self.model, self.switch)

    @record.setter
    def record(self, value: Any) -> None:
        self._log.records[self.switch] = value



def _call_with_original(forward: Callable, original: Callable, module: nn.Module, *args, **kwargs):
    return forward(module, original, *args, **kwargs)


def changes(model: nn.Module, switch: str) -> Changes:
    """``switch``'s writer on ``model`` (the log is made on the first change)."""
    return Changes(model, switch)


def undo(model: nn.Module, switch: str | None = None, *, keep_record: bool = False) -> None:
    """Take back ``switch``'s changes on ``model`` in reverse order (every switch's when None: ``revert``)."""
    log = log_of(model)
    if log is None:
        return
    log.undo(switch, keep_record=keep_record)
    _drop_if_empty(model)


def record(model: nn.Module, switch: str) -> Any:
    """``switch``'s record on ``model``, or None."""
    log = log_of(model)
    return log.records.get(switch) if log is not None else None


def entries(model: nn.Module, switch: str) -> list[Entry]:
    """``switch``'s entries on ``model``, in the order they were made."""
    log = log_of(model)
    return log.of(switch) if log is not None else []


def is_on(model: nn.Module, switch: str) -> bool:
    """Whether ``switch`` has changes on ``model``."""
    log = log_of(model)
    return log is not None and log.is_on(switch)


def on_records(model: nn.Module) -> list[Any]:
    """The records of the switches that have changes on ``model`` now, in the order they were switched on."""
    log = log_of(model)
    if log is None:
        return []
    return [log.records[s] for s in log.switches() if s in log.records and log.is_on(s)]


# -- the shape every switch has ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Optimization:
    """One switch of :func:`fastsft_lab.apply`, in the shape every switch has; each package defines its own beside
    the code it switches.

    ``validate(model, value, options)`` raises a one-line error and changes nothing; it returns the switch's
    settings, which ``enable(model, settings)`` switches on (or into another mode) through ``changes(model, name)``.
    ``value`` None means "as it is": ``options`` alone change the mode of a switch that is on. :meth:`disable` is
    the log's undo of exactly what it changed; :meth:`state` is what its record reports (:func:`fastsft_lab.state`).

    ``off``: the values that mean off. ``options``: :func:`~fastsft_lab.apply`'s arguments that are modes of this
    switch. ``takes``: switches this one takes over while it is on: given with it, their value and options are its
    options; switching it on turns them off first, and setting one of them alone turns this one off.
    """

    name: str
    validate: Callable[[nn.Module, Any, dict], Any]
    enable: Callable[[nn.Module, Any], None]
    off: tuple = ()
    options: tuple[str, ...] = ()
    takes: tuple[str, ...] = ()

    def is_off(self, value: Any) -> bool:
        return any(value is o or (type(value) is type(o) and value == o) for o in self.off)

    def disable(self, model: nn.Module) -> None:
        undo(model, self.name)

    def is_on(self, model: nn.Module) -> bool:
        return is_on(model, self.name)

    def state(self, model: nn.Module) -> dict:
        rec = record(model, self.name)
        return rec.state() if rec is not None and is_on(model, self.name) else {}


__all__ = ["Changes", "Entry", "RestoreLog", "Optimization", "changes", "undo", "record", "entries", "is_on", "on_records",
           "log_of"]
