"""What every benchmark shares: the machine, one pinned core, timing, child processes.

Each measurement runs in a child process (`run_child`) pinned to one CPU, so that one
configuration's memory cannot leak into the next one's RSS, and a configuration that
hangs or runs out of memory is recorded as skipped instead of stopping the run. A
child reports records as `@@record <json>` lines on stdout; anything else it prints
(TensorFlow's logging, say) is ignored.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
_MARK = "@@record "


# -- the machine ---------------------------------------------------------------------------

def _first(path: str, prefix: str, default: str = "?") -> str:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith(prefix):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return default


def _version(*dists: str) -> str | None:
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="utf-8") as f:
            text = f.read()
        return text[text.index("[") + 1:text.index("]")]
    except (OSError, ValueError):
        return "?"


def _file_digest(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:12]
    except OSError:
        return None


def machine_info() -> dict:
    """The machine and software a result was measured on (no TensorFlow import)."""
    mem_kib = int(_first("/proc/meminfo", "MemTotal", "0 kB").split()[0])
    return {
        "cpu": _first("/proc/cpuinfo", "model name"),
        "cores": os.cpu_count(),
        "memory_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
        "transparent_hugepages": _thp_mode(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "tensorflow": _version("tensorflow-cpu", "tensorflow"),
        "cffi": _version("cffi"),
        "kv_table_c_sha256": _file_digest(os.path.join(ROOT, "csrc", "kv_table.c")),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def mem_available() -> int:
    """Bytes the kernel says a new process could allocate without swapping."""
    return int(_first("/proc/meminfo", "MemAvailable", "0 kB").split()[0]) * 1024


def rss_bytes() -> int:
    """This process's resident set size now, after handing freed heap memory back to
    the kernel (glibc's malloc_trim), so that memory freed by growth is not counted."""
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None).malloc_trim(0)
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def busy_cores(seconds: float = 1.0) -> float:
    """How many CPUs' worth of time the whole machine spent busy over `seconds`
    (from /proc/stat; call it while this process idles to see everyone else)."""
    def sample():
        with open("/proc/stat", encoding="ascii") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
        return sum(v[:8]) - idle, sum(v[:8])
    b0, t0 = sample()
    time.sleep(seconds)
    b1, t1 = sample()
    return (os.cpu_count() or 1) * (b1 - b0) / max(1, t1 - t0)


def wait_until_quiet(max_wait: float, below: float = 0.3) -> float:
    """Wait (up to max_wait seconds) until other processes use less than `below`
    CPUs; return the last reading."""
    deadline = time.monotonic() + max_wait
    busy = busy_cores()
    while busy >= below and time.monotonic() < deadline:
        busy = busy_cores()
    return busy


def pin_to_cpu(cpu: int) -> None:
    """Run this process (and any thread it starts later) on one CPU only."""
    os.sched_setaffinity(0, {cpu})


def default_cpu() -> int:
    """The last CPU we may run on: away from CPU 0, where interrupts tend to land."""
    return max(os.sched_getaffinity(0))


# -- timing --------------------------------------------------------------------------------

def timed_passes(run, *, min_reps: int = 3, max_reps: int = 20,
                 min_seconds: float = 0.5) -> list[float]:
    """Seconds of repeated calls of run(): at least min_reps, and more (up to
    max_reps) until min_seconds have been spent. The caller warms up first."""
    times = []
    spent = 0.0
    while len(times) < min_reps or (spent < min_seconds and len(times) < max_reps):
        t0 = time.perf_counter()
        run()
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
    return times


# -- child processes -----------------------------------------------------------------------

def emit(record: dict) -> None:
    """Report one record to the parent (called in a child)."""
    sys.stdout.write(_MARK + json.dumps(record) + "\n")
    sys.stdout.flush()


def run_child(target: str, spec: dict, timeout: float) -> tuple[list[dict], str | None]:
    """Run `module:function`(spec) in a fresh Python; return its records and an error
    (None if it finished). Records reported before a timeout or a crash are kept."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = "1"
    cmd = [sys.executable, "-c", "import bench.common as c; c._child_main()",
           target, json.dumps(spec)]
    error = None
    try:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, check=False)
        out, err = proc.stdout, proc.stderr
        if proc.returncode != 0:
            tail = [line for line in err.strip().splitlines() if line.strip()][-1:]
            error = f"child exited with status {proc.returncode}: " + " ".join(tail)[:300]
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        error = f"timed out after {timeout:.0f} s"
    records = [json.loads(line[len(_MARK):]) for line in out.splitlines()
               if line.startswith(_MARK)]
    return records, error


def _child_main() -> None:
    target, spec = sys.argv[1], json.loads(sys.argv[2])
    module, func = target.split(":")
    getattr(importlib.import_module(module), func)(spec)


# -- the random-gather roofline ------------------------------------------------------------

_GATHER_CDEF = """
int bench_gather(uint64_t bytes, int hugepages, int64_t m, int reps, double *rates,
                 double *checksum);
"""


def _build_gather():
    """Compile bench/_gather.c with cffi (API mode) into a temporary directory."""
    from cffi import FFI

    src = os.path.join(ROOT, "bench", "_gather.c")
    with open(src, encoding="utf-8") as f:
        code = f.read()
    ffi = FFI()
    ffi.cdef(_GATHER_CDEF)
    ffi.set_source("_kvbench_gather", code, extra_compile_args=["-O2"])
    tmp = tempfile.mkdtemp(prefix="kvbench-gather-")
    path = ffi.compile(tmpdir=tmp, verbose=False)
    loader = importlib.machinery.ExtensionFileLoader("_kvbench_gather", path)
    spec = importlib.util.spec_from_file_location("_kvbench_gather", path, loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def gather_child(spec: dict) -> None:
    """Child: random 64-byte gathers per second over a buffer much larger than cache,
    with 4 KiB pages and with transparent huge pages."""
    pin_to_cpu(spec["cpu"])
    mod = _build_gather()
    ffi, lib = mod.ffi, mod.lib
    for huge in (0, 1):
        rates = ffi.new("double[]", spec["reps"])
        checksum = ffi.new("double *")
        status = lib.bench_gather(spec["bytes"], huge, spec["gathers"], spec["reps"],
                                  rates, checksum)
        if status != 0:
            raise RuntimeError(f"bench_gather({spec['bytes']} bytes): status {status}")
        rs = sorted(rates[i] for i in range(spec["reps"]))
        emit({"pages": "huge" if huge else "4k", "buffer_bytes": spec["bytes"],
              "gathers": spec["gathers"], "reps": spec["reps"],
              "per_sec": rs[-1], "per_sec_median": rs[len(rs) // 2]})


def measure_gather(*, buffer_bytes: int, gathers: int, reps: int, cpu: int,
                   timeout: float = 300) -> dict:
    """Random 64-byte gathers/s on `cpu`: {"4k": record, "huge": record}; a record is
    missing if its measurement failed (the error is under "error")."""
    records, error = run_child("bench.common:gather_child",
                               {"bytes": buffer_bytes, "gathers": gathers, "reps": reps,
                                "cpu": cpu}, timeout)
    out = {r["pages"]: r for r in records}
    if error:
        out["error"] = error
    return out


# -- results -------------------------------------------------------------------------------

def publish(out_dir: str, name: str, records: list[dict], markdown) -> str:
    """Stamp every record with the machine, write <name>.json and <name>.md (the text
    markdown(machine) returns) into out_dir, print the text; returns it."""
    machine = machine_info()
    for r in records:
        r["machine"] = machine
    md = markdown(machine)
    jpath, mpath = write_results(out_dir, name, records, md)
    print(md)
    print(f"[{name}] wrote {jpath}, {mpath}")
    return md


def write_results(out_dir: str, name: str, records: list[dict], markdown: str) -> tuple[str, str]:
    """Write <name>.json (a list of records) and <name>.md into out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    jpath = os.path.join(out_dir, f"{name}.json")
    mpath = os.path.join(out_dir, f"{name}.md")
    with open(jpath, "w", encoding="utf-8") as f:
        json.dump(records, f, indent=1)
        f.write("\n")
    with open(mpath, "w", encoding="utf-8") as f:
        f.write(markdown)
    return jpath, mpath
