"""Every code example of README.md and docs/*.md runs (tests/docs_examples.py): the
one-process pages in one process, the distributed ones in one 2-rank job, all of them
within 2 minutes; every block is run or skipped with a reason; README's links point at
files that exist."""

import re
import subprocess
import sys
import time
from pathlib import Path

from mpirun import run

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import docs_examples  # noqa: E402

BUDGET = 120.0


def test_every_python_block_runs_or_says_why_not():
    pages = docs_examples.pages()
    assert sum(len(p.blocks) for p in pages) >= 10
    readme = next(p for p in pages if p.path.name == "README.md")
    assert readme.blocks and readme.ranks == 2          # the fit example, on 2 ranks
    for p in pages:
        for line, why in p.skipped:
            assert len(why) > 10, f"{p.path}:{line}: say why the example does not run"


def test_the_examples_run_within_two_minutes(tmp_path):
    pages = [p for p in docs_examples.pages() if p.blocks]
    by_ranks = {}
    for p in pages:
        by_ranks.setdefault(p.ranks, []).append(docs_examples.name_of(p))
    t0 = time.monotonic()
    outs = []
    for ranks, names in sorted(by_ranks.items()):
        args = [ROOT / "tests" / "docs_examples.py", "--workdir", tmp_path / f"r{ranks}", *names]
        if ranks == 1:
            proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True,
                                  text=True, timeout=BUDGET, cwd=ROOT)
            code, out = proc.returncode, proc.stdout + proc.stderr
        else:
            code, out = run(ranks, args, BUDGET, "docs examples")
        assert code == 0, out[-8000:]
        outs.append(out)
        for n in names:
            assert re.search(rf"docs-example {re.escape(n)}: \d+ block\(s\) on {ranks} "
                             r"rank\(s\) ok", out), (n, out[-4000:])
    took = time.monotonic() - t0
    assert took < BUDGET, f"the docs' examples took {took:.0f}s (budget {BUDGET:.0f}s)"


def test_the_readmes_links_point_at_files():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [u for u in links if "://" not in u]
    assert local, "README links to no docs page"
    missing = [u for u in local if not (ROOT / u).exists()]
    assert not missing, f"README links to missing files: {missing}"
    assert len(text.splitlines()) <= 300
