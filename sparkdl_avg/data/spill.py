"""Where a task spills its partition: a folder of its own under one of Spark's local
directories on the executor, checked for room before a byte is written and removed on every
path out. Its owner holds an exclusive lock on a file inside for as long as it lives (the
kernel drops the lock when the process dies, however it dies), so a folder left by a killed
task is removed by a later one, and the folder of a fit running beside it, whose lock is
held, never is: in any process namespace, with no pid to trust."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
import uuid

from sparkdl_avg._errors import DataCacheError
from sparkdl_avg.data.cache import MIB

SPILL_FOLDER = "sparkdl-avg-spill"
LOCK_FILE = ".owner"
HALF_MADE_S = 3600.0
"""A hidden folder (one being made) older than this was left half-made by a killed task."""


def local_dirs() -> list[str]:
    """Spark's local directories on this executor (`spark.local.dir`, which Spark hands its
    Python workers as SPARK_LOCAL_DIRS); the system's temporary folder outside Spark."""
    dirs = [d for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if d]
    return dirs or [tempfile.gettempdir()]


class SpillDir:
    """A folder for one task's spill files; `with SpillDir.create(...)` removes it on exit."""

    def __init__(self, path: str, lock_fd: int) -> None:
        self.path, self._lock_fd = path, lock_fd

    @classmethod
    def create(cls, needed_bytes: int, *, dirs: list[str] | None = None,
               rank: int = 0) -> SpillDir:
        """A fresh folder in the first local directory (from this worker's turn in the list)
        with room for `needed_bytes`. Raises DataCacheError naming every directory tried and
        why none would do."""
        dirs = dirs or local_dirs()
        problems = []
        for i in range(len(dirs)):
            base = dirs[(rank + i) % len(dirs)]
            problem = unusable(base, needed_bytes)
            if problem is None:
                root = os.path.join(base, SPILL_FOLDER)
                os.makedirs(root, exist_ok=True)
                remove_orphans(root)
                return cls._locked_folder(root)
            problems.append(f"{base}: {problem}")
        raise DataCacheError(
            f"no local directory can hold this task's data cache ({needed_bytes / MIB:.1f} "
            f"MiB needed): {'; '.join(problems)}. Point spark.local.dir (SPARK_LOCAL_DIRS) "
            "at a writable disk with room, or raise cache_budget_mb to keep the partition in "
            "memory")

    @classmethod
    def _locked_folder(cls, root: str) -> SpillDir:
        """Made under a hidden name, locked, then renamed into place: a cleaner never sees
        a visible folder whose lock is not held yet."""
        name = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        making = os.path.join(root, f".{name}")
        os.mkdir(making, 0o700)
        fd = os.open(os.path.join(making, LOCK_FILE), os.O_CREAT | os.O_WRONLY, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            path = os.path.join(root, name)
            os.rename(making, path)
        except BaseException:
            os.close(fd)
            shutil.rmtree(making, ignore_errors=True)
            raise
        return cls(path, fd)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> SpillDir:
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()


def unusable(base: str, needed_bytes: int) -> str | None:
    """Why `base` cannot hold `needed_bytes` of spill files; None if it can."""
    if not os.path.isdir(base):
        return "does not exist"
    if not os.access(base, os.W_OK | os.X_OK):
        return "is not writable"
    free = _free_bytes(base)
    if free < needed_bytes:
        return f"has {free / MIB:.1f} MiB free"
    return None


def _free_bytes(path: str) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def remove_orphans(root: str) -> list[str]:
    """Remove the spill folders under `root` whose owner is gone (their lock is free), and
    half-made ones older than HALF_MADE_S; returns their names."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        folder = os.path.join(root, name)
        if name.startswith("."):
            if _age_s(folder) > HALF_MADE_S:
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(name)
            continue
        try:
            fd = os.open(os.path.join(folder, LOCK_FILE), os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its owner is alive
            continue
        else:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(name)
        finally:
            os.close(fd)
    return removed


def _age_s(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return 0.0
