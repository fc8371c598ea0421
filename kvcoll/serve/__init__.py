"""kvcoll serve: a publish directory (kv.callbacks.Publish) served with TensorFlow
Serving's gRPC and REST APIs, from kvcoll's C tables and the published serving graph.

    kvcoll serve pub/ --grpc-port 8500 --rest-port 8501     # or python -m kvcoll.serve

Modules: `model` (the tables, the dense graph, the version a request pins), `requests`
(TF Serving's request forms, checked against the signature), `server` (gRPC, REST,
batching, metrics), `heap` (Python's cycle collector kept off the request path),
`cli` (the command). See docs/serving.md.
"""

__all__ = ["main"]


def main(argv=None) -> int:
    from .cli import main as _main

    return _main(argv)
