"""`sparkdl-avg ps serve --shards K`: K parameter servers, one child process per shard (each
the same `ps serve` a fit's sidecar is), watched by this process. It prints the address list
a fit takes as `ps_address`, in shard order, restarts a shard that dies from its checkpoint
on the same port (where the workers reconnect), and stops them all when it ends. Imports
neither torch nor pyspark."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import time

from sparkdl_avg._errors import TrainingError
from sparkdl_avg.ps.settings import ServerSettings
from sparkdl_avg.ps.shards import MAX_SHARDS
from sparkdl_avg.ps.sidecar import Sidecar


def serve_shards(args: argparse.Namespace, secret: bytes, settings: ServerSettings,
                 fail, alive) -> int:
    shards = args.shards
    if not 1 < shards <= MAX_SHARDS:
        return fail(f"--shards must be from 1 to {MAX_SHARDS}, got {shards}")
    if args.resume:
        return fail("--resume takes up one server's checkpoint; with --shards each shard "
                    "resumes from its own when it is restarted")
    folder, stem = None, "parameter-server"
    if args.checkpoint_file:  # shard k saves to <stem>-<k>-of-<K>.npz beside it
        folder = os.path.dirname(os.path.abspath(args.checkpoint_file))
        stem = os.path.basename(args.checkpoint_file).removesuffix(".npz")
    tls = ("--tls-cert", args.tls_cert, "--tls-key", args.tls_key) if args.tls_cert else ()
    with contextlib.ExitStack() as stack:
        try:
            servers = [stack.enter_context(Sidecar(
                settings, host=args.host, secret=secret, checkpoint_dir=folder,
                port=args.port + k if args.port else 0, name=f"{stem}-{k}-of-{shards}",
                extra_args=tls)) for k in range(shards)]
        except TrainingError as exc:
            return fail(f"a shard did not start: {exc}")
        address = ",".join(f"{args.host}:{s.port}" for s in servers)
        if args.ready_file:
            tmp = args.ready_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"port": servers[0].port, "ports": [s.port for s in servers],
                           "pid": os.getpid()}, f)
            os.replace(tmp, args.ready_file)
        logging.info("serving %d shards with %s", shards, settings)
        print(f"ps_address={address}", flush=True)
        try:
            while True:
                time.sleep(1.0)
                if args.parent_pid and not alive(args.parent_pid):  # watchdog
                    logging.warning("parent %d is gone: stopping", args.parent_pid)
                    return 0
                for k, server in enumerate(servers):
                    if not server.alive():
                        logging.warning("shard %d exited (code %s): restarting it from its "
                                        "checkpoint", k, server.returncode)
                        try:
                            server.restart()
                        except TrainingError as exc:
                            return fail(f"shard {k} could not be restarted: {exc}")
        except KeyboardInterrupt:
            return 0
