"""Fake GPUs for the executors of `cluster_fits.py` (on their PYTHONPATH, so every Python
worker imports this first). While the JSON file named by SPARKDL_AVG_FAKE_CUDA exists, torch
sees the GPUs it describes, read afresh on every call so one application can try several
layouts: {"visible": what CUDA_VISIBLE_DEVICES says (physical ids)}. Device i's UUID names its
physical id ("fake-<id>"). `set_device` writes "<pid> <device>" to the file's ".set" sibling
and fails, as a fake GPU cannot run anything. Without the file, torch is untouched."""

import json
import os
import sys
from types import SimpleNamespace

_PATH = os.environ.get("SPARKDL_AVG_FAKE_CUDA")


def _layout():
    try:
        with open(_PATH) as f:
            return json.load(f)
    except OSError:
        return None


def _install() -> None:
    import torch

    real = {name: getattr(torch.cuda, name)
            for name in ("is_available", "device_count", "get_device_properties", "set_device")}

    def visible(layout):
        return [d for d in layout["visible"].split(",") if d]

    def is_available():
        layout = _layout()
        if layout is None:
            return real["is_available"]()
        os.environ["CUDA_VISIBLE_DEVICES"] = layout["visible"]  # as the executor would have
        sys.modules.pop("pynvml", None)  # imported before the fake: import it afresh
        return True

    def device_count():
        layout = _layout()
        return real["device_count"]() if layout is None else len(visible(layout))

    def get_device_properties(index):
        layout = _layout()
        if layout is None:
            return real["get_device_properties"](index)
        return SimpleNamespace(uuid=f"fake-{visible(layout)[index]}", name="Fake GPU")

    def set_device(device):
        if _layout() is None:
            return real["set_device"](device)
        with open(_PATH + ".set", "a") as f:
            f.write(f"{os.getpid()} {device}\n")
        raise RuntimeError(f"CUDA error: {device} is a fake GPU (test)")

    torch.cuda.is_available, torch.cuda.device_count = is_available, device_count
    _hide_nvml()
    torch.cuda.get_device_properties, torch.cuda.set_device = get_device_properties, set_device


def _hide_nvml() -> None:
    """On a machine with real GPUs, NVML would describe those, not the fake ones: while the
    GPUs are faked, `import pynvml` fails as on a machine without nvidia-ml-py, and the
    CUDA_VISIBLE_DEVICES rule applies."""
    import importlib.abc

    class Hidden(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "pynvml" and _layout() is not None:
                raise ModuleNotFoundError("pynvml is hidden while the GPUs are faked")
            return None

    sys.meta_path.insert(0, Hidden())
    sys.modules.pop("pynvml", None)


if _PATH:
    _install()
