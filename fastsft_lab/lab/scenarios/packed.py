"""Benchmark of optimization 1: naive / cached / collated / oracle packed attention (+ the stock transformers path).

"cached (collated)" is the training setup of ``PackedCollator(prebuild=backend)``: the metadata's host side is
built outside the timed step (as a DataLoader worker would) and pinned (as ``DataLoader(pin_memory=True)`` does);
the step only copies it to the device. Against the oracle it shows what is left of the metadata's cost.

GPU default: Qwen3-14B width, 8 layers, NF4 + LoRA r16 on all projections, gradient checkpointing, one packed
row per step from the realistic length mix at 4k and 16k tokens, backends sdpa, varlen, flex -- roughly 4-6 min
on an H200, a good part of it torch.compile for flex (``--set packed.backends=sdpa,varlen`` skips it). Each
configuration's JSON and the regime summary are written as soon as it finishes, so a time limit keeps what was
done. Smoke (CPU): tiny-qwen3 and tiny-gpt-oss, 512 tokens of short sequences, sdpa (varlen's CPU kernel is a
reference for exactness, not one to time). CPU timings show the mechanism (syncs removed, metadata built once), not
GPU speed.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from ...data import PackedBatch, benchmark_batches
from ...families import get_family
from ..._compat import attn_implementation, set_attn_implementation_of
from ...models import LoraSettings, build_model, get_preset
from ...structure import base_model, family_of
from ...packing import (BACKENDS, PackedMetadata, available_backends, get_backend, packed_inputs, prebuild_metadata,
                        prepare_metadata)
from ...toggles import apply
from ..harness import Variant, format_table, make_result, run_variants, write_json
from ..plots import plot_regime, plot_result, save_figure
from ..scenario import OptionError, Scenario, option


def _windows_and_sinks(model: nn.Module) -> tuple[tuple[int | None, ...], bool]:
    """The sliding windows of the model's layers and whether its attention has sinks, from its family record."""
    family = family_of(model)
    windows = set(family.layer_windows(base_model(model).config))
    return tuple(sorted(windows, key=lambda w: -1 if w is None else w)), family.attention.sinks


def packed_variants(model: nn.Module, backend: str, device: torch.device, *, stock: str | None = None,
                    collated: bool = False, naive: bool = True) -> list:
    """naive, cached and oracle variants of ``backend`` (+ the stock transformers path ``stock``) for run_variants;
    ``collated=True`` adds "cached (collated)", metadata prebuilt by the collator path (the scenario's default);
    ``naive=False`` leaves the naive one out."""
    windows, sinks = _windows_and_sinks(model)
    dtype = base_model(model).get_input_embeddings().weight.dtype
    b = get_backend(backend)

    def on(cache: bool):
        return lambda m: apply(m, packed_attention=backend, packed_metadata_cache=cache)

    def off(m):
        apply(m, packed_attention="off")

    def prepared(batch: PackedBatch) -> PackedMetadata:
        meta = prepare_metadata(PackedMetadata.from_batch(batch), device, backend=backend, dtype=dtype,
                                windows=windows, sink=sinks)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return meta

    def collated_meta(batch: PackedBatch) -> PackedMetadata:
        # PackedCollator(prebuild=backend, windows=...) in a DataLoader worker, then its pin-memory thread
        meta = prebuild_metadata(PackedMetadata.from_batch(batch), backend, windows=windows)
        return meta.pin_memory() if device.type == "cuda" else meta

    variants = [
        Variant(f"{backend} naive", {"attn_implementation": b.attn_name, "packed_metadata_cache": False}, on(False),
                off, None, lambda bt, s: bt.model_inputs(),
                note=f"metadata rebuilt from position_ids in every layer (and again in each checkpoint recompute); "
                     f"syncs per layer: {b.naive_syncs}. Faithful to transformers' flash-attention packed path "
                     f"(modeling_flash_attention_utils) and Unsloth's pre-cache utils/packing.py builders."),
        Variant(f"{backend} cached", {"attn_implementation": b.attn_name, "packed_metadata_cache": True}, on(True),
                off, None, lambda bt, s: packed_inputs(bt),
                note="PackedMetadata built from the packer's host lengths inside the timed step; device tensors "
                     "(one pinned non-blocking copy) and the backend object built lazily by the first layer, then "
                     "reused by every layer and by the checkpoint recompute. 0 syncs."),
        Variant(f"{backend} oracle", {"attn_implementation": b.attn_name, "packed_metadata_cache": True,
                                      "oracle": True},
                on(True), off, prepared,
                lambda bt, s: {**bt.model_inputs(), "packed_metadata": s},
                note="everything prebuilt outside the timed region (Variant.prepare): the zero-overhead limit."),
    ]
    if collated:
        variants.insert(2, Variant(
            f"{backend} cached (collated)", {"attn_implementation": b.attn_name, "packed_metadata_cache": True,
                                             "collated": True},
            on(True), off, collated_meta,
            lambda bt, s: {**bt.model_inputs(), "packed_metadata": s.to(device, non_blocking=True)},
            note="PackedCollator(prebuild=backend): host side (cu_seqlens, seq/position ids, the backend's tables) "
                 "built and pinned outside the timed region, as DataLoader workers and pin_memory=True do; the "
                 "timed step queues the non-blocking copies (PackedMetadata.to) and the layers assemble the rest "
                 "on first use (dense masks on the device, from seq_ids). 0 syncs."))
    if not naive:
        variants = variants[1:]
    if stock:
        before: list = []           # the implementation the model had, while the stock variant runs

        def stock_on(m, impl=stock):
            apply(m, packed_attention="off")
            base = base_model(m)
            before.append(attn_implementation(base.config))
            if before[-1] != impl:
                base.set_attn_implementation(impl)

        def stock_off(m):
            if before:
                set_attn_implementation_of(base_model(m).config, before.pop())

        unequal = stock_leak(model)
        leak = " (its masks never see position_ids: packed sequences attend across boundaries)" if unequal else ""
        variants.append(Variant(
            f"stock {stock}", {"attn_implementation": stock, "packed_metadata_cache": None}, stock_on, stock_off,
            None, lambda bt, s: bt.model_inputs(),
            note=f"stock transformers {stock} given packed position_ids and no mask: masking_utils detects the "
                 f"packing from position_ids once per forward (one sync) and builds the mask once{leak}.",
            unequal=unequal))
    return variants


def naive_variants(model: nn.Module, backends=("sdpa",), device=None) -> list:
    """Only the naive per-layer variant of each backend (notebook 00 measures it next to the stock path)."""
    from ...structure import model_device

    device = torch.device(device) if device is not None else model_device(model)
    return [packed_variants(model, b, device)[0] for b in backends]


STOCK_LEAKS = ("not the model's output: each packed sequence attends to the ones before it in the row (stock "
               "transformers' masks for this family never see position_ids; notebook 01 shows the leak)")


def stock_leak(model: nn.Module) -> str:
    """Why a row on stock attention does not compute exact packing on ``model`` (:data:`STOCK_LEAKS`), from its
    family record; "" where stock transformers keeps packed sequences apart."""
    return "" if family_of(model).attention.stock_packs else STOCK_LEAKS


def _stock_for(backend: str, family: str) -> str | None:
    """The stock path a user of ``backend`` would otherwise run (None: the same as another config's stock)."""
    if backend == "flex":
        return "flex_attention"
    if backend == "varlen":
        return None   # stock transformers has no torch-varlen path; its stock sdpa/eager is timed in the sdpa config
    return get_family(family).attention.stock   # GPT-OSS: eager (SDPA cannot take its attention sinks)


def _result_name(model: str, tokens: int, mix: str, backend: str) -> str:
    size = f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
    return f"packed_{model}_{size}_{mix}_{backend}"


def speedups(result: dict) -> dict:
    """naive/cached and naive/oracle (forward, step), and cached/oracle (step), from a result's medians."""
    rows = {r["name"].split(" ", 1)[1] if " " in r["name"] else r["name"]: r for r in result["variants"]
            if "error" not in r}
    out = {}
    naive = rows.get("naive")
    for row, key in (("cached", "cached"), ("oracle", "oracle"), ("cached (collated)", "collated")):
        if naive and row in rows:
            for phase in ("forward", "step"):
                if f"{phase}_ms" in naive and f"{phase}_ms" in rows[row]:
                    out[f"{key}_{phase}_speedup"] = round(naive[f"{phase}_ms"]["median"] /
                                                          rows[row][f"{phase}_ms"]["median"], 4)
    oracle = rows.get("oracle")
    for row, key in (("cached", "cached_vs_oracle_step"), ("cached (collated)", "collated_vs_oracle_step")):
        if oracle and row in rows and "step_ms" in rows[row] and "step_ms" in oracle:
            out[key] = round(rows[row]["step_ms"]["median"] / oracle["step_ms"]["median"], 4)
    return out


SWEEP_MODELS = {"qwen3-0.6b": None, "qwen3-14b": 8}   # model -> decoder layers kept (None: all)


@dataclasses.dataclass
class PackedOptions:
    models: list = option(["qwen3-14b"], kind="strs", help="model presets")
    tokens: list = option([4096, 16384], kind="ints", help="tokens per step (one configuration each)")
    backends: list = option(["sdpa", "varlen", "flex", "segments"], kind="strs",
                            help=f"packed-attention backends, from: {', '.join(BACKENDS)}")
    mixes: list = option(["realistic"], kind="strs", help="length mixes (short, realistic, long)")
    num_layers: int | None = option(8, kind="int?", help="decoder layers kept at real width (none: all)")
    quant: str | None = option("nf4", kind="str?", help="nf4 (QLoRA) or none")
    lora_rank: int = option(16, kind="int", help="LoRA rank on every projection")
    gradient_checkpointing: bool = option(True, kind="bool", help="transformers' checkpointing on the layers")
    row_tokens: int | None = option(None, kind="int?", help="tokens per packed row (none: one row per step)")
    stock: bool = option(True, kind="bool", help="also time the stock transformers path")
    naive: bool = option(True, kind="bool", help="time the naive path (false: cached/collated/oracle only; saves "
                                                 "flex's per-layer create_block_mask compile at 16k)")
    collated: bool = option(True, kind="bool", help="also time the cached path with metadata prebuilt by the "
                                                    "collator (PackedCollator(prebuild=...)), copied in the step")
    sweep: bool = option(False, kind="bool", help="the regime map: qwen3-0.6b (28 layers) and qwen3-14b (8) x "
                                                  "2k-16k x mixes x backends")
    dtype: str = option("bfloat16", kind="str", help="compute dtype")
    steps: int = option(4, kind="int", help="measured steps per variant")
    warmup: int = option(2, kind="int", help="warm-up steps per variant")

    @classmethod
    def defaults(cls, device: torch.device, smoke: bool) -> "PackedOptions":
        if smoke:
            # varlen runs a reference kernel on a CPU (tested for exactness, not a kernel to time): sdpa only there
            return cls(models=["tiny-qwen3", "tiny-gpt-oss"], tokens=[512],
                       backends=["sdpa"] if device.type == "cpu" else ["sdpa", "varlen"],
                       mixes=["short"], num_layers=None, quant=None, lora_rank=8,
                       dtype="float32" if device.type == "cpu" else "bfloat16", steps=6, warmup=2)
        return cls()


class PackedScenario(Scenario):
    name = "packed"
    title = "packed-sequence metadata caching (optimization 1)"
    Options = PackedOptions

    def validate(self, opts: PackedOptions, device: torch.device) -> None:
        super().validate(opts, device)
        for b in opts.backends:
            if b not in BACKENDS:
                raise OptionError(f"unknown packed-attention backend {b!r}; known: {', '.join(BACKENDS)}")
        for m in opts.models:
            get_preset(m)
        from ...data import LENGTH_MIXES

        for mix in opts.mixes:
            if mix not in LENGTH_MIXES:
                raise OptionError(f"unknown length mix {mix!r}; known: {', '.join(LENGTH_MIXES)}")
        if opts.quant not in (None, "nf4", "none"):
            raise OptionError(f"quant must be nf4 or none, got {opts.quant!r}")
        if opts.dtype not in ("bfloat16", "float16", "float32"):
            raise OptionError(f"dtype must be bfloat16, float16 or float32, got {opts.dtype!r}")

    def run(self, opts: PackedOptions, *, device: torch.device, out_dir: str, progress: bool = True) -> list[dict]:
        if opts.sweep:
            plan = [(m, layers) for m, layers in SWEEP_MODELS.items()]
            tokens, backends, mixes = [2048, 4096, 8192, 16384], ["sdpa", "varlen"], opts.mixes
            stock_on = False
        else:
            plan = [(m, opts.num_layers) for m in opts.models]
            tokens, backends, mixes, stock_on = opts.tokens, opts.backends, opts.mixes, opts.stock
        dtype = getattr(torch, opts.dtype)
        quant = None if opts.quant in (None, "none") else opts.quant
        status = available_backends(device)
        results, summary = [], []
        for model_name, layers in plan:
            preset = get_preset(model_name)
            model = build_model(model_name, device=device, dtype=dtype, quant=quant,
                                lora=LoraSettings(rank=opts.lora_rank), num_layers=layers,
                                gradient_checkpointing=opts.gradient_checkpointing)
            for p in model.parameters():  # LoRA B starts at zero; give the adapters a real gradient path
                if p.requires_grad and p.dim() == 2 and not p.any():
                    nn.init.normal_(p, std=0.01)
            vocab = model.config.vocab_size
            for mix in mixes:
                for n_tokens in tokens:
                    row = opts.row_tokens or n_tokens
                    batches = [b.to(device) for b in benchmark_batches(tokens_per_step=n_tokens, row_tokens=row,
                                                                       steps=max(opts.steps, 2), vocab_size=vocab,
                                                                       mix=mix)]
                    for backend in backends:
                        st = status[backend]
                        if not st.available or not st.training:
                            print(f"[packed] skip {model_name} {backend}: {st.reason}")
                            continue
                        stock = _stock_for(backend, preset.family) if stock_on else None
                        if stock == "flex_attention" and device.type == "cpu":
                            stock = None
                        label = f"{model_name} {n_tokens} {mix} {backend}"
                        variants = packed_variants(model, backend, device, stock=stock, collated=opts.collated,
                                                   naive=opts.naive)
                        rows = run_variants(model, batches, variants,
                                            steps=opts.steps, warmup=opts.warmup, mode="train", progress=progress,
                                            label=label)
                        config = {"model": model_name, "num_layers": model.config.num_hidden_layers,
                                  "tokens_per_step": n_tokens, "row_tokens": row, "mix": mix, "backend": backend,
                                  "quant": quant, "lora_rank": opts.lora_rank,
                                  "gradient_checkpointing": opts.gradient_checkpointing, "dtype": opts.dtype,
                                  "steps": opts.steps, "warmup": opts.warmup, "mode": "train",
                                  "cpu_threads": torch.get_num_threads() if device.type == "cpu" else None,
                                  "batch": batches[0].length_stats(),
                                  "segments_per_step": [b.num_sequences for b in batches]}
                        notes = ("baseline = the naive path (first variant); speedups are naive/x." if opts.naive
                                 else "no naive path in this run (packed.naive=false): baseline = cached.")
                        if device.type == "cpu":
                            notes += (" CPU run: the timings show the mechanism (host syncs removed, metadata "
                                      "built once), not GPU speed; see the committed GPU results.")
                        result = make_result("packed_metadata", config, rows, device, notes=notes)
                        result["speedups"] = speedups(result)
                        name = _result_name(model_name, n_tokens, mix, backend)
                        write_json(result, os.path.join(out_dir, name + ".json"))
                        fig = plot_result(result, title=f"packed metadata: {model_name} ({config['num_layers']} "
                                                        f"layers) | {n_tokens} tok/step | {mix} | {backend} | "
                                                        f"{result['env'].get('gpu_name') or 'CPU'}")
                        if fig is not None:
                            save_figure(fig, os.path.join(out_dir, name + ".png"))
                        print(f"\n{label}\n{format_table(result)}")
                        results.append(result)
                        summary.append({"model": model_name, "backend": backend, "mix": mix,
                                        "tokens_per_step": n_tokens, "num_layers": config["num_layers"],
                                        **result["speedups"]})
                        write_json({"scenario": "packed_metadata_regime", "summary": summary,
                                    "env": results[0]["env"]}, os.path.join(out_dir, "packed_regime.json"))
                        save_figure(plot_regime(summary), os.path.join(out_dir, "packed_regime.png"))
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return results


__all__ = ["PackedScenario", "PackedOptions", "packed_variants", "naive_variants", "speedups"]
