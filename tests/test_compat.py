"""``fastsft_lab._compat``: every private or version-dependent framework name the library reads is there, each
accessor works on the installed versions (a moved name fails here, by name), and no other library file reaches
into a private torch / transformers / PEFT name."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from fastsft_lab import _compat as C

from _source_helpers import code_lines

LIB = pathlib.Path(__file__).resolve().parents[1] / "fastsft_lab"

# torch._x, transformers.y._z, "from torch.utils import _pytree", "from transformers.x import _name"
PRIVATE = re.compile(r"\b(?:torch|transformers|peft|bitsandbytes)(?:\.\w+)*\._[A-Za-z]\w*"
                     r"|^\s*from\s+(?:torch|transformers|peft|bitsandbytes)[\w.]*\s+import\s+[^#\n]*\b_[a-z]\w*"
                     r"|\._experts_implementation_internal\b|\._orig_mod\b")


def _private_in(code: str) -> bool:
    """Whether a line of code reaches into a private framework name (string literals and ``as`` aliases aside)."""
    code = re.sub(r"(\"[^\"]*\"|'[^']*')", "", code)
    code = re.sub(r"\s+as\s+\w+", "", code)
    return bool(PRIVATE.search(code))




def test_no_private_framework_name_outside_compat():
    found = []
    for path in sorted(LIB.rglob("*.py")):
        rel = path.relative_to(LIB.parent).as_posix()
        if rel in ("fastsft_lab/_compat.py",) or rel.startswith("fastsft_lab/lab/"):
            continue
        for i, code in code_lines(path):
            if _private_in(code):
                found.append(f"{rel}:{i}: {code.strip()}")
    assert not found, "private framework names outside fastsft_lab/_compat.py:\n" + "\n".join(found)


def test_the_layout_check_would_catch_a_private_name():
    for bad in ("x = torch._assert_async(c)", "from torch.utils import _pytree",
                "from transformers.utils.output_capturing import _active_collector", "m._orig_mod"):
        assert _private_in(bad), bad
    for fine in ("x = torch.nn.functional.pad(y)", "from torch.profiler import profile as _profile",
                 "raise ValueError('torch._foo moved')"):
        assert not _private_in(fine), fine


def test_every_torch_accessor_works_on_this_torch():
    assert isinstance(C.saved_tensors_hooks_enabled(), bool)
    assert C.checkpoint_valid() is True
    C.assert_async(torch.tensor(True), "holds")
    with pytest.raises(RuntimeError, match="fails here"):
        C.assert_async(torch.tensor(False), "fails here")
    assert C.dispatch_modes() == []
    assert hasattr(C.TorchDispatchMode, "__torch_dispatch__")
    with C.disable_dispatch_modes():
        pass
    assert callable(C.flex_block_transpose()), "torch moved flex_attention._transpose_ordered"
    assert isinstance(C.has_triton(), bool)
    ops = C.flash_attention_ops()
    assert ops is not None, "torch moved aten._flash_attention_forward/backward"
    assert "cum_seq_q" in C.flash_forward_arguments(), "aten._flash_attention_forward's schema changed"
    cfg = C.dynamo_config()
    assert isinstance(cfg.recompile_limit, int) and hasattr(cfg, "fail_on_recompile_limit_hit")
    assert all(isinstance(e, type) and issubclass(e, Exception) for e in C.dynamo_errors())
    assert callable(C.grouped_mm_function()), "no grouped matmul in this torch"
    leaves, spec = C.pytree.tree_flatten(([torch.ones(1)], {"a": 2}))
    assert C.pytree.tree_unflatten(leaves, spec)[1] == {"a": 2}
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            seen.append(C.in_backward())
            return g

    assert C.in_backward() is False
    Probe.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert seen == [True], "torch moved torch._C._current_graph_task_id"


def test_the_bitsandbytes_accessor_works_on_this_bitsandbytes():
    pytest.importorskip("bitsandbytes")
    assert callable(C.bnb_fix_quant_state()), "bitsandbytes moved nn.modules.fix_4bit_weight_quant_state_from_module"


def test_every_transformers_accessor_works_on_this_transformers():
    var = C.output_collector()
    assert var is not None and hasattr(var, "get") and hasattr(var, "set"), \
        "transformers moved utils.output_capturing._active_collector"
    is_packed, prepare = C.flash_packed_helpers()
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    assert bool(is_packed(pos, batch_size=1))
    (cu, _), (max_len, _) = prepare(pos)
    assert cu.tolist() == [0, 3, 5] and int(max_len) == 3

    class Config:
        pass

    cfg = Config()
    C.set_experts_implementation_of(cfg, "grouped_mm")
    assert cfg._experts_implementation_internal == "grouped_mm"


def test_wrapper_accessors():
    m = torch.nn.Linear(2, 2)
    assert C.compiled_inner(torch.compile(m, backend="eager")) is m and C.compiled_inner(m) is None
    assert C.ddp_inner(torch.nn.DataParallel(m)) is m and C.ddp_inner(m) is None
    assert not C.is_zero3_partitioned(m.parameters())
    p = torch.nn.Parameter(torch.ones(1))
    p.ds_id = 3                          # how DeepSpeed ZeRO-3 marks a partitioned parameter
    assert C.is_zero3_partitioned([p])
    assert not C.is_fsdp1(m) and not C.is_fsdp2(m)
