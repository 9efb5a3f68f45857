"""bench/ab_commits.py's comparison: every number of a report by its path, medians per side, and whether the two
sides' spreads overlap."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import ab_commits


def test_figures_take_every_number_and_key_restore_cases_by_tokens() -> None:
    report = {
        "sections": {
            "restore": {"cases": [{"tokens": 4096, "us_per_object": 12.5, "bitwise_equal": True}], "note": None},
            "store": {"read_MBps": 2000, "backend": "odirect", "runs": [3, 4]},
        },
        "machine": {"calibration": {"python_loop_ns": 25.0}, "cpus": 2},
    }
    assert ab_commits.figures(report) == {
        "restore.cases.4096.tokens": 4096.0,
        "restore.cases.4096.us_per_object": 12.5,
        "store.read_MBps": 2000.0,
        "store.runs.0": 3.0,
        "store.runs.1": 4.0,
        "calibration.python_loop_ns": 25.0,
    }


def test_compare_reports_medians_their_ratio_and_overlap() -> None:
    runs = [
        ("before", {"x": 10.0, "y": 1.0, "only_before": 1.0}),
        ("after", {"x": 12.0, "y": 3.0}),
        ("after", {"x": 9.0, "y": 4.0}),
        ("before", {"x": 11.0, "y": 2.0}),
    ]
    out = ab_commits.compare(runs)
    assert set(out) == {"x", "y"}  # a figure one side lacks is not compared
    assert out["x"]["before"] == [10.0, 11.0] and out["x"]["after"] == [12.0, 9.0]
    assert out["x"]["before_median"] == 10.5 and out["x"]["after_median"] == 10.5
    assert out["x"]["after_over_before"] == 1.0 and out["x"]["ranges_overlap"]
    assert out["y"]["after_over_before"] == round(3.5 / 1.5, 3) and not out["y"]["ranges_overlap"]
