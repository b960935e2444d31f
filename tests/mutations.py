"""A curated mutation run: does the test suite catch a wrong change to the core logic?

Each mutation below is a small, plausible bug in one file (an off-by-one in ``cu_seqlens``, a stream wait dropped, the
packer's fit rule reversed, ...). The run applies each one to a temporary copy of the repository, runs the tests
that guard that logic, and calls the mutation *killed* when they fail. It fails unless every mutation is killed.

    python tests/mutations.py            # all of them (about 10 minutes on 2 CPU cores)
    python tests/mutations.py --list     # names only
    python tests/mutations.py --only sdpa-window-off-by-one,packer-worst-fit

Run it before submitting a change to core logic (``make mutants``); CI runs the ordinary suite only. A mutation
whose ``old`` text no longer appears exactly once is an error: the list must follow the code.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str           # relative to the repository root
    old: str | tuple    # one text, or several (each replaced by the matching entry of ``new``)
    new: str | tuple
    tests: tuple        # pytest arguments (files, -k expressions)

    def edits(self) -> list[tuple[str, str]]:
        return list(zip(self.old, self.new)) if isinstance(self.old, tuple) else [(self.old, self.new)]


P = "fastsft_lab/packing/"
O = "fastsft_lab/offload/"
M = "fastsft_lab/moe/"
# the test files by name, wherever their level puts them (tests/unit, integration, distributed, cuda)
_TESTS = {os.path.basename(p): os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tests", "*", "test_*.py"))}


def T(name: str) -> str:
    """``tests/<level>/<name>``."""
    return _TESTS[name]


def TP(subject: str) -> str:
    return T("test_packed_" + subject)


def TO(subject: str) -> str:
    return T("test_offload_" + subject)


TM = (T("test_moe_experts.py"), T("test_moe_models.py"))
TPL = (T("test_plan_solver.py"), T("test_plan_exactness.py"), T("test_plan_switch.py"))
TD = T("test_dequant.py")

MUTATIONS = [
    # --- packed metadata and attention
    Mutation("varlen-max-seqlen-minus-one", P + "backends/varlen.py",
             "return meta.tensors(norm_device(device)).cu_seqlens, meta.max_seqlen",
             "return meta.tensors(norm_device(device)).cu_seqlens, meta.max_seqlen - 1",
             (TP("flex.py"), TP("models.py"), TP("cuda.py"), "-k", "alone")),
    Mutation("segments-window-ignored", P + "backends/segments.py",
             "if sinks is None and (window is None or n <= window):", "if sinks is None:",
             (TP("backends.py"), "-k", "segments")),
    Mutation("naive-varlen-max-seqlen-minus-one", P + "backends/varlen.py",
             "return cu, int(max_len)  # sync 3", "return cu, int(max_len) - 1  # sync 3",
             (TP("flex.py"), TP("models.py"), TP("cuda.py"), "-k", "alone")),
    Mutation("segment-lengths-misassigned", P + "metadata.py",
             "lengths = cu[1:] - cu[:-1]", "lengths = (cu[1:] - cu[:-1]).roll(1)",
             (TP("metadata.py"), TP("flex.py"), TP("switch.py"), TP("models.py"), TP("trl.py"), TP("cuda.py"),
              "-k", "alone or metadata")),
    Mutation("position-ids-from-segment-ends", P + "metadata.py",
             "starts = cu[:-1].to(torch.long)", "starts = (cu[1:] - 1).to(torch.long)",
             (TP("metadata.py"), TP("switch.py"), TP("models.py"), TP("trl.py"), TP("cuda.py"), "-k", "metadata")),
    Mutation("sdpa-window-off-by-one", P + "backends/sdpa.py",
             "causal = causal & (i[:, None] - i[None, :] < window)  # q - W < k",
             "causal = causal & (i[:, None] - i[None, :] <= window)  # q - W < k",
             (TP("flex.py"), TP("models.py"), TP("cuda.py"), "-k", "window or alone")),
    Mutation("varlen-reference-window-off-by-one", P + "backends/varlen.py",
             "allowed = allowed & (i[:, None] - i[None, :] < window)",
             "allowed = allowed & (i[:, None] - i[None, :] <= window)",
             (TP("backends.py"), TP("cuda.py"), "-k", "kernels")),
    Mutation("sdpa-sink-skipped", P + "backends/sdpa.py",
             "    if sinks is None:\n        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask",
             "    if True:\n        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[..., :k.shape[2]]",
             (TP("backends.py"), TP("cuda.py"), "-k", "kernels")),
    Mutation("varlen-sink-skipped", P + "backends/varlen.py",
             "        if sinks is not None:\n            sink = sinks.float()[:, None]",
             "        if False:\n            sink = sinks.float()[:, None]",
             (TP("backends.py"), TP("cuda.py"), "-k", "kernels")),
    Mutation("flex-sink-sign", P + "backends/flex.py",
             "factor = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))",
             "factor = torch.sigmoid(lse.float() + sinks.float().view(1, -1, 1))",
             (TP("backends.py"), TP("cuda.py"), "-k", "kernels")),
    Mutation("flex-full-tiles-include-the-diagonal", P + "backends/flex.py",
             "full = (j < i) & (q_lo_last <= k0)", "full = (j <= i) & (q_lo_last <= k0)",
             (TP("backends.py"), TP("flex.py"), TP("cuda.py"), "-k", "block_tables or kernels")),
    Mutation("naive-mask-not-causal", P + "backends/sdpa.py",
             "        block = block.masked_fill(upper, -math.inf)\n", "",
             (TP("metadata.py"), TP("flex.py"), TP("models.py"), TP("lab.py"), TP("cuda.py"), "-k",
              "alone or naive")),
    Mutation("metadata-check-dropped", P + "switch.py",
             "                check_metadata_matches(meta, pos)\n", "                pass\n",
             (TP("switch.py"), "-k", "another_batch")),
    Mutation("position-ids-check-dropped", P + "switch.py",
             "            check_position_ids(pos.expand(*shape))\n", "            pass\n",
             (TP("switch.py"), "-k", "start_at_zero")),
    Mutation("softcapping-not-refused", P + "switch.py",
             "    if softcap is not None:\n        raise NotImplementedError(f\"{name} uses attention logit",
             "    if False:\n        raise NotImplementedError(f\"{name} uses attention logit",
             (TP("switch.py"), "-k", "softcap")),
    Mutation("generate-through-packed-attention", P + "switch.py",
             "        with original_attention(base):\n            return original(*args, **kwargs)",
             "        return original(*args, **kwargs)", (TP("switch.py"), "-k", "generate")),
    # --- the packer
    Mutation("packer-worst-fit", "fastsft_lab/data.py",
             "        k = bisect.bisect_left(free, (n, -1))\n        if k < len(free):",
             "        k = len(free) - 1\n        if free and free[k][0] >= n:", (T("test_data.py"),)),
    Mutation("first-label-of-a-sequence-kept", "fastsft_lab/data.py",
             "            r_lab.append(IGNORE_INDEX)\n            r_lab.extend(ex.labels[1:])",
             "            r_lab.extend(ex.labels)", (T("test_data.py"),)),
    # --- offloaded checkpointing
    Mutation("copy-does-not-wait-for-a-free-slot", O + "manager.py",
             "        ops.wait_event(\"copy\", (\"free\", slot))          # the previous user of the slot is done",
             "        pass  # the previous user of the slot is done", (TO("streams.py"), "-k", "stream_order")),
    Mutation("ready-event-not-recorded", O + "manager.py",
             "        ops.record((\"ready\", slot), \"copy\")\n", "", (TO("streams.py"), "-k", "stream_order")),
    Mutation("input-not-protected-by-record-stream", O + "manager.py",
             "            ops.record_stream(src, inp, stream)\n", "            pass\n",
             (TO("streams.py"), "-k", "stream_order")),
    Mutation("prefetch-off", O + "manager.py",
             "        if self.prefetch and policy.can_prefetch():", "        if False:",
             (TO("streams.py"), TO("memory.py"), TO("models.py"), TO("cuda.py"), "-k", "prefetch")),
    Mutation("every-input-in-slot-zero", O + "policy.py",
             "        return self.slots[seq % len(self.slots)]", "        return self.slots[0]",
             (TO("streams.py"), TO("memory.py"), TO("models.py"), TO("cuda.py"), "-k", "prefetch or stream_order")),
    Mutation("pool-slot-never-released", O + "manager.py",
             "        entry.release()   # the pool slot may be refilled", "        pass   # the pool slot may be refilled",
             (TO("memory.py"), "-k", "pool or registry or dropped or reloaded")),
    Mutation("rng-not-replayed", O + "checkpoint.py",
             "            torch.set_rng_state(call.cpu_rng)\n", "            pass\n",
             (TO("models.py"), "-k", "dropout")),
    Mutation("autocast-not-replayed", O + "checkpoint.py",
             "torch.enable_grad(), dev_ctx, torch.autocast(\"cpu\", **cpu_autocast), side_ctx as inner:",
             "torch.enable_grad(), dev_ctx, side_ctx as inner:", (TO("models.py"), "-k", "autocast")),
    Mutation("parameter-gradients-dropped", O + "checkpoint.py",
             "    return leaf_grads, [grads.get(id(p)) if need else None for p, need in zip(params, need_params)]",
             "    return leaf_grads, [None for p in params]", (TO("models.py"), "-k", "gradients_equal or selective")),
    # --- MoE routing
    Mutation("searchsorted-left", M + "grouping.py",
             "ends = torch.searchsorted(sorted_ids, experts, right=True, out_int32=int32)",
             "ends = torch.searchsorted(sorted_ids, experts, right=False, out_int32=int32)", TM),
    Mutation("combine-wrong-permutation", M + "grouping.py",
             "y = _RowGather.apply(y_sorted, inv, perm, 1).view(num_tokens, k, -1)",
             "y = _RowGather.apply(y_sorted, perm, inv, 1).view(num_tokens, k, -1)", TM),
    Mutation("fused-combine-wrong-token", M + "kernels.py",
             "        t = p // K\n", "        t = p % K\n", (*TM, "-k", "interpreted")),
    Mutation("fused-combine-weights-dropped", M + "kernels.py",
             "            tile = tile * w[:, None]", "            tile = tile", (*TM, "-k", "interpreted")),
    Mutation("fused-glu-bias-of-the-wrong-column", M + "gate.py",
             "x += tl.load(b_ptr + e[:, None] * (2 * I) + cols[None, :], mask=mask",
             "x += tl.load(b_ptr + e[:, None] * (2 * I) + cols[None, :] // 2 * 2, mask=mask",  # up gets gate's bias
             (*TM, "-k", "interpreted")),
    Mutation("fused-swiglu-up-not-offset", M + "gate.py",
             "        out = g / (1.0 + tl.exp(-g)) * u",
             "        out = g / (1.0 + tl.exp(-g)) * g", (*TM, "-k", "interpreted")),
    Mutation("down-bias-not-added", M + "experts.py",
             "        out = torch.addmm(out, dense.to(out.dtype), self.down_proj_bias.to(out.dtype))",
             "        out = out", TM),
    Mutation("gate-up-unclamped-below", M + "gate.py",
             "up = gate_up[..., 1::2].clamp(min=-limit, max=limit)", "up = gate_up[..., 1::2].clamp(max=limit)",
             TM),
    Mutation("dense-routing-weights-not-gathered", M + "modules.py",
             "        return routing_weights.gather(1, top_k_index)\n", "        return routing_weights\n",
             (*TM, "-k", "dense")),
    Mutation("record-window-of-every-layer-dropped", "fastsft_lab/families.py",
             "return [window if self.attention.windows == \"every_layer\" else None] * layers",
             "return [None] * layers", (T("test_families.py"), "-k", "live_model")),
    Mutation("nf4-scale-off", M + "nf4.py",
             "return QuantState(absmax=absmax, shape=", "return QuantState(absmax=absmax * 1.01, shape=",
             (*TM, "-k", "nf4")),
    Mutation("router-loss-counts-the-padding", P + "switch.py",
             "        kwargs[\"attention_mask\"] = meta.real_tokens_mask(ref.device)\n        return args, kwargs",
             "        return None", (TP("models.py"), "-k", "aux_loss")),
    Mutation("fused-loss-not-shifted", "fastsft_lab/loss.py",
             "shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].reshape(-1)",
             "shift = labels.reshape(-1)", (T("test_loss.py"),)),
    Mutation("fused-ce-ignored-rows-keep-a-gradient", "fastsft_lab/loss.py",
             "                grad = grad * valid\n", "", (T("test_loss.py"), "-k", "interpreted")),
    Mutation("fused-lora-unscaled", "fastsft_lab/lora.py",
             "out2d.addmm_(xa, b.t(), alpha=self.scaling[name])", "out2d.addmm_(xa, b.t())",
             (T("test_lora.py"),)),
    Mutation("fused-lora-dropout-skipped", "fastsft_lab/lora.py",
             "xd = self.lora_dropout[name](x).to(dtype)", "xd = x.to(dtype)", (T("test_lora.py"),)),
    Mutation("packed-attention-traced-by-compile", "fastsft_lab/packing/registry.py",
             "AttentionInterface.register(backend.attn_name, torch.compiler.disable(attention))",
             "AttentionInterface.register(backend.attn_name, attention)", (T("test_compiled_layers.py"),)),
    Mutation("grouped-mm-traced-in-float32", "fastsft_lab/moe/matmul.py",
             "if torch.compiler.is_compiling() and (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16):",
             "if False:", (T("test_compiled_layers.py"), "-k", "gpt")),
    Mutation("packed-metadata-a-frozen-dataclass", P + "metadata.py",
             ("@dataclass(init=False, eq=False, repr=False)\nclass PackedMetadata:",
              "    def __setattr__(self, name: str, value: Any) -> None:\n",
              "    def __delattr__(self, name: str) -> None:\n"),
             ("@dataclass(init=False, eq=False, repr=False, frozen=True)\nclass PackedMetadata:",
              "    def _unused_setattr(self, name: str, value: Any) -> None:\n",
              "    def _unused_delattr(self, name: str) -> None:\n"),
             (T("test_compiled_layers.py"), "-k", "plain_object")),
    # --- several processes, wrappers, padding-free collators, the training check
    Mutation("offload-keeps-fsdp2-sharded-params", O + "checkpoint.py",
             "params = None if module is None or is_fsdp2(module) else",
             "params = None if module is None else", (T("test_distributed.py"), "-k", "fsdp2")),
    Mutation("fused-loss-normalised-by-local-token-count", "fastsft_lab/loss.py",
             'num_items = kwargs.pop("num_items_in_batch", None)',
             'num_items = kwargs.pop("num_items_in_batch", None) and None', (T("test_distributed.py"),)),
    Mutation("ddp-not-seen-through", "fastsft_lab/structure.py",
             "nxt = ddp_inner(inner) or compiled_inner(inner)", "nxt = compiled_inner(inner)",
             (T("test_distributed.py"), "-k", "ddp")),
    Mutation("seq-idx-check-any", P + "switch.py",
             "assert_async((new_seq == (position_ids == 0)).all(),",
             "assert_async((new_seq == (position_ids == 0)).any(),", (T("test_padding_free.py"),)),
    Mutation("timeline-counts-a-device-assert-as-a-wait", "fastsft_lab/profiling.py",
             'if device.type == "cpu" and evt.name == "aten::_assert_async":',
             'if device.type == "cpu" and evt.name == "aten::_assert_async" and False:',
             (T("test_profiling.py"), "-k", "timeline")),
    Mutation("training-check-tolerance-10x", "fastsft_lab/lab/convergence.py",
             "return 2 * reduction_length * torch.finfo(dtype).eps / 2",
             "return 20 * reduction_length * torch.finfo(dtype).eps / 2", (T("test_training.py"), "-k", "bound")),
    Mutation("pool-host-memory-check-off", O + "pool.py",
             "if avail is not None and size + HOST_RESERVE_BYTES > avail:",
             "if False:", (TO("memory.py"), "-k", "host_memory")),
    Mutation("restore-log-skips-an-undo", "fastsft_lab/restore.py",
             "        for e in reversed(mine):\n            _UNDO[e.kind](e)",
             "        for e in reversed(mine[1:]):\n            _UNDO[e.kind](e)",
             (T("test_restore.py"), "-k", "property")),
    Mutation("fused-loss-off-does-nothing", "fastsft_lab/restore.py",
             "    def disable(self, model: nn.Module) -> None:\n        undo(model, self.name)\n",
             "    def disable(self, model: nn.Module) -> None:\n        if self.name != \"fused_loss\":\n"
             "            undo(model, self.name)\n",
             (T("test_toggles.py"), "-k", "every_switch")),
    Mutation("router-loss-averaged-per-rank", "fastsft_lab/loss.py",
             "        dist.all_reduce(counts, group=group)          # global assignments and routed tokens (no gradient)",
             "        pass", (T("test_distributed.py"), "-k", "router")),
    Mutation("moe-bias-one-hot-off-by-one", M + "experts.py",
             "one_hot = (sorted_ids.unsqueeze(1) == experts).to(gate_up.dtype)",
             "one_hot = (sorted_ids.unsqueeze(1) == (experts + 1) % num_experts).to(gate_up.dtype)", TM),
    Mutation("offload-reloaded-bytes-not-counted", O + "manager.py",
             "self.stats.bytes_reloaded += entry.nbytes", "self.stats.bytes_reloaded += 0",
             (T("test_bench.py"), "-k", "bytes")),
    Mutation("equality-check-always-bitwise", "fastsft_lab/lab/harness.py",
             "bitwise = torch.equal(loss, loss0) and all(", "bitwise = True or all(",
             (T("test_bench.py"), "-k", "same_weights")),
    # --- the checkpointing plan for a memory budget
    Mutation("plan-saves-outputs-changed-in-place", O + "plan.py",
             "unsaved = frozenset(op for _, op, t, version in records\n"
             "                        if tensor_version(t) != version or t.untyped_storage().data_ptr() in count.written)",
             "unsaved = frozenset()", (*TPL, "-k", "every_choice or compose")),
    Mutation("plan-keep-layer-recomputed", O + "plan.py",
             '        if choice == "keep":\n            return function(*args)',
             '        if choice == "keep":\n            return full_checkpoint(function, *args)', (*TPL, "-k", "names")),
    Mutation("plan-budget-check-off-by-one", O + "solver.py",
             "for w, s, c, over in options if b + w <= total", "for w, s, c, over in options if b + w < total",
             (*TPL, "-k", "solver")),
    Mutation("plan-backward-room-unchecked", O + "solver.py", "for b, t, cs in front if b <= room\n",
             "for b, t, cs in front\n", (*TPL, "-k", "solver")),
    Mutation("plan-layer-charged-beside-itself", O + "solver.py",
             "        most = max(most, held + own(cost, choice))\n        held += cost.held[choice]\n",
             "        held += cost.held[choice]\n        most = max(most, held + own(cost, choice))\n",
             (*TPL, "-k", "solver")),
    Mutation("plan-forward-room-unchecked", O + "solver.py", "if b + w <= total and b + over <= 0)",
             "if b + w <= total)", (*TPL, "-k", "solver")),
    Mutation("plan-forward-of-another-choice", O + "solver.py", "lambda cost, choice: cost.forward[choice])",
             'lambda cost, choice: cost.forward["offload"])', (*TPL, "-k", "solver")),
    Mutation("plan-forward-peak-lost-without-the-loss", O + "plan.py",
             "self.peak if self.loss_peak is not None else max(self.peak, self.forward_peak or 0)", "self.peak",
             (*TPL, "-k", "by_phase")),
    Mutation("plan-loss-phase-unpredicted", O + "solver.py", "    peak = int(max(loss, backward, forward) -",
             "    peak = int(max(backward, forward) -", (*TPL, "-k", "ranked")),
    Mutation("plan-last-layer-uncharged", O + "solver.py",
             "options = [(cost.held[c], cost.seconds[c], c,",
             "options = [(cost.held[c] if cost is not costs[-1] else 0, cost.seconds[c], c,",
             (*TPL, "-k", "solver")),
    Mutation("plan-choices-timed-one-after-another", O + "plan.py",
             "    for _ in range(repeats):\n        for name, fn in fns.items():\n",
             "    for name, fn in fns.items():\n        for _ in range(repeats):\n", (*TPL, "-k", "drift")),
    Mutation("plan-counts-resident-weights", O + "plan.py",
             "exclude = storage_ptrs([*params, *resident])",
             "exclude = storage_ptrs(params)", (*TPL, "-k", "frozen")),
    Mutation("plan-budget-share-leaves-out-the-model", O + "allocator.py",
             "return held + int(free * share / 100)", "return int(free * share / 100)", (*TPL, "-k", "on_top")),
    Mutation("stock-leak-record-wrong", "fastsft_lab/families.py",
             'stock="eager", stock_packs=False)', 'stock="eager")', (T("test_packed_models.py"), "-k", "family_record")),
    Mutation("stock-leak-unmarked", "fastsft_lab/lab/scenarios/combined.py",
             "    if not leak:\n        return variants", "    return variants",
             (T("test_bench.py"), "-k", "stock_row")),
    Mutation("plan-never-replans", O + "plan.py",
             "if self.plan is None or target > self.plan.tokens:", "if self.plan is None:", (*TPL, "-k", "replans")),
    Mutation("plan-selective-recomputes-nf4-matmuls", O + "plan.py",
             '_SAVED_CUSTOM_OPS = (("bitsandbytes", "gemm_4bit"),)', "_SAVED_CUSTOM_OPS = ()", (*TPL, "-k", "nf4")),
    Mutation("plan-ignores-the-allocator-ceiling", O + "plan.py",
             "return self.budget if self.ceiling is None else min(self.budget, self.ceiling)",
             "return self.budget", (*TPL, "-k", "ceiling")),
    Mutation("plan-measurement-saves-outputs-as-themselves", O + "plan.py",
             "            self.saved[st.data_ptr()] = st.nbytes()\n        # detached", "            self.saved[st.data_ptr()] = st.nbytes()\n        return t\n        # detached",
             (*TPL, "-k", "nothing_of")),
    Mutation("plan-measurement-keeps-its-op-records", O + "plan.py", "    count.selective.clear()\n", "",
             (*TPL, "-k", "nothing_of")),
    Mutation("saved-kept-tensor-holds-its-graph", O + "saved.py",
             "            self.stats.kept += 1\n", "            self.stats.kept += 1\n            return t\n",
             (T("test_offload_saved.py"), "-k", "forward_without")),
    Mutation("saved-sources-hold-the-graph", O + "saved.py", "group.sources.append(t.detach())",
             "group.sources.append(t)", (T("test_offload_saved.py"), "-k", "forward_without")),
    Mutation("plan-search-misses-the-first-reload", O + "solver.py",
             "    timed = _with_first_reload(costs)\n    at_loss, most, forward_off = _smallest(costs)\n    loss_base",
             "    timed = list(costs)\n    at_loss, most, forward_off = _smallest(costs)\n    loss_base",
             (*TPL, "-k", "ranked")),
    Mutation("frontier-sets-the-peer-against-searched-plans", "fastsft_lab/lab/results.py",
             'plans = [r for r in rows if r["budget"] is not None and r["ms"] and r["peak"]]',
             'plans = [r for r in rows if (r["budget"] is not None or r["searched"]) and r["ms"] and r["peak"]]',
             (T("test_results.py"), "-k", "peer_at_its_memory")),
    Mutation("dequant-kept-weight-not-cast-to-the-gradient", "fastsft_lab/dequant.py",
             "w = kept[1].to(grad.dtype)", "w = kept[1]", (T("test_dequant.py"), "-k", "autocast")),
    Mutation("fused-loss-ignores-logit-transforms", "fastsft_lab/loss.py",
             "        if value is not None and value != unchanged:", "        if False:",
             (T("test_toggles.py"), "-k", "logits")),
    Mutation("packed-attention-on-a-non-causal-lm", P + "switch.py",
             'if not callable(getattr(base_model(model), "generate", None)):', "if False:",
             (T("test_toggles.py"), "-k", "causal_lm")),
    Mutation("state-ignores-replaced-checkpointing", O + "switch.py",
             "        if self.displaced():\n            return {}", "        if False:\n            return {}",
             (T("test_offload_switch.py"), "-k", "replaced")),
    Mutation("plan-host-check-ignores-pinned-blocks", O + "plan.py",
             "sum(c.pinned for c in costs) > host // 2", 'sum(c.held["keep"] for c in costs) > host // 2',
             (T("test_offload_saved.py"), "-k", "host")),
    Mutation("plan-last-layer-reload-hidden", O + "solver.py",
             "if last is None or not last.first_reload or", "if True or",
             (T("test_offload_saved.py"), "-k", "first")),
    Mutation("plan-trusts-a-noisy-keep-reading", O + "plan.py",
             '    seconds["keep"] = min(seconds.values())\n', "", (*TPL, "-k", "noisy")),
    Mutation("free-memory-ignores-the-allocator-cache", O + "allocator.py",
             "return total, free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)",
             "return total, free", (*TPL, "-k", "free_gpu")),
    Mutation("plan-pinned-reading-unrounded", O + "plan.py",
             'readings["pinned"] = sum(pow2_ceil(b) for b in small_saved', 'readings["pinned"] = sum(b for b in small_saved',
             (T("test_offload_saved.py"), "-k", "pinned")),
    Mutation("saved-views-not-held", O + "saved.py", "            group.sources.append(t.detach())", "            pass",
             (*TPL, "-k", "every_choice")),
    Mutation("saved-no-prefetch", O + "saved.py", "            if self.prefetch:\n                prev =",
             "            if False:\n                prev =", (T("test_offload_saved.py"), "-k", "buffers")),
    Mutation("saved-stores-unbounded", O + "saved.py", "self._release_stores(keep=(2 if self.prefetch else 1) - 1)",
             "pass", (T("test_offload_saved.py"), "-k", "buffers")),
    Mutation("saved-activation-let-go-before-its-copy", O + "saved.py",
             '            self.ops.wait_event("compute", ("saved-stored", seq))\n', "",
             (T("test_offload_saved.py"), "-k", "stream_order")),
    Mutation("saved-stores-held-through-the-backward", O + "saved.py",
             "        if self._storing:                   # the backward has begun: every store is let go\n"
             "            self._release_stores(keep=0)\n", "",
             (T("test_offload_saved.py"), "-k", "buffers")),
    Mutation("plan-prefetched-activations-uncharged", O + "solver.py",
             " - (saved_extra if saves else 0)", "", (*TPL, "-k", "solver", T("test_offload_saved.py"), "-k",
                                                      "solver")),
    # --- the plan on several ranks, whatever ran before, in a Trainer
    Mutation("plan-ranks-take-rank-zeros-costs", O + "ranks.py",
             "return {k: max(getattr(c, attr)[k] for c in costs) for k in sorted(keys)}",
             "return {k: getattr(costs[0], attr)[k] for k in sorted(keys)}",
             (T("test_plan_fsdp2.py"), "-k", "combine")),
    Mutation("plan-ranks-base-not-rebased", O + "ranks.py",
             'base = max(p["base"] - s[1] for p, s in zip(problems, smallest)) + most',
             'base = max(p["base"] for p in problems)', (T("test_plan_fsdp2.py"), "-k", "combine")),
    Mutation("plan-ranks-largest-budget", O + "ranks.py", "return combined, min(budgets)",
             "return combined, max(budgets)", (T("test_plan_fsdp2.py"), "-k", "combine")),
    Mutation("plan-ranks-each-alone", O + "plan.py", "self.ranks = ranks_of(layers)", "self.ranks = None",
             (T("test_distributed.py"), "-k", "plan")),
    Mutation("plan-fsdp2-measures-sharded-layers", O + "plan.py",
             "_private_collector(), unsharded(layer):", "_private_collector(), unsharded(None):",
             (T("test_plan_fsdp2.py"), "-k", "sharded")),
    Mutation("plan-step-one-keeps-the-cache", O + "plan.py",
             "                release_cached_blocks(self.device)   # step 1's slack",
             "                # step 1's slack",
             (T("test_plan_allocator.py"),)),
    Mutation("allocator-release-keeps-the-peaks", O + "allocator.py",
             "    cuda.empty_cache()\n    cuda.reset_peak_memory_stats(device)\n", "    cuda.empty_cache()\n",
             (T("test_plan_allocator.py"),)),
    Mutation("guard-not-set", O + "switch.py", "    guard(log, model)           # the Trainer's",
             "    # the Trainer's", (T("test_plan_trainer.py"),)),
    Mutation("guard-not-taken-off", O + "guard.py",
             "        log.set(base, name, functools.partial(_kept, ref, name, warned))",
             "        vars(base)[name] = functools.partial(_kept, ref, name, warned)",
             (T("test_plan_trainer.py"), "-k", "methods")),
    Mutation("real-tokens-count-the-padding", "fastsft_lab/callbacks.py",
             "return int(meta.cu_seqlens[-1]) - sum(meta.pad_lengths or ())", "return int(meta.cu_seqlens[-1])",
             (T("test_plan_trainer.py"),)),
    Mutation("plan-misses-writes-through-an-alias", O + "plan.py",
             "if tensor_version(t) != version or t.untyped_storage().data_ptr() in count.written)",
             "if tensor_version(t) != version)", (T("test_plan_fused_lora.py"),)),
    Mutation("mfu-counts-frozen-weight-gradients", "fastsft_lab/lab/flops.py",
             "    base = (4 if frozen_base else 6) * n * tokens", "    base = 6 * n * tokens",
             (T("test_flops_model.py"),)),
    # --- diagnose: what bounds a kernel, the step's busy time, the recompute
    Mutation("roofline-long-kernels-called-latency", "fastsft_lab/roofline.py",
             'return "latency" if seconds / max(kernels, 1) < LATENCY_MAX_S else "unknown"', 'return "latency"',
             (T("test_diagnose_rules.py"), "-k", "big_matmul")),
    Mutation("diagnose-eager-attention-counted-as-its-core-ops", "fastsft_lab/diagnosis.py",
             "    quadratic: Callable[[Kernel], bool] = ((lambda k: _short(k.op) in _ATTENTION_CORE) if fused",
             "    quadratic: Callable[[Kernel], bool] = ((lambda k: _short(k.op) in _ATTENTION_CORE) if True",
             (T("test_diagnose.py"), "-k", "score_kernel")),
    Mutation("diagnose-step-time-the-upper-median", "fastsft_lab/diagnosis.py",
             "    step_ms = statistics.median(s.times_ms)", "    step_ms = sorted(s.times_ms)[len(s.times_ms) // 2]",
             (T("test_diagnose.py"), "-k", "times_its_steps")),
    Mutation("predict-eager-attention-as-cross-pairs", "fastsft_lab/predict.py",
             "    if skips and not c.attention_fused:", "    if False:",
             (T("test_diagnose_rules.py"), "-k", "eager_attention")),
    Mutation("roofline-latency-threshold-inverted", "fastsft_lab/roofline.py",
             "if max(t_compute, t_memory) < LATENCY_FRACTION * seconds:",
             "if max(t_compute, t_memory) > LATENCY_FRACTION * seconds:",
             (T("test_diagnose_rules.py"), "-k", "big_matmul or ridge or together")),
    Mutation("busy-union-counts-overlaps-twice", "fastsft_lab/step_profile.py",
             "            total += e - end", "            total += e - s",
             (T("test_diagnose_rules.py"), "-k", "busy or gap")),
    Mutation("recompute-taken-for-forward", "fastsft_lab/step_profile.py",
             'phase = "forward" if above.phase == "forward" else "recompute"', "phase = above.phase",
             (T("test_diagnose_rules.py"), T("test_diagnose.py"), "-k", "recompute")),
    # --- fused NF4 dequantisation
    Mutation("dequant-bf16-truncated", "fastsft_lab/dequant.py",
             "values = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)",
             "values = (bits >> 16).to(tl.int16)", (TD, "-k", "definition")),
    Mutation("dequant-nibbles-swapped", "fastsft_lab/dequant.py",
             "tl.join(hi, lo)", "tl.join(lo, hi)", (TD, "-k", "definition")),
    Mutation("dequant-keeps-another-dtype", "fastsft_lab/dequant.py",
             "if x.dtype == quant_state.dtype and in_backward():", "if in_backward():", (TD, "-k", "keeps")),
    Mutation("dequant-kept-weight-unused", "fastsft_lab/dequant.py",
             "if kept is not None and kept[0] is codes:", "if False:", (TD, "-k", "plan_choice")),
    # --- the lab's views of the chain (issue 41)
    Mutation("routing-forced-index-ignored", "fastsft_lab/lab/routing.py",
             "return logits, routing_weights_at(module, logits.reshape(-1, logits.shape[-1]), forced), forced",
             "return out", (T("test_routing_agreement.py"), "-k", "planted or bf16")),
    Mutation("routing-flips-count-slot-order", "fastsft_lab/lab/routing.py",
             "return int((a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1).sum())",
             "return int((a != b).any(dim=-1).sum())", (T("test_routing_agreement.py"),)),
    Mutation("reading-time-rounded-down", "fastsft_lab/lab/reading.py",
             "return math.ceil((p[\"prose\"] + p[\"code\"] + p[\"outputs\"]) / WORDS_PER_MIN + p[\"charts\"])",
             "return math.floor((p[\"prose\"] + p[\"code\"] + p[\"outputs\"]) / WORDS_PER_MIN + p[\"charts\"])",
             (T("test_notebook_reading.py"), "-k", "measure")),
    Mutation("chain-keeps-grouped-once", "fastsft_lab/lab/results.py",
             "return [n for n in doc[\"config\"][\"chain\"] if n not in NOT_IN_CHAIN]",
             "return list(doc[\"config\"][\"chain\"])", (T("test_results.py"), "-k", "attribution")),
    Mutation("host-events-duplicate-nodes-kept", "fastsft_lab/profile_events.py",
             "if id(e) in gone or parent is None or parent.name != e.name or len(parent.cpu_children) != 1:",
             "if True:", (T("test_host_events.py"),)),
    Mutation("removes-labelled-by-the-largest-part", "fastsft_lab/lab/removes.py",
             "kind = min(kinds, key=lambda k: kinds[k]) if faster else",
             "kind = max(kinds, key=lambda k: sum(a[p] for p in KINDS[k])) if faster else",
             (T("test_attribution_removes.py"), "-k", "fell_most")),
    Mutation("removes-against-the-first-step", "fastsft_lab/lab/removes.py",
             'out[r["name"]] = removed(prev["profile"], r["profile"])',
             'out[r["name"]] = removed(rows[0].get("profile", prev["profile"]), r["profile"])',
             (T("test_attribution_removes.py"), "-k", "step_before")),
]


def _apply(root: str, m: Mutation) -> None:
    path = os.path.join(root, m.path)
    with open(path) as f:
        text = f.read()
    for old, new in m.edits():
        count = text.count(old)
        if count != 1:
            raise SystemExit(f"mutation {m.name}: its text occurs {count} times in {m.path} (expected once): update "
                             "tests/mutations.py to follow the code")
        text = text.replace(old, new)
    with open(path, "w") as f:
        f.write(text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="comma-separated mutation names")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args(argv)
    todo = MUTATIONS
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {m.name for m in MUTATIONS}
        if unknown:
            raise SystemExit(f"unknown mutation(s) {sorted(unknown)}; known: {', '.join(m.name for m in MUTATIONS)}")
        todo = [m for m in MUTATIONS if m.name in names]
    if args.list:
        for m in todo:
            print(f"{m.name:42s} {m.path}")
        return 0
    work = tempfile.mkdtemp(prefix="fastsft-mutants-")
    try:
        for sub in ("fastsft_lab", "tests"):
            shutil.copytree(os.path.join(ROOT, sub), os.path.join(work, sub),
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "data"))
        for m in todo:                               # every mutation's text must be there before anything runs
            with open(os.path.join(work, m.path)) as f:
                text = f.read()
                if any(text.count(old) != 1 for old, _ in m.edits()):
                    _apply(work, m)                  # raises with the explanation
        env = dict(os.environ, PYTHONPATH=work, SMOKE="1", MPLBACKEND="Agg")
        rows, t0 = [], time.time()
        for m in todo:
            original = open(os.path.join(work, m.path)).read()
            _apply(work, m)
            t = time.time()
            run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
                                 cwd=work, env=env, capture_output=True, text=True)
            with open(os.path.join(work, m.path), "w") as f:
                f.write(original)
            last = [line for line in run.stdout.strip().splitlines() if line.strip()][-1:] or [""]
            killed = run.returncode not in (0, 5)
            rows.append((m, killed, time.time() - t, last[0]))
            print(f"{'killed  ' if killed else 'SURVIVED'} {m.name:42s} {time.time() - t:5.1f}s  {last[0][:70]}",
                  flush=True)
        killed = sum(1 for _, k, _, _ in rows if k)
        print(f"\n{killed}/{len(rows)} mutations killed ({killed / len(rows):.0%}) in {time.time() - t0:.0f} s")
        survived = [m.name for m, k, _, _ in rows if not k]
        if survived:
            print("survived: " + ", ".join(survived))
        return 0 if not survived else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
