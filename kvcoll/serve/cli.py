"""`kvcoll serve DIR` (also `python -m kvcoll.serve DIR`): serve a publish directory
with TensorFlow Serving's gRPC and REST APIs. See docs/serving.md.

Prints one line when it serves, for scripts and tests to wait for:

    kvcoll serve: ready model=<name> version=<n> grpc=<host>:<port> rest=<host>:<port>

and stops cleanly on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

__all__ = ["main", "kvcoll_main"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvcoll serve",
        description="Serve a kvcoll publish directory (kv.callbacks.Publish) with "
                    "TensorFlow Serving's gRPC and REST APIs, applying new versions live.")
    p.add_argument("directory", help="the publish directory")
    p.add_argument("--model-name", default="model",
                   help="the name clients ask for (model_spec.name, /v1/models/<name>)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--grpc-port", type=int, default=8500, help="gRPC port (0: any free)")
    p.add_argument("--rest-port", type=int, default=8501, help="REST port (0: any free)")
    p.add_argument("--max-batch", type=int, default=4096,
                   help="the most samples one request may hold")
    p.add_argument("--batch-rows", type=int, default=256,
                   help="merge concurrent requests up to this many samples")
    p.add_argument("--batch-wait-ms", type=float, default=2.0,
                   help="wait at most this long for more requests to merge")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 2,
                   help="threads that run merged batches (default: the cores)")
    p.add_argument("--poll-ms", type=float, default=200.0,
                   help="how often to look for a new version (0: never: serve the "
                        "version loaded at start)")
    p.add_argument("--headroom", type=float, default=1.25,
                   help="table capacity reserved at load, as a multiple of the base's rows "
                        "(growth beyond it rebuilds a table's index while requests wait)")
    p.add_argument("--apply-share", type=float, default=0.2,
                   help="the share of a core applying a delta may use while requests are "
                        "served: it pauses between its pieces so that requests are not "
                        "delayed behind it (1: no pauses; the apply finishes sooner)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for name, value, low in (("--max-batch", args.max_batch, 1),
                             ("--batch-rows", args.batch_rows, 1),
                             ("--workers", args.workers, 1)):
        if value < low:
            print(f"kvcoll serve: {name} must be >= {low}, got {value}", file=sys.stderr)
            return 2
    if not 0 < args.apply_share <= 1:
        print(f"kvcoll serve: --apply-share must be in (0, 1], got {args.apply_share}",
              file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from ..publish import PublishError
    from .model import ServedModel
    from .server import Server

    try:
        model = ServedModel(args.directory, name=args.model_name, max_batch=args.max_batch,
                            headroom=args.headroom, apply_share=args.apply_share)
    except PublishError as exc:
        print(f"kvcoll serve: {exc}", file=sys.stderr)
        return 1
    server = Server(model, host=args.host, grpc_port=args.grpc_port,
                    rest_port=args.rest_port, batch_rows=args.batch_rows,
                    batch_wait=args.batch_wait_ms / 1000.0, workers=args.workers)
    return asyncio.run(_run(server, args.poll_ms / 1000.0))


async def _run(server, poll: float) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await server.start()
    tail = None
    if poll > 0 and hasattr(server, "follow"):
        tail = loop.create_task(server.follow(poll))
    m = server.model
    print(f"kvcoll serve: ready model={m.name} version={m.version} "
          f"grpc={server.host}:{server.grpc_port} rest={server.host}:{server.rest_port}",
          flush=True)
    await stop.wait()
    if tail is not None:
        tail.cancel()
        try:
            await tail
        except asyncio.CancelledError:
            pass
    await server.stop()
    m.close()
    return 0


def kvcoll_main(argv=None) -> int:
    """The `kvcoll` console script: `kvcoll serve DIR ...`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] != "serve":
        print("usage: kvcoll serve DIR [options]   (kvcoll serve --help for the options)",
              file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return main(argv[1:])
