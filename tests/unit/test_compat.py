"""``fastsft_lab._compat``: every private or version-dependent framework name the package reads is there, each
accessor works on the installed versions (a moved name fails here, by name), and no other file of the package --
the lab included -- reaches into a private torch / transformers / PEFT / ... name.

The rule, over the syntax tree of every file but ``_compat.py``:

* an attribute access ``obj._name`` is ours when the package defines ``_name`` (a function, class, module, argument,
  a module or class variable, or ``self._name = ...``), or when ``obj`` is a module of the standard library
  (``os._exit``); any other is a framework's private name;
* ``getattr`` / ``setattr`` / ``hasattr`` / ``delattr`` with a literal private name, and ``vars(obj)[...]`` /
  ``obj.__dict__[...]`` with one, count as attribute accesses;
* an import of a private framework module or name (``import torch._dynamo``, ``from torch.utils import _pytree``);
* a string naming a private attribute of a framework class a switch touches (``nn.Module``, ``torch.Tensor``,
  transformers' config and model classes, its ``GradientCheckpointingLayer``) -- a name handed around to be looked
  up later (``log.set(layer, "_gradient_checkpointing_func", ...)``).

So that "ours" cannot hide a framework name, no private name the package defines may also be one of those classes'.
"""

from __future__ import annotations

import ast
import pathlib
import re
import sys

import pytest
import torch

from fastsft_lab import _compat as C

PKG = pathlib.Path(__file__).resolve().parents[2] / "fastsft_lab"
FRAMEWORKS = ("torch", "transformers", "peft", "bitsandbytes", "triton", "accelerate", "trl", "xformers",
              "flash_attn", "datasets", "liger_kernel")
_PRIVATE = re.compile(r"^_[A-Za-z0-9]\w*$")


def _private(name: str) -> bool:
    return bool(_PRIVATE.match(name)) and not (name.startswith("__") and name.endswith("__"))


def _framework_private_attributes() -> set[str]:
    """The private attributes of the framework classes a switch touches (their instances' too, where the class sets
    them in ``__init__``)."""
    import transformers
    from transformers.modeling_layers import GradientCheckpointingLayer

    names: set[str] = set()
    config = transformers.Qwen3Config(hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                      num_attention_heads=1, num_key_value_heads=1, head_dim=8, vocab_size=8)
    model = transformers.Qwen3ForCausalLM(config)
    model.gradient_checkpointing_enable()          # what it sets on the layers and the model, too
    for obj in (torch.nn.Module, torch.Tensor, torch.ones(1), transformers.PretrainedConfig, config,
                transformers.PreTrainedModel, GradientCheckpointingLayer, *model.modules()):
        names.update(n for n in dir(obj) if _private(n))
        names.update(n for n in getattr(obj, "__dict__", {}) if _private(n))
    return names


def _defined(trees: dict) -> set[str]:
    """Every private-looking name the package itself defines."""
    names = {p.stem for p in trees}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    for sub in ast.walk(target):
                        if isinstance(sub, ast.Name):
                            names.add(sub.id)
                        elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                                and sub.value.id in ("self", "cls"):
                            names.add(sub.attr)
    return {n for n in names if _private(n)}


def _stdlib_modules(tree: ast.AST) -> set[str]:
    """The names a file binds to a module of the standard library (``import os``, ``import os.path as p``)."""
    bound = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in sys.stdlib_module_names:
                    bound.add(alias.asname or alias.name.split(".")[0])
    return bound


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def private_names_outside_compat(sources: dict[str, str], framework: set[str]) -> list[str]:
    """``path:line: name`` for every framework-private name in ``sources`` (path -> code) under the module's rule;
    ``_compat.py`` is the one file allowed them."""
    trees = {pathlib.Path(path): ast.parse(code) for path, code in sources.items()}
    ours = _defined(trees) - {"_compat"} | {"_compat"}
    found = []
    for path, tree in trees.items():
        if path.name == "_compat.py":
            continue
        stdlib = _stdlib_modules(tree)
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and _private(node.attr):
                if node.attr not in ours and _root(node.value) not in stdlib:
                    name = node.attr
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) > 1 \
                    and node.func.id in ("getattr", "setattr", "hasattr", "delattr"):
                arg = node.args[1]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _private(arg.value) \
                        and arg.value not in ours:
                    name = arg.value
            elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                    and isinstance(node.slice.value, str) and _private(node.slice.value) \
                    and node.slice.value not in ours and (
                        (isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "vars")
                        or (isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__")):
                name = node.slice.value
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in framework:
                name = node.value
            elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FRAMEWORKS \
                    and (any(_private(part) for part in node.module.split("."))
                         or any(_private(alias.name) for alias in node.names)):
                name = node.module
            elif isinstance(node, ast.Import):
                name = next((a.name for a in node.names if a.name.split(".")[0] in FRAMEWORKS
                             and any(_private(part) for part in a.name.split("."))), None)
            if name is not None:
                found.append(f"{path.as_posix()}:{node.lineno}: {name}")
    return sorted(set(found))


@pytest.fixture(scope="module")
def framework_names():
    return _framework_private_attributes()


def _package_sources() -> dict[str, str]:
    return {p.relative_to(PKG.parent).as_posix(): p.read_text() for p in sorted(PKG.rglob("*.py"))}


def test_no_private_framework_name_outside_compat(framework_names):
    found = private_names_outside_compat(_package_sources(), framework_names)
    assert not found, "framework-private names outside fastsft_lab/_compat.py:\n" + "\n".join(found)


def test_no_private_name_of_ours_is_also_a_frameworks(framework_names):
    trees = {pathlib.Path(p): ast.parse(code) for p, code in _package_sources().items()}
    clash = sorted(_defined(trees) & framework_names)
    assert not clash, f"names the package defines that framework classes also have (the guard would miss them): {clash}"


def test_the_guard_would_catch_a_private_name(framework_names):
    caught = {
        "a.py": "import torch\nx = torch._assert_async(c)\n",
        "b.py": "from torch.utils import _pytree\n",
        "c.py": "from transformers.utils.output_capturing import _active_collector\n",
        "d.py": "def f(m):\n    return m._orig_mod\n",
        "e.py": "def f(c):\n    c._attn_implementation = 'x'\n",
        "f.py": "def f(t):\n    return getattr(t, '_version')\n",
        "g.py": "def f(log, layer, fn):\n    log.set(layer, '_gradient_checkpointing_func', fn)\n",
        "h.py": "import torch._dynamo\n",
        "i.py": "def f(m):\n    return vars(m)['_parameters']\n",
    }
    for path, code in caught.items():
        assert private_names_outside_compat({path: code}, framework_names), code
    fine = {
        "a.py": "import torch\nx = torch.nn.functional.pad(y)\n",
        "b.py": "from torch.profiler import profile as _profile\n",
        "c.py": "raise ValueError('torch._foo moved')\n",
        "d.py": "import os\nos._exit(0)\n",
        "e.py": "class A:\n    def __init__(self):\n        self._mine = 1\n    def f(self, o):\n        return o._mine\n",
        "f.py": "from fastsft_lab._compat import checkpoint_function\n",
    }
    for path, code in fine.items():
        assert not private_names_outside_compat({path: code}, framework_names), code


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


def test_the_model_accessors_work_on_this_transformers():
    import transformers
    from transformers.modeling_layers import GradientCheckpointingLayer

    config = transformers.Qwen3Config(hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                                      num_key_value_heads=1, head_dim=8, vocab_size=8, attn_implementation="eager")
    model = transformers.Qwen3ForCausalLM(config)
    assert C.attn_implementation(model.config) == "eager"
    C.set_attn_implementation_of(model.config, "sdpa")
    assert C.attn_implementation(model.config) == "sdpa" and hasattr(model.config, C.ATTN_IMPLEMENTATION)
    assert hasattr(model.config, C.EXPERTS_IMPLEMENTATION)
    layer = model.model.layers[0]
    assert isinstance(layer, GradientCheckpointingLayer) and C.checkpoint_function(layer) is None
    model.gradient_checkpointing_enable()
    assert callable(C.checkpoint_function(layer)), "transformers moved GradientCheckpointingLayer's function"
    assert len(C.require_grads_hooks(model)) == 1, "transformers moved enable_input_require_grads' hooks"
    assert set(C.REQUIRE_GRADS_HOOKS) & set(vars(model))


def test_the_tensor_and_module_accessors_work_on_this_torch():
    t = torch.ones(4)
    v0 = C.tensor_version(t)
    t.add_(1)
    assert C.tensor_version(t) == v0 + 1
    assert C.tensor_is_view(t[1:]) and not C.tensor_is_view(t)
    assert C.ATEN_TO_COPY is torch.ops.aten._to_copy and C.ATEN_LOCAL_SCALAR_DENSE is not None
    assert C.ATEN_UNSAFE_INDEX is not None and C.ATEN_INDEX_PUT_IMPL is not None and C.ATEN_UNIQUE
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu in C.ATEN_MATMUL_AND_ATTENTION
    m = torch.nn.Linear(2, 2)
    assert C.compiled_call(m) is None
    C.set_compiled_call(m, None)
    handle = m.register_forward_hook(lambda *a: None, always_call=True)
    pre, post, always = C.forward_hooks(m)
    assert handle.id in post and handle.id in always and not pre
    C.remove_forward_hook(m, handle.id)
    assert not C.forward_hooks(m)[1] and not C.forward_hooks(m)[2]
    C.empty_host_cache()
