"""No lab notebook in the code or the docs: comments and docstrings in kvtier/ and the pages in docs/ say why in
words, and carry no measured figures, machine names, run ids, dates or commit ids. Figures go stale there; they
live in bench/results/*.json and in docs/benchmarks.md, which bench/report.py generates from them (so that page
alone is not checked). A page says what is measured, by which test or bench script, and where it is shown.

What counts as a figure (each pattern below names why it is one):
- a decimal with a unit of time, size, rate, percent or ratio ("3.1 ms", "2.4 GB/s", "1.9x", "0.7%"): a
  measurement; a whole number with a unit ("4096 B", "32 MiB", "30 s") is usually a constant or a default and is
  allowed, unless it is a rate ("310 MB/s", "50,000 objects/s"), a time below a second ("26 ms": kvtier's own
  deadlines are in seconds) or an approximate time ("about 90 s"), which are measured;
- a range of figures ("1.1-3.2 GB/s", "16-18 ms", with a hyphen or an en dash): the spread of runs;
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
DASH = "\u2013"  # the en dash the docs write ranges with
TIMES = "\u00d7"  # the multiplication sign the docs write ratios with

PATTERNS: dict[str, re.Pattern[str]] = {
    # a decimal with a unit: nobody writes a default as 3.1 ms or 0.7%; a run measures it
    "decimal figure": re.compile(rf"(?<![\w.]){DEC}\s?(?:{TIME}|{SIZE}|{RATE}|%)(?![\w/])"),
    # below a second, a time in a comment is what something took: kvtier's own deadlines are in seconds
    "sub-second time": re.compile(rf"(?<![\w.]){NUM}\s?(?:ns|µs|us|ms)(?!\w)"),
    # "about 90 s", "~17 ms": an estimate of how long something takes, read off a run
    "approximate time": re.compile(rf"(?:\babout|~)\s?{NUM}\s?{TIME}(?!\w)"),
    # a rate is measured, whole or not
    "rate": re.compile(rf"(?<![\w.]){NUM}\s?{RATE}(?!\w)"),
    # a speed-up or a ratio of runs: "1.9x", "12x faster", ten with a multiplication sign
    "ratio": re.compile(rf"(?<![\w.]){NUM}(?:x(?:\b|(?= ))|{TIMES})(?!\d)"),
    # a spread of runs, with a hyphen or an en dash: "1.1-3.2 GB/s", "16-18 ms", "0.91-0.93"
    "range of figures": re.compile(
        rf"(?<![\w.\-{DASH}]){DEC}[-{DASH}]{DEC}(?![\w.])|(?<![\w.\-{DASH}]){NUM}[-{DASH}]{NUM}\s?(?:{TIME}|{RATE})\b"
    ),
    "machine name": re.compile(r"\bVMs?\b"),
    "run id": re.compile(r"\br\d{2,3}\b"),
    "date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "commit id": re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,12}\b"),
}

GENERATED = "benchmarks.md"  # written by bench/report.py from bench/results/*.json: the figures' one home

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


# A page may state a constant, a default or a test's bound that reads like a figure: (page, text) -> the code that
# holds it, so the page can be checked against it. Measurements never go here.
PAGE_CONSTANTS: dict[tuple[str, str], str] = {
    ("cluster.md", "0.94 MiB"): "deepseek-v4-flash's history bytes per block: its groups' object_bytes, not a run",
    ("cluster.md", "13.9 MiB"): "deepseek-v4-flash's state bytes per checkpoint: its groups' object_bytes, not a run",
    ("cluster.md", "0.2 s"): "cluster.lookup_timeout_s's default in kvtier/core/config_schema.py",
    ("verifier.md", "0.1 s"): "tests/verifier/test_footprint.py: the bound it holds a stop's CPU time under",
    ("verifier.md", "50 ms"): "kvtier/verifier/busy.py SAMPLE_S: how often the busy probe samples, at most",
    ("verifier.md", "1 MiB/s"): "kvtier/verifier/busy.py OTHERS_BUSY_BYTES_PER_S: what makes a disk busy",
    ("verifier.md", "0.5 s"): "kvtier/verifier/busy.py HOLD_S, and bench/verifier_offloads.py's longest stop",
    ("verifier.md", "64 MiB/s"): "verifier.rate_bytes_per_s's default in kvtier/core/config_schema.py",
    ("verifier.md", "0.2 s"): "bench/verifier.py --window-s default",
    ("verifier.md", "32 MiB/s"): "bench/verifier.py --rate default (32 << 20)",
}


def figures_in(where: str, line: int, text: str) -> list[str]:
    """'where:line: kind: the text that matched' for every figure in `text`, whose first line is `line`."""
    found = []
    page = Path(where).name
    for kind, pattern in PATTERNS.items():
        for m in pattern.finditer(text):
            if m.group(0) in ALLOWED or (page, m.group(0)) in PAGE_CONSTANTS:
                continue
            at = line + text.count("\n", 0, m.start())
            found.append(f"{where}:{at}: {kind}: {m.group(0)!r}")
    return found


def figures(path: Path) -> list[str]:
    """Every figure in a module's comments and docstrings."""
    return [f for line, text in comment_blocks(path) for f in figures_in(str(path.relative_to(REPO)), line, text)]


def page_figures(path: Path) -> list[str]:
    """Every figure in a docs page: its prose, tables and examples alike (an example's output is one run's too)."""
    return figures_in(str(path.relative_to(REPO)), 1, path.read_text())


def modules(store: bool) -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if (p.relative_to(PACKAGE).parts[0] == "store") == store)


def pages() -> list[Path]:
    """docs/*.md but the generated benchmarks page, whose figures are bench/results' own."""
    return sorted(p for p in (REPO / "docs").glob("*.md") if p.name != GENERATED)


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


def test_the_scanner_finds_figures_in_a_page(tmp_path: Path) -> None:
    # A page is read whole: prose, a table row and an example's output each carry a figure here.
    page = tmp_path / "page.md"
    page.write_text(
        "# A page\n\nRestores read at 2.6 GB/s on the VM.\n\n"
        "| case | p99 |\n| --- | --- |\n| lookup | 16\u201318 ms |\n\n"
        "```\nprefix: hit 4,096 tokens, 0.05 s\n```\nUnder 10\u00d7 the baseline.\n"
    )
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        found = page_figures(page)
    finally:
        REPO = saved
    lines = {f.split(":")[1] for f in found}
    kinds = {f.split(": ")[1] for f in found}
    assert lines == {"3", "7", "10", "12"}, found
    assert {"rate", "machine name", "range of figures", "decimal figure", "ratio"} <= kinds, found


def test_the_pages_checked_are_every_page_but_the_generated_one() -> None:
    names = {p.name for p in pages()}
    assert GENERATED not in names and (REPO / "docs" / GENERATED).exists()
    assert names == {p.name for p in (REPO / "docs").glob("*.md")} - {GENERATED}
    # the generated page is what carries the figures: the exemption is not a hole another page could use
    assert "generated by bench/report.py" in (REPO / "docs" / GENERATED).read_text()


def test_no_figures_in_the_docs() -> None:
    found = [f for p in pages() for f in page_figures(p)]
    assert not found, (
        "figures in docs/ (say what is measured and where: a bench script or test, and docs/benchmarks.md):\n"
        + "\n".join(found)
    )


def test_each_page_constant_is_on_its_page() -> None:
    # an entry whose text left its page is a hole for a figure to come back through: drop it
    stale = [key for key in PAGE_CONSTANTS if key[1] not in (REPO / "docs" / key[0]).read_text()]
    assert not stale, stale
