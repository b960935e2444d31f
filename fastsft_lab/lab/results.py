"""Committed benchmark results, read back: the one loader behind every notebook figure and README table.

Results are the JSON files ``python -m fastsft_lab bench`` writes, committed under ``benchmarks/results/<run>/``.
In a clone they are read from there (recursively). An installed package (``pip install``, Colab) has no
``benchmarks/`` folder, so a compact copy of them ships as package data, ``fastsft_lab/lab/data/results.json``,
written by :func:`write_index` (``python -m fastsft_lab results --index``) and checked against the folder by a test.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
from typing import Any, Iterable, Sequence

INDEX = pathlib.Path(__file__).resolve().parent / "data" / "results.json"
_SKIP = {"summary.json"}


def repo_results_dir() -> pathlib.Path | None:
    """``benchmarks/results`` of the clone this package runs from, or None (an installed package)."""
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    return path if path.is_dir() else None


def _read_folder(root: pathlib.Path) -> list[dict]:
    docs = []
    for path in sorted(glob.glob(os.path.join(root, "**", "*.json"), recursive=True)):
        if os.path.basename(path) in _SKIP:
            continue
        try:
            with open(path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and "scenario" in doc and "env" in doc:
            doc["_path"] = os.path.relpath(path, root).replace(os.sep, "/")
            docs.append(doc)
    return docs


def all_results(root: str | os.PathLike | None = None) -> list[dict]:
    """Every result document: from ``root``, else the clone's ``benchmarks/results``, else the packaged index.

    Each carries ``_path``, its path relative to the results folder (``<run>/<sub>/<file>.json``).
    """
    if root is not None:
        return _read_folder(pathlib.Path(root))
    repo = repo_results_dir()
    if repo is not None:
        return _read_folder(repo)
    if INDEX.exists():
        return json.loads(INDEX.read_text())["results"]
    return []


def _scenario_matches(doc: dict, scenario: str | Sequence[str] | None) -> bool:
    if scenario is None:
        return True
    names = (scenario,) if isinstance(scenario, str) else tuple(scenario)
    return doc.get("scenario") in names


def load_results(scenario: str | Sequence[str] | None = None, *, root=None, device_type: str | None = "cuda",
                 newest_run: bool = False) -> list[dict]:
    """Committed results of ``scenario`` (a name or several), for ``device_type`` (None: any), newest first.

    ``newest_run=True`` keeps only the documents of the newest run folder (the first part of ``_path``) that has
    any: figures from different sessions are never mixed in one chart.
    """
    docs = [d for d in all_results(root) if _scenario_matches(d, scenario)
            and (device_type is None or d.get("env", {}).get("device") == device_type)]
    docs.sort(key=lambda d: (d["env"].get("date", ""), d["_path"]), reverse=True)
    if newest_run and docs:
        run = run_of(docs[0])
        docs = [d for d in docs if run_of(d) == run]
    return docs


def run_of(doc: dict) -> str:
    """The run folder a document was committed in (e.g. ``h200-2026-12-02b``)."""
    return doc["_path"].split("/", 1)[0]


def newest_per_config(docs: Iterable[dict], key) -> list[dict]:
    """One document per ``key(doc)`` (the newest), in the order of first appearance of each key."""
    out: dict[Any, dict] = {}
    for d in sorted(docs, key=lambda d: (d["env"].get("date", ""), d["_path"]), reverse=True):
        out.setdefault(key(d), d)
    return list(out.values())


def weights_text(c: dict) -> str:
    """A result config's base weights in words: ``NF4`` (every ``nn.Linear`` quantised; an MoE's experts are fused
    parameters, not linears, so they stay in the compute dtype and the words say so) or the dtype."""
    if c.get("quant") != "nf4":
        return c.get("dtype", "bf16")
    from ..models import PRESETS  # here, not at the top: the results loader itself needs no torch

    preset = PRESETS.get(c.get("model", ""))
    return f"NF4 (experts {c.get('dtype', 'bf16')})" if preset is not None and preset.is_moe else "NF4"


def describe_run(doc: dict) -> str:
    """``GPU, torch, transformers, date`` of a result, for a caption."""
    env = doc.get("env", {})
    return (f"{env.get('gpu_name') or 'CPU'}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
            f"{env.get('date', '')[:10]} ({run_of(doc)})")


def _compact(doc: dict) -> dict:
    """A result as the index keeps it: everything but the per-variant notes (the committed JSON has those)."""
    out = {k: v for k, v in doc.items() if k != "variants"}
    if "variants" in doc:
        out["variants"] = [{k: v for k, v in r.items() if k != "note"} for r in doc["variants"]]
    return out


def build_index(root: str | os.PathLike | None = None) -> dict:
    """The package-data index of every committed result (see the module docstring)."""
    root = pathlib.Path(root) if root is not None else repo_results_dir()
    if root is None:
        raise FileNotFoundError("no benchmarks/results folder here: build the index from a clone")
    return {"about": "compact copy of benchmarks/results/**/*.json for installed packages; "
                     "regenerate with `python -m fastsft_lab results --index`",
            "results": [_compact(d) for d in _read_folder(root)]}


def write_index(root: str | os.PathLike | None = None, path: str | os.PathLike = INDEX) -> str:
    index = build_index(root)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(index, separators=(",", ":"), sort_keys=True, default=str) + "\n")
    return str(path)


# --- per-scenario views the notebooks use ---------------------------------------------------------------------------
def offload_results(root=None, device_type: str = "cuda") -> dict:
    """Offload results of the newest run of each kind: ``{"offload": [...one per token count], "timeline": [...],
    "sweep": [...], "vram": [...]}`` (lists empty when nothing was committed). Where the run holds two documents
    for one token count (a later call re-measured it), the one with more variants is kept."""
    kinds = {"offload": "offload", "offload_timeline": "timeline", "offload_sweep": "sweep", "offload_vram": "vram"}
    out: dict[str, list] = {}
    for scenario, name in kinds.items():
        out[name] = load_results(scenario, root=root, device_type=device_type, newest_run=True)
    for k in ("offload", "timeline"):
        best: dict[int, dict] = {}
        for d in out[k]:
            t = d["config"].get("tokens_per_step", 0)
            if t not in best or len(d.get("variants", d.get("timelines", []))) > \
                    len(best[t].get("variants", best[t].get("timelines", []))):
                best[t] = d
        out[k] = [best[t] for t in sorted(best)]
    return out


UNSETTLED_SPREAD = 1.5    # p80 / p20 of a variant's step times above which its median settles no comparison


def step_spread(variant: dict) -> float | None:
    """p80 / p20 of ``variant``'s step times (None when it has no percentiles)."""
    st = variant.get("step_ms") or {}
    return st["p80"] / st["p20"] if st.get("p20") else None


def unsettled(variant: dict) -> bool:
    """Whether ``variant``'s steps spread too widely (still compiling, say) for its median to rank it."""
    spread = step_spread(variant)
    return spread is not None and spread > UNSETTLED_SPREAD


def packed_regime(root=None, device_type: str = "cuda") -> list[dict]:
    """The regime-map points of every committed packed run, one per (model, depth, backend, mix, tokens): the newest
    measurement of each point. A run measures a point when it ran the naive path there: where that path (or the
    cached one) failed, the point has no ratio, and an older run's ratio never stands in for it. A run that did not
    run the naive path (the collated-metadata runs compare cached with the oracle) does not measure the point. Points
    come from the regime summaries and from each configuration's own ``speedups``."""
    def key(p):
        return p["model"], p.get("num_layers"), p["backend"], p["mix"], p["tokens_per_step"]

    points, ran_naive = [], set()
    for doc in load_results("packed_metadata", root=root, device_type=device_type):
        c = doc["config"]
        p = {"model": c["model"], "backend": c["backend"], "mix": c["mix"], "tokens_per_step": c["tokens_per_step"],
             "num_layers": c.get("num_layers"), **doc.get("speedups", {}), "_run": run_of(doc),
             "_date": doc["env"].get("date", "")}
        if any(v["name"].endswith(" naive") for v in doc["variants"]):
            ran_naive.add((p["_run"], key(p)))
            points.append(p)
    for doc in load_results("packed_metadata_regime", root=root, device_type=device_type):
        for p in doc["summary"]:
            p = dict(p, _run=run_of(doc), _date=doc["env"].get("date", ""))
            if p.get("cached_step_speedup") or (p["_run"], key(p)) in ran_naive:
                points.append(p)
    seen, out = set(), []
    for p in sorted(points, key=lambda p: p["_date"], reverse=True):
        if key(p) not in seen:
            seen.add(key(p))
            out.append(p)
    return out


def packed_key(d: dict) -> tuple:
    """What tells two packed results apart: model, depth, length mix, backend, tokens per step."""
    c = d["config"]
    return c["model"], c.get("num_layers"), c["mix"], c["backend"], c["tokens_per_step"]


def _ran(d: dict, suffix: str) -> bool:
    return any(v["name"].endswith(suffix) and (suffix == " naive" or "step_ms" in v) for v in d["variants"])


def packed_configs(root=None, device_type: str = "cuda", collated: bool = False) -> list[dict]:
    """The newest committed packed result of each configuration (:func:`packed_key`), sorted by it: of the runs that
    ran the naive path (failed or not: a failure is the newest word on that point), or with ``collated=True`` of the
    runs that timed the collated path (``<backend> cached (collated)``)."""
    docs = [d for d in load_results("packed_metadata", root=root, device_type=device_type)
            if _ran(d, " (collated)" if collated else " naive")]
    return sorted(newest_per_config(docs, packed_key), key=packed_key)


def packed_headline(model: str = "qwen3-14b", tokens: int = 8192, mix: str = "realistic",
                    backends: Sequence[str] = ("sdpa", "varlen", "flex"), root=None) -> list[dict]:
    """One document per backend at ``model`` width, ``tokens`` per step and ``mix``, all from the newest run that
    ran the naive path on every one of ``backends`` there (else from the newest run that ran any): one session, so
    its rows compare. ``[]`` when none was committed."""
    by_run: dict[str, dict[str, dict]] = {}
    for d in load_results("packed_metadata", root=root):          # newest first: the newest per backend in each run
        c = d["config"]
        if c["model"] == model and c["tokens_per_step"] == tokens and c["mix"] == mix and _ran(d, " naive"):
            by_run.setdefault(run_of(d), {}).setdefault(c["backend"], d)
    if not by_run:
        return []
    run = next((r for r, docs in by_run.items() if set(backends) <= set(docs)), next(iter(by_run)))
    return [by_run[run][b] for b in backends if b in by_run[run]]


def _floor_config(d: dict) -> tuple:
    """What tells two combined or breakdown results apart: model, depth, tokens per step, kernels, autocast."""
    c = d["config"]
    return c["model"], c.get("num_layers"), c.get("tokens_per_step"), c.get("kernels"), c.get("autocast", "none")


def combined_results(root=None, device_type: str = "cuda") -> list[dict]:
    """The newest committed result of each combined configuration (model, depth, tokens, kernels, autocast), across
    runs: a later run at another depth or under autocast does not hide the full-depth headline or the ablation run
    without it. Each names its run (``run_of``)."""
    return newest_per_config(load_results("combined", root=root, device_type=device_type), _floor_config)


PEER_OUR_VARIANTS = ("transformers default", "all naive", "all fast")   # our rows shown beside a peer's


def newest_peak_gib(scenario: str, root=None, variant: str | None = None, **config) -> tuple[float | None, dict | None]:
    """The largest ``peak_mem_bytes`` (GiB) of the newest committed GPU result of ``scenario`` whose config has
    every ``config`` value (with ``variant``: of that variant only, in the newest such result that ran it), with that
    document; ``(None, None)`` when none matches, ``(None, doc)`` when the document has no peak for it."""
    docs = [d for d in load_results(scenario, root=root) if all(d["config"].get(k) == v for k, v in config.items())]
    if variant is not None:         # the newest document that ran that variant (a later run may have left it out)
        docs = [d for d in docs if any(v["name"] == variant for v in d["variants"])] or docs
    if not docs:
        return None, None
    peaks = [v["peak_mem_bytes"] for v in docs[0]["variants"] if variant in (None, v["name"]) and v.get("peak_mem_bytes")]
    return (max(peaks) / 2**30 if peaks else None), docs[0]


def peer_results(root=None, device_type: str = "cuda") -> list[tuple[list[dict], list[dict]]]:
    """Unsloth against us, one comparison per shape (model, depth, tokens per step) a peer run measured:
    ``(peer, ours)``. Both sides come from one session: per shape, the newest run folder that holds the peer's
    ``peer-unsloth`` documents *and* our combined results at that shape (``ours``: the newest per kernel floor and
    autocast), so that they ran on the same host and batches. A shape whose newest peer run has no such partner in any
    folder gives that run's peer documents with ``ours == []``. Shapes are ordered by their newest peer run.
    ``[]`` when no peer run was committed."""
    docs = load_results("peer-unsloth", root=root, device_type=device_type)      # newest first
    if not docs:
        return []
    shape = lambda c: (c.get("model"), c.get("num_layers"), c.get("tokens_per_step"))   # noqa: E731
    combined = load_results("combined", root=root, device_type=device_type)
    out = []
    for key in dict.fromkeys(shape(d["config"]) for d in docs):
        peers = [d for d in docs if shape(d["config"]) == key]
        runs = list(dict.fromkeys(run_of(d) for d in peers))                       # newest first
        pick, ours = runs[0], []
        for run in runs:
            same = [d for d in combined if run_of(d) == run and shape(d["config"]) == key]
            if same:
                pick, ours = run, newest_per_config(
                    same, key=lambda d: (d["config"].get("kernels"), d["config"].get("autocast")))
                break
        out.append(([d for d in peers if run_of(d) == pick], ours))
    return out


def experts_profile(root=None, device_type: str = "cuda") -> dict | None:
    """The newest committed experts profile (``benchmarks/experts_profile.py``): one MoE layer's experts against the
    grouped matmuls alone, per preset and token count; None if there is none."""
    docs = load_results("moe-experts-profile", root=root, device_type=device_type)
    return docs[0] if docs else None


def experts_profile_rows(doc: dict) -> list[dict]:
    """Per case of an experts profile: the limit, each implementation's step and its ratio to the limit, the GPU
    time of the grouped matmul kernels inside each profiled step and the rest (``glue_ms``), and the glue's floor:
    the fewest bytes it moves (:func:`.flops.moe_glue_bytes`) at the GPU's HBM data-sheet bandwidth
    (``glue_floor_ms``), with the ratio an unfused glue at that floor would give over the grouped-matmul kernels
    (``best_unfused_vs_grouped_mm``)."""
    from ..models import PRESETS  # here, not at the top: the results loader itself needs no torch
    from .flops import moe_glue_bytes, peak_bandwidth

    bandwidth = peak_bandwidth(doc.get("env", {}).get("gpu_name"))
    rows = []
    for case in doc["cases"]:
        by = {r["name"]: r for r in case["rows"]}
        limit = (by.get("expert matmuls alone", {}).get("step_ms") or {}).get("median")
        row = {"preset": case["preset"], "tokens": case["tokens"], "limit_ms": limit}
        cfg = PRESETS[case["preset"]].config if case["preset"] in PRESETS else {}
        inter = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
        if bandwidth and inter and case.get("top_k") and case.get("hidden_size"):
            glue_bytes = moe_glue_bytes(case["tokens"], case["top_k"], case["hidden_size"], inter)
            row.update(glue_bytes=glue_bytes, glue_floor_ms=glue_bytes / bandwidth * 1e3)
        for name, r in by.items():
            if name == "expert matmuls alone" or not r.get("step_ms"):
                continue
            ms = r["step_ms"]["median"]
            row[name] = {"step_ms": ms, "vs_limit": ms / limit if limit else None}
            prof = r.get("profile_step") or {}
            gmm = sum(o["ms"] for o in prof.get("ops", []) if o["name"] == "aten::_grouped_mm")
            if gmm and prof.get("gpu_busy_ms"):
                row[name].update(gpu_busy_ms=prof["gpu_busy_ms"], grouped_mm_ms=gmm, glue_ms=prof["gpu_busy_ms"] - gmm)
                if "glue_floor_ms" in row:
                    # the best an unfused glue could do: its bytes at the HBM data-sheet rate, beside the same kernels
                    row[name]["best_unfused_vs_grouped_mm"] = (gmm + row["glue_floor_ms"]) / gmm
        rows.append(row)
    return rows


def breakdown_results(root=None, device_type: str | None = "cuda") -> list[dict]:
    """The newest committed breakdown (``bench --only breakdown``) of each (model, depth, tokens, kernels, autocast),
    across runs (a later run of one configuration does not hide the others; each names its run), in the order model,
    depth, kernels ``none`` before ``liger``, autocast ``none`` first."""
    docs = newest_per_config(load_results("breakdown", root=root, device_type=device_type), _floor_config)
    return sorted(docs, key=lambda d: (d["config"]["model"], d["config"].get("num_layers") or 0,
                                       d["config"].get("kernels") != "none", d["config"].get("autocast", "none") != "none"))


def attribution_results(root=None, device_type: str | None = "cuda") -> list[dict]:
    """The newest committed attribution chain (``bench --only attribution``) of each (model, depth, tokens, kernel
    floor), across runs: dense before MoE, the stock floor before Liger's."""
    def key(d: dict) -> tuple:
        c = d["config"]
        return c["model"], c.get("num_layers"), c.get("tokens_per_step"), c.get("kernels", "none")
    docs = newest_per_config(load_results("attribution", root=root, device_type=device_type), key)
    return sorted(docs, key=lambda d: ("gpt-oss" in d["config"]["model"], d["config"]["model"],
                                       d["config"].get("kernels", "none") != "none"))


# Steps older attribution runs measured that are no step of the chain any more (each names where it is shown)
NOT_IN_CHAIN = {"+ experts grouped once": "one host sync per MoE layer and a loop of launches per expert: slower than "
                                          "transformers' default experts (notebook 03 counts why)"}


def chain_steps(doc: dict) -> list[str]:
    """The steps of an attribution result's chain, in order, without the steps older runs measured that the chain
    no longer takes (:data:`NOT_IN_CHAIN`): each step is compared with the one before it in this list, both measured
    in the same interleaved run."""
    return [n for n in doc["config"]["chain"] if n not in NOT_IN_CHAIN]


def attribution_for(model: str, kernels: str = "none", root=None, device_type: str | None = "cuda") -> dict | None:
    """The committed attribution chain of ``model`` on the kernel floor ``kernels`` at its deepest committed depth
    (:func:`attribution_results`: the newest of each configuration), or None: the one chain every view of that model
    reads (README, notebooks 00, 03, 04)."""
    docs = [d for d in attribution_results(root=root, device_type=device_type) if d["config"]["model"] == model
            and d["config"].get("kernels", "none") == kernels]
    return max(docs, key=lambda d: d["config"].get("num_layers") or 0) if docs else None


def plans_in(doc: dict) -> int:
    """How many solved plans a memory-plan result times: two or more make a frontier; one is a run at a budget asked
    for (``--set budget.budgets=80``)."""
    return sum(1 for v in doc["variants"] if "memory_budget_bytes" in v.get("toggles", {}))


def budget_results(root=None, device_type: str | None = "cuda") -> list[dict]:
    """The newest committed memory-plan frontier (``bench --only budget``) of each (model, depth, tokens per step,
    quantisation, autocast), and the newest run at budgets asked for of each where there is one (a run of one point
    does not hide the frontier), across runs; dense models first, then by tokens, the frontier before the point."""
    def key(d: dict) -> tuple:
        c = d["config"]
        return (c["model"], c.get("num_layers"), c.get("tokens_per_step"), c.get("quant"), c.get("autocast", "none"),
                c.get("kernels", "none"), plans_in(d) > 1)
    docs = newest_per_config(load_results("budget", root=root, device_type=device_type), key)
    return sorted(docs, key=lambda d: ("gpt-oss" in d["config"]["model"], d["config"]["model"],
                                       d["config"].get("tokens_per_step") or 0, plans_in(d) <= 1))


def frontier_peers(doc: dict, root=None) -> list[dict]:
    """The Unsloth peer's documents (``peer-unsloth``) at a frontier's shape (model, depth, tokens per step) from the
    frontier's own run folder (same host and batches); ``[]`` when that session ran none."""
    shape = lambda c: (c.get("model"), c.get("num_layers"), c.get("tokens_per_step"))   # noqa: E731
    return [d for d in load_results("peer-unsloth", root=root, device_type=None)
            if run_of(d) == run_of(doc) and shape(d["config"]) == shape(doc["config"])]


def frontier_flops(doc: dict) -> float | None:
    """Model FLOPs of one step of a memory-plan frontier (:func:`.flops.step_flops` with the base frozen where LoRA
    trains: forward and input gradients, the adapters' weight gradients, attention over the real segments, the LM
    head), the same for every row and for the peer on the same batches. Recorded by the budget scenario
    (``config.model_flops_per_step``); for a run before it recorded them, worked out from what its rows recorded: the
    PaLM-convention ``flops_per_step``, the tokens (``tokens_per_s`` x the median step) and the preset's sizes and
    LoRA rank (:func:`.flops.model_flops_from_palm`). None where neither is there."""
    from types import SimpleNamespace

    from ..models import PRESETS
    from .flops import lora_params, model_flops_from_palm

    c = doc["config"]
    if c.get("model_flops_per_step"):
        return float(c["model_flops_per_step"])
    v = next((v for v in doc["variants"] if v.get("flops_per_step") and v.get("tokens_per_s") and "step_ms" in v),
             None)
    preset = PRESETS.get(c.get("model"))
    if v is None or preset is None:
        return None
    config = SimpleNamespace(**{**preset.config, "num_hidden_layers": c.get("num_layers")
                                or preset.config["num_hidden_layers"]})
    rank = c.get("lora_rank") or 0
    adapters = lora_params(config, rank, preset.lora_targets) if rank else 0
    if adapters is None:
        return None
    tokens = v["tokens_per_s"] * v["step_ms"]["median"] / 1e3
    return model_flops_from_palm(v["flops_per_step"], config, tokens, frozen_base=bool(rank), adapter_params=adapters)


def frontier_rows(doc: dict, peers: Sequence[dict] = ()) -> list[dict]:
    """One memory-plan frontier (``bench --only budget``) as rows: each budget's plan, the exhaustive search's plans
    (``searched``: the budget they were ranked for), the README recipe and no checkpointing, then each variant of
    ``peers`` (:func:`frontier_peers`; ``peer``: True), with step ms, predicted and measured peak (bytes; None where
    not recorded), speed against the recipe ("x": higher is faster), MFU (:func:`frontier_flops` over the step and
    the card's dense bf16 peak; None where either is unknown) and the error of a variant that did not run (e.g. out
    of memory)."""
    from .flops import peak_flops

    recipe = next((v for v in doc["variants"] if v["name"].startswith("offload x2") and "step_ms" in v), None)
    flops, peak = frontier_flops(doc), peak_flops(doc.get("env", {}).get("gpu_name"))
    rows = []
    variants = [(v, False) for v in doc["variants"]] + [(v, True) for p in peers for v in p["variants"]]
    for v, peer in variants:
        t = v.get("toggles", {})
        row = {"name": f"Unsloth {v['name'].removeprefix('unsloth ')}" if peer else v["name"],
               "budget": None if peer else t.get("memory_budget_bytes"),
               "searched": None if peer else t.get("search_budget_bytes"),
               "predicted": None if peer else t.get("predicted_peak_bytes"), "peer": peer,
               "peak": v.get("peak_mem_bytes"), "ms": v["step_ms"]["median"] if "step_ms" in v else None,
               "error": v.get("error"), "syncs": v.get("host_syncs_per_step")}
        row["speed"] = recipe["step_ms"]["median"] / row["ms"] if recipe and row["ms"] else None
        row["mfu"] = flops / (row["ms"] / 1e3) / peak if flops and peak and row["ms"] else None
        rows.append(row)
    return rows


PEER_MEMORY_MULTIPLES = (1.0, 2.5)
"""The memory a frontier is compared with a peer at: the peer's own peak, and 2.5 times it."""


def frontier_vs_peers(rows: Sequence[dict]) -> list[dict]:
    """Per peer row of :func:`frontier_rows` and per multiple of :data:`PEER_MEMORY_MULTIPLES` of its measured
    peak: the fastest of the solver's plans (what ``apply(memory_budget=...)`` picks; not the search's) whose
    measured peak is within that memory (``plan``: its row, None when none is) and its speed over the peer's step
    (``speed``, higher is ours faster)."""
    plans = [r for r in rows if r["budget"] is not None and r["ms"] and r["peak"]]
    out = []
    for peer in (r for r in rows if r["peer"] and r["ms"] and r["peak"]):
        for m in PEER_MEMORY_MULTIPLES:
            fits = [r for r in plans if r["peak"] <= m * peer["peak"]]
            best = min(fits, key=lambda r: r["ms"]) if fits else None
            out.append({"peer": peer, "multiple": m, "memory": m * peer["peak"], "plan": best,
                        "speed": peer["ms"] / best["ms"] if best else None})
    return out


__all__ = ["weights_text", "attribution_results", "attribution_for", "chain_steps", "NOT_IN_CHAIN", "budget_results", "plans_in", "frontier_flops", "frontier_rows", "frontier_peers", "frontier_vs_peers",
           "PEER_MEMORY_MULTIPLES", "all_results", "load_results", "run_of", "newest_per_config", "describe_run", "build_index", "write_index",
           "repo_results_dir", "INDEX", "step_spread", "unsettled", "UNSETTLED_SPREAD", "offload_results",
           "packed_regime", "packed_key", "packed_configs", "packed_headline", "combined_results", "newest_peak_gib", "peer_results", "PEER_OUR_VARIANTS", "experts_profile",
           "experts_profile_rows", "breakdown_results"]
