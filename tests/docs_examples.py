"""Run the code examples of README.md and docs/*.md, so the docs cannot drift from the code.

Every ```python block of a page runs, in order, in one namespace per page, in a fresh
directory of its own (the same path on every rank). What a page says in HTML comments
(invisible on the rendered page):

    <!-- docs-test: ranks=2 -->          the page's blocks run on 2 ranks (under mpirun)
    <!-- docs-test: setup                hidden code run before the page's first block
    ...python...                         (tiny data for the example: x_mine, files, ...)
    -->
    <!-- docs-test: skip REASON -->      the next block is not run (REASON is required:
                                         a broker, several hosts, Horovod...)

    python tests/docs_examples.py --list                 # pages, blocks, ranks, skips
    python tests/docs_examples.py --workdir D PAGE...    # run the pages in this process
    mpirun -np 2 python tests/docs_examples.py --workdir D PAGE...

tests/launch/test_docs_examples.py runs every page (all one-process pages in one
process, all 2-rank pages in one mpirun job) within 2 minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
SETUP = re.compile(r"<!--\s*docs-test:\s*setup\s*\n(.*?)-->", re.S)
RANKS = re.compile(r"<!--\s*docs-test:\s*ranks=(\d+)\s*-->")
SKIP = re.compile(r"<!--\s*docs-test:\s*skip\s+(\S.*?)\s*-->\s*$")


@dataclass
class Page:
    path: Path
    ranks: int = 1
    setup: str = ""
    blocks: list = field(default_factory=list)     # (line, code)
    skipped: list = field(default_factory=list)    # (line, reason)


def pages() -> list:
    """README.md and every docs/*.md page, parsed."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [parse(p) for p in paths]


def parse(path: Path) -> Page:
    text = path.read_text()
    page = Page(path)
    m = RANKS.search(text)
    if m:
        page.ranks = int(m.group(1))
    page.setup = "\n".join(s for s in SETUP.findall(text))
    for m in FENCE.finditer(text):
        if m.group(1) != "python":
            continue
        line = text.count("\n", 0, m.start()) + 1
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = SKIP.search(before)
        if skip:
            page.skipped.append((line, skip.group(1)))
        else:
            page.blocks.append((line, m.group(2)))
    return page


def name_of(page: Page) -> str:
    return str(page.path.relative_to(ROOT))


def run_page(page: Page, workdir: Path) -> None:
    """Run the page's setup and blocks in one namespace, in workdir/<page>/."""
    where = workdir / name_of(page).replace("/", "_")
    where.mkdir(parents=True, exist_ok=True)
    old = os.getcwd()
    os.chdir(where)
    ns = {"__name__": "__docs__"}
    try:
        if page.setup:
            exec(compile(page.setup, f"{name_of(page)}:setup", "exec"), ns)
        for line, code in page.blocks:
            # blank lines keep the page's line numbers in tracebacks
            exec(compile("\n" * line + code, name_of(page), "exec"), ns)
    finally:
        os.chdir(old)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pages", nargs="*", help="README.md, docs/x.md (default: all)")
    ap.add_argument("--workdir", default="build/docs-examples")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    everything = pages()
    if args.list:
        for p in everything:
            print(f"{name_of(p)}: {len(p.blocks)} block(s), ranks={p.ranks}"
                  + "".join(f"; skip line {ln}: {why}" for ln, why in p.skipped))
        return 0
    chosen = [p for p in everything if not args.pages or name_of(p) in args.pages]
    missing = set(args.pages) - {name_of(p) for p in chosen}
    if missing:
        print(f"no such page: {sorted(missing)}", file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import kvcoll as kv
    kv.init()
    failed = 0
    for p in chosen:
        if not p.blocks:
            continue
        t0 = time.perf_counter()
        try:
            run_page(p, Path(args.workdir).resolve())
            ok = "ok"
        except BaseException:  # noqa: BLE001 - report every page
            failed += 1
            ok = "FAILED\n" + traceback.format_exc()
        if kv.rank() == 0 or ok != "ok":
            print(f"docs-example {name_of(p)}: {len(p.blocks)} block(s) on {kv.size()} "
                  f"rank(s) {ok} ({time.perf_counter() - t0:.1f}s)", flush=True)
    kv.shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
