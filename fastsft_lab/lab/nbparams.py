"""The parameters of each notebook, for the machine it runs on: one call per notebook's parameters cell.

``parameters("00", PROFILE, SMOKE)`` returns the notebook's sizes as ``{NAME: value}`` (the notebook puts them in its
namespace) and prints what it picked and why. In smoke mode the sizes are tiny; on a GPU they are the largest
choice that fits its memory (:meth:`fastsft_lab.env.DeviceProfile.pick` over ``{choice: GiB it needs}``: the peak
the committed runs of that configuration measured, plus headroom); a GPU too small for every choice falls back to
smoke sizes and says so.
"""

from __future__ import annotations

import torch

from ..env import DeviceProfile
from . import results

__all__ = ["parameters", "CHOICES"]

# Per notebook: {choice: its sizes and the GiB it needs}, largest first
CHOICES = {
    "00": {"qwen3-14b": dict(tokens=8192, gib=40),              # all 40 layers; NF4 + LoRA r16, checkpointing
           "qwen3-0.6b": dict(tokens=4096, gib=12)},            # all 28 layers; fits a 16 GB T4
    "00-moe": {"4 layers, 8192 tokens": dict(layers=4, tokens=8192, gib=30),   # GPT-OSS-20B, no-grad forward
               "1 layer, 2048 tokens": dict(layers=1, tokens=2048, gib=12)},
    "01": {"qwen3-14b": dict(layers=8, gib=16),                 # 8 of its 40 layers at real width, 4096 tokens
           "qwen3-0.6b": dict(layers=28, gib=11)},              # all 28 layers, 4096 tokens: fits a 16 GB T4
    "02": {"qwen3-14b": dict(layers=10, tokens=16384, eq_tokens=8192, gib=56),   # 10 of 40 layers, real width
           "qwen3-0.6b": dict(layers=28, tokens=4096, eq_tokens=2048, gib=12)},  # all layers: fits a 16 GB T4
    "03": {"4 layers, 8192 tokens": dict(layers=4, tokens=8192, row=2048, gib=56),   # GPT-OSS-20B, 4 of 24 layers
           "1 layer, 2048 tokens": dict(layers=1, tokens=2048, row=1024, gib=14)},   # fits a 16 GB T4
    "04": {"qwen3-14b x8 (NF4) and gpt-oss-20b x4": dict(models=[("qwen3-14b", 8), ("gpt-oss-20b", 4)], tokens=8192,
                                                         gib=40),
           "qwen3-14b x8 (NF4)": dict(models=[("qwen3-14b", 8)], tokens=8192, gib=24),
           "qwen3-0.6b, all layers": dict(models=[("qwen3-0.6b", None)], tokens=4096, gib=10)},
}


def _pick(profile: DeviceProfile, choices: dict, smoke: bool) -> tuple[str | None, bool]:
    if smoke:
        return None, True
    pick = profile.pick({k: c["gib"] for k, c in choices.items()})
    if pick is None:
        print(f"{profile.name}: {profile.memory_gib:.0f} GiB is less than the smallest choice needs: smoke sizes")
    return pick, pick is None


def _autocast(profile: DeviceProfile) -> str:
    """bf16 where the GPU trains in it (what SFTTrainer(bf16=True) runs), else none."""
    return "bf16" if profile.device == "cuda" and profile.dtype == torch.bfloat16 else "none"


def parameters(notebook: str, profile: DeviceProfile, smoke: bool) -> dict:
    """The sizes of ``notebook`` ("00" ... "04") on this machine, printed with the reason for the choice."""
    fn = {"00": _nb00, "01": _nb01, "02": _nb02, "03": _nb03, "04": _nb04}.get(notebook)
    if fn is None:
        raise ValueError(f"no parameters for notebook {notebook!r}; known: 00, 01, 02, 03, 04")
    p = fn(profile, smoke)
    p.update(DEVICE=profile.device, DTYPE=profile.dtype)
    if profile.device == "cpu":
        torch.set_num_threads(1)   # tiny models: threads only add noise on a small shared CPU
    print(profile.describe())
    print(p.pop("WHY"))
    shown = {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v) for k, v in p.items()}
    print(", ".join(f"{k}={v}" for k, v in shown.items()))
    return p


def _nb00(profile, smoke):
    model, smoke = _pick(profile, CHOICES["00"], smoke)
    if smoke:
        return dict(SMOKE=True, MODEL="tiny-qwen3", NUM_LAYERS=None, TOKENS=1024, ROW_TOKENS=512, STEPS=4,
                    MOE_MODEL="tiny-gpt-oss", MOE_LAYERS=None, MOE_TOKENS=512, AUTOCAST="none", BUDGET=16.0,
                    WHY="smoke mode: tiny models with the real structure")
    moe = _pick(profile, CHOICES["00-moe"], False)[0] or "1 layer, 2048 tokens"
    m = CHOICES["00-moe"][moe]
    peak, doc = results.newest_peak_gib("packed_metadata", model=model, mix="realistic", backend="sdpa",
                                        num_layers=8 if model == "qwen3-14b" else 28,
                                        tokens_per_step=8192 if model == "qwen3-14b" else 4096)
    seen = f" (the committed run of its closest configuration peaked at {peak:.1f} GiB)" if peak else ""
    return dict(SMOKE=False, MODEL=model, NUM_LAYERS=None, TOKENS=CHOICES["00"][model]["tokens"],
                ROW_TOKENS=CHOICES["00"][model]["tokens"], STEPS=4, MOE_MODEL="gpt-oss-20b", MOE_LAYERS=m["layers"],
                MOE_TOKENS=m["tokens"], AUTOCAST=_autocast(profile), BUDGET=float(round(min(80.0, 0.8 * profile.memory_gib))),
                WHY=f"{model}, all layers: the largest choice whose need ({CHOICES['00'][model]['gib']} GiB){seen} "
                    f"fits in {profile.memory_gib:.0f} GiB; GPT-OSS-20B: {moe}")


def _nb01(profile, smoke):
    model, smoke = _pick(profile, CHOICES["01"], smoke)
    if smoke:
        # on a CPU varlen is a slow reference kernel, flex has no backward, xformers/flash no kernels
        return dict(SMOKE=True, BENCH_MODEL="tiny-qwen3", NUM_LAYERS=None, TOKENS=512, MIX="short", STEPS=4,
                    BACKENDS=["sdpa"], QUANT=None, WHY="smoke mode: a tiny Qwen3, sdpa")
    layers = CHOICES["01"][model]["layers"]
    peak, doc = results.newest_peak_gib("packed_metadata", variant="stock sdpa", model=model, num_layers=layers,
                                        tokens_per_step=4096, mix="realistic", backend="sdpa")
    seen = f" (the committed run peaked at {peak:.1f} GiB)" if peak else ""
    # flex is left out here (its torch.compile takes minutes); the committed results include it
    backends = [b for b in ("sdpa", "varlen") if b in profile.packed_backends]
    return dict(SMOKE=False, BENCH_MODEL=model, NUM_LAYERS=layers, TOKENS=4096, MIX="realistic", STEPS=6,
                BACKENDS=backends, QUANT="nf4",
                WHY=f"{model} x{layers}: the largest choice whose need ({CHOICES['01'][model]['gib']} GiB){seen} fits "
                    f"in {profile.memory_gib:.0f} GiB; backends this GPU trains with: {', '.join(backends)}")


def _nb02(profile, smoke):
    model, smoke = _pick(profile, CHOICES["02"], smoke)
    unified = profile.unified_memory
    if smoke:
        return dict(SMOKE=True, MODEL="tiny-qwen3", NUM_LAYERS=6, QUANT=None, LORA_RANK=8, TOKENS=512,
                    ROW_TOKENS=256, EQ_TOKENS=256, STEPS=3, TIME_OFFLOAD=not unified,
                    WHY="smoke mode: a tiny Qwen3 (6 layers)")
    c = CHOICES["02"][model]
    peak, doc = results.newest_peak_gib("offload", variant="checkpointing (standard)", model=model,
                                        num_layers=c["layers"], tokens_per_step=c["tokens"])
    seen = f" (the committed run peaked at {peak:.1f} GiB)" if peak else ""
    why = (f"{model} x{c['layers']}, {c['tokens']} tokens: the largest choice whose need ({c['gib']} GiB){seen} "
           f"fits in {profile.memory_gib:.0f} GiB")
    if unified:
        why += "; unified memory: an offload copy moves nothing here, so the timing cells are skipped"
    return dict(SMOKE=False, MODEL=model, NUM_LAYERS=c["layers"], QUANT="nf4", LORA_RANK=16, TOKENS=c["tokens"],
                ROW_TOKENS=min(8192, c["tokens"]), EQ_TOKENS=c["eq_tokens"], STEPS=4, TIME_OFFLOAD=not unified,
                WHY=why)


def _nb03(profile, smoke):
    choice, smoke = _pick(profile, CHOICES["03"], smoke)
    if smoke:
        return dict(SMOKE=True, PRESET="tiny-gpt-oss", NUM_LAYERS=None, TOKENS=256, ROW_TOKENS=128, STEPS=3,
                    LORA_RANK=16, WHY="smoke mode: a tiny GPT-OSS with the real structure")
    c = CHOICES["03"][choice]
    peak, doc = results.newest_peak_gib("moe-routing", model="gpt-oss-20b", num_layers=4, tokens_per_step=8192,
                                        mode="train")
    seen = f" (the committed 4-layer training step peaked at {peak:.1f} GiB)" if peak else ""
    return dict(SMOKE=False, PRESET="gpt-oss-20b", NUM_LAYERS=c["layers"], TOKENS=c["tokens"], ROW_TOKENS=c["row"],
                STEPS=6, LORA_RANK=16,
                WHY=f"GPT-OSS-20B, {choice}: the largest choice whose need ({c['gib']} GiB){seen} fits in "
                    f"{profile.memory_gib:.0f} GiB")


def _nb04(profile, smoke):
    choice, smoke = _pick(profile, CHOICES["04"], smoke)
    if smoke:
        return dict(SMOKE=True, MODELS=[("tiny-qwen3", None), ("tiny-gpt-oss", None)], TOKENS=512, STEPS=3,
                    BACKEND="sdpa", AUTOCAST="none", WHY="smoke mode: tiny models with the real structure")
    c = CHOICES["04"][choice]
    return dict(SMOKE=False, MODELS=c["models"], TOKENS=c["tokens"], STEPS=4, BACKEND=profile.packed_backends[0],
                AUTOCAST=_autocast(profile),
                WHY=f"{choice}: the largest choice whose need ({c['gib']} GiB) fits in {profile.memory_gib:.0f} GiB")
