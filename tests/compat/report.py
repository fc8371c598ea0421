"""The compatibility table from what `./dev compat` ran: reads tests/compat/results/
<lane>.json (each lane's versions and test counts, written by the suite) and writes
results/lanes.md and the table of docs/versions.md between its compat markers.

    python tests/compat/report.py tests/compat/results docs/versions.md
"""

import json
import sys
from pathlib import Path

ORDER = ("main", "tfkeras", "tf215")
WHAT = {"main": "TF 2.21 + Keras 3 (the main lane)",
        "tfkeras": "TF 2.21 + tf_keras (Keras 2, `TF_USE_LEGACY_KERAS=1`)",
        "tf215": "TF 2.15 + its Keras 2 + Horovod"}
BEGIN, END = "<!-- compat-table:begin -->", "<!-- compat-table:end -->"


def table(results: Path) -> str:
    rows = []
    for lane in ORDER:
        path = results / f"{lane}.json"
        if not path.exists():
            continue
        r = json.loads(path.read_text())
        ok = "pass" if r["exit_status"] == 0 and not r["failed"] and not r["error"] else "**FAIL**"
        rows.append(f"| {WHAT[lane]} | {r['tensorflow']} | {r['keras']} | "
                    f"{r['horovod'] or '-'} | {r['openmpi']} | {r['python']} | "
                    f"{ok}: {r['passed']} passed, {r['failed'] + r['error']} failed, "
                    f"{r['skipped']} skipped ({r['seconds']:.0f} s) | {r['date']} |")
    return "\n".join([
        "| lane | TensorFlow | Keras | Horovod | Open MPI | Python | compatibility suite | ran |",
        "|---|---|---|---|---|---|---|---|", *rows])


def main(results: str, readme: str) -> int:
    results = Path(results)
    text = table(results)
    (results / "lanes.md").write_text("# Compatibility lanes (`./dev compat`)\n\n" + text + "\n")
    path = Path(readme)
    doc = path.read_text()
    if BEGIN in doc and END in doc:
        head, rest = doc.split(BEGIN, 1)
        path.write_text(head + BEGIN + "\n" + text + "\n" + END + rest.split(END, 1)[1])
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
