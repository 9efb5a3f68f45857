"""docs/benchmarks.md and the README's key results are what bench/report.py makes from the committed reports in
bench/results/*.json: no figure in them is written by hand, and a report that changes changes them."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def load_report_module():
    spec = importlib.util.spec_from_file_location("bench_report", REPO / "bench" / "report.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = load_report_module()


def test_the_benchmarks_page_is_generated_from_the_committed_reports() -> None:
    assert report.load_reports(), "no run_all report under bench/results"
    wanted = report.generated()[report.PAGE]
    assert (REPO / "docs" / "benchmarks.md").read_text() == wanted, "run python bench/report.py"


def test_the_readme_key_results_are_generated_from_the_committed_reports() -> None:
    assert (REPO / "README.md").read_text() == report.generated()[report.README], "run python bench/report.py"


def test_check_mode_says_whether_the_pages_are_current() -> None:
    proc = subprocess.run([sys.executable, "bench/report.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_page_follows_the_reports(tmp_path: Path) -> None:
    # Another figure in a report is another figure on the page: the page is not a copy of itself.
    shutil.copytree(REPO / "bench" / "results", tmp_path, dirs_exist_ok=True)
    (name, latest), *_ = report.load_reports(tmp_path)
    changed = copy.deepcopy(latest)
    changed["commit"] = "0000000"
    changed["sections"]["store"]["read_MBps"] = 1234.0
    changed["sections"]["store"]["fio_read_MBps"] = 617.0
    changed["sections"]["store"]["read_ratio_to_fio"] = 2.0
    changed["sections"]["store"]["read_ratio_best_over_best"] = 1.5
    changed["sections"]["store"]["fio"] = {"ioengine": "libaio", "request_bytes": 1 << 20, "iodepth": 8, "memory": "x"}
    (tmp_path / name).write_text(json.dumps(changed))
    text = report.page(report.load_reports(tmp_path), tmp_path)
    assert "commit `0000000`" in text
    row = "| 1,234 | fio libaio O_DIRECT, 1024 KiB x 8 in flight, x | 617 | 2.00 of fio (median of ABBA pairs; best"
    assert row + " over best 1.50) |" in text
    assert text != report.page(report.load_reports(REPO / "bench" / "results"))


def test_every_line_with_a_baseline_shows_its_figure_and_the_ratio() -> None:
    (_, latest), *_ = report.load_reports()
    lines = report.rows(latest["sections"])
    assert lines
    for r in lines:
        if r.baseline and r.baseline_figure != "error":
            assert r.baseline_figure not in ("", "-"), r
    keyed = {r.key: r for r in lines}
    for key in report.KEY_ROWS:
        if key in keyed:
            assert keyed[key].baseline and keyed[key].ratio, keyed[key]


def test_a_page_names_where_and_when_it_ran() -> None:
    (_, latest), *_ = report.load_reports()
    text = report.markdown(latest)
    m = latest["machine"]
    for fact in (latest["date"], latest["commit"], m["cpu_model"], str(m["calibration"]["python_loop_ns"])):
        assert fact in text, fact


def test_a_readme_without_its_block_is_refused() -> None:
    with pytest.raises(ValueError, match="key-results block"):
        report.readme_with("# kvtier\n", report.key_results(report.load_reports()))


def test_the_readme_takes_the_newest_full_run_and_the_page_shows_every_report(tmp_path: Path) -> None:
    (_, latest), *_ = report.load_reports()
    older, quick = copy.deepcopy(latest), copy.deepcopy(latest)
    older.update(date="2000-01-01", commit="1111111")
    quick.update(date="2100-01-01", commit="2222222", quick=True)
    (tmp_path / "older.json").write_text(json.dumps(older))
    (tmp_path / "quick.json").write_text(json.dumps(quick))
    (tmp_path / "notes.json").write_text(json.dumps({"not": "a report"}))  # ignored: not what run_all writes
    reports = report.load_reports(tmp_path)
    assert [name for name, _ in reports] == ["quick.json", "older.json"]  # newest first
    assert "commit `1111111`" in report.key_results(reports)  # a --quick run never stands for the results
    text = report.page(reports, tmp_path)
    assert text.index("commit `2222222` with `--quick`") < text.index("commit `1111111`")
