"""python -m bench [--quick] [--out DIR]                  every benchmark but the opt-in ones
python -m bench BENCHMARK [--quick] [--out DIR] [flags]  one, with its own flags

Opt-in (run only when named): peers, which builds a venv per peer framework first;
online, which runs training jobs and servers for about 20 minutes; elastic, which makes
network-namespace hosts (root) and runs a training job per event (about 10 minutes);
topology and scale, which make network-namespace hosts too (scale: about 10 minutes).

--quick runs small sizes in seconds and, unless --out is given, writes its results to a
temporary directory rather than bench/results/. `python -m bench BENCHMARK -h` lists a
benchmark's flags. A benchmark is a module with add_arguments(parser) and run(args).
"""

import argparse
import sys

from . import (async_bench, checkpoint_bench, data_bench, elastic_bench, fit_bench,
               lifecycle_bench, online_bench, peers_bench, scale_bench, soak_bench, table_bench,
               threads_bench, topology_bench, train_bench, wire_bench)

BENCHMARKS = {"table": table_bench, "train": train_bench, "fit": fit_bench,
              "checkpoint": checkpoint_bench, "async": async_bench,
              "lifecycle": lifecycle_bench, "soak": soak_bench, "data": data_bench,
              "peers": peers_bench, "threads": threads_bench, "online": online_bench,
              "elastic": elastic_bench, "wire": wire_bench, "topology": topology_bench,
              "scale": scale_bench}
OPT_IN = {"peers", "online", "elastic", "topology", "scale"}


def _common(p: argparse.ArgumentParser, default=None) -> None:
    # a benchmark's parser suppresses its defaults, so `--quick table` keeps --quick
    p.add_argument("--quick", action="store_true", default=default or False,
                   help="small sizes: a smoke test")
    p.add_argument("--out", default=default, help="directory for the results "
                   "(default: bench/results)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(p)
    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    subs = {}
    for name, mod in BENCHMARKS.items():
        sp = sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        _common(sp, argparse.SUPPRESS)
        mod.add_arguments(sp)
        subs[name] = sp
    args = p.parse_args(argv)
    if args.benchmark:
        BENCHMARKS[args.benchmark].run(args)
        return
    for name, mod in BENCHMARKS.items():  # every benchmark with its defaults
        if name in OPT_IN:
            continue
        own = subs[name].parse_args([])
        own.quick, own.out = args.quick, args.out
        mod.run(own)


if __name__ == "__main__":
    sys.exit(main())
