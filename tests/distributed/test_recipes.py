"""The launch recipes run as the README writes them: TRL's SFTTrainer with every switch on and a memory budget, two
processes on the CPU through accelerate (DDP on gloo) and through torchrun, each reading the world size inside the
workers. (accelerate runs FSDP on accelerators only -- on a CPU it launches MULTI_CPU, DDP -- so the FSDP2 recipe's
plan is checked on the CPU by ``fastsft_lab.lab.distributed``'s fsdp2 plan cases, tests/distributed/test_distributed.py.)"""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPES = ROOT / "benchmarks" / "recipes"
pytest.importorskip("trl")


def _run(cmd: list[str], out: pathlib.Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd + [str(RECIPES / "sft.py"), "--max-steps", "2", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sft_recipe_on_two_processes_through_accelerate_and_torchrun(tmp_path):
    # a port of its own: accelerate's default (29500) can still be held by an earlier test's processes
    accel = _run([sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                  str(RECIPES / "accelerate" / "ddp_cpu.yaml"), "--main_process_port", str(_free_port())],
                 tmp_path / "accelerate.json")
    torchrun = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"],
                    tmp_path / "torchrun.json")
    for doc in (accel, torchrun):
        assert doc["world_size"] == 2 and doc["steps"] == 2                   # two ranks, read inside the workers
        assert len(doc["losses"]) == 2 and all(math.isfinite(x) and x > 0 for x in doc["losses"])
        assert "offload_buffers=2" in doc["state"] and "fused_loss=True" in doc["state"]
        # the budget's plan measured at step 1 and solved at step 2 on each rank, and still on after train()
        assert "checkpointing='plan'" in doc["state_after"] and "measuring" not in doc["state_after"]
        assert len(doc["plans"]) == 2 and all(p and len(p) == 3 for p in doc["plans"])
    assert accel["losses"] == torchrun["losses"]        # the same processes and data, whichever launcher


def test_accelerate_configs_name_what_they_launch():
    yaml = pytest.importorskip("yaml")
    cpu = yaml.safe_load((RECIPES / "accelerate" / "ddp_cpu.yaml").read_text())
    assert cpu["distributed_type"] == "MULTI_GPU" and cpu["use_cpu"] is True and cpu["num_processes"] == 2
    fsdp = yaml.safe_load((RECIPES / "accelerate" / "fsdp2.yaml").read_text())
    assert fsdp["distributed_type"] == "FSDP" and fsdp["fsdp_config"]["fsdp_version"] == 2
    assert fsdp["fsdp_config"]["fsdp_activation_checkpointing"] is False      # offload brings its own
    ddp = yaml.safe_load((RECIPES / "accelerate" / "ddp.yaml").read_text())
    assert ddp["distributed_type"] == "MULTI_GPU" and ddp["use_cpu"] is False
