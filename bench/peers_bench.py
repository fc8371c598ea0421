"""kvcoll beside its peers, TFRA and TorchRec: the same DeepFM on the same data.

    python -m bench peers            # full: 25 minutes on a quiet 2-core machine (more when
                                     # others load it; the venvs once: about 10 minutes)
    python -m bench peers --quick    # a smoke run: tiny sizes, one repetition

Each peer runs in a venv of its own, built on first use and reused while its
requirements file is unchanged (.venv-peers/<peer>, from bench/peers/requirements-*.txt:
TFRA 0.8.1 on tensorflow 2.16.2 with tf-keras 2.16.0, and Horovod 0.28.1 built against
it; TorchRec 1.9.2 on torch 2.13.0 CPU with fbgemm-gpu-cpu 1.8.0).

The data are kvcoll's SyntheticCTR (26 fields of Zipf ids, 13 numerics, labels from a
planted model), written once to disk: --peers-warmup + --peers-steps global batches and
a held-out set (`write_data`), read by every framework in the same way
(bench/peers/common.py). The model is DeepFM with rows of 16 floats (a first-order
weight and a 15-wide FM vector), MLP 256-128; rows train with Adagrad (0.2, accumulators
from 0.01), dense weights with Adam (0.002). The adapters (bench/peers/*_worker.py) say
how each framework is set up and write that next to their numbers. TorchRec's rows
train with row-wise Adagrad (one accumulator per row, FBGEMM's fused kernel); kvcoll
runs twice, with per-element Adagrad (as TFRA) and with kv.optimizers.RowWiseAdagrad
(as TorchRec: "kvcoll-rowwise"), so each comparison can be made like for like.

Runs, each a fresh launch: every framework on 1 process x 2 threads and on 2 ranks x 1
thread (kvcoll under mpirun; TFRA alone, and on 2 ranks through Horovod under mpirun;
TorchRec under torchrun, DistributedModelParallel over gloo), and TorchRec once more
without collisions (--table-rows 0), --peers-reps rounds interleaved (A B C ... A B C
...). `--peers-only kvcoll,kvcoll-rowwise` runs kvcoll both ways alone (no peer venvs).
Before each run the bench waits (up to --peers-wait seconds) until other processes
use less than 0.3 CPUs and records what they used and /proc/loadavg.

Writes bench/results/peers.json, peers.md and peers.png.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from . import common

PEERS = os.path.join(common.ROOT, "bench", "peers")
VENVS = os.path.join(common.ROOT, ".venv-peers")
NUM_FIELDS, NUM_NUMERIC = 26, 13

# peer -> its requirements files: the first installed with --no-deps, the second (if
# any) then built from source, --no-deps --no-build-isolation, with BUILD_ENV
REQUIREMENTS = {"tfra": ("requirements-tfra.txt", "requirements-tfra-build.txt"),
                "torchrec": ("requirements-torchrec.txt",)}
BUILD_ENV = {"HOROVOD_WITH_TENSORFLOW": "1", "HOROVOD_WITH_MPI": "1",
             "HOROVOD_WITHOUT_PYTORCH": "1", "HOROVOD_WITHOUT_MXNET": "1",
             "HOROVOD_WITHOUT_GLOO": "1", "TF_USE_LEGACY_KERAS": "1"}
DISTURBED = 0.5      # CPUs used by other processes during a run that make it run again
LABELS = {"kvcoll": "kvcoll", "kvcoll-rowwise": "kvcoll, row-wise Adagrad", "tfra": "TFRA",
          "torchrec": "TorchRec", "torchrec-exact": "TorchRec, no collisions",
          "kvcoll-nopipe": "kvcoll, pipeline off",
          "kvcoll-semi": "kvcoll, semi-sync pipeline (rows one step stale)",
          "kvcoll-nohuge": "kvcoll, --huge-pages off", "kvcoll-xla": "kvcoll, --xla on"}
# opt-in kvcoll runs (named in --peers-only): the setting each changes, and its value
VARIANTS = {"kvcoll-nopipe": ("pipeline", "off"), "kvcoll-semi": ("pipeline", "semi"),
            "kvcoll-nohuge": ("huge_pages", "off"), "kvcoll-xla": ("xla", "on")}


def add_arguments(p) -> None:
    g = p.add_argument_group("peers")
    g.add_argument("--peers-steps", type=int, default=300, help="timed steps per run")
    g.add_argument("--peers-warmup", type=int, default=10, help="untimed steps first")
    g.add_argument("--peers-batch", type=int, default=4096, help="global batch")
    g.add_argument("--peers-eval", type=int, default=100_000, help="held-out samples")
    g.add_argument("--peers-reps", type=int, default=3, help="interleaved rounds")
    g.add_argument("--peers-table-rows", type=int, default=1_000_000,
                   help="TorchRec's rows per table (ids modulo this)")
    g.add_argument("--peers-only", default="",
                   help="comma-separated subset of kvcoll,kvcoll-rowwise,tfra,torchrec,"
                        "torchrec-exact; kvcoll-nopipe, kvcoll-semi, kvcoll-nohuge and "
                        "kvcoll-xla (kvcoll with --pipeline off or semi, --huge-pages off "
                        "or --xla on) run only when named")
    g.add_argument("--peers-wait", type=float, default=90,
                   help="seconds to wait at most for a quiet machine before each run")
    g.add_argument("--peers-retries", type=int, default=1,
                   help=f"runs again (at most this often) a run during which other processes "
                        f"used more than {DISTURBED} CPUs")
    g.add_argument("--peers-setup-only", action="store_true",
                   help="build (or check) the peer venvs and stop")
    g.add_argument("--peers-from", metavar="JSON",
                   help="run nothing: write peers.md and peers.png again from this peers.json")


# -- the data ------------------------------------------------------------------------------

def write_data(path: str, *, steps: int, batch: int, eval_samples: int, seed: int = 0,
               vocab: int = 10**7, chunk: int = 1 << 16) -> dict:
    """Write `steps` global batches of SyntheticCTR's training stream and its first
    `eval_samples` held-out samples as .npy files (bench/peers/common.py reads them);
    returns the manifest. Generated in chunks, so memory stays small at any size."""
    from kvcoll.data import SyntheticCTR

    data = SyntheticCTR(seed=seed, vocab=vocab)
    os.makedirs(path, exist_ok=True)
    for part, n, make in (("train", steps * batch, data.samples),
                          ("eval", eval_samples, lambda lo, hi: data.samples(lo, hi, "eval"))):
        outs = {
            "cat": np.lib.format.open_memmap(os.path.join(path, f"{part}_cat.npy"), "w+",
                                             np.int64, (n, NUM_FIELDS)),
            "num": np.lib.format.open_memmap(os.path.join(path, f"{part}_num.npy"), "w+",
                                             np.float32, (n, NUM_NUMERIC)),
            "label": np.lib.format.open_memmap(os.path.join(path, f"{part}_label.npy"), "w+",
                                               np.float32, (n,)),
        }
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            s = make(lo, hi)
            outs["cat"][lo:hi] = s["categorical"]
            outs["num"][lo:hi] = s["numeric"]
            outs["label"][lo:hi] = s["label"]
        for a in outs.values():
            a.flush()
        del outs
    manifest = {"generator": repr(data), "seed": seed, "batch": batch, "steps": steps,
                "eval_samples": eval_samples, "num_fields": NUM_FIELDS,
                "num_numeric": NUM_NUMERIC, "vocab": [int(v) for v in data.vocab],
                "offsets": [int(o) for o in data.offsets],
                "planted_auc": data.planted_auc(data.eval_set(eval_samples))}
    with open(os.path.join(path, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def _warm(path: str) -> None:
    """Read every file of the data set once, so that the runs find them in the page cache."""
    for name in os.listdir(path):
        with open(os.path.join(path, name), "rb") as f:
            while f.read(1 << 24):
                pass


# -- the venvs -----------------------------------------------------------------------------

def venv_python(peer: str) -> str:
    return os.path.join(VENVS, peer, "bin", "python")


def _requirements_digest(peer: str) -> str:
    h = hashlib.sha256()
    for name in REQUIREMENTS[peer]:
        with open(os.path.join(PEERS, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def venv_ready(peer: str) -> bool:
    """True if .venv-peers/<peer> exists and was built from the current requirements."""
    stamp = os.path.join(VENVS, peer, ".kvcoll-requirements")
    try:
        with open(stamp, encoding="utf-8") as f:
            return os.path.exists(venv_python(peer)) and f.read().strip() == \
                _requirements_digest(peer)
    except OSError:
        return False


def ensure_venv(peer: str) -> None:
    """Build .venv-peers/<peer> from its requirements files, unless it is ready; an
    existing venv is brought up to the pins (pip installs only what differs)."""
    if venv_ready(peer):
        return
    path = os.path.join(VENVS, peer)
    if not os.path.exists(venv_python(peer)):
        base = getattr(sys, "_base_executable", None) or shutil.which("python3")
        print(f"[peers] creating {path}", flush=True)
        subprocess.run([base, "-m", "venv", path], check=True)
    pip = [venv_python(peer), "-m", "pip", "install", "--disable-pip-version-check",
           "--no-deps", "-q"]
    first, *build = REQUIREMENTS[peer]
    print(f"[peers] installing {first} into {path}", flush=True)
    subprocess.run([*pip, "-r", os.path.join(PEERS, first)], check=True)
    for name in build:
        # built against the venv's own packages, with kvcoll's Open MPI (mpicc) on PATH
        env = dict(os.environ, **BUILD_ENV)
        env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
        print(f"[peers] building {name} into {path} (minutes, once)", flush=True)
        subprocess.run([*pip, "--no-build-isolation", "-r", os.path.join(PEERS, name)],
                       check=True, env=env)
    with open(os.path.join(path, ".kvcoll-requirements"), "w", encoding="utf-8") as f:
        f.write(_requirements_digest(peer) + "\n")


# -- one run -------------------------------------------------------------------------------

def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(impl: str, world: int, threads: int, flags: list[str]) -> tuple[list[str], dict]:
    """The command line and environment of one run of `impl` (kvcoll, kvcoll-rowwise,
    tfra, torchrec, torchrec-exact) on `world` ranks with `threads` compute threads each;
    `flags` are the adapter's (bench/peers/common.py parse)."""
    env = dict(os.environ, PYTHONPATH=common.ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TF_CPP_MIN_LOG_LEVEL="2", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    flags = [*flags, "--threads", str(threads)]
    mpirun = [os.path.join(os.path.dirname(sys.executable), "mpirun"), "--oversubscribe",
              "--bind-to", "none", "-np", str(world)]
    if impl in VARIANTS:
        setting, value = VARIANTS[impl]
        env[f"KVCOLL_{setting.upper()}"] = value
        impl = "kvcoll"
    if impl in ("kvcoll", "kvcoll-rowwise"):
        if impl == "kvcoll-rowwise":
            flags = [*flags, "--row-optimizer", "rowwise"]
        return [*mpirun, sys.executable, "-m", "bench.peers.kvcoll_worker", *flags], env
    if impl == "tfra":
        env["TF_USE_LEGACY_KERAS"] = "1"
        py = [venv_python("tfra"), "-m", "bench.peers.tfra_worker", *flags]
        if world == 1:
            return py, env
        return [*mpirun, "-x", "TF_USE_LEGACY_KERAS", *py, "--horovod"], env
    if impl in ("torchrec", "torchrec-exact"):
        if impl == "torchrec-exact":
            flags = [*flags, "--table-rows", "0"]
        return [venv_python("torchrec"), "-m", "torch.distributed.run", "--nproc-per-node",
                str(world), "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                "-m", "bench.peers.torchrec_worker", *flags], env
    raise ValueError(f"unknown framework {impl!r}")


def run_one(impl: str, world: int, threads: int, flags: list[str], out: str,
            timeout: float) -> tuple[list[dict], float, str | None]:
    """Launch one run; returns its ranks' records, its wall time and an error (or None)."""
    shutil.rmtree(out, ignore_errors=True)
    cmd, env = command(impl, world, threads, [*flags, "--out", out])
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=common.ROOT, capture_output=True, text=True,
                              timeout=timeout, check=False)
        error = None if proc.returncode == 0 else (
            f"exit {proc.returncode}: " + " | ".join(
                [ln for ln in (proc.stderr or proc.stdout).strip().splitlines()
                 if ln.strip()][-3:])[-600:])
    except subprocess.TimeoutExpired:
        error = f"timed out after {timeout:.0f} s"
    wall = time.perf_counter() - t0
    records = []
    for r in range(world):
        path = os.path.join(out, f"rank{r}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                rec = json.load(f)
            rec["preds"] = np.load(os.path.join(out, f"preds{r}.npy"))
            records.append(rec)
    if error is None and len(records) != world:
        error = f"{world - len(records)} rank(s) wrote no record"
    return records, wall, error


def _cpu_seconds() -> tuple[float, float]:
    """CPU seconds so far: the whole machine's busy time, and this process's waited-for
    descendants' (the runs)."""
    with open("/proc/stat", encoding="ascii") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = (sum(v[:8]) - v[3] - (v[4] if len(v) > 4 else 0)) / os.sysconf("SC_CLK_TCK")
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return busy, ru.ru_utime + ru.ru_stime


def measure(impl: str, world: int, threads: int, rec: dict, labels: np.ndarray,
            flags: list[str], out: str, wait: float, timeout: float) -> dict:
    """One run, after waiting for a quiet machine: `rec` with its numbers (or its error),
    the load before it and the CPUs other processes used while it ran."""
    busy = common.wait_until_quiet(wait) if wait else common.busy_cores(0.5)
    rec = dict(rec, others_busy_cores=round(busy, 2), loadavg_before=_loadavg())
    print(f"[peers] round {rec['rep'] + 1}: {LABELS[impl]} on {world} x {threads} (others busy "
          f"{busy:.2f} cores, load {rec['loadavg_before']})", flush=True)
    machine0, runs0 = _cpu_seconds()
    ranks, wall, error = run_one(impl, world, threads, flags, out, timeout)
    machine1, runs1 = _cpu_seconds()
    rec.update(wall_seconds=round(wall, 1), loadavg_after=_loadavg(),
               others_busy_cores_during=round(
                   max(0.0, (machine1 - machine0) - (runs1 - runs0)) / wall, 2))
    if error:
        print(f"[peers]   failed: {error}", flush=True)
        return dict(rec, error=error)
    rec.update(_summarise(ranks, labels, rec["steps"], rec["global_batch"]))
    print(f"[peers]   {rec['samples_per_sec']:,.0f} samples/s, AUC {rec['eval_auc']:.4f}, "
          f"peak RSS {rec['peak_rss_mb_max']:,.0f} MB (others used "
          f"{rec['others_busy_cores_during']:.2f} cores meanwhile)", flush=True)
    return rec


def _loadavg() -> str:
    with open("/proc/loadavg", encoding="ascii") as f:
        return " ".join(f.read().split()[:3])


# -- the whole benchmark -------------------------------------------------------------------

def plan(only: list[str]) -> list[tuple[str, int, int]]:
    """(framework, ranks, threads per rank) of one round, in the order they run."""
    runs = [(impl, world, 2 // world) for world in (1, 2)
            for impl in ("kvcoll", "kvcoll-rowwise", "tfra", "torchrec")]
    runs.append(("torchrec-exact", 1, 2))
    # opt-in (--peers-only ...,kvcoll-nopipe,kvcoll-semi,kvcoll-nohuge,kvcoll-xla): kvcoll
    # with one setting changed, beside its defaults in the same rounds
    runs += [(impl, world, 2 // world) for impl in VARIANTS for world in (1, 2)]
    return [r for r in runs if (not only and r[0] not in VARIANTS) or r[0] in only]


def run(args) -> None:
    if args.peers_from:
        return rewrite(args.peers_from, args.out or common.RESULTS)
    quick = args.quick
    steps = 4 if quick else args.peers_steps
    warmup = 2 if quick else args.peers_warmup
    batch = 512 if quick else args.peers_batch
    evals = 4096 if quick else args.peers_eval
    reps = 1 if quick else args.peers_reps
    wait = 0 if quick else args.peers_wait
    retries = 0 if quick else args.peers_retries
    out_dir = args.out or (tempfile.mkdtemp() if quick else common.RESULTS)
    only = [s.strip() for s in args.peers_only.split(",") if s.strip()]
    command_line = " ".join(["./dev bench", *sys.argv[1:]])

    venv_errors = {}
    for peer in ("tfra", "torchrec"):
        if only and not any(o.startswith(peer) for o in only):
            continue
        try:
            ensure_venv(peer)
        except (subprocess.CalledProcessError, OSError) as exc:
            venv_errors[peer] = f"venv not built: {exc}"
            print(f"[peers] {peer}: {venv_errors[peer]}", flush=True)
    if args.peers_setup_only:
        return

    records, runs = [], plan(only)
    with tempfile.TemporaryDirectory(dir=common.ROOT, prefix="kvbench-peers-") as tmp:
        data_dir = os.path.join(tmp, "data")
        print(f"[peers] writing {warmup + steps} batches of {batch} and {evals:,} held-out "
              f"samples to {data_dir}", flush=True)
        manifest = write_data(data_dir, steps=warmup + steps, batch=batch, eval_samples=evals)
        _warm(data_dir)
        labels = np.load(os.path.join(data_dir, "eval_label.npy"))
        flags = ["--data", data_dir, "--steps", str(steps), "--warmup", str(warmup),
                 "--table-rows", str(args.peers_table_rows)]
        for rep in range(reps):
            for impl, world, threads in runs:
                peer = impl.split("-")[0]
                rec = {"framework": impl, "ranks": world, "threads_per_rank": threads,
                       "rep": rep, "steps": steps, "warmup": warmup, "global_batch": batch,
                       "max_wait_seconds": wait, "command": command_line}
                if peer in venv_errors:
                    records.append(dict(rec, error=venv_errors[peer]))
                    continue
                for attempt in range(1 + retries):
                    done = measure(impl, world, threads, dict(rec, attempt=attempt), labels,
                                   _adapter_flags(impl, flags), os.path.join(tmp, "out"),
                                   wait, timeout=300 + steps * 2.0)
                    disturbed = done.get("others_busy_cores_during", 0) > DISTURBED
                    if "error" in done or not disturbed or attempt == retries:
                        break
                    print(f"[peers]   others used {done['others_busy_cores_during']:.2f} "
                          f"cores during the run: once more", flush=True)
                    records.append(dict(done, superseded=True))
                records.append(done)
    summary = summarise(records)
    result = [{"kind": "summary", "data": manifest, "configs": summary}] + \
        [dict(r, kind="run") for r in records]
    common.publish(out_dir, "peers", result, lambda m: markdown(summary, manifest, records, m))
    png = os.path.join(out_dir, "peers.png")
    chart(summary, png)
    print(f"[peers] wrote {png}")


def rewrite(path: str, out_dir: str) -> None:
    """peers.md and peers.png again from a peers.json (its runs and machine as they were)."""
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    head, records = result[0], [r for r in result[1:] if r.get("kind") == "run"]
    summary = summarise(records)
    head["configs"] = summary
    md = markdown(summary, head["data"], records, head["machine"])
    common.write_results(out_dir, "peers", [head, *records], md)
    chart(summary, os.path.join(out_dir, "peers.png"))
    print(md)


def _adapter_flags(impl: str, flags: list[str]) -> list[str]:
    """--table-rows is TorchRec's alone."""
    if impl.startswith("torchrec"):
        return flags
    i = flags.index("--table-rows")
    return flags[:i] + flags[i + 2:]


def _summarise(ranks: list[dict], labels: np.ndarray, steps: int, batch: int) -> dict:
    """One run's numbers from its ranks' records."""
    from kvcoll.data import auc

    ranks = sorted(ranks, key=lambda r: r["rank"])
    preds = np.concatenate([r.pop("preds") for r in ranks])
    seconds = max(r["seconds"] for r in ranks)
    out = {"seconds": seconds, "samples_per_sec": steps * batch / seconds,
           "eval_auc": auc(labels, preds) if np.isfinite(preds).all() else None,
           "eval_preds_nonfinite": int((~np.isfinite(preds)).sum()),
           "train_loss": statistics.fmean(r["train_loss"] for r in ranks),
           "peak_rss_mb": [round(r["peak_rss_bytes"] / 2**20) for r in ranks],
           "peak_rss_mb_max": max(r["peak_rss_bytes"] for r in ranks) / 2**20,
           "rows": sum(r["rows"] for r in ranks), "config": ranks[0]["config"]}
    for key in ("rows_touched", "distinct_ids", "table_rows", "row_bytes", "floor"):
        if key in ranks[0]:
            out[key] = ranks[0][key]
    return out


def summarise(records: list[dict]) -> list[dict]:
    """Per (framework, ranks): medians and ranges over the rounds that ran."""
    out = []
    keys = list(dict.fromkeys((r["framework"], r["ranks"], r["threads_per_rank"])
                              for r in records))
    for impl, world, threads in keys:
        rs = [r for r in records if (r["framework"], r["ranks"]) == (impl, world)
              and not r.get("superseded")]
        ok = [r for r in rs if "error" not in r]
        s = {"framework": impl, "ranks": world, "threads_per_rank": threads,
             "runs": len(ok), "failed": len(rs) - len(ok),
             "errors": sorted({r["error"] for r in rs if "error" in r})}
        if ok:
            sps = [r["samples_per_sec"] for r in ok]
            aucs = [r["eval_auc"] for r in ok if r["eval_auc"] is not None]
            rss = [r["peak_rss_mb_max"] for r in ok]
            s.update(samples_per_sec=statistics.median(sps), samples_per_sec_range=[min(sps),
                                                                                    max(sps)],
                     eval_auc=statistics.median(aucs) if aucs else None,
                     eval_auc_range=[min(aucs), max(aucs)] if aucs else None,
                     peak_rss_mb=statistics.median(rss), peak_rss_mb_range=[min(rss), max(rss)],
                     rows=ok[0]["rows"], train_loss=statistics.median(r["train_loss"] for r in ok),
                     others_busy_cores_max=max(r["others_busy_cores"] for r in ok),
                     others_busy_cores_during=[r["others_busy_cores_during"] for r in ok],
                     config=ok[0]["config"])
            for key in ("rows_touched", "distinct_ids", "table_rows", "row_bytes"):
                if key in ok[0]:
                    s[key] = ok[0][key]
            quiet = [r["samples_per_sec"] for r in ok
                     if r["others_busy_cores_during"] <= DISTURBED]
            s.update(quiet_runs=len(quiet),
                     quiet_samples_per_sec=statistics.median(quiet) if quiet else None)
            floors = [r["floor"] for r in ok if "floor" in r]
            if floors:   # kvcoll's: the step's floor, each run's own (issue #32)
                s["floor"] = {k: statistics.median(f[k] for f in floors)
                              for k in floors[0] if isinstance(floors[0][k], (int, float))}
        out.append(s)
    return out


# -- the report ----------------------------------------------------------------------------

def _get(summary, impl, world):
    return next((s for s in summary if s["framework"] == impl and s["ranks"] == world), None)


def table(summary: list[dict]) -> list[str]:
    """The markdown table of the summary (the README opens its benchmark section with it)."""
    lines = ["| framework | ranks x threads | samples/s (median, range) | samples/s, quiet "
             "runs (median, runs) | eval AUC | peak RSS per rank | embedding rows |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for s in summary:
        name = LABELS[s["framework"]]
        shape = f"{s['ranks']} x {s['threads_per_rank']}"
        if not s["runs"]:
            lines.append(f"| {name} | {shape} | not run: {'; '.join(s['errors'])[:200]} | | | | |")
            continue
        lo, hi = s["samples_per_sec_range"]
        auc = "" if s["eval_auc"] is None else f"{s['eval_auc']:.4f}"
        rows = f"{s['rows']:,}"
        if "rows_touched" in s:
            rows = f"{s['rows']:,} allocated, {s['rows_touched']:,} used"
        quiet = (f"{s['quiet_samples_per_sec']:,.0f} ({s['quiet_runs']})"
                 if s.get("quiet_samples_per_sec") else "none")
        lines.append(f"| {name} | {shape} | {s['samples_per_sec']:,.0f} ({lo:,.0f}-{hi:,.0f}) | "
                     f"{quiet} | {auc} | {s['peak_rss_mb']:,.0f} MB | {rows} |")
    return lines


def markdown(summary, manifest, records, machine) -> str:
    steps, batch = records[0]["steps"], records[0]["global_batch"]
    warmup = records[0]["warmup"]
    reps = max(r["rep"] for r in records) + 1
    kept = [r for r in records if "others_busy_cores" in r and not r.get("superseded")]
    busy = [r["others_busy_cores"] for r in kept]
    during = [r["others_busy_cores_during"] for r in kept]
    again = sum(1 for r in records if r.get("superseded"))
    lines = [
        "# kvcoll, TFRA and TorchRec side by side (DeepFM, synthetic CTR data)",
        "",
        f"`{records[0]['command']}` — the same DeepFM (26 fields, rows of 16 floats: a first-order "
        f"weight and a 15-wide FM vector, MLP 256-128) on the same data: {warmup} + {steps} "
        f"global batches of {batch} from kvcoll's SyntheticCTR ({manifest['generator']}), "
        f"written once to disk and read by every framework in the same way; eval AUC on the "
        f"same {manifest['eval_samples']:,} held-out samples (planted AUC "
        f"{manifest['planted_auc']:.4f}) after the same {warmup + steps} steps. samples/s: "
        f"the {steps} timed steps; {reps} rounds, interleaved; median and range. "
        f"{machine['cpu']}, {machine['cores']} cores, {machine['memory_gib']} GiB, "
        f"{machine.get('date', '')}.",
        "",
        *table(summary),
        "",
    ]
    exact, hashed = _get(summary, "torchrec-exact", 1), _get(summary, "torchrec", 1)
    kv1 = _get(summary, "kvcoll", 1)
    if hashed and hashed.get("runs") and "distinct_ids" in hashed:
        coll = hashed["distinct_ids"] - hashed["rows_touched"]
        lines.append(
            f"- TorchRec's tables are fixed: {hashed['table_rows']:,} rows each, a field's ids "
            f"taken modulo that. The {hashed['distinct_ids']:,} distinct ids of the training "
            f"steps landed on {hashed['rows_touched']:,} rows: {coll:,} ids "
            f"({coll / hashed['distinct_ids']:.1%}) share a row with another. All "
            f"{hashed['rows']:,} rows are allocated (with their accumulators) from the start, "
            f"hence the memory.")
        if exact and exact.get("runs") and exact["eval_auc"] and hashed["eval_auc"]:
            lines.append(
                f"- The effect of the collisions: TorchRec with one row per distinct id (a "
                f"dictionary made before training: \"no collisions\") reaches AUC "
                f"{exact['eval_auc']:.4f} vs {hashed['eval_auc']:.4f} with ids modulo "
                f"{hashed['table_rows']:,}, after the same steps.")
    if kv1 and kv1.get("runs"):
        lines.append(f"- kvcoll and TFRA grow a row per distinct id: {kv1['rows']:,} rows "
                     "after these steps.")
    lines += _rowwise_lines(summary)
    lines += _variant_lines(summary)
    if busy:
        lines.append(
            f"- The machine is shared: before each run the bench waited (up to "
            f"{records[0]['max_wait_seconds']:.0f} s) for other processes to go quiet; they used "
            f"{statistics.median(busy):.2f} CPUs (median; at most {max(busy):.2f}) when runs "
            f"began, and {statistics.median(during):.2f} (median; at most {max(during):.2f}) "
            f"while they ran (the machine's busy time less the runs' own). A run during which "
            f"they used more than {DISTURBED} CPUs is not quiet, and was run once more (at most "
            f"--peers-retries times; the last attempt counts): {again} were. Per run: "
            f"`others_busy_cores`, `others_busy_cores_during` and `loadavg_before` in "
            f"peers.json.")
    lines += floor_lines(summary)
    lines += ["", "## How each framework is set up", ""]
    for s in summary:
        if not s.get("runs"):
            continue
        lines.append(f"### {LABELS[s['framework']]}, {s['ranks']} x {s['threads_per_rank']}")
        lines.append("")
        for k, v in s["config"].items():
            if k == "placement":
                v = ", ".join(f"{t}: rank {'/'.join(map(str, p))}" for t, p in v.items())
            lines.append(f"- {k}: {v}")
        lines.append("")
    lines += [
        "## Differences that remain",
        "",
        "- Row optimizer: kvcoll (first rows) and TFRA keep one Adagrad accumulator per float; "
        "TorchRec's fused kernel one per row (row-wise Adagrad, the one TorchRec recommends "
        "and FBGEMM's CPU kernel offers fused), and so does \"kvcoll, row-wise Adagrad\" "
        "(kv.optimizers.RowWiseAdagrad: FBGEMM's rule and arithmetic, bit for bit). Learning "
        "rates, initial accumulators and Adam's settings are the same.",
        "- Initial rows: N(0, 0.01^2) in kvcoll and TFRA; TorchRec's sharded tables "
        "initialise uniformly, U(-0.0173, 0.0173) (the same standard deviation).",
        "- TFRA looks all fields up in one table (ids are disjoint across fields), kvcoll and "
        "TorchRec keep a table per field. The model computes the same function.",
        "- TensorFlow versions: kvcoll runs on TF 2.21 with Keras 3, TFRA on TF 2.16.2 with "
        "Keras 2 (the newest it supports).",
        "- Loop: kvcoll uses model.fit; TFRA a tf.function step; TorchRec a plain Python loop "
        "(no TrainPipelineSparseDist, which overlaps the next batch's input exchange with "
        "compute).",
        "",
    ]
    return "\n".join(lines)


def _rowwise_lines(summary: list[dict]) -> list[str]:
    """kvcoll with row-wise Adagrad against per-element Adagrad, per shape: the ratio of
    their throughputs (same run, interleaved), their AUCs and the bytes a row takes."""
    lines = []
    for world in (1, 2):
        a, r = _get(summary, "kvcoll", world), _get(summary, "kvcoll-rowwise", world)
        if not (a and r and a.get("runs") and r.get("runs")):
            continue
        auc = ""
        if a["eval_auc"] is not None and r["eval_auc"] is not None:
            auc = f", AUC {r['eval_auc']:.4f} against {a['eval_auc']:.4f}"
        size = ""
        if "row_bytes" in a and "row_bytes" in r:
            size = (f"; a row takes {r['row_bytes']} bytes against {a['row_bytes']} "
                    f"({a['row_bytes'] - r['row_bytes']} fewer: one accumulator instead of "
                    "one per float)")
        lines.append(
            f"- kvcoll with row-wise Adagrad on {world} x {a['threads_per_rank']}: "
            f"{r['samples_per_sec']:,.0f} samples/s against {a['samples_per_sec']:,.0f} with "
            f"per-element Adagrad ({r['samples_per_sec'] / a['samples_per_sec']:.2f}x, medians "
            f"of the same interleaved rounds){auc}{size}.")
    return lines


def _variant_lines(summary: list[dict]) -> list[str]:
    """kvcoll with one setting changed (its pipeline off or semi-synchronous, huge pages
    off) against its defaults, per shape: throughputs (same run, interleaved) and AUCs."""
    lines = []
    for impl, (setting, value) in VARIANTS.items():
        for world in (1, 2):
            a, v = _get(summary, "kvcoll", world), _get(summary, impl, world)
            if not (a and v and a.get("runs") and v.get("runs")):
                continue
            auc = ""
            if a["eval_auc"] is not None and v["eval_auc"] is not None:
                auc = (f", AUC {v['eval_auc']:.4f} against {a['eval_auc']:.4f} "
                       f"({v['eval_auc'] - a['eval_auc']:+.4f})")
            lines.append(
                f"- kvcoll with --{setting.replace('_', '-')} {value} on {world} x "
                f"{a['threads_per_rank']}: {v['samples_per_sec']:,.0f} samples/s against "
                f"{a['samples_per_sec']:,.0f} with the defaults "
                f"({v['samples_per_sec'] / a['samples_per_sec']:.2f}x, medians of the same "
                f"interleaved rounds){auc}.")
    return lines


def floor_lines(summary: list[dict]) -> list[str]:
    """kvcoll's step beside its floor, measured in the same runs (medians over runs)."""
    rows = [s for s in summary if s.get("floor")]
    if not rows:
        return []
    lines = ["", "## kvcoll's step and its floor", "",
             "Each kvcoll run, after its timed fit and its evaluation, measures on 30 batches "
             "of the timed range: the dense step alone (forward, backward, the rows' "
             "gradient, the dense optimizer, on ready-made rows; every rank at once, no "
             "communication while timed) and the sparse side alone (the batch read and "
             "prepared, the pull and the push of its rows with a zero gradient; no "
             "TensorFlow step), wall and CPU time. Those batches' ids all have rows by "
             "then; the fit created its rows as it went (row initialization, arena "
             "growth, index rebuilds), so the sparse side is measured again as the fit ran "
             "it: on new, empty tables like the model's, over every batch of the run "
             "(fresh tables; the timed range). The floor is the larger of the dense step "
             "alone and (dense + sparse CPU) / cores: a pipeline hides waiting, not CPU "
             "work; with the fresh tables' sparse CPU it counts the sparse work the fit "
             "did. (CPU includes MPI's polling while a rank waits for its peers.)", "",
             "| framework | ranks x threads | step (fit) ms | dense alone ms (CPU ms) | "
             "sparse alone ms (CPU ms) | floor ms | step / floor | sparse alone, fresh "
             "tables ms (CPU ms) | floor ms, fresh | step / floor, fresh |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in rows:
        f = s["floor"]
        fresh = "| — | — | — |"
        if "floor_fresh_ms" in f:    # (a record from before it was measured: none)
            fresh = (f"| {f['sparse_fresh_ms']:.1f} ({f['sparse_fresh_cpu_ms']:.1f}) | "
                     f"{f['floor_fresh_ms']:.1f} | {f['step_over_floor_fresh']:.2f} |")
        lines.append(f"| {LABELS[s['framework']]} | {s['ranks']} x {s['threads_per_rank']} | "
                     f"{f['step_ms']:.1f} | "
                     f"{f['dense_ms']:.1f} ({f['dense_cpu_ms']:.1f}) | {f['sparse_ms']:.1f} "
                     f"({f['sparse_cpu_ms']:.1f}) | {f['floor_ms']:.1f} | "
                     f"{f['step_over_floor']:.2f} {fresh}")
    return lines


def chart(summary: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = [i for i in ("kvcoll", "kvcoll-rowwise", *VARIANTS, "tfra", "torchrec",
                         "torchrec-exact")
             if any(s["framework"] == i for s in summary)]
    fig, ax = plt.subplots(figsize=(7.5, 4), dpi=110)
    width = 0.38
    for j, world in enumerate((1, 2)):
        xs, vals, errs, labels = [], [], [[], []], []
        for i, impl in enumerate(impls):
            s = _get(summary, impl, world)
            if not s or not s.get("runs"):
                continue
            lo, hi = s["samples_per_sec_range"]
            xs.append(i + (j - 0.5) * width)
            vals.append(s["samples_per_sec"])
            errs[0].append(s["samples_per_sec"] - lo)
            errs[1].append(hi - s["samples_per_sec"])
            auc = "" if s["eval_auc"] is None else f"\nAUC {s['eval_auc']:.3f}"
            labels.append(f"{s['samples_per_sec']:,.0f}{auc}")
        if xs:
            bars = ax.bar(xs, vals, width, yerr=errs, capsize=3,
                          label="1 process x 2 threads" if world == 1 else "2 ranks x 1 thread")
            ax.bar_label(bars, labels=labels, fontsize=7, padding=2)
    ax.set_xticks(range(len(impls)), [LABELS[i].replace(", ", ",\n") for i in impls])
    ax.set_ylabel("samples / s (median, range)")
    ax.set_title("DeepFM training on 2 cores: same model, same data")
    ax.margins(y=0.2)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
