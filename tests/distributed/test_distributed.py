"""Several processes on the CPU (torchrun, gloo): DDP and FSDP2 with every optimization on equal one process on the
same global batch, loss and every trainable gradient (``fastsft_lab.lab.distributed`` runs the cases)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fastsft_lab.lab.distributed import CASES, IDLE_EXPERT

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built")

TOL = 1e-5   # float32, a few thousand terms per sum: the ranks' reduction reorders them


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("dist") / "dist.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "-m", "fastsft_lab.lab.distributed", "--case", "all", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["case"]: r for r in json.loads(out.read_text())["results"]}


@pytest.mark.parametrize("case", list(CASES))
def test_distributed_step_equals_one_process_on_the_global_batch(results, case):
    r = results[case]
    assert "error" not in r, r.get("error")
    # guards: it ran on two ranks that saw different data, and a rank's own gradient is far from the global one
    assert r["world_size"] == 2
    assert len(set(r["loss_tokens_per_rank"])) == 2, r["loss_tokens_per_rank"]
    assert r["rank0_alone_vs_ref"] > 1e-2
    assert r["n_grads"] > 0 and not r["missing_grads"], f"no gradient: {r['missing_grads'][:4]}"
    assert not r["zero_grads"], f"all-zero gradient: {r['zero_grads'][:4]}"
    assert r["loss_diff"] <= TOL * max(1.0, abs(r["ref_loss"]))
    assert r["max_grad_diff"] <= TOL, (r["worst_grad"], r["max_grad_diff"])
    if CASES[case][1] == "tiny-gpt-oss":      # an expert without a token on the rank: the empty group is covered
        assert [0, IDLE_EXPERT] in r["idle_experts_rank0"]


def test_apply_sees_through_ddp_and_refuses_fsdp1_in_one_line():
    import fastsft_lab
    from fastsft_lab.data import benchmark_batches
    from fastsft_lab.models import build_model
    from fastsft_lab.structure import unwrap
    from fastsft_lab.packing import packed_inputs

    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=None, seed=1)
    batch = benchmark_batches(tokens_per_step=256, row_tokens=128, steps=1, vocab_size=256, mix="short")[0]
    ref = model(**batch.model_inputs()).loss
    compiled = torch.compile(model, backend="eager")
    assert unwrap(compiled) is model
    assert compiled(**batch.model_inputs()).logits is not None           # compiled before the switches
    state = fastsft_lab.apply(compiled, packed_attention="sdpa", offload_buffers=2, fused_loss=True)
    assert state == fastsft_lab.state(model) and fastsft_lab.state(model).checkpointing == "offload"
    out = compiled(**packed_inputs(batch))
    assert out.logits is None                                             # the fused loss ran: no logits held
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-6)
    fastsft_lab.revert(compiled)
    assert fastsft_lab.state(model).checkpointing == "none"
    assert compiled(**batch.model_inputs()).logits is not None

    class FakeFSDP1(torch.distributed.fsdp.FullyShardedDataParallel):
        def __init__(self, module):            # no process group needed to be recognised
            torch.nn.Module.__init__(self)
            self._fsdp_wrapped_module = module

    with pytest.raises(ValueError, match="FSDP1 .* not supported: shard with FSDP2's"):
        fastsft_lab.apply(FakeFSDP1(model), packed_attention="sdpa")


def test_offload_refuses_deepspeed_zero3_partitioned_layers_in_one_line():
    """ZeRO-3 partitions parameters as FSDP2 shards them; until that path is tested, offload refuses rather than
    risk the silent gradient loss FSDP2 had."""
    import fastsft_lab
    from fastsft_lab.data import benchmark_batches
    from fastsft_lab.models import build_model
    from fastsft_lab.structure import decoder_layers
    from fastsft_lab.packing import packed_inputs

    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=None, seed=1)
    fastsft_lab.apply(model, offload_buffers=2)
    for p in decoder_layers(model)[1].parameters():
        p.ds_id = 7                                      # what DeepSpeed ZeRO-3 marks a partitioned parameter with
    batch = benchmark_batches(tokens_per_step=256, row_tokens=128, steps=1, vocab_size=256, mix="short")[0]
    with pytest.raises(NotImplementedError, match="DeepSpeed ZeRO-3 is not supported .* fully_shard"):
        model(**packed_inputs(batch)).loss.backward()
    fastsft_lab.revert(model)


def test_bench_distributed_scenario_times_one_process_and_ddp_on_the_cpu(tmp_path):
    """``bench --only distributed`` on a CPU: the plain step, DDP at world 1 through torchrun, DDP at world 2 on gloo,
    each with the world size its workers saw."""
    from fastsft_lab.lab.scenarios import run_scenario

    (result,) = run_scenario("distributed", device="cpu", smoke=True, out_dir=str(tmp_path), steps=2, warmup=1,
                             progress=False)
    rows = {r["name"]: r for r in result["variants"]}
    assert list(rows) == ["one process, no DDP", "DDP, world 1 (torchrun)", "DDP, world 2"]
    assert [rows[n].get("world_size") for n in rows] == [1, 1, 2], [r.get("error") for r in rows.values()]
    assert all(r["step_ms"]["n"] == 2 and r["backend"] == "gloo" for r in rows.values())
    assert set(result["derived"]) == {"ddp_overhead_world_1", "rank_step_overhead_world_2", "same_first_loss_world_1",
                                      "loss_max_rel_diff_world_1"}
    assert result["derived"]["same_first_loss_world_1"] is True
    assert result["derived"]["loss_max_rel_diff_world_1"] == 0.0     # a CPU run is deterministic: bitwise
    assert result["config"]["world_size"] == 2
