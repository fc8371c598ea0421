"""Rows on the wire as fp32, fp16 and bf16: speed, bytes and the demo's AUC.

    python -m bench wire            # 2 ranks x 1 thread, the demo's 400 steps, ~3 minutes
    python -m bench wire --quick    # a smoke test

Each launch (bench/wire_worker.py) trains the demo's DeepFM (examples/train.py's
defaults: dim 8, i.e. rows of 9 floats, global batch 4096, hidden 256-128, Adam for the dense
weights and Adagrad for the rows) three times in one process, with wire_dtype fp32, fp16 and bf16,
on the same batches, in rotating blocks: the ratios to fp32 come from the same run
and the same machine load. Per dtype: samples/s, the bytes every rank sends the others
per step (ids, rows, row gradients), the exchange's ms per step, the final loss and the
AUC on a fixed held-out set after the same steps. Also the C conversion's speed alone.

This machine's ranks exchange over shared memory, where bytes are cheap: the speed
gain here is small or none, and what a 16-bit wire saves on a network is the byte
count (the scale model's input). Writes bench/results/wire.json and wire.md.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from . import common

WORKER = os.path.join(common.ROOT, "bench", "wire_worker.py")
WIRES = ("fp32", "fp16", "bf16")


def add_arguments(p) -> None:
    g = p.add_argument_group("wire")
    g.add_argument("--wire-steps", type=int, default=400,
                   help="timed steps per dtype (the demo's 400)")
    g.add_argument("--wire-launches", type=int, default=3,
                   help="launches of the three-way comparison on 2 ranks")
    g.add_argument("--wire-quiet-wait", type=float, default=600,
                   help="seconds to wait, before each launch, for other processes to use "
                        "less than half a CPU (the wait is recorded, then it goes on)")
    g.add_argument("--wire-worlds", default="2", help="world sizes, comma-separated")


def _mpirun(world: int, args: list[str], timeout: float) -> None:
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(world),
           sys.executable, WORKER, *args]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def conversion_speed(n: int = 1 << 22) -> dict:
    """ns per value of the C pack and unpack (kvcoll.exchange.wire), one thread, on
    values like a row payload's."""
    from kvcoll.exchange.kernels import set_threads
    from kvcoll.exchange.wire import Wire

    set_threads(1)
    x = (np.random.default_rng(0).standard_normal(n) * 0.05).astype(np.float32)
    out = {}
    for name in WIRES[1:]:
        w = Wire(name)
        packed, _ = w.pack(x)
        back, _ = w.unpack(packed)
        best = {"pack": [], "unpack": []}
        for _ in range(7):
            t0 = time.perf_counter()
            w.pack(x, out=packed)
            t1 = time.perf_counter()
            w.unpack(packed, out=back)
            t2 = time.perf_counter()
            best["pack"].append(t1 - t0)
            best["unpack"].append(t2 - t1)
        out[name] = {k: min(v) / n * 1e9 for k, v in best.items()}
    return out


def run(args) -> None:
    quick = args.quick
    steps = 20 if quick else args.wire_steps
    launches = 1 if quick else args.wire_launches
    worlds = [int(w) for w in str(args.wire_worlds).split(",") if w.strip()]
    out_dir = args.out or (tempfile.mkdtemp() if quick else common.RESULTS)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in worlds:
            for i in range(launches):
                busy = common.wait_until_quiet(0 if quick else args.wire_quiet_wait, 0.5)
                path = os.path.join(tmp, f"wire{world}-{i}.json")
                print(f"[wire] {world} rank(s), launch {i + 1}/{launches}: fp32, fp16, bf16 "
                      f"x {steps} steps", flush=True)
                _mpirun(world, ["--steps", str(steps), "--block", str(5 if quick else 10),
                                "--batch-size", str(1024 if quick else 4096),
                                "--eval-samples", str(8192 if quick else 100_000),
                                "--out", path], timeout=3600)
                rec = json.load(open(path))
                rec["kind"], rec["launch"], rec["busy_before"] = "train", i, busy
                records.append(rec)
    records.append({"kind": "conversion", "ns_per_value": conversion_speed()})
    common.publish(out_dir, "wire", records, lambda m: markdown(records, m))


def _q(v) -> str:
    a, b = np.percentile(v, [25, 75])
    return f"{a:.2f}-{b:.2f}"


def markdown(records, machine) -> str:
    runs = [r for r in records if r["kind"] == "train"]
    conv = next(r for r in records if r["kind"] == "conversion")["ns_per_value"]
    first = runs[0]
    lines = [
        "# Rows on the wire: fp32, fp16, bf16",
        "",
        f"`./dev bench wire` — the demo's DeepFM (examples/train.py's defaults: rows of "
        f"{first['dim'] + 1} floats, hidden {'-'.join(map(str, first['hidden']))}, global "
        f"batch {first['global_batch_size']}, BSP, pipelined loop), {first['steps']} timed "
        f"steps after {first['warmup']} of warm-up, one TensorFlow thread per rank. "
        f"{machine['cpu']}, {machine['cores']} cores, TensorFlow "
        f"{machine.get('tensorflow', '?')}, {machine.get('date', '')}.",
        "",
        "Three trainers in one launch (kv.Trainer(wire_dtype=...)), the same initial weights "
        f"and batches, stepping blocks of {first['block']} steps in a rotating order with a "
        "barrier around each block: a 16-bit dtype's ratio is its block's speed over the "
        "fp32 block's of the same round; the median and quartiles over the rounds. The "
        "ranks exchange over shared memory here, so bytes cost little: the speed ratio "
        "is this machine's, the bytes are what a network would carry.",
        "",
        "## Speed and AUC",
        "",
        "| ranks | launch | wire | samples/s (median block) | / fp32 (median) | quartiles | "
        "exchange ms/step | final loss | eval AUC | AUC - fp32's | others busy before |",
        "|---:|---:|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        base = r["wires"]["fp32"]
        for w in WIRES:
            d = r["wires"][w]
            ratio = f"{d['ratio_to_fp32']:.3f}" if w != "fp32" else "1"
            quart = _q(d["ratios_to_fp32"]) if w != "fp32" else ""
            lines.append(
                f"| {r['world_size']} | {r['launch'] + 1} | {w} | {d['samples_per_sec']:,.0f} | "
                f"{ratio} | {quart} | {d['ms_per_step']['exchange']:.2f} | "
                f"{d['final_loss']:.5f} | {d['eval_auc']:.5f} | "
                f"{d['eval_auc'] - base['eval_auc']:+.5f} | {r['busy_before']:.2f} |")
    lines += [
        "",
        f"Held-out set: {first['eval_samples']:,} samples never trained on (planted AUC "
        f"{first['planted_auc']:.4f}, the best any model reaches there).",
        "",
        "## Bytes on the wire per step",
        "",
        "Summed over every rank: what each sends to the others (its own share never "
        "crosses), per training step. The dense gradient's allreduce stays float32 "
        "whatever the wire (its size: the vector each rank contributes).",
        "",
        "| ranks | wire | ids | rows | row gradients | total | / fp32 | "
        "dense allreduce (per rank) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for world in sorted({r["world_size"] for r in runs}):
        r = next(x for x in runs if x["world_size"] == world)
        base = r["wires"]["fp32"]["bytes_per_step"]["total"]
        for w in WIRES:
            b = r["wires"][w]["bytes_per_step"]
            lines.append(
                f"| {world} | {w} | {b['ids'] / 1e3:,.1f} kB | {b['rows'] / 1e3:,.1f} kB | "
                f"{b['grads'] / 1e3:,.1f} kB | {b['total'] / 1e3:,.1f} kB | "
                f"{b['total'] / base if base else 1:.3f} | "
                f"{r['wires'][w]['dense_allreduce_bytes'] / 1e3:,.1f} kB |")
    lines += [
        "",
        "Ids stay 8 bytes each; rows and their gradients go from 4 to 2 bytes a value, so "
        "the saving is (rows + gradients) / 2 of the total, and grows with the row width "
        f"(the demo's rows are {first['dim'] + 1} floats against an 8-byte id each way).",
        "",
        "## The conversion alone",
        "",
        "C, one thread, 4M values (kvcoll.exchange.wire; the AVX-512 copy on this CPU):",
        "",
        "| wire | pack ns/value | unpack ns/value |",
        "|---|---:|---:|",
    ]
    for w in WIRES[1:]:
        lines.append(f"| {w} | {conv[w]['pack']:.3f} | {conv[w]['unpack']:.3f} |")
    ratios = {w: [r["wires"][w]["ratio_to_fp32"] for r in runs if r["world_size"] == 2]
              for w in WIRES[1:]}
    aucd = {w: [r["wires"][w]["eval_auc"] - r["wires"]["fp32"]["eval_auc"] for r in runs]
            for w in WIRES[1:]}
    if ratios["fp16"]:
        lines += [
            "",
            "## Summary",
            "",
            *[f"- {w}: speed / fp32 on 2 ranks {statistics.median(ratios[w]):.3f} (median "
              f"of launches), AUC - fp32's {min(aucd[w]):+.5f} to {max(aucd[w]):+.5f}."
              for w in WIRES[1:]],
        ]
    lines.append("")
    return "\n".join(lines)
