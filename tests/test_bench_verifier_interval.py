"""The benches' resampling intervals of a p99 ratio (bench/resample.py): bench/verifier.py's writing-window ratio and
bench/verifier_offloads.py's durable-offload ratio. Each holds the run's own figure, moves with how the windows
differ, and is the same for the same run."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from verifier import Activity, windows_p99_ratio, windows_p99_ratio_interval
from verifier_offloads import p99_interval

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


def test_the_durable_offload_interval_holds_the_figure_and_moves_with_the_stopping_windows() -> None:
    rng = np.random.default_rng(3)
    labels = ["control", "stopping", "stopping", "control"] * 10
    windows = [(label, list(rng.exponential(1.3e-2 if label == "stopping" else 1e-2, 150))) for label in labels]
    pooled = {side: np.concatenate([xs for label, xs in windows if label == side]) for side in ("stopping", "control")}
    figure = np.percentile(pooled["stopping"], 99) / np.percentile(pooled["control"], 99)
    low, high = p99_interval(windows) or (0.0, 0.0)
    assert low < figure < high
    assert low > 1.0  # the stopping windows are 1.3x slower here
    assert p99_interval(windows) == [low, high]
    same = [(label, list(rng.exponential(1e-2, 150))) for label in labels]
    same_low, same_high = p99_interval(same) or (0.0, 0.0)
    assert same_low < 1.0 < same_high
    assert p99_interval([w for w in windows if w[0] == "stopping"]) is None
