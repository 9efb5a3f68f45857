"""Lint a Prometheus text exposition by the naming conventions (prometheus.io/docs/practices/naming), the rules
`promtool check metrics` applies, and kvtier's own: counters end in `_total`, units are base units named as a
suffix, no `_created` series, no since-start ratio gauges (`_rate`), every family has HELP and TYPE.

`promtool` runs too where it is installed (Debian: `apt-get install prometheus`); these rules run everywhere.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess

NAME = re.compile(r"^kvtier_[a-z][a-z0-9_]*$")
LABEL = re.compile(r"^[a-z][a-z0-9_]*$")
NON_BASE_UNITS = ("milliseconds", "microseconds", "nanoseconds", "minutes", "hours", "kilobytes", "megabytes", "bits")
# what a name may end in: a base unit, a ratio, or the thing it counts
UNIT = re.compile(
    r"_(seconds|bytes|ratio|info|objects|slots|records|keys|pins|requests|connections|lookups|recoveries|"
    r"recomputes|rejections|evictions|misses|actions|restarts|passes|up|healthy)$"
)
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s+(\S+)")


@dataclasses.dataclass(slots=True)
class Family:
    name: str
    type: str = ""
    help: str = ""
    samples: list[tuple[str, dict[str, str]]] = dataclasses.field(default_factory=list)


def parse(text: str) -> dict[str, Family]:
    """Families by name, with their samples (sample name, labels)."""
    families: dict[str, Family] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_ = line[7:].partition(" ")
            families.setdefault(name, Family(name)).help = help_
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            families.setdefault(name, Family(name)).type = kind
        elif line and not line.startswith("#"):
            m = SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            labels = dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
            owner = _owner(m.group(1), families)
            families.setdefault(owner, Family(owner)).samples.append((m.group(1), labels))
    return families


def _owner(sample: str, families: dict[str, Family]) -> str:
    for suffix in ("_bucket", "_count", "_sum", "_created", "_total", "_info", ""):
        if suffix and sample.endswith(suffix) and sample[: -len(suffix)] in families:
            return sample[: -len(suffix)]
    return sample


def problems(text: str) -> list[str]:
    """Every violation, one line each (empty: clean)."""
    out: list[str] = []
    for name, fam in parse(text).items():
        if not NAME.match(name):
            out.append(f"{name}: names are kvtier_ + snake_case")
        if not fam.help:
            out.append(f"{name}: no HELP")
        if not fam.type:
            out.append(f"{name}: no TYPE")
        if any(unit in name for unit in NON_BASE_UNITS):
            out.append(f"{name}: use base units (seconds, bytes)")
        if name.endswith(("_rate", "_success_rate")):
            out.append(f"{name}: a since-start rate gauge; expose counters and let PromQL take rate()")
        for sample, labels in fam.samples:
            if sample.endswith("_created"):
                out.append(f"{sample}: _created series (disable them)")
            if fam.type == "counter" and not sample.endswith("_total"):
                out.append(f"{sample}: a counter's samples end in _total")
            if fam.type != "counter" and sample.endswith("_total"):
                out.append(f"{sample}: _total on a {fam.type or 'untyped'} metric")
            out.extend(f"{sample}: label {k!r} is not snake_case" for k in labels if not LABEL.match(k))
        if fam.type in ("gauge", "counter", "histogram") and not UNIT.search(name.removesuffix("_total")):
            out.append(f"{name}: the name does not end in its unit (_seconds, _bytes, _ratio, or what it counts)")
    return out


def promtool(text: str) -> list[str] | None:
    """`promtool check metrics` findings, or None where promtool is not installed."""
    exe = shutil.which("promtool")
    if exe is None:
        return None
    proc = subprocess.run([exe, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
