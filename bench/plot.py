"""Draw restore vs recompute (time over prompt length, log scale) from a run_all report; run in the peers venv.

Usage: python bench/plot.py REPORT.json OUT.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    report_path, out = sys.argv[1], sys.argv[2]
    report = json.loads(Path(report_path).read_text())
    restore = report["sections"]["restore"]
    cases = restore["cases"]
    tokens = [c["tokens"] for c in cases]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.plot(tokens, [c["recompute_s"] for c in cases], "o-", label="recompute the prefix (no cache)")
    ax.plot(tokens, [c["restore_s"] for c in cases], "s-", label="restore from disk (lookup + load + rebuild)")
    if all("resident_s" in c for c in cases):
        ax.plot(tokens, [c["resident_s"] for c in cases], "^--", label="restore, objects resident in the pool")
    for c in cases:
        if c["hit_tokens"] < c["tokens"]:
            ax.annotate(
                f"hit {c['hit_tokens'] / 1024:.1f}K:\nboth sides stop there",
                (c["tokens"], c["recompute_s"]),
                textcoords="offset points",
                xytext=(-112, -24),
                fontsize=7,
            )
        if c.get("resident_loaded_objects"):
            ax.annotate(
                f"+{c['resident_loaded_objects']} objects\nloaded",
                (c["tokens"], c["resident_s"]),
                textcoords="offset points",
                xytext=(-70, -22),
                fontsize=7,
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(tokens, [f"{t // 1024}K" for t in tokens])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("seconds")
    path = "through the daemon" if restore.get("path") == "daemon" else "in process"
    ax.set_title(f"kvtier restore vs recompute, {restore['profile']} ({path}), {report['date']}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main()
