"""Shared-memory regions: where a worker and the driver share a host, the parameters of the
"driver" transport skip loopback TCP (two kernel copies and a wake-up per chunk each way).

A region is a file in /dev/shm (mode 0600) that both processes map. Its first bytes hold a
random token, sent only over the authenticated connection: a peer that can open the file
*and* read the token is on this host and is the peer that created it, so nothing is shared
by guesswork (a container with its own /dev/shm, another user, or another host simply
finds no such region, and the pair keeps to TCP). Frames then name the region instead of
carrying the bytes (`frames.Connection`). A worker unlinks its file once the driver has
mapped it (the driver unlinks it on mapping it, the worker on hearing so); the driver keeps
its own linked for workers that join later, until it closes.
Whatever fails here (no room, a mapping refused) means TCP, never a failed fit.

A file left by a process that was killed before it could unlink is removed by the next
region made on the host (`_sweep`): its name carries the creator's pid. (Where processes with
their own pid namespaces share /dev/shm, a live region may look dead; removing its name only
sends a peer that has not mapped it yet over TCP: mapped memory stays.)
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import mmap
import os
import re
import secrets
from pathlib import Path

import numpy as np

log = logging.getLogger("sparkdl_avg")
FOLDER = Path("/dev/shm")
PREFIX = "sparkdl-avg-"
_NAME = re.compile(rf"{PREFIX}(\d{{1,10}})-[0-9a-f]{{16}}")
"""A region's file: the creator's pid, then 8 random bytes."""
_TOKEN_BYTES = 16
REFERENCE = re.compile(rf"(?P<file>{_NAME.pattern}):(?P<token>[0-9a-f]{{{2 * _TOKEN_BYTES}}})")
"""What a peer is told (`SharedRegion.name`): the file, then the token in hex."""
HEADER = 64
"""The token, then padding: the data starts 64-byte aligned."""


class SharedRegion:
    """`nbytes` of shared memory after a header; `data` views them, `array(dtype, n)` too."""

    def __init__(self, path: Path, fd: int, nbytes: int, token: bytes, owner: bool) -> None:
        self.path, self.nbytes, self.token, self.owner = path, nbytes, token, owner
        try:
            self._map = mmap.mmap(fd, HEADER + nbytes)
        finally:
            os.close(fd)
        self.data = memoryview(self._map)[HEADER:]
        self.address = np.frombuffer(self.data, np.uint8).ctypes.data

    @property
    def name(self) -> str:
        """What the peer is told: the file's name and the token, as `name:hex`."""
        return f"{self.path.name}:{self.token.hex()}"

    @classmethod
    def create(cls, nbytes: int) -> SharedRegion | None:
        """A new region of `nbytes`, or None where the host cannot give one (no /dev/shm, or
        too little room: the memory is reserved now, so a full tmpfs fails here, not with a
        SIGBUS mid-fit)."""
        if not FOLDER.is_dir():
            return None
        with contextlib.suppress(OSError):
            _sweep()
        token = secrets.token_bytes(_TOKEN_BYTES)
        path = FOLDER / f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            log.info("no shared memory for the parameters (%s): they go over TCP", exc)
            return None
        try:
            os.posix_fallocate(fd, 0, HEADER + nbytes)
            os.pwrite(fd, token, 0)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            log.info("no shared memory for %d MB of parameters (%s): they go over TCP",
                     nbytes >> 20, os.strerror(exc.errno or errno.EIO))
            return None
        try:
            return cls(path, fd, nbytes, token, owner=True)
        except (OSError, ValueError) as exc:  # the mapping refused
            path.unlink(missing_ok=True)
            log.info("no shared memory for the parameters (%s): they go over TCP", exc)
            return None

    @classmethod
    def attach(cls, name: str, nbytes: int) -> SharedRegion | None:
        """The peer's region `name` (as `SharedRegion.name` gives it), if it is on this host,
        ours, of exactly `nbytes`, and holds its token; else None."""
        reference = REFERENCE.fullmatch(name)
        if reference is None:
            return None  # only our own names: never a path elsewhere
        path, token = FOLDER / reference["file"], bytes.fromhex(reference["token"])
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            return None  # another host, container or user
        try:
            info = os.fstat(fd)
            if info.st_uid != os.getuid() or info.st_size != HEADER + nbytes or \
                    not hmac.compare_digest(os.pread(fd, _TOKEN_BYTES, 0), token):
                os.close(fd)
                return None
        except OSError:
            os.close(fd)
            return None
        try:
            return cls(path, fd, nbytes, token, owner=False)
        except (OSError, ValueError):
            return None

    def array(self, dtype: np.dtype, numel: int) -> np.ndarray | None:
        """The first `numel` values of `dtype` in the region, or None if they do not fit."""
        dtype = np.dtype(dtype)
        if numel * dtype.itemsize > self.nbytes:
            return None
        return np.frombuffer(self.data, dtype, numel)

    def holds(self, view: memoryview) -> bool:
        """Whether `view` is the region's first `view.nbytes` bytes (then a frame only names
        it)."""
        return view.nbytes <= self.nbytes and view.nbytes > 0 and \
            np.frombuffer(view, np.uint8).ctypes.data == self.address

    def unlink(self, *, peers: bool = False) -> None:
        """Remove the file (our own region's, once the peer has it mapped; `peers`: the
        peer's, which only we map): the memory stays until both unmap it."""
        if self.owner or peers:
            self.path.unlink(missing_ok=True)

    def close(self) -> None:
        """Unlink (if ours) and unmap; a view still held (a result the caller keeps) keeps the
        mapping alive until it is dropped."""
        self.unlink()
        with contextlib.suppress(BufferError):
            self.data.release()
            self._map.close()


def _sweep() -> None:
    """Remove regions whose creator no longer runs (killed before it could unlink them)."""
    uid = os.getuid()
    for path in FOLDER.glob(f"{PREFIX}*"):
        match = _NAME.fullmatch(path.name)
        if match is None:
            continue
        with contextlib.suppress(OSError):
            if path.stat().st_uid == uid and not _running(int(match.group(1))):
                path.unlink()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # not provably dead: kept
    return True
