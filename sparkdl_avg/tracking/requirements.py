"""The logged model's pip requirements: torch and mlflow as installed, and with a
`fit(preprocess=)` function cloudpickle (the function is stored with it) and the third-party
distributions the function uses (a PNG decoder's Pillow), each pinned to the version
installed here without its local label (`+cpu`), so an environment MLflow builds for the
model can install them.

What the function uses is read from the objects it reaches, not guessed from names: the
globals its code names, the modules its code imports absolutely (an `import` inside the
function included; `from .utils import x` is the user's own package), its closure and
defaults, a partial's arguments, a callable object's class and the user's base classes, a
builtin function's module (numpy's `frombuffer`), and, through them, the user's own functions
and classes (the code that travels with the model: anything not from a distribution installed
in site-packages, or from this library; an editable or local-folder install is the user's).
An object from an installed distribution is pinned and not looked into: its own requirements
are its distribution's. A module of a namespace package (`google.protobuf`) is pinned to the
distribution whose files hold it. The standard library is left out.

Limits: a package the function reaches only through a name it computes (`importlib`,
`getattr` with a string), a `sys.modules` lookup or a file it executes is not seen; nor
past the first `_MAX_OBJECTS` objects (a warning says so). A failure of the walk itself logs
a warning and leaves the pins at torch, mlflow and cloudpickle: the model is still logged.
"""

from __future__ import annotations

import collections
import dis
import functools
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import sys
import types

from sparkdl_avg._model import is_installed_file

log = logging.getLogger("sparkdl_avg")
_OURS = "sparkdl_avg"
_MAX_OBJECTS = 2000
"""How many objects the walk visits at most: a bound on a pathological closure."""
_PRIMITIVES = (str, bytes, bytearray, int, float, complex, bool, type(None))
"""Values that name no package: neither counted nor looked into."""


def model_requirements(preprocess=None) -> list[str]:
    """`torch==...`, `mlflow==...`, then with `preprocess` `cloudpickle==...` and the
    distributions it uses, pinned."""
    import mlflow
    import torch

    pins = {"torch": _public(torch.__version__), "mlflow": _public(mlflow.__version__)}
    if preprocess is None:
        return [f"{name}=={version}" for name, version in pins.items()]
    pins["cloudpickle"] = _public(importlib.metadata.version("cloudpickle"))
    try:
        used = preprocess_distributions(preprocess)
    except Exception:  # noqa: BLE001 - after training: a missing pin beats a failed fit
        log.warning("could not read which packages preprocess uses; the logged model "
                    "requires only %s: install the others where it is loaded",
                    ", ".join(pins), exc_info=True)
        used = {}
    for name, version in used.items():
        pins.setdefault(name, version)
    return [f"{name}=={version}" for name, version in pins.items()]


def preprocess_distributions(fn) -> dict[str, str]:
    """{distribution name (normalised): installed version} of the third-party packages `fn`
    reaches (see the module's docstring), by name; {} for None."""
    if fn is None:
        return {}
    walk = _Walk(importlib.metadata.packages_distributions())
    walk.run(fn)
    out = {}
    for dist in walk.found:
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:  # a stale mapping: skip it
            continue
        out.setdefault(re.sub(r"[-_.]+", "-", dist).lower(), _public(version))
    return dict(sorted(out.items()))


def _public(version: str) -> str:
    """A version without its local label (`2.3.0+cu121`): no index serves that."""
    return version.split("+")[0]


class _Walk:
    """Visits the objects a function reaches with an explicit stack (a deep chain of the
    user's objects is no recursion), each once, at most `_MAX_OBJECTS`."""

    def __init__(self, owners: dict) -> None:
        self.owners = owners
        self.found: set[str] = set()
        """The distributions to pin."""
        self.seen: dict[int, object] = {}
        """By id, holding each object: a temporary's id is not reused while the walk runs."""
        self.stack: list = []
        self._dists: dict[str, list[str] | None] = {}
        self._noted_types: set[type] = set()

    def run(self, root) -> None:
        self.stack = [root]
        while self.stack:
            obj = self.stack.pop()
            if id(obj) in self.seen or type(obj) in self._noted_types:
                continue
            if len(self.seen) >= _MAX_OBJECTS:
                log.warning("stopped reading what preprocess uses after %d objects: a "
                            "package it reaches only past them is not in the logged model's "
                            "requirements", _MAX_OBJECTS)
                return
            self.seen[id(obj)] = obj
            self._step(obj)

    def _push(self, items) -> None:
        self.stack.extend(item for item in items if not isinstance(item, _PRIMITIVES))

    def _step(self, obj) -> None:
        if isinstance(obj, types.ModuleType):
            self._module(obj.__name__)
        elif isinstance(obj, types.FunctionType):
            if self._module(obj.__module__):
                self._function(obj)
        elif isinstance(obj, types.MethodType):
            self._push((obj.__func__, obj.__self__))
        elif isinstance(obj, functools.partial):
            self._push((obj.func, *obj.args, *obj.keywords.values()))
        elif isinstance(obj, type):
            if self._module(obj.__module__):
                # static and class methods unwrapped; the bases: a __call__ inherited
                self._push(getattr(m, "__func__", m) for m in vars(obj).values())
                self._push(obj.__bases__)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            self._push(obj)
        elif isinstance(obj, dict):
            self._push(obj.values())
        else:
            self._other(obj)

    def _other(self, obj) -> None:
        """A builtin function names its module (numpy's `frombuffer`: its type's is
        builtins); an instance, its class's. A third-party instance's class, once noted,
        skips its other instances (an array of arrays); a user's is looked into."""
        module = getattr(obj, "__module__", None)
        if isinstance(module, str) and module != type(obj).__module__:
            self._module(module)
        if self._module(type(obj).__module__):
            self._push((type(obj), getattr(obj, "__dict__", {})))
        elif self._dists.get(type(obj).__module__):
            self._noted_types.add(type(obj))

    def _function(self, fn: types.FunctionType) -> None:
        for code in _codes(fn.__code__):
            self._push(fn.__globals__[name] for name in code.co_names
                       if name in fn.__globals__)
            for name in _absolute_imports(code):
                self._module(name)
        for cell in fn.__closure__ or ():
            try:
                self._push((cell.cell_contents,))
            except ValueError:  # an empty cell
                continue
        self._push((fn.__defaults__ or (), fn.__kwdefaults__ or {}))

    def _module(self, name: str | None) -> bool:
        """Note `name`'s distribution; whether its objects are user code to look into."""
        top = (name or "").split(".")[0]
        if not top or top in sys.stdlib_module_names or top == "builtins":
            return False
        if top == _OURS:
            return True
        if name not in self._dists:
            self._dists[name] = self._distributions(name, top)
        dists = self._dists[name]
        self.found.update(dists or ())
        return dists is None

    def _distributions(self, name: str, top: str) -> list[str] | None:
        """The distributions that install module `name`; None: the user's code (in no
        distribution, or in one installed from a local folder, editable or not)."""
        candidates = list(dict.fromkeys(self.owners.get(top, ())))
        if not candidates:
            return None
        path = _module_file(name)
        if path is not None and not is_installed_file(path):
            return None
        if len(candidates) > 1 and path is not None:  # a namespace package: who owns it
            candidates = [d for d in candidates if _holds(d, path)] or candidates
        dists = [d for d in candidates if not _installed_locally(d)]
        return dists or None


def _module_file(name: str) -> str | None:
    """The file of module `name`, or of its nearest imported parent; for one not imported,
    its top-level package's (found without importing it)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        path = getattr(sys.modules.get(".".join(parts[:n])), "__file__", None)
        if path:
            return path
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.has_location else None


def _holds(dist: str, path: str) -> bool:
    """Whether an installed distribution named `dist` lists `path` among its files."""
    wanted = {os.path.abspath(path), os.path.realpath(path)}
    for d in importlib.metadata.distributions(name=dist):
        if any(os.path.abspath(d.locate_file(f)) in wanted for f in d.files or ()):
            return True
    return False


def _installed_locally(dist: str) -> bool:
    """Installed from a local folder (editable or not), a file or a VCS checkout: a pin of
    its version names nothing an index serves."""
    for d in importlib.metadata.distributions(name=dist):
        try:
            info = json.loads(d.read_text("direct_url.json") or "{}")
        except ValueError:
            continue
        if "dir_info" in info or "vcs_info" in info or \
                str(info.get("url", "")).startswith("file:"):
            return True
    return False


def _absolute_imports(code: types.CodeType):
    """The modules `code` imports absolutely: IMPORT_NAME's level is the constant loaded two
    instructions before it (a relative import, `from .utils import x`, is the user's own
    package, not a top-level `utils`)."""
    last: collections.deque = collections.deque(maxlen=2)
    for ins in dis.get_instructions(code):
        if ins.opname == "IMPORT_NAME":
            level = last[0].argval if len(last) == 2 and last[0].opname == "LOAD_CONST" \
                else 0
            if not level:
                yield ins.argval
        last.append(ins)


def _codes(code: types.CodeType):
    """`code` and the code objects nested in it (its lambdas, inner functions)."""
    stack = [code]
    while stack:
        code = stack.pop()
        yield code
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
