"""Fused NF4 dequantisation: bitsandbytes' weights bit for bit, one dequantisation fewer under checkpointing.

The Triton kernel runs here through Triton's interpreter (numpy on the CPU) and is held, bit for bit, to a float32
reference written out below and to bitsandbytes' own dequantisation, for every output dtype, plain and double
quantisation, sizes that end mid-byte and mid-block. The layer path (``apply(fused_dequant=True)``) is held to
bitsandbytes' ``Linear4bit`` to the bit (loss and every gradient) with and without checkpointing, and counted: two
dequantisations per projection and step under checkpointing where bitsandbytes makes three.
"""

import pytest
import torch

import fastsft_lab
from fastsft_lab import dequant
from fastsft_lab.data import benchmark_batches
from fastsft_lab.models import LoraSettings, build_model

bnb_functional = pytest.importorskip("bitsandbytes.functional")


@pytest.fixture(scope="module")
def interpreted():
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    return InterpretedFunction(dequant.nf4_kernel().fn)


def _quantized(shape, nested, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    codes, qs = bnb_functional.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=nested,
                                             quant_storage=torch.uint8)
    return w, codes, qs


def _reference(codes, qs, dtype):
    """NF4 by its definition, in float32: code[c] * absmax[block], the absmax itself code2[q] * absmax2 + offset
    when nested; high nibble first; one rounding to ``dtype`` at the end (torch's round to nearest even)."""
    flat = codes.view(torch.uint8).reshape(-1).long()
    idx = torch.stack([flat >> 4, flat & 15], 1).reshape(-1)
    absmax = qs.absmax
    if qs.nested:
        absmax = qs.state2.code[absmax.long()] * qs.state2.absmax.repeat_interleave(256)[:absmax.numel()]
        absmax = absmax + qs.offset
    scale = absmax[torch.arange(idx.numel()) // qs.blocksize]
    return (qs.code[idx] * scale).to(dtype)[:qs.shape.numel()].reshape(qs.shape)


# (64, 96): a row ends mid-block; (33, 320): an odd row count; (130, 768) x nested: more than one absmax block of 256
SHAPES = [(64, 96), (33, 320), (130, 768), (7, 9)]


@pytest.mark.parametrize("nested", [True, False], ids=["double-quant", "plain"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_equals_the_definition_bit_for_bit(interpreted, shape, dtype, nested):
    w, codes, qs = _quantized(shape, nested)
    got = dequant.dequantize_nf4(codes, qs, dtype, kernel=interpreted)
    assert got.dtype == dtype and got.shape == shape
    assert torch.equal(got, _reference(codes, qs, dtype))
    # and it is the weight: within NF4's own error (half the widest code gap, 0.16, of each block's absmax)
    assert (got.float() - w).abs().max() <= 0.17 * w.abs().max()


@pytest.mark.parametrize("nested", [True, False], ids=["double-quant", "plain"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_kernel_equals_bitsandbytes_where_its_cpu_kernel_is_right(interpreted, dtype, nested):
    # bitsandbytes 0.50.2's CPU dequantisation mis-assigns blocks when a row is not a whole number of blocks
    # ((64, 96) above); with whole blocks it is the reference the CUDA test checks on the GPU
    _, codes, qs = _quantized((130, 768), nested)
    assert torch.equal(dequant.dequantize_nf4(codes, qs, dtype, kernel=interpreted),
                       dequant.bitsandbytes_dequantize(codes, qs, dtype))


def _qlora(checkpointing, dtype=torch.float32):
    model = build_model("tiny-qwen3", device="cpu", dtype=dtype, quant="nf4", lora=LoraSettings(rank=4),
                        gradient_checkpointing=checkpointing, seed=3)
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    return model


def _step(model, batch):
    out = model(**batch.model_inputs())
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


class _Count:
    """Counts dequantisations: calls of bitsandbytes' 4-bit dequantisation op, or of the kernel."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = dequant.bitsandbytes_dequantize

        def counted(*args, **kwargs):
            self.n += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(dequant, "bitsandbytes_dequantize", counted)


@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "plain"])
def test_layers_equal_bitsandbytes_to_the_bit(checkpointing, one_cpu_thread):
    model = _qlora(checkpointing)
    batch = benchmark_batches(tokens_per_step=128, steps=1, vocab_size=model.config.vocab_size, mix="short")[0]
    ref_loss, ref = _step(model, batch)
    st = fastsft_lab.apply(model, fused_dequant=True)
    assert st.fused_dequant and dequant.fused_dequant_layers(model) == len(dequant.fused_dequant_targets(model)) > 0
    loss, got = _step(model, batch)
    assert torch.equal(loss, ref_loss)
    assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref), "gradients differ"
    assert not fastsft_lab.revert(model).fused_dequant and dequant.fused_dequant_layers(model) == 0


def test_checkpointed_layers_dequantise_twice_not_three_times(monkeypatch, one_cpu_thread):
    model = _qlora(True)
    batch = benchmark_batches(tokens_per_step=128, steps=1, vocab_size=model.config.vocab_size, mix="short")[0]
    projections = len(dequant.fused_dequant_targets(model))
    fastsft_lab.apply(model, fused_dequant=True)
    count = _Count(monkeypatch)
    _step(model, batch)
    assert count.n == 2 * projections              # forward and recompute; the backward reuses the recompute's
    assert dequant.kept_weights() == 0             # each kept weight was taken by its backward
    # without checkpointing: forward and backward (bitsandbytes' own count), nothing kept through the step
    fastsft_lab.revert(model)
    model.gradient_checkpointing_disable()
    fastsft_lab.apply(model, fused_dequant=True)
    count.n = 0
    _step(model, batch)
    assert count.n == 2 * projections


@pytest.mark.parametrize("backward", ["inside", "outside"])
def test_under_autocast_it_equals_bitsandbytes_with_the_backward_inside_or_outside(backward, one_cpu_thread):
    """float32 weights, the forward under bf16 autocast (SFTTrainer(bf16=True)); the backward inside the autocast
    block (the lab's harness) or after it (accelerate's and the Trainer's order): the gradients reaching the kept
    weight are bf16 there, and the result is bitsandbytes' to the bit."""
    batch = benchmark_batches(tokens_per_step=128, steps=1, vocab_size=256, mix="short")[0]
    runs = []
    for fused in (False, True):
        model = _qlora(True)
        fastsft_lab.apply(model, fused_dequant=fused)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch.model_inputs()).loss
            if backward == "inside":
                loss.backward()
        if backward == "outside":
            loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
        assert dequant.kept_weights() == 0
    (ref_loss, ref), (loss, got) = runs
    assert torch.equal(loss, ref_loss)
    assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref), "gradients differ"


@pytest.mark.parametrize("weight_dtype,kept", [(torch.float32, 1), (torch.bfloat16, 0)], ids=["same", "bf16-weights"])
def test_a_recompute_keeps_the_weight_only_where_it_is_bitsandbytes_backward_weight(monkeypatch, weight_dtype, kept):
    # activations in float32, weights quantised from bf16: bitsandbytes' forward dequantises to float32, its
    # backward to bf16 then float32 -- two different tensors; the backward must not reuse the forward's
    _, codes, qs = _quantized((64, 128), True)
    qs.dtype = weight_dtype
    x = torch.randn(5, 128, requires_grad=True)
    monkeypatch.setattr(dequant, "in_backward", lambda: True)          # as in a recompute
    out = dequant.NF4Matmul.apply(x, None, codes.view(-1, 1), qs, None)
    assert dequant.kept_weights() == kept
    out.backward(torch.ones_like(out))
    assert dequant.kept_weights() == 0
    w_backward = dequant.bitsandbytes_dequantize(codes, qs, weight_dtype).float()
    torch.testing.assert_close(x.grad, torch.ones(5, 64) @ w_backward, rtol=0, atol=0)


PLANS = [("keep", "keep"), ("checkpoint", "keep"), ("selective", "offload"), ("offload", "checkpoint"),
         ("offload_saved", "selective")]


@pytest.mark.parametrize("choices", PLANS, ids="-".join)
def test_every_plan_choice_equals_plain_training_with_two_dequantisations(monkeypatch, choices):
    from fastsft_lab.offload import plan as P

    model = build_model("tiny-qwen3", device="cpu", dtype=torch.bfloat16, num_layers=2, quant="nf4",
                        lora=LoraSettings(rank=4), seed=5)
    model.train()
    model.enable_input_require_grads()                       # every projection's input needs a gradient: all counted
    batch = benchmark_batches(tokens_per_step=192, row_tokens=96, steps=1, vocab_size=256, mix="short")[0]
    reference = _step(model, batch)
    projections = len(dequant.fused_dequant_targets(model))
    fastsft_lab.apply(model, memory_budget=16, fused_dequant=True)
    try:
        _step(model, batch)                                  # step 1 measures
        P.memory_planner(model).saved.min_bytes = 0          # offload_saved moves even the tiny model's activations
        P.set_plan(model, choices)
        count = _Count(monkeypatch)
        loss, grads = _step(model, batch)
        # kept, selective, checkpointed or offloaded: two per projection (bitsandbytes: three when recomputed)
        assert count.n == 2 * projections, count.n
        assert dequant.kept_weights() == 0
        assert torch.equal(loss, reference[0])
        assert all(torch.equal(grads[n], g) for n, g in reference[1].items())
    finally:
        fastsft_lab.revert(model)


def test_refusals_in_one_line():
    dense = build_model("tiny-qwen3", device="cpu", dtype=torch.float32, lora=LoraSettings(rank=4))
    with pytest.raises(ValueError, match="fused_dequant=True needs bitsandbytes Linear4bit layers"):
        fastsft_lab.apply(dense, fused_dequant=True)
    with pytest.raises(ValueError, match="fused_dequant must be True or False"):
        fastsft_lab.apply(dense, fused_dequant="yes")
    with pytest.raises(ValueError, match="has no bitsandbytes Linear4bit layer"):
        dequant.enable_fused_dequant(dense)
    model = _qlora(False)
    name, layer = dequant.fused_dequant_targets(model)[0]
    layer.weight.quant_state.quant_type = "fp4"
    with pytest.raises(NotImplementedError, match=f"fused_dequant computes NF4 weights; {name} holds fp4"):
        fastsft_lab.apply(model, fused_dequant=True, fused_loss=True)
    assert fastsft_lab.state(model) == fastsft_lab.ModelState()          # validated before anything changed


def test_fsdp2_is_refused_in_one_line_before_anything_changes(monkeypatch):
    model = _qlora(False)
    monkeypatch.setattr(dequant, "is_fsdp2", lambda m: True)      # fully_shard needs a process group
    with pytest.raises(NotImplementedError, match="fused_dequant under FSDP2 is not supported") as err:
        fastsft_lab.apply(model, fused_loss=True, fused_dequant=True)
    assert "\n" not in str(err.value)
    assert fastsft_lab.state(model) == fastsft_lab.ModelState()


def test_no_gradient_runs_bitsandbytes_own_forward(monkeypatch):
    model = _qlora(False)
    fastsft_lab.apply(model, fused_dequant=True)
    count = _Count(monkeypatch)
    batch = benchmark_batches(tokens_per_step=64, steps=1, vocab_size=model.config.vocab_size, mix="short")[0]
    with torch.no_grad():
        model(**batch.model_inputs())
    assert count.n == 0


@pytest.mark.cuda
@pytest.mark.parametrize("nested", [True, False], ids=["double-quant", "plain"])
def test_cuda_kernel_equals_bitsandbytes_bit_for_bit(nested):
    pytest.importorskip("triton")
    _, codes, qs = _quantized((5120, 1024 + 64), nested)
    codes, qs = codes.cuda(), qs
    qs.to("cuda")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        got = dequant.dequantize_nf4(codes, qs, dtype)
        assert torch.equal(got, dequant.bitsandbytes_dequantize(codes, qs, dtype)), dtype
        assert torch.equal(got.cpu(), _reference(codes.cpu(), _cpu_state(qs), dtype)), dtype


def _cpu_state(qs):
    import copy

    c = copy.deepcopy(qs)
    c.to("cpu")
    return c


@pytest.mark.cuda
def test_cuda_qlora_step_equals_bitsandbytes_above_its_gemm_threshold():
    # past 1536 rows bitsandbytes dequantises and calls F.linear too: the same kernels on the same weights
    model = build_model("tiny-qwen3", device="cuda", dtype=torch.bfloat16, quant="nf4", lora=LoraSettings(rank=8),
                        gradient_checkpointing=True, seed=3)
    batch = benchmark_batches(tokens_per_step=2048, steps=1, vocab_size=model.config.vocab_size, mix="short")[0]
    batch = batch.to("cuda")
    ref_loss, ref = _step(model, batch)
    fastsft_lab.apply(model, fused_dequant=True)
    loss, got = _step(model, batch)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(got[n], ref[n]) for n in ref)


def test_the_combined_benchmark_times_it_beside_all_fast_on_qlora_models():
    from fastsft_lab.lab.scenarios.combined import combined_variants

    model = _qlora(True)
    names = [v.name for v in combined_variants(model, is_moe=False, which="core", packed="sdpa", trl=False,
                                               dequant=True)]
    assert names[-2:] == ["all fast", "all fast + fused dequant"]
    variant = next(v for v in combined_variants(model, is_moe=False, which="core", packed="sdpa", trl=False,
                                                dequant=True) if v.name == "all fast + fused dequant")
    variant.enable(model)
    st = fastsft_lab.state(model)
    assert st.fused_dequant and st.offload_buffers == 2 and st.packed == "sdpa"
    variant.disable(model)
    assert not fastsft_lab.state(model).fused_dequant


def test_composes_with_fused_lora_to_the_bit(one_cpu_thread):
    # fused LoRA adds into the base output in place: with the fused dequantisation underneath, the same numbers
    model = _qlora(True)
    batch = benchmark_batches(tokens_per_step=128, steps=1, vocab_size=model.config.vocab_size, mix="short")[0]
    fastsft_lab.apply(model, fused_lora=True)
    ref_loss, ref = _step(model, batch)
    assert fastsft_lab.apply(model, fused_dequant=True).fused_lora
    loss, got = _step(model, batch)
    assert torch.equal(loss, ref_loss) and all(torch.equal(got[n], ref[n]) for n in ref)
    fastsft_lab.revert(model)


def test_a_kernel_that_does_not_build_falls_back_to_bitsandbytes_with_one_warning(monkeypatch):
    _, codes, qs = _quantized((64, 128), True)

    class Unbuildable:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise RuntimeError("CompilationError: at 1:2: no such op\nmore lines")
            return launch

    monkeypatch.setattr(dequant, "_use_kernel", lambda c: True)
    monkeypatch.setattr(dequant, "nf4_kernel", lambda: Unbuildable())
    monkeypatch.setattr(dequant, "_BROKEN", [])
    with pytest.warns(RuntimeWarning, match="did not build .RuntimeError: CompilationError: at 1:2: no such op.;"):
        got = dequant.dequantize_nf4(codes, qs, torch.float32)
    assert torch.equal(got, dequant.bitsandbytes_dequantize(codes, qs, torch.float32))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # once: later calls go to bitsandbytes quietly
        assert torch.equal(dequant.dequantize_nf4(codes, qs, torch.float32), got)


def test_weights_left_by_an_unfinished_backward_are_let_go_at_the_next_forward(monkeypatch):
    model = _qlora(True)
    batch = benchmark_batches(tokens_per_step=64, steps=1, vocab_size=model.config.vocab_size, mix="short")[0]
    fastsft_lab.apply(model, fused_dequant=True)
    monkeypatch.setitem(dequant._KEPT, 1, (torch.zeros(1), torch.zeros(8)))     # as an exception would leave it
    model(**batch.model_inputs()).loss.backward()
    assert dequant.kept_weights() == 0
    fastsft_lab.revert(model)


def test_under_torch_compile_it_equals_bitsandbytes(one_cpu_thread):
    # dynamo traces the layer's Function (bitsandbytes' ops stand in for the Triton launch while compiling)
    model = _qlora(True)
    batch = benchmark_batches(tokens_per_step=64, steps=1, vocab_size=model.config.vocab_size, mix="short")[0]
    ref_loss, ref = _step(model, batch)
    fastsft_lab.apply(model, fused_dequant=True)
    compiled = torch.compile(model, backend="aot_eager")
    try:
        loss, got = _step(compiled, batch)
    finally:
        torch.compiler.reset()
        fastsft_lab.revert(model)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)         # float32: a reordered sum at most
    for n, g in ref.items():
        torch.testing.assert_close(got[n.removeprefix("_orig_mod.")] if n in got else got["_orig_mod." + n], g,
                                   rtol=1e-5, atol=1e-7, msg=n)
