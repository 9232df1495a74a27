"""How far two computations of the same numbers may lie apart when they round differently,
derived from the dtype and the size of each sum.

Two computations that are the same in exact arithmetic (a chunked evaluation and an unchunked
one, the model's forward in a Spark task and on the driver) need not agree to the bit: the
order of a sum, the blocking of a matrix product and the use of fused multiply-adds follow
the shapes and the CPU's kernels (`torch.backends.cpu.get_cpu_capability()`, MKL's own
dispatch), so a test comparing them bitwise holds on one kind of CPU only. These bounds hold
for any order and either kind of kernel (Higham, Accuracy and Stability of Numerical
Algorithms, 2nd ed., section 3.1: a sum of n terms computed in any order lies within
gamma_n = n u / (1 - n u) of the exact one, relative to the sum of the terms' magnitudes,
u being half the dtype's epsilon; a product rounded once more counts as one more term)."""

from __future__ import annotations

import numpy as np
import torch


def unit_roundoff(dtype) -> float:
    """u: the largest relative error of one rounding to `dtype` (a torch or numpy dtype)."""
    if not isinstance(dtype, torch.dtype):
        return float(np.finfo(dtype).eps) / 2
    return float(torch.finfo(dtype).eps) / 2


def gamma(dtype, terms: int) -> float:
    """gamma_n for a sum of `terms` terms: how far one computation of it may lie from the
    exact value, relative to the sum of its terms' magnitudes."""
    nu = terms * unit_roundoff(dtype)
    assert nu < 0.1, f"{terms} terms in {dtype}: no useful bound"
    return nu / (1 - nu)


def sum_tolerance(dtype, terms: int) -> float:
    """How far two computations of a sum of `terms` terms may lie apart, relative to the sum
    of the terms' magnitudes: each within gamma_n of the exact sum, so twice that."""
    return 2 * gamma(dtype, terms)


LIPSCHITZ_1 = (torch.nn.ReLU, torch.nn.Tanh, torch.nn.Dropout, torch.nn.Identity)
"""Elementwise layers with |f(a) - f(b)| <= |a - b| and |f(a)| <= |a|: a difference and a
magnitude pass through them no larger."""


def forward_tolerance(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """How far two computations of `model(x)` may lie apart, per output element, for a
    `torch.nn.Sequential` (or a module holding one as `.net`) of Linear layers and
    `LIPSCHITZ_1` activations, evaluated in its parameters' dtype.

    Run the network on |x| with |W| and |b| (the "absolute network"): its output M_k at
    layer k bounds the magnitudes of that layer's terms. A Linear layer computing
    W h + b over `fan_in + 1` terms adds at most gamma |W| |h| + ... <= gamma M_k of its
    own, and passes what came in multiplied by |W|, which M_k also bounds; so each of L
    Linear layers adds at most gamma M_out at the output (first order in gamma), and two
    computations lie within 2 L gamma M_out of each other."""
    net = model.net if hasattr(model, "net") else model
    assert isinstance(net, torch.nn.Sequential), type(net)
    dtype = next(model.parameters()).dtype
    magnitude = x.detach().to(dtype).abs()
    linears, widest = 0, 0
    with torch.no_grad():
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                magnitude = magnitude @ layer.weight.abs().T
                if layer.bias is not None:
                    magnitude = magnitude + layer.bias.abs()
                linears += 1
                widest = max(widest, layer.in_features + 1)
            elif not isinstance(layer, LIPSCHITZ_1):
                raise TypeError(f"no rounding bound for {type(layer).__name__}")
    # the absolute network rounds too: one more gamma of slack covers it
    return 2 * (linears + 1) * gamma(dtype, widest) * magnitude
