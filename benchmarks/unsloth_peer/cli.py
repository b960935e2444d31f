"""The command line: ``export``, ``run``, ``error-json``, ``summary``; every failure of a run becomes an error
result (and a one-line error on stderr), whatever stage it happens in."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import traceback

from .common import CHECKPOINTING, FLEX_PAD_MULTIPLE, LAYOUTS, MOE_ROW_TOKENS, log, now, one_line, write_json
from .export import export
from .result import error_result, summary_line
from .run import Interrupted, run

PROG = "python -m benchmarks.unsloth_peer"
_SIGNALLED = [False]


def _on_signal(signum, frame):
    if _SIGNALLED[0]:  # timeout and the stage's timeout may both signal: one interruption is enough
        return
    _SIGNALLED[0] = True
    limit = os.environ.get("UNSLOTH_PEER_TIMEOUT_S")
    raise Interrupted(f"{signal.Signals(signum).name} received" + (f" (this run's timeout is {limit} s, or the "
                                                                   "stage's ran out)" if limit else ""))


def _cli_run(args) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_signal)
    ctx: dict = {}
    log(f"run: {args.dir} -> {args.out} (double buffer {args.double_buffer}, warmup {args.warmup}, layout "
        f"{args.layout or 'the family default'})")
    try:
        result = run(args.dir, args.out, double_buffer=args.double_buffer, warmup=args.warmup, steps=args.steps,
                     lengths_device=args.seq_lengths_device, allow_cpu=args.allow_cpu, ctx=ctx, layout=args.layout,
                     pad_multiple=args.pad_to_multiple_of, checkpointing=args.checkpointing)
    except BaseException as e:  # noqa: BLE001 - every failure becomes an error result
        _SIGNALLED[0] = True  # from here on a late signal must not interrupt writing the error result
        interrupted = isinstance(e, (KeyboardInterrupt, Interrupted))
        kind = "interrupted" if interrupted else type(e).__name__
        message = one_line(f"{ctx.get('stage', '?')}: {kind}: {e}")
        tb = None
        if not (isinstance(e, ModuleNotFoundError) and ctx.get("stage") == "import unsloth"):
            tb = traceback.format_exc()
            print(tb, flush=True)
        try:
            write_json(args.out, error_result(ctx, message, args.double_buffer, args.seq_lengths_device, tb,
                                              args.checkpointing))
        except Exception as w:  # noqa: BLE001
            message += f" (and the error JSON could not be written: {w})"
        print(f"unsloth_peer run: error: {message}", file=sys.stderr, flush=True)
        return 130 if interrupted else 1
    v = result["variants"][0]
    if "error" in v:
        print(f"unsloth_peer run: error: {v['error']}", file=sys.stderr, flush=True)
        return 2
    log(f"{summary_line(args.out)} -> {args.out}")
    return 0


def _cli_export(args) -> int:
    try:
        export(args.out, model=args.model, num_layers=args.num_layers, tokens=args.tokens, steps=args.steps,
               mix=args.mix, lora_rank=args.lora_rank, device=args.device, row_tokens=args.row_tokens)
    except BaseException as e:  # noqa: BLE001
        message = one_line(f"{type(e).__name__}: {e}")
        print(traceback.format_exc(), flush=True)
        try:
            write_json(os.path.join(args.out, "export_error.json"), {"error": message, "date": now()})
        except Exception:  # noqa: BLE001
            pass
        print(f"unsloth_peer export: error: {message}", file=sys.stderr, flush=True)
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    return 0


def _layers_arg(text: str):
    if text in ("auto", "all"):
        return None if text == "all" else "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int, 'all' or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"num-layers must be >= 1, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    from . import __doc__ as package_doc

    p = argparse.ArgumentParser(prog=PROG, description=(package_doc or "").split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="our environment: weights, tokenizer, batches and meta.json into --out")
    ex.add_argument("--out", required=True)
    ex.add_argument("--model", default="qwen3-14b")
    ex.add_argument("--num-layers", type=_layers_arg, default="auto",
                    help="decoder layers: an int, 'all', or 'auto' (default: 8 for Qwen3, all for GPT-OSS)")
    ex.add_argument("--tokens", type=int, default=8192)
    ex.add_argument("--row-tokens", type=int, default=None,
                    help=f"tokens per packed row (default: --tokens for Qwen3, {MOE_ROW_TOKENS} for GPT-OSS)")
    ex.add_argument("--steps", type=int, default=6, help="packed batches to export")
    ex.add_argument("--mix", default="realistic")
    ex.add_argument("--lora-rank", type=int, default=16)
    ex.add_argument("--device", default=None, help="where the random weights are built (default cuda if any)")
    rn = sub.add_parser("run", help="Unsloth's environment: measure the export in --dir, write --out")
    rn.add_argument("--dir", required=True)
    rn.add_argument("--out", required=True)
    rn.add_argument("--double-buffer", choices=("on", "off"), default="on")
    rn.add_argument("--checkpointing", choices=tuple(CHECKPOINTING), default="unsloth",
                    help="unsloth: use_gradient_checkpointing='unsloth' (offloaded); off: False (every activation kept)")
    rn.add_argument("--warmup", type=int, default=2)
    rn.add_argument("--steps", type=int, default=None, help="measured steps (default: one per exported batch)")
    rn.add_argument("--seq-lengths-device", choices=("cpu", "cuda"), default="cpu",
                    help="where packed_seq_lengths lives: the collator's host tensor, or moved as HF Trainer does")
    rn.add_argument("--layout", choices=LAYOUTS, default=None,
                    help="packed: the export's rows (Qwen3 with packed_seq_lengths; GPT-OSS segments then attend "
                         "across a row); padded (GPT-OSS only): one right-padded row per sequence, as Unsloth trains "
                         "GPT-OSS. Default: padded for GPT-OSS, packed for Qwen3")
    rn.add_argument("--pad-to-multiple-of", type=int, default=None,
                    help=f"padded layout: round the padded width up to this (default {FLEX_PAD_MULTIPLE}, Unsloth's "
                         "SFTConfig value for GPT-OSS; 1: the step's longest sequence)")
    rn.add_argument("--allow-cpu", action="store_true", help="development only: Unsloth's CPU backend")
    er = sub.add_parser("error-json", help="write an error result (for the stage script when a run left none)")
    er.add_argument("--out", required=True)
    er.add_argument("--message", required=True)
    er.add_argument("--double-buffer", choices=("on", "off"), default="on")
    er.add_argument("--checkpointing", choices=tuple(CHECKPOINTING), default="unsloth")
    er.add_argument("--stage", default="stage script")
    sm = sub.add_parser("summary", help="one line per result JSON")
    sm.add_argument("paths", nargs="+")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.cmd == "export":
        return _cli_export(args)
    if args.cmd == "run":
        return _cli_run(args)
    if args.cmd == "error-json":
        write_json(args.out, error_result({"stage": args.stage}, one_line(args.message), args.double_buffer,
                                          "cpu", None, args.checkpointing))
        return 0
    lines = [summary_line(path) for path in args.paths]
    print("\n".join(lines), flush=True)
    return 1 if any(": ERROR: " in line for line in lines) else 0
