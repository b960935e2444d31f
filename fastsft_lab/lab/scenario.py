"""One template for every benchmark scenario (Liger-Kernel's benchmark habit: the same providers, modes, warm-up
and statistics for every kernel).

A scenario is a :class:`Scenario` subclass with an ``Options`` dataclass. ``Options.defaults(device, smoke)`` gives
the GPU defaults (real architectures) or the smoke defaults (tiny models, a CPU); each field carries its help text
and a kind used to read ``--set SCENARIO.KEY=VALUE`` from the command line. :func:`resolve_options` applies
overrides and rejects unknown keys, naming the valid ones; :meth:`Scenario.validate` checks values before anything
runs. :meth:`Scenario.run` does the work and returns the result dicts it wrote as JSON.

On a CPU every scenario runs with one intra-op thread (restored afterwards): tiny models gain nothing from
threads, and on a small shared machine spinning OpenMP workers turn every step into noise.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar

import torch


class OptionError(ValueError):
    """A scenario option that is unknown or has an invalid value (the CLI prints it as one line)."""


def option(default: Any = None, *, help: str, kind: str = "any") -> Any:
    """A scenario option field. ``kind``: ``int``, ``float``, ``bool``, ``str``, ``ints``, ``strs``, ``int?``
    (an int or none), ``str?``, or ``any``."""
    if isinstance(default, (list, dict, tuple)):
        value = default
        return dataclasses.field(default_factory=lambda: type(value)(value), metadata={"help": help, "kind": kind})
    return dataclasses.field(default=default, metadata={"help": help, "kind": kind})


def _coerce(name: str, kind: str, value: Any) -> Any:
    def bad(want: str):
        return OptionError(f"option {name}: expected {want}, got {value!r}")

    if kind == "any":
        return value
    if kind in ("ints", "strs"):
        items = value if isinstance(value, (list, tuple)) else [value]
        if kind == "ints":
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
                raise bad("integers (comma-separated)")
            return [int(v) for v in items]
        return ["none" if v is None else str(v) for v in items]   # the CLI reads the word "none" as None
    optional = kind.endswith("?")
    base = kind.rstrip("?")
    if value is None and kind == "str":
        return "none"
    if value is None:
        if optional:
            return None
        raise bad(f"a value of kind {base}")
    if base == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer" + (" or none" if optional else ""))
        return value
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number")
        return float(value)
    if base == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if base == "str":
        return str(value)
    raise ValueError(f"unknown option kind {kind!r}")


def option_help(options_cls) -> list[tuple[str, str, str]]:
    """``(name, kind, help)`` of every option of a scenario's ``Options`` class."""
    return [(f.name, f.metadata.get("kind", "any"), f.metadata.get("help", "")) for f in dataclasses.fields(options_cls)
            if not f.name.startswith("_")]


def resolve_options(options_cls, device: torch.device, smoke: bool, overrides: dict | None = None):
    """``options_cls.defaults(device, smoke)`` with ``overrides`` applied; unknown keys raise :class:`OptionError`."""
    opts = options_cls.defaults(device, smoke)
    overrides = dict(overrides or {})
    fields = {f.name: f for f in dataclasses.fields(options_cls) if not f.name.startswith("_")}
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise OptionError(f"unknown option(s) {', '.join(unknown)}; valid: {', '.join(sorted(fields))}")
    values = {k: _coerce(k, fields[k].metadata.get("kind", "any"), v) for k, v in overrides.items()}
    return dataclasses.replace(opts, **values)


class Scenario:
    """A benchmark scenario: ``name`` (``--only``), ``title``, ``Options``, :meth:`validate` and :meth:`run`."""

    name: ClassVar[str]
    title: ClassVar[str]
    Options: ClassVar[type]

    def options(self, device: torch.device, smoke: bool, overrides: dict | None = None, *,
                steps: int | None = None, warmup: int | None = None):
        """Resolved and validated options (``steps``/``warmup`` from the CLI override the scenario's)."""
        opts = resolve_options(self.Options, device, smoke, overrides)
        extra = {k: v for k, v in (("steps", steps), ("warmup", warmup)) if v is not None}
        if extra:
            opts = dataclasses.replace(opts, **extra)
        self.validate(opts, device)
        return opts

    def validate(self, opts, device: torch.device) -> None:
        """Raise :class:`OptionError` for a value that cannot run (called before anything runs)."""
        if getattr(opts, "steps", 1) < 1:
            raise OptionError(f"steps must be >= 1, got {opts.steps}")
        if getattr(opts, "warmup", 0) < 0:
            raise OptionError(f"warmup must be >= 0, got {opts.warmup}")
        from ..models import PRESETS
        named = [getattr(opts, "preset", None), *(getattr(opts, "models", None) or [])]
        for name in (n for n in named if isinstance(n, str)):
            if name not in PRESETS:
                raise OptionError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")

    def run(self, opts, *, device: torch.device, out_dir: str, progress: bool = True) -> list[dict]:
        raise NotImplementedError

    def __call__(self, opts, *, device: torch.device, out_dir: str, progress: bool = True) -> list[dict]:
        """:meth:`run` with the output folder made and, on a CPU, one intra-op thread (restored afterwards)."""
        os.makedirs(out_dir, exist_ok=True)
        threads = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(1)
        try:
            return self.run(opts, device=device, out_dir=out_dir, progress=progress)
        finally:
            torch.set_num_threads(threads)


__all__ = ["Scenario", "OptionError", "option", "option_help", "resolve_options"]
