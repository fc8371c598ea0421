"""MkDocs hook (mkdocs.yml `hooks:`): the benchmark results in bench/results/ (their
markdown tables and charts, rewritten by `./dev bench`) become part of the site under
bench-results/, so docs/benchmarks.md links them without a copy in docs/."""

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent


def on_files(files, config):
    results = ROOT / "bench" / "results"
    for path in sorted(results.glob("*")):
        if path.suffix in (".md", ".png"):
            files.append(File.generated(config, f"bench-results/{path.name}",
                                        abs_src_path=str(path)))
    return files
