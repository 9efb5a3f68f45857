"""One size format for people: binary units with one decimal; bytes below 1 KiB; `none` for no figure."""

from __future__ import annotations

import pytest

from kvtier.core.units import format_bytes


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (2 * 2**30, "2.0 GiB"),
        (2048 * 2**20, "2.0 GiB"),  # what `status` showed as "2048 MiB"
        (5 * 2**50, "5.0 PiB"),
        (3 * 2**60, "3,072.0 PiB"),
        (None, "none"),
    ],
)
def test_format_bytes(n: int | None, text: str) -> None:
    assert format_bytes(n) == text
