"""bench/verifier.py's resampling interval of the writing-window ratio: it holds the run's own figure, moves with
how the windows differ, and is the same for the same run."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from verifier import Activity, windows_p99_ratio, windows_p99_ratio_interval

WROTE, READ = Activity(write_bytes=4096), Activity()


def _windows(rng: np.random.Generator, n: int, scale: float) -> list[list[float]]:
    return [list(rng.exponential(scale, 150)) for _ in range(n)]


def test_the_interval_holds_the_figure_and_is_the_same_for_the_same_run() -> None:
    rng = np.random.default_rng(7)
    with_, without = _windows(rng, 40, 1.2e-3), _windows(rng, 40, 1e-3)
    activity = [WROTE if i % 3 == 0 else READ for i in range(40)]
    figure = windows_p99_ratio(with_, without, activity, True)
    low, high = windows_p99_ratio_interval(with_, without, activity, True) or (0.0, 0.0)
    assert figure is not None and low < figure < high
    assert windows_p99_ratio_interval(with_, without, activity, True) == [low, high]
    # the windows in which the verifier wrote are 1.2x slower here, and those in which it only read no different
    assert low > 1.0
    read_low, read_high = windows_p99_ratio_interval(with_, without, [WROTE] * 40, True) or (0.0, 0.0)
    assert read_low < 1.2 < read_high


def test_no_interval_without_windows_of_that_kind() -> None:
    rng = np.random.default_rng(1)
    with_, without = _windows(rng, 8, 1e-3), _windows(rng, 8, 1e-3)
    assert windows_p99_ratio_interval(with_, without, [READ] * 8, True) is None
    assert windows_p99_ratio_interval(with_, [], [WROTE] * 8, True) is None
