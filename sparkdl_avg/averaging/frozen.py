"""What a replica keeps of its own build and never sends: the frozen tensors, and their
fingerprint. Every replica builds them with `model_fn`; the fit checks, before training, that
each replica's fingerprint is the driver's (or, with `driver_model="meta"`, the executor
build's), and a checkpoint records it, so a resume over other frozen weights is refused."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from sparkdl_avg.averaging.flat_buffer import averaged_tensors, persistent_buffers


def frozen_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor), in a fixed order: the parameters that do not require gradients, then
    the persistent buffers of the modules in eval mode (a frozen BatchNorm's statistics).
    Not among them: what trains (`averaged_tensors`), a training module's other buffers (its
    counters), and constants a module derives (non-persistent buffers)."""
    trained = {id(t) for t in averaged_tensors(model)}
    found = [(name, p) for name, p in model.named_parameters() if id(p) not in trained]
    return found + [(name, b) for name, b, training in persistent_buffers(model)
                    if not training and id(b) not in trained]


def _digest(t: torch.Tensor) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """The frozen tensors' names and a digest of each (dtype, shape and bytes)."""

    names: tuple[str, ...]
    digests: tuple[str, ...]

    @classmethod
    def of(cls, model: torch.nn.Module) -> Fingerprint:
        tensors = frozen_tensors(model)
        if any(t.is_meta for _, t in tensors):
            raise ValueError("a model on the meta device has no frozen values to fingerprint")
        return cls(tuple(n for n, _ in tensors), tuple(_digest(t) for _, t in tensors))

    @property
    def digest(self) -> str:
        """One digest of them all (a checkpoint's fingerprint compares it)."""
        return hashlib.blake2b("".join(f"{n}={d};" for n, d in zip(
            self.names, self.digests, strict=True)).encode(), digest_size=12).hexdigest()

    def to_dict(self) -> dict:
        return {"digest": self.digest, "tensors": [list(p) for p in zip(
            self.names, self.digests, strict=True)]}

    @classmethod
    def from_dict(cls, d: dict) -> Fingerprint:
        pairs = d.get("tensors", [])
        return cls(tuple(str(n) for n, _ in pairs), tuple(str(h) for _, h in pairs))

    def difference(self, other: Fingerprint) -> str | None:
        """Where `other` first differs, in words; None if it does not."""
        for i, (name, digest) in enumerate(zip(self.names, self.digests, strict=False)):
            if i >= len(other.names) or other.names[i] != name:
                theirs = other.names[i] if i < len(other.names) else "nothing"
                return (f"frozen tensor {i} is {name!r} in one and {theirs!r} in the other "
                        "(not the same model)")
            if other.digests[i] != digest:
                return f"the first differing frozen tensor is {name!r}"
        if len(other.names) > len(self.names):
            return f"one has a frozen tensor {other.names[len(self.names)]!r} the other lacks"
        return None
