"""Command line: `sparkdl-avg ps serve ...` (or `python -m sparkdl_avg ps serve ...`) runs a
parameter server; fits in async mode start one beside the driver the same way. Its options
are `ServerSettings`' fields plus where to listen and what to keep. Imports neither torch
nor pyspark."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from pathlib import Path

from sparkdl_avg._errors import ConfigError
from sparkdl_avg.net.tls import server_context
from sparkdl_avg.ps.settings import ServerSettings


def main(argv: list[str] | None = None) -> int:
    from sparkdl_avg.ps.server import SECRET_ENV

    parser = argparse.ArgumentParser(prog="sparkdl-avg")
    sub = parser.add_subparsers(dest="command", required=True)
    ps = sub.add_parser("ps", help="parameter server").add_subparsers(dest="verb", required=True)
    serve = ps.add_parser("serve", help="serve until stopped (or until --parent-pid exits)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0, help="0 picks a free port")
    serve.add_argument("--secret-file", help=f"file holding the hex secret (else ${SECRET_ENV})")
    ServerSettings.add_arguments(serve)
    serve.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    serve.add_argument("--tls-key", help="the certificate's private key (PEM)")
    serve.add_argument("--checkpoint-file", help="save the state here (npz) at INIT and every "
                       "--checkpoint-every applied updates")
    serve.add_argument("--resume", action="store_true",
                       help="start from --checkpoint-file instead of waiting for an INIT")
    serve.add_argument("--ready-file", help="written with the bound port once serving")
    serve.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    serve.add_argument("--shards", type=int, default=1, help="run this many servers, each "
                       "owning a slice of the parameters (ports --port, --port+1, ... or "
                       "free ones), restarted from their checkpoints if they die; prints "
                       "the fit's ps_address")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ps %(levelname)s %(message)s")
    return _serve(args, SECRET_ENV)


def _serve(args: argparse.Namespace, secret_env: str) -> int:
    from sparkdl_avg.ps.server import ParameterServer

    secret_hex = Path(args.secret_file).read_text().strip() if args.secret_file \
        else os.environ.get(secret_env, "")
    try:
        secret = bytes.fromhex(secret_hex)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        return _fail(f"need a secret of at least 16 bytes in hex (--secret-file or "
                     f"${secret_env})")
    try:
        settings = ServerSettings.from_args(args)
    except ConfigError as exc:
        return _fail(str(exc))
    if args.resume and not (args.checkpoint_file and os.path.exists(args.checkpoint_file)):
        return _fail("--resume needs an existing --checkpoint-file")
    try:
        tls = server_context(args.tls_cert, args.tls_key) if args.tls_cert else None
    except ConfigError as exc:
        return _fail(str(exc))
    if args.shards != 1:
        from sparkdl_avg.ps.shard_supervisor import serve_shards

        return serve_shards(args, secret, settings, _fail, _alive)
    server = ParameterServer(settings, secret=secret, host=args.host, port=args.port, tls=tls,
                             checkpoint_path=args.checkpoint_file)
    if args.resume:
        server.restore(args.checkpoint_file)
    stop = threading.Event()
    with server:
        if args.ready_file:
            tmp = args.ready_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"port": server.address[1], "pid": os.getpid()}, f)
            os.replace(tmp, args.ready_file)
        logging.info("serving on %s:%d with %s", *server.address, settings)
        try:
            while not stop.wait(1.0):
                if args.parent_pid and not _alive(args.parent_pid):  # watchdog
                    logging.warning("parent %d is gone: stopping", args.parent_pid)
                    break
                if server.failure is not None:  # exit, so whoever watches restarts us
                    logging.error("cannot accept connections any more: stopping")
                    return 1
        except KeyboardInterrupt:
            pass
    return 0


def _fail(message: str) -> int:
    print(f"sparkdl-avg ps: {message}", file=sys.stderr)
    return 2


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
