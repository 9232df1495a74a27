"""Command line: `sparkdl-avg ps serve ...` (or `python -m sparkdl_avg ps serve ...`) runs a
parameter server; fits in async mode start one beside the driver the same way."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
from pathlib import Path

from sparkdl_avg._ps_server import SECRET_ENV


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sparkdl-avg")
    sub = parser.add_subparsers(dest="command", required=True)
    ps = sub.add_parser("ps", help="parameter server").add_subparsers(dest="verb", required=True)
    serve = ps.add_parser("serve", help="serve until stopped (or until --parent-pid exits)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=0, help="0 picks a free port")
    serve.add_argument("--secret-file", help=f"file holding the hex secret (else ${SECRET_ENV})")
    serve.add_argument("--algorithm", choices=["downpour", "dcasgd", "dcasgd-adaptive"],
                       default="downpour")
    serve.add_argument("--lr", type=float, default=0.01, help="workers' lr (DC-ASGD needs it)")
    serve.add_argument("--dc-lambda", type=float, default=None,
                       help="lambda (default 0.04) or, adaptive, lambda0 (default 2)")
    serve.add_argument("--update-scale", type=float, default=1.0)
    serve.add_argument("--staleness-bound", type=int, default=None)
    serve.add_argument("--timeout", type=float, default=600.0)
    serve.add_argument("--max-message-mb", type=int, default=4096)
    serve.add_argument("--tls-cert", help="serve TLS with this certificate (PEM)")
    serve.add_argument("--tls-key", help="the certificate's private key (PEM)")
    serve.add_argument("--checkpoint-file", help="save the state here (npz) at INIT and every "
                       "--checkpoint-every applied updates")
    serve.add_argument("--checkpoint-every", type=int, default=0)
    serve.add_argument("--resume", action="store_true",
                       help="start from --checkpoint-file instead of waiting for an INIT")
    serve.add_argument("--ready-file", help="written with the bound port once serving")
    serve.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s ps %(levelname)s %(message)s")
    return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    from sparkdl_avg._ps_server import ParameterServer

    secret_hex = Path(args.secret_file).read_text().strip() if args.secret_file \
        else os.environ.get(SECRET_ENV, "")
    try:
        secret = bytes.fromhex(secret_hex)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        print(f"sparkdl-avg ps: need a secret of at least 16 bytes in hex (--secret-file or "
              f"${SECRET_ENV})", file=sys.stderr)
        return 2
    default_lambda = 2.0 if args.algorithm == "dcasgd-adaptive" else 0.04
    settings = {"algorithm": args.algorithm, "lr": args.lr, "update_scale": args.update_scale,
                "dc_lambda": default_lambda if args.dc_lambda is None else args.dc_lambda}
    tls = None
    if args.tls_cert:
        import ssl

        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    server = ParameterServer(tls=tls, secret=secret, host=args.host, port=args.port,
                             settings=settings,
                             staleness_bound=args.staleness_bound, timeout=args.timeout,
                             max_message_bytes=args.max_message_mb << 20,
                             checkpoint_path=args.checkpoint_file,
                             checkpoint_every=args.checkpoint_every)
    if args.resume:
        if not args.checkpoint_file or not os.path.exists(args.checkpoint_file):
            print("sparkdl-avg ps: --resume needs an existing --checkpoint-file",
                  file=sys.stderr)
            return 2
        server.restore(args.checkpoint_file)
    stop = threading.Event()
    with server:
        if args.ready_file:
            tmp = args.ready_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump({"port": server.address[1], "pid": os.getpid()}, f)
            os.replace(tmp, args.ready_file)
        logging.info("serving on %s:%d", *server.address)
        try:
            while not stop.wait(1.0):
                if args.parent_pid and not _alive(args.parent_pid):  # watchdog
                    logging.warning("parent %d is gone: stopping", args.parent_pid)
                    break
        except KeyboardInterrupt:
            pass
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":
    sys.exit(main())
