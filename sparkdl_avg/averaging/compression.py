"""Compressed deltas (`TrainConfig.delta_compression`): pure numpy, one thread, in chunks.

A delta (the global parameters minus a replica, or the driver's update) is cut into blocks of
`BLOCK` values. "int8" and "int4" keep one float32 scale a block (its largest magnitude over
127 or 7) and each value as the nearest multiple of it, so no value is off by more than half
a step; "bf16" keeps each value's nearest bfloat16 (round to nearest even). The payload is the
scales, then the codes: `encoded_nbytes` of it for `numel` values.

`ErrorFeedback` keeps what quantization dropped and adds it to the next delta (Seide et al.
2014; Karimireddy et al. 2019): over the rounds nothing is lost, only late, which is what
makes 4 and 8 bits train like 32 (MuLoCo, SparseLoCo; INTELLECT-1 in 8 bits)."""

from __future__ import annotations

import typing
from typing import Literal

import numpy as np

Compression = Literal["none", "bf16", "int8", "int4"]
COMPRESSIONS: tuple[str, ...] = typing.get_args(Compression)
BLOCK = 256
"""Values per scale: 4 bytes of scale per 256 values (1.6% on int8, 3% on int4)."""
_LEVELS = {"int8": 127, "int4": 7}
_CHUNK = 1 << 16
"""Values per pass (a multiple of BLOCK): temporaries stay small and in cache."""
RESIDUAL = -3
"""The index under which a packed state (`task.worker_state.pack_entries`) holds an error
feedback's residual: a worker's, or the update's in the outer state."""


def bits(compression: str) -> int:
    """Bits a value takes on the wire (besides its block's scale)."""
    return {"bf16": 16, "int8": 8, "int4": 4}[compression]


def encoded_nbytes(compression: str, numel: int) -> int:
    """The payload's size for `numel` values."""
    if compression == "bf16":
        return 2 * numel
    blocks = -(-numel // BLOCK)
    codes = numel if compression == "int8" else -(-numel // 2)
    return 4 * blocks + codes


def _views(compression: str, payload: np.ndarray, numel: int):
    """(scales, codes) inside `payload` (uint8, `encoded_nbytes` long)."""
    if payload.dtype != np.uint8 or payload.size != encoded_nbytes(compression, numel):
        raise ValueError(f"a {compression} payload of {numel} values has "
                         f"{encoded_nbytes(compression, numel)} bytes, got {payload.size}")
    if compression == "bf16":
        return None, payload.view(np.uint16)
    blocks = -(-numel // BLOCK)
    return payload[:4 * blocks].view(np.float32), payload[4 * blocks:]


def encode(values: np.ndarray, compression: str, payload: np.ndarray) -> None:
    """`values` (float32 or float64, finite) into `payload` (uint8, `encoded_nbytes`)."""
    scales, codes = _views(compression, payload, values.size)
    for start in range(0, values.size, _CHUNK):
        chunk = values[start:start + _CHUNK]
        if compression == "bf16":
            codes[start:start + chunk.size] = _to_bf16(chunk)
            continue
        first = start // BLOCK
        blocks, tail = _blocks(chunk)
        levels = _LEVELS[compression]
        scale = (np.abs(blocks).max(axis=1) / levels).astype(np.float32)
        scales[first:first + len(scale)] = scale
        # divide by the scale as stored, in float64: the nearest step of what decode uses
        safe = np.where(scale > 0, scale, 1).astype(np.float64)
        q = np.rint(blocks / safe[:, None])
        np.clip(q, -levels, levels, out=q)
        q = q.reshape(-1)[:chunk.size] if tail else q.reshape(-1)
        if compression == "int8":
            codes[start:start + chunk.size] = q.astype(np.int8).view(np.uint8)
        else:
            _pack_nibbles(q, codes, start)


def decode(payload: np.ndarray, compression: str, out: np.ndarray) -> None:
    """A payload of `out.size` values back into `out` (float32 or float64)."""
    for start in range(0, out.size, _CHUNK):
        decode_range(payload, compression, out.size, start, out[start:start + _CHUNK])


def _blocks(chunk: np.ndarray) -> tuple[np.ndarray, bool]:
    """`chunk` as rows of BLOCK values, zero-padded at the end; whether it was padded."""
    if chunk.size % BLOCK == 0:
        return chunk.reshape(-1, BLOCK), False
    padded = np.zeros(-(-chunk.size // BLOCK) * BLOCK, chunk.dtype)
    padded[:chunk.size] = chunk
    return padded.reshape(-1, BLOCK), True


def _to_bf16(values: np.ndarray) -> np.ndarray:
    """Each value's nearest bfloat16 (ties to even), as its 16 bits."""
    bits32 = values.astype(np.float32).view(np.uint32)
    rounded = bits32 + (np.uint32(0x7FFF) + ((bits32 >> 16) & 1))
    out = (rounded >> 16).astype(np.uint16)
    nan = (bits32 & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    if nan.any():  # rounding would carry a NaN's mantissa out, into ±0 or ±inf: quiet NaN
        out[nan] = ((bits32[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)
    return out


def _pack_nibbles(q: np.ndarray, codes: np.ndarray, start: int) -> None:
    """Codes in [-7, 7] as 4-bit nibbles (plus 8), two a byte, the first in the low half;
    `start` is even (a chunk boundary)."""
    nib = (q + 8).astype(np.uint8)
    if nib.size % 2:
        nib = np.append(nib, np.uint8(8))
    codes[start // 2:start // 2 + nib.size // 2] = nib[0::2] | (nib[1::2] << 4)


def _unpack_nibbles(codes: np.ndarray, start: int, stop: int) -> np.ndarray:
    packed = codes[start // 2:-(-stop // 2)]
    nib = np.empty(2 * packed.size, np.int8)
    nib[0::2] = packed & 0x0F
    nib[1::2] = packed >> 4
    return nib[:stop - start] - 8


class ErrorFeedback:
    """One sender's compression with error feedback: each delta is sent with what earlier
    rounds' quantization dropped added to it, and what this one drops is kept for the next.
    So the sum of everything sent, plus `residual`, is the sum of the true deltas."""

    def __init__(self, compression: str, numel: int, dtype: np.dtype) -> None:
        self.compression = compression
        self.residual = np.zeros(numel, dtype)
        self._sent = np.empty(min(_CHUNK, numel), dtype)

    @property
    def nbytes(self) -> int:
        """The payload's size."""
        return encoded_nbytes(self.compression, self.residual.size)

    def encode(self, delta: np.ndarray, payload: np.ndarray) -> None:
        """`delta` plus the residual into `payload`; the residual becomes what it dropped.
        `delta` may be overwritten."""
        np.add(delta, self.residual, out=delta)
        encode(delta, self.compression, payload)
        self.residual[:] = delta
        # what the receiver decodes, subtracted chunk by chunk (scales cover whole blocks)
        for start in range(0, delta.size, _CHUNK):
            stop = min(start + _CHUNK, delta.size)
            sent = self._sent[:stop - start]
            decode_range(payload, self.compression, delta.size, start, sent)
            self.residual[start:stop] -= sent


def apply_update(global_: np.ndarray, payload: np.ndarray, compression: str) -> None:
    """G -= the update in `payload`, chunk by chunk: the same operations, so the same bits,
    on the driver and every worker."""
    scratch = np.empty(min(_CHUNK, global_.size), global_.dtype)
    for start in range(0, global_.size, _CHUNK):
        stop = min(start + _CHUNK, global_.size)
        update = scratch[:stop - start]
        decode_range(payload, compression, global_.size, start, update)
        global_[start:stop] -= update


def decode_range(payload: np.ndarray, compression: str, numel: int, start: int,
                 out: np.ndarray) -> None:
    """Values [start, start + out.size) of a payload of `numel` values into `out`; `start`
    is a multiple of BLOCK (and so even)."""
    scales, codes = _views(compression, payload, numel)
    stop = start + out.size
    if compression == "bf16":
        out[:] = (codes[start:stop].astype(np.uint32) << 16).view(np.float32)
        return
    q = codes[start:stop].view(np.int8) if compression == "int8" \
        else _unpack_nibbles(codes, start, stop)
    scale = np.repeat(scales[start // BLOCK:-(-stop // BLOCK)], BLOCK)[:stop - start]
    np.multiply(q, scale.astype(out.dtype), out=out)
