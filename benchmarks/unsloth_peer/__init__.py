"""Unsloth as a peer: the combined benchmark's model, packed batches and LoRA settings, run through Unsloth.

Two commands, two processes, two site folders (Unsloth patches transformers when it is imported, so it never
shares a process with fastsft_lab's own environment), driven by ``benchmarks/unsloth_peer.sh``:

    python -m benchmarks.unsloth_peer export --out DIR ...            # our environment (export.py)
    python -m benchmarks.unsloth_peer run --dir DIR --out RESULT.json  # Unsloth's environment (run.py)

plus ``error-json`` and ``summary`` for the stage script (cli.py). Modules: ``export`` (the shared folder),
``layouts`` (packed and padded feeds), ``run`` (the measured run, stage by stage; its docstring says what Unsloth
runs), ``probes`` (what Unsloth actually did), ``result`` (the harness's result format), ``stats`` (the harness's
own percentiles). Importing this package imports the standard library and ``fastsft_lab._util`` only: never torch
or transformers before unsloth.
"""

from __future__ import annotations

from .cli import main
from .common import (CHECKPOINTING, FAMILIES, FLEX_PAD_MULTIPLE, GPT_OSS_LORA_TARGETS, LAYOUTS, LORA_TARGETS,
                     SCENARIO, write_json)
from .export import batches_to_json, check_free_space, export, family_defaults, read_export
from .layouts import (check_layout, default_layout, labelled_pairs_packed, labelled_pairs_padded, layout_stats,
                      padded_layout, real_segments, warmup_covering)
from .probes import PROBE_CHANGED, PROBE_SAME, check_lora_placement, isolation_probe, padded_probe
from .result import error_result, run_config, summary_line, variant_toggles
from .run import CheckFailed, Interrupted, run
from .stats import length_stats, percentiles

__all__ = ["main", "export", "read_export", "batches_to_json", "family_defaults", "check_free_space", "run",
           "run_config", "variant_toggles", "error_result", "summary_line", "write_json", "percentiles",
           "length_stats", "layout_stats", "default_layout", "check_layout", "real_segments", "padded_layout",
           "labelled_pairs_packed", "labelled_pairs_padded", "warmup_covering", "padded_probe", "isolation_probe",
           "check_lora_placement", "PROBE_SAME", "PROBE_CHANGED", "CheckFailed", "Interrupted", "SCENARIO",
           "FAMILIES", "LAYOUTS", "LORA_TARGETS", "GPT_OSS_LORA_TARGETS", "FLEX_PAD_MULTIPLE", "CHECKPOINTING"]
