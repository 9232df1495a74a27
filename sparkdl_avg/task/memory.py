"""The task process's resident memory (Linux /proc), to report what a task really used.

Spark reuses Python workers across tasks, so the peak is reset when a task starts
(`clear_refs`): the reported peak is this task's own, not an earlier one's."""

from __future__ import annotations


def _status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Restart the peak (VmHWM) from the current resident size; False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def resident_bytes() -> int | None:
    """Resident memory now (VmRSS); None off Linux."""
    return _status("VmRSS")


def peak_resident_bytes() -> int | None:
    """Peak resident memory since the last `reset_peak` (VmHWM); None off Linux."""
    return _status("VmHWM")


def release_task_memory() -> None:
    """After a task, on every path: Spark reuses the Python worker, so what the task cached
    would outlive it into the next fit or scoring task. Collect reference cycles (a model or a
    traceback can hold tensors in one), then hand CUDA's cached blocks and torch's pinned host
    cache back. What survives is frozen (`gc.freeze`): the modules and what they keep, which
    later collections then skip (torch's 300,000 objects cost a full one 0.15 s, on the fit's
    critical path); a later task's cycles are newer, and still collected."""
    import gc

    import torch

    gc.collect()
    gc.freeze()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        host_empty = getattr(torch._C, "_host_emptyCache", None)  # CUDA builds only
        if host_empty is not None:
            host_empty()
