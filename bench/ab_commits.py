"""Two commits' `bench/run_all.py` figures side by side, alternated in one run; prints one JSON object.

    python bench/ab_commits.py BEFORE AFTER [--rounds N] [--only SECTION ...] [--dir DIR] [--out FILE]

Each commit is checked out into a temporary git worktree of this repository and runs `bench/run_all.py --only
SECTION ...` from it, its own kvtier first on the path (PYTHONPATH: the daemons it starts and the scripts it runs
import that tree, not whatever kvtier the interpreter has installed), with this interpreter. The sides run in ABBA
order (`abba.abba`), so a machine that speeds up or slows down over the run weighs on both alike.

Per figure (every number of every section's JSON, restore's cases by their token count, and the machine's
calibration): each side's values in run order, each side's median, `after_over_before` (the medians' ratio) and
`ranges_overlap`: whether the two sides' [min, max] intersect. A figure whose ranges do not overlap moved beyond
what the rounds themselves spread; whether up is better depends on the figure, which its name says. The worktrees
are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from abba import abba

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


def flatten(doc: object, prefix: str = "") -> dict[str, float]:
    """Every number in a report, by its dotted path; a list of restore cases is keyed by each case's `tokens`."""
    out: dict[str, float] = {}
    if isinstance(doc, dict):
        for key, value in doc.items():
            out.update(flatten(value, f"{prefix}{key}."))
    elif isinstance(doc, list):
        for i, item in enumerate(doc):
            name = item["tokens"] if isinstance(item, dict) and "tokens" in item else i
            out.update(flatten(item, f"{prefix}{name}."))
    elif isinstance(doc, (int, float)) and not isinstance(doc, bool):
        out[prefix.rstrip(".")] = float(doc)
    return out


def figures(report: dict) -> dict[str, float]:
    """The figures of one run_all report that compare across commits: its sections and the machine's calibration."""
    out = flatten(report.get("sections", {}))
    out.update(flatten(report.get("machine", {}).get("calibration", {}), "calibration."))
    return out


def compare(runs: list[tuple[str, dict[str, float]]]) -> dict[str, dict]:
    """Per figure both sides carry: values in run order, medians, their ratio and whether the ranges overlap."""
    sides = {"before": [f for s, f in runs if s == "before"], "after": [f for s, f in runs if s == "after"]}
    names = set.intersection(*(set(f) for f in sides["before"] + sides["after"])) if runs else set()
    out: dict[str, dict] = {}
    for name in sorted(names):
        before = [f[name] for f in sides["before"]]
        after = [f[name] for f in sides["after"]]
        b, a = statistics.median(before), statistics.median(after)
        out[name] = {
            "before": before,
            "after": after,
            "before_median": b,
            "after_median": a,
            "after_over_before": round(a / b, 3) if b else None,
            "ranges_overlap": max(before) >= min(after) and max(after) >= min(before),
        }
    return out


def run_side(tree: Path, only: list[str], bench_dir: str, out_dir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "bench/run_all.py", "--only", *only, "--dir", bench_dir, "--out", str(out_dir)]
    res = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if res.returncode:
        raise SystemExit(f"run_all failed in {tree}: {res.stderr.strip().splitlines()[-1:]}")
    return json.loads((out_dir / "latest.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rounds", type=int, default=3, help="ABBA rounds: each side runs this many times")
    ap.add_argument("--only", nargs="+", default=["store", "restore", "daemon"], help="run_all's sections")
    ap.add_argument("--dir", default=os.environ.get("KVTIER_BENCH_DIR", "/var/tmp"), help="The filesystem measured.")
    ap.add_argument("--out", help="Also write the JSON here.")
    args = ap.parse_args()
    revs = {}
    for side in ("before", "after"):
        rev = getattr(args, side)
        revs[side] = subprocess.run(
            ["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="kvtier-ab-") as work:
        trees = {side: Path(work) / side for side in revs}
        for side, tree in trees.items():
            subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), revs[side]], cwd=ROOT, check=True)
        try:
            runs = []
            for i, side in enumerate(abba("before", "after", args.rounds)):
                report = run_side(trees[side], args.only, args.dir, Path(work) / f"out-{i}")
                runs.append((side, figures(report)))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    doc = {
        "before": revs["before"],
        "after": revs["after"],
        "order": [side for side, _ in runs],
        "sections": args.only,
        "figures": compare(runs),
    }
    text = json.dumps(doc, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
