"""Double backward (``create_graph=True``: gradient penalties, Hessian-vector products) through
cudnorm's own path (``policy="cudnn"``, set for every test in conftest) equals PyTorch's
double backward of the same formula: the first gradients are differentiable graphs, and the
second derivatives for every input (and ``dy``) match."""

import pytest
import torch
import torch.nn.functional as F

import cudnorm

D = 64


def _cases(device):
    g = torch.Generator().manual_seed(0)

    def make(*shape, scale=1.0, offset=0.0):
        return (offset + scale * torch.randn(shape, generator=g)).to(device).requires_grad_()

    x, w, b = make(6, 5, D), make(D, scale=0.1, offset=1.0), make(D, scale=0.1)
    xa, sc, sh = make(3, 7, D), make(3, D, scale=0.1), make(3, D, scale=0.1)
    return [
        ("layer_norm", (x, w, b), lambda x, w, b: cudnorm.layer_norm(x, (D,), w, b, 1e-5),
         lambda x, w, b: F.layer_norm(x, (D,), w, b, 1e-5)),
        ("rms_norm", (x, w), lambda x, w: cudnorm.rms_norm(x, (D,), w, 1e-6),
         lambda x, w: F.rms_norm(x, (D,), w, 1e-6)),
        ("ada_layer_norm dit", (xa, sc, sh), lambda x, s, t: cudnorm.ada_layer_norm(x, s, t, 1e-6, one_plus_scale=True),
         lambda x, s, t: F.layer_norm(x, (D,), eps=1e-6) * (1 + s[:, None]) + t[:, None]),
        ("ada_layer_norm", (xa, sc, sh), lambda x, s, t: cudnorm.ada_layer_norm(x, s, t, 1e-6),
         lambda x, s, t: F.layer_norm(x, (D,), eps=1e-6) * s[:, None] + t[:, None]),
    ]


def _second_derivatives(fn, inputs):
    """A gradient penalty: grad of sum(first grads ** 2) w.r.t. the inputs and dy."""
    y = fn(*inputs)
    dy = torch.linspace(-1, 1, y.numel(), device=y.device).view(y.shape).requires_grad_()
    first = torch.autograd.grad(y, inputs, dy, create_graph=True)
    penalty = sum(g.square().sum() for g in first)
    return torch.autograd.grad(penalty, (*inputs, dy), allow_unused=True)


def _check(device):
    for name, inputs, mine, theirs in _cases(device):
        got, want = _second_derivatives(mine, inputs), _second_derivatives(theirs, inputs)
        for i, (a, e) in enumerate(zip(got, want)):
            assert (a is None) == (e is None), (name, i)
            if a is not None:
                torch.testing.assert_close(a, e, atol=2e-4, rtol=2e-4, msg=f"{name}: input {i}")


def test_double_backward_matches_pytorch_cpu():
    _check("cpu")


@pytest.mark.gpu
def test_double_backward_matches_pytorch_gpu():
    _check("cuda")  # forwards on cuDNN graphs (fp32), double backward through PyTorch's ops


def test_plain_backward_still_runs_cudnorms_backward():
    x = torch.randn(4, D, requires_grad=True)
    y = cudnorm.rms_norm(x, (D,), None, 1e-6)
    assert "Function" in type(y.grad_fn).__name__
    (g,) = torch.autograd.grad(y.sum(), x)  # create_graph=False: the op's own backward
    assert g.grad_fn is None
