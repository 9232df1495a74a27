"""The package's shape: no import cycle, no module over 400 lines, package __init__s that
import nothing, and a parameter server command line that needs neither pyspark nor torch."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import sparkdl_avg

ROOT = Path(sparkdl_avg.__file__).parent
MAX_LINES = 400


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def top_level_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The package's modules `name` imports when it is imported (not inside functions, not
    under `if TYPE_CHECKING:`)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                       for alias in node.names]
        else:
            continue
        out |= {t for t in targets if t in known}
    return out


def test_no_import_cycles():
    found = modules()
    graph = {name: top_level_imports(path, name, set(found)) for name, path in found.items()}
    state: dict[str, str] = {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = "open"
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                cycle = stack[stack.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, stack + [dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert len(graph) > 30  # the walk saw the whole package


def test_no_module_is_over_400_lines():
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_subpackage_inits_import_nothing():
    """Importing `sparkdl_avg.ps.server` must not drag in the rest of the package."""
    for name, path in modules().items():
        if path.name == "__init__.py" and name != "sparkdl_avg":
            body = ast.parse(path.read_text()).body
            assert all(isinstance(n, ast.Expr) for n in body), name


def _cli_imports(command: list[str], tmp_path: Path) -> set[str]:
    """Run the parameter server's command line until it serves; the top-level packages it
    imported (from -X importtime)."""
    run = len(list(tmp_path.iterdir()))
    ready, log = tmp_path / f"ready-{run}.json", tmp_path / f"imports-{run}.txt"
    env = {**os.environ, "SPARKDL_AVG_PS_SECRET": os.urandom(32).hex()}
    with open(log, "w") as stderr:  # a file: a full pipe would block the server
        proc = subprocess.Popen([sys.executable, "-X", "importtime", *command, "ps", "serve",
                                 "--ready-file", str(ready)], env=env, stderr=stderr)
        try:
            deadline = time.monotonic() + 60
            while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert json.loads(ready.read_text())["port"] > 0  # it served
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    lines = [line.split("|")[-1].strip() for line in log.read_text().splitlines()
             if line.startswith("import time:")]
    assert len(lines) > 50  # importtime did report
    return {line.split(".")[0] for line in lines}


def test_server_command_line_imports_neither_pyspark_nor_torch(tmp_path):
    script = Path(sys.executable).with_name("sparkdl-avg")  # the console script
    for command in (["-m", "sparkdl_avg"], [str(script)]):
        imported = _cli_imports(command, tmp_path)
        assert "sparkdl_avg" in imported
        assert not imported & {"pyspark", "torch", "mlflow", "py4j"}, command


def test_only_the_session_module_touches_what_spark_connect_lacks():
    """A Connect session has no SparkContext: `driver/session.py` answers for both kinds. The
    others are `_jvm_archive` and `_local_session`, which start a JVM of this process's own
    (`local_session`'s, the jobs' and the benches', never a Connect session's) and end it so
    that it writes its class archive."""
    users = {name for name, path in modules().items()
             if any(word in path.read_text() for word in ("sparkContext", "_jsc", "_jvm"))}
    assert users == {"sparkdl_avg.driver.session", "sparkdl_avg._jvm_archive",
                     "sparkdl_avg._local_session"}
