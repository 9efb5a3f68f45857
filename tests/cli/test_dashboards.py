"""dashboards/ (issue 41): the Grafana dashboard's and the alert rules' queries name only metrics kvtier exposes,
and the rules pass `promtool check rules`.

What exists: every family the daemon's metrics code declares (some appear only once something happened: a
recompute, a verifier action), checked against a live `kvtier serve`'s /metrics (everything it exposes is among
them), plus the cluster tier's families rendered by their own code from a cluster stats document."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvtier.client import Client
from kvtier.daemon.cluster_metrics import cluster_families
from support.daemon import DaemonProc

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "dashboards" / "kvtier-grafana.json"
RULES = REPO / "dashboards" / "kvtier-alerts.yml"
METRIC = re.compile(r"\b(kvtier_[a-z0-9_]+)\b")
# a collector's families (CounterMetricFamily(...)) and the client library's own metrics (Counter(...))
DECLARED = re.compile(r'\b(Counter|Gauge|Histogram)(?:MetricFamily)?\(\s*"(kvtier_[a-z0-9_]+)"')
SUFFIXES = {"Counter": ("_total",), "Histogram": ("_bucket", "_sum", "_count"), "Gauge": ("",)}


def _declared_names() -> set[str]:
    """The series names of every family kvtier/daemon/*.py declares, by its type."""
    names: set[str] = set()
    for source in (REPO / "kvtier" / "daemon").glob("*.py"):
        for kind, family in DECLARED.findall(source.read_text()):
            names |= {family + suffix for suffix in SUFFIXES[kind]}
    return names


def _exposed_names(text: str) -> set[str]:
    """Every series name an exposition can carry: gauges as named, counters with _total, histograms' parts."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names |= {
                "counter": {name if name.endswith("_total") else f"{name}_total"},
                "histogram": {f"{name}_bucket", f"{name}_sum", f"{name}_count"},
            }.get(kind, {name})
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def _cluster_exposition() -> str:
    hist = {"bounds": [0.001, 0.01], "counts": [1, 0, 0], "sum_s": 0.0005}
    doc = {
        "cluster": {
            "up": True,
            "misses": {"absent": 1},
            "bytes_loaded": 1,
            "bytes_stored": 1,
            "lookup_latency": hist,
            "load_latency": hist,
        },
        "backlog_bytes": 0,
        **{e: 0 for e in ("local_hits", "cluster_hits", "queued", "dropped", "written_through", "promoted")},
        "background_failed": 0,
    }

    class Cluster:
        def collect(self):  # type: ignore[no-untyped-def]
            yield from cluster_families(doc)

    registry = CollectorRegistry()
    registry.register(Cluster())
    return generate_latest(registry).decode()


@pytest.fixture(scope="module")
def exposed(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    daemon = DaemonProc(tmp_path_factory.mktemp("metrics"))
    try:
        with Client(daemon.socket) as c:
            address = c.stats().daemon.metrics
        body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    finally:
        daemon.close()
    live, declared = _exposed_names(body), _declared_names()
    assert live <= declared, f"exposed but not found declared: {sorted(live - declared)}"  # the reading works
    assert _cluster_exposition_names() <= declared and "kvtier_cluster_up" in declared
    assert "kvtier_lookup_objects_total" in live
    return declared


def _cluster_exposition_names() -> set[str]:
    return _exposed_names(_cluster_exposition())


def _dashboard_queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in doc["panels"] for t in p["targets"]]
    queries += [v["query"] for v in doc["templating"]["list"] if v["type"] == "query"]
    return queries


def _rule_queries() -> list[str]:
    return [m.group(1) for m in re.finditer(r"^\s+expr: (.+)$", RULES.read_text(), re.M)]


def test_dashboard_and_rules_name_only_metrics_that_exist(exposed: set[str]) -> None:
    dashboard, rules = _dashboard_queries(), _rule_queries()
    assert len(dashboard) >= 12 and len(rules) >= 6
    unknown = {name for q in dashboard + rules for name in METRIC.findall(q)} - exposed
    assert not unknown, f"queries name metrics kvtier does not expose: {sorted(unknown)}"


def test_the_check_can_fail(exposed: set[str]) -> None:
    """A misspelt metric in a query is caught by the same comparison."""
    assert set(METRIC.findall("rate(kvtier_lookup_object_total[5m])")) - exposed == {"kvtier_lookup_object_total"}


def test_rules_cover_the_issues_alerts() -> None:
    text = RULES.read_text()
    for alert in (
        "KvtierStoreNearBudget",
        "KvtierVerifierStalled",
        "KvtierClusterDown",
        "KvtierCorruptRecords",
        "KvtierWriteBackBlocked",
        "KvtierHitRateCollapse",
    ):
        assert f"alert: {alert}\n" in text, alert


def test_promtool_check_rules() -> None:
    if shutil.which("promtool") is None:
        why = "promtool not installed (Debian: apt-get install prometheus; .ci/run installs it)"
        if os.environ.get("CI") == "true":  # CI installs it: missing there is a failed install, not a skip
            pytest.fail(why)
        pytest.skip(why)
    proc = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr
