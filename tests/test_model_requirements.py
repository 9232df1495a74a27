"""The logged model's requirements name what `fit(preprocess=)` uses (issue 31): the
third-party packages the function reaches through its globals, its imports (one inside the
function too), its closure, a partial's arguments or a callable object's class, each mapped to
its distribution and pinned to the installed version; the standard library and this library
left out. (The logged model's own requirements.txt: tests/test_image_source.py.)"""

from __future__ import annotations

import functools
import importlib.metadata
import json

import numpy as np

from sparkdl_avg.tracking.requirements import model_requirements, preprocess_distributions

PILLOW = importlib.metadata.version("pillow")
NUMPY = importlib.metadata.version("numpy")


def _open(data: bytes):
    from PIL import Image  # imported where it is used: seen in the code, not the globals

    return Image


def _decode(batch, *, training, rng):  # PIL through a helper, numpy as a global
    return {"x": np.asarray(_open(batch["x"]))}


class _Decoder:
    def __init__(self, scale) -> None:
        self.scale = scale

    def __call__(self, batch, *, training, rng):
        return {"x": json.loads(batch["x"]) * self.scale}  # json: the standard library


def test_a_preprocess_pins_what_it_reaches_and_nothing_else():
    assert preprocess_distributions(_decode) == {"pillow": PILLOW, "numpy": NUMPY}
    assert preprocess_distributions(None) == {}
    assert preprocess_distributions(lambda batch, **_: batch) == {}
    assert preprocess_distributions(_Decoder(2)) == {}  # json only
    assert preprocess_distributions(_Decoder(np.float32(2))) == {"numpy": NUMPY}
    closure = (lambda decode: lambda batch, **k: decode(batch, **k))(_decode)
    assert preprocess_distributions(closure) == {"pillow": PILLOW, "numpy": NUMPY}
    partial = functools.partial(lambda table, batch, **_: batch, np.zeros(2))
    assert preprocess_distributions(partial) == {"numpy": NUMPY}


def test_the_requirements_pin_torch_and_mlflow_first_then_the_preprocess():
    import mlflow
    import torch

    torch_pin = f"torch=={torch.__version__.split('+')[0]}"
    assert model_requirements() == [torch_pin, f"mlflow=={mlflow.__version__}"]
    assert model_requirements(_decode)[2:] == [f"pillow=={PILLOW}", f"numpy=={NUMPY}"]
