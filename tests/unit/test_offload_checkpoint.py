"""The offloaded checkpoint function on toy modules (unit): views, strides, tuples, kwargs, a tensor passed twice,
and the grad mode its forward runs in."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from fastsft_lab import offload as O

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


class _Toy(nn.Module):
    def __init__(self, tuple_out=False):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.tuple_out = tuple_out

    def forward(self, x, scale=None, bias=None):
        y = torch.tanh(self.lin(x)) * (scale if scale is not None else 1.0)
        if bias is not None:
            y = y + bias[0] * bias[1]
        return (y, None) if self.tuple_out else y


def _toy_run(toy, leaf_data, layout, x_grad, kwargs, manager=None):
    """y and gradients of sin(toy(x)).sum(), x derived from a leaf as a view / transpose / itself."""
    toy.zero_grad(set_to_none=True)
    for t in (kwargs["scale"], kwargs["bias"][1]):
        t.grad = None
    leaf = leaf_data.clone().requires_grad_(x_grad)
    x = {"contiguous": lambda t: t, "transposed": lambda t: t.t(), "view": lambda t: t[1]}[layout](leaf)
    fn = functools.partial(toy, **kwargs)
    out = O.offloaded_checkpoint(fn, x, manager=manager, module=toy) if manager else fn(x)
    y = out[0] if isinstance(out, tuple) else out
    y.sin().sum().backward()
    return (y.detach(), [p.grad.clone() for p in toy.parameters()], leaf.grad,
            kwargs["scale"].grad.clone(), kwargs["bias"][1].grad.clone())


@pytest.mark.parametrize("tuple_out", [False, True], ids=["tensor-out", "tuple-out"])
@pytest.mark.parametrize("x_grad", [True, False], ids=["x-grad", "x-frozen"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "view"])
def test_offloaded_checkpoint_function(tuple_out, x_grad, layout):
    torch.manual_seed(0)
    toy = _Toy(tuple_out)
    manager = O.OffloadManager("cpu", buffers=2, prefetch=True)
    leaf_data = torch.randn(3, 8, 8) if layout == "view" else torch.randn(8, 8)
    kwargs = {"scale": torch.randn(8, requires_grad=True),                    # a kwarg that needs a gradient
              "bias": (torch.randn(8), torch.randn(8, requires_grad=True))}   # nested in a tuple, like cos/sin
    ref = _toy_run(toy, leaf_data, layout, x_grad, kwargs)
    got = _toy_run(toy, leaf_data, layout, x_grad, kwargs, manager)
    # The pool keeps a contiguous copy: a transposed input is recomputed from contiguous memory, which may pick a
    # different matmul path (last-bit float differences). Contiguous inputs and views are bitwise equal.
    tol = dict(rtol=1e-5, atol=1e-6) if layout == "transposed" else dict(rtol=0, atol=0)
    for a, b in zip(ref, got):
        if isinstance(a, list):
            for u, v in zip(a, b):
                torch.testing.assert_close(v, u, **tol)
        elif a is None:
            assert b is None
        else:
            torch.testing.assert_close(b, a, **tol)
    assert manager.stats.saves == 1 and manager.pending == 0


def test_same_tensor_twice_gets_summed_gradient():
    manager = O.OffloadManager("cpu", buffers=1)
    w = torch.randn(4, requires_grad=True)

    def f(a, b):
        return a * b * w

    x = torch.randn(4, requires_grad=True)
    O.offloaded_checkpoint(f, x, x, manager=manager).sum().backward()
    ref = torch.randn(4).copy_(x.detach()).requires_grad_(True)
    (ref * ref * w.detach()).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)


# --- the offloaded forward runs the kernels of the standard path ---------------------------------------------------
class _GradModeProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        y = self.lin(x)
        self.seen.append((torch.is_grad_enabled(), y.requires_grad))
        return torch.tanh(y)


@pytest.mark.parametrize("forward_grad", [True, False], ids=["grad-on", "no-grad"])
def test_offloaded_forward_grad_mode(forward_grad):
    # Kernels such as SDPA's pick their backend by whether inputs require grad: the default forward runs with grad
    # on (nothing saved), like standard checkpointing; forward_grad=False is torch's reentrant behaviour.
    probe = _GradModeProbe()
    manager = O.OffloadManager("cpu", buffers=2, prefetch=True, forward_grad=forward_grad)
    x = torch.randn(3, 4, requires_grad=True)
    y = O.offloaded_checkpoint(probe, x, manager=manager, module=probe)
    assert probe.seen == [(forward_grad, forward_grad)]
    assert y.requires_grad and y.grad_fn is not None and "_OffloadedLayer" in type(y.grad_fn).__name__
    y.sum().backward()
    assert probe.seen[-1] == (True, True)          # the recompute always runs with grad
    ref = x.detach().clone().requires_grad_(True)
    torch.tanh(probe.lin(ref)).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=0, atol=0)
