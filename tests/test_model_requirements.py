"""The logged model's requirements name what `fit(preprocess=)` uses (issue 31): the
third-party packages the function reaches through its globals, its absolute imports (one
inside the function too), its closure, a partial's arguments, a callable object's class and
its user base classes, or a builtin function's module, each mapped to the distribution holding
it and pinned to the installed version without a local label; cloudpickle beside them; the
standard library, this library and editable or local installs left out. The walk is bounded
without recursion, strings do not use up its bound, and its failure only warns. (The logged
model's own requirements.txt: tests/test_image_source.py.)"""

from __future__ import annotations

import functools
import importlib.metadata
import json

import numpy as np
import pytest
from numpy import frombuffer

from sparkdl_avg.tracking import requirements
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
    cloudpickle = f"cloudpickle=={importlib.metadata.version('cloudpickle')}"
    # the preprocess is stored cloudpickled: loading it needs cloudpickle
    assert model_requirements(_decode)[2:] == [cloudpickle, f"numpy=={NUMPY}",
                                               f"pillow=={PILLOW}"]


def _local_decode(batch, *, training, rng):  # this library's code, as a user's would be
    from sparkdl_avg._model import is_installed_file

    return is_installed_file(batch)


def test_an_editable_or_local_install_is_the_users_code_not_a_pin(monkeypatch):
    from sparkdl_avg._model import is_installed_file

    notebook = "/local_disk0/.ephemeral_nfs/envs/pythonEnv-1/lib/python3.11/site-packages"
    assert is_installed_file(f"{notebook}/PIL/__init__.py")  # a %pip install: pinned
    assert not is_installed_file("/home/me/project/helpers/__init__.py")
    monkeypatch.setattr(requirements, "_OURS", "not_this_library")  # sparkdl-avg: editable
    assert "sparkdl-avg" not in preprocess_distributions(_local_decode)
    every = importlib.metadata.distributions
    direct_url = {"dir_info": {}, "url": "file:///home/me/pkg"}  # a local folder

    class Fake:  # what an installed distribution says of where it came from
        files = None

        def read_text(self, name):
            return json.dumps(direct_url) if name == "direct_url.json" else None

    monkeypatch.setattr(importlib.metadata, "distributions",
                        lambda name=None, **kw: [Fake()] if name else every(**kw))
    assert preprocess_distributions(_decode) == {}
    direct_url = {"vcs_info": {"vcs": "git"}, "url": "https://example.com/pkg.git"}
    assert preprocess_distributions(_decode) == {}
    direct_url = {"archive_info": {}, "url": "https://example.com/pkg.whl"}
    assert preprocess_distributions(_decode) == {"pillow": PILLOW, "numpy": NUMPY}


LABELS = [f"label-{i}" for i in range(3000)]


def _labelled(batch, *, training, rng):  # 3000 strings read before PIL's open
    return {"x": _open(batch["x"]), "names": [LABELS[i] for i in batch["y"]]}


def test_strings_do_not_use_up_the_bound_and_the_bound_warns(caplog):
    import logging

    assert preprocess_distributions(_labelled) == {"pillow": PILLOW}
    many = [_Decoder(i) for i in range(requirements._MAX_OBJECTS)]
    with caplog.at_level(logging.WARNING, "sparkdl_avg"):
        preprocess_distributions(lambda batch, **_: many)
    assert "stopped reading what preprocess uses" in caplog.text


class _Base:
    def __call__(self, batch, *, training, rng):
        return {"x": _open(batch["x"])}


class _Inherits(_Base):
    pass


def _relative(batch, *, training, rng):
    from .yaml import load  # the user's own package's yaml module, not PyYAML

    return load(batch)


def test_builtin_functions_inherited_calls_and_relative_imports():
    assert preprocess_distributions(lambda b, **_: frombuffer(b)) == {"numpy": NUMPY}
    assert preprocess_distributions(_Inherits()) == {"pillow": PILLOW}
    assert preprocess_distributions(_relative) == {}


class _Link:
    def __init__(self, after) -> None:
        self.after = after


def test_a_deep_chain_is_walked_and_a_failed_walk_only_warns(monkeypatch, caplog):
    import logging

    chain = np.zeros(1)
    for _ in range(900):
        chain = _Link(chain)
    assert preprocess_distributions(chain) == {"numpy": NUMPY}  # the array at its end

    def fail(self, root):
        raise RecursionError("deep")

    monkeypatch.setattr(requirements._Walk, "run", fail)
    with caplog.at_level(logging.WARNING, "sparkdl_avg"):
        assert [p.split("==")[0] for p in model_requirements(_decode)] == [
            "torch", "mlflow", "cloudpickle"]
    assert "could not read which packages preprocess uses" in caplog.text


def test_local_version_labels_are_dropped_for_every_package(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "2.0.0+cu121")
    assert preprocess_distributions(_decode) == {"pillow": "2.0.0", "numpy": "2.0.0"}


def test_a_namespace_package_module_pins_the_distribution_holding_it():
    pytest.importorskip("google.protobuf")

    def uses_protobuf(batch, *, training, rng):
        from google.protobuf import json_format

        return json_format

    version = importlib.metadata.version("protobuf")
    assert preprocess_distributions(uses_protobuf) == {"protobuf": version}
