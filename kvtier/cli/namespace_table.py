"""The namespace tables of `kvtier namespace list` and `kvtier status`."""

from __future__ import annotations

from kvtier.wire.stats import EngineNamespaceStats, EventStats, NamespaceStats


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


def engine_lines(engines: list[EngineNamespaceStats]) -> list[str]:
    """What engines' tiers did per namespace since the daemon started: lookups and the share that hit, loads
    (and failed ones) with their bytes, stores with theirs, open connections."""
    header = (
        "engine namespace",
        "engine",
        "model",
        "conns",
        "lookups",
        "hit",
        "loads",
        "failed",
        "loaded",
        "stores",
        "stored",
    )
    rows = [header]
    for e in engines:
        hit = f"{e.hits / e.lookups:.1%}" if e.lookups else "-"
        rows.append(
            (
                e.namespace,
                e.engine,
                e.model[:24],
                str(e.connections),
                str(e.lookups),
                hit,
                str(e.loads),
                str(e.load_failures),
                _size(e.bytes_loaded),
                str(e.stores),
                _size(e.bytes_stored),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return [
        "  ".join(c.rjust(w) if i >= 3 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
        for r in rows
    ]


def events_line(ev: EventStats | None) -> str:
    """The KV-events publisher in one line."""
    if ev is None:
        return "events     off ([events] endpoint publishes the blocks this node holds; docs/events.md)"
    replay = f", replays on {ev.replay_endpoint} ({ev.replays} served)" if ev.replay_endpoint else ""
    dropped = f", {ev.dropped:,} dropped (queue full)" if ev.dropped else ""
    return (
        f"events     {ev.endpoint} topic {ev.topic!r}: {ev.batches:,} batches, {ev.stored:,} stored, "
        f"{ev.removed:,} removed{dropped}{replay}"
    )
