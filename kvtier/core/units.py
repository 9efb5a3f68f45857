"""The one way kvtier shows a byte count to a person: binary units, one decimal (JSON keeps plain bytes)."""

from __future__ import annotations

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int | float | None) -> str:
    """`512 B`, `1.5 KiB`, `2.0 GiB`; None (no figure, e.g. no budget) is `none`."""
    if n is None:
        return "none"
    value = float(n)
    if abs(value) < 1024:
        return f"{int(value)} B"
    for unit in _UNITS:
        value /= 1024
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{value:,.1f} {unit}"
    raise AssertionError("unreachable")
