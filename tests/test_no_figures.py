"""No lab notebook in the code: comments and docstrings in kvtier/ say why in words, and carry no measured figures,
machine names, run ids, dates or commit ids. Figures go stale in code; they live in bench/results/*.json and in
docs/benchmarks.md, which bench/report.py generates from them.

What counts as a figure (each pattern below names why it is one):
- a decimal with a unit of time, size, rate, percent or ratio ("3.1 ms", "2.4 GB/s", "1.9x", "0.7%"): a
  measurement; a whole number with a unit ("4096 B", "32 MiB", "30 s") is usually a constant or a default and is
  allowed, unless it is a rate ("310 MB/s", "50,000 objects/s"), a time below a second ("26 ms": kvtier's own
  deadlines are in seconds) or an approximate time ("about 90 s"), which are measured;
- a range of figures ("1.1-3.2 GB/s", "16-18 ms"): the spread of runs;
- "VM", a run id ("r83"), a date ("2026-12-02"), a commit id (7-12 hex digits with a letter and a digit).

The store's modules (kvtier/store/) are checked by their own test function so that their cleanup can land apart.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "kvtier"

TIME = r"(?:ns|µs|us|ms|s|sec|seconds?|min|minutes?|h)"
SIZE = r"(?:B|KB|MB|GB|TB|KiB|MiB|GiB|TiB|bytes?)"
RATE = r"(?:[KMG]i?B/s|Gbit/s|Mbit/s|objects/s|records/s|ops/s|op/s|/s)"
NUM = r"\d[\d,]*(?:\.\d+)?"
DEC = r"\d[\d,]*\.\d+"

PATTERNS: dict[str, re.Pattern[str]] = {
    # a decimal with a unit: nobody writes a default as 3.1 ms or 0.7%; a run measures it
    "decimal figure": re.compile(rf"(?<![\w.]){DEC}\s?(?:{TIME}|{SIZE}|{RATE}|%)(?![\w/])"),
    # below a second, a time in a comment is what something took: kvtier's own deadlines are in seconds
    "sub-second time": re.compile(rf"(?<![\w.]){NUM}\s?(?:ns|µs|us|ms)(?!\w)"),
    # "about 90 s", "~17 ms": an estimate of how long something takes, read off a run
    "approximate time": re.compile(rf"(?:\babout|~)\s?{NUM}\s?{TIME}(?!\w)"),
    # a rate is measured, whole or not
    "rate": re.compile(rf"(?<![\w.]){NUM}\s?{RATE}(?!\w)"),
    # a speed-up or a ratio of runs: "1.9x", "12x faster"
    "ratio": re.compile(rf"(?<![\w.]){NUM}x(?:\b|(?= ))(?!\d)"),
    # a spread of runs: "1.1-3.2 GB/s", "16-18 ms", "0.91-0.93"
    "range of figures": re.compile(rf"(?<![\w.\-]){DEC}-{DEC}(?![\w.])|(?<![\w.\-]){NUM}-{NUM}\s?(?:{TIME}|{RATE})\b"),
    "machine name": re.compile(r"\bVMs?\b"),
    "run id": re.compile(r"\br\d{2,3}\b"),
    "date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "commit id": re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b"),
}

# Texts that match a pattern but are not measurements, each with why. Keep this short: a new entry needs a reason a
# reader accepts, not a wish to pass.
ALLOWED: dict[str, str] = {
    "1.5 GB": "core/config.py parse_size: an example of the size syntax it accepts",
    "1.5 KiB": "core/units.py format_bytes: an example of what it prints",
    "2.0 GiB": "core/units.py format_bytes: an example of what it prints",
    "4 MiB/s": "the verifier's busy_rate_bytes_per_s default (4 << 20), a setting, and sums its comments do with it",
}


def comment_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of every comment and docstring in a module."""
    source = path.read_text()
    out: list[tuple[int, str]] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                out.append((node.body[0].lineno, doc))
    return out


def figures(path: Path) -> list[str]:
    """'module:line: kind: the text that matched' for every figure in a module's comments and docstrings."""
    found = []
    for line, text in comment_blocks(path):
        for kind, pattern in PATTERNS.items():
            for m in pattern.finditer(text):
                if m.group(0) in ALLOWED:
                    continue
                at = line + text.count("\n", 0, m.start())
                found.append(f"{path.relative_to(REPO)}:{at}: {kind}: {m.group(0)!r}")
    return found


def modules(store: bool) -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if (p.relative_to(PACKAGE).parts[0] == "store") == store)


def test_the_scanner_finds_each_kind_of_figure(tmp_path: Path) -> None:
    # The patterns can fail: each kind of figure written into a module's comment or docstring is found.
    sample = tmp_path / "kvtier_sample.py"
    sample.write_text(
        '"""A load took 3.1 ms on the VM (r83, 2026-12-02 at 81d600a), 26 ms with a copy."""\n'
        "# reads at 2,400 MB/s, 1.9x the peer's, over runs 16-18 s apart; 0.91-0.93 of raw; setup: about 90 s\n"
        "X = 1\n"
    )
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        kinds = {f.split(": ")[1] for f in figures(sample)}
    finally:
        REPO = saved
    assert kinds == set(PATTERNS), kinds


def test_the_scanner_passes_constants_in_words(tmp_path: Path) -> None:
    # Constants and defaults are not figures: a whole size or a timeout, a format's alignment, a version.
    sample = tmp_path / "kvtier_sample.py"
    sample.write_text(
        '"""Payloads of 4 KiB or more sit on 4096-byte boundaries; up to 32 MiB in flight; a 30 s timeout."""\n'
        "# xxh3_128 checksums; vLLM 0.32 and SGLang 0.5.23; 128-bit hashes; a block of 256 tokens\n"
        "X = 1\n"
    )
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        assert figures(sample) == []
    finally:
        REPO = saved


def test_no_figures_in_comments_outside_the_store() -> None:
    found = [f for p in modules(store=False) for f in figures(p)]
    assert not found, "figures in comments or docstrings (say why in words; figures go to bench/results):\n" + (
        "\n".join(found)
    )


def test_no_figures_in_the_store_comments() -> None:
    # kvtier/store/ apart: its read path is being rewritten on another branch, which cleans these comments.
    found = [f for p in modules(store=True) for f in figures(p)]
    assert not found, "figures in kvtier/store comments or docstrings:\n" + "\n".join(found)
