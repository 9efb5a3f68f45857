"""How far a p99 ratio measured over alternating windows could have moved: the resampling interval that
bench/verifier.py (the readers in the verifier's writing windows) and bench/verifier_offloads.py (durable offloads
with the verifier stopped at random) report beside their figures.

`p99_ratio_interval(a, b)` is the middle 95% of (p99 of a's pooled samples) / (p99 of b's) over `draws`
resamplings, with replacement, of each side's windows, with a fixed seed: the same run gives the same interval.
Windows are drawn, not samples, since the samples of one window share its moment: the interval says how far the
figure could have moved had the verifier's work and the machine's own hiccups fallen in other windows of the same
run. A figure whose interval holds the target on both sides is neither met nor missed beyond that run's noise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def p99_ratio_interval(
    a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], draws: int = 1000
) -> list[float] | None:
    """[low, high] of the p99 ratio a / b over resamplings of each side's windows (lists of samples); None where
    a side has no window with samples."""
    wa = [np.asarray(xs, float) for xs in a if len(xs)]
    wb = [np.asarray(xs, float) for xs in b if len(xs)]
    if not wa or not wb:
        return None
    rng = np.random.default_rng(0)
    ratios = [
        np.percentile(np.concatenate([wa[i] for i in rng.integers(0, len(wa), len(wa))]), 99)
        / np.percentile(np.concatenate([wb[i] for i in rng.integers(0, len(wb), len(wb))]), 99)
        for _ in range(draws)
    ]
    return [round(float(x), 3) for x in np.percentile(ratios, [2.5, 97.5])]
