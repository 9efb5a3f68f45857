"""The unit files: `systemd-analyze verify` prints nothing at all (it exits 0 on misspelt keys), and the hardening
we promise."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CONFIG = "/etc/kvtier/kvtier.toml"
UNITS = sorted((Path(__file__).resolve().parents[2] / "systemd").glob("kvtier*"))
INSTALLED = "/opt/kvtier/bin/kvtier"  # the venv of docs/systemd.md

pytestmark = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze not installed (apt-get install systemd; .ci/run does this) - unit files NOT verified",
)


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The units with the install path of `kvtier` pointed at a real executable here (verify checks it exists)."""
    d = tmp_path_factory.mktemp("units")
    exe = d / "kvtier"
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} -m kvtier.cli "$@"\n')
    exe.chmod(0o755)
    for unit in UNITS:
        (d / unit.name).write_text(unit.read_text().replace(INSTALLED, str(exe)))
    return d


def test_every_unit_is_shipped() -> None:
    assert {u.name for u in UNITS} == {
        "kvtier.service",
        "kvtier-verifier.service",
        "kvtier-audit.service",
        "kvtier-audit.timer",
    }


@pytest.mark.parametrize("unit", [u.name for u in UNITS])
def test_verify_prints_nothing(staged: Path, unit: str) -> None:
    proc = subprocess.run(["systemd-analyze", "verify", str(staged / unit)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stdout + proc.stderr


def test_verify_catches_a_misspelt_key(staged: Path, tmp_path: Path) -> None:
    """The check above can fail: a typo makes verify talk even though it still exits 0."""
    bad = tmp_path / "kvtier.service"
    bad.write_text((staged / "kvtier.service").read_text().replace("NoNewPrivileges=", "NoNewPrivilege="))
    proc = subprocess.run(["systemd-analyze", "verify", str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.stdout + proc.stderr != ""


def _keys(unit: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in (UNITS[0].parent / unit).read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out.setdefault(k.strip(), v.strip())
    return out


def test_daemon_unit_shape() -> None:
    k = _keys("kvtier.service")
    assert k["Type"] == "notify" and int(k["WatchdogSec"]) > 0
    assert k["RuntimeDirectory"] == "kvtier" and k["StateDirectory"] == "kvtier"
    assert k["User"] == "kvtier" and k["NoNewPrivileges"] == "yes" and k["PrivateTmp"] == "yes"
    assert k["ProtectSystem"] == "strict" and "/var/lib/kvtier" in k["ReadWritePaths"]
    # GPUDirect Storage needs /dev/nvidia* and /run/udev: nothing may hide them.
    for hiding in (
        "PrivateDevices",
        "DevicePolicy",
        "DeviceAllow",
        "InaccessiblePaths",
        "TemporaryFileSystem",
        "PrivateUsers",
    ):
        assert hiding not in k, hiding
    # the socket's directory is searchable by all: the daemon admits each peer itself (SO_PEERCRED, allowed_*)
    assert k["RuntimeDirectoryMode"] == "0755"
    assert k["ExecStart"] == f"{INSTALLED} serve --config {CONFIG}"


def test_verifier_reads_the_daemons_config_and_follows_it() -> None:
    k = _keys("kvtier-verifier.service")
    assert k["ExecStart"] == f"{INSTALLED} verifier run --store /var/lib/kvtier/store --config {CONFIG}"
    assert "kvtier.service" in k["After"].split()  # the store exists once the daemon is READY
    assert k["PartOf"] == "kvtier.service" and k["ReloadPropagatedFrom"] == "kvtier.service"
    assert "kvtier-verifier.service" in _keys("kvtier.service")["Wants"].split()


def test_audit_is_deep_and_fails_its_unit_on_problems() -> None:
    k = _keys("kvtier-audit.service")
    assert k["ExecStart"] == f"{INSTALLED} audit --store /var/lib/kvtier/store --deep --json"
    assert "SuccessExitStatus" not in k  # exit 1 (corruption found) must fail the unit
    timer = _keys("kvtier-audit.timer")
    assert timer["OnCalendar"] and timer["Persistent"] == "true"


def test_security_score_is_ok(staged: Path) -> None:
    proc = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(staged / "kvtier.service")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    last = [line for line in proc.stdout.splitlines() if "Overall exposure level" in line]
    assert last, proc.stdout + proc.stderr
    score = float(last[0].split(":")[1].split()[0])
    assert score <= 2.5, last[0]
