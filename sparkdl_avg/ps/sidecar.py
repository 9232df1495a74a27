"""The parameter server as a child process of the driver, owned for the length of one fit."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

from sparkdl_avg._errors import TrainingError
from sparkdl_avg.ps.server import SECRET_ENV
from sparkdl_avg.ps.settings import ServerSettings

_START_TIMEOUT_S = 60.0


class Sidecar:
    """`python -m sparkdl_avg ps serve` beside the driver. Leaving the block stops it; if the
    driver dies instead, the server's watchdog sees the parent gone and exits. It saves its
    state every `settings.checkpoint_every` updates; `restart()` brings a dead one back from
    that state on the same port, where its workers reconnect."""

    def __init__(self, settings: ServerSettings, *, host: str, secret: bytes,
                 checkpoint_dir: str | None = None, port: int = 0,
                 name: str = "parameter-server", extra_args: tuple[str, ...] = ()) -> None:
        """`name`: of the checkpoint file (a shard's, `ps.shards.shard_name`).
        `extra_args`: more `ps serve` options (TLS)."""
        self._checkpoint_dir = checkpoint_dir
        self._name = name
        self.restarts = 0
        self._args = ["--host", host, "--parent-pid", str(os.getpid()), *settings.to_argv(),
                      *extra_args]
        self._secret = secret
        self._proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None
        self.port = port
        """Where the server listens: given, or (0) the one it picked, once it runs."""

    def __enter__(self) -> Sidecar:
        self._dir = tempfile.TemporaryDirectory(prefix="sparkdl-avg-ps-")
        folder = self._checkpoint_dir or self._dir.name
        os.makedirs(folder, exist_ok=True)
        self.checkpoint_file = os.path.join(folder, f"{self._name}.npz")
        with contextlib.suppress(FileNotFoundError):  # a previous fit's: never to be resumed
            os.remove(self.checkpoint_file)
        self._args += ["--checkpoint-file", self.checkpoint_file]
        self._launch(["--port", str(self.port)] if self.port else [])
        return self

    def alive(self, grace_s: float = 0.0) -> bool:
        """Whether the server process runs (waiting up to `grace_s` for a dying one to end)."""
        if self._proc is None:
            return False
        if grace_s:
            try:
                self._proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                return True
        return self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None

    def restart(self) -> None:
        """Start a new server on the same port from the last checkpoint (a fresh one if it
        died before its first: before any INIT)."""
        self._stop()
        self.restarts += 1
        resume = ["--resume"] if os.path.exists(self.checkpoint_file) else []
        self._launch(["--port", str(self.port), *resume])

    def _launch(self, extra: list[str]) -> None:
        ready = os.path.join(self._dir.name, "ready.json")
        with contextlib.suppress(FileNotFoundError):
            os.remove(ready)
        env = {**os.environ, SECRET_ENV: self._secret.hex()}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "sparkdl_avg", "ps", "serve", *self._args, *extra,
             "--ready-file", ready], env=env, stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not os.path.exists(ready):
            if self._proc.poll() is not None:
                self.__exit__(None, None, None)
                raise TrainingError(f"the parameter server exited at start "
                                    f"(code {self._proc.returncode})")
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise TrainingError(f"the parameter server did not start in "
                                    f"{_START_TIMEOUT_S:.0f}s")
            time.sleep(0.05)
        with open(ready) as f:
            self.port = json.load(f)["port"]

    def __exit__(self, *exc_info) -> None:
        self._stop()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def _stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
