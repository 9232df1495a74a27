"""A `torch.distributed` process group of one barrier job's tasks, for the collective
transport: gloo on the CPU, NCCL on CUDA.

It never touches torch's global default group (`init_process_group`): the group is an object
this task owns, so nothing is left behind in a Python worker Spark reuses for the next fit or
restart, and `close()` on every path out is the whole cleanup. Rendezvous: worker 0 listens on
its cluster address (the one it reaches the driver from), every task learns that address from
the barrier's `allGather`, and the group's own sockets bind to each task's cluster address too,
never 0.0.0.0. Neither gloo nor NCCL authenticates its peers: see docs/guide/security.md.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist


class TaskGroup:
    def __init__(self, backend, store) -> None:
        self._backend, self._store = backend, store  # gloo and NCCL keep using the store

    @classmethod
    def form(cls, *, rank: int, world: int, address: str, device: torch.device,
             all_gather: Callable[[str], list[str]], connect_timeout_s: float,
             op_timeout_s: float) -> TaskGroup:
        """Every task of the barrier job calls this once its data is loaded. `address`: this
        task's cluster address; `all_gather`: the barrier context's. Collectives time out
        after `op_timeout_s` (the round timeout)."""
        listening = None
        port = 0
        if rank == 0:
            listening = socket.create_server((address, 0), backlog=max(64, 2 * world))
            port = listening.getsockname()[1]
        try:
            found = [json.loads(m) for m in all_gather(json.dumps([rank, address, port]))]
        except BaseException:  # a peer failed, the stage was cancelled: Spark reuses us
            if listening is not None:
                listening.close()
            raise
        host, port = next((h, p) for r, h, p in found if r == 0)
        # the store's from here: it closes the socket
        listener = listening.detach() if listening is not None else None
        store = dist.TCPStore(host, port, world, rank == 0,
                              timeout=datetime.timedelta(seconds=connect_timeout_s),
                              wait_for_workers=False, use_libuv=False,
                              **({"master_listen_fd": listener} if rank == 0 else {}))
        timeout = datetime.timedelta(seconds=op_timeout_s)
        if device.type == "cuda":
            backend = _nccl(store, rank, world, address, timeout)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
            backend = dist.ProcessGroupGloo(store, rank, world, options)
        return cls(backend, store)

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """`tensor` becomes the sum of every task's, in place; identical bits on every task."""
        self._backend.allreduce([tensor]).wait()

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every task's `tensor` (the same shape on every task), by rank."""
        out = [torch.empty_like(tensor) for _ in range(self._backend.size())]
        self._backend.allgather([out], [tensor]).wait()
        return out

    def close(self) -> None:
        backend, self._backend = self._backend, None
        if backend is not None:
            with contextlib.suppress(Exception):
                backend.shutdown()
        self._store = None


def _nccl(store, rank: int, world: int, address: str, timeout: datetime.timedelta):
    """NCCL's bootstrap sockets on the interface that holds `address` (NCCL picks one by
    name: NCCL_SOCKET_IFNAME, unless the user set it)."""
    interface = interface_of(address)
    if interface and "NCCL_SOCKET_IFNAME" not in os.environ:
        os.environ["NCCL_SOCKET_IFNAME"] = f"={interface}"
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world, options)


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds the IPv4 `address` (None: not found, or
    not Linux)."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                info = fcntl.ioctl(probe.fileno(), siocgifaddr,
                                   struct.pack("256s", name.encode()[:15]))
                if socket.inet_ntoa(info[20:24]) == address:
                    return name
    return None
