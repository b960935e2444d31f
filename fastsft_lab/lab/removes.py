"""What each step of a chain removes, measured: from one profiled warm step per step
(:func:`.harness.profile_variant`: the step's time by what bounds each kernel -- compute, memory, latency, as
:mod:`fastsft_lab.roofline` classes it against the card's peaks, not by the module that launched it -- and idle), the
change against the step before, named by the kind whose time fell most: compute, memory bandwidth or host overhead.

The attribution scenario stores it per step (``removed``); the README table, notebooks 00, 03 and 04 and the
chain charts read it from the committed profiles through :func:`chain_removed`, so every view gives one answer, and
a run without profiles says "not profiled".
"""

from __future__ import annotations

# The step's time by what bounds it: the kernels' classes (fastsft_lab.roofline) and idle, the device waiting for the host
PARTS = ("compute", "memory", "latency", "unknown", "idle")
PART_NAMES = {"compute": "compute-bound kernels", "memory": "memory-bound kernels", "latency": "latency-bound kernels",
              "unknown": "unclassified kernels", "idle": "idle"}
# What a step removes, by the parts whose time fell: latency-bound kernels (too small or short to come near either
# peak: launch-bound) and idle are both the host's overhead -- fewer, larger launches and no syncs shorten them
KINDS = {"compute": ("compute",), "memory bandwidth": ("memory",), "host overhead": ("latency", "idle"),
         "unclassified kernels": ("unknown",)}
NOISE_SHARE = 0.01     # a part that moved less than this share of the step before is not named (one profiled step)
NOISE_MS = 0.05


def _parts(profile: dict) -> dict[str, float]:
    return {p: float(profile["ms"].get(p, 0.0)) for p in PARTS}


def removed(before: dict, after: dict) -> dict:
    """What a chain step removed: from the ``profile`` of the step before it (``before``) and its own (``after``)
    (:func:`.harness.profile_variant`). Per part (:data:`PARTS`) the change in ms -- they sum to the change of the
    profiled step, ``step_ms`` being busy + idle -- and per kind (:data:`KINDS`). The label names the kind whose
    time fell most (where the step got faster), then every part that moved by more than :data:`NOISE_SHARE` of the
    step before (at least the one that moved most in the step's direction), largest fall first; where the step's
    time rose it says so and names the kind that grew most; where the step moved less than that, "about even"."""
    b, a = _parts(before), _parts(after)
    deltas = {p: a[p] - b[p] for p in PARTS}
    step = sum(deltas.values())
    kinds = {k: sum(deltas[p] for p in parts) for k, parts in KINDS.items()}
    floor = max(NOISE_MS, NOISE_SHARE * sum(b.values()))
    faster = step < 0
    kind = min(kinds, key=lambda k: kinds[k]) if faster else max(kinds, key=lambda k: kinds[k])   # the most moved
    order = sorted(PARTS, key=lambda p: deltas[p] if faster else -deltas[p])       # the step's direction first
    moved = [p for p in order if abs(deltas[p]) >= floor] or order[:1]              # at least the one that moved most
    parts = ", ".join(f"{PART_NAMES[p]} {deltas[p]:+.1f} ms" for p in moved)
    named: str | None = kind
    if abs(step) < floor:
        label, short, named = f"about even ({step:+.1f} ms): {parts}", "about even", None
    elif faster:
        label, short = f"{kind}: {parts}", f"{kind} {kinds[kind]:+.1f} ms"
    else:
        label, short = f"slower ({step:+.1f} ms), more {kind}: {parts}", f"slower: {kind} {kinds[kind]:+.1f} ms"
    return {"step_delta_ms": round(step, 4), "deltas_ms": {p: round(d, 4) for p, d in deltas.items()},
            "kinds_ms": {k: round(d, 4) for k, d in kinds.items()}, "kind": named, "label": label, "short": short}


def _not_profiled(why: str) -> dict:
    return {"kind": None, "label": f"not profiled ({why})", "short": "not profiled"}


def chain_removed(rows: list[dict]) -> dict[str, dict]:
    """:func:`removed` for every step of a chain after the first, ``rows`` in chain order (a result's variants);
    where a step or the one before it has no profile (a run before the chain profiled its steps, a step that failed,
    a profile that did not run) a label "not profiled" saying why -- never one guessed."""
    out: dict[str, dict] = {}
    for prev, r in zip(rows, rows[1:]):
        if "step_ms" not in r:
            out[r["name"]] = _not_profiled("the step failed")
        elif "step_ms" not in prev:
            out[r["name"]] = _not_profiled("the step before it failed")
        elif "profile" not in r or "profile" not in prev:
            err = r.get("profile_error") or prev.get("profile_error")
            out[r["name"]] = _not_profiled(f"the profile did not run: {err[:80]}" if err else "a run before the chain "
                                           "profiled its steps")
        else:
            out[r["name"]] = removed(prev["profile"], r["profile"])
    return out


def profile_text(profile: dict) -> str:
    """One profiled step in a line: its ms by part, idle's share, launches and syncs."""
    ms, step = profile["ms"], profile["step_ms"]
    parts = " | ".join(f"{p} {ms[p]:.1f}" for p in PARTS if p != "unknown" or ms.get(p, 0.0) >= 0.05)
    syncs = profile.get("syncs")
    return (f"{step:.1f} ms: {parts} ({ms['idle'] / step:.0%} idle); {profile['launches']:,.0f} launches"
            + (f", {syncs} sync{'s' if syncs != 1 else ''}" if syncs is not None else ""))


def measured_lines(rows: list[dict], only=None) -> list[str]:
    """What each step of a chain removes, measured (:func:`chain_removed`), as printed under its table: the first
    step's profile (:func:`profile_text`), then each step's label; [] where no step was profiled. ``only``: these
    steps' lines only."""
    prof = next((r["profile"] for r in rows if "profile" in r), None)
    if prof is None:
        return []
    idle = ("the device waiting for the host, re-based on the timed step" if prof["activity"] == "cuda" else
            "a CPU: host time outside ops; the profiled step runs slower than the timed ones, so its ms are not the "
            "bars'")
    out = [f"  measured, one profiled warm step each: ms by what bounds each kernel ({prof['peaks']}) and idle "
           f"({idle})"]
    first = rows[0]
    if only is None or first["name"] in only:
        out.append(f"    {first['name']:36s} " + (profile_text(first["profile"]) if "profile" in first else
                                                   "not profiled"))
    out += [f"    {name:36s} {r['label']}" for name, r in chain_removed(rows).items() if only is None or name in only]
    return out


__all__ = ["PARTS", "PART_NAMES", "KINDS", "NOISE_SHARE", "NOISE_MS", "removed", "chain_removed", "profile_text",
           "measured_lines"]
