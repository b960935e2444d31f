"""The results tables of the README (its headline) and of docs/results.md (every other table), generated from the
committed JSON (through :mod:`.results`), never typed in.

``python -m fastsft_lab results --readme`` rewrites every block of those files that sits between
``<!-- results:NAME -->`` and ``<!-- /results:NAME -->``, and draws the headline chart (docs/headline.png); a test
checks that the committed files equal what this module generates from the committed results.
"""

from __future__ import annotations

import pathlib
import re
from typing import Callable, Sequence

from ..models import PRESETS
from . import results as R

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _ms(v: dict | None, key: str = "step_ms") -> str:
    stat = (v or {}).get(key)
    return f"{stat['median']:.1f}" if stat else "–"


def _spread(v: dict | None, key: str = "step_ms") -> str:
    stat = (v or {}).get(key)
    return f"{stat['p20']:.1f}–{stat['p80']:.1f}" if stat and "p20" in stat else "–"


def _gib(v: dict | None) -> str:
    b = (v or {}).get("peak_mem_bytes")
    return f"{b / 2**30:.1f}" if b else "–"


def _source(docs: list[dict]) -> str:
    runs = sorted({R.run_of(d) for d in docs})
    env = docs[0]["env"]
    return (f"{env.get('gpu_name')}, torch {env.get('torch')}, transformers {env.get('transformers')}; run "
            f"{', '.join(f'`benchmarks/results/{r}`' for r in runs)} ({_dates(docs)})")


def _dates(docs: list[dict]) -> str:
    days = sorted({d["env"].get("date", "")[:10] for d in docs} - {""})
    return days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}" if days else "undated"


def _full_layers(model: str) -> int | None:
    preset = PRESETS.get(model)
    return preset.config.get("num_hidden_layers") if preset else None


def _is_full_depth(c: dict) -> bool:
    return _full_layers(c["model"]) is not None and c.get("num_layers") == _full_layers(c["model"])


def _depth(c: dict) -> str:
    """'all 40 layers' at the preset's full depth, else '8 of 40 layers'."""
    full = _full_layers(c["model"])
    if full is None or full == c["num_layers"]:
        return f"all {c['num_layers']} layers"
    return f"{c['num_layers']} of {full} layers"


def combined_table() -> str:
    docs = R.combined_results()
    if not docs:
        return "_No committed GPU run of the combined scenario yet (`python -m fastsft_lab bench --only combined`)._"
    out = []
    order = {"none": 0, "liger": 1}
    for d in sorted(docs, key=lambda d: (d["config"]["model"], -d["config"]["num_layers"], d["config"]["tokens_per_step"],
                                         d["config"].get("autocast", "none") == "none",
                                         order.get(d["config"]["kernels"], 2))):
        c = d["config"]
        rows = [v for v in d["variants"]]
        base = next((v for v in rows if v["name"] == "transformers default" and "step_ms" in v), None)
        quant = "bf16 weights" if c.get("quant") in (None, "none") else f"{c['quant'].upper()} weights"
        cast = c.get("autocast", "none")
        out.append(f"**{c['model']}, {_depth(c)}, {c['tokens_per_step']} tokens/step, kernels: "
                   f"{c['kernels']}, {'autocast ' + cast if cast != 'none' else 'no autocast'}** "
                   f"({c.get('kernels_detail', 'stock kernels')}; {quant}, LoRA r{c.get('lora_rank')}; {c.get('steps')} measured steps"
                   f"{_link(c)}, run `{R.run_of(d)}`)\n")
        out.append("| variant | step ms | vs default | tokens/s | MFU | host syncs/step | peak GiB |")
        out.append("|---|---|---|---|---|---|---|")
        for v in rows:
            if "step_ms" not in v:
                out.append(f"| {v['name']} | {v.get('error', '–')[:80]} | | | | | |")
                continue
            speed = f"{base['step_ms']['median'] / v['step_ms']['median']:.2f}x" if base else "–"
            mfu = f"{v['mfu']:.1%}" if v.get("mfu") is not None else "–"
            out.append(f"| {v['name']} | {_ms(v)} | {speed} | {v.get('tokens_per_s', 0):,.0f} | {mfu} | "
                       f"{v.get('host_syncs_per_step', '–')} | {_gib(v)} |")
        derived = d.get("derived", {})
        if derived:
            out.append("\n" + "; ".join(f"{k.replace('_', ' ')}: {v:.3f}" for k, v in derived.items()))
        out.append("")
    notes: dict[str, str] = {}
    for d in docs:
        for v in d["variants"]:
            if v.get("note"):
                notes.setdefault(v["name"], v["note"])
    if notes:
        out.append("What each row runs:\n")
        out.extend(f"- **{name}**: {note}" for name, note in notes.items())
        out.append("")
    out.append(f"Source: {_source(docs)}.")
    return "\n".join(out)


def _gbps(c: dict) -> str | None:
    """``"H2D / D2H"`` GB/s of the host link a run's offloaded copies crossed; None where it was not measured
    (recorded by combined runs since session 9, by breakdowns since session 10)."""
    link = c.get("host_link") or {}
    return f"{link['h2d_gbps']:.0f} / {link['d2h_gbps']:.0f}" if link.get("h2d_gbps") else None


def _link(c: dict) -> str:
    """The host link for a caption, or nothing where it was not measured."""
    return f"; host link {_gbps(c)} GB/s H2D / D2H" if _gbps(c) else ""


def _folder(doc: dict) -> str:
    return doc["_path"].rsplit("/", 1)[0]


def packed_table() -> str:
    all_docs = [d for d in R.load_results("packed_metadata") if d["config"]["model"] == "qwen3-14b"
                and d["config"]["mix"] == "realistic" and d.get("speedups", {}).get("cached_step_speedup")]
    # A flex configuration measured after another row length in the same process pays that process's compile
    # state (notebook 01, the flex section): prefer a run folder that measured one row length only, then the newest.
    lengths: dict[str, set] = {}
    for d in R.load_results("packed_metadata"):
        lengths.setdefault(_folder(d), set()).add(d["config"]["tokens_per_step"])
    best: dict[tuple, tuple] = {}
    for d in all_docs:
        key = (d["config"]["backend"], d["config"]["tokens_per_step"])
        rank = (d["config"]["backend"] != "flex" or len(lengths[_folder(d)]) == 1, d["env"].get("date", ""))
        if key not in best or rank > best[key][0]:
            best[key] = (rank, d)
    docs = [d for _, d in best.values()]
    if not docs:
        return "_No committed GPU run of the packed scenario._"
    gpu = lambda d: (d["env"].get("gpu_name") or "?").removeprefix("NVIDIA ")   # noqa: E731
    mixed = len({gpu(d) for d in docs}) > 1        # rows from different cards: each says its own (ratios compare)
    out = ["| backend, tokens/step | naive → cached forward ms | naive → cached step ms | step speedup | "
           "cached vs oracle (step) | host syncs naive → cached |" + (" GPU |" if mixed else ""),
           "|---|---|---|---|---|---|" + ("---|" if mixed else "")]
    for d in sorted(docs, key=lambda d: (d["config"]["tokens_per_step"], d["config"]["backend"])):
        c, by = d["config"], {v["name"].split(" ", 1)[1]: v for v in d["variants"] if " " in v["name"]}
        n, ca = by.get("naive"), by.get("cached")
        sp = d["speedups"]
        out.append(f"| {c['backend']}, {c['tokens_per_step'] // 1024}k | {_ms(n, 'forward_ms')} → "
                   f"{_ms(ca, 'forward_ms')} | {_ms(n)} → {_ms(ca)} | {sp['cached_step_speedup']:.3f}x | "
                   f"{(sp.get('cached_vs_oracle_step', 1) - 1) * 100:+.1f}% | "
                   f"{(n or {}).get('host_syncs_per_step', '–')} → {(ca or {}).get('host_syncs_per_step', '–')} |"
                   + (f" {gpu(d)} |" if mixed else ""))
    out.append(f"\nQwen3-14B width, {docs[0]['config']['num_layers']} layers, NF4 + LoRA r16, gradient checkpointing, "
               f"one packed row per step, realistic length mix. Source: {_source(docs)}.")
    return "\n".join(out)


def regime_table() -> str:
    points = R.packed_regime()
    if not points:
        return "_No committed regime map._"
    cols = sorted({p["tokens_per_step"] for p in points})
    keys = sorted({(p["model"], p.get("num_layers"), p["mix"], p["backend"]) for p in points})
    out = ["| model (layers), mix, backend | " + " | ".join(f"{t // 1024}k" for t in cols) + " |",
           "|---|" + "---|" * len(cols)]
    for model, layers, mix, backend in keys:
        cells = []
        for t in cols:
            p = next((p for p in points if (p["model"], p.get("num_layers"), p["mix"], p["backend"],
                                            p["tokens_per_step"]) == (model, layers, mix, backend, t)), None)
            if p is None:
                cells.append("–")
                continue
            if not p.get("cached_step_speedup"):
                cells.append("failed")       # the newest run of this point has no ratio; no older one stands in
                continue
            txt = f"{p.get('cached_forward_speedup', float('nan')):.2f} / {p['cached_step_speedup']:.2f}"
            noisy = abs(p.get("cached_vs_oracle_step", 1) - 1) > 0.02
            cells.append(f"({txt})" if noisy else txt)
        out.append(f"| {model} ({layers}), {mix}, {backend} | " + " | ".join(cells) + " |")
    out.append("\nforward / step speed of the cached path over the naive one; in parentheses where cached and oracle "
               "differ by more than 2% (host-bound, noise-dominated steps). The newest measurement of each point; "
               "\"failed\" where it has no ratio.")
    return "\n".join(out)


def offload_table() -> str:
    res = R.offload_results()
    docs = res["offload"]
    if not docs:
        return "_No committed GPU run of the offload scenario._"
    names = ["checkpointing (standard)", "offload x1 (single buffer)", "offload x2 (double buffer)",
             "offload x2 + prefetch", "save_on_cpu(step) + ckpt", "transformers offload=True", "no checkpointing"]
    out = ["| tokens/step | " + " | ".join(names) + " | peak GiB standard → x2 + prefetch |",
           "|---|" + "---|" * (len(names) + 1)]
    for d in docs:
        by = {v["name"]: v for v in d["variants"]}
        cells = [_ms(by.get(n)) if n in by else "–" for n in names]
        out.append(f"| {d['config']['tokens_per_step'] // 1024}k | " + " | ".join(cells) +
                   f" | {_gib(by.get('checkpointing (standard)'))} → {_gib(by.get('offload x2 + prefetch'))} |")
    c = docs[0]["config"]
    out.append(f"\nStep ms (median). {c['model']} width, {c['num_layers']} layers, {c.get('quant')} + LoRA "
               f"r{c.get('lora_rank')}, {c.get('attn_implementation')}, rows of {c.get('row_tokens')} tokens. "
               f"Source: {_source(docs)}.")
    for v in res["vram"]:
        by = {x["name"]: x for x in v["variants"]}
        out.append(f"At full depth ({v['config']['num_layers']} layers, {v['config']['tokens_per_step']} tokens): peak "
                   f"{_gib(by.get('checkpointing (standard)'))} → {_gib(by.get('offload x2 + prefetch'))} GiB.")
    return "\n".join(out)


def moe_table() -> str:
    docs = R.load_results(["moe-routing"], newest_run=True)
    micro = R.load_results(["moe-experts-layer"], newest_run=True)
    if not docs:
        return "_No committed GPU run of the MoE scenario._"
    names = ["naive", "grouped", "sync_free", "transformers eager", "transformers grouped_mm"]
    out = ["| tokens/step, mode | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for d in sorted(docs, key=lambda d: (d["config"]["tokens_per_step"], d["config"]["mode"])):
        by = {v["name"]: v for v in d["variants"]}
        base = by.get("naive", {}).get("step_ms", {}).get("median")
        cells = []
        for n in names:
            v = by.get(n)
            if v is None or "step_ms" not in v:
                cells.append("–")
                continue
            ms = v["step_ms"]["median"]
            cells.append(f"{ms:.1f} ({base / ms:.2f}x)" if base else f"{ms:.1f}")
        out.append(f"| {d['config']['tokens_per_step'] // 1024}k, {d['config']['mode']} | " + " | ".join(cells) + " |")
    c = docs[0]["config"]
    out.append(f"\nStep ms (speed vs naive). {c['model']} width, {c['num_layers']} layers, {c.get('dtype')}, LoRA "
               f"r{c.get('lora_rank')} on attention, {c.get('attn_implementation')} attention, rows of "
               f"{c.get('row_tokens')}. Source: {_source(docs)}.")
    profile = R.experts_profile()
    if profile is not None:
        out.append("\nOne MoE layer's experts, forward + backward (input and routing-weight gradients, expert weights "
                   "frozen as under LoRA), against the grouped matmuls alone:\n")
        out.append("| preset, tokens | matmuls alone ms | sync_free ms (x limit) | sync_free, eager glue ms (x limit) | "
                   "sync_free GPU busy / its grouped-matmul kernels | sync_free glue ms / its HBM floor | "
                   "best unfused glue (x grouped-matmul kernels) |")
        out.append("|---|---|---|---|---|---|---|")
        for r in R.experts_profile_rows(profile):
            def cell(name):
                v = r.get(name)
                return f"{v['step_ms']:.2f} ({v['vs_limit']:.2f}x)" if v and v.get("vs_limit") else "–"
            sf = r.get("sync_free") or {}
            busy = (f"{sf['gpu_busy_ms']:.2f} / {sf['grouped_mm_ms']:.2f} ms ({sf['gpu_busy_ms'] / sf['grouped_mm_ms']:.2f}x)"
                    if sf.get("grouped_mm_ms") else "–")
            glue = (f"{sf['glue_ms']:.2f} / {r['glue_floor_ms']:.2f} ({sf['glue_ms'] / r['glue_floor_ms']:.1f}x)"
                    if sf.get("glue_ms") and r.get("glue_floor_ms") else "–")
            best = f"{sf['best_unfused_vs_grouped_mm']:.2f}x" if sf.get("best_unfused_vs_grouped_mm") else "–"
            out.append(f"| {r['preset']}, {r['tokens'] // 1024}k | {r['limit_ms']:.2f} | {cell('sync_free')} | "
                       f"{cell('sync_free:eager_glue')} | {busy} | {glue} | {best} |")
        out.append(f"\nEager glue: every fused Triton kernel off (gate, combine, token-gather backward). Glue: sync_free's "
                   f"GPU busy time minus its grouped-matmul kernels. HBM floor: the fewest bytes that glue moves as "
                   f"separate kernels (`fastsft_lab.lab.flops.moe_glue_bytes`: 4TH + 5RH + 8RI bf16 elements) at the "
                   f"GPU's data-sheet bandwidth; best unfused: the grouped-matmul kernels plus that floor, over the "
                   f"kernels. Source: {_source([profile])}; `benchmarks/experts_profile.py`.")
    else:
        for m in micro:
            by = {v["name"]: v for v in m["variants"]}
            parts = [f"{n} {_ms(by.get(n))}" for n in ("naive", "transformers grouped_mm", "sync_free",
                                                        "expert matmuls alone") if n in by]
            out.append(f"One MoE layer's experts, forward + backward, {m['config']['model']}, "
                       f"{m['config']['tokens_per_step']} tokens: " + ", ".join(parts) + " ms.")
    return "\n".join(out)


def moe_layer_table() -> str:
    """Every configuration of the newest committed experts microbenchmark (``bench --only moe``) as the per-layer
    chain from transformers' default with syncs and launches (:func:`experts_layer_text`), in one text block."""
    docs = sorted(R.load_results("moe-experts-layer", newest_run=True),
                  key=lambda d: (d["config"].get("model", ""), d["config"].get("tokens_per_step", 0)))
    if not docs:
        return "_No committed GPU run of the experts microbenchmark (`bench --only moe`)._"
    return "```\n" + "\n\n".join(experts_layer_text(d) for d in docs) + "\n```"


def soak_table() -> str:
    soak = R.load_results("soak", newest_run=True)
    fb = R.load_results("offload_fallback", newest_run=True)
    cv = R.load_results("convergence", newest_run=True)
    if not (soak or fb or cv):
        return "_No committed soak run yet (`benchmarks/soak.py`)._"
    out = []
    for d in soak:
        c = d["config"]
        out.append(f"**Soak**: {d['steps']} steps of all fast, {c['preset']} x{c['num_layers']}, "
                   f"{c['tokens_per_step']} tokens ({d['seconds']:.0f} s); slope after the first "
                   f"{d['warmup_steps_excluded']} steps, bytes per step:\n")
        out.append("| what | slope (bytes/step) | first → last | min … max |")
        out.append("|---|---|---|---|")
        for k, s in d["slopes"].items():
            out.append(f"| {k} | {s['bytes_per_step']:,.0f} | {s['first'] / 2**20:,.1f} → {s['last'] / 2**20:,.1f} MiB | "
                       f"{s['min'] / 2**20:,.1f} … {s['max'] / 2**20:,.1f} MiB |")
    for d in fb:
        if "error" in d:
            caps = ", ".join(f"{t['cap_bytes'] / 2**30:.2f}" for t in d.get("trials", []) if t.get("cap_bytes"))
            out.append(f"\n**Forced OOM fallback: not triggered.** Every memory cap tried ({caps} GiB) failed first on "
                       f"an allocation outside the staging buffers ({d['error'].split(': ', 1)[-1][:60]}...): the "
                       f"buffers are allocated before the step's peak, so a cap on the whole process cannot make the "
                       f"second buffer the allocation that fails. The fallback itself is tested with an out-of-memory "
                       f"error injected on the second buffer (`tests/test_offload_memory.py` on the CPU, `tests/test_offload_cuda.py` on CUDA).")
        elif not d.get("fallbacks"):
            out.append(f"\n**Forced OOM fallback: not triggered.** Under a {d.get('cap_bytes', 0) / 2**30:.2f} GiB cap the "
                       f"second buffer still fit (fallbacks 0, {d.get('active_buffers_after')} buffers after), so this "
                       f"run does not exercise the fallback; the tests do (an injected OOM on the second buffer, on "
                       f"CPU and CUDA). Max |loss difference| between this run (two buffers) and one buffer over "
                       f"{d['steps']} steps: {d.get('max_abs_loss_diff', float('nan')):.2e}, inside the loss-curve "
                       f"noise floor below.")
        else:
            out.append(f"\n**Forced OOM fallback** (memory capped {d.get('cap_bytes', 0) / 2**30:.1f} GiB): "
                       f"fallbacks {d.get('fallbacks')}, buffers after {d.get('active_buffers_after')}, max |loss "
                       f"difference| vs offload x1 over {d['steps']} steps: {d.get('max_abs_loss_diff', float('nan')):.2e}.")
    for d in cv:
        out.append(f"\n**Loss curves** ({d['steps']} steps, {d['config']['preset']} x{d['config']['num_layers']}, "
                   f"{d['config']['dtype']}): max |all fast − all naive| {d['max_abs_diff_fast_vs_naive']:.2e}; noise "
                   f"floor (weights one ulp apart) {d['max_abs_diff_noise_floor']:.2e}.")
    docs = soak + fb + cv
    out.append(f"\nSource: {_source(docs)}.")
    return "\n".join(out)


def _mem_parts(v: dict) -> str:
    """resident before a step → peak after the forward → step peak, GiB (– where not recorded)."""
    parts = [v.get("resident_mem_bytes"), v.get("forward_peak_mem_bytes"), v.get("peak_mem_bytes")]
    return " → ".join(f"{b / 2**30:.2f}" if b else "–" for b in parts)


def _frontier_header(doc: dict) -> str:
    c = doc["config"]
    what = "" if R.plans_in(doc) > 1 else " (one budget, asked for: not a frontier)"
    kernels = ", Liger kernels" if c.get("kernels") == "liger" else ""
    return (f"{c['model']}, {_depth(c)}, {R.weights_text(c)} + LoRA r{c.get('lora_rank')}, "
            f"{c.get('tokens_per_step')} tokens/step, "
            f"autocast {c.get('autocast')}, floor: {', '.join(f'{k}={v}' for k, v in c.get('floor', {}).items())}"
            + kernels + what)


def frontier_findings(doc: dict, rows: list[dict]) -> list[str]:
    """What a frontier says against the search and the peer, one sentence each: the solver's step against the
    fastest measured plan for its budget (``solver_vs_searched``), and per peer run its step and peak against our
    fastest solved plan within its peak and within 2.5 times it."""
    der = doc.get("derived", {})
    out = []
    searched = {k.removeprefix("solver_vs_searched_"): v for k, v in der.items() if k.startswith("solver_vs_searched_")}
    if searched:
        worst = max(searched.values())
        out.append(f"Exhaustive search ({doc['config'].get('search')} next-best plans per budget by the cost model, "
                   f"timed beside the solver's): the solver's plan is within {100 * (worst - 1):.1f}% of the fastest "
                   f"measured plan at every budget ({', '.join(f'{k} {v:.3f}x' for k, v in searched.items())}).")
    for c in R.frontier_vs_peers(rows):
        p, r = c["peer"], c["plan"]
        where = "at its own peak memory" if c["multiple"] == 1 else f"with {c['multiple']:g}x its memory"
        head = (f"{p['name']}: {p['ms']:.1f} ms at {p['peak'] / 2**30:.2f} GiB; {where} "
                f"({c['memory'] / 2**30:.2f} GiB) ")
        out.append(head + ("no solved plan fits." if r is None else
                           f"the plan {r['name']} takes {r['ms']:.1f} ms at {r['peak'] / 2**30:.2f} GiB: "
                           f"{c['speed']:.3f}x its speed."))
    return out


MFU_NOTE = ("MFU: model FLOPs of the step (the frozen base's forward and input gradients, LoRA's forward and "
            "gradients, attention over the real segments, the LM head; no recompute) over the card's dense bf16 peak.")


def _mfu(row: dict) -> str:
    return f"{row['mfu']:.1%}" if row.get("mfu") is not None else "–"


def frontier_text(doc: dict, root=None) -> str:
    """A frontier of :func:`.results.budget_results` as text (one line per budget, search plan, reference and peer
    run, then :func:`frontier_findings`), for notebooks."""
    g = lambda b: f"{b / 2**30:6.1f}" if b else f"{'–':>6s}"          # noqa: E731
    rows = R.frontier_rows(doc, R.frontier_peers(doc, root))
    w = max([len("plan (budget: choices)")] + [len(r["name"]) for r in rows])
    out = [f"{_frontier_header(doc)} | {R.describe_run(doc)}",
           f"  {'plan (budget: choices)':{w}s} {'step ms':>8s} {'vs recipe':>9s} {'MFU':>6s} {'predicted':>9s} "
           f"{'peak GiB':>8s}"]
    for r in rows:
        if r["ms"] is None:
            out.append(f"  {r['name']:{w}s} did not run: {(r['error'] or '')[:80]}")
            continue
        speed = f"{r['speed']:8.2f}x" if r["speed"] else f"{'–':>9s}"
        out.append(f"  {r['name']:{w}s} {r['ms']:8.1f} {speed} {_mfu(r):>6s} {g(r['predicted']):>9s} "
                   f"{g(r['peak']):>8s}")
    return "\n".join(out + frontier_findings(doc, rows) + [MFU_NOTE])


def budget_table() -> str:
    docs = R.budget_results()
    if not docs:
        return "_No committed GPU run of `bench --only budget` yet._"
    g = lambda b: f"{b / 2**30:.1f}" if b else "–"          # noqa: E731
    out = []
    for doc in docs:
        out += [f"**{_frontier_header(doc)}**\n", "| plan (budget: choices) | step ms (median) | vs recipe | MFU | "
                "predicted peak GiB | measured peak GiB | host syncs/step |", "|---|---|---|---|---|---|---|"]
        rows = R.frontier_rows(doc, R.frontier_peers(doc))
        for r in rows:
            if r["ms"] is None:
                out.append(f"| {r['name']} | did not run: {(r['error'] or '')[:80]} | | | | | |")
            else:
                speed = f"{r['speed']:.2f}x" if r["speed"] else "–"
                out.append(f"| {r['name']} | {r['ms']:.1f} | {speed} | {_mfu(r)} | {g(r['predicted'])} | "
                           f"{g(r['peak'])} | {r['syncs'] if r['syncs'] is not None else '–'} |")
        out += ["", *frontier_findings(doc, rows), MFU_NOTE, f"\nSource: {_source([doc])}.\n"]
    return "\n".join(out).rstrip()


def peer_verdict(peer: list[dict], same: list[dict]) -> dict | None:
    """Who leads in one comparison of :func:`.results.peer_results`: the peer's fastest row against our fastest "all
    fast" row of the same session, by medians (``speed``: higher is ours faster) and by the peer's mean step
    (``speed_by_mean``, where its steps are recorded), with our peak memory over the peer's (``memory``, None where
    either is not recorded). None when either side has no timed row."""
    peers = [v for d in peer for v in d["variants"] if "step_ms" in v]
    ours = [(d["config"].get("kernels"), v) for d in same for v in d["variants"]
            if v["name"] == "all fast" and "step_ms" in v]
    if not peers or not ours:
        return None
    p = min(peers, key=lambda v: v["step_ms"]["median"])
    kernels, o = min(ours, key=lambda kv: kv[1]["step_ms"]["median"])
    verdict = {"peer": p, "ours": o, "kernels": kernels, "speed": p["step_ms"]["median"] / o["step_ms"]["median"],
               "memory": (o["peak_mem_bytes"] / p["peak_mem_bytes"]
                          if o.get("peak_mem_bytes") and p.get("peak_mem_bytes") else None)}
    steps = p.get("samples_ms", {}).get("step")
    if steps:
        verdict["peer_mean_ms"] = sum(steps) / len(steps)
        verdict["speed_by_mean"] = verdict["peer_mean_ms"] / o["step_ms"]["median"]
    return verdict


def peer_table() -> str:
    comparisons = R.peer_results()
    if not comparisons:
        return "_No committed Unsloth run yet (`benchmarks/unsloth_peer.sh`)._"
    return "\n\n".join(_peer_section(docs, same) for docs, same in comparisons)


def _peer_section(docs: list[dict], same: list[dict]) -> str:
    """One model's comparison: Unsloth's runs, then our stock / naive / fast rows from the same session."""
    c = docs[0]["config"]
    out = [f"**{c.get('model')}, {c.get('num_layers')} layers, {c.get('tokens_per_step')} tokens per step**\n",
           "| system | step ms (median) | p20–p80 ms | steps | memory GiB: resident → after forward → peak | "
           "host syncs/step |", "|---|---|---|---|---|---|"]
    for d in docs:
        for v in d["variants"]:
            if "step_ms" in v:
                out.append(f"| {v['name']} | {_ms(v)} | {_spread(v)} | {v['step_ms'].get('n', '–')} | {_mem_parts(v)} | "
                           f"{v.get('host_syncs_per_step', '–')} |")
            else:
                out.append(f"| {v['name']} | {v.get('error', '–')[:100]} | | | | |")
    for d in same:
        for v in d["variants"]:
            if v["name"] in R.PEER_OUR_VARIANTS and "step_ms" in v:
                out.append(f"| fastsft_lab {v['name']} (kernels {d['config']['kernels']}) | {_ms(v)} | {_spread(v)} | "
                           f"{v['step_ms'].get('n', '–')} | {_mem_parts(v)} | {v.get('host_syncs_per_step', '–')} |")
    verdict = peer_verdict(docs, same)
    if verdict:
        best_peer, v = verdict["peer"], verdict["ours"]
        mem = f" at {verdict['memory']:.2f}x the peak memory" if verdict["memory"] else ""
        out.append(f"\nfastsft_lab all fast (kernels {verdict['kernels']}) vs {best_peer['name']}: "
                   f"{verdict['speed']:.2f}x the speed (medians){mem}.")
        samples = best_peer.get("samples_ms", {}).get("step")
        if samples:
            out.append(f"By the mean of its {len(samples)} measured steps ({verdict['peer_mean_ms']:.1f} ms: what a run's "
                       f"wall clock pays) against our median: {verdict['speed_by_mean']:.2f}x the speed.")
        if R.unsettled(best_peer):
            out.append(f"The ratio compares medians of {best_peer['step_ms']['n']} steps; {best_peer['name']}'s steps "
                       f"spread {R.step_spread(best_peer):.1f}x from p20 to p80 (ours: {R.step_spread(v):.2f}x), "
                       f"so the lead is not settled by this run.")
            if samples:
                out.append(f"Its measured steps, in order: {', '.join(f'{x:.0f}' for x in samples)} ms.")
    if c.get("layout") == "padded":
        out.append(f"\nUnsloth cannot keep packed {c.get('model')} sequences apart (its attention is causal over the whole "
                   f"row; its trainer blocklists padding-free packing for this model), so it runs the same sequences one "
                   f"per right-padded row, as its users train: {c.get('padded_tokens_per_step', 0):.0f} tokens computed "
                   f"per step for {c.get('real_tokens_per_step', 0):.0f} real ones "
                   f"({100 * c.get('padding_fraction', 0):.0f}% padding). Its tokens/s counts real tokens.")
    out.append(f"\nSource: {_source(docs + same)}.")
    return "\n".join(out)


def offload_link_table() -> str:
    docs = R.load_results("offload_link", newest_run=True)
    if not docs:
        return "_No committed GPU run of the offload_link scenario (`bench --only offload_link`)._"
    d = docs[0]
    c, der = d["config"], d.get("derived", {})
    out = ["| link GB/s (measured) | copy / backward | plain checkpointing ms | offload x1 ms (vs plain) | "
           "x2 + prefetch ms (vs plain) | x2 gain over x1, measured / model |", "|---|---|---|---|---|---|"]
    for p in d.get("points", []):
        label = "native " if p.get("target_gbps") is None else ""
        out.append(f"| {label}{p['measured_gbps']:.1f} | {p['copy_to_backward_ratio']:.3f} | {p['plain_ms']:.1f} | "
                   f"{p['offload1_ms']:.1f} (+{100 * (p['offload1_ms'] / p['plain_ms'] - 1):.1f}%) | "
                   f"{p['offload2p_ms']:.1f} (+{100 * (p['offload2p_ms'] / p['plain_ms'] - 1):.1f}%) | "
                   f"{100 * p['gain_x2_vs_x1']:+.1f}% / {100 * p['model_gain_x2_vs_x1']:+.1f}% |")
    out.append(f"\nSlower links emulated on the H200 by padding each paced copy with dummy bytes over the same link "
               f"(pacing within {100 * der.get('link_error_max_abs', float('nan')):.1f}% of target; the timeline model "
               f"within {100 * der.get('model_error_max_abs', float('nan')):.1f}% of every measured step). The published "
               f"+6.7% double-buffer gain begins at about {der.get('published_gain_regime_begins_gbps', float('nan')):.1f} "
               f"GB/s here (a copy/backward ratio near 0.1); x2 + prefetch stays within "
               f"{100 * der.get('overhead_budget', 0.03):.0f}% of plain checkpointing down to about "
               f"{der.get('x2_stops_paying_gbps', float('nan')):.1f} GB/s, x1 only down to "
               f"{der.get('x1_stops_paying_gbps', float('nan')):.1f} GB/s. {c['model']} width, {c['num_layers']} layers, "
               f"{c.get('quant')} + LoRA r{c.get('lora_rank')}, {c['tokens_per_step']} tokens. Source: {_source(docs)}.")
    return "\n".join(out)


def breakdown_table() -> str:
    docs = R.breakdown_results()
    if not docs:
        return ("_No committed GPU run of the breakdown scenario yet (`bench --only breakdown`); notebook 04 shows the "
                "CPU smoke breakdown._")
    from .breakdown import describe_bottleneck, step_view

    views = [step_view(d) for d in docs]
    labels: dict[str, str] = {}
    for v in views:
        for row in v["categories"]:
            labels.setdefault(row["category"], row["label"])
    labels["idle"] = labels.get("idle", "idle")
    heads = [f"{d['config']['model']} ({_depth(d['config'])}), kernels {d['config'].get('kernels')}"
             f"{' + fused LoRA' if 'fused LoRA' in d['config'].get('kernels_detail', '') else ''}, autocast "
             f"{d['config'].get('autocast', 'none')}" for d in docs]
    out = ["| ms (share of the step) | " + " | ".join(heads) + " |", "|---" * (len(docs) + 1) + "|"]
    for cat, label in labels.items():
        cells = []
        for v in views:
            row = next((r for r in v["categories"] if r["category"] == cat), None)
            cells.append(f"{row['ms']:.1f} ({100 * row['share']:.0f}%)" if row and row["ms"] else "–")
        if any(c != "–" for c in cells):
            out.append(f"| {label} | " + " | ".join(cells) + " |")
    out.append("| **step without the profiler** | " + " | ".join(f"**{v['step_ms']:.1f}**" for v in views) + " |")
    out.append("| profiled step (its idle) | " + " | ".join(
        f"{v.get('profiled_step_ms', v['step_ms']):.1f} ({v.get('profiled_idle_ms', 0):.1f})" for v in views) + " |")
    links = [_gbps(d["config"]) for d in docs]
    if any(links):                                      # breakdowns from two hosts differ by their link
        out.append("| host link, H2D / D2H GB/s | " + " | ".join(link or "not recorded" for link in links) + " |")
    tokens = sorted({d["config"]["tokens_per_step"] for d in docs})
    out.append("\n" + " ".join(f"{h}: {describe_bottleneck(v)}." for h, v in zip(heads, views)))
    out.append(f"\nAll-fast step, {', '.join(map(str, tokens))} tokens; device time per category under the profiler "
               f"(module scope and backward-node sequence numbers); idle is the step timed without the profiler minus "
               f"that busy time (the profiler's own host overhead lengthens the gaps of a host-bound step; "
               f"`fastsft_lab.lab.breakdown.without_profiler`). Source: {_source(docs)}.")
    return "\n".join(out)


def _loop_naive(doc: dict) -> bool:
    """Whether a combined result's "all naive" ran transformers' eager per-expert loop (runs before 2026-12-06) instead
    of its default experts."""
    return any(v["name"] == "all naive" and v.get("toggles", {}).get("moe") == "naive" for v in doc["variants"])


def headline_rows() -> list[dict]:
    """Per model a peer run measured: stock transformers, fastsft_lab all fast and Unsloth on the same batches and
    host (``results.peer_results``): step ms, speed over stock, peak GiB, and the source of each."""
    rows = []
    for docs, same in R.peer_results():
        c = docs[0]["config"]
        fast = [(d, v) for d in same for v in d["variants"] if v["name"] == "all fast" and "step_ms" in v]
        peer = [(d, v) for d in docs for v in d["variants"] if "step_ms" in v]
        if not (fast and peer):
            continue
        pick = lambda pairs: min(pairs, key=lambda dv: dv[1]["step_ms"]["median"])   # noqa: E731
        (fd, fv), (pd, pv) = pick(fast), pick(peer)
        # stock transformers on the same kernel floor and autocast as our fastest row: one change between them
        stock = [(fd, v) for v in fd["variants"] if v["name"] == "transformers default" and "step_ms" in v]
        if not stock:
            continue
        sd, sv = stock[0]
        base = sv["step_ms"]["median"]
        model = f"{c.get('model')} x{c.get('num_layers')}, {c.get('tokens_per_step')} tokens"
        floor = f"kernels {fd['config'].get('kernels')}, autocast {fd['config'].get('autocast', 'none')}"
        for system, d, v in ((f"stock transformers ({floor})", sd, sv), (f"fastsft_lab all fast ({floor})", fd, fv),
                             (pv["name"].replace("unsloth", "Unsloth"), pd, pv)):
            rows.append({"model": model, "system": system, "step_ms": v["step_ms"]["median"],
                         "speed": base / v["step_ms"]["median"], "peak_gib": (v.get("peak_mem_bytes") or 0) / 2**30,
                         "run": R.run_of(d), "layout": d["config"].get("layout"),
                         "env": d["env"]})
    return rows


def headline_table() -> str:
    rows = headline_rows()
    if not rows:
        return "_No committed comparison with Unsloth yet._"
    out = ["| model (depth, tokens/step) | system | step ms | speed vs stock | peak GiB | run |", "|---|---|---|---|---|---|"]
    for r in rows:
        padded = " (padded rows)" if r["layout"] == "padded" and r["system"].startswith("Unsloth") else ""
        out.append(f"| {r['model']} | {r['system']}{padded} | {r['step_ms']:.1f} | {r['speed']:.2f}x | "
                   f"{r['peak_gib']:.1f} | `{r['run']}` |")
    careful, loop, full_depth = [], [], [d for d in R.combined_results() if _is_full_depth(d["config"])]
    for model in dict.fromkeys(d["config"]["model"] for d in full_depth):
        ratios, runs, looped = [], set(), False
        for d in full_depth:
            v = {x["name"]: x for x in d["variants"] if "step_ms" in x}
            if d["config"]["model"] == model and "all fast" in v and "all naive" in v:
                if _loop_naive(d):          # an older run: its all naive ran the loop the default does not
                    looped = True
                    continue
                ratios.append(v["all naive"]["step_ms"]["median"] / v["all fast"]["step_ms"]["median"])
                runs.add(R.run_of(d))
        if ratios:
            careful.append(f"{min(ratios):.2f}–{max(ratios):.2f}x at {model} (all {_full_layers(model)} layers; "
                           f"{len(ratios)} configurations, runs {', '.join(f'`{r}`' for r in sorted(runs))})")
        elif looped:
            loop.append(model)
    loop_text = (f" {', '.join(loop)}: the committed careful baselines ran transformers' eager per-expert loop, "
                 "which its default does not run, so no ratio is given here; the chain below measures each fix "
                 "against the default." if loop else "")
    if careful:
        out.append("\nAgainst a careful baseline instead of stock (**all naive**: the same kernels, each fix in its "
                   "\"before\" form -- metadata rebuilt per layer, one staging buffer, transformers' default experts), "
                   "the glue fixes are worth " + "; ".join(careful) + ". The published figure is ~25% (a later "
                   "revision ~15%). Over stock transformers, most of the dense-model gain is the packed attention "
                   "kernel and exact packing." + loop_text)
    elif loop_text:
        out.append("\n" + loop_text.strip())
    env = rows[0]["env"]
    out.append(f"\nMedians of interleaved steps on one {env.get('gpu_name')} (torch {env.get('torch')}, transformers "
               f"{env.get('transformers')}); each model's three rows come from one session, on the same batches. "
               "Qwen3-14B: NF4 + LoRA r16; GPT-OSS-20B: bf16 + LoRA r16; random weights at the real widths. The runs' "
               "folders are under `benchmarks/results/`; every other table is in [docs/results.md](docs/results.md).")
    return "\n".join(out)


HEADLINE_PNG = README.parent / "docs" / "headline.png"


def write_headline_chart(path: pathlib.Path = HEADLINE_PNG) -> str | None:
    """The headline chart (``plots.plot_headline`` of :func:`headline_rows`) as a committed PNG."""
    from .plots import plot_headline, save_figure

    rows = headline_rows()
    if not rows:
        return None
    return save_figure(plot_headline(rows), str(path))


PUBLISHED_GLUE_GAIN = 0.25     # Unsloth's blog post: ~25% per step from the three glue fixes together


# Combined rows that are steps of the attribution chain (its decomposition is the one every view reads)
CHAIN_ROWS = ("packed (cached metadata)", "+ sync_free experts")


def combined_summary(tokens: int = 8192, autocast: str = "bf16") -> list[tuple[str, str, dict]]:
    """Per model, at full depth, ``tokens`` per step and ``autocast``: one text table of the variants on both kernel
    floors (step ms, speed over transformers' default on the same floor, host syncs, peak GiB) -- stock, TRL, all
    naive, all fast and the ablation; not the rows the attribution chain decomposes (:data:`CHAIN_ROWS`) -- closed
    by the glue fixes' own share (all fast over all naive on each floor; "not measured" where a floor lacks one, and
    not given where all naive ran transformers' eager per-expert loop, which its default does not) beside the
    published figure, and the result the table comes from first (the floor that ran the most variants).
    ``[(model, table, doc)]``."""
    out = []
    docs = [d for d in R.combined_results() if d["config"].get("tokens_per_step") == tokens
            and d["config"].get("autocast", "none") == autocast and _is_full_depth(d["config"])]
    for model in dict.fromkeys(d["config"]["model"] for d in docs):
        mine = sorted((d for d in docs if d["config"]["model"] == model), key=lambda d: d["config"]["kernels"] != "none")
        names = list(dict.fromkeys(v["name"] for d in mine for v in d["variants"] if "step_ms" in v
                                   and v["name"] not in CHAIN_ROWS))
        head = "".join(f" | {'kernels ' + d['config']['kernels']:^31s}" for d in mine)
        sub = "".join(f" | {'ms':>8s} {'x dflt':>6s} {'GiB':>6s} {'syncs':>6s}  " for _ in mine)
        lines = [f"{model}, all {mine[0]['config']['num_layers']} layers, {tokens} tokens/step, autocast {autocast} "
                 f"({'; '.join(dict.fromkeys(R.describe_run(d) for d in mine))})", f"  {'':30s}{head}",
                 f"  {'variant':30s}{sub}"]
        for name in names:
            cells = ""
            for d in mine:
                rows = {v["name"]: v for v in d["variants"] if "step_ms" in v}
                v, base = rows.get(name), rows.get("transformers default")
                if v is None:
                    cells += f" | {'not run':^31s}"
                    continue
                x = base["step_ms"]["median"] / v["step_ms"]["median"] if base else float("nan")
                peak = f"{v['peak_mem_bytes'] / 2**30:6.1f}" if v.get("peak_mem_bytes") else f"{'-':>6s}"
                cells += f" | {v['step_ms']['median']:8.1f} {x:5.2f}x {peak} {str(v.get('host_syncs_per_step', '-')):>6s}  "
            label = name + (" (eager loop)" if name == "all naive" and any(_loop_naive(d) for d in mine) else "")
            lines.append(f"  {label:30s}{cells}")
        glue = []
        for d in mine:
            rows = {v["name"]: v for v in d["variants"] if "step_ms" in v}
            if _loop_naive(d):
                glue.append(f"not against the default experts on kernels {d['config']['kernels']} (all naive ran "
                            "the eager loop)")
            elif "all naive" in rows and "all fast" in rows:
                glue.append(f"{rows['all naive']['step_ms']['median'] / rows['all fast']['step_ms']['median']:.2f}x on "
                            f"kernels {d['config']['kernels']}")
            else:
                glue.append(f"not measured on kernels {d['config']['kernels']}")
        lines.append(f"  all fast over all naive (the glue fixes alone, same kernels): {', '.join(glue)}; "
                     f"published: ~{PUBLISHED_GLUE_GAIN:.0%} (a later revision ~15%)")
        lines.append("  x dflt: speed over transformers' default on the same floor (higher is better)")
        pick = max(mine, key=lambda d: (len(d["variants"]), d["config"]["kernels"] != "none"))
        out.append((model, "\n".join(lines), pick))
    return out


# --- text views the notebooks print (one call per cell) -------------------------------------------------------------
MOE_DEFAULT = "transformers grouped_mm"     # transformers 5.x's default experts path: the real baseline


def _speed(base_ms: float | None, ms: float) -> str:
    """``base / ms`` as "1.23x" (higher is faster), "–" without a base."""
    return f"{base_ms / ms:.2f}x" if base_ms else "–"


def moe_runs_text(docs: list[dict]) -> str:
    """Committed MoE results (``moe-routing``: whole-model steps; ``moe-experts-layer``: one layer's experts) as text:
    per configuration, each variant's step ms, its speed over the naive loop and over transformers' default
    ``grouped_mm`` path ("x": higher is faster), host syncs per step. A variant that failed says so; a baseline the
    run did not measure leaves its column "–" (no other run stands in)."""
    if not docs:
        return "No committed GPU run of the MoE scenarios."
    order = {"moe-routing": 0, "moe-experts-layer": 1}
    docs = sorted(docs, key=lambda d: (order.get(d["scenario"], 2), d["config"].get("model", ""),
                                       d["config"].get("tokens_per_step", 0), d["config"].get("mode", "")))
    first: dict[str, dict] = {}                                      # one document per run, to name each run once
    for d in docs:
        first.setdefault(R.run_of(d), d)
    out = [f"from {R.describe_run(d)}" for d in first.values()]
    for d in docs:
        c = d["config"]
        what = (f"whole model, {c.get('num_layers')} layers, {c.get('mode')} step" if d["scenario"] == "moe-routing"
                else "one layer's experts, forward + backward")
        out.append(f"\n{c.get('model')}, {c.get('tokens_per_step')} tokens, {what} ({R.run_of(d)})")
        out.append(f"  {'variant':26s} {'step ms':>9s} {'vs naive':>9s} {'vs default':>11s} {'syncs/step':>11s}")
        ok = {v["name"]: v["step_ms"]["median"] for v in d["variants"] if "step_ms" in v}
        for v in d["variants"]:
            if v["name"] not in ok:
                out.append(f"  {v['name']:26s} failed: {str(v.get('error', 'no timing'))[:70]}")
                continue
            ms = ok[v["name"]]
            out.append(f"  {v['name']:26s} {ms:9.2f} {_speed(ok.get('naive'), ms):>9s} "
                       f"{_speed(ok.get(MOE_DEFAULT), ms):>11s} {v.get('host_syncs_per_step', '–')!s:>11s}")
    out.append(f"\nvs default: speed over {MOE_DEFAULT!r}, what transformers 5.x runs unless told otherwise; "
               "vs naive: over the eager per-expert loop (x: higher is faster).")
    return "\n".join(out)


# One MoE layer's experts as a chain from transformers' default, one change per step (the per-layer view of the
# attribution chain's MoE steps), and the modes measured beside it; names as the moe scenario's microbenchmark gives them
LAYER_CHAIN = (("transformers grouped_mm", "transformers' default (grouped_mm)"),
               ("sync_free, eager glue", "+ sync-free routing, eager glue"),
               ("sync_free", "+ fused gate/combine kernels"))
LAYER_BESIDE = (("grouped", "grouped once (one sync per layer)"), ("naive", "naive (the per-expert loop)"),
                ("transformers eager", "transformers eager (the same loop)"),
                ("expert matmuls alone", "the limit: the grouped matmuls alone"))


def experts_layer_text(doc: dict) -> str:
    """One MoE layer's experts (a ``moe-experts-layer`` result) as the per-layer chain from transformers' default
    (:data:`LAYER_CHAIN`: each step over the one before and over the default, "x": higher is faster) and the modes
    beside it (:data:`LAYER_BESIDE`), each with its forward's host syncs and its kernel launches (forward / forward +
    backward; "–" where the run did not count them). Where the fused kernels do not run (a CPU), sync_free runs its
    eager glue and the two MoE steps are one."""
    c = doc["config"]
    rows = {v["name"]: v for v in doc["variants"]}
    ok = {n: r["step_ms"]["median"] for n, r in rows.items() if "step_ms" in r}
    default = ok.get(LAYER_CHAIN[0][0])
    where = R.describe_run(doc) if "_path" in doc else "measured here"
    out = [f"{c.get('model')}, one MoE layer's experts ({c.get('num_experts')} experts, top-{c.get('top_k')}), "
           f"{c.get('tokens_per_step')} tokens, forward + backward | {where}",
           f"  {'':40s} {'step ms':>8s} {'vs before':>9s} {'vs default':>10s} {'syncs':>6s} {'launches fwd / +bwd':>20s}"]

    def line(label, name, before=None):
        r = rows.get(name)
        if r is None or name not in ok:
            why = (r or {}).get("error", "not measured in this run")
            return f"  {label:40s} {why[:70]}"
        ms = ok[name]
        launches = (f"{r['launches_forward']} / {r['launches_per_step']}" if "launches_per_step" in r else "–")
        return (f"  {label:40s} {ms:8.2f} {(f'{before / ms:.2f}x' if before else '–'):>9s} "
                f"{(f'{default / ms:.2f}x' if default else '–'):>10s} {str(r.get('host_syncs_per_step', '–')):>6s} "
                f"{launches:>20s}")

    prev = None
    cuda = doc.get("env", {}).get("device") == "cuda"
    for name, label in LAYER_CHAIN:
        if name == LAYER_CHAIN[1][0] and name not in rows:      # one step, not two: say which and why
            continue
        if name == "sync_free" and LAYER_CHAIN[1][0] not in rows:
            label = ("+ sync-free routing and fused glue" if cuda else "+ sync-free routing (eager glue: no CUDA)")
        out.append(line(label, name, prev))
        prev = ok.get(name)
    out.append("  beside the chain:")
    out.extend(line(label, name) for name, label in LAYER_BESIDE)
    out.extend(_launch_lesson(rows, ok))
    counted = next((r.get("launches_counted") for r in rows.values() if r.get("launches_counted")), None)
    if counted:
        out.append(f"  launches: {counted}")
    return "\n".join(out)


def _launch_lesson(rows: dict, ok: dict) -> list[str]:
    """naive -> grouped (the syncs go, the loop of launches stays) and grouped -> sync_free (the launches go), each
    as syncs, launches and step time before -> after, from one result's rows ("–" where not counted)."""
    out = []
    for a, b in (("naive", "grouped"), ("grouped", "sync_free")):
        if a not in ok or b not in ok:
            continue
        ra, rb = rows[a], rows[b]
        launches = (f"launches {ra['launches_per_step']} -> {rb['launches_per_step']}" if "launches_per_step" in ra
                    and "launches_per_step" in rb else "launches not counted")
        out.append(f"  {a} -> {b}: syncs {ra.get('host_syncs_per_step', '–')} -> {rb.get('host_syncs_per_step', '–')}, "
                   f"{launches}, step {ok[a]:.2f} -> {ok[b]:.2f} ms ({ok[a] / ok[b]:.2f}x)")
    return out


def experts_profile_text(doc: dict | None, top: int = 10) -> str:
    """A committed experts profile (``benchmarks/experts_profile.py``, :func:`.results.experts_profile_rows`) as text:
    per preset and token count, sync_free and sync_free with every fused kernel off against the grouped matmuls alone
    (percent over that limit), the glue against its HBM floor, and where sync_free's GPU time goes in the first case
    (its ``top`` ops). Says so when no profile was committed."""
    if doc is None:
        return "No committed experts profile (benchmarks/experts_profile.py on the GPU machine)."
    nan = float("nan")
    def over(d: dict) -> str:
        return f"{(d.get('vs_limit') or nan) * 100 - 100:+.0f}% over the matmuls alone"

    out = [f"[{R.describe_run(doc)}] {doc.get('what', '')}".rstrip()]
    for r in R.experts_profile_rows(doc):
        sf, eg = r.get("sync_free") or {}, r.get("sync_free:eager_glue") or {}
        out.append(f"  {r['preset']:14s} {r['tokens']:6d} tokens: matmuls alone {r['limit_ms']:6.2f} ms, sync_free "
                   f"{sf.get('step_ms', nan):6.2f} ms ({over(sf)}), every fused kernel off "
                   f"{eg.get('step_ms', nan):6.2f} ms ({over(eg)})")
        if sf.get("glue_ms") and r.get("glue_floor_ms"):
            out.append(f"  {'':28s}glue {sf['glue_ms']:.2f} ms against its HBM floor {r['glue_floor_ms']:.2f} ms "
                       f"({r['glue_bytes'] / 1e9:.2f} GB); the grouped-matmul kernels ({sf['grouped_mm_ms']:.2f} ms) plus "
                       f"that floor: {sf['best_unfused_vs_grouped_mm'] * 100 - 100:+.0f}% over the kernels alone")
    case = doc["cases"][0]
    row = next((r for r in case["rows"] if r["name"] == "sync_free" and r.get("profile_step")), None)
    if row is not None:
        out.append(f"\nwhere sync_free's GPU time goes, {case['preset']} {case['tokens']} tokens "
                   f"({row['profile_step']['gpu_busy_ms']:.2f} ms busy per forward + backward):")
        out.extend(f"  {o['ms']:7.3f} ms  {o['name']}" for o in row["profile_step"]["ops"][:top])
    return "\n".join(out)


def _bytes(n: float) -> str:
    """Bytes in GiB / MiB / KiB, whichever reads best."""
    unit, scale = next((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))
                       if abs(n) >= s or s == 1)
    return f"{n / scale:.1f} {unit}" if scale > 1 else f"{n:.0f} B"


def _met(ok) -> str:
    return "met" if ok else "NOT met"


def offload_derived_text(doc: dict) -> str:
    """The figures the offload benchmark derives for one token count (``doc["derived"]``) as a sentence: the gains of
    the double buffer over one buffer, its cost against standard checkpointing and its speed over ``save_on_cpu`` and
    transformers' ``offload=True`` ("x": higher is faster), the memory saved and the second buffer's size, each
    target of the issue said to be met or not (no raw flags)."""
    d, parts = doc.get("derived") or {}, []
    if "double_prefetch_vs_single_gain" in d:
        parts.append(f"two buffers + prefetch {d['double_prefetch_vs_single_gain'] * 100:+.1f}% over one buffer"
                     + (f" (two buffers alone {d['double_vs_single_gain'] * 100:+.1f}%)" if "double_vs_single_gain" in d
                        else ""))
    if "offload2p_vs_standard_overhead" in d:
        over = d["offload2p_vs_standard_overhead"]
        parts.append(f"{abs(over) * 100:.1f}% {'slower' if over > 0 else 'faster'} than standard checkpointing"
                     + (f" (target: within 3%, {_met(d['target_within_3pct_of_standard'])})"
                        if "target_within_3pct_of_standard" in d else ""))
    if "offload2p_speedup_vs_save_on_cpu_step" in d:
        parts.append(f"{d['offload2p_speedup_vs_save_on_cpu_step']:.2f}x the speed of save_on_cpu around the step"
                     + (f" (target: 1.5x, {_met(d['target_1p5x_vs_save_on_cpu'])})" if "target_1p5x_vs_save_on_cpu" in d
                        else ""))
    if "offload2p_speedup_vs_transformers_offload" in d:
        parts.append(f"{d['offload2p_speedup_vs_transformers_offload']:.2f}x the speed of transformers offload=True")
    if "peak_saved_vs_standard_bytes" in d:
        parts.append(f"peak {_bytes(d['peak_saved_vs_standard_bytes'])} below standard checkpointing"
                     + (f" (target: below, {_met(d['target_peak_below_standard'])})" if "target_peak_below_standard" in d
                        else ""))
    if "second_buffer_bytes" in d:
        parts.append(f"second staging buffer {_bytes(d['second_buffer_bytes'])}"
                     + (f" (target: at most 0.5 GB, {_met(d['target_second_buffer_le_0p5GB'])})"
                        if "target_second_buffer_le_0p5GB" in d else ""))
    if d.get("note"):
        parts.append(str(d["note"]))
    head = f"{doc['config'].get('tokens_per_step')} tokens: "
    return head + ("; ".join(parts) if parts else "no derived figures in this result")


def offload_overlap_text(doc: dict) -> str:
    """The copy/compute overlap of a committed offload timeline (``offload_timeline``), one line per variant: the
    share of copies (and of reloads) hidden behind compute, and how long compute waited for reloads."""
    out = [f"[{R.describe_run(doc)}]"]
    for name, ov in doc.get("overlap", {}).items():
        hidden = ov.get("hidden_share")
        out.append(f"  {name:28s} copies hidden behind compute: "
                   + (f"{hidden:.0%} (reloads {ov.get('h2d_hidden_share') or 0:.0%})" if hidden is not None else "–")
                   + f", compute waited {ov.get('reload_stall_ms', float('nan')):.1f} ms for reloads")
    return "\n".join(out)


def offload_vram_text(docs: list[dict]) -> str:
    """Peak GPU memory of each variant of the committed full-depth offload runs (``offload_vram``), in GiB."""
    if not docs:
        return "No committed full-depth memory run of the offload scenario."
    out = []
    for d in docs:
        c = d["config"]
        peaks = ", ".join(f"{v['name']} {v['peak_mem_bytes'] / 2**30:.2f} GiB" if v.get("peak_mem_bytes")
                          else f"{v['name']} not measured" for v in d["variants"])
        out.append(f"peak at full depth on the GPU, {c.get('num_layers')} layers, {c.get('tokens_per_step')} tokens: "
                   f"{peaks}  [{R.describe_run(d)}]")
    return "\n".join(out)


def offload_sweep_text(doc: dict | None) -> str:
    """The regime sweep (``offload_sweep``) as one line per point: preset, width, tokens, the reload-to-backward time
    ratio, and the gain of two buffers + prefetch over one buffer, and over one buffer with serial forward copies
    (percent, positive: faster). A gain the run did not measure reads "–"."""
    if doc is None:
        return "No committed GPU run of the offload regime sweep."
    def pct(v: float | None) -> str:
        return f"{v * 100:+5.1f}%" if v is not None else "    –"

    out = [f"[{R.describe_run(doc)}]",
           (f"  {'preset':12s} {'hidden':>6s} {'tokens':>6s} {'reload/backward':>15s} {'x2+prefetch over x1':>20s} "
            f"{'over x1, serial fwd copies':>27s}")]
    for p in doc.get("points", []):
        ratio = p.get("copy_to_backward_ratio")
        out.append(f"  {p.get('preset', ''):12s} {p.get('hidden_size', 0):6d} {p.get('tokens', 0):6d} "
                   f"{(f'{ratio:.3f}' if ratio is not None else '–'):>15s} {pct(p.get('gain_x2p_vs_x1')):>20s} "
                   f"{pct(p.get('gain_x2p_vs_x1_serial')):>27s}")
    return "\n".join(out)


def offload_link_text(doc: dict | None) -> str:
    """The emulated-link run (``offload_link``): per link bandwidth, the copy/backward ratio, one buffer's and two
    buffers + prefetch's step time over plain checkpointing (percent, positive: slower), the gain of two buffers
    over one, measured and modelled, then where the published +6.7% begins and where each mode stops paying."""
    if doc is None:
        return "No committed GPU run of the offload_link scenario (bench --only offload_link on the GPU machine)."
    c = doc["config"]
    out = [f"[{R.describe_run(doc)}; {c.get('model')} x{c.get('num_layers')}, {c.get('tokens_per_step')} tokens]"]
    for p in doc.get("points", []):
        out.append(f"  link {p['measured_gbps']:5.1f} GB/s  copy/backward {p['copy_to_backward_ratio']:.3f}  "
                   f"step time over plain: x1 {100 * (p['offload1_ms'] / p['plain_ms'] - 1):+5.1f}%, x2+prefetch "
                   f"{100 * (p['offload2p_ms'] / p['plain_ms'] - 1):+5.1f}%  gain of x2 over x1 "
                   f"{100 * p['gain_x2_vs_x1']:+5.1f}% (model {100 * p['model_gain_x2_vs_x1']:+5.1f}%)")
    der = doc.get("derived") or {}
    if der:
        out.append(f"the published +6.7% begins near {der['published_gain_regime_begins_gbps']:.1f} GB/s; x2 + prefetch "
                   f"stays within 3% of plain checkpointing down to {der['x2_stops_paying_gbps']:.1f} GB/s, x1 down to "
                   f"{der['x1_stops_paying_gbps']:.1f} GB/s")
    return "\n".join(out)


def _runs_named(docs: list[dict]) -> list[str]:
    return [f"  {r}" for r in sorted({R.describe_run(d) for d in docs})]


def _cfg(d: dict) -> str:
    return " ".join(map(str, R.packed_key(d)))


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def packed_configs_text(docs: list[dict]) -> str:
    """Every committed packed configuration (:func:`.results.packed_configs`) as a table: the cached path's speed over
    the naive one (forward, step; "x": higher is faster), cached over the oracle's step time, and the run. A
    configuration whose newest run has no ratio says which variant failed, instead of an older run's ratio."""
    # here, not at the top: the scenario module needs torch, this module's callers not
    from .scenarios.packed import speedups

    if not docs:
        return "No committed GPU run of the packed scenario."
    out = [f"{len(docs)} GPU configurations, the newest measurement of each, from:", *_runs_named(docs),
           (f"\n{'model':11s} {'layers':>6s} {'mix':9s} {'backend':7s} {'tokens':>6s}   cached/naive: forward    step"
            f"   cached/oracle step   run")]
    for d in docs:
        s, failed = speedups(d), [v["name"] for v in d["variants"] if "error" in v]
        if "cached_forward_speedup" in s:
            ratios = f"{s['cached_forward_speedup']:20.3f}x {s['cached_step_speedup']:6.3f}x"
        else:
            ratios = f"{'no ratio, failed: ' + (failed[0].split()[-1] if failed else 'naive'):>28s}"
        model, layers, mix, backend, tokens = R.packed_key(d)
        out.append(f"{model:11s} {layers:6d} {mix:9s} {backend:7s} {tokens:6d} {ratios} "
                   f"{_f(s.get('cached_vs_oracle_step'), '14.3f')}        {R.run_of(d)}")
    return "\n".join(out)


def packed_findings_text(docs: list[dict], published_forward: float = 1.433) -> str:
    """What the committed packed configurations say, computed from them: how many have the cached path within 1% of
    the oracle (and, for the others, the oracle's own p20-p80 spread), the largest and smallest gains of the cache
    over the naive path, and where the published forward gain (+43.3%) is reached."""
    from .scenarios.packed import speedups

    measured = [(d, speedups(d)) for d in docs]
    paired = [(d, s) for d, s in measured if "cached_vs_oracle_step" in s]
    near = [d for d, s in paired if abs(s["cached_vs_oracle_step"] - 1) <= 0.01]
    outside = []                # beyond 1%, and beyond the oracle's own p20-p80 half-spread: not noise by that measure
    for d, s in paired:
        if d not in near:
            o = next(v["step_ms"] for v in d["variants"] if v["name"].endswith(" oracle"))
            spread = (o["p80"] - o["p20"]) / 2 / o["median"] if "p20" in o else 0.0
            if abs(s["cached_vs_oracle_step"] - 1) > spread:
                outside.append((d, s["cached_vs_oracle_step"], spread))
    others = len(paired) - len(near)
    out = [f"cached path within 1% of the oracle (step time): {len(near)} of {len(paired)} configurations"
           + (f"; of the other {others}, {others - len(outside)} differ by less than the oracle's own p20-p80 "
              f"half-spread (noise by that measure), {len(outside)} by more" if others else "")
           + (":" if outside else "")]
    out.extend(f"  {_cfg(d):34s} cached/oracle {ratio:.3f}   oracle spread +-{spread:.1%}" for d, ratio, spread in outside)
    gains = sorted(((s["cached_forward_speedup"], s["cached_step_speedup"], d) for d, s in measured
                    if "cached_forward_speedup" in s), key=lambda g: -g[0])
    out.append("\nlargest gains of the cache over the naive path (forward, step):")
    out.extend(f"  {_cfg(d):34s} {fwd - 1:+7.1%} {step - 1:+7.1%}" for fwd, step, d in gains[:4])
    out.append("smallest:")
    out.extend(f"  {_cfg(d):34s} {fwd - 1:+7.1%} {step - 1:+7.1%}" for fwd, step, d in gains[-3:])
    above = [d for fwd, _, d in gains if fwd >= published_forward]
    out.append(f"\nUnsloth's published {published_forward - 1:+.1%} forward (Qwen3-14B QLoRA SFT) is reached in "
               f"{len(above)} of {len(gains)} configurations: {', '.join(_cfg(d) for d in above) or 'none'}")
    return "\n".join(out)


def packed_variants_text(docs: list[dict], stock: str = "stock sdpa") -> str:
    """Every variant's step time in one run's documents (:func:`.results.packed_headline`), with its speed over stock
    transformers (``stock``, "x": higher is faster; "–" where the run has no stock row). A failed variant says so."""
    if not docs:
        return "No committed GPU run of the packed scenario at this configuration."
    c = docs[0]["config"]
    stock_ms = next((v["step_ms"]["median"] for d in docs for v in d["variants"] if v["name"] == stock
                     and "step_ms" in v), None)
    out = [(f"{c['model']} width, {c.get('num_layers')} layers, {c['tokens_per_step']} tokens/step, {c['mix']} lengths: "
            f"{R.describe_run(docs[0])}")]
    for d in docs:
        for v in d["variants"]:
            if "step_ms" in v:
                ms = v["step_ms"]["median"]
                out.append(f"  {v['name']:24s} step {ms:7.1f} ms   speed over {stock} "
                           + (f"{stock_ms / ms:.2f}x" if stock_ms else "–"))
            else:
                out.append(f"  {v['name']:24s} failed: {str(v.get('error', ''))[:90]}")
    return "\n".join(out)


def packed_regime_text(points: list[dict]) -> str:
    """The regime map's points (:func:`.results.packed_regime`): those drawn as missing (their newest run has no
    ratio; no older run stands in), then how many have a ratio and the runs they come from."""
    runs = {R.run_of(d): R.describe_run(d) for d in R.load_results(["packed_metadata_regime", "packed_metadata"])}
    missing = [p for p in points if not p.get("cached_forward_speedup")]
    out = [f"missing (its newest run has no ratio): {p['model']} x{p.get('num_layers')} {p['backend']} {p['mix']} "
           f"{p['tokens_per_step']} tokens" for p in missing]
    out.append(f"{len(points) - len(missing)} points with a ratio, from:")
    out.extend(f"  {runs.get(r, r)}" for r in sorted({p["_run"] for p in points}))
    return "\n".join(out)


def packed_collated_text(docs: list[dict], band: float = 0.005) -> str:
    """The collated path (:func:`.results.packed_configs` with ``collated=True``): per configuration the cached and
    the collated step time over the oracle's, and the oracle's ms; then how many are within ``band`` of the oracle."""
    from .scenarios.packed import speedups

    if not docs:
        return "No committed GPU run of the collated path."
    out = [f"{len(docs)} configurations, from:", *_runs_named(docs),
           f"\n{'model':11s} {'layers':>6s} {'backend':7s} {'tokens':>6s}   cached/oracle   collated/oracle   oracle ms"]
    inside = 0
    for d in docs:
        s = speedups(d)
        o = next(v["step_ms"]["median"] for v in d["variants"] if v["name"].endswith(" oracle"))
        model, layers, _, backend, tokens = R.packed_key(d)
        out.append(f"{model:11s} {layers:6d} {backend:7s} {tokens:6d} {_f(s.get('cached_vs_oracle_step'), '13.4f')} "
                   f"{_f(s.get('collated_vs_oracle_step'), '17.4f')} {o:11.1f}")
        inside += s.get("collated_vs_oracle_step") is not None and abs(s["collated_vs_oracle_step"] - 1) <= band
    out.append(f"\ncollated within {band:.1%} of the oracle: {inside} of {len(docs)} configurations")
    return "\n".join(out)


def config_header(doc: dict, where: str | None = None) -> str:
    """A caption every table or chart of one result carries: model, depth, tokens per step, kernel floor and autocast
    (each "not recorded" where the result has none), then ``where`` (default: the run, :func:`.results.describe_run`)."""
    c = doc.get("config", {})
    model = c.get("model") or c.get("preset") or "model not recorded"
    depth = _depth({"model": model, "num_layers": c["num_layers"]}) if c.get("num_layers") else "depth not recorded"
    tokens = f"{c['tokens_per_step']} tokens/step" if c.get("tokens_per_step") else "tokens not recorded"
    kernels = c.get("kernels") or "not recorded"
    autocast = c.get("autocast") or "not recorded"
    if where is None:      # a committed result names its run; a live one says so
        where = R.describe_run(doc) if "_path" in doc else f"this run ({doc.get('env', {}).get('device', 'here')})"
    return f"{model}, {depth}, {tokens}, kernels {kernels}, autocast {autocast} | {where}"


# What the source article published for each fix (Unsloth's blog post on packed-sequence training), by the
# attribution chain's step names: its regime was a B200/H100, transformers of its time, Qwen3-14B QLoRA / GPT-OSS-20B.
# The double buffer's figure is offload_link.PUBLISHED_GAIN (a test keeps the two equal).
PUBLISHED_STEP = {"+ metadata cached": "+14.3% per batch, +43.3% forward (Qwen3-14B QLoRA)",
                  "+ sync-free routing, eager glue": "+23% forward, grouped + sync-free over the per-expert loop "
                                                     "(GPT-OSS)",
                  "+ sync-free experts": "+23% forward, grouped + sync-free over the per-expert loop (GPT-OSS)",
                  "+ double buffer": "+6.7% (Qwen3-14B, B200)"}


def _chain_steps(doc: dict):
    """The steps of an attribution chain in order (:func:`.results.chain_steps`): ``(name, row, before)``,
    ``before`` = (speed over the step before, whether their p20-p80 spreads overlap), None for the first step and
    for a step after one that did not run; a step that did not run has a row without ``step_ms``."""
    from .harness import spreads_overlap

    rows = {r["name"]: r for r in doc["variants"]}
    prev = None
    for name in R.chain_steps(doc):
        r = rows.get(name, {})
        if "step_ms" not in r:
            yield name, r, None
            prev = None
            continue
        before = None
        if prev is not None:
            before = (prev["step_ms"]["median"] / r["step_ms"]["median"],
                      spreads_overlap(prev["step_ms"], r["step_ms"]))
        yield name, r, before
        prev = r


def chain_ratios(doc: dict) -> dict[str, str]:
    """Each step of an attribution chain as the README table and :func:`attribution_text` print it: its speed over
    the step before ("1.04x", "1.04x~" where the spreads overlap), "failed" where it did not run; the first step
    and a step after a failed one are left out. The one formatting both read, so a test can hold them to it."""
    out = {}
    for name, r, before in _chain_steps(doc):
        if "step_ms" not in r:
            out[name] = "failed"
        elif before is not None:
            out[name] = f"{before[0]:.2f}x{'~' if before[1] else ''}"
    return out


def _stock_leaks(doc: dict) -> str:
    """Why the stock row of ``doc``'s model does not compute exact packing, from its family record ("" where it
    does, or the model is not a preset)."""
    from .scenarios.packed import STOCK_LEAKS

    preset = PRESETS.get(doc.get("config", {}).get("model", ""))
    return "" if preset is None or preset.family_record.attention.stock_packs else STOCK_LEAKS


def _removes(name: str) -> str:
    from .scenarios.attribution import step_removes

    return step_removes(name)


def profiled(doc: dict) -> bool:
    """Whether an attribution result profiled its steps (runs before that did not: their labels say so)."""
    return any("profile" in r for r in doc.get("variants", []))


def _chain_rows(doc: dict) -> list[dict]:
    rows = {r["name"]: r for r in doc["variants"]}
    return [rows.get(n, {"name": n}) for n in R.chain_steps(doc)]


def chain_labels(doc: dict) -> dict[str, str]:
    """What each step after the first removed, measured (:func:`.removes.chain_removed` over the
    chain's committed profiles): the label every view prints -- "not profiled" where a step has no profile."""
    from .removes import chain_removed

    return {name: r["label"] for name, r in chain_removed(_chain_rows(doc)).items()}


NOT_PROFILED = "not profiled (a run before the chain profiled its steps: what each step removes is its mechanism only)"


def stock_step_text(doc: dict) -> str:
    """The first step of a chain -- transformers' default, the step the chain starts from -- as its profile measured
    it: its time by what bounds each kernel and idle, and so the most any host-side (glue) fix can win on it (idle
    plus latency-bound kernels: what fewer launches and no syncs shorten); "not profiled" for a run without profiles."""
    first = _chain_rows(doc)[0]
    where = config_header(doc).split(" | ")[0]
    prof = first.get("profile")
    if prof is None:
        return f"{first['name']} ({where}): not profiled in this run, so its idle time is not measured here"
    ms, step = prof["ms"], prof["step_ms"]
    host = ms["idle"] + ms["latency"]
    idle_is = "the device waiting for the host" if prof["activity"] == "cuda" else "on a CPU: host time outside ops"
    return (f"{first['name']} ({where}), one profiled warm step: {step:.1f} ms = "
            + " + ".join(f"{ms[p]:.1f} {p}" for p in ("compute", "memory", "latency", "unknown")
                         if p != "unknown" or ms.get(p, 0) >= 0.05)
            + f" (kernels by what bounds them) + {ms['idle']:.1f} idle ({idle_is})\n"
            f"  idle: {ms['idle'] / step:.0%} of the step; idle + latency-bound kernels: {host:.1f} ms "
            f"({host / step:.0%}), the most any glue fix (fewer launches, no syncs) can win on this step; the other "
            f"{step - host:.1f} ms only fewer FLOPs, fewer bytes or faster kernels shorten")


def routing_text(doc: dict) -> str:
    """The routing check of an MoE attribution chain (``doc["routing"]``): per MoE step, the tokens its routing sends
    to other experts than the reference's, per layer, and its largest relative difference as run against the same
    with the reference's routing forced. "" where the chain has none (dense models, runs before the check)."""
    out = []
    for name, a in (doc.get("routing") or {}).items():
        if "error" in a:
            out.append(f"  {name}: routing check did not run: {a['error'][:100]}")
            continue
        flips = a["flipped_tokens"]
        out.append(f"  {name}: {sum(flips)} of {a['tokens']} tokens x {len(flips)} layers routed to other experts "
                   f"(router logits in {a['logits_dtype']}; per layer {_flips_short(flips)}); vs ref as run "
                   f"{a['free']['rel']:.1e}, with the reference's routing forced {a['forced']['rel']:.1e}")
    return "\n".join(out)


def _flips_short(flips: list[int]) -> str:
    return str(flips) if len(flips) <= 8 else f"{flips[:4]} ... {flips[-2:]}".replace("] ... [", ", ..., ")


def attribution_text(doc: dict, only: Sequence[str] | None = None) -> str:
    """The attribution chain of one result (scenario ``attribution``) as a table: each step's median step time
    [p20-p80], its speed over the step before and over stock ("x": higher is faster; ``~`` where the two spreads
    overlap), its host syncs per step, whether it computes what exact packing computes (``vs ref``) and what the
    step removes; for an MoE chain, the routing check under it (:func:`routing_text`). A failed step says so and the
    next one is not compared with it. ``only``: print only these steps (each still compared with the step before it
    in the chain)."""
    from .harness import _fmt_equal

    chain = R.chain_steps(doc)
    stock = {r["name"]: r for r in doc["variants"]}.get(chain[0], {})
    out = [config_header(doc),
           f"  {'step':36s} {'step ms':>22s} {'vs before':>9s} {'vs stock':>8s} {'syncs':>5s} {'vs ref':>7s}  removes"]
    for name, r, before in _chain_steps(doc):
        if only is not None and name not in only:
            continue
        if "step_ms" not in r:
            out.append(f"  {name:36s} {'failed: ' + str(r.get('error', 'not run'))[:60]}")
            continue
        ms = r["step_ms"]
        step = f"{ms['median']:.1f} [{ms['p20']:.1f}-{ms['p80']:.1f}]"
        before = "–" if before is None else f"{before[0]:.2f}x{'~' if before[1] else ' '}"
        over = f"{stock['step_ms']['median'] / ms['median']:.2f}x" if "step_ms" in stock else "–"
        same = _fmt_equal(r["equal_to_first"]) if "equal_to_first" in r else "-"
        syncs = str(r.get("host_syncs_per_step", "-"))
        removes = _removes(name).split(":")[0] if name != chain[0] else "baseline"
        out.append(f"  {name:36s} {step:>22s} {before:>9s} {over:>8s} {syncs:>5s} {same:>7s}  {removes}".rstrip())
    unequal = [f"  {r['name']}: {r['unequal']}" for r in doc["variants"] if r.get("unequal") and
               not (r.get("equal_to_first") or {}).get("bitwise", True)]
    if not unequal and _stock_leaks(doc) and "equal_to_first" in stock:     # runs before the row said it itself
        unequal = [f"  {chain[0]}: {_stock_leaks(doc)}"]
    if only is not None:
        unequal = [u for u in unequal if u.split(":")[0].strip() in only]
    out += unequal
    routing = routing_text(doc)
    if routing:
        out.append(routing)
    out.append("  ~: p20-p80 spreads overlap (not told apart); vs ref: loss and gradients against exact packing (ref), "
               "bitwise or the largest relative difference; removes: the mechanism"
               + ("" if profiled(doc) else f"; measured: {NOT_PROFILED}"))
    from .removes import measured_lines

    out += measured_lines(_chain_rows(doc), only=only)
    return "\n".join(out)


def attribution_table(root=None) -> str:
    """Markdown: what each change of the attribution chain is worth here, one column per committed chain (model and
    kernel floor, :func:`.results.attribution_results`): its speed over the step before (:func:`chain_ratios`; blank
    where the chain has no such step) and, in the last row, the whole chain over stock; what each step removes and
    the published figure of each fix beside it."""
    docs = R.attribution_results(root=root)
    if not docs:
        return "_No committed GPU run of `bench --only attribution` yet._"
    steps: list[str] = []
    for d in sorted(docs, key=lambda d: -len(R.chain_steps(d))):         # the longest chain gives the order;
        at = 0                                                           # another's own steps follow their
        for name in R.chain_steps(d):                                    # predecessor in that chain
            if name in steps:
                at = steps.index(name) + 1
            else:
                steps.insert(at, name)
                at += 1

    def cells(doc: dict) -> dict:
        rows = {r["name"]: r for r in doc["variants"]}
        out = chain_ratios(doc)
        if profiled(doc):                 # each bar's measured label under its ratio
            out = {name: f"{ratio}<br>{chain_labels(doc)[name]}" for name, ratio in out.items()}
        chain = R.chain_steps(doc)
        first, last = rows.get(chain[0], {}), rows.get(chain[-1], {})
        if "step_ms" in first and "step_ms" in last:
            out["total"] = (f"**{first['step_ms']['median'] / last['step_ms']['median']:.2f}x** "
                            f"({first['step_ms']['median']:.0f} → {last['step_ms']['median']:.0f} ms)")
        return out

    cols = [cells(d) for d in docs]
    floor = {"none": "stock kernels", "liger": "Liger floor"}
    heads = [f"{d['config']['model']} {_depth(d['config'])}, {floor.get(d['config'].get('kernels', 'none'), '?')}"
             for d in docs]
    out = ["| step (each over the one before) | what it removes (the mechanism) | " + " | ".join(heads)
           + " | published |",
           "|---" * (len(docs) + 3) + "|"]
    for name in steps[1:]:
        out.append(f"| {name} | {_removes(name)} | " + " | ".join(c.get(name, "") for c in cols)
                   + f" | {PUBLISHED_STEP.get(name, '')} |")
    out.append("| the whole chain over stock | | " + " | ".join(c.get("total", "") for c in cols) + " | |")
    tokens = sorted({d["config"].get("tokens_per_step") for d in docs})
    autocast = sorted({str(d["config"].get("autocast", "none")) for d in docs})
    older = [d for d in docs if any(n in d["config"]["chain"] for n in R.NOT_IN_CHAIN)]
    note = ""
    if older:
        note = (f" The {', '.join(dict.fromkeys(d['config']['model'] for d in older))} chains of run"
                f"{'s' if len({R.run_of(d) for d in older}) > 1 else ''} "
                f"{', '.join(f'`{r}`' for r in sorted({R.run_of(d) for d in older}))} measured the MoE fix as one "
                "step (\"+ sync-free experts\", over the cached step); their \"grouped once\" row, slower than the "
                "default, is no step of the chain (notebook 03).")
    plain = [h for h, d in zip(heads, docs) if not profiled(d)]
    measured = ("Under each ratio, what that step removed, measured: one profiled warm step per step, its time by "
                "what bounds each kernel (compute, memory, latency: achieved FLOP/s and bytes/s against the card's "
                "peaks) and idle, against the step before." if len(plain) < len(docs) else "")
    if plain:
        measured += (" What each bar removes is its mechanism only: not profiled (runs before the chain profiled its "
                     "steps)." if len(plain) == len(docs) else
                     f" {'; '.join(plain)}: not profiled (a run before the chain profiled its steps).")
    out.append(f"\n{', '.join(map(str, tokens))} tokens per step, autocast {', '.join(autocast)}; ~: the two steps' "
               f"p20-p80 spreads overlap. {measured.strip()} Source: {_source(docs)}.{note}")
    return "\n".join(out)


def peer_text(peer: list[dict], same: list[dict]) -> str:
    """One comparison of :func:`.results.peer_results` as text: the peer's rows and ours from the same session
    (step ms, peak GiB, host syncs; each of our rows names its kernel floor and autocast), who leads by medians and by
    the peer's mean step ("x": higher is faster), memory resident -> after forward -> peak, and for every variant
    whose steps spread too widely (:func:`.results.unsettled`) a note with its measured steps. A variant that failed
    says so; a peak not recorded reads "–"."""
    from .plots import peer_rows

    c = peer[0]["config"]
    out = [f"{c.get('model')}, {_depth(c)}, {c.get('tokens_per_step')} tokens/step, kernel floor and autocast: each "
           f"row's | {R.describe_run(peer[0])}"]
    if c.get("layout") == "padded":
        out.append(f"  Unsloth on padded rows: {c['padded_tokens_per_step']:.0f} tokens computed per step for "
                   f"{c['real_tokens_per_step']:.0f} real ones ({100 * c['padding_fraction']:.0f}% padding)")
    out.extend(f"  {v['name']}: failed: {v.get('error')}" for d in peer for v in d["variants"] if "step_ms" not in v)
    for name, ms, peak, syncs in peer_rows(peer, same):
        gib = f"{peak / 2**30:6.1f} GiB" if peak else f"{'–':>6s} GiB"
        out.append(f"  {name:60s} {ms:8.1f} ms   {gib}   syncs {syncs if syncs is not None else '–'}")
    verdict = peer_verdict(peer, same)
    if verdict:
        p, o = verdict["peer"], verdict["ours"]
        mem = f" at {verdict['memory']:.2f}x the peak memory" if verdict["memory"] else ""
        out.append(f"  ours (all fast) vs {p['name']}: {verdict['speed']:.2f}x the speed "
                   f"by medians ({p['step_ms']['n']} and {o['step_ms']['n']} steps){mem}")
        if "peer_mean_ms" in verdict:
            out.append(f"  by {p['name']}'s mean step ({verdict['peer_mean_ms']:.1f} ms, what a run's wall clock pays): "
                       f"{verdict['speed_by_mean']:.2f}x")
        for who, v in (("peer", p), ("ours", o)):
            parts = [v.get(k) for k in ("resident_mem_bytes", "forward_peak_mem_bytes", "peak_mem_bytes")]
            if all(parts):
                out.append(f"  {who} memory, resident -> after forward -> peak: "
                           + " -> ".join(f"{b / 2**30:.2f}" for b in parts) + " GiB")
    elif not any(v["name"] == "all fast" and "step_ms" in v for d in same for v in d["variants"]):
        out.append("  no combined run of ours in the same session: no ratio (none from another session stands in)")
    for d in peer + same:                  # a median says little when the steps spread: show every measured step
        for v in d["variants"]:
            if R.unsettled(v):
                steps = v.get("samples_ms", {}).get("step")
                out.append(f"  note: {v['name']} spread {R.step_spread(v):.1f}x from p20 to p80 over {v['step_ms']['n']} "
                           f"steps" + (f" (steps, ms: {', '.join(f'{x:.0f}' for x in steps)})" if steps else "")
                           + ": the medians above do not settle which is faster.")
    return "\n".join(out)


def breakdown_text(docs: list[dict]) -> str:
    """Committed breakdowns (:func:`.results.breakdown_results`) as one table per model: a column per configuration,
    its header naming depth, kernel floor and autocast (so no two columns share a header), a row per category in ms
    and share of the step (re-based on the unprofiled step, :func:`.breakdown.step_view`), the step unprofiled and
    profiled, and each column's largest part. A category a configuration has no time in reads "–"."""
    from .breakdown import step_view

    docs = [d for d in docs if d.get("breakdown")]
    if not docs:
        return "No committed GPU run of the breakdown scenario yet (python -m fastsft_lab bench --only breakdown)."
    out = []
    for model in dict.fromkeys(d["config"]["model"] for d in docs):
        mine = [d for d in docs if d["config"]["model"] == model]
        views = [step_view(d) for d in mine]
        heads = [(f"x{d['config'].get('num_layers')} {d['config'].get('kernels')}",
                  f"autocast {d['config'].get('autocast', 'none')}") for d in mine]
        w = max(18, *(len(h) + 2 for pair in heads for h in pair))
        runs = sorted({R.describe_run(d) for d in mine})
        out.append(f"{model}, {mine[0]['config']['tokens_per_step']} tokens/step, the all-fast step: ms (share of the "
                   f"step); columns: depth, kernel floor, autocast | {'; '.join(runs)}")
        out.append(f"  {'':22s}" + "".join(f"{h[0]:>{w}s}" for h in heads))
        out.append(f"  {'':22s}" + "".join(f"{h[1]:>{w}s}" for h in heads))
        labels = dict.fromkeys((r["category"], r["label"]) for v in views for r in v["categories"])
        for cat, label in labels:
            cells = []
            for v in views:
                row = next((r for r in v["categories"] if r["category"] == cat), None)
                cells.append(f"{row['ms']:.1f} ({row['share']:.0%})" if row and row["ms"] else "–")
            if any(c != "–" for c in cells):
                out.append(f"  {label:22s}" + "".join(f"{c:>{w}s}" for c in cells))
        out.append(f"  {'step, unprofiled':22s}" + "".join(f"{v['step_ms']:>{w}.1f}" for v in views))
        out.append(f"  {'step, profiled':22s}" + "".join(f"{v.get('profiled_step_ms', v['step_ms']):>{w}.1f}"
                                                        for v in views))
        tops = {r["category"]: r["label"] for v in views for r in v["categories"]}
        out.append(f"  {'largest part':22s}" + "".join(f"{tops[v['bottleneck']]:>{w}s}" for v in views))
        out.append("")
    return "\n".join(out).rstrip()


def loss_curves_text(doc: dict | None) -> str:
    """A committed loss-curve run (``benchmarks/soak.py --what curves``) in one sentence: how many steps of which
    model, and the largest difference of all fast from all naive against the noise floor (the same run with the
    weights one ulp apart). Says so when none was committed."""
    if doc is None:
        return "No committed GPU loss curves yet (benchmarks/soak.py --what curves)."
    c = doc["config"]
    steps = len(next(iter(doc["losses"].values()), []))
    depth = _depth({"model": c.get("preset"), "num_layers": c.get("num_layers")})
    return (f"{steps} LoRA steps, {c.get('preset')}, {depth}, {c.get('tokens_per_step')} tokens/step, kernels none, "
            f"autocast none ({c.get('dtype')} weights; soak.py sets neither): max |all fast - all naive| = {doc['max_abs_diff_fast_vs_naive']:.2e}; noise "
            f"floor (weights one ulp apart) = {doc['max_abs_diff_noise_floor']:.2e}  [{R.describe_run(doc)}]")


TABLES: dict[str, Callable[[], str]] = {"headline": headline_table, "combined": combined_table, "packed": packed_table, "regime": regime_table, "offload": offload_table,
          "moe": moe_table, "soak": soak_table, "peer": peer_table, "offload_link": offload_link_table,
          "breakdown": breakdown_table, "budget": budget_table, "attribution": attribution_table,
          "moe_layer": moe_layer_table}


RESULTS_MD = README.parent / "docs" / "results.md"
DOCS = (README, RESULTS_MD)        # every generated block lives in one of these


def render(text: str) -> str:
    """``text`` with every results block it holds regenerated."""
    for name, fn in TABLES.items():
        pattern = re.compile(rf"(<!-- results:{name} -->\n)(?:.*?\n)?(<!-- /results:{name} -->)", re.S)
        table = fn()
        text = pattern.sub(lambda m: m.group(1) + table + "\n" + m.group(2), text)
    return text


def write_readme(paths=DOCS) -> str:
    """Regenerate the results blocks of the README (the headline) and of docs/results.md (every other table)."""
    for path in paths:
        path.write_text(render(path.read_text()))
    return ", ".join(str(p) for p in paths)


__all__ = ["TABLES", "combined_summary", "attribution_text", "attribution_table", "chain_ratios", "chain_labels",
           "profiled", "stock_step_text", "NOT_PROFILED", "routing_text", "PUBLISHED_STEP", "PUBLISHED_GLUE_GAIN", "config_header", "peer_text", "peer_verdict", "frontier_text", "frontier_findings",
           "breakdown_text", "loss_curves_text", "moe_runs_text", "experts_layer_text", "LAYER_CHAIN", "LAYER_BESIDE", "experts_profile_text", "offload_derived_text", "offload_overlap_text",
           "offload_vram_text", "offload_sweep_text", "offload_link_text", "packed_configs_text",
           "packed_findings_text", "packed_variants_text", "packed_regime_text", "packed_collated_text", "MOE_DEFAULT", "render", "write_readme", "write_headline_chart", "headline_rows", "headline_table", "README",
           "RESULTS_MD", "DOCS"]
