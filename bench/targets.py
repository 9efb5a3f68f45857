"""The benchmarks' acceptance lines (bench/targets.toml), checked against a run_all report.

Contract:
- `load(path)` reads the file into `Target` records; a malformed entry is a ValueError that names it and says
  what to fix.
- `evaluate(targets, sections, machine)` gives one `Verdict` per target: `met` or `missed` when its figure is in
  the section's JSON and its conditions hold; `n/a` otherwise, with why (the section did not run or failed, the
  figure is not in its JSON, or a condition does not hold) and the figure where there is one. A missed line with a
  `ceiling` (the most its figure could be on this machine, measured in the same run) that misses the bound too says
  so in its why: the hardware, not kvtier, is short of the line there.
- `line(verdict)` is the one-line form run_all prints; `cell(verdicts)` the report's target column for one row.

Why one file: a "met" written by hand beside a figure goes stale the day the figure moves; here the bound is
written once and every report is checked against it by the same code.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

FILE = Path(__file__).resolve().parent / "targets.toml"
OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
    "==": operator.eq,
}
_CONDITION = re.compile(r"^\s*(\w+)\s*(?:(>=|<=|==|>|<)\s*(-?[0-9.]+))?\s*$")
_STEP = re.compile(r"^(\w+)(?:\[(?:(\w+)=([^\]]+)|(-?\d+))\])?$")


@dataclasses.dataclass(frozen=True, slots=True)
class Target:
    row: str
    section: str
    path: str
    op: str
    value: float
    text: str
    issue: int
    when: tuple[str, ...] = ()
    ceiling: str = ""  # path, in the same section, of the most the figure could be on this machine
    ceiling_text: str = ""  # what that figure is, as a reader reads it


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    row: str
    text: str
    issue: int
    status: str  # met | missed | n/a
    measured: float | None
    why: str = ""


def load(path: Path = FILE) -> list[Target]:
    entries = tomllib.loads(path.read_text()).get("target", [])
    out = []
    for i, e in enumerate(entries):
        try:
            t = Target(
                row=e["row"],
                section=e["section"],
                path=e["path"],
                op=e["op"],
                value=float(e["value"]),
                text=e["text"],
                issue=int(e["issue"]),
                when=tuple(e.get("when", ())),
                ceiling=e.get("ceiling", ""),
                ceiling_text=e.get("ceiling_text", ""),
            )
        except (KeyError, TypeError, ValueError) as exc:
            need = "row, section, path, op, value, text, issue"
            raise ValueError(f"{path.name}: target {i + 1} needs {need}: {exc}") from exc
        if t.op not in OPS:
            raise ValueError(f"{path.name}: target {i + 1} ({t.text}): op must be one of {' '.join(OPS)}")
        for c in t.when:
            if not _CONDITION.match(c):
                raise ValueError(f"{path.name}: target {i + 1}: condition {c!r} is not '<name> [<op> <number>]'")
        if bool(t.ceiling) != bool(t.ceiling_text):
            raise ValueError(f"{path.name}: target {i + 1} ({t.text}): a ceiling needs both ceiling and ceiling_text")
        for step in f"{t.path}.{t.ceiling}".strip(".").split("."):
            if not _STEP.match(step):
                raise ValueError(f"{path.name}: target {i + 1}: path step {step!r} is not name, name[k=v] or name[i]")
        out.append(t)
    return out


def lookup(doc: Any, path: str) -> Any:
    """The value at `path` in `doc` (a section's JSON), or None where any step is absent."""
    for step in path.split("."):
        m = _STEP.match(step)
        if m is None or not isinstance(doc, dict):
            return None
        name, key, want, index = m.groups()
        doc = doc.get(name)
        if key is not None:
            doc = next((x for x in doc or [] if isinstance(x, dict) and str(x.get(key)) == want), None)
        elif index is not None:
            doc = doc[int(index)] if isinstance(doc, list) and -len(doc) <= int(index) < len(doc) else None
    return doc


def _condition(cond: str, section: dict, machine: dict) -> str | None:
    """None where `cond` holds, else why not (with the figure)."""
    m = _CONDITION.match(cond)
    assert m is not None  # load() checked it
    name, op, number = m.groups()
    for where in (machine.get("calibration", {}), machine, section):
        if name in where:
            got = where[name]
            break
    else:
        return f"{name} not recorded"
    if op is None:
        return None if got else f"not {name}"
    return None if OPS[op](got, float(number)) else f"{name} {got} (needs {op} {number})"


def evaluate(targets: Sequence[Target], sections: dict, machine: dict) -> list[Verdict]:
    out = []
    for t in targets:
        sec = sections.get(t.section)
        figure = lookup(sec, t.path) if isinstance(sec, dict) else None
        measured = _number(figure)
        if sec is None:
            why = f"section {t.section} did not run"
        elif "error" in sec or "pending" in sec or "skipped" in sec:
            why = f"{t.section}: {sec.get('error') or sec.get('pending') or sec.get('skipped')}"[:160]
        elif measured is None:
            why = f"{t.path} is not in the {t.section} report"
        else:
            why = "; ".join(w for c in t.when if (w := _condition(c, sec, machine)))
        if why:
            out.append(Verdict(t.row, t.text, t.issue, "n/a", measured, why))
            continue
        if OPS[t.op](measured, t.value):
            out.append(Verdict(t.row, t.text, t.issue, "met", measured))
            continue
        out.append(Verdict(t.row, t.text, t.issue, "missed", measured, _out_of_reach(t, sec)))
    return out


def _out_of_reach(t: Target, section: dict) -> str:
    """Why a missed line could not have been met on this machine: its ceiling misses the bound too ('' otherwise)."""
    if not t.ceiling:
        return ""
    top = _number(lookup(section, t.ceiling))
    if top is None or OPS[t.op](top, t.value):
        return ""
    return f"out of reach on this machine: {t.ceiling_text} {_figure(top)}"


def _number(figure: Any) -> float | None:
    """A report's figure as a number, or None where it is absent or not one (a flag is not a figure)."""
    return float(figure) if isinstance(figure, int | float) and not isinstance(figure, bool) else None


def _figure(x: float | None) -> str:
    return "-" if x is None else f"{x:,.3g}" if abs(x) < 100 else f"{x:,.0f}"


def line(v: Verdict) -> str:
    tail = f" ({v.why})" if v.why else ""
    return f"{v.status:>6}  {v.text}: {_figure(v.measured)}{tail}  [issue {v.issue}]"


def cell(verdicts: Sequence[Verdict]) -> str:
    """The target column of one report line: each of its targets and what became of it."""
    parts = []
    for v in verdicts:
        state = f"{v.status}: {v.why}" if v.why else v.status
        parts.append(f"{v.text}: {state}")
    return "; ".join(parts)


def as_json(verdicts: Sequence[Verdict]) -> list[dict]:
    return [dataclasses.asdict(v) for v in verdicts]


def from_json(items: Sequence[dict]) -> list[Verdict]:
    return [Verdict(**d) for d in items]
