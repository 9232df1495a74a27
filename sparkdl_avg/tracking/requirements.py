"""The logged model's pip requirements: torch and mlflow as installed, and the third-party
distributions a `fit(preprocess=)` function uses (a PNG decoder's Pillow), each pinned to the
version installed here, so an environment MLflow builds for the model can run it.

What the function uses is read from the objects it reaches, not guessed from names: the
globals its code names, the modules its code imports (an `import` inside the function
included), its closure and defaults, a partial's arguments, a callable object's class, and,
through them, the user's own functions and classes (the code that travels with the model:
anything not from an installed distribution, or from this library). An object from an
installed distribution is pinned and not looked into: its own requirements are its
distribution's. The standard library is left out.
"""

from __future__ import annotations

import dis
import functools
import importlib.metadata
import re
import sys
import types

_OURS = "sparkdl_avg"
_MAX_OBJECTS = 2000
"""How many objects the walk visits at most: a bound on a pathological closure."""


def model_requirements(preprocess=None) -> list[str]:
    """`torch==...`, `mlflow==...`, then the distributions `preprocess` uses, pinned."""
    import mlflow
    import torch

    pins = {"torch": torch.__version__.split("+")[0], "mlflow": mlflow.__version__}
    for name, version in preprocess_distributions(preprocess).items():
        pins.setdefault(name, version)
    return [f"{name}=={version}" for name, version in pins.items()]


def preprocess_distributions(fn) -> dict[str, str]:
    """{distribution name (normalised): installed version} of the third-party packages `fn`
    reaches (see the module's docstring); {} for None."""
    if fn is None:
        return {}
    owners = importlib.metadata.packages_distributions()
    found: set[str] = set()
    _Walk(owners, found).visit(fn)
    out = {}
    for top in sorted(found):
        for dist in owners.get(top, ()):
            name = re.sub(r"[-_.]+", "-", dist).lower()
            try:
                out.setdefault(name, importlib.metadata.version(dist))
            except importlib.metadata.PackageNotFoundError:  # a stale mapping: skip it
                continue
    return out


class _Walk:
    def __init__(self, owners: dict, found: set[str]) -> None:
        self.owners, self.found = owners, found
        self.seen: dict[int, object] = {}
        """By id, holding each object: a temporary's id is not reused while the walk runs."""

    def visit(self, obj) -> None:
        if id(obj) in self.seen or len(self.seen) >= _MAX_OBJECTS:
            return
        self.seen[id(obj)] = obj
        if isinstance(obj, types.ModuleType):
            self._module(obj.__name__)
        elif isinstance(obj, types.FunctionType):
            if self._module(obj.__module__):
                self._function(obj)
        elif isinstance(obj, types.MethodType):
            self.visit(obj.__func__)
            self.visit(obj.__self__)
        elif isinstance(obj, functools.partial):
            for part in (obj.func, *obj.args, *obj.keywords.values()):
                self.visit(part)
        elif isinstance(obj, type):
            if self._module(obj.__module__):
                for member in vars(obj).values():
                    self.visit(getattr(member, "__func__", member))  # static, class methods
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for item in obj:
                self.visit(item)
        elif isinstance(obj, dict):
            for item in obj.values():
                self.visit(item)
        # an instance (a callable object): its class noted; if the class is the user's, its
        # methods and what the instance holds
        elif not isinstance(obj, (str, bytes, int, float, bool, type(None))) and \
                self._module(type(obj).__module__):
            self.visit(type(obj))
            self.visit(getattr(obj, "__dict__", {}))

    def _function(self, fn: types.FunctionType) -> None:
        for code in _codes(fn.__code__):
            for name in code.co_names:
                if name in fn.__globals__:
                    self.visit(fn.__globals__[name])
            for ins in dis.get_instructions(code):
                if ins.opname == "IMPORT_NAME":
                    self._module(ins.argval)
        for cell in fn.__closure__ or ():
            try:
                self.visit(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        self.visit(fn.__defaults__ or ())
        self.visit(fn.__kwdefaults__ or {})

    def _module(self, name: str | None) -> bool:
        """Note `name`'s distribution; whether its objects are user code to look into."""
        top = (name or "").split(".")[0]
        if not top or top in sys.stdlib_module_names or top == "builtins":
            return False
        if self._third_party(top):
            self.found.add(top)
            return False
        return True

    def _third_party(self, module: str | None) -> bool:
        top = (module or "").split(".")[0]
        return top != _OURS and top in self.owners and top not in sys.stdlib_module_names


def _codes(code: types.CodeType):
    """`code` and the code objects nested in it (its lambdas, inner functions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)
