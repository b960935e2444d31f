"""Several processes, every optimization on: does a DDP or FSDP2 step equal one process on the same global batch?

Run under torchrun (on a CPU with gloo, on GPUs with NCCL)::

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m fastsft_lab.lab.distributed \\
        --case fsdp2-qwen3-lora-offload2 --out runs/dist.json

Each rank takes its own row of a packed global batch (the rows hold different numbers of loss tokens), builds the
same model from the same seed, switches the optimizations on (``fastsft_lab.apply``, before or after wrapping, as
the case says), wraps it (DDP, or FSDP2's ``fully_shard`` per decoder layer then the root) and runs one step. The
loss is the global mean over every loss token of every rank: each rank divides its sum by the token count of the
whole batch (``num_items_in_batch``, all-reduced, as transformers' Trainer does with
``average_tokens_across_devices``) and multiplies by the world size that the wrapper's gradient averaging divides
by. Rank 0 then runs the reference in the same process: the same switches, no wrapper, both rows in one batch; and,
as a guard against a vacuous comparison, the gradient of its own row alone.

Writes one JSON document: per case the world size seen inside the workers, each rank's loss-token count, the loss
and every trainable gradient's largest difference from the reference, and how far a rank's own gradient is from it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

import fastsft_lab
from fastsft_lab.data import PackedBatch, pack_examples, synthetic_corpus
from fastsft_lab.loss import set_router_loss_scope
from fastsft_lab.models import LoraSettings, build_model, get_preset
from fastsft_lab.structure import base_model, decoder_layers, family_of

# case name -> (wrapper, preset, lora, switches, apply before wrapping[, router loss scope[, collator]])
CASES: dict[str, tuple] = {
    "ddp-qwen3-lora-all": ("ddp", "tiny-qwen3", True,
                           dict(packed_attention="sdpa", offload_buffers=2, fused_loss=True), True),
    "ddp-qwen3-full-offload1-applied-after": ("ddp", "tiny-qwen3", False,
                                              dict(packed_attention="sdpa", offload_buffers=1, fused_loss=True), False),
    "ddp-gpt-oss-lora-experts-sync-free": ("ddp", "tiny-gpt-oss", True,
                                           dict(packed_attention="sdpa", offload_buffers=2, fused_loss=True,
                                                moe_routing="sync_free"), True),
    # the router load-balancing loss in the loss (as TRL turns it on for MoE models), averaged over every rank
    "ddp-gpt-oss-router-loss-global": ("ddp", "tiny-gpt-oss", True,
                                       dict(packed_attention="sdpa", offload_buffers=2, fused_loss=True,
                                            moe_routing="sync_free"), True, "global"),
    # the memory plan's first step under DDP: each kind of layer measured inside the forward (autograd.grad on the
    # layer's own inputs and parameters: no gradient accumulated, DDP's reducer untouched), every layer offloaded
    "ddp-qwen3-lora-memory-plan": ("ddp", "tiny-qwen3", True,
                                   dict(packed_attention="sdpa", memory_budget=16, fused_loss=True), True),
    # a fixed plan mixing every choice, offload_saved's hooks and copies included (``plan``: set_plan after apply)
    "ddp-qwen3-lora-plan-every-choice": ("ddp", "tiny-qwen3", True,
                                         dict(packed_attention="sdpa", memory_budget=16, fused_loss=True,
                                              plan=("offload_saved", "selective", "keep")), True),
    # TRL's padding-free collator on each rank's sequences (one flattened row per rank, seq_idx and cu_seq_lens)
    "ddp-qwen3-trl-padding-free": ("ddp", "tiny-qwen3", True,
                                   dict(packed_attention="sdpa", offload_buffers=2, fused_loss=True), True, None,
                                   "trl-padding-free"),
    # the experts sharded with their layer, LoRA on them, an expert idle
    "fsdp2-gpt-oss-lora-experts-sync-free": ("fsdp2", "tiny-gpt-oss", True,
                                             dict(packed_attention="sdpa", offload_buffers=2, fused_loss=True,
                                                  moe_routing="sync_free"), True),
    "fsdp2-qwen3-lora-offload0": ("fsdp2", "tiny-qwen3", True,
                                  dict(packed_attention="sdpa", offload_buffers=0, fused_loss=True), True),
    "fsdp2-qwen3-lora-offload2": ("fsdp2", "tiny-qwen3", True,
                                  dict(packed_attention="sdpa", offload_buffers=2, fused_loss=True), True),
    "fsdp2-qwen3-full-offload2": ("fsdp2", "tiny-qwen3", False,
                                  dict(packed_attention="sdpa", offload_buffers=2, fused_loss=True), True),
    "fsdp2-qwen3-full-offload1-applied-after": ("fsdp2", "tiny-qwen3", False,
                                                dict(packed_attention="sdpa", offload_buffers=1), False),
    # the memory plan's first step under FSDP2, applied before fully_shard (the README's order) and after it: each
    # kind of layer measured on its gathered weights, every layer offloaded
    "fsdp2-qwen3-lora-memory-plan": ("fsdp2", "tiny-qwen3", True,
                                     dict(packed_attention="sdpa", memory_budget=16, fused_loss=True), True),
    "fsdp2-qwen3-full-memory-plan-applied-after": ("fsdp2", "tiny-qwen3", False,
                                                   dict(packed_attention="sdpa", memory_budget=16), False),
    # a fixed plan of the choices the solved case below does not reach, offload_saved's hooks and copies included
    "fsdp2-qwen3-lora-plan-every-choice": ("fsdp2", "tiny-qwen3", True,
                                           dict(packed_attention="sdpa", memory_budget=16, fused_loss=True,
                                                plan=("offload_saved", "selective", "checkpoint")), True),
    # a plan solved at step 2 (``solve``: after step 1 each rank's budget is its smallest plan's peak plus
    # a + b * rank kept layers, so alone the ranks would keep different layers): one plan for both ranks, mixed
    "fsdp2-qwen3-lora-plan-solved": ("fsdp2", "tiny-qwen3", True,
                                     dict(packed_attention="sdpa", memory_budget=16, fused_loss=True,
                                          solve=(1.5, 1.0)), True),
}


def _model(preset: str, lora: bool, router_loss: bool = False) -> torch.nn.Module:
    # MoE: LoRA on the experts too, so their gradients (an expert idle on one rank) cross the ranks
    settings = LoraSettings(rank=4, lora_experts=get_preset(preset).is_moe) if lora else None
    model = build_model(preset, device="cpu", dtype=torch.float32, lora=settings, seed=1)
    if router_loss:
        base_model(model).config.output_router_logits = True
    if get_preset(preset).is_moe:
        # one expert of layer 0 gets no token on any rank: the empty group goes through sync_free, DDP and the
        # reduction of the experts' LoRA gradients (its rows stay zero)
        with torch.no_grad():
            router = getattr(decoder_layers(model)[0].mlp, family_of(model).experts.router)   # the record's router
            router.bias[IDLE_EXPERT] = -1e4
    torch.manual_seed(7)
    for n, p in model.named_parameters():      # PEFT starts lora_B at zero: give every adapter a gradient path
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    return model


IDLE_EXPERT = 7


def _tokens_per_expert(model: torch.nn.Module, call) -> list[list[int]]:
    """Per MoE layer, how many (token, slot) routings each expert received during ``call()`` (a pre-hook reads the
    router's top-k indices as the experts module receives them)."""
    from fastsft_lab.moe.modules import experts_modules

    got: list[list[int]] = []

    def hook(module, args, kwargs):
        idx = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and not a.is_floating_point()]
        if idx:
            n = getattr(module, "num_experts", None) or int(idx[0].max()) + 1
            got.append(torch.bincount(idx[0].reshape(-1), minlength=n).tolist())

    hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in experts_modules(model)]
    try:
        call()
    finally:
        for h in hooks:
            h.remove()
    return got


def global_batch(world: int, vocab_size: int) -> PackedBatch:
    """``world`` packed rows of 128 tokens from the short mix (prompts carry no loss: the rows' loss-token counts
    differ)."""
    ex = synthetic_corpus(12 * world, vocab_size=vocab_size, mix="short", max_len=60, seed=11)
    return pack_examples(ex, 128, rows_per_batch=world, drop_last=True)[0]


def _row(batch: PackedBatch, r: int) -> dict:
    return {"input_ids": batch.input_ids[r:r + 1], "labels": batch.labels[r:r + 1],
            "position_ids": batch.position_ids[r:r + 1]}


def _padding_free(batch: PackedBatch, world: int) -> tuple[list[dict], dict]:
    """The sequences of each rank's packed row through TRL's padding-free collator (one flattened row per rank), and
    all of them through it at once (the one-process reference)."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collate = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)
    features: list[list[dict]] = []
    for r in range(world):
        start, rows = 0, []
        for j, n in enumerate(batch.seq_lengths[r]):
            if not (batch.pad_lengths[r] and j == len(batch.seq_lengths[r]) - 1):   # the padding tail is no sequence
                rows.append({"input_ids": batch.input_ids[r, start:start + n].tolist()})
            start += n
        features.append(rows)
    features[-1] = features[-1][:-1]       # the last rank one sequence short: the ranks' token counts differ
    return [collate(f) for f in features], collate([x for f in features for x in f])


def _n_items(labels: torch.Tensor) -> torch.Tensor:
    return (labels[:, 1:] != -100).sum()


def _grads(model: torch.nn.Module) -> dict[str, Any]:
    out = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        g = p.grad
        if g is not None and hasattr(g, "full_tensor"):   # FSDP2: a sharded DTensor
            g = g.full_tensor()
        out[_plain_name(n)] = None if g is None else g.detach().clone()
    return out


def _plain_name(name: str) -> str:
    for prefix in ("module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name.replace("._checkpoint_wrapped_module", "")


def _wrap(model: torch.nn.Module, wrapper: str) -> torch.nn.Module:
    if wrapper == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in decoder_layers(model):
            fully_shard(layer)
        fully_shard(model)
        return model
    raise ValueError(f"unknown wrapper {wrapper!r}; valid: ddp, fsdp2")


def _apply_switches(model: torch.nn.Module, switches: dict) -> None:
    """``fastsft_lab.apply(model, **switches)``; a ``plan`` among them is then fixed with ``set_plan``, every saved
    activation of its offload_saved layers moved (the tiny models' are all under the default size it leaves);
    ``solve`` is :func:`_solve_per_rank`'s."""
    switches = dict(switches)
    switches.pop("solve", None)
    plan = switches.pop("plan", None)
    fastsft_lab.apply(model, **switches)
    if plan is not None:
        from fastsft_lab.offload import plan as P

        P.set_plan(model, plan)
        P.memory_planner(model).saved.min_bytes = 0


def _solve_per_rank(wrapped: torch.nn.Module, model: torch.nn.Module, inputs: dict, spread: tuple) -> None:
    """The memory plan's step 1 (measuring, every layer offloaded) on ``inputs``, gradients dropped; then this
    rank's budget: its smallest plan's predicted peak plus ``a + b * rank`` kept layers' bytes. The next step
    solves the plan -- under FSDP2 one plan for every rank, under the smallest of their budgets."""
    from fastsft_lab.offload import plan as P

    wrapped(**inputs).loss.backward()
    model.zero_grad(set_to_none=True)
    planner = P.memory_planner(model)
    keep = max(c.held["keep"] for c in planner.costs.values())
    planner.budget = int(planner.smallest(planner.tokens) + (spread[0] + spread[1] * dist.get_rank()) * keep)


def _plans_of_ranks(model: torch.nn.Module) -> list | None:
    """Every rank's memory plan (its choices), in rank order; None where the model has no solved plan."""
    from fastsft_lab.offload import plan as P

    planner = P.memory_planner(model)
    mine = list(planner.plan.choices) if planner is not None and planner.plan is not None else None
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return None if mine is None else out


def run_case(name: str) -> dict | None:
    wrapper, preset, lora, switches, before, *rest = CASES[name]
    scope = rest[0] if rest else None
    collator = rest[1] if len(rest) > 1 else None
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(preset, lora, router_loss=scope is not None)
    batch = global_batch(world, model.config.vocab_size)
    if collator == "trl-padding-free":
        per_rank, reference = _padding_free(batch, world)
        mine = per_rank[rank]
    else:
        mine, reference = _row(batch, rank), {"input_ids": batch.input_ids, "labels": batch.labels,
                                              "position_ids": batch.position_ids}
    n_local = _n_items(mine["labels"])
    n_global = n_local.clone()
    dist.all_reduce(n_global)
    counts = [torch.zeros_like(n_local) for _ in range(world)]
    dist.all_gather(counts, n_local)
    if before:
        _apply_switches(model, switches)
    if scope is not None:
        set_router_loss_scope(model, scope)
    wrapped = _wrap(model, wrapper)
    if not before:
        _apply_switches(wrapped, switches)
    if "solve" in switches:
        _solve_per_rank(wrapped, model, {**mine, "num_items_in_batch": n_global}, switches["solve"])
    state = str(fastsft_lab.state(wrapped))
    holder: dict[str, Any] = {}
    per_expert = _tokens_per_expert(model, lambda: holder.setdefault("out", wrapped(**mine, num_items_in_batch=n_global)))
    out = holder["out"]
    (out.loss * world).backward()         # the wrappers average gradients over the ranks
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)                 # the global mean: every rank divided by the global count
    got = _grads(wrapped)
    plans = _plans_of_ranks(model)
    if rank != 0:
        return None
    if "solve" in switches:               # the case tests what it says: a solved plan, mixed, one for every rank
        if plans is None or len(set(plans[0])) < 2:
            raise AssertionError(f"the solved plan does not mix choices: {plans}")
        if wrapper == "fsdp2" and any(p != plans[0] for p in plans):
            raise AssertionError(f"the ranks of a sharded model took different plans: {plans}")
    ref_model = _model(preset, lora, router_loss=scope is not None)     # one process: the stock router loss
    _apply_switches(ref_model, switches)
    ref_out = ref_model(**reference, num_items_in_batch=_n_items(reference["labels"]))
    ref_out.loss.backward()
    ref = _grads(ref_model)
    local_model = _model(preset, lora, router_loss=scope is not None)   # rank 0's own row alone
    _apply_switches(local_model, switches)
    (local_model(**mine, num_items_in_batch=n_global).loss * world).backward()
    local = _grads(local_model)
    diffs, missing, zero = {}, [], []
    for n, g in ref.items():
        if got.get(n) is None:
            missing.append(n)
            continue
        if not got[n].abs().max() > 0:
            zero.append(n)
        diffs[n] = float((got[n] - g).abs().max())
    local_gap = max(float((local[n] - g).abs().max()) for n, g in ref.items() if local.get(n) is not None)
    return {"case": name, "wrapper": wrapper, "router_loss_scope": scope, "collator": collator, "preset": preset, "lora": lora, "switches": switches,
            "applied": "before wrapping" if before else "after wrapping", "state": state, "world_size": world,
            "loss_tokens_per_rank": [int(c) for c in counts], "loss": float(loss), "ref_loss": float(ref_out.loss),
            "loss_diff": abs(float(loss) - float(ref_out.loss)), "n_grads": len(ref), "missing_grads": missing,
            "zero_grads": zero, "max_grad_diff": max(diffs.values()) if diffs else None,
            "worst_grad": max(diffs, key=diffs.__getitem__) if diffs else None,
            "rank0_alone_vs_ref": local_gap, "plans_per_rank": plans,
            # rank 0's (layer, expert) pairs that received no token in its forward
            "idle_experts_rank0": sorted({(i, e) for i, counts in enumerate(per_expert)
                                          for e, c in enumerate(counts) if c == 0})}


def time_steps(preset: str, *, tokens: int, steps: int, warmup: int, layers: int | None = None,
               wrap: bool = True) -> dict | None:
    """Every rank trains its own packed batch of ``tokens`` with all fast under DDP (world 1 too: the same code path
    as several ranks; ``wrap=False``: the plain model, DDP's zero-overhead limit); per step the slowest rank's wall
    time (a barrier closes each step). Rank 0 returns the statistics; the others None."""
    from fastsft_lab.data import benchmark_batches
    from fastsft_lab.profiling import percentiles

    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    preset_ = get_preset(preset)
    model = build_model(preset, device=device, dtype=torch.bfloat16 if cuda else torch.float32, num_layers=layers,
                        quant="nf4" if cuda and preset_.real and not preset_.is_moe else None,
                        lora=LoraSettings(rank=16 if preset_.real else 4))
    fastsft_lab.apply(model, packed_attention="varlen" if cuda else "sdpa", offload_buffers=2, fused_loss=True,
                      **({"moe_routing": "sync_free"} if preset_.is_moe else {}))
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None) if wrap \
        else model
    batches = benchmark_batches(tokens_per_step=tokens * world, row_tokens=tokens, steps=1,
                                vocab_size=model.config.vocab_size, mix="short" if not preset_.real else "realistic")
    from fastsft_lab.packing import packed_inputs

    batch = batches[0]
    mine = PackedBatch(batch.input_ids[rank:rank + 1], batch.labels[rank:rank + 1], batch.position_ids[rank:rank + 1],
                       batch.seq_lengths[rank:rank + 1], batch.pad_lengths[rank:rank + 1]).to(device)
    opt = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-5)
    times, losses = [], []
    for i in range(warmup + steps):
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()
        t0 = time.perf_counter()
        loss = ddp(**packed_inputs(mine)).loss
        loss.backward()
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        dist.barrier()                   # the step ends when the slowest rank's does
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    if rank != 0:
        return None
    return {"world_size": world, "preset": preset, "num_layers": model.config.num_hidden_layers,
            "tokens_per_rank": tokens, "steps": steps, "warmup": warmup, "step_ms": percentiles(times),
            "device": str(device.type), "backend": dist.get_backend(), "ddp": wrap,
            "losses_rank0": [float(x) for x in losses]}       # read after the timed steps: no sync inside them


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="all", help=f"comma-separated, or all: {', '.join(CASES)}")
    ap.add_argument("--out", required=True, help="JSON file rank 0 writes")
    ap.add_argument("--time", metavar="PRESET", default=None,
                    help="instead of the equality cases: time all fast under DDP on PRESET (bench --only distributed)")
    ap.add_argument("--tokens", type=int, default=512, help="with --time: tokens per rank and step")
    ap.add_argument("--layers", type=int, default=None, help="with --time: decoder layers (default: all)")
    ap.add_argument("--steps", type=int, default=6, help="with --time: measured steps")
    ap.add_argument("--warmup", type=int, default=2, help="with --time: warm-up steps")
    ap.add_argument("--no-ddp", action="store_true", help="with --time: the plain model, not wrapped (world 1)")
    args = ap.parse_args(argv)
    if args.time is not None:
        if "RANK" not in os.environ:
            print("run under torchrun (see the module docstring)", file=sys.stderr)
            return 2
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        torch.set_num_threads(1)
        try:
            doc = time_steps(args.time, tokens=args.tokens, steps=args.steps, warmup=args.warmup, layers=args.layers,
                             wrap=not args.no_ddp)
            if doc is not None:
                os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
                with open(args.out, "w") as f:
                    json.dump(doc, f, indent=1)
        finally:
            dist.destroy_process_group()
        return 0
    names = list(CASES) if args.case == "all" else args.case.split(",")
    bad = [n for n in names if n not in CASES]
    if bad:
        print(f"unknown case(s) {', '.join(bad)}; valid: {', '.join(CASES)}", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print("run under torchrun: python -m torch.distributed.run --standalone --nproc_per_node=2 -m "
              "fastsft_lab.lab.distributed ...", file=sys.stderr)
        return 2
    dist.init_process_group("gloo" if not torch.cuda.is_available() else "nccl")
    torch.set_num_threads(1)
    results = []
    try:
        for name in names:
            try:
                r = run_case(name)
            except Exception as e:  # noqa: BLE001 - one failing case is recorded, the others still run
                r = {"case": name, "error": f"{type(e).__name__}: {str(e)[:500]}"} if dist.get_rank() == 0 else None
            if r is not None:
                results.append(r)
            dist.barrier()
    finally:
        if dist.get_rank() == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump({"results": results}, f, indent=1)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # The process group is destroyed and the results written: leave without the interpreter's teardown, where a
    # gloo worker (torch 2.13, CPU) now and then aborts on a thread still joinable ("terminate called without an
    # active exception", SIGABRT after a finished run), which torchrun reports as the whole run failing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
