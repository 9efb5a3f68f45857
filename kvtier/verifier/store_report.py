"""`kvtier audit`: the disk store's report: counts per namespace and form, orphaned and reclaimable bytes, budget."""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

from kvtier.core.forms import CacheForm
from kvtier.core.rollout_doc import namespace_roles
from kvtier.core.tier import ObjectKey
from kvtier.core.units import format_bytes
from kvtier.store import RECORD_FORMS, DiskStore, QuarantineReason, StoreLimits
from kvtier.verifier.checks import NamespaceView, SegmentFiles
from kvtier.verifier.inventory import FormCounts, Progress, take_inventory
from kvtier.verifier.layouts import LayoutOracle
from kvtier.verifier.settings import VerifierSettings
from kvtier.verifier.survey import survey_segments

COUNT_FIELDS = tuple(f.name for f in dataclasses.fields(FormCounts))
FAULTS_SHOWN = 20  # corrupt records named in the text report; --json names every one


@dataclasses.dataclass(slots=True)
class NamespaceReport:
    namespace: bytes
    live: bool
    state: str  # live / canary (as the daemon last published its roles) / retired
    version_key: dict[str, str] | None  # None: records name a namespace the index has no entry for
    forms: dict[CacheForm, FormCounts]
    identity: dict[str, Any] | None = None  # an engine tier's resolved configuration behind the version key


@dataclasses.dataclass(slots=True)
class AuditReport:
    """What one audit saw. `problems`: corruption not yet quarantined, or orphaned bytes (exit code 1)."""

    store: str
    format_version: int
    namespaces: list[NamespaceReport]
    orphaned_bytes: int
    reclaimable_bytes: int
    used_bytes: int
    budget_bytes: int | None
    corrupt: int
    quarantined: int
    oldest: float | None
    newest: float | None
    stray_files: int
    missing_segments: int
    deep: bool = False  # every serving record was re-read and checksummed
    faults: list[tuple[ObjectKey, QuarantineReason]] = dataclasses.field(default_factory=list)  # the corrupt ones

    @property
    def problems(self) -> bool:
        return self.corrupt > 0 or self.orphaned_bytes > 0

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "format_version": self.format_version,
            "namespaces": [
                {
                    "namespace": n.namespace.hex(),
                    "live": n.live,
                    "state": n.state,
                    "version_key": n.version_key,
                    "identity": n.identity,
                    "forms": {f.value: c.to_dict() for f, c in n.forms.items()},
                }
                for n in self.namespaces
            ],
            "orphaned_bytes": self.orphaned_bytes,
            "reclaimable_bytes": self.reclaimable_bytes,
            "used_bytes": self.used_bytes,
            "budget_bytes": self.budget_bytes,
            "corrupt": self.corrupt,
            "quarantined": self.quarantined,
            "oldest": self.oldest,
            "newest": self.newest,
            "deep": self.deep,
            "corrupt_records": [_fault_json(k, r) for k, r in self.faults],
        }


def _fault_json(key: ObjectKey, reason: QuarantineReason) -> dict[str, str]:
    return {
        "namespace": key.namespace.hex(),
        "block_hash": key.block_hash.hex(),
        "group": key.group,
        "form": key.form.value,
        "reason": reason.label,
    }


def audit_store(
    store: DiskStore,
    settings: VerifierSettings | None = None,
    *,
    deep: bool = False,
    progress: Progress | None = None,
) -> AuditReport:
    """Read-only: survey segments/, walk the index (and with `deep` re-read every serving record)."""
    settings = settings or VerifierSettings()
    survey = survey_segments(store, settings.orphan_grace_s)
    namespaces = NamespaceView(store)
    files = SegmentFiles(store.segment_dir)
    inv = take_inventory(
        store,
        namespaces,
        files,
        LayoutOracle.load(settings.profiles),
        deep=deep,
        read_bytes=settings.read_bytes,
        progress=progress,
    )
    reports = []
    roles = namespace_roles(store)
    for ns in sorted(set(namespaces.entries) | set(inv.counts)):
        entry = namespaces.entries.get(ns)
        forms = inv.counts.get(ns) or {f: FormCounts() for f in RECORD_FORMS}
        live = bool(entry and entry.live)
        state = "retired" if not live else "canary" if roles.get(ns.hex(), ("",))[0] == "canary" else "live"
        key, identity = (entry.version_key.to_dict(), entry.identity) if entry else (None, None)
        reports.append(NamespaceReport(ns, live, state, key, forms, dict(identity) if identity else None))
    reclaimable = sum(max(0, size - inv.serving_bytes.get(s, 0)) for s, (size, _) in survey.files.items())
    reclaimable += sum(s.size for s in survey.old_strays())
    limits = settings.limits or store.limits() or StoreLimits()
    return AuditReport(
        store=store.root,
        format_version=store.format_version(),
        namespaces=reports,
        orphaned_bytes=survey.orphaned_bytes,
        reclaimable_bytes=reclaimable,
        used_bytes=int(store.stats()["record_bytes"]),
        budget_bytes=limits.budget_bytes or None,
        corrupt=inv.total("corrupt"),
        quarantined=inv.total("quarantined"),
        oldest=inv.oldest,
        newest=inv.newest,
        stray_files=len(survey.old_strays()),
        missing_segments=len([s for s in survey.missing if survey.entries[s].referenced]),
        deep=deep,
        faults=inv.faults,
    )


def render_table(report: AuditReport) -> str:
    """The human form: a header of store-wide figures, then one row per namespace and form with entries."""
    budget = format_bytes(report.budget_bytes)
    checked = "deep: every serving record re-read and checksummed" if report.deep else "index only (--deep re-reads)"
    lines = [
        f"store        {report.store}  (format v{report.format_version})",
        f"used         {format_bytes(report.used_bytes)} of budget {budget}",
        f"orphaned     {format_bytes(report.orphaned_bytes)}  ({report.stray_files} stray files, "
        f"{report.missing_segments} missing segments)",
        f"reclaimable  {format_bytes(report.reclaimable_bytes)}",
        f"entries      oldest {_time(report.oldest)}  newest {_time(report.newest)}",
        f"checked      {checked}",
        f"corrupt      {report.corrupt}  quarantined {report.quarantined}",
    ]
    shown = report.faults[:FAULTS_SHOWN]
    for key, reason in shown:
        lines.append(
            f"  corrupt    {key.group} ({key.form.value}) block {key.block_hash.hex()} "
            f"namespace {key.namespace.hex()[:16]}: {reason.label}"
        )
    if len(report.faults) > len(shown):
        lines.append(f"  ... and {len(report.faults) - len(shown)} more (--json lists them all)")
    lines.append("")
    header = ("namespace", "state", "model", "form", *COUNT_FIELDS)
    rows = [header]
    for n in report.namespaces:
        model = (n.version_key or {}).get("model_id", "?")
        listed = [(f, c) for f, c in n.forms.items() if c.entries] or [(RECORD_FORMS[0], n.forms[RECORD_FORMS[0]])]
        for form, c in listed:
            counts = [format_bytes(c.bytes) if k == "bytes" else str(getattr(c, k)) for k in COUNT_FIELDS]
            rows.append((n.namespace.hex()[:16], n.state, model[:24], form.value, *counts))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        lines.append(
            "  ".join(cell.ljust(w) if i < 4 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths))).rstrip()
        )
    return "\n".join(lines)


def _time(t: float | None) -> str:
    return "-" if t is None else datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat(timespec="seconds")
