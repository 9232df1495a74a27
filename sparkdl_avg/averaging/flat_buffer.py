"""A replica's averaged tensors in one flat buffer, and its host copy for the wire."""

from __future__ import annotations

import numpy as np
import torch


def averaged_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """What trains, so what is averaged, in a fixed order: the parameters that require
    gradients, then the floating buffers of the modules in training mode (BatchNorm's
    statistics; a frozen backbone in eval mode keeps its own). Everything else is frozen:
    each replica builds it with `model_fn` and it never travels (`averaging.frozen`)."""
    tensors = trainable_parameters(model)
    return tensors + [b for _, b in _training_buffers(model) if b.is_floating_point()]


def trainable_parameters(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters that require gradients: the first of `averaged_tensors`, and what an
    outer optimizer steps."""
    return [p for p in model.parameters() if p.requires_grad]


def counted_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The integer buffers of the modules in training mode, by name (BatchNorm's
    `num_batches_tracked`): they change in training but are not averaged, so checkpoints
    carry them. Boolean buffers (attention masks) are constants and stay."""
    return {name: b for name, b in _training_buffers(model)
            if not b.is_floating_point() and b.dtype != torch.bool}


def _training_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, buffer) of the modules in training mode, each buffer once, in
    `named_buffers()` order; never a non-persistent one (`persistent_buffers`)."""
    return [(name, b) for name, b, training in persistent_buffers(model) if training]


def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor, bool]]:
    """(name, buffer, its module's training mode) of the buffers a state dict holds, each
    once. A non-persistent buffer (a rotary embedding's `inv_freq`, a causal mask) is a
    constant the module derives when built: neither state that trains nor frozen weights,
    and possibly uninitialised memory (`torch.empty`)."""
    seen: set[int] = set()
    found = []
    for prefix, module in model.named_modules():
        skip = module._non_persistent_buffers_set
        for name, b in module.named_buffers(prefix=prefix, recurse=False):
            if b is not None and name.rpartition(".")[2] not in skip and id(b) not in seen:
                seen.add(id(b))
                found.append((name, b, module.training))
    return found


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """Parameters travel and are averaged in float64 for float64 models, else float32
    (numpy, and so the wire, has no bfloat16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class WireBuffer:
    """A flat tensor on its device (`flat`) and its host copy for the wire (`host`, the same
    tensor on the CPU in the wire's dtype; `array` is its numpy view). What a transport
    averages: `FlatBuffer`, or overlap's detached `Snapshot`."""

    flat: torch.Tensor
    host: torch.Tensor
    array: np.ndarray

    def gather(self) -> np.ndarray:
        """The tensors' current values in `array`."""
        if self.host is not self.flat:
            self.host.copy_(self.flat, non_blocking=True)
            sync_device(self.flat)
        return self.array

    def scatter(self) -> None:
        """`array`'s values (e.g. a received average) into the tensors."""
        if self.host is not self.flat:
            self.flat.copy_(self.host, non_blocking=True)
            sync_device(self.flat)


class FlatBuffer(WireBuffer):
    """The tensors re-homed into one contiguous tensor, and its host copy for the wire.

    Each tensor's storage becomes a view of `flat` (`t.data = view`), so the module and the
    optimizer keep working on the same objects while the whole set moves as one block. On the
    CPU with the wire's dtype, `flat` *is* the wire buffer: no copies at all. On a GPU, one
    pinned host buffer takes one non-blocking copy each way."""

    def __init__(self, tensors: list[torch.Tensor], wire_dtype: torch.dtype,
                 host: np.ndarray | None = None) -> None:
        """`host`: memory for `flat` where it is the wire buffer (the CPU, the wire's dtype;
        a shared-memory region: `Transport.host_buffer`), if it holds exactly the tensors."""
        first = tensors[0]
        numel = sum(t.numel() for t in tensors)
        if host is not None and host.size == numel and first.device.type == "cpu" \
                and first.dtype == wire_dtype:
            self.flat = torch.from_numpy(host)
        else:
            self.flat = torch.empty(numel, dtype=first.dtype, device=first.device)
        offset = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                placed = _same_layout(self.flat[offset:offset + n], t)
                placed.copy_(t)
                t.data = placed
                offset += n
        if first.device.type == "cpu" and first.dtype == wire_dtype:
            self.host = self.flat
        else:
            self.host = torch.empty(numel, dtype=wire_dtype,
                                    pin_memory=first.device.type == "cuda")
        self.array = self.host.numpy()


def _same_layout(segment: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """`segment` shaped as `t`, keeping a channels_last layout (a conv model converted with
    `model.to(memory_format=torch.channels_last)` stays so, and its kernels fast)."""
    for fmt, dims in ((torch.channels_last, 4), (torch.channels_last_3d, 5)):
        if t.dim() == dims and not t.is_contiguous() and t.is_contiguous(memory_format=fmt):
            return segment.as_strided(t.size(), t.stride())
    return segment.view_as(t)


def sync_device(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)
