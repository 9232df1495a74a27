"""Shared-memory regions between a worker and the driver on one host (`net.shared_memory`):
what proves a peer may use one, what a frame that names one may claim, and that no file is
left behind."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from sparkdl_avg import ProtocolError
from sparkdl_avg.net import shared_memory
from sparkdl_avg.net.frames import HEADER, MAGIC, SHARED, VERSION, Connection, Kind
from sparkdl_avg.net.shared_memory import SharedRegion

pytestmark = pytest.mark.skipif(not shared_memory.FOLDER.is_dir(), reason="no /dev/shm")


def _ours() -> set[str]:
    return {p.name for p in shared_memory.FOLDER.glob(f"{shared_memory.PREFIX}{os.getpid()}-*")}


@pytest.fixture
def region():
    made = SharedRegion.create(4096)
    yield made
    made.close()


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    left = Connection(a, timeout=5, max_payload=1 << 20)
    right = Connection(b, timeout=5, max_payload=1 << 20)
    yield left, right
    left.close()
    right.close()


def test_a_peer_maps_a_region_only_with_its_name_token_and_size(region):
    peer = SharedRegion.attach(region.name, 4096)
    assert peer is not None and not peer.owner
    region.array(np.float32, 8)[:] = np.arange(8)
    assert peer.array(np.float32, 8).tolist() == list(range(8))  # the same memory
    peer.close()
    assert region.path.exists()  # only its creator removes the file
    file, _, token = region.name.partition(":")
    wrong_token = f"{file}:{'0' * 32}" if token != "0" * 32 else f"{file}:{'1' * 32}"
    for name, nbytes in [(wrong_token, 4096), (region.name, 4095), (f"{file}:zz", 4096),
                         ("../../etc/passwd:" + token, 4096),
                         (f"{shared_memory.PREFIX}1-{'a' * 16}:{token}", 4096)]:
        assert SharedRegion.attach(name, nbytes) is None, name
    assert region.array(np.float32, 1025) is None  # 4100 bytes do not fit


def test_no_region_where_dev_shm_is_full(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    before = _ours()
    monkeypatch.setattr(shared_memory.os, "posix_fallocate", full)
    assert SharedRegion.create(1 << 20) is None
    assert _ours() == before  # the file it began is gone


def test_closing_removes_the_file_but_a_held_view_keeps_the_memory(region):
    values = region.array(np.float64, 4)
    values[:] = 1.5
    region.close()
    assert not region.path.exists()
    assert values.sum() == 6.0  # mapped until the view is dropped


def test_a_killed_creators_region_is_removed_by_the_next_one_made(tmp_path):
    code = ("import os, sys; from sparkdl_avg.net.shared_memory import SharedRegion; "
            "r = SharedRegion.create(4096); print(r.path, flush=True); os._exit(0)")
    left = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert os.path.exists(left)  # its creator died without unlinking
    mine = SharedRegion.create(4096)  # sweeps on the way
    try:
        assert not os.path.exists(left)
        assert mine.path.exists()  # a live creator's is kept
    finally:
        mine.close()


def test_a_frame_that_names_a_region_carries_no_payload_bytes(region, pair):
    left, right = pair
    peer = SharedRegion.attach(region.name, 4096)
    left.shared_out, right.shared_in = region, peer
    sent = region.array(np.float32, 100)
    sent[:] = np.arange(100)
    left.send(Kind.PUSH, {"n": 100}, sent)
    on_socket = right.sock.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    assert len(on_socket) == HEADER.size + len(b'{"n":100}')  # the header and meta only
    received = np.zeros(100, np.float32)
    frame = right.recv(received)
    assert frame.meta == {"n": 100} and received.tolist() == list(range(100))
    left.send(Kind.PUSH, {}, np.arange(3, dtype=np.float32))  # not the region: on the socket
    assert right.recv(np.zeros(3, np.float32)).payload.nbytes == 12
    in_place = peer.array(np.float32, 100)  # a target that *is* the region: nothing copied
    sent[:] = 7
    left.send(Kind.PUSH, {}, sent)
    assert right.recv(in_place).payload.nbytes == 400 and in_place.sum() == 700
    left.send(Kind.PUSH, {}, sent)  # no target: a copy the region's next round cannot touch
    copy = np.frombuffer(right.recv().payload, np.float32)
    sent[:] = 0
    assert copy.sum() == 700
    assert left.bytes_moved == right.bytes_moved  # both count the payloads they moved


def _raw(flags: int, payload_len: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, Kind.PUSH, flags, 2, payload_len) + b"{}"


@pytest.mark.parametrize("flags, payload_len, peer_region, match", [
    (SHARED, 16, False, "shares none"),
    (SHARED, 4097, True, "region of 4096"),
    (4, 0, True, "unknown frame flags"),
])
def test_a_frame_naming_a_region_it_may_not_is_refused(region, pair, flags, payload_len,
                                                      peer_region, match):
    left, right = pair
    if peer_region:
        right.shared_in = SharedRegion.attach(region.name, 4096)
    left.sock.sendall(_raw(flags, payload_len))
    with pytest.raises(ProtocolError, match=match):
        right.recv(np.zeros(payload_len // 4, np.float32) if payload_len % 4 == 0 else None)


def _fit(spark, **fields):
    import torch

    from sparkdl_avg import TrainConfig, fit

    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(96, 5)), rng.integers(0, 3, 96)
    rows = [(row.tolist(), int(label)) for row, label in zip(x, y, strict=True)]
    df = spark.createDataFrame(rows, "features array<double>, label long")

    def model():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(),
                                   torch.nn.Linear(8, 3)).double()

    config = TrainConfig(num_workers=2, epochs=2, batch_size=8, averaging_frequency=2,
                         optimizer="sgd", lr=0.1, shuffle=False, log_model=False, **fields)
    return fit(df, model, config)


@pytest.mark.spark
def test_pushes_through_shared_memory_and_averages_over_tcp_train_as_tcp_does(
        spark, caplog, monkeypatch):
    """The driver cannot make its region (a full /dev/shm: patched here, in the driver's
    process only): the workers' pushes still come through theirs, the averages go over TCP,
    and the fit trains exactly as one that shares nothing (the same arithmetic on the same
    machine, so bit for bit). No region of the driver's is left behind."""
    import logging

    import torch

    made = SharedRegion.create
    monkeypatch.setattr(SharedRegion, "create", classmethod(lambda cls, nbytes: None))
    with caplog.at_level(logging.INFO, logger="sparkdl_avg"):
        mixed = _fit(spark)
    monkeypatch.setattr(SharedRegion, "create", made)
    said = [r.getMessage() for r in caplog.records if "shared memory" in r.getMessage()]
    assert len(said) == 2 and all("pushes come through" in m for m in said), said
    plain = _fit(spark, shared_memory=False)
    for a, b in zip(mixed.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert [h["wire_mb"] for h in mixed.history] == [h["wire_mb"] for h in plain.history]
    assert not _ours()
