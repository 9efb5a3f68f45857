"""The systemd unit against the cluster's endpoints (issue 40): the shipped kvtier.service blocks a remote master,
the shipped cluster drop-in lets it through, and `kvtier config show` says which endpoints the installed unit
would block (read from a real /etc/systemd/system, in a private mount namespace)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.cluster.unit_check import installed_unit, parse_policy, unit_blocks
from kvtier.core.cluster_config import ClusterConfig
from support.daemon import child_env

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "kvtier.service"
DROPIN = REPO / "systemd" / "drop-ins" / "kvtier-cluster.conf"
REMOTE = ClusterConfig(
    enabled=True,
    master="10.0.0.5:50051",
    metadata="http://10.0.0.5:8080/metadata",
    admin="http://10.0.0.6:9003",
)


def _texts(*paths: Path) -> list[tuple[Path, str]]:
    return [(p, p.read_text()) for p in paths]


def test_the_shipped_unit_blocks_a_remote_cluster_and_the_drop_in_allows_it() -> None:
    blocked = unit_blocks(REMOTE, _texts(UNIT))
    assert [(b.role, b.address) for b in blocked] == [
        ("master", "10.0.0.5"),
        ("metadata", "10.0.0.5"),
        ("admin", "10.0.0.6"),
    ]
    assert "IPAddressAllow=" in blocked[0].why and str(UNIT) in blocked[0].why
    assert unit_blocks(REMOTE, _texts(UNIT, DROPIN)) == []
    # a loopback cluster (tests, one host) passes the unit as shipped; a cluster that is off is never checked
    assert unit_blocks(ClusterConfig(enabled=True), _texts(UNIT)) == []
    assert unit_blocks(ClusterConfig(enabled=False, master="10.0.0.5:1"), _texts(UNIT)) == []
    # an etcd cluster outside the drop-in's prefix is still blocked, by each endpoint
    etcd = ClusterConfig(enabled=True, etcd="192.168.1.2:2379;10.1.1.1:2379", metadata="etcd://192.168.1.2:2379")
    assert [(b.role, b.endpoint) for b in unit_blocks(etcd, _texts(UNIT, DROPIN))] == [
        ("etcd", "192.168.1.2:2379"),
        ("metadata", "192.168.1.2:2379"),
    ]


def test_policy_follows_systemd_list_semantics(tmp_path: Path) -> None:
    """An empty assignment resets a list; allow wins over deny; entries outside [Service] do not count."""
    reset = tmp_path / "reset.conf"
    reset.write_text("[Service]\nIPAddressDeny=\n")
    assert unit_blocks(REMOTE, _texts(UNIT, reset)) == []  # nothing denied any more
    other = tmp_path / "other.conf"
    other.write_text("[Unit]\nIPAddressAllow=any\n[Service]\nIPAddressAllow=10.0.0.5/32 ::1\n")
    policy = parse_policy(_texts(UNIT, other))
    assert [b.address for b in unit_blocks(REMOTE, _texts(UNIT, other))] == ["10.0.0.6"]
    assert len(policy.allow) == 4  # localhost (two), 10.0.0.5/32 and ::1
    names = ClusterConfig(enabled=True, master="cluster-master.invalid:50051", metadata="http://127.0.0.1:1/m")
    (b,) = unit_blocks(names, _texts(UNIT), resolve=lambda host: [])
    assert b.role == "master" and "does not resolve" in b.why
    assert unit_blocks(names, _texts(UNIT), resolve=lambda host: ["127.0.0.2"]) == []


def test_installed_unit_reads_drop_ins_in_systemds_order(tmp_path: Path) -> None:
    etc, lib = tmp_path / "etc/systemd/system", tmp_path / "lib/systemd/system"
    (lib / "kvtier.service.d").mkdir(parents=True)
    (etc / "kvtier.service.d").mkdir(parents=True)
    shutil.copy(UNIT, lib / "kvtier.service")
    (lib / "kvtier.service.d" / "b.conf").write_text("[Service]\nIPAddressAllow=10.0.0.6\n")
    (etc / "kvtier.service.d" / "b.conf").write_text("[Service]\nIPAddressAllow=10.0.0.5\n")  # overrides lib's b
    (lib / "kvtier.service.d" / "a.conf").write_text("[Service]\n")
    texts = installed_unit(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p, _ in texts] == [
        "lib/systemd/system/kvtier.service",
        "lib/systemd/system/kvtier.service.d/a.conf",
        "etc/systemd/system/kvtier.service.d/b.conf",
    ]
    assert [b.address for b in unit_blocks(REMOTE, texts)] == ["10.0.0.6"]
    assert installed_unit(tmp_path / "nothing") == []


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_reads_the_drop_in_and_prints_nothing(tmp_path: Path) -> None:
    """`systemd-analyze verify` exits 0 on misspelt keys: the test fails on any output, and shows the drop-in
    is read at all by a misspelt copy of it that does print."""
    exe = tmp_path / "kvtier"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    (tmp_path / "kvtier.service").write_text(UNIT.read_text().replace("/opt/kvtier/bin/kvtier", str(exe)))
    (tmp_path / "kvtier.service.d").mkdir()
    conf = tmp_path / "kvtier.service.d" / "cluster.conf"

    def verify() -> str:
        run = subprocess.run(
            ["systemd-analyze", "verify", str(tmp_path / "kvtier.service")], capture_output=True, text=True
        )
        return run.stdout + run.stderr

    conf.write_text(DROPIN.read_text())
    assert verify() == ""
    conf.write_text(DROPIN.read_text().replace("IPAddressAllow", "IPAdressAllow"))
    assert "IPAdressAllow" in verify()


def _can_unshare() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare(), reason="needs root and unshare (a private mount namespace over /etc)")
def test_config_show_warns_while_the_installed_unit_blocks_the_cluster(tmp_path: Path) -> None:
    config = tmp_path / "kvtier.toml"
    config.write_text(
        '[cluster]\nenabled = true\nmaster = "10.0.0.5:50051"\nmetadata = "http://10.0.0.5:8080/metadata"\n'
    )
    units = tmp_path / "units"
    units.mkdir()
    shutil.copy(UNIT, units / "kvtier.service")

    def show() -> subprocess.CompletedProcess:
        # /etc/systemd/system replaced, in this process's own mount namespace only, by the test's folder
        script = (
            f"mount --bind {units} /etc/systemd/system && "
            f"exec {sys.executable} -m kvtier.cli config show --config {config}"
        )
        return subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=120,
        )

    run = show()
    assert run.returncode == 0, run.stderr
    assert "warning: kvtier.service would block the cluster's master 10.0.0.5:50051" in run.stderr, run.stderr
    assert "metadata 10.0.0.5:8080" in run.stderr and 'master = "10.0.0.5:50051"' in run.stdout
    (units / "kvtier.service.d").mkdir()
    shutil.copy(DROPIN, units / "kvtier.service.d" / "cluster.conf")
    run = show()
    assert run.returncode == 0 and "warning" not in run.stderr, run.stderr
