"""Checkpoint throughput and memory: saves, restores on other world sizes, export.

    python -m bench checkpoint            # 10M rows at dim 16 (Adagrad): about 15 minutes
    python -m bench checkpoint --quick    # 200k rows: a smoke test

One table of --ckpt-rows rows at --ckpt-dim (Adagrad: dim slot floats per row), tables
only (kvcoll.checkpoint.Checkpointer; the dense model's tf.train.Checkpoint is not part
of the measure), on a temporary directory on the same disk as the repository. Every
save and restore runs in a fresh process (a child, or an mpirun job), so none of them
finds memory that an earlier one freed: on a VM the first touch of fresh memory is a
good part of the cost, and a save measured in a warm process (or a restore in a cold
one) would not compare.

One rank:
- full save in format 1 (the first format, written as kvcoll wrote it: six .npy
  records, a sha256 per file) and in format 3 (pages sorted by the model's bucket, a
  sha256 per page); both export every row, write, hash and fsync every file, commit;
  then, in the format-3 process, an incremental save after updating --ckpt-changed (1%)
  of the rows;
- restore into a fresh table: format 1, the format-3 full checkpoint, and its full +
  delta chain;
- export: kv.export of a one-table Keras model (SavedModel built from the dictionary's
  parts, and the dictionary).

Across world sizes (mpirun): the same rows written on 2 ranks (format 1: today's full
save; format 3 with a delta of 1% changed rows), then restored on 1 and on 3 ranks, the
full checkpoint and the full + delta chain, with the default restore buffer (256 MiB),
and the format-1 checkpoint on 3 ranks for comparison. Each rank reports its seconds,
rows, bytes read, and its peak RSS growth during the restore (VmHWM reset before it)
next to its table's final bytes: extra = growth - table, to hold against the bound (the
buffer, plus the table's old index while its index grows: under 5 bytes a row).

Writes bench/results/checkpoint.json and checkpoint.md. Targets: an incremental save of
1% dirty rows at least 20x faster than a full save; a format-3 restore on another world
size within the memory bound on every rank, at a throughput (rows / seconds of the
slowest rank) at least that of today's full save (format 1 on the 2 writing ranks, in
the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from . import common

SEED = 0


def add_arguments(p) -> None:
    g = p.add_argument_group("checkpoint")
    g.add_argument("--ckpt-rows", type=int, default=10_000_000, help="rows in the table")
    g.add_argument("--ckpt-dim", type=int, default=16, help="embedding width")
    g.add_argument("--ckpt-changed", type=float, default=0.01,
                   help="fraction of rows updated before the incremental save")


def _table(dim: int):
    import kvcoll as kv

    return kv.KvTable(dim, name="t", initializer=("normal", 0.0, 0.01),
                      optimizer=kv.optimizers.Adagrad(0.05))


def _keys(rows: int):
    import numpy as np

    return np.random.default_rng(SEED).permutation(rows * 4)[:rows].astype(np.int64)


def _fill(t, keys) -> None:
    for i in range(0, keys.size, 1 << 20):
        t.find_or_create(keys[i:i + (1 << 20)], step=1)


def _hot(rows: int, changed: float):
    """The keys the incremental save follows a change of: a fixed `changed` fraction."""
    import numpy as np

    return np.random.default_rng(1).choice(_keys(rows), max(1, int(rows * changed)),
                                           replace=False)


def _change(t, hot) -> None:
    import numpy as np

    grads = np.random.default_rng(2).normal(size=(hot.size, t.dim)).astype(np.float32)
    t.apply_gradients(hot, grads, step=2)


def _record(what: str, seconds: float, rows: int, nbytes: int, **extra) -> dict:
    return {"what": what, "seconds": seconds, "rows": int(rows), "bytes": int(nbytes),
            "rows_per_sec": rows / seconds, "mb_per_sec": nbytes / seconds / 1e6, **extra}


def child(spec: dict) -> None:
    """Child (one rank, a fresh process per measurement): spec["op"] is "save" (build
    the table, save it in format spec["version"], and with "delta" update a fraction and
    save incrementally), "restore" (a fresh table from spec["ckpt"] in spec["dir"]) or
    "export"; one record per measurement."""
    import numpy as np

    import kvcoll as kv
    from kvcoll.checkpoint import Checkpointer
    from kvcoll.comm import Comm

    rows, dim, op = spec["rows"], spec["dim"], spec["op"]
    comm = Comm.local()
    base = {"ranks": 1, "table_rows": rows, "dim": dim}
    if op == "restore":
        t = _table(dim)
        r = Checkpointer({"t": t}, comm).restore(spec["dir"], spec.get("ckpt"))
        if spec.get("ckpt"):  # the full save: every row its initial value
            sample = _keys(rows)[:1000]
            assert np.array_equal(t.find(sample), t.initial_values(sample)), "restore"
        common.emit(_record(spec["what"], r.seconds, r.rows, r.bytes, chain=len(r.chain),
                            **base))
        t.close()
        return
    t = _table(dim)
    _fill(t, _keys(rows))
    if op == "save":
        ck = Checkpointer({"t": t}, comm, version=spec["version"])
        info = ck.save(spec["dir"], 1)
        common.emit(_record(spec["what"], info.seconds, info.rows, info.bytes, **base))
        if spec.get("delta"):
            _change(t, _hot(rows, spec["changed"]))
            info = ck.save(spec["dir"], 2, incremental=True)
            assert info.kind == "delta" and info.rows == max(1, int(rows * spec["changed"]))
            common.emit(_record("save incremental", info.seconds, info.rows, info.bytes,
                                changed_fraction=spec["changed"], **base))
        t.close()
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    ids = keras.Input(shape=(), dtype="int64", name="id")
    x = keras.Input(shape=(4,), dtype="float32", name="x")
    emb = kv.Embedding("t", dim, initializer=("normal", 0.0, 0.01))
    model = keras.Model({"id": ids, "x": x}, keras.layers.Dense(1)(
        keras.layers.Concatenate()([emb(ids), x])))
    trainer = kv.Trainer(model, keras.losses.BinaryCrossentropy(from_logits=True),
                         kv.DistributedOptimizer(keras.optimizers.Adam(1e-3),
                                                 sparse=t.optimizer), comm=comm)
    for part in t.export_batches(batch=1 << 20, columns=("slots",)):
        trainer.tables["t"].import_(part["keys"], part["values"], slots=part["slots"])
    t.close()
    out = os.path.join(spec["dir"], "export")
    t0 = time.perf_counter()
    kv.export(out, trainer)
    sec = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    common.emit(_record("export (SavedModel + dictionary)", sec, rows, size, **base))
    trainer.close()


# -- across world sizes (under mpirun) ------------------------------------------------------

def _hwm() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")


def worker(argv=None) -> None:
    """One rank of a job (mpirun -np N python -m bench.checkpoint_bench ROLE ...): write
    (build this rank's share, save in --version; with --delta, update and save a delta)
    or restore (--ckpt: a fresh table from it; its peak RSS growth during the restore).
    Appends every rank's records to --out as JSON lines."""
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("write", "restore"))
    p.add_argument("--dir", required=True)
    p.add_argument("--what", required=True)
    p.add_argument("--rows", type=int, required=True)
    p.add_argument("--dim", type=int, required=True)
    p.add_argument("--changed", type=float, default=0.0)
    p.add_argument("--version", type=int, default=None, help="default: kvcoll's")
    p.add_argument("--delta", action="store_true")
    p.add_argument("--ckpt")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    import numpy as np

    import kvcoll as kv
    from kvcoll.checkpoint import RESTORE_BUFFER, VERSION, Checkpointer
    from kvcoll.routing import owner_of

    kv.init(argv=[])
    from kvcoll.runtime import comm as runtime_comm

    comm = runtime_comm()
    keys = _keys(args.rows)
    mine = keys[owner_of(keys, comm.size) == comm.rank]
    del keys
    records = []

    def record(what, seconds, **extra):
        records.append({"what": what, "ranks": comm.size, "rank": comm.rank, "mpi": True,
                        "seconds": seconds, "table_rows": args.rows, "dim": args.dim,
                        **extra})

    t = _table(args.dim)
    if args.role == "write":
        _fill(t, mine)
        ck = Checkpointer({"t": t}, comm, version=args.version or VERSION)
        comm.barrier()
        info = ck.save(args.dir, 1)
        record(args.what, info.seconds, rows=info.rows, bytes=info.bytes)
        if args.delta:
            hot = _hot(args.rows, args.changed)
            _change(t, hot[owner_of(hot, comm.size) == comm.rank])
            comm.barrier()
            info = ck.save(args.dir, 2, incremental=True)
            record("save incremental", info.seconds, rows=info.rows, bytes=info.bytes)
    else:
        base = common.rss_bytes()
        _reset_hwm()
        comm.barrier()
        info = Checkpointer({"t": t}, comm).restore(args.dir, args.ckpt)
        growth = _hwm() - base
        if args.ckpt:  # the full save: every row its initial value
            sample = mine[:1000]
            assert np.array_equal(t.find(sample), t.initial_values(sample)), "restore"
        total = int(comm.allreduce(np.array([len(t)], np.int64))[0])
        assert total == args.rows, (total, args.rows)
        record(args.what, info.seconds, rows=len(t), bytes=info.bytes, chain=len(info.chain),
               written_on=2, rss_growth=growth, table_bytes=t.stats().bytes,
               extra_bytes=growth - t.stats().bytes, buffer_bytes=RESTORE_BUFFER,
               bound_bytes=RESTORE_BUFFER + 5 * len(t))
    t.close()
    gathered = comm.allgather_json(records, "bench:records")
    if comm.rank == 0:
        with open(args.out, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for rs in gathered for r in rs)
    kv.shutdown()


def _mpirun(world: int, args: list, timeout: float) -> None:
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(world),
           sys.executable, "-m", "bench.checkpoint_bench", *map(str, args)]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=common.ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True,
                          cwd=common.ROOT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")


FULL = f"ckpt-{1:010d}"
BEFORE = "format 1 (before)"


def run(args) -> None:
    from kvcoll.checkpoint import VERSION

    rows = 200_000 if args.quick else args.ckpt_rows
    out_dir = args.out or (tempfile.mkdtemp() if args.quick else common.RESULTS)
    tmp = tempfile.mkdtemp(prefix="kvbench-ckpt-", dir=tempfile.gettempdir())
    v1, cur = os.path.join(tmp, "v1"), os.path.join(tmp, "cur")
    base = {"rows": rows, "dim": args.ckpt_dim, "changed": args.ckpt_changed}
    print(f"[checkpoint] {rows:,} rows at dim {args.ckpt_dim}, "
          f"{args.ckpt_changed:.0%} changed; every measurement in a fresh process", flush=True)
    records = []
    one_rank = [
        ("save", f"save full, {BEFORE}", {"version": 1, "dir": v1}),
        ("save", "save full", {"version": VERSION, "dir": cur, "delta": True}),
        ("restore", f"restore full, {BEFORE}", {"dir": v1}),
        ("restore", "restore full", {"dir": cur, "ckpt": FULL}),
        ("restore", "restore full + delta", {"dir": cur}),
        ("export", "export", {"dir": tmp}),
    ]
    try:
        for op, what, extra in one_rank:
            print(f"[checkpoint] one rank: {what}", flush=True)
            got, error = common.run_child("bench.checkpoint_bench:child",
                                          {**base, **extra, "op": op, "what": what},
                                          timeout=3600)
            records += got
            if error:
                records.append({"what": "error", "error": f"{what}: {error}"})
        for d in (v1, cur):
            shutil.rmtree(d, ignore_errors=True)
        out = os.path.join(tmp, "records.jsonl")
        common_args = ["--rows", rows, "--dim", args.ckpt_dim, "--out", out]
        jobs = [
            (2, ["write", "--dir", v1, "--what", f"save full, {BEFORE}", "--version", 1]),
            (2, ["write", "--dir", cur, "--what", "save full", "--delta",
                 "--changed", args.ckpt_changed]),
        ]
        for world in (1, 3):
            jobs += [(world, ["restore", "--dir", cur, "--ckpt", FULL, "--what", "restore full"]),
                     (world, ["restore", "--dir", cur, "--what", "restore full + delta"])]
        jobs.append((3, ["restore", "--dir", v1, "--what", f"restore full, {BEFORE}"]))
        for world, job in jobs:
            print(f"[checkpoint] {world} rank(s): {job[0]} {job[4]}", flush=True)
            try:
                _mpirun(world, [*job, *common_args], timeout=3600)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                records.append({"what": "error", "error": str(exc)[-600:]})
        if os.path.exists(out):
            with open(out, encoding="utf-8") as f:
                records += [json.loads(line) for line in f]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    common.publish(out_dir, "checkpoint", records,
                   lambda m: markdown(records, rows, args.ckpt_dim, args.ckpt_changed, m))


def summary(records: list) -> dict:
    """Per (operation, ranks) of the multi-rank jobs: seconds of the slowest rank, rows
    over all ranks, the worst extra memory and its bound; and the targets."""
    jobs = {}
    for r in records:
        if r.get("mpi"):
            jobs.setdefault((r["what"], r["ranks"]), []).append(r)
    out = {}
    for key, rs in jobs.items():
        sec = max(r["seconds"] for r in rs)
        rows = sum(r["rows"] for r in rs) if "chain" in rs[0] else rs[0]["rows"]
        out[key] = {"seconds": sec, "rows": rows, "rows_per_sec": rows / sec, "per_rank": rs}
    return out


def _mib(n: float) -> str:
    return f"{n / 2**20:,.0f}"


def markdown(records, rows, dim, changed, machine) -> str:
    lines = [
        "# Checkpoint throughput and memory",
        "",
        f"`./dev bench checkpoint` — one table of {rows:,} rows at dim {dim} (Adagrad: "
        f"{dim} slot floats per row), tables only; {machine['cpu']}, "
        f"{machine['cores']} cores, {machine['memory_gib']} GiB, {machine.get('date', '')}.",
        "Saves write, sha256 and fsync every file; restores read and verify every page they "
        "use (format 3: twice, once to verify and once to replay). Format 1 is the first "
        "format (kvcoll's save before format 2). Every save and restore runs in a "
        "fresh process.",
        "",
        "One rank:",
        "",
        "| operation | rows | MB | seconds | rows/s | MB/s |",
        "|---|---|---|---|---|---|",
    ]
    by = {}
    for r in records:
        if r["what"] == "error":
            lines.append(f"| error | {r['error']} | | | | |")
            continue
        if r.get("mpi"):
            continue
        by[r["what"]] = r
        lines.append(f"| {r['what']} | {r['rows']:,} | {r['bytes'] / 1e6:,.1f} | "
                     f"{r['seconds']:.3f} | {r['rows_per_sec']:,.0f} | {r['mb_per_sec']:,.0f} |")
    jobs = summary(records)
    if jobs:
        lines += ["", "Written on 2 ranks, restored on 1 and 3 (default restore buffer, "
                      "256 MiB); rows/s = rows over all ranks / seconds of the slowest rank; "
                      "per rank: seconds, MB read, peak RSS growth during the restore, the "
                      "table's final bytes, and extra = growth - table (MiB):",
                  "",
                  "| operation | ranks | rows | seconds | rows/s | per rank: s / MB read / "
                  "RSS growth / table / extra (MiB) |",
                  "|---|---|---|---|---|---|"]
        for (what, ranks), j in sorted(jobs.items(), key=lambda kv: (kv[0][1] != 2, kv[0])):
            per = "; ".join(
                f"{r['seconds']:.1f} / {r['bytes'] / 1e6:,.0f}"
                + (f" / {_mib(r['rss_growth'])} / {_mib(r['table_bytes'])} / "
                   f"{_mib(r['extra_bytes'])}" if "rss_growth" in r else "")
                for r in sorted(j["per_rank"], key=lambda r: r["rank"]))
            lines.append(f"| {what} | {ranks} | {j['rows']:,} | {j['seconds']:.2f} | "
                         f"{j['rows_per_sec']:,.0f} | {per} |")
    lines.append("")
    if "save full" in by and "save incremental" in by:
        ratio = by["save full"]["seconds"] / by["save incremental"]["seconds"]
        lines.append(f"- incremental save of {changed:.0%} changed rows: {ratio:.1f}x faster "
                     f"than a full save (target >= 20x)")
    before = jobs.get(("save full, format 1 (before)", 2))
    for (what, ranks), j in sorted(jobs.items()):
        if not what.startswith("restore"):
            continue
        worst = max(j["per_rank"], key=lambda r: r["extra_bytes"] - r["bound_bytes"])
        if BEFORE in what:
            lines.append(f"- {what} on {ranks} rank(s), for comparison: every rank reads "
                         f"every file whole into memory first: extra memory up to "
                         f"{_mib(worst['extra_bytes'])} MiB a rank")
            continue
        within = all(r["extra_bytes"] <= r["bound_bytes"] for r in j["per_rank"])
        line = (f"- {what} on {ranks} rank(s): worst extra memory {_mib(worst['extra_bytes'])}"
                f" MiB against a bound of {_mib(worst['bound_bytes'])} MiB (256 MiB buffer + "
                f"5 B a row): {'within' if within else '**above**'}")
        if before:
            ratio = j["rows_per_sec"] / before["rows_per_sec"]
            line += (f"; {j['rows_per_sec']:,.0f} rows/s = {ratio:.2f}x today's full save on 2 "
                     f"ranks ({before['rows_per_sec']:,.0f} rows/s; target >= 1: "
                     f"{'met' if ratio >= 1 else '**missed**'})")
        lines.append(line)
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    worker()
