"""Fused LoRA: PEFT's LoRA forward with the adapter added into the base output by one in-place GEMM.

Equal to PEFT's forward (outputs and every gradient) in float32, on plain and NF4 bases, with dropout, several
adapters and the whole model trained with every other switch on; in bf16 no further from a float32 reference than
PEFT under autocast; refuses DoRA and LoRA biases; reverts exactly; and does, per layer, no pass over a
(tokens, out) tensor besides the base matmul and the one GEMM.
"""

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fastsft_lab
from fastsft_lab import lora
from fastsft_lab.data import benchmark_batches
from fastsft_lab.models import LoraSettings, build_model


def _peft_linear(*, dropout=0.0, adapters=("default",), dtype=torch.float32, use_dora=False, lora_bias=False):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 12)).to(dtype)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules=["0", "1"], use_dora=use_dora,
                     lora_bias=lora_bias)
    model = get_peft_model(base, cfg, adapter_name=adapters[0])
    for name in adapters[1:]:
        model.add_adapter(name, LoraConfig(r=3, lora_alpha=3, target_modules=["0", "1"]))
    return _draw_lora_b(model, 0.1)


def _draw_lora_b(model, std):
    """LoRA B away from its zero init, so that the adapters change the output and get a gradient path."""
    for n, p in model.named_parameters():
        if "lora_B" in n:
            nn.init.normal_(p, std=std)
    return model


def _grads(model, x, seed=0):
    torch.manual_seed(seed)
    xx = x.clone().requires_grad_(True)
    out = model(xx)
    out.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.detach(), xx.grad, grads


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_fused_equals_peft_in_float32_outputs_and_gradients(dropout):
    model = _peft_linear(dropout=dropout)
    model.train()
    x = torch.randn(3, 7, 24)
    ref = _grads(model, x)
    lora.enable_fused_lora(model)
    assert lora.fused_lora_layers(model) == 2
    got = _grads(model, x)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-5, atol=1e-6)
    assert got[2].keys() == ref[2].keys() and any("lora_A" in n for n in ref[2])
    for n in ref[2]:
        torch.testing.assert_close(got[2][n], ref[2][n], rtol=1e-5, atol=1e-6, msg=n)
    lora.disable_fused_lora(model)
    assert lora.fused_lora_layers(model) == 0
    back = _grads(model, x)
    assert torch.equal(back[0], ref[0]) and torch.equal(back[1], ref[1])   # PEFT's own forward again, bit for bit


def test_several_active_adapters_merged_and_disabled():
    model = _peft_linear(adapters=("first", "second"))
    model.base_model.set_adapter(["first", "second"])
    x = torch.randn(2, 5, 24)
    ref = _grads(model, x)
    lora.enable_fused_lora(model)
    got = _grads(model, x)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)
    for n in ref[2]:
        torch.testing.assert_close(got[2][n], ref[2][n], rtol=1e-5, atol=1e-6, msg=n)
    with model.disable_adapter():                       # PEFT's own path: the base alone
        off = model(x)
    lora.disable_fused_lora(model)
    with model.disable_adapter():
        torch.testing.assert_close(off, model(x))


def test_nf4_model_equals_peft_and_trains_with_every_switch_on():
    model = _draw_lora_b(build_model("tiny-qwen3", device="cpu", dtype=torch.float32, quant="nf4",
                                     lora=LoraSettings(rank=4), gradient_checkpointing=True), 0.05)
    kinds = {type(m).__name__ for _, m in lora.fused_lora_targets(model)}
    assert "Linear4bit" in kinds, kinds
    batch = benchmark_batches(tokens_per_step=128, steps=1, vocab_size=model.config.vocab_size, mix="short")[0]

    def step():
        out = model(**batch.model_inputs())
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out.loss.detach(), grads

    ref_loss, ref_grads = step()
    st = fastsft_lab.apply(model, fused_lora=True, packed_attention="sdpa", offload_buffers=2, fused_loss=True)
    assert st.fused_lora and lora.fused_lora_layers(model) == len(lora.fused_lora_targets(model))
    from fastsft_lab.packing import packed_inputs

    out = model(**packed_inputs(batch))
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), ref_loss, rtol=1e-5, atol=1e-5)
    for n, g in ref_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[n].grad, g, rtol=1e-4, atol=1e-6, msg=n)
    assert not fastsft_lab.revert(model).fused_lora and lora.fused_lora_layers(model) == 0


def test_bf16_no_further_from_float32_than_peft_under_autocast():
    ref_model = _peft_linear()
    x = torch.randn(4, 33, 24)
    ref = _grads(ref_model, x)
    model = _peft_linear()
    model.base_model.model.to(torch.bfloat16)
    for n, p in model.named_parameters():             # adapters in float32, base in bf16: QLoRA's layout
        if "lora_" in n:
            p.data = p.data.float()
    xb = x.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        peft = _grads(model, xb)
    lora.enable_fused_lora(model)
    fused_plain = _grads(model, xb)                   # no autocast: the adapters still run in bf16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = _grads(model, xb)

    def err(run):
        e = [(run[0].float() - ref[0]).abs().max() / ref[0].abs().max()]
        e += [(run[2][n].float() - ref[2][n]).abs().max() / ref[2][n].abs().max() for n in ref[2] if "lora_" in n]
        return max(e).item()

    assert fused[0].dtype == torch.bfloat16 and all(fused[2][n].dtype == torch.float32 for n in fused[2])
    assert err(fused) <= 1.5 * err(peft) + 1e-3, (err(fused), err(peft))
    assert err(fused_plain) <= 1.5 * err(peft) + 1e-3, (err(fused_plain), err(peft))


class _BigOps(TorchDispatchMode):
    """aten ops whose output has at least ``numel`` elements (passes over a (tokens, out) tensor)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.numel() >= self.numel and not func.is_view:
            self.ops.append(func.__name__.split(".")[0])
        return out


def test_one_gemm_per_adapter_and_no_other_pass_over_the_output():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(nn.Sequential(nn.Linear(64, 256)), LoraConfig(r=4, target_modules=["0"]))
    x = torch.randn(128, 64, requires_grad=True)
    with _BigOps(128 * 256) as peft_ops:
        model(x)
    lora.enable_fused_lora(model)
    with _BigOps(128 * 256) as fused_ops:
        model(x)
    # PEFT: the base matmul, then the (128, 256) product, its scaling and the sum; fused: base matmul + one addmm_
    assert len(peft_ops.ops) >= 3, peft_ops.ops
    assert fused_ops.ops in (["addmm", "addmm_"], ["mm", "addmm_"], ["linear", "addmm_"]), fused_ops.ops


def test_refuses_dora_and_lora_bias_and_models_without_lora():
    with pytest.raises(NotImplementedError, match="LoRA variant"):
        lora.enable_fused_lora(_peft_linear(use_dora=True))
    with pytest.raises(NotImplementedError, match="lora_bias"):
        lora.enable_fused_lora(_peft_linear(lora_bias=True))
    model = build_model("tiny-qwen3", device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="fused_lora=True needs PEFT LoRA"):
        fastsft_lab.apply(model, fused_lora=True)
    with pytest.raises(ValueError, match="fused_lora must be True or False"):
        fastsft_lab.apply(model, fused_lora="yes")
    assert not fastsft_lab.state(model).fused_lora


@pytest.mark.cuda
def test_cuda_nf4_fused_lora_matches_peft_under_autocast():
    model = _draw_lora_b(build_model("tiny-qwen3", device="cuda", dtype=torch.bfloat16, quant="nf4",
                                     lora=LoraSettings(rank=8), gradient_checkpointing=True), 0.05)
    batch = benchmark_batches(tokens_per_step=512, steps=1, vocab_size=model.config.vocab_size, mix="short")[0]
    batch = batch.to("cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch.model_inputs())
        out.loss.backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return out.loss.float().item(), grads

    ref_loss, ref = step()
    lora.enable_fused_lora(model)
    loss, got = step()                      # bitsandbytes' Linear4bit output is added into in place: no autograd error
    assert abs(loss - ref_loss) <= 2e-2 * abs(ref_loss)
    for n, g in ref.items():
        rel = ((got[n] - g).norm() / g.norm().clamp(min=1e-12)).item()
        assert rel <= 5e-2, (n, rel)
