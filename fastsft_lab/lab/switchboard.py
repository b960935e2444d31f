"""An ipywidgets switchboard on a live model: one control per optimization, "run N steps", a live chart.

    sb = Switchboard(model, batches)       # batches: fastsft_lab.data.PackedBatch, on the model's device
    sb.show()                              # in Jupyter / Colab: the controls, the button and the chart

Every control goes through :func:`fastsft_lab.apply` ("off" included: each switch turns off on its own), so what the
panel shows is what a training script gets. Each run of N steps records, for the current setting, the median step time
(forward + backward + optimizer), the host syncs of one step's forward and backward and the peak GPU memory; the chart compares every
setting run so far. The same object is driven from code (``sb.set(...)``, ``sb.run(n)``), which is how the tests
check it on a CPU, and where no widget frontend is present (nbval, a terminal) :meth:`show` prints what it would
show.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import nn

import fastsft_lab

from ..data import PackedBatch
from ..structure import model_device
from ..moe import experts_modules
from ..packing import available_backends, packed_inputs
from ..profiling import PhaseTimer, SyncCounter, peak_memory, percentiles, reset_peak_memory
from .harness import AUTOCAST, make_optimizer


@dataclasses.dataclass
class Setting:
    """One position of every switch (what :meth:`Switchboard.set` takes)."""

    backend: str = "off"         # "off" (the model's own attention) or a packed-attention backend
    cache: bool = True           # packed metadata once per batch (False: rebuilt in every layer)
    buffers: int = 0             # 0: standard checkpointing, 1 or 2: offloaded
    prefetch: bool = True        # with 2 buffers
    moe: str = "off"             # "off" (stock experts), naive, grouped, sync_free
    fused_loss: bool = False

    def label(self) -> str:
        parts = ["stock attn" if self.backend == "off" else f"{self.backend}{'' if self.cache else ' naive'}",
                 {0: "ckpt", 1: "offload x1", 2: "offload x2" + (" +pf" if self.prefetch else "")}[self.buffers]]
        if self.moe != "off":
            parts.append(f"moe {self.moe}")
        if self.fused_loss:
            parts.append("fused loss")
        return ", ".join(parts)


class Switchboard:
    """The panel (see the module docstring).

    Args:
        model: a live transformers causal LM (PEFT-wrapped or not), with gradient checkpointing on.
        batches: packed batches to cycle through.
        lr: the optimizer's learning rate (AdamW over the trainable parameters).
        autocast: "none", "bf16" or "fp16": every step's forward and backward under ``torch.autocast`` (what
            ``SFTTrainer(bf16=True)`` does), as the benchmarks' steps run.
    """

    def __init__(self, model: nn.Module, batches: Sequence[PackedBatch], *, lr: float = 1e-6, autocast: str = "none"):
        if not batches:
            raise ValueError("the switchboard needs at least one batch")
        self.model = model
        self.batches = list(batches)
        self.device = model_device(model)
        self.is_moe = bool(experts_modules(model))
        status = available_backends(self.device)
        self.backends = ["off"] + [b for b, st in status.items() if st.training]
        if autocast not in AUTOCAST:
            raise ValueError(f"autocast must be one of {', '.join(AUTOCAST)}, got {autocast!r}")
        self.autocast = autocast
        self.setting = Setting()
        self.records: list[dict] = []
        self._optimizer = make_optimizer(model, lr=lr)
        self._step = 0
        self._widgets = None

    # -- the switches
    def set(self, **changes) -> Setting:
        """Change some switches (``backend``, ``cache``, ``buffers``, ``prefetch``, ``moe``, ``fused_loss``) and
        apply the whole setting to the model. Invalid values raise a one-line error naming the valid ones."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(Setting)}
        if unknown:
            raise ValueError(f"unknown switch(es) {sorted(unknown)}; valid: "
                             f"{', '.join(f.name for f in dataclasses.fields(Setting))}")
        new = dataclasses.replace(self.setting, **changes)
        if new.backend not in self.backends:
            raise ValueError(f"backend {new.backend!r} does not train here; valid: {', '.join(self.backends)}")
        if new.moe != "off" and not self.is_moe:
            raise ValueError("this model has no mixture-of-experts layers: moe must stay 'off'")
        if new.moe not in ("off", "naive", "grouped", "sync_free"):
            raise ValueError(f"moe must be off, naive, grouped or sync_free, got {new.moe!r}")
        if new.buffers not in (0, 1, 2):
            raise ValueError(f"buffers must be 0, 1 or 2, got {new.buffers!r}")
        self._apply_setting(new)
        self.setting = new
        self._sync_widgets()
        return new

    def _apply_setting(self, s: Setting) -> None:
        # the whole setting in one apply: every switch on, in its mode, or "off" (no revert in between)
        kwargs = {"offload_buffers": s.buffers, "fused_loss": s.fused_loss, "packed_attention": s.backend}
        if s.buffers == 2:
            kwargs["prefetch"] = s.prefetch
        if s.backend != "off":
            kwargs["packed_metadata_cache"] = s.cache
        if self.is_moe:
            kwargs["moe_routing"] = s.moe
        fastsft_lab.apply(self.model, **kwargs)

    # -- running
    def _inputs(self, batch: PackedBatch) -> dict:
        if self.setting.backend != "off" and self.setting.cache:
            return packed_inputs(batch)
        return batch.model_inputs()

    def _one_step(self, timer: PhaseTimer | None, counter: SyncCounter | None = None) -> float:
        batch = self.batches[self._step % len(self.batches)]
        self._step += 1
        ctx = timer.phase("step") if timer is not None else _null()
        with ctx:
            with counter if counter is not None else _null(), self._cast():   # forward + backward (optimizer apart)
                loss = self.model(**self._inputs(batch)).loss
                loss.backward()
            self._optimizer.step()
            self._optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def run(self, steps: int = 3) -> dict:
        """Run ``steps`` training steps in the current setting (after one untimed step that counts host syncs)."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        self.model.train()
        counter = SyncCounter(device=self.device)
        self._one_step(None, counter)
        timer = PhaseTimer(self.device)
        reset_peak_memory(self.device)
        times, losses = [], []
        for _ in range(steps):
            losses.append(self._one_step(timer))
            times.append(timer.collect()["step"])
        peak = peak_memory(self.device)
        record = {"setting": self.setting.label(), **dataclasses.asdict(self.setting),
                  "step_ms": percentiles(times), "host_syncs_per_step": counter.total, "peak_mem_bytes": peak,
                  "loss": losses[-1], "tokens_per_step": self.batches[0].num_tokens}
        self.records.append(record)
        self._redraw()
        return record

    def one_at_a_time(self, flips: Sequence[dict], steps: int = 2) -> list[dict]:
        """Run the current setting, then flip one switch per entry of ``flips`` (each a one-key dict such as
        ``{"cache": True}``, applied on top of the previous ones) and run ``steps`` steps after each, so that every
        record after the first differs from the one before it by exactly that switch (its ``changed``, e.g.
        ``"cache: off -> on"``). A flip of no or several switches is refused before anything runs."""
        for flip in flips:
            if len(flip) != 1:
                raise ValueError(f"one switch at a time: each flip names exactly one switch, got {sorted(flip)}")
        first = self.run(steps)
        first["changed"] = f"start: {first['setting']}"
        out = [first]
        for flip in flips:
            (name, value), = flip.items()
            before = getattr(self.setting, name)
            self.set(**flip)
            record = self.run(steps)
            record["changed"] = f"{name}: {_word(before)} -> {_word(value)}"
            out.append(record)
        self._redraw()
        return out

    def changes_text(self) -> str:
        """Every run so far, in order, as what changed since the run before it (the switch and its two positions, or
        the whole setting where it was set by hand), its median step, its speed over the run before ("x": higher is
        faster), host syncs before -> after and peak GPU memory ("–" where not measured, as on a CPU)."""
        lines = [f"{'what changed':40s} {'step ms':>9s} {'x prev':>7s} {'syncs':>10s} {'peak GiB':>9s}"]
        prev = None
        for r in self.records:
            ms = r["step_ms"]["median"]
            speed = f"{prev['step_ms']['median'] / ms:6.2f}x" if prev else f"{'':7s}"
            syncs = f"{prev['host_syncs_per_step']} -> {r['host_syncs_per_step']}" if prev else str(r["host_syncs_per_step"])
            peak = f"{r['peak_mem_bytes'] / 2**30:9.2f}" if r["peak_mem_bytes"] else f"{'–':>9s}"
            lines.append(f"{r.get('changed') or r['setting']:40s} {ms:9.1f} {speed} {syncs:>10s} {peak}")
            prev = r
        return "\n".join(lines)

    def breakdown(self, steps: int = 1) -> dict:
        """Where the current setting's step goes (:func:`.breakdown.profile_steps`: ms per category, on a GPU device
        time, on a CPU host ops' self time), after one unprofiled warm-up step. On a GPU, where the last run was of
        this setting, re-based on its unprofiled median step (:func:`.breakdown.without_profiler`)."""
        from .breakdown import profile_steps, without_profiler

        self.model.train()
        self._one_step(None)
        bd = profile_steps(self.model, lambda i: self._forward_backward(), device=self.device, steps=steps,
                           optimizer_step=self._optimizer_step)
        last = self.records[-1] if self.records else None
        if bd.get("activity") == "cuda" and last and last["setting"] == self.setting.label():
            bd = without_profiler(bd, last["step_ms"]["median"])
        return bd

    def _forward_backward(self) -> None:
        batch = self.batches[self._step % len(self.batches)]
        self._step += 1
        with self._cast():
            self.model(**self._inputs(batch)).loss.backward()

    def _cast(self):
        dtype = AUTOCAST[self.autocast]
        return _null() if dtype is None else torch.autocast(self.device.type, dtype=dtype)

    def _optimizer_step(self) -> None:
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)

    # -- what it shows
    def table(self) -> str:
        lines = [f"{'setting':46s} {'step ms':>10s} {'syncs':>6s} {'peak GiB':>9s}"]
        for r in self.records:
            peak = f"{r['peak_mem_bytes'] / 2**30:9.2f}" if r["peak_mem_bytes"] else f"{'-':>9s}"
            lines.append(f"{r['setting']:46s} {r['step_ms']['median']:10.1f} {r['host_syncs_per_step']:6d} {peak}")
        return "\n".join(lines)

    def figure(self):
        """Step time, host syncs and peak memory of every setting run so far (one bar each)."""
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        names = [r.get("changed") or r["setting"] for r in self.records]
        series = [("step ms (lower is better)", [r["step_ms"]["median"] for r in self.records]),
                  ("host syncs per step (lower is better)", [r["host_syncs_per_step"] for r in self.records]),
                  ("peak GPU memory, GiB (lower is better)",
                   [r["peak_mem_bytes"] / 2**30 if r["peak_mem_bytes"] else None for r in self.records])]
        for ax, (title, values) in zip(axes, series):
            ax.bar(range(len(values)), [float("nan") if v is None else v for v in values], color="#4C72B0")
            for i, v in enumerate(values):
                if v is None:                 # not measured (a CPU has no allocator peak): missing, not zero
                    ax.text(i, 0, "not\nmeasured", ha="center", va="bottom", fontsize=7, color="#8C8C8C")
            if all(v is None for v in values):
                ax.set_ylim(0, 1)
            ax.set_title(title, fontsize=9)
            ax.set_xticks(range(len(values)))
            ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
        fig.tight_layout()
        return fig

    def show(self):
        """The panel in a notebook with a widget frontend; otherwise (or as well) every run so far as text, each as
        what changed since the run before (:meth:`changes_text`)."""
        print(f"switchboard on {type(self.model).__name__} ({self.device}, autocast {self.autocast}); setting: "
              f"{self.setting.label()}")
        print(self.changes_text() if self.records else "(no runs yet: press 'run' or call sb.run(n))")
        try:
            import ipywidgets as W
            from IPython.display import display
        except ImportError:
            return None
        self._widgets = self._build(W)
        display(self._widgets["panel"])
        return self._widgets["panel"]

    # -- widgets
    def _build(self, W):
        s = self.setting
        c = {
            "backend": W.Dropdown(options=self.backends, value=s.backend, description="attention"),
            "cache": W.Checkbox(value=s.cache, description="metadata cache"),
            "buffers": W.Dropdown(options=[0, 1, 2], value=s.buffers, description="offload buffers"),
            "prefetch": W.Checkbox(value=s.prefetch, description="prefetch"),
            "moe": W.Dropdown(options=["off", "naive", "grouped", "sync_free"], value=s.moe, description="MoE routing",
                              disabled=not self.is_moe),
            "fused_loss": W.Checkbox(value=s.fused_loss, description="fused loss"),
        }
        steps = W.BoundedIntText(value=3, min=1, max=1000, description="steps")
        button = W.Button(description="run N steps", button_style="primary")
        out = W.Output()
        for name, widget in c.items():
            widget.observe(lambda change, n=name: self._on_change(n, change), names="value")
        button.on_click(lambda _: self.run(steps.value))
        panel = W.VBox([W.HBox([c["backend"], c["cache"]]), W.HBox([c["buffers"], c["prefetch"]]),
                        W.HBox([c["moe"], c["fused_loss"]]), W.HBox([steps, button]), out])
        return {"controls": c, "steps": steps, "button": button, "out": out, "panel": panel}

    def _on_change(self, name: str, change) -> None:
        try:
            self.set(**{name: change["new"]})
        except ValueError as e:
            self._print(f"not applied: {e}")
            self._sync_widgets()

    def _sync_widgets(self) -> None:
        if not self._widgets:
            return
        for name, widget in self._widgets["controls"].items():
            value = getattr(self.setting, name)
            if widget.value != value:
                widget.value = value
        self._widgets["controls"]["prefetch"].disabled = self.setting.buffers != 2
        self._widgets["controls"]["cache"].disabled = self.setting.backend == "off"

    def _print(self, text: str) -> None:
        if self._widgets:
            with self._widgets["out"]:
                print(text)
        else:
            print(text)

    def _redraw(self) -> None:
        if not self._widgets:
            return
        import matplotlib.pyplot as plt
        from IPython.display import display

        out = self._widgets["out"]
        out.clear_output(wait=True)
        with out:
            print(self.changes_text())
            fig = self.figure()
            display(fig)
            plt.close(fig)


def _word(value) -> str:
    """A switch position in words: on/off for a flag, the value otherwise."""
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


__all__ = ["Switchboard", "Setting"]
