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

from functools import partial

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


LAMBDA = 8.0
"""Higham and Mary's probabilistic bound (SIAM J. Sci. Comput. 41(5), 2019, theorem 2.4):
with rounding errors independent and of mean zero, a sum of n terms lies within
lambda sqrt(n) u (to first order) of the exact one, relative to the sum of its terms'
magnitudes, with probability at least 1 - 2 n exp(-lambda^2 (1 - u)^2 / 2): for lambda = 8
and n = 2000 terms, a failure in 10^10. The worst case, n u, is for a wide float32 layer
(2000 terms: 1.2e-4) looser than any claim worth testing."""


def probable_gamma(dtype, terms: int) -> float:
    """`gamma`, the probabilistic way (`LAMBDA`): lambda sqrt(n) u, for wide sums."""
    x = LAMBDA * terms ** 0.5 * unit_roundoff(dtype)
    assert x < 0.1, f"{terms} terms in {dtype}: no useful bound"
    return x / (1 - x)


LIPSCHITZ_1 = (torch.nn.ReLU, torch.nn.Tanh, torch.nn.Dropout, torch.nn.Identity)
"""Elementwise layers with |f(a) - f(b)| <= |a - b| and |f(a)| <= |a| (Dropout in eval
mode): a difference and a magnitude pass through them no larger."""


def forward_tolerance(model: torch.nn.Module, x: torch.Tensor, *,
                      probable: bool = False) -> torch.Tensor:
    """How far two computations of `model(x)` may lie apart, per output element, for a
    `torch.nn.Sequential` (or a module holding one as `.net`; nested ones are flattened) of
    Linear, Conv2d, BatchNorm1d in eval mode, MaxPool2d, AdaptiveAvgPool2d, Flatten and
    `LIPSCHITZ_1` layers, evaluated in its parameters' dtype.

    Carried through the layers in float64 (so the bound itself does not round): M, a bound
    on each value's magnitude (the "absolute network": |x|, then |W| M + |b|, ...), and E,
    a bound on how far the computed value lies from the exact one. A Linear layer over
    fan_in + 1 terms: E' = |W| E + gamma M' (with `probable`: E' = lambda sqrt(W^2 E^2) +
    `probable_gamma` M', the incoming errors taken as independent and of mean zero, as the
    roundings they come from, so that Hoeffding's inequality bounds their weighted sum);
    BatchNorm1d's affine map per feature, x s + c with |s| = |w| / sqrt(var + eps): E' =
    |s| E + gamma_4 M'; a convolution is a Linear layer over each window (C_in k^2 + 1
    terms); a max or a mean over a window moves no difference further apart (a mean rounds
    its sum too), nor do the `LIPSCHITZ_1` layers (Tanh also bounds M by 1). Two
    computations lie within 2 E of each other (to first order in u)."""
    net = model.net if hasattr(model, "net") else model
    assert isinstance(net, torch.nn.Sequential), type(net)
    dtype = next(model.parameters()).dtype
    g = probable_gamma if probable else gamma
    magnitude = x.detach().double().abs()
    error = torch.zeros_like(magnitude)
    with torch.no_grad():
        for layer in _flat(net):
            if isinstance(layer, torch.nn.Linear):
                magnitude = linear_magnitude(layer, magnitude)
                w = layer.weight.double()
                carried = (error ** 2 @ (w ** 2).T).sqrt() * LAMBDA if probable else \
                    error @ w.abs().T
                error = carried + g(dtype, layer.in_features + 1) * magnitude
            elif isinstance(layer, torch.nn.BatchNorm1d) and not layer.training:
                scale = (layer.running_var.double() + layer.eps).rsqrt()
                shift = layer.running_mean.double().abs() * scale
                if layer.affine:
                    scale = scale * layer.weight.double().abs()
                    shift = shift * layer.weight.double().abs() + layer.bias.double().abs()
                magnitude = magnitude * scale + shift
                error = error * scale + g(dtype, 4) * magnitude
            elif isinstance(layer, torch.nn.Conv2d):
                w, f = layer.weight.double(), torch.nn.functional.conv2d
                conv = partial(f, stride=layer.stride, padding=layer.padding,
                               dilation=layer.dilation, groups=layer.groups)
                magnitude = conv(magnitude, w.abs()) + (
                    0 if layer.bias is None else layer.bias.double().abs()[:, None, None])
                carried = (conv(error ** 2, w ** 2)).sqrt() * LAMBDA if probable else \
                    conv(error, w.abs())
                error = carried + g(dtype, w[0].numel() + 1) * magnitude
            elif isinstance(layer, (torch.nn.MaxPool2d, torch.nn.Flatten)):
                magnitude, error = layer(magnitude), layer(error)  # max: 1-Lipschitz
            elif isinstance(layer, torch.nn.AdaptiveAvgPool2d):
                window = magnitude[0, 0].numel() // max(1, layer(magnitude)[0, 0].numel())
                magnitude, error = layer(magnitude), layer(error)
                error = error + g(dtype, window + 1) * magnitude
            elif isinstance(layer, torch.nn.Tanh):
                magnitude = magnitude.clamp(max=1.0)
            elif not isinstance(layer, LIPSCHITZ_1) or layer.training and \
                    isinstance(layer, torch.nn.Dropout):
                raise TypeError(f"no rounding bound for {layer}")
    return 2 * error


def _flat(net: torch.nn.Sequential):
    for layer in net:
        if isinstance(layer, torch.nn.Sequential):
            yield from _flat(layer)
        else:
            yield layer


def linear_magnitude(layer: torch.nn.Linear, magnitude: torch.Tensor) -> torch.Tensor:
    """The absolute network's step through `layer`, in float64: |W| m + |b|, a bound on the
    magnitudes of the terms of each output's sum (`forward_tolerance`)."""
    with torch.no_grad():
        out = magnitude.double() @ layer.weight.double().abs().T
        return out + layer.bias.double().abs() if layer.bias is not None else out


def outputs_tolerance(dtype, terms: int, magnitude: torch.Tensor, layers: int = 1):
    """`forward_tolerance` for a network written out by hand (embeddings are exact lookups:
    their |rows| enter the magnitude): `layers` Linear layers whose widest sum has `terms`
    terms, `magnitude` the absolute network's output (`linear_magnitude`); each layer adds
    at most gamma M to how far one computation lies from the exact one."""
    return 2 * layers * gamma(dtype, terms) * magnitude


def classes_agree(predicted, logits, tolerance) -> bool:
    """Whether each row's `predicted` class is the argmax of `logits` ([rows, classes]),
    where a class whose logit lies within `tolerance` of the largest (computed elsewhere, it
    may round to the largest) counts as the argmax too."""
    logits = torch.as_tensor(np.asarray(logits, dtype=np.float64))
    tolerance = torch.as_tensor(np.asarray(tolerance, dtype=np.float64)).expand_as(logits)
    predicted = torch.as_tensor(np.asarray(predicted)).long().reshape(-1, 1)
    assert len(predicted) == len(logits), (len(predicted), len(logits))
    chosen = logits.gather(1, predicted)
    slack = tolerance.gather(1, predicted) + tolerance.max(1, keepdim=True).values
    return bool((chosen >= logits.max(1, keepdim=True).values - slack).all())


def probabilities_tolerance(probabilities, logit_tolerance):
    """How far softmax (or sigmoid) probabilities may lie apart when each logit of a row may
    lie `logit_tolerance` (elementwise, broadcast) from the other computation's: logits
    moving by at most d move p_i by a factor within exp(+-2d), so by at most expm1(2d) p_i;
    plus float64's own rounding of the softmax (its exp, sum and division: 8 u covers it)."""
    p = np.asarray(probabilities, dtype=np.float64)
    d = np.broadcast_to(np.asarray(logit_tolerance, dtype=np.float64), p.shape)
    if p.ndim:
        d = d.max(axis=-1, keepdims=True)
    return (np.expm1(2 * d) + 8 * unit_roundoff(np.float64)) * p


def within(got, want, tolerance) -> bool:
    """Whether |got - want| <= tolerance elementwise (in float64, shapes broadcast)."""
    got, want = (np.asarray(a, dtype=np.float64) for a in (got, want))
    assert got.shape == want.shape, (got.shape, want.shape)
    return bool(np.all(np.abs(got - want) <= np.asarray(tolerance, dtype=np.float64)))


def signs_agree(predicted, logits, tolerance) -> bool:
    """Whether `predicted` (0/1, or booleans) is `logits > 0` elementwise, a logit within
    `tolerance` of 0 counting either way (computed elsewhere, it may round across 0)."""
    logits, predicted = np.asarray(logits, dtype=np.float64), np.asarray(predicted)
    assert predicted.shape == logits.shape, (predicted.shape, logits.shape)
    same = (predicted > 0) == (logits > 0)
    return bool(np.all(same | (np.abs(logits) <= np.asarray(tolerance, dtype=np.float64))))


def near_ties(logits, tolerance) -> int:
    """Rows whose two largest logits lie within `tolerance` (elementwise, broadcast) of each
    other: computed elsewhere, their class may be either."""
    logits = torch.as_tensor(np.asarray(logits, dtype=np.float64))
    tolerance = torch.as_tensor(np.asarray(tolerance, dtype=np.float64)).expand_as(logits)
    top = logits.topk(2, dim=1).values
    return int((top[:, 0] - top[:, 1] <= 2 * tolerance.max(1).values).sum())


def evaluation_here(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *,
                    probable: bool = False):
    """(loss, loss_tolerance, accuracy, accuracy_tolerance): the evaluation a fit reports
    for `model` (a `forward_tolerance` network) on the rows (x, y) under cross_entropy,
    computed here, and how far the fit's own may lie from each. The fit computes the logits
    in its chunks (within `forward_tolerance` of these), each row's cross-entropy in the
    logits' dtype, and sums in float64: a row's cross-entropy moves by at most twice its
    largest logit's move, and its log-sum-exp rounds (C exps summed, a subtraction, a log
    and a difference, C + 4 roundings of terms of at most 2 max|z| + loss + 1); a row whose
    two largest logits lie within rounding may be scored either way. `probable`: as
    `forward_tolerance`."""
    with torch.no_grad():
        logits = model.eval()(x)
    apart = forward_tolerance(model, x, probable=probable)
    z = logits.double()
    per_row = torch.nn.functional.cross_entropy(z, y, reduction="none")
    rounded = (z.shape[1] + 4) * unit_roundoff(logits.dtype) * \
        (2 * z.abs().max(1).values + per_row + 1)
    loss = per_row.mean().item()
    loss_tolerance = (2 * apart.max(1).values.double() + rounded).mean().item() + \
        sum_tolerance(torch.float64, len(y) + 1) * loss
    accuracy = (z.argmax(1) == y).double().mean().item()
    return loss, loss_tolerance, accuracy, near_ties(z, apart) / len(y) + 1e-12
