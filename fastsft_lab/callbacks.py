"""A ``transformers.TrainerCallback`` that logs what the optimizations change, step by step, in a real training run.

``StepStatsCallback`` adds to the trainer's logs, every ``logging_steps``: the step time (wall clock between step
ends, so it includes data loading and the optimizer), tokens per second, host syncs per step (counted on the first
step after each log, by :class:`fastsft_lab.profiling.SyncCounter`, which costs some Python overhead on that one
step) and, on a GPU, the peak memory since the last log. Works with TRL's ``SFTTrainer`` as with ``Trainer``::

    trainer = SFTTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tokenizer,
                         data_collator=PackedCollator(max_tokens=8192), callbacks=[StepStatsCallback()])
"""

from __future__ import annotations

import time

import torch

from .profiling import SyncCounter


def _trainer_callback_base():
    from transformers import TrainerCallback

    return TrainerCallback


class StepStatsCallback(_trainer_callback_base()):  # type: ignore[misc]  # transformers' class, on use
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

    # the trainer calls these
    def on_train_begin(self, args, state, control, **kwargs):
        self._t = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

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
        if torch.cuda.is_available():
            stats["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            torch.cuda.reset_peak_memory_stats()
        logs.update(stats)
        self.history.append({"step": state.global_step, **stats})
        self._times, self._syncs = [], None


__all__ = ["StepStatsCallback"]
