"""The fused linear cross-entropy: transformers' causal-LM loss and gradients, without the logits, without a sync."""

import pytest
import torch

from fastsft_lab import loss as L
from fastsft_lab.data import benchmark_batches
from fastsft_lab.models import LoraSettings, build_model
from fastsft_lab.profiling import SyncCounter


def _reference(hidden, weight, labels, num_items=None):
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits = hidden @ weight.t()
    return ForCausalLMLoss(logits, labels, vocab_size=weight.shape[0], num_items_in_batch=num_items)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("num_items", [None, 17])
def test_loss_and_gradients_equal_the_unfused_loss(chunk, num_items):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 33, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (2, 33), generator=g)
    labels[0, :5] = -100
    labels[1, 20:] = -100
    ref = _reference(hidden, weight, labels, num_items)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    got = L.linear_cross_entropy(hidden, weight, labels, num_items_in_batch=num_items, chunk=chunk)
    got_grads = torch.autograd.grad(got, (hidden, weight))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    for a, b in zip(got_grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_no_host_sync_and_all_ignored_labels():
    hidden = torch.randn(1, 9, 8, requires_grad=True)
    weight = torch.randn(11, 8)
    labels = torch.full((1, 9), -100)
    with SyncCounter(device="cpu") as c:
        out = L.linear_cross_entropy(hidden, weight, labels)
        out.backward()
    assert c.total == 0 and out.item() == 0 and hidden.grad.abs().sum() == 0
    with pytest.raises(ValueError, match="chunk"):
        L.linear_cross_entropy(hidden, weight, labels, chunk=0)


@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gpt-oss"])
def test_model_switch_equals_the_model_loss_and_reverts(preset):
    import fastsft_lab

    model = build_model(preset, device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    batch = benchmark_batches(tokens_per_step=128, row_tokens=64, steps=1, vocab_size=256, mix="short")[0]
    inputs = {**batch.model_inputs(), "output_router_logits": preset == "tiny-gpt-oss"}

    def run():
        model.zero_grad(set_to_none=True)
        out = model(**inputs)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref, ref_grads = run()
    assert fastsft_lab.apply(model, fused_loss=True).fused_loss
    got, grads = run()
    assert got.logits is None
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-6)
    if preset == "tiny-gpt-oss":
        torch.testing.assert_close(got.aux_loss, ref.aux_loss)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)
    assert not fastsft_lab.revert(model).fused_loss
    again, _ = run()
    assert torch.equal(again.loss, ref.loss) and again.logits is not None


@pytest.mark.cuda
def test_cuda_fused_loss_matches_in_bf16_and_syncs_nothing():
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(1, 4096, 256, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    weight = torch.randn(32000, 256, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    labels = torch.randint(0, 32000, (1, 4096), device="cuda", generator=g)
    labels[0, :100] = -100
    ref = _reference(hidden, weight, labels)
    (ref_g,) = torch.autograd.grad(ref, hidden)
    torch.cuda.synchronize()
    with SyncCounter(device="cuda", cross_check=True) as c:
        got = L.linear_cross_entropy(hidden, weight, labels)
        (got_g,) = torch.autograd.grad(got, hidden)
    assert c.total == 0 and (c.cuda_reported or 0) == 0, c.cuda_messages
    torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got_g.float(), ref_g.float(), rtol=2e-2, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("preset", ["tiny-qwen3", "tiny-gpt-oss"])
def test_cuda_liger_floor_is_as_close_to_fp32_as_the_unfused_bf16_model(preset):
    """Liger's kernels round differently from the unfused bf16 model, so the two are not compared
    with each other: both are compared with an fp32 copy of the same weights, and Liger's error
    must stay within the unfused model's own bf16 rounding error (twice it, plus 1%)."""
    pytest.importorskip("liger_kernel")
    import copy

    from fastsft_lab.lab.scenarios.combined import apply_liger

    base = build_model(preset, device="cuda", dtype=torch.bfloat16, lora=LoraSettings(rank=4), seed=0)
    for n, p in base.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator(device="cuda").manual_seed(1))
    fp32 = copy.deepcopy(base).float()
    liger = copy.deepcopy(base)
    apply_liger(liger, "qwen3" if preset == "tiny-qwen3" else "gpt_oss")

    batch = benchmark_batches(tokens_per_step=512, row_tokens=256, steps=1, vocab_size=256, mix="short")[0].to("cuda")

    def run(m):
        out = m(**batch.model_inputs())
        out.loss.backward()
        return out.loss.detach().float(), {n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None}

    ref_loss, ref_grads = run(fp32)
    bf16_loss, bf16_grads = run(base)
    loss, grads = run(liger)
    assert grads.keys() == bf16_grads.keys() == ref_grads.keys()
    assert abs(loss - ref_loss) <= 2 * abs(bf16_loss - ref_loss) + 1e-2 * abs(ref_loss)

    def rel(g, n):
        return ((g[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-12)).item()

    for n in grads:
        assert rel(grads, n) <= 2 * rel(bf16_grads, n) + 1e-2, (n, rel(grads, n), rel(bf16_grads, n))


# --- the per-chunk kernel (Triton; interpreted on the CPU where triton is installed) ---------------------------------
_CE_KERNEL_CHECK = r"""
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from fastsft_lab import loss as L
assert L._HAS_TRITON and L.fused_ce_available(torch.zeros(1))

torch.manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for rows, vocab, block in [(7, 300, 64), (4, 128, 64), (3, 5, 64)]:   # V not a multiple of BLOCK, a multiple, V < BLOCK
        logits = (torch.randn(rows, vocab) * 4).to(dtype)
        target = torch.randint(0, vocab, (rows,))
        target[0], target[1], target[2] = 0, vocab - 1, -100                 # first and last column, an ignored row
        if rows > 3:
            target[-1] = -100
        ref_loss, ref_g = L._eager_chunk(logits.clone(), target, dtype)
        x = logits.clone()
        loss, g = L._fused_chunk(x, target, True, block=block)
        assert g.data_ptr() == x.data_ptr() and g.dtype == dtype, (g.dtype, dtype)   # in place, in the logits' dtype
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        if dtype == torch.float32:
            torch.testing.assert_close(g, ref_g, rtol=1e-5, atol=1e-6)
        else:   # the same float32 values up to summation order, then one rounding: at most one bf16 step apart
            torch.testing.assert_close(g.float(), ref_g.float(), rtol=1.6e-2, atol=1e-5)
        ignored = target == -100
        assert (g[ignored] == 0).all() and (loss[ignored] == 0).all()
        assert (g[~ignored].float().sum(1).abs() < 2e-2).all()                # softmax - onehot sums to zero
        x = logits.clone()
        loss, g = L._fused_chunk(x, target, False, block=block)               # loss only: the logits stay
        assert g is None and torch.equal(x, logits)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)

# linear_cross_entropy end to end: the kernel runs, and loss and gradients equal the eager path's
calls = []
kernel = L._fused_chunk
L._fused_chunk = lambda *a, **k: calls.append(1) or kernel(*a, **k)
hidden = torch.randn(2, 33, 16)
weight = torch.randn(50, 16)
labels = torch.randint(0, 50, (2, 33))
labels[0, :5] = -100
runs = []
for fused in (False, True):
    L.set_fused_ce(fused)
    h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = L.linear_cross_entropy(h, w, labels, chunk=7)
    out.backward()
    runs.append((out.detach(), h.grad, w.grad))
assert len(calls) == 10, calls                                                # 66 tokens in chunks of 7
for a, b in zip(runs[1], runs[0]):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
print("ok")
"""


def test_fused_ce_kernel_interpreted_on_cpu(interpreted):
    # The kernel against the eager chunk: loss terms and the in-place gradient, float32 and bf16 logits, ignored rows,
    # targets at the first and last column, a vocab that is not a multiple of the block; then the whole loss.
    interpreted(_CE_KERNEL_CHECK)


def test_fused_ce_switch_and_env():
    import os
    import subprocess
    import sys

    old = L.set_fused_ce(False)
    try:
        assert not L.fused_ce_available(torch.zeros(1)) and L.set_fused_ce(True) is False
        assert L.fused_ce_available(torch.zeros(1)) == (L._HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1")
    finally:
        L.set_fused_ce(old)
    env = dict(os.environ, FASTSFT_FUSED_CE="0")
    run = subprocess.run([sys.executable, "-c", "from fastsft_lab import loss; print(loss._FUSED_CE.on)"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "False", run.stderr[-2000:]


@pytest.mark.cuda
def test_cuda_fused_ce_kernel_at_qwen3_width_matches_fp32_and_syncs_nothing():
    # Qwen3-14B's head: H 5120, V 151,936; 2048 tokens (two chunks of 1024), bf16 against the unfused float32 loss
    assert L.fused_ce_available(torch.zeros(1, device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(1, 2048, 5120, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    weight = (torch.randn(151936, 5120, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02)
    labels = torch.randint(0, 151936, (1, 2048), device="cuda", generator=g)
    labels[0, :100] = -100
    labels[0, 1000] = 0
    labels[0, 1001] = 151935
    h32 = hidden.detach().float().requires_grad_()
    ref = _reference(h32, weight.float(), labels)
    (ref_g,) = torch.autograd.grad(ref, h32)
    L.linear_cross_entropy(hidden, weight, labels).backward()        # compiles the kernel outside the counted block
    torch.cuda.synchronize()
    with SyncCounter(device="cuda", cross_check=True) as c:
        got = L.linear_cross_entropy(hidden, weight, labels)
        (got_g,) = torch.autograd.grad(got, hidden)
    assert c.total == 0 and (c.cuda_reported or 0) == 0, c.cuda_messages
    torch.testing.assert_close(got.float(), ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(got_g.float(), ref_g, rtol=2e-2, atol=1e-3 * ref_g.abs().max().item())
    assert ((got_g.float() - ref_g).norm() / ref_g.norm()).item() < 1e-2
    old = L.set_fused_ce(False)                                       # the eager path: the same loss, summed alike
    try:
        eager = L.linear_cross_entropy(hidden, weight, labels)
    finally:
        L.set_fused_ce(old)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("module", ["gpt_oss", "qwen3_moe"])
@pytest.mark.parametrize("masked", [False, True])
def test_router_loss_across_ranks_is_transformers_own_on_one_process(module, masked):
    """On one process the global router loss is transformers' load_balancing_loss_func of that model, to float32
    rounding (the distributed case against one process: tests/distributed/test_distributed.py)."""
    import importlib

    from fastsft_lab.loss import load_balancing_loss_across_ranks

    balance = importlib.import_module(f"transformers.models.{module}.modeling_{module}").load_balancing_loss_func
    g = torch.Generator().manual_seed(3)
    logits = tuple(torch.randn(40, 8, generator=g) for _ in range(3))
    mask = (torch.rand(2, 20, generator=g) > 0.3).long() if masked else None
    want = balance(logits, 8, 2, mask)
    got = load_balancing_loss_across_ranks(logits, 8, 2, mask)
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=1e-7)


def test_router_loss_scope_needs_the_fused_loss_and_a_known_scope():
    import fastsft_lab
    from fastsft_lab.loss import set_router_loss_scope
    from fastsft_lab.models import build_model

    model = build_model("tiny-gpt-oss", device="cpu", dtype=torch.float32, lora=None, seed=1)
    with pytest.raises(ValueError, match="apply\\(model, fused_loss=True\\) first"):
        set_router_loss_scope(model, "global")
    fastsft_lab.apply(model, fused_loss=True)
    with pytest.raises(ValueError, match="'rank' or 'global'"):
        set_router_loss_scope(model, "node")
    set_router_loss_scope(model, "global")
    fastsft_lab.revert(model)
    from fastsft_lab.restore import log_of

    assert log_of(model) is None          # the scope went with the fused loss's record
