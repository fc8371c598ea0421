"""What every peer adapter shares: the data on disk, the flags, the report.

Numpy and the standard library only: this module is imported in every framework's venv.

The data set is kvcoll's SyntheticCTR (planted model), written once by the parent
(bench/peers_bench.py, `write_data`) as .npy files:

    train_cat.npy    int64   [steps * batch, fields]   global ids (field f's in its own range)
    train_num.npy    float32 [steps * batch, numeric]
    train_label.npy  float32 [steps * batch]
    eval_cat.npy, eval_num.npy, eval_label.npy          the held-out samples
    manifest.json    how it was made (seed, vocab, batch, steps, fields' id offsets)

The global batch of step t is rows [t * batch, (t + 1) * batch); rank r of w reads its
`even_split` part of it, as kvcoll's generator would have made it. Every adapter reads
its slice inside the timed loop in the same way (`Data.batch`: one positioned read per
file into a fresh array; the parent has put the files in the page cache), so data
reading is timed alike for all. The files are read, not memory-mapped, so that a
process's resident set holds its own memory and not the page cache's.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

FILES = ("cat", "num", "label")


def even_split(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rows [lo, hi) of n that rank gets: the first n % world ranks get one more
    (the same split as kvcoll.data.even_split)."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


class _Array:
    """A 2-d (or 1-d) .npy file read by rows with positioned reads."""

    def __init__(self, path: str):
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = read(f)
            self.offset = f.tell()
        if fortran:
            raise ValueError(f"{path}: Fortran-ordered arrays are not supported")
        self.path, self.shape, self.dtype = path, shape, np.dtype(dtype)
        self.row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * self.dtype.itemsize
        self.fd = os.open(path, os.O_RDONLY)

    def __len__(self) -> int:
        return self.shape[0]

    def rows(self, lo: int, hi: int) -> np.ndarray:
        out = np.empty((hi - lo,) + tuple(self.shape[1:]), self.dtype)
        view = memoryview(out).cast("B")
        want, pos = view.nbytes, self.offset + lo * self.row_bytes
        got = 0
        while got < want:
            n = os.preadv(self.fd, [view[got:]], pos + got)
            if n <= 0:
                raise OSError(f"{self.path}: short read at byte {pos + got}")
            got += n
        return out


class Data:
    """The data set in `path` (see the module docstring)."""

    def __init__(self, path: str):
        self.path = path
        with open(os.path.join(path, "manifest.json"), encoding="utf-8") as f:
            self.manifest = json.load(f)
        self.batch_size = int(self.manifest["batch"])
        self.steps = int(self.manifest["steps"])
        self.num_fields = int(self.manifest["num_fields"])
        self.num_numeric = int(self.manifest["num_numeric"])
        self.offsets = np.asarray(self.manifest["offsets"], np.int64)
        self.vocab = np.asarray(self.manifest["vocab"], np.int64)
        self.train = {k: _Array(os.path.join(path, f"train_{k}.npy")) for k in FILES}
        self.eval = {k: _Array(os.path.join(path, f"eval_{k}.npy")) for k in FILES}

    def batch(self, step: int, rank: int = 0, world: int = 1) -> dict:
        """This rank's slice of the global batch of `step`, as arrays of its own."""
        if not 0 <= step < self.steps:
            raise ValueError(f"step {step} is outside the {self.steps} steps written to {self.path}")
        lo, hi = even_split(self.batch_size, rank, world)
        a = step * self.batch_size
        return {k: self.train[k].rows(a + lo, a + hi) for k in FILES}

    def eval_part(self, rank: int = 0, world: int = 1) -> dict:
        """This rank's even_split part of the held-out samples."""
        lo, hi = even_split(len(self.eval["label"]), rank, world)
        return {k: self.eval[k].rows(lo, hi) for k in FILES}

    def eval_size(self) -> int:
        return len(self.eval["label"])

    def train_ids(self, steps: int) -> np.ndarray:
        """The ids of the first `steps` global batches (every rank's), [n, fields]."""
        return self.train["cat"].rows(0, steps * self.batch_size)


def eval_chunks(n: int, world: int, per_call: int) -> int:
    """How many predict calls every rank makes for its part of n eval samples: the same
    number on every rank (lookups are collectives on 2 ranks), each rank's part cut
    into that many even pieces (`even_split`)."""
    largest = max(hi - lo for lo, hi in (even_split(n, r, world) for r in range(world)))
    return max(1, -(-largest // per_call))


def parse(argv=None, extra=None) -> argparse.Namespace:
    """The flags every adapter takes (bench/peers_bench.py passes them)."""
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="directory written by bench/peers_bench.py")
    p.add_argument("--out", required=True, help="directory for rank<r>.json and preds<r>.npy")
    p.add_argument("--steps", type=int, required=True, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first")
    p.add_argument("--threads", type=int, default=1, help="compute threads per process")
    p.add_argument("--dim", type=int, default=15,
                   help="FM vector width (a row is dim + 1 floats: one first-order weight)")
    p.add_argument("--hidden", default="256,128", help="deep MLP units")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam, dense weights")
    p.add_argument("--sparse-lr", type=float, default=0.2, help="Adagrad, embedding rows")
    p.add_argument("--sparse-init-accum", type=float, default=0.01,
                   help="Adagrad's initial accumulator")
    p.add_argument("--init-std", type=float, default=0.01, help="rows start as N(0, std^2)")
    p.add_argument("--eval-batch", type=int, default=16384, help="samples per predict call")
    p.add_argument("--seed", type=int, default=0)
    if extra:
        extra(p)
    args = p.parse_args(argv)
    args.hidden = tuple(int(u) for u in args.hidden.split(",") if u.strip())
    if args.warmup + args.steps < 1:
        p.error("need at least one step")
    return args


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (VmHWM)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def report(args, *, framework: str, rank: int, world: int, seconds: float, rows: int,
           preds: np.ndarray, config: dict, train_loss: float, peak_rss: int,
           **extra) -> None:
    """Write this rank's record (rank<r>.json) and its eval predictions (preds<r>.npy:
    logits of its even_split part of the eval set) into args.out. `rows` is the number
    of embedding rows this rank holds, `train_loss` the mean loss of the timed steps;
    `extra` goes into the record as it is."""
    os.makedirs(args.out, exist_ok=True)
    np.save(os.path.join(args.out, f"preds{rank}.npy"), np.asarray(preds, np.float32).reshape(-1))
    record = {"framework": framework, "rank": rank, "world": world, "threads": args.threads,
              "steps": args.steps, "warmup": args.warmup, "seconds": seconds,
              "rows": int(rows), "peak_rss_bytes": int(peak_rss),
              "train_loss": float(train_loss), "config": config, **extra}
    with open(os.path.join(args.out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(record, f)

