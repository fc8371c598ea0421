"""Which bytes a rank reads: file lists, globs, byte ranges cut at line ends, text blocks.

Readers take one path, a list of paths, or glob patterns; `expand` turns them into
the ordered list of files, checked on every rank before any reading (so a missing or
unreadable path is the same error everywhere, at construction).

A rank's part of plain text files is a byte range of their concatenation
(`byte_ranges`); a line belongs to the range that holds its first byte, so every line
is read by exactly one rank, whatever the world size, without anyone reading the rest
(Hadoop's input-split rule). `text_blocks` reads a range (or a whole file, .gz
included) in blocks that end at a line end, each knowing where it came from, so an
error can name the file and the line.
"""

from __future__ import annotations

import glob
import gzip
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import InvalidArgumentError

__all__ = ["Block", "byte_ranges", "expand", "is_gzip", "line_number", "text_blocks"]


def expand(paths, what: str) -> list[str]:
    """The files named by `paths` (a path, a glob pattern, or a list of them), in order;
    patterns expand to their sorted matches. Raises InvalidArgumentError naming the path
    when nothing matches, a path is missing, not a file, or cannot be opened."""
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    try:
        paths = [os.fsdecode(p) for p in paths]
    except TypeError:
        raise InvalidArgumentError(
            f"{what}: paths must be a path, a glob pattern or a list of them, got "
            f"{type(paths).__name__}") from None
    out: list[str] = []
    for p in paths:
        if glob.has_magic(p) and not os.path.exists(p):
            matches = sorted(glob.glob(p))
            if not matches:
                raise InvalidArgumentError(f"{what}: the pattern {p!r} matches no file")
            out.extend(matches)
        else:
            out.append(p)
    if not out:
        raise InvalidArgumentError(f"{what}: needs at least one file")
    for p in out:
        if not os.path.exists(p):
            raise InvalidArgumentError(f"{what}: no such file: {p}")
        if not os.path.isfile(p):
            raise InvalidArgumentError(f"{what}: {p} is not a file (a directory?); pass the "
                                       f"files, or a pattern such as {os.path.join(p, '*')!r}")
        try:
            with open(p, "rb"):
                pass
        except OSError as exc:
            raise InvalidArgumentError(f"{what}: cannot read {p}: {exc.strerror}") from None
    return out


def is_gzip(path: str) -> bool:
    return path.endswith(".gz")


def byte_ranges(paths: list[str], sizes: list[int], rank: int, world: int
                ) -> list[tuple[str, int, int]]:
    """Rank `rank`'s (path, start, end) byte ranges: its 1/world of the files'
    concatenated bytes, split at file ends. The ranges' owners then read the lines that
    start inside them (`text_blocks`)."""
    total = sum(sizes)
    lo, hi = total * rank // world, total * (rank + 1) // world
    out, at = [], 0
    for path, size in zip(paths, sizes):
        a, b = max(lo, at), min(hi, at + size)
        if a < b:
            out.append((path, a - at, b - at))
        at += size
    return out


@dataclass
class Block:
    """Whole lines of one file, from byte `offset` on: data ends with a newline (one is
    added to a last line without one). Readers count the lines (they scan the bytes
    anyway); `line_number` finds a block's first line when an error needs it."""
    data: memoryview
    path: str
    offset: int


def _open(path: str):
    return gzip.open(path, "rb") if is_gzip(path) else open(path, "rb")


def text_blocks(path: str, start: int = 0, end: int | None = None,
                block_bytes: int = 8 << 20, what: str = "reader") -> Iterator[Block]:
    """The lines of `path` that start in [start, end) (the whole file by default), in
    blocks of about block_bytes that end at a line end. Byte ranges are for plain
    files; a .gz file is read whole."""
    try:
        with _open(path) as f:
            if start > 0:
                f.seek(start - 1)
                if f.read(1) != b"\n":
                    f.readline()              # the line under way is the previous range's
                start = f.tell()
            if end is None and not is_gzip(path):
                end = os.fstat(f.fileno()).st_size    # read no bigger a block than the file
            if end is not None and start >= end:
                return
            remaining = None if end is None else end - start
            carry = b""
            at = start
            while remaining is None or remaining > 0:
                want = block_bytes if remaining is None else min(block_bytes, remaining)
                data = bytearray(len(carry) + want)      # read once, straight after carry
                data[:len(carry)] = carry
                got = f.readinto(memoryview(data)[len(carry):])
                if not got:
                    break
                if got < want:
                    del data[len(carry) + got:]
                if remaining is not None:
                    remaining -= got
                    if remaining == 0 and not data.endswith(b"\n"):
                        data += f.readline()   # finish the last line that starts in range
                cut = data.rfind(b"\n") + 1
                if cut == 0:
                    carry = bytes(data)
                    continue
                carry = bytes(data[cut:])
                yield Block(memoryview(data)[:cut], path, at)
                at += cut
            if carry:
                yield Block(memoryview(carry + b"\n"), path, at)
    except (OSError, EOFError, zlib.error) as exc:
        raise InvalidArgumentError(f"{what}: cannot read {path}: {exc}") from None


def line_number(path: str, offset: int) -> int:
    """The 1-based number of the line that starts at byte `offset` of `path` (of the
    decompressed stream for .gz): counts the newlines before it. For error messages."""
    count, at = 0, 0
    with _open(path) as f:
        while at < offset:
            chunk = f.read(min(8 << 20, offset - at))
            if not chunk:
                break
            count += chunk.count(b"\n")
            at += len(chunk)
    return count + 1
