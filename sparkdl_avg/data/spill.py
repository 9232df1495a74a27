"""Where a task spills its partition: a folder of its own under one of Spark's local
directories on the executor, checked for room before a byte is written and removed on every
path out. Folders left by killed tasks are removed by later ones, but only once the process
that made them is gone, so fits running side by side never touch each other's files."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

from sparkdl_avg._errors import DataCacheError

SPILL_FOLDER = "sparkdl-avg-spill"
_MIB = 1 << 20


def local_dirs() -> list[str]:
    """Spark's local directories on this executor (`spark.local.dir`, which Spark hands its
    Python workers as SPARK_LOCAL_DIRS); the system's temporary folder outside Spark."""
    dirs = [d for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if d]
    return dirs or [tempfile.gettempdir()]


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks after boot): a pid with another start time is
    another process that reused the number. None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(b")", 1)[1].split()[19].decode()


def _owner_gone(name: str) -> bool:
    pid, _, rest = name.partition("-")
    started, _, _ = rest.partition("-")
    if not pid.isdigit():
        return False
    return _start_time(int(pid)) != started


class SpillDir:
    """A folder for one task's spill files; `with SpillDir.create(...)` removes it on exit."""

    def __init__(self, path: str) -> None:
        self.path = path

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
            problem = _unusable(base, needed_bytes)
            if problem is None:
                root = os.path.join(base, SPILL_FOLDER)
                os.makedirs(root, exist_ok=True)
                remove_orphans(root)
                me = os.getpid()
                path = os.path.join(root, f"{me}-{_start_time(me)}-{uuid.uuid4().hex[:12]}")
                os.mkdir(path, 0o700)
                return cls(path)
            problems.append(f"{base}: {problem}")
        raise DataCacheError(
            f"no local directory can hold this task's data cache ({needed_bytes / _MIB:.1f} "
            f"MiB needed): {'; '.join(problems)}. Point spark.local.dir (SPARK_LOCAL_DIRS) "
            "at a writable disk with room, or raise cache_budget_mb to keep the partition in "
            "memory")

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)

    def __enter__(self) -> SpillDir:
        return self

    def __exit__(self, *exc_info) -> None:
        self.remove()


def _unusable(base: str, needed_bytes: int) -> str | None:
    if not os.path.isdir(base):
        return "does not exist"
    if not os.access(base, os.W_OK | os.X_OK):
        return "is not writable"
    free = _free_bytes(base)
    if free < needed_bytes:
        return f"has {free / _MIB:.1f} MiB free"
    return None


def _free_bytes(path: str) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def remove_orphans(root: str) -> list[str]:
    """Remove spill folders under `root` whose owning process is gone; returns them."""
    removed = []
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        if _owner_gone(name):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            removed.append(name)
    return removed
