"""Checkpoints of a synchronous fit: the restart point after a failure, and what `resume_from`
continues from after the driver died.

A checkpoint is a folder: `params.npy` (the averaged parameters), `state-<rank>.npy` (each
worker's optimizer state as bytes) and `checkpoint.json` (round, steps, the metrics so far,
what the fit must match to resume, and the files' SHA-256), written last so a folder without
it is incomplete. It lives under `checkpoint_dir/round-NNNNNN/` (the newest two are kept) or
in the MLflow run under `checkpoints/round-NNNNNN/`. Loading never unpickles: `np.load` with
`allow_pickle=False` and JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sparkdl_avg._background import BackgroundWriter
from sparkdl_avg._errors import ConfigError, TrainingError

log = logging.getLogger("sparkdl_avg")
FORMAT = 1
_KEEP = 2
_ROUND_DIR = re.compile(r"^round-(\d{6,})$")
_RUN_ID = re.compile(r"^(runs:/)?([0-9a-f]{32})/?$")


@dataclass(slots=True)
class Checkpoint:
    round: int
    """Rounds completed: training continues with this round."""
    steps: int
    """Local minibatch steps each worker has taken (its position in the data)."""
    params: np.ndarray
    """The averaged parameters, flat, in the wire dtype."""
    states: list[tuple[list, np.ndarray]] | None
    """Per worker: its optimizer state as `task.worker_state.pack` made it; None before any
    step."""
    fingerprint: dict
    """What a fit must match to continue from here (see `fingerprint`)."""
    history: list[dict] = field(default_factory=list)
    """The per-round metrics up to here."""
    best: np.ndarray | None = None
    """Early stopping with restore_best: the averaged parameters of the best evaluation so
    far (`best.npy`)."""
    stop: dict | None = None
    """A stop already decided at this point (early stopping or on_round): by, round,
    reason."""
    global_state: tuple[list, np.ndarray] | None = None
    """With an outer optimizer or compressed deltas: its state and the update's residual
    (`averaging.global_step.GlobalStep.state`, packed), `global.npy`."""


# --- one checkpoint <-> one local folder -------------------------------------------------

def write_folder(checkpoint: Checkpoint, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    files = {"params.npy": checkpoint.params}
    if checkpoint.best is not None:
        files["best.npy"] = checkpoint.best
    if checkpoint.global_state is not None:
        files["global.npy"] = checkpoint.global_state[1]
    layouts = None
    if checkpoint.states is not None:
        layouts = [layout for layout, _ in checkpoint.states]
        files.update({f"state-{rank}.npy": payload
                      for rank, (_, payload) in enumerate(checkpoint.states)})
    digests = {}
    for name, array in files.items():
        np.save(folder / name, np.ascontiguousarray(array), allow_pickle=False)
        digests[name] = _sha256(folder / name)
    meta = {"format": FORMAT, "round": checkpoint.round, "steps": checkpoint.steps,
            "fingerprint": checkpoint.fingerprint, "history": checkpoint.history,
            "stop": checkpoint.stop, "state_layouts": layouts,
            "global_layout": checkpoint.global_state[0] if checkpoint.global_state else None,
            "sha256": digests}
    (folder / "checkpoint.json").write_text(json.dumps(meta))


def read_folder(folder: Path) -> Checkpoint:
    try:
        meta = json.loads((folder / "checkpoint.json").read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, this version reads {FORMAT}")
        for name, digest in meta["sha256"].items():
            if _sha256(folder / name) != digest:
                raise ValueError(f"{name} does not match its SHA-256: the checkpoint is damaged")
        params = np.load(folder / "params.npy", allow_pickle=False)
        best = np.load(folder / "best.npy", allow_pickle=False) \
            if "best.npy" in meta["sha256"] else None
        states = None
        if meta["state_layouts"] is not None:
            states = [(layout, np.load(folder / f"state-{rank}.npy", allow_pickle=False))
                      for rank, layout in enumerate(meta["state_layouts"])]
        global_state = None
        if meta.get("global_layout") is not None:
            global_state = (meta["global_layout"],
                            np.load(folder / "global.npy", allow_pickle=False))
        return Checkpoint(round=int(meta["round"]), steps=int(meta["steps"]), params=params,
                          states=states, fingerprint=meta["fingerprint"],
                          history=meta["history"], best=best, stop=meta.get("stop"),
                          global_state=global_state)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"cannot read the checkpoint in {folder}: {exc}") from exc


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _round_name(round_index: int) -> str:
    return f"round-{round_index:06d}"


# --- where checkpoints are kept ----------------------------------------------------------

class DirStore:
    """`checkpoint_dir`: each checkpoint written to a temporary folder, synced, then renamed
    into place, so a crash leaves either the whole checkpoint or none of it."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.description = str(self.path)

    def save(self, checkpoint: Checkpoint) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        final = self.path / _round_name(checkpoint.round)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=self.path))
        try:
            write_folder(checkpoint, tmp)
            _fsync_folder(tmp)
            if final.exists():  # the same round again (a restart): swap, never a gap
                old = final.with_name(f".{final.name}-old")
                shutil.rmtree(old, ignore_errors=True)
                os.rename(final, old)
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
            _fsync_folder(self.path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old in self.complete()[:-_KEEP]:
            shutil.rmtree(old, ignore_errors=True)

    def load_latest(self) -> Checkpoint | None:
        """The newest checkpoint that reads back whole (an older one if the newest is
        damaged); `path` may also be one checkpoint's own folder."""
        if (self.path / "checkpoint.json").exists():
            return read_folder(self.path)
        return _newest_readable(self.complete(), read_folder)

    def complete(self) -> list[Path]:
        """Checkpoint folders with their checkpoint.json, oldest first."""
        if not self.path.is_dir():
            return []
        found = [p for p in self.path.iterdir()
                 if _ROUND_DIR.match(p.name) and (p / "checkpoint.json").exists()]
        return sorted(found, key=lambda p: int(_ROUND_DIR.match(p.name).group(1)))


def _newest_readable(places: list, read) -> Checkpoint | None:
    """The newest of `places` (oldest first) that `read` reads back whole, warning past
    damaged ones; the first error if none reads; None if there are none."""
    error = None
    for place in reversed(places):
        try:
            return read(place)
        except ConfigError as exc:
            log.warning("skipping a damaged checkpoint: %s", exc)
            error = error or exc
    if error is not None:
        raise error
    return None


def _fsync_folder(folder: Path) -> None:
    for path in [*folder.iterdir(), folder]:
        if path.is_dir() and path != folder:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class MlflowStore:
    """The run's artifacts: data files first, `checkpoint.json` last."""

    def __init__(self, tracking_uri: str, run_id: str) -> None:
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri)
        self.run_id = run_id
        self.description = f"MLflow run {run_id}"
        self._repo = None
        self._saved: list[str] | None = None
        """The complete checkpoints, listed once, then kept up to date by `save`: a listing
        costs several tracking-store queries a folder, 60% of a save's time."""

    def save(self, checkpoint: Checkpoint) -> None:
        path = f"checkpoints/{_round_name(checkpoint.round)}"
        if self._saved is None:
            self._saved = self._complete()
        repo = self._repository()
        with tempfile.TemporaryDirectory(prefix="sparkdl-avg-ckpt-") as tmp:
            folder = Path(tmp) / "data"
            write_folder(checkpoint, folder)
            marker = Path(tmp) / "checkpoint.json"
            os.rename(folder / "checkpoint.json", marker)
            repo.log_artifacts(str(folder), path)
            repo.log_artifact(str(marker), path)
        if path not in self._saved:
            self._saved.append(path)
        while len(self._saved) > _KEEP:
            self._delete(self._saved.pop(0))

    def _repository(self):
        """The run's artifact repository, resolved once."""
        if self._repo is None:
            from mlflow.tracking.artifact_utils import get_artifact_repository

            uri = self._client.get_run(self.run_id).info.artifact_uri
            self._repo = get_artifact_repository(uri)
        return self._repo

    def load_latest(self) -> Checkpoint | None:
        """The newest checkpoint that reads back whole (an older one if the newest is
        damaged), as `DirStore.load_latest`; None if the run holds none."""
        return _newest_readable(self._complete(), self._read)

    def _read(self, path: str) -> Checkpoint:
        with tempfile.TemporaryDirectory(prefix="sparkdl-avg-ckpt-") as tmp:
            local = self._client.download_artifacts(self.run_id, path, tmp)
            try:
                return read_folder(Path(local))
            except ConfigError as exc:  # named by the run's artifact, not the gone download
                raise ConfigError(f"cannot read the checkpoint {path} of {self.description}: "
                                  f"{exc.__cause__ or exc}") from exc

    def _complete(self) -> list[str]:
        found = []
        for item in self._client.list_artifacts(self.run_id, "checkpoints"):
            name = item.path.rsplit("/", 1)[-1]
            if item.is_dir and _ROUND_DIR.match(name) and any(
                    f.path.endswith("/checkpoint.json")
                    for f in self._client.list_artifacts(self.run_id, item.path)):
                found.append(item.path)
        return sorted(found, key=lambda p: int(_ROUND_DIR.match(p.rsplit("/", 1)[-1]).group(1)))

    def _delete(self, path: str) -> None:
        """Best effort: not every artifact store can delete."""
        try:
            self._repository().delete_artifacts(path)
        except Exception as exc:  # noqa: BLE001 - keeping an old checkpoint is harmless
            log.debug("could not delete old checkpoint %s: %s", path, exc)


def open_source(resume_from: str, tracking_uri: str) -> tuple[Checkpoint, DirStore | MlflowStore]:
    """The newest checkpoint at `resume_from` (a directory or an MLflow run id) and the store
    it came from."""
    if not isinstance(resume_from, str) or not resume_from:
        raise ConfigError(f"resume_from must be a directory or an MLflow run id, got "
                          f"{resume_from!r}")
    if os.path.isdir(resume_from):
        store = DirStore(resume_from)
        return _found(store.load_latest(), store), store
    match = _RUN_ID.match(resume_from)
    if match is None:
        raise ConfigError(f"resume_from={resume_from!r} is neither an existing directory nor "
                          "an MLflow run id")
    store = MlflowStore(tracking_uri, match.group(2))
    try:
        checkpoint = store.load_latest()
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(f"cannot read the checkpoints of {store.description}: {exc}") \
            from exc
    return _found(checkpoint, store), store


def target_store(config, run_id: str, tracking_uri: str,
                 source: DirStore | MlflowStore | None) -> DirStore | MlflowStore:
    """Where this fit saves checkpoints. A checkpoint_dir that holds another fit's checkpoints
    is refused (they would be pruned, or resumed by mistake) unless this fit continues them."""
    if config.checkpoint_dir is None:
        return MlflowStore(tracking_uri, run_id)
    store = DirStore(config.checkpoint_dir)
    continuing = isinstance(source, DirStore) and \
        source.path.resolve() in (store.path.resolve(), store.path.resolve().parent)
    existing = store.complete()
    if existing and not continuing:
        raise ConfigError(
            f"checkpoint_dir={config.checkpoint_dir!r} already holds checkpoints of another "
            f"fit ({existing[-1].name}); continue it with resume_from={config.checkpoint_dir!r} "
            "or choose an empty directory")
    return store


def end_source_run(tracking_uri: str, run_id: str) -> None:
    """The run of a fit whose driver died stays RUNNING; once resumed, mark it KILLED."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    if client.get_run(run_id).info.status == "RUNNING":
        client.set_terminated(run_id, "KILLED")


def _found(checkpoint: Checkpoint | None, store) -> Checkpoint:
    if checkpoint is None:
        raise ConfigError(f"{store.description} holds no complete checkpoint")
    return checkpoint


@contextlib.contextmanager
def writing(store):
    """A checkpoint `BackgroundWriter` to `store`, closed (pending checkpoint saved) on leaving;
    a save that failed fails the fit then (`check_saved`), if nothing failed it before."""
    writer = BackgroundWriter(store.save, f"a checkpoint to {store.description}")
    try:
        yield writer
    finally:
        writer.close()
    check_saved(writer)


def check_saved(writer: BackgroundWriter) -> None:
    """A TrainingError once a checkpoint could not be saved: the fit could neither restart
    from it nor be resumed, so it stops rather than end FINISHED without one."""
    if writer.error is not None:
        raise TrainingError(f"{writer.failure}; free space or "
                            "fix the store (checkpoint_dir, or the MLflow run's artifacts), "
                            "or set checkpoint_every=0 to train without checkpoints") \
            from writer.error
