"""The namespace table of `kvtier namespace list` and `kvtier status`."""

from __future__ import annotations

from kvtier.wire.stats import NamespaceStats


def namespace_lines(namespaces: list[NamespaceStats]) -> list[str]:
    """A table of namespaces: hex, state, serving profile, model, records, bytes."""
    header = ("namespace", "state", "profile", "model", "records", "bytes")
    rows = [header] + [
        (n.namespace, n.state, n.profile or "-", n.model[:24], str(n.records), _size(n.bytes)) for n in namespaces
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return [
        "  ".join(c.rjust(w) if i >= 4 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    ]


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
