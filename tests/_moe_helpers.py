"""Shared by the MoE tests: a standalone experts module per family, random routings, one implementation's outputs and
gradients, and the comparison with transformers' eager experts."""

from __future__ import annotations

import math

import torch

from fastsft_lab.families import FAMILIES, get_family
from fastsft_lab.models import PRESETS
from fastsft_lab.moe import MODES, set_moe_routing

ATTN_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_IMPLS = ("eager",) + MODES + ("grouped_mm",)
MOE_FAMILIES = [f.name for f in FAMILIES.values() if f.is_moe]                        # gpt_oss, qwen3_moe, mixtral
TINY_MOE_PRESETS = [p.name for p in PRESETS.values() if p.is_moe and not p.real]     # one tiny preset per family
# the config names of each MoE family's expert width and expert count (transformers 5.17)
EXPERT_SIZE_KEYS = {"gpt_oss": ("intermediate_size", "num_local_experts"),
                    "qwen3_moe": ("moe_intermediate_size", "num_experts"),
                    "mixtral": ("intermediate_size", "num_local_experts")}


def make_experts(family: str, *, hidden: int = 16, inter: int = 8, experts: int = 6, top_k: int = 2,
                 dtype=torch.float32, device="cpu", seed: int = 0):
    """A standalone experts module of ``family`` (its record names the config and experts classes) with random
    weights large enough to hit GPT-OSS's clamps (limit 7)."""
    import importlib

    torch.manual_seed(seed)
    fam = get_family(family)
    width_key, count_key = EXPERT_SIZE_KEYS[family]
    cfg = fam.config_type()(hidden_size=hidden, num_experts_per_tok=top_k, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=8, **{width_key: inter, count_key: experts})
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    module = getattr(modeling, fam.experts.class_name)(cfg)
    module = module.to(device=device, dtype=dtype)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.normal_(0.0, 0.5 if "bias" in name else 1.0 / math.sqrt(p.shape[-2]))
    return module


def random_routing(tokens: int, experts: int, top_k: int, *, used: list[int] | None = None, seed: int = 0,
                   device="cpu", dtype=torch.float32):
    """(T, k) distinct expert ids drawn from ``used`` (default: all), softmax weights."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(used if used is not None else list(range(experts)))
    assert top_k <= len(pool)
    idx = torch.stack([pool[torch.randperm(len(pool), generator=g)[:top_k]] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1)
    return idx.to(device), weights.to(device=device, dtype=dtype)


def run_experts(module, impl, x, idx, w, grad_out):
    """Output and gradients (input, routing weights, every expert parameter) of one implementation."""
    set_moe_routing(module, impl)
    try:
        module.zero_grad(set_to_none=True)
        xx = x.detach().clone().requires_grad_(True)
        ww = w.detach().clone().requires_grad_(True)
        out = module(xx, idx, ww)
        out.backward(grad_out)
        grads = {"input": xx.grad, "weights": ww.grad}
        grads.update({n: p.grad.clone() for n, p in module.named_parameters()})
        return out.detach(), grads
    finally:
        set_moe_routing(module, None)


def assert_close(actual, expected, what="", tol=2e-5):
    scale = 1.0 + expected.abs().max().item()
    diff = (actual - expected).abs().max().item() if actual.numel() else 0.0
    assert diff <= tol * scale, f"{what}: max |diff| {diff:.3g} > {tol} x {scale:.3g}"


def compare_to_eager(module, x, idx, w, modes=MODES + ("grouped_mm",)):
    torch.manual_seed(123)
    grad_out = torch.randn_like(x)
    ref_out, ref_grads = run_experts(module, "eager", x, idx, w, grad_out)
    for mode in modes:
        out, grads = run_experts(module, mode, x, idx, w, grad_out)
        if mode == "naive":  # the same ops as the stock loop: bit-identical
            assert torch.equal(out, ref_out)
            assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)
            continue
        assert_close(out, ref_out, f"{mode} output")
        for name in ref_grads:
            assert_close(grads[name], ref_grads[name], f"{mode} grad {name}")


# --- CUDA: per MoE layer in bf16, syncs cross-checked by CUDA -------------------------------------------------------
def _real_width_layer(family: str, dtype=torch.bfloat16):
    """One MoE block (router + experts) at real width on the GPU, initialised like the model (std 0.02)."""
    from fastsft_lab.models import make_config

    preset = "gpt-oss-20b" if family == "gpt_oss" else "qwen3-30b-a3b"
    config = make_config(preset, num_layers=1)
    torch.manual_seed(0)
    if family == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as Block
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
    with torch.device("cuda"):
        block = Block(config).to(dtype)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.normal_(0.0, 0.02)
    return block
