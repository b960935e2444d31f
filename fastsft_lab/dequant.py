"""NF4 dequantisation for QLoRA's frozen base layers: bitsandbytes' path and the fused one, side by side.

A QLoRA projection (bitsandbytes ``Linear4bit``, NF4 with double quantisation) computes ``y = x @ W.T`` from 4-bit
codes. At training sizes bitsandbytes dequantises ``W`` and runs a dense matmul, and does so once in the forward and
once more in the backward (for ``grad_x = grad_y @ W``). Under gradient checkpointing the forward runs twice, so each
projection is dequantised three times per step. As bitsandbytes 0.50 runs it (:func:`bitsandbytes_dequantize`
below is that path, for reading side by side), a double-quantised weight takes three kernels per dequantisation:
the 8-bit absmax codes to float32, the offset added, then the 4-bit codes to the compute dtype.

The fused path (``apply(model, fused_dequant=True)``) changes two things, and no number:

* **one kernel** (:func:`dequantize_nf4`, Triton, CUDA): absmax codes, offset and 4-bit codes read once, the
  weight written once. The same float32 arithmetic in the same order (``code2[q] * absmax2 + offset``, no fused
  multiply-add, then ``code[c] * absmax``, rounded to the output dtype once), so the weight equals bitsandbytes'
  bit for bit. Without Triton or off CUDA it is bitsandbytes' own dequantisation (and where Triton cannot build the
  kernel: one warning, then bitsandbytes' dequantisation).
* **no third dequantisation under checkpointing** (:class:`NF4Matmul`): when the forward runs as a checkpoint's
  recompute -- inside the backward, right before this layer's own backward -- the dequantised weight is saved for
  that backward instead of being made again. It lives from the layer's recompute to its backward: at most one
  layer's weights at a time (0.66 GB at Qwen3-14B width in bf16), freed projection by projection as the backward
  runs. A layer that is not checkpointed saves nothing extra and dequantises again in its backward, as
  bitsandbytes does (keeping the weights of every layer through the step would cost the model's size again).

Numbers: the forward is bitsandbytes' dequantise-then-``F.linear`` path, which bitsandbytes itself takes for more
than 1536 rows on CUDA and at every size elsewhere; for fewer rows on CUDA bitsandbytes runs its own GEMM kernel,
equal to this one to the compute dtype's rounding. The backward is bitsandbytes' ``grad_y @ W`` with the same ``W``
(the saved weight is reused only when the compute dtype is the weight's own, where bitsandbytes' two
dequantisations give the same tensor).

Scope: NF4 (``quant_type="nf4"``), plain or double-quantised with bitsandbytes' absmax blocks of 256; under PEFT and
``torch.compile`` (tested; while compiling, bitsandbytes' ops stand in for the kernel). Refused in one line: FP4
weights, a model with no ``Linear4bit``, FSDP2. A call without gradients (evaluation, generation) runs
bitsandbytes' own forward.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

import functools
from dataclasses import dataclass

from ._compat import bnb_fix_quant_state, has_triton, in_backward, is_fsdp2
from ._util import on_device_of
from .model_state import state
from .restore import Optimization, changes, entries
from .structure import base_model

SWITCH = "fused_dequant"
ABSMAX_BLOCK = 256                  # bitsandbytes' block of the nested (double) quantisation of the absmax values


# -- bitsandbytes' path, for reading -----------------------------------------------------------------------------------
def bitsandbytes_dequantize(codes: torch.Tensor, quant_state, dtype: torch.dtype) -> torch.Tensor:
    """The weight as bitsandbytes 0.50's ``gemm_4bit`` fallback dequantises it for ``F.linear``: the nested absmax
    to float32 (one kernel), the offset added (a second), the 4-bit codes to ``dtype`` (a third)."""
    absmax = quant_state.absmax
    if quant_state.nested:
        absmax = torch.ops.bitsandbytes.dequantize_blockwise.default(
            absmax, quant_state.state2.absmax, quant_state.state2.code, quant_state.state2.blocksize, torch.float32
        ) + quant_state.offset
    return torch.ops.bitsandbytes.dequantize_4bit.default(codes, absmax, quant_state.blocksize,
                                                          quant_state.quant_type, quant_state.shape, dtype)


# -- the fused path ----------------------------------------------------------------------------------------------------
_KERNEL = None


def nf4_kernel():
    """The Triton kernel (built on first use, so that importing this module never needs Triton)."""
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def _nf4_dequant_kernel(codes_ptr, absmax_ptr, code_ptr, absmax_q_ptr, absmax2_ptr, code2_ptr, offset_ptr,
                                out_ptr, n_bytes, numel, BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr,
                                BF16: tl.constexpr, BYTES: tl.constexpr):
            # one program: BYTES packed bytes -> 2 * BYTES weights (high nibble first, as bitsandbytes packs them)
            pid = tl.program_id(0)
            offs = pid * BYTES + tl.arange(0, BYTES)
            live = offs < n_bytes
            byte = tl.load(codes_ptr + offs, mask=live, other=0).to(tl.int32)
            block = (offs * 2) // BLOCKSIZE                 # both nibbles of a byte share a block (BLOCKSIZE is even)
            if NESTED:
                q = tl.load(absmax_q_ptr + block, mask=live, other=0).to(tl.int32)
                scale = tl.load(code2_ptr + q, mask=live, other=0.0) * tl.load(absmax2_ptr + block // 256,
                                                                               mask=live, other=0.0)
                scale = scale + tl.load(offset_ptr)         # rounded after the product: launched without FMA
            else:
                scale = tl.load(absmax_ptr + block, mask=live, other=0.0)
            hi = tl.load(code_ptr + (byte >> 4), mask=live, other=0.0) * scale
            lo = tl.load(code_ptr + (byte & 15), mask=live, other=0.0) * scale
            values = tl.reshape(tl.join(hi, lo), (2 * BYTES,))
            if BF16:
                # round to nearest even on the bits (as torch rounds float32 to bfloat16), stored through an int16 view
                bits = values.to(tl.uint32, bitcast=True)
                values = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16)
            else:
                values = values.to(out_ptr.dtype.element_ty)
            out = pid * 2 * BYTES + tl.arange(0, 2 * BYTES)
            tl.store(out_ptr + out, values, mask=out < numel)

        _KERNEL = _nf4_dequant_kernel
    return _KERNEL


def _use_kernel(codes: torch.Tensor) -> bool:
    # while torch.compile traces, bitsandbytes' ops (registered custom ops) stand in: the same numbers
    return codes.device.type == "cuda" and has_triton() and not torch.compiler.is_compiling()


def dequantize_nf4(codes: torch.Tensor, quant_state, dtype: torch.dtype, *, kernel=None) -> torch.Tensor:
    """The NF4 weight ``quant_state.shape`` in ``dtype``, equal bit for bit to :func:`bitsandbytes_dequantize`: one
    Triton kernel on CUDA (``kernel`` overrides which: tests pass Triton's interpreter to run it on a CPU),
    bitsandbytes' own dequantisation elsewhere."""
    if kernel is None:
        if not _use_kernel(codes) or _BROKEN:
            return bitsandbytes_dequantize(codes, quant_state, dtype)
        try:
            return _launch(nf4_kernel(), codes, quant_state, dtype)
        except Exception as err:         # a Triton that cannot build it (compile errors are raised at launch)
            _BROKEN.append(f"{type(err).__name__}: {err}".splitlines()[0])
            warnings.warn(f"fused_dequant: the Triton NF4 kernel did not build ({_BROKEN[0]}); bitsandbytes' "
                          "dequantisation from here on (the same numbers, the fused path's speed lost)",
                          RuntimeWarning, stacklevel=2)
            return bitsandbytes_dequantize(codes, quant_state, dtype)
    return _launch(kernel, codes, quant_state, dtype)


_BROKEN: list[str] = []          # why the kernel could not be built, once it could not


def _launch(kernel, codes: torch.Tensor, quant_state, dtype: torch.dtype) -> torch.Tensor:
    qs = quant_state
    numel = qs.shape.numel() if isinstance(qs.shape, torch.Size) else int(torch.Size(qs.shape).numel())
    flat = codes.view(torch.uint8).reshape(-1)
    out = torch.empty(tuple(qs.shape), dtype=dtype, device=codes.device)
    code = qs.code.to(device=codes.device, dtype=torch.float32)
    if qs.nested:
        absmax, absmax_q = qs.state2.absmax, qs.absmax
        code2, offset = qs.state2.code, qs.offset.reshape(1).to(device=codes.device, dtype=torch.float32)
    else:
        absmax, absmax_q, code2, offset = qs.absmax, qs.absmax, code, code      # unread placeholders
    n_bytes, per_program = flat.numel(), 1024
    bf16 = dtype == torch.bfloat16
    with on_device_of(codes):
        kernel[(-(-n_bytes // per_program),)](
            flat, absmax, code, absmax_q, absmax, code2, offset, out.view(torch.int16) if bf16 else out, n_bytes,
            numel, BLOCKSIZE=qs.blocksize, NESTED=bool(qs.nested), BF16=bf16, BYTES=per_program,
            enable_fp_fusion=False)
    return out


# A recompute's weights, by the codes view its forward saved: {id(codes): (codes, w)}. A checkpoint's recompute is a
# second autograd graph (torch's non-reentrant checkpoint keeps the first graph's nodes and hands them the recompute's
# saved tensors, checking they match the first forward's), so the weight cannot travel as a saved tensor of its own;
# it waits here for the backward of the node that saved ``codes``, which follows the recompute at once.
_KEPT: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


class NF4Matmul(torch.autograd.Function):
    """``F.linear(x, W, bias)`` for a frozen NF4 weight ``W``, as bitsandbytes' ``MatMul4Bit`` computes it for
    training, with :func:`dequantize_nf4`; inside a checkpoint's recompute the weight is kept for the backward."""

    @staticmethod
    def forward(ctx, x, bias, codes, quant_state, kernel):
        w = dequantize_nf4(codes, quant_state, x.dtype, kernel=kernel)
        out = F.linear(x, w, bias)
        # Kept only when it is the tensor bitsandbytes' backward would make (its backward dequantises to the
        # weight's dtype, then casts), and only in a recompute, where this node's backward follows at once.
        if x.dtype == quant_state.dtype and in_backward():
            _KEPT[id(codes)] = (codes, w)
        ctx.save_for_backward(codes)
        ctx.quant_state, ctx.kernel = quant_state, kernel
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        (codes,) = ctx.saved_tensors
        kept = _KEPT.pop(id(codes), None)
        grad_x = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0, dtype=ctx.bias_dtype)
        if ctx.needs_input_grad[0]:
            if kept is not None and kept[0] is codes:
                w = kept[1].to(grad.dtype)      # a forward under autocast, its backward outside: bf16 grads
            else:
                qs = ctx.quant_state
                w = dequantize_nf4(codes, qs, qs.dtype, kernel=ctx.kernel).to(grad.dtype)
            grad_x = torch.matmul(grad, w)
        return grad_x, grad_bias, None, None, None


def kept_weights() -> int:
    """How many recomputed weights wait for their backward now (0 between steps)."""
    return len(_KEPT)


def fused_dequant_forward(self, original, x: torch.Tensor, *, kernel=None) -> torch.Tensor:
    """bitsandbytes ``Linear4bit.forward`` (0.50) through :class:`NF4Matmul` when a gradient is needed
    (``original``: the layer's own forward; ``kernel``: a Triton kernel to use on every device)."""
    bias = self.bias
    if not torch.is_grad_enabled() or not (x.requires_grad or (bias is not None and bias.requires_grad)):
        return original(x)
    if _KEPT and not in_backward():
        _KEPT.clear()          # left by a backward that did not finish (an exception): a weight each, let go
    bnb_fix_quant_state()(self)
    quant_state = self.weight.quant_state
    if not self.compute_type_is_set:
        self.set_compute_type(x)
        self.compute_type_is_set = True
    inp_dtype = x.dtype
    if self.compute_dtype is not None:
        x = x.to(self.compute_dtype)
    if bias is not None:
        if bias.dtype != x.dtype:
            bias.data = bias.data.to(x.dtype)
        bias = bias.to(self.compute_dtype)
    return NF4Matmul.apply(x, bias, self.weight.view(-1, 1), quant_state, kernel).to(inp_dtype)


def _linear4bit_class():
    try:
        import bitsandbytes as bnb
    except ImportError:
        return None
    return bnb.nn.Linear4bit


def fused_dequant_targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The bitsandbytes ``Linear4bit`` layers of ``model`` (checked: FP4 weights and FSDP2 raise)."""
    cls = _linear4bit_class()
    found = [(n, m) for n, m in model.named_modules() if cls is not None and isinstance(m, cls)]
    if found and any(is_fsdp2(m) for m in model.modules()):
        raise NotImplementedError("fused_dequant under FSDP2 is not supported (not tested with sharded NF4 "
                                  "weights): leave it off, bitsandbytes' own dequantisation runs")
    for n, m in found:
        quant_type = getattr(getattr(m.weight, "quant_state", None), "quant_type", None) or getattr(m.weight,
                                                                                                    "quant_type", None)
        if quant_type != "nf4":
            raise NotImplementedError(f"fused_dequant computes NF4 weights; {n} holds {quant_type} (quant_type='nf4' "
                                      "in BitsAndBytesConfig, or leave fused_dequant off)")
        qs = getattr(m.weight, "quant_state", None)
        if qs is not None and qs.nested and qs.state2.blocksize != ABSMAX_BLOCK:
            raise NotImplementedError(f"fused_dequant takes bitsandbytes' nested absmax blocks of {ABSMAX_BLOCK}; "
                                      f"{n} has {qs.state2.blocksize}")
    return found


@dataclass
class FusedDequant:
    """The ``fused_dequant`` switch's record in the model's restore log."""

    layers: int

    def state(self) -> dict:
        return {"fused_dequant": True}


def validate(model: nn.Module, value, options: dict) -> bool:
    """The ``fused_dequant`` switch's checks: True or False, and NF4 ``Linear4bit`` layers it computes exactly."""
    if not isinstance(value, bool):
        raise ValueError(f"fused_dequant must be True or False, got {value!r}")
    if not fused_dequant_targets(model):
        raise ValueError(f"fused_dequant=True needs bitsandbytes Linear4bit layers (QLoRA); "
                         f"{type(base_model(model)).__name__} has none")
    return value


def enable(model: nn.Module, value: bool = True, *, kernel=None) -> None:
    """Put :func:`fused_dequant_forward` in front of every NF4 ``Linear4bit``'s forward (checked by
    :func:`validate`)."""
    log = changes(model, SWITCH)
    targets = fused_dequant_targets(model)
    forward = functools.partial(fused_dequant_forward, kernel=kernel) if kernel is not None else fused_dequant_forward
    for _, m in targets:
        log.forward(m, forward)
    log.record = FusedDequant(len(targets))


FUSED_DEQUANT = Optimization(SWITCH, validate, enable, off=(False,))


def enable_fused_dequant(model: nn.Module, *, kernel=None):
    """Run every bitsandbytes NF4 ``Linear4bit`` of ``model`` through :func:`fused_dequant_forward` (on the
    instances; the class stays untouched). ``kernel``: a Triton kernel to use on every device (tests: the
    interpreter).

    Raises:
        ValueError: the model has no ``Linear4bit`` layer.
        NotImplementedError: an FP4 weight, before anything changes.
    """
    if not fused_dequant_targets(model):
        raise ValueError(f"{type(model).__name__} has no bitsandbytes Linear4bit layer (load it with "
                         "BitsAndBytesConfig(load_in_4bit=True)): fused_dequant has nothing to dequantise")
    enable(model, kernel=kernel)
    return state(model)


def disable_fused_dequant(model: nn.Module):
    """bitsandbytes' own forward on every layer again (a no-op when it is off)."""
    FUSED_DEQUANT.disable(model)
    return state(model)


def fused_dequant_layers(model: nn.Module) -> int:
    """How many layers of ``model`` run the fused dequantisation."""
    return sum(1 for e in entries(model, SWITCH) if e.name == "forward")


__all__ = ["FUSED_DEQUANT", "NF4Matmul", "bitsandbytes_dequantize", "dequantize_nf4", "disable_fused_dequant",
           "enable_fused_dequant", "fused_dequant_forward", "fused_dequant_layers", "fused_dequant_targets",
           "kept_weights", "nf4_kernel"]
