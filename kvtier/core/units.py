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


def size_setting(n: int) -> str | int:
    """A byte count as a config value that reads back exactly: `512MiB` when a binary unit divides it, else bytes."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n and n % scale == 0:
            return f"{n // scale}{unit}"
    return n
