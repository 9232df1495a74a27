"""The data caches without Spark: rows placed by their global number, memory and disk giving
the same minibatches from any step, bad rows caught, spill folders checked and cleaned."""

import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
import torch

from sparkdl_avg._errors import DataCacheError, DataError
from sparkdl_avg.data import spill as spill_module
from sparkdl_avg.data.batches import TrainBatches
from sparkdl_avg.data.columns import EVAL, TRAIN
from sparkdl_avg.data.order import Cut
from sparkdl_avg.data.partition import Shape, cache_kind, load_partition
from sparkdl_avg.data.schema import DataSchema, FieldSpec
from sparkdl_avg.data.spill import SPILL_FOLDER, SpillDir, remove_orphans

F, WORKERS, RANK = 3, 3, 1
CPU = torch.device("cpu")


def _schema(features=F, label_dtype="int64") -> DataSchema:
    """One float vector in, one label out: the fit before typed inputs."""
    return DataSchema(
        inputs=(FieldSpec("input", "features", "features", "_x0", "float32", (features,)),),
        binding="single", labels=(FieldSpec("label", "label", "label", "_y0", label_dtype, ()),),
        label_list=False)


def _global_rows(n_train: int, n_eval: int, seed: int = 0):
    """Every worker's rows, numbered globally (features encode the row number)."""
    rng = np.random.default_rng(seed)
    out = []
    for split, n in ((TRAIN, n_train), (EVAL, n_eval)):
        g = np.arange(n)
        x = (g[:, None] * 10 + np.arange(F)).astype(np.float32) + rng.random((n, F),
                                                                              np.float32)
        out.append((x, (g % 4).astype(np.int64), g, np.full(n, split, np.int8)))
    return out


def _batches(n_train=200, n_eval=50, *, rank=RANK, arrival_seed=1, batch_rows=17, edit=None):
    """Arrow batches of worker `rank`'s rows, in a random arrival order."""
    parts = []
    for x, y, g, s in _global_rows(n_train, n_eval):
        mine = g % WORKERS == rank
        parts.append((x[mine], y[mine], g[mine], s[mine]))
    x, y, g, s = (np.concatenate(c) for c in zip(*parts, strict=True))
    perm = np.random.default_rng(arrival_seed).permutation(len(g))
    x, y, g, s = x[perm], y[perm], g[perm], s[perm]
    if edit:
        x, y, g, s = edit(x, y, g, s)
    for a in range(0, len(g), batch_rows):
        b = slice(a, a + batch_rows)
        yield pa.RecordBatch.from_arrays(
            [pa.FixedSizeListArray.from_arrays(pa.array(x[b].ravel()), F).cast(
                pa.list_(pa.float32())), pa.array(y[b]), pa.array(g[b]), pa.array(s[b])],
            names=["_x0", "_y0", "_row", "_split"])


def _shape(n_train=200, n_eval=50, rank=RANK):
    sizes = [len(range(w, n_train, WORKERS)) for w in range(WORKERS)]
    evals = [len(range(w, n_eval, WORKERS)) for w in range(WORKERS)]
    return Shape(rank=rank, num_workers=WORKERS, train_rows=sizes[rank],
                 eval_rows=evals[rank], schema=_schema())


@pytest.fixture
def spill(tmp_path):
    with SpillDir.create(1 << 20, dirs=[str(tmp_path)]) as folder:
        yield folder


def _load(cache, spill=None, **kw):
    return load_partition(_batches(**kw), _shape(), cache=cache, spill=spill, device=CPU)


@pytest.mark.parametrize("cache", ["memory", "disk"])
def test_rows_land_in_local_order_whatever_order_they_arrive_in(cache, spill):
    data = _load(cache, spill, arrival_seed=7)
    batch = next(data.train.chunks(1000))
    (x,), (y,) = batch.inputs, batch.labels
    local = np.arange(data.rows[0]) * WORKERS + RANK  # global numbers, in local order
    assert np.array_equal(np.floor(x[:, 0].numpy() / 10), local)
    assert np.array_equal(y.numpy(), local % 4)
    assert data.rows == (_shape().train_rows, _shape().eval_rows)
    data.close()


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("epoch_rows", [67, 70])
def test_memory_and_disk_give_identical_batches_from_any_step(spill, shuffle, epoch_rows):
    """67 rows, 5 a step: without padding the last batch is partial; padded to an epoch of
    70 positions (as a partition shorter than the others is), 3 rows repeat."""
    memory, disk = _load("memory"), _load("disk", spill)
    assert disk.spilled_bytes == _shape().bytes
    kw = {"cut": Cut(4, 3), "seed": 9, "worker": RANK, "shuffle": shuffle, "batch_size": 5,
          "steps_per_epoch": 14, "total_steps": 42, "device": CPU, "epoch_rows": epoch_rows}
    a, b = TrainBatches(memory.train, **kw), TrainBatches(disk.train, **kw)
    a.start(0)
    b.start(0)
    full = [_pair(a.next()) for _ in range(42)]
    for (xa, ya), (xb, yb) in zip(full, [_pair(b.next()) for _ in range(42)], strict=True):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    # each epoch visits every row, and fills its positions by repeating some
    rows = sorted(next(memory.train.chunks(1000)).inputs[0][:, 0].floor().tolist())
    for epoch in range(3):
        seen = torch.cat([x for x, _ in full[14 * epoch:14 * (epoch + 1)]])[:, 0].floor()
        assert len(seen) == epoch_rows and sorted(set(seen.tolist())) == rows
    for restart in (3, 13, 14, 30):  # mid-window, at the padded batch, an epoch, the last
        b.start(restart)
        for x, y in full[restart:restart + 8]:
            xb, yb = _pair(b.next())
            assert torch.equal(x, xb) and torch.equal(y, yb)
    b.close()
    disk.close()
    assert b._producer is None


def _pair(batch):
    (x,), (y,) = batch.inputs, batch.labels
    assert batch.weights is None and batch.padded == batch.positions == 0
    return x, y


def test_auto_keeps_a_partition_that_fits_the_budget_in_memory():
    shape = Shape(0, 1, train_rows=1000, eval_rows=24,
                  schema=_schema(255, "float32"))  # 1 KiB a row: 1 MiB
    assert cache_kind("auto", shape, 1) == "memory"
    assert cache_kind("auto", shape, 0) == "disk"
    assert cache_kind("disk", shape, 512) == "disk"


@pytest.mark.parametrize("cache", ["memory", "disk"])
@pytest.mark.parametrize(("edit", "says"), [
    (lambda x, y, g, s: (x[1:], y[1:], g[1:], s[1:]), "received"),
    (lambda x, y, g, s: (x, y, np.r_[g[:1], g[:-1]], s), "twice"),
    (lambda x, y, g, s: (x, y, g + WORKERS * 1000, s), "beyond"),
    (lambda x, y, g, s: (x, y, g + 1, s), "another worker"),
])
def test_rows_that_differ_from_what_validation_counted_are_caught(cache, spill, edit, says):
    with pytest.raises(DataError, match=f"partition {RANK}: .*{says}.*changed between"):
        _load(cache, spill, edit=edit)


def test_a_missing_or_unwritable_local_directory_is_named(tmp_path, monkeypatch):
    # the check asks os.access; root (as CI runs) may write anywhere, so chmod would prove
    # nothing there: the directory is unwritable to the check instead
    locked = tmp_path / "locked"
    locked.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw:
                        False if str(path) == str(locked) else access(path, mode, **kw))
    missing = str(tmp_path / "nowhere")
    with pytest.raises(DataCacheError) as err:
        SpillDir.create(5 << 20, dirs=[missing, str(locked)])
    text = str(err.value)
    assert f"{missing}: does not exist" in text and "5.0 MiB needed" in text
    assert f"{locked}: is not writable" in text
    assert not (locked / SPILL_FOLDER).exists()
    monkeypatch.undo()
    with SpillDir.create(5 << 20, dirs=[missing, str(locked)]) as spill:  # writable again
        assert spill.path.startswith(str(locked))


def test_a_full_local_directory_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.setattr(spill_module, "_free_bytes", lambda path: 3 << 20)
    with pytest.raises(DataCacheError, match=r"4\.0 MiB needed.*: has 3\.0 MiB free"):
        SpillDir.create(4 << 20, dirs=[str(tmp_path)])
    assert not (tmp_path / SPILL_FOLDER).exists()


def test_a_disk_that_fills_up_while_writing_is_a_clear_error(spill, monkeypatch):
    import errno

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(DataCacheError, match=f"no room for the data cache in {spill.path}"):
        _load("disk", spill)


def test_spill_folder_is_removed_on_success_and_failure(tmp_path):
    with SpillDir.create(1 << 20, dirs=[str(tmp_path)]) as folder:
        _load("disk", folder).close()
        assert os.listdir(folder.path)
    assert not os.path.exists(folder.path)
    with pytest.raises(DataError), SpillDir.create(1 << 20, dirs=[str(tmp_path)]) as folder:
        _load("disk", folder, edit=lambda x, y, g, s: (x, y, g + 1, s))
    assert not os.path.exists(folder.path)


def _spill_in_subprocess(base, then: str) -> subprocess.Popen:
    """A process that makes a spill folder under `base`, prints it, then sleeps or dies."""
    code = ("import os, sys, time\n"
            "from sparkdl_avg.data.spill import SpillDir\n"
            f"folder = SpillDir.create(1, dirs=[{str(base)!r}])\n"
            "print(os.path.basename(folder.path), flush=True)\n"
            + ("time.sleep(60)\n" if then == "live" else "os._exit(9)\n"))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


def test_only_folders_whose_owner_is_gone_are_cleaned(tmp_path):
    alive = _spill_in_subprocess(tmp_path, "live")
    try:
        names = {"alive": alive.stdout.readline().strip()}
        dead = _spill_in_subprocess(tmp_path, "die")  # after: creating cleans up first
        names["dead"] = dead.stdout.readline().strip()
        dead.wait()
        root = tmp_path / SPILL_FOLDER
        assert (root / names["dead"]).is_dir()  # a killed task's folder, left behind
        mine = SpillDir._locked_folder(str(root))  # without cleaning first, as create does
        (root / ".half-made-now").mkdir()
        old = root / ".half-made-long-ago"
        old.mkdir()
        os.utime(old, (0, 0))
        removed = remove_orphans(str(root))
        assert sorted(removed) == sorted([names["dead"], ".half-made-long-ago"])
        assert sorted(os.listdir(root)) == sorted(
            [names["alive"], os.path.basename(mine.path), ".half-made-now"])
        mine.remove()
    finally:
        alive.kill()
        alive.wait()
    assert remove_orphans(str(root)) == [names["alive"]]  # its owner is gone now


def test_the_memory_cache_holds_features_in_the_models_dtype_once(spill):
    """A bfloat16 model: the partition is converted once at load (one copy, half the size),
    and its minibatches equal the disk cache's, converted as they are read."""
    memory = load_partition(_batches(), _shape(), cache="memory", device=CPU,
                            dtype=torch.bfloat16)
    disk = load_partition(_batches(), _shape(), cache="disk", spill=spill, device=CPU,
                          dtype=torch.bfloat16)
    assert memory.train.columns[0].dtype == torch.bfloat16
    assert memory.train.columns[1].dtype == torch.int64
    kw = {"cut": Cut(4, 3), "seed": 2, "worker": RANK, "shuffle": True, "batch_size": 5,
          "steps_per_epoch": 14, "total_steps": 14, "device": CPU}
    a, b = TrainBatches(memory.train, **kw), TrainBatches(disk.train, **kw)
    a.start(0)
    b.start(0)
    for _ in range(14):
        (xa, ya), (xb, yb) = _pair(a.next()), _pair(b.next())
        assert xa.dtype == xb.dtype == torch.bfloat16 and ya.dtype == yb.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    b.close()
    disk.close()
