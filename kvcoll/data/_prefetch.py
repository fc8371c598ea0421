"""Reading ahead of training: a generator run in a background thread, behind a bounded queue.

The readers' work (file reads, pyarrow's parsing, the C id kernels) releases the GIL,
so a thread overlaps it with the training step. The queue holds at most `depth`
batches, so memory stays bounded however fast the reader is. An exception in the
generator is handed over the queue and re-raised on the consuming thread, the same
object with its message (which names the file and line), after the batches read
before it. `close()` (or dropping the iterator) stops the thread at its next batch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

__all__ = ["Prefetch"]

_DONE = object()


class _Raised:
    def __init__(self, exc: BaseException):
        self.exc = exc


def _put(q: queue.Queue, stop: threading.Event, item) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def _produce(source: Iterator, q: queue.Queue, stop: threading.Event) -> None:
    """The reading thread. It holds the queue, the event and the source, never the
    Prefetch object, so dropping that object stops the thread (its __del__ sets stop)."""
    try:
        for item in source:
            if not _put(q, stop, item):
                break
        else:
            _put(q, stop, _DONE)
    except BaseException as exc:  # noqa: BLE001 (handed to the consumer, raised there)
        _put(q, stop, _Raised(exc))
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()                 # a generator's finally blocks (open files) run here


class Prefetch:
    """Iterate `source` (an iterator) in a daemon thread, `depth` items ahead.

    depth 0 reads on the consuming thread (no thread at all)."""

    def __init__(self, source: Iterator, depth: int = 2, name: str = "kvcoll-reader"):
        self._source = source
        self._stop = threading.Event()
        self._thread = None
        self._finished = False
        if depth > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=int(depth))
            self._thread = threading.Thread(target=_produce, name=name, daemon=True,
                                            args=(source, self._queue, self._stop))
            self._thread.start()

    def __iter__(self):
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        if self._thread is None:
            try:
                return next(self._source)
            except StopIteration:
                self._finished = True
                raise
        item = self._queue.get()
        if item is _DONE:
            self._finished = True
            raise StopIteration
        if isinstance(item, _Raised):
            self._finished = True
            raise item.exc
        return item

    def close(self) -> None:
        """Stop reading ahead; the thread ends at its next batch (it is a daemon, so a
        thread blocked in a slow read never keeps the process alive)."""
        self._finished = True
        self._stop.set()
        if self._thread is None:
            close = getattr(self._source, "close", None)
            if close is not None:
                close()
            return
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)

    def __del__(self):
        self._stop.set()
