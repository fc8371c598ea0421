"""Checkpoint throughput: full vs incremental save, restore, and export for serving.

    python -m bench checkpoint            # 10M rows at dim 16 (Adagrad): a few minutes
    python -m bench checkpoint --quick    # 200k rows: a smoke test

One table of --ckpt-rows rows at --ckpt-dim (Adagrad: dim slot floats per row), one rank
(kvcoll.checkpoint.Checkpointer on a one-rank communicator, tables only: the dense
model's tf.train.Checkpoint is not part of the measure). Measured, each in a child
process on a temporary directory on the same disk as the repository:

- full save: export every row (value, slots, header), write + sha256 + fsync, commit;
- incremental save after updating --ckpt-changed (1%) of the rows;
- restore of the full checkpoint, and of the full + delta chain (read, verify sha256,
  import) into a fresh table;
- export: kv.export of a one-table Keras model (SavedModel with a DenseHashTable and
  the embedding dictionary).

Writes bench/results/checkpoint.json and checkpoint.md. Target: an incremental save
of 1% dirty rows at least 20x faster than a full save.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

from . import common


def add_arguments(p) -> None:
    g = p.add_argument_group("checkpoint")
    g.add_argument("--ckpt-rows", type=int, default=10_000_000, help="rows in the table")
    g.add_argument("--ckpt-dim", type=int, default=16, help="embedding width")
    g.add_argument("--ckpt-changed", type=float, default=0.01,
                   help="fraction of rows updated before the incremental save")


def child(spec: dict) -> None:
    """Child: build the table, save full, update a fraction, save incremental, restore
    both ways, export; one record per measurement."""
    import numpy as np

    import kvcoll as kv
    from kvcoll.checkpoint import Checkpointer
    from kvcoll.comm import Comm

    rows, dim, changed = spec["rows"], spec["dim"], spec["changed"]
    tmp = tempfile.mkdtemp(prefix="kvbench-ckpt-", dir=spec["dir"])
    comm = Comm.local()
    try:
        opt = kv.optimizers.Adagrad(0.05)
        t = kv.KvTable(dim, name="t", initializer=("normal", 0.0, 0.01), optimizer=opt)
        keys = np.random.default_rng(0).permutation(rows * 4)[:rows].astype(np.int64)
        for i in range(0, rows, 1 << 20):
            t.find_or_create(keys[i:i + (1 << 20)], step=1)
        ck = Checkpointer({"t": t}, comm)
        ckdir = os.path.join(tmp, "ck")

        def record(what, seconds, n, nbytes, **extra):
            common.emit({"what": what, "rows": int(n), "bytes": int(nbytes),
                         "seconds": seconds, "rows_per_sec": n / seconds,
                         "mb_per_sec": nbytes / seconds / 1e6, "table_rows": rows, "dim": dim,
                         **extra})

        info = ck.save(ckdir, 1)
        record("save full", info.seconds, info.rows, info.bytes)
        n_changed = max(1, int(rows * changed))
        hot = np.random.default_rng(1).choice(keys, n_changed, replace=False)
        grads = np.random.default_rng(2).normal(size=(n_changed, dim)).astype(np.float32)
        t.apply_gradients(hot, grads, step=2)
        info = ck.save(ckdir, 2, incremental=True)
        assert info.kind == "delta" and info.rows == n_changed, info
        record("save incremental", info.seconds, info.rows, info.bytes,
               changed_fraction=changed)
        full_name = f"ckpt-{1:010d}"
        expected = t.export()
        for what, name in (("restore full", full_name), ("restore full + delta", None)):
            fresh = kv.KvTable(dim, name="t", initializer=("normal", 0.0, 0.01), optimizer=opt)
            r = Checkpointer({"t": fresh}, comm).restore(ckdir, name)
            record(what, r.seconds, r.rows, r.bytes, chain=len(r.chain))
            if name is None:
                got = fresh.find(expected["keys"][:1000])
                assert np.array_equal(got, expected["values"][:1000])
            fresh.close()
        del expected
        shutil.rmtree(ckdir)

        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import keras

        ids = keras.Input(shape=(), dtype="int64", name="id")
        x = keras.Input(shape=(4,), dtype="float32", name="x")
        emb = kv.Embedding("t", dim, initializer=("normal", 0.0, 0.01))
        model = keras.Model({"id": ids, "x": x}, keras.layers.Dense(1)(
            keras.layers.Concatenate()([emb(ids), x])))
        trainer = kv.Trainer(model, keras.losses.BinaryCrossentropy(from_logits=True),
                             kv.DistributedOptimizer(keras.optimizers.Adam(1e-3), sparse=opt),
                             comm=comm)
        e = t.export()
        trainer.tables["t"].import_(e["keys"], e["values"], slots=e["slots"])
        del e
        t.close()
        t0 = time.perf_counter()
        kv.export(os.path.join(tmp, "export"), trainer)
        sec = time.perf_counter() - t0
        size = sum(os.path.getsize(os.path.join(d, f))
                   for d, _, fs in os.walk(os.path.join(tmp, "export")) for f in fs)
        record("export (SavedModel + dictionary)", sec, rows, size)
        trainer.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args) -> None:
    rows = 200_000 if args.quick else args.ckpt_rows
    out_dir = args.out or (tempfile.mkdtemp() if args.quick else common.RESULTS)
    spec = {"rows": rows, "dim": args.ckpt_dim, "changed": args.ckpt_changed,
            "dir": tempfile.gettempdir()}
    print(f"[checkpoint] {rows:,} rows at dim {args.ckpt_dim}, "
          f"{args.ckpt_changed:.0%} changed", flush=True)
    records, error = common.run_child("bench.checkpoint_bench:child", spec, timeout=3600)
    if error:
        records.append({"what": "error", "error": error})
    common.publish(out_dir, "checkpoint", records,
                   lambda m: markdown(records, rows, args.ckpt_dim, args.ckpt_changed, m))


def markdown(records, rows, dim, changed, machine) -> str:
    lines = [
        "# Checkpoint throughput",
        "",
        f"`./dev bench checkpoint` — one table of {rows:,} rows at dim {dim} (Adagrad: "
        f"{dim} slot floats per row), one rank, tables only; {machine['cpu']}, "
        f"{machine['cores']} cores, {machine['memory_gib']} GiB, {machine.get('date', '')}.",
        "Saves write, sha256 and fsync every file; restores read and verify every file.",
        "",
        "| operation | rows | MB | seconds | rows/s | MB/s |",
        "|---|---|---|---|---|---|",
    ]
    by = {}
    for r in records:
        if r["what"] == "error":
            lines.append(f"| error | {r['error']} | | | | |")
            continue
        by[r["what"]] = r
        lines.append(f"| {r['what']} | {r['rows']:,} | {r['bytes'] / 1e6:,.1f} | "
                     f"{r['seconds']:.3f} | {r['rows_per_sec']:,.0f} | {r['mb_per_sec']:,.0f} |")
    if "save full" in by and "save incremental" in by:
        ratio = by["save full"]["seconds"] / by["save incremental"]["seconds"]
        lines += ["", f"- incremental save of {changed:.0%} changed rows: {ratio:.1f}x faster "
                      f"than a full save (target >= 20x)"]
    lines.append("")
    return "\n".join(lines)
