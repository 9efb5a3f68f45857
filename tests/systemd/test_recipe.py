"""docs/systemd.md's install block, run as written in a throwaway root, up to its first `systemctl`.

A private mount namespace lays overlays over /etc, /opt and /var/lib, so `useradd`, the venv in
/opt/kvtier and the files in /etc land in this test's folder, never on the host. What cannot run
here is stood in for at the edge: `sudo` (we are root already) and `apt-get` (no package download
in a test; the stand-in checks that the packages it names are installed). Then the installed units
are verified against the installed `kvtier` and the real `kvtier` user: `systemd-analyze verify`
prints nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "systemd.md"
OVERLAID = ("etc", "opt", "var/lib")
UNITS = ("kvtier.service", "kvtier-verifier.service", "kvtier-audit.service", "kvtier-audit.timer")


def _can_overlay() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("systemd-analyze") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True)
    return probe.returncode == 0 and Path("/usr/bin/python3").exists()


# It installs torch into a fresh venv (one to two minutes): CI runs it on its own (tests/systemd/run.sh), not
# inside the main suite's ten minutes.
RUN_ENV = "KVTIER_RECIPE_TEST"


def _why_not() -> str | None:
    if os.environ.get(RUN_ENV) != "1":
        return f"runs with {RUN_ENV}=1 (tests/systemd/run.sh)"
    if not _can_overlay():
        return "needs root, unshare (mount namespaces), systemd-analyze and /usr/bin/python3"
    return None


WHY_NOT = _why_not()


def install_block() -> list[str]:
    """The commands of the first bash block under '## Install', up to the first systemctl (not run here)."""
    text = DOC.read_text()
    section = text[text.index("## Install") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, f"no bash block under '## Install' in {DOC}"
    lines = [ln for ln in block.group(1).splitlines() if ln.strip()]
    cut = next(i for i, ln in enumerate(lines) if "systemctl" in ln)
    return lines[:cut]


def test_the_block_is_the_whole_recipe() -> None:
    """The parts the issue names are in the block as written (a test of the doc, so the run below means something)."""
    lines = install_block()
    joined = "\n".join(lines)
    assert "python3 -m venv /opt/kvtier" in joined and "/opt/kvtier/bin/pip install" in joined
    assert "sudo pip install" not in joined  # PEP 668: refused on Debian 12
    assert "config init --system" in joined
    assert all(unit in joined for unit in UNITS)


def _host_user() -> str:
    return subprocess.run(["getent", "passwd", "kvtier"], capture_output=True, text=True).stdout


@pytest.mark.slow
@pytest.mark.timeout(700)  # the recipe's own bound is 600 s (below): pytest's default 300 s cut a loaded machine short
@pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")
def test_recipe_installs_in_a_throwaway_root(tmp_path: Path) -> None:
    host_user_before = _host_user()
    shims = tmp_path / "shims"
    shims.mkdir()
    (shims / "sudo").write_text('#!/bin/sh\nexec "$@"\n')
    (shims / "apt-get").write_text(
        textwrap.dedent("""\
        #!/bin/sh
        # stand-in: no downloads in a test; every package named must be installed already
        for arg in "$@"; do
          case "$arg" in
            -*|install) ;;
            *) dpkg -s "$arg" >/dev/null 2>&1 || { echo "not installed: $arg" >&2; exit 100; } ;;
          esac
        done
        """)
    )
    for shim in shims.iterdir():
        shim.chmod(0o755)
    mounts = "\n".join(
        f"mkdir -p {tmp_path}/up/{d} {tmp_path}/work/{d} && "
        f"mount -t overlay overlay -o lowerdir=/{d},upperdir={tmp_path}/up/{d},workdir={tmp_path}/work/{d} /{d}"
        for d in OVERLAID
    )
    recipe = "\n".join(install_block())
    checks = textwrap.dedent(f"""\
        id kvtier
        /opt/kvtier/bin/kvtier --version
        /opt/kvtier/bin/kvtier doctor --system --json > {tmp_path}/doctor.json || echo "doctor exit $?"
        cd /etc/systemd/system
        systemd-analyze verify {" ".join(UNITS)} > {tmp_path}/verify.out 2>&1
        """)
    # "a clone of kvtier": the tracked tree, so pip's build/ and egg-info land there, not in this checkout
    clone = tmp_path / "kvtier"
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], check=True, capture_output=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (REPO / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, clone / name)
    script = tmp_path / "run.sh"
    script.write_text(f"set -euo pipefail\n{mounts}\ncd {clone}\n{recipe}\n{checks}")
    env = {
        "PATH": f"{shims}:/usr/sbin:/usr/bin:/sbin:/bin",  # Debian's python3, as on a fresh host
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
        **{k: v for k, v in os.environ.items() if k.startswith("PIP_")},  # this machine's wheel sources
    }
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "bash", str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "uid=" in proc.stdout and "kvtier" in proc.stdout
    assert (tmp_path / "verify.out").read_text() == ""  # systemd-analyze verify said nothing about any unit
    up = tmp_path / "up"
    assert {p.name for p in (up / "etc/systemd/system").iterdir()} >= set(UNITS)
    config = (up / "etc/kvtier/kvtier.toml").read_text()
    # the system defaults, not the installing user's (./.kvtier, metrics off), and the file says its mode
    assert (
        'mode = "system"' in config
        and 'socket = "/run/kvtier/kvtier.sock"' in config
        and 'root = "/var/lib/kvtier/store"' in config
    )
    assert 'address = "127.0.0.1:9641"' in config and ".kvtier" not in config
    assert (up / "opt/kvtier/bin/kvtier").exists() and (up / "etc/passwd").exists()
    assert _host_user() == host_user_before  # the host's accounts were not touched
    # kvtier doctor, installed: the system mode from the file the recipe wrote, and nothing fails there
    doctor = {c["name"]: c for c in json.loads((tmp_path / "doctor.json").read_text())}
    assert doctor["config"]["status"] == "ok" and "system mode" in doctor["config"]["detail"], doctor
    assert "/etc/kvtier/kvtier.toml" in doctor["config"]["detail"] and "doctor exit" not in proc.stdout, doctor
