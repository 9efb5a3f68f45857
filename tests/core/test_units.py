"""One size format for people: binary units with one decimal; bytes below 1 KiB; `none` for no figure."""

from __future__ import annotations

import pytest

from kvtier.core.config import parse_size
from kvtier.core.units import format_bytes, size_setting


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


@pytest.mark.parametrize("n", [0, 1, 4096, 8 * 2**20, 100 * 2**30, 3 * 2**40, 12345])
def test_size_settings_read_back_exactly(n: int) -> None:
    assert parse_size(size_setting(n), "k") == n
    assert size_setting(8 * 2**20) == "8MiB" and size_setting(12345) == 12345
