"""``transformers.TrainerCallback``s: what the optimizations change, step by step, in a real training run, and a
diagnosis of the Trainer's own step (:class:`DiagnoseCallback`).

``StepStatsCallback`` adds to the trainer's logs, every ``logging_steps``: the step time (wall clock between step
ends, so it includes data loading and the optimizer), the real tokens per second (:func:`real_tokens`: a collator's
padding tail left out, where ``include_num_input_tokens_seen`` counts it), host syncs per step (counted on the first
step after each log, by :class:`fastsft_lab.profiling.SyncCounter`, which costs some Python overhead on that one
step), on a GPU the peak memory since the last log, and the model's memory plan whenever it is (re)solved. Works
with TRL's ``SFTTrainer`` as with ``Trainer``::

    trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tokenizer,
                         data_collator=PackedCollator(max_tokens=8192), callbacks=[StepStatsCallback()])
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
from transformers import TrainerCallback

from .profiling import SyncCounter


def real_tokens(inputs: dict) -> int | torch.Tensor:
    """The tokens of a batch that are not padding: a packed batch's rows less their padding tails (its
    ``packed_metadata``, host ints), a padded batch's ``attention_mask`` sum (a device tensor: no sync until it is
    read), else every token (a padding-free batch: TRL's ``padding_free=True``, ``DataCollatorWithFlattening``)."""
    meta = inputs.get("packed_metadata")
    if meta is not None and getattr(meta, "cu_seqlens", None):
        return int(meta.cu_seqlens[-1]) - sum(meta.pad_lengths or ())
    mask = inputs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        return mask.sum()
    ids = inputs.get("input_ids")
    if ids is None:
        ids = inputs.get("inputs_embeds")
        return 0 if ids is None else int(ids.shape[:-1].numel())
    return int(ids.numel())


class StepStatsCallback(TrainerCallback):
    """Step time, tokens/s, host syncs per step and peak memory in the trainer's logs (see the module docstring).

    Args:
        count_syncs: count host syncs on one step per logging interval (False: never; the counter's dispatch
            mode slows that step down).
    """

    def __init__(self, count_syncs: bool = True):
        self.count_syncs = count_syncs
        self.history: list[dict] = []
        self._t = None
        self._times: list[float] = []
        self._seen = 0
        self._counter: SyncCounter | None = None
        self._syncs: int | None = None
        self._real: list[Any] = []           # real tokens of the training forwards since the last log
        self._hook: Any = None
        self._model: Any = None
        self._plan: str | None = None

    # the trainer calls these
    def on_train_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        model = kwargs.get("model")
        if model is not None and self._hook is None:
            # the model the Trainer calls (its wrappers call it in turn): every training forward's real tokens
            self._model = model
            self._hook = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _count(self, module, args, kwargs) -> None:
        if module.training and torch.is_grad_enabled():
            self._real.append(real_tokens({"input_ids": args[0], **kwargs} if args else kwargs))

    def on_step_begin(self, args, state, control, **kwargs):
        if self.count_syncs and self._counter is None and self._syncs is None:
            self._counter = SyncCounter()
            self._counter.__enter__()

    def on_step_end(self, args, state, control, **kwargs):
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._syncs = self._counter.total
            self._counter = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        self._times.append(now - self._t)
        self._t = now

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or not self._times:
            return
        step_s = sorted(self._times)[len(self._times) // 2]
        stats = {"step_time_ms": round(step_s * 1e3, 2), "host_syncs_per_step": self._syncs}
        seen = getattr(state, "num_input_tokens_seen", 0) or 0
        if seen > self._seen:
            stats["tokens_per_s"] = round((seen - self._seen) / sum(self._times), 1)
        self._seen = seen
        if self._real:
            stats["real_tokens_per_s"] = round(_all_ranks(self._real) / sum(self._times), 1)
            self._real = []
        plan = _plan_of(self._model)
        if plan is not None and plan != self._plan:       # when (re)solved: once, not every log
            stats["memory_plan"] = self._plan = plan
        if torch.cuda.is_available():
            stats["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            torch.cuda.reset_peak_memory_stats()
        logs.update(stats)
        # the Trainer keeps its own copy of the logs, made before the callbacks run: the stats go there too
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(stats)
        self.history.append({"step": state.global_step, **stats})
        self._times, self._syncs = [], None


def _all_ranks(counts: list) -> int:
    """The sum of ``counts`` (ints and device tensors) over this process and, in a process group, every rank (the
    Trainer logs on every rank at the same steps)."""
    total = sum(int(c.sum().item()) if isinstance(c, torch.Tensor) else c for c in counts)
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        on = torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend()) else "cpu"
        t = torch.tensor([total], dtype=torch.int64, device=on)
        dist.all_reduce(t)
        total = int(t.item())
    return total


def _plan_of(model) -> str | None:
    """The model's solved memory plan, in a line (None without one, or while step 1 measures)."""
    if model is None:
        return None
    from .offload.plan import memory_planner

    planner = memory_planner(model)
    return None if planner is None or planner.plan is None else planner.plan.describe()



class DiagnoseCallback(TrainerCallback):
    """:func:`fastsft_lab.diagnose` on the Trainer's own loop: its batches, its autocast and accelerate wrapping, its
    optimizer step, what its loop does between forward and backward. Warm steps first (the last keeps the step's
    inputs and autocast), then ``repeats`` timed (the step time, the peak memory), one with its host syncs counted and
    one profiled (the kernels), in the order :func:`fastsft_lab.diagnose` runs them: no timed step follows the
    profiler, whose teardown can slow the step after it. The report is printed (main process), kept in
    :attr:`diagnosis`, and the step's inputs in :attr:`batch` --
    ``callback.diagnosis.apply_and_measure(model, callback.batch)`` measures the suggestions on it::

        diag = DiagnoseCallback(step=3)
        trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, callbacks=[diag])
        trainer.train()                          # prints the report after step 3 + repeats + 1
        fastsft_lab.apply(model, **diag.diagnosis.suggested())

    Args:
        step: the first measured (timed) step (the steps before it warm up: 2+ for a memory plan, which measures
            at step 1).
        repeats: timed steps (their median is the step time).
        print_report: print the report when it is ready.
    """

    def __init__(self, step: int = 3, repeats: int = 3, print_report: bool = True):
        if step < 1 or repeats < 1:
            raise ValueError(f"DiagnoseCallback needs step >= 1 and repeats >= 1, got step={step}, repeats={repeats}")
        self.step, self.repeats, self.print_report = step, repeats, print_report
        self.diagnosis: Any = None      # the Diagnosis, once measured
        self.batch: dict | None = None  # the profiled step's inputs, as the Trainer passed them to the model
        self._session: Any = None
        self._recorder: Any = None
        self._capture: Any = None
        self._t = 0.0

    @property
    def last_step(self) -> int:
        """The last step measured: the profiled one."""
        return self.step + self.repeats + 1

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from .diagnosis import Session

        if state.max_steps and 0 < state.max_steps <= self.last_step:
            raise ValueError(f"DiagnoseCallback(step={self.step}, repeats={self.repeats}) measures steps {self.step}-"
                             f"{self.last_step}: train at least {self.last_step + 1} steps (max_steps is "
                             f"{state.max_steps})")
        self._session = Session(model)
        self.diagnosis = None

    def _sync(self) -> None:
        if self._session.device.type == "cuda":
            torch.cuda.synchronize(self._session.device)

    def on_step_begin(self, args, state, control, **kwargs):
        from .step_profile import StepRecorder

        s, g = self._session, state.global_step
        if s is None or self.diagnosis is not None:
            return
        if g == self.step - 1:                               # the inputs and autocast kept (a warm-up step)
            self._capture = s.capture()
            self._capture.__enter__()
        elif self.step <= g < self.step + self.repeats:      # timed
            if g == self.step:
                s.read_memory()
                if s.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(s.device)
            self._sync()
            self._t = time.perf_counter()
        elif g == self.last_step - 1:                        # host syncs counted
            s.sync_counter().__enter__()
        elif g == self.last_step:                            # profiled
            self._recorder = StepRecorder(None if s.compiled else s.inner, s.device).start()
            self._recorder.begin_step()

    def on_step_end(self, args, state, control, **kwargs):
        s, g = self._session, state.global_step - 1          # the step that just ended
        if s is None or self.diagnosis is not None:
            return
        if g == self.step - 1 and self._capture is not None:
            self._capture.__exit__(None, None, None)
            self._capture = None
        elif self.step <= g < self.step + self.repeats:
            self._sync()
            s.times_ms.append((time.perf_counter() - self._t) * 1e3)
            if g == self.step + self.repeats - 1 and s.device.type == "cuda":
                s.peak = int(torch.cuda.max_memory_allocated(s.device))
        elif g == self.last_step - 1 and s.counter is not None:
            s.counter.__exit__(None, None, None)
        elif g == self.last_step and self._recorder is not None:
            self._recorder.end_step()
            s.profile = self._recorder.stop()
            self._recorder = None
            if s.profile.kernel_ms(lambda k: k.where.phase == "recompute") > 0:
                s.measure_layers()
            self.diagnosis = s.diagnosis()
            self.diagnosis._replay = {"autocast": s.autocast}
            self.diagnosis._batch = self.batch = s.inputs
            self._session = None
            if self.print_report and getattr(state, "is_world_process_zero", True):
                print(self.diagnosis)

    def on_train_end(self, args, state, control, **kwargs):
        # a run stopped inside the measured steps: leave no profiler, hook or counter behind
        if self._recorder is not None:
            self._recorder.close()
            self._recorder = None
        if self._capture is not None:
            self._capture.__exit__(None, None, None)
            self._capture = None
        s = self._session
        if s is not None and s.counter is not None and self.diagnosis is None:
            with contextlib.suppress(ValueError):
                s.counter.__exit__(None, None, None)


__all__ = ["StepStatsCallback", "DiagnoseCallback", "real_tokens"]
