"""README.md's client snippet runs as written against the default daemon: `kvtier serve` with no config,
started in a folder, and the snippet run by the same user in that folder.

Both as root and as an unprivileged user (`nobody`, by setpriv, when the suite runs as root): with no flag, no
config and no $KVTIER_MODE the mode is `user` whoever runs it (issue 41: root used to get the system defaults).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534


def snippet() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("An engine links `kvtier.client`") :]
    block = re.search(r"```python\n(.*?)```", section, re.S)
    assert block, "no python block after 'An engine links `kvtier.client`' in README.md"
    return block.group(1)


def as_user(who: str) -> list[str]:
    """The command prefix that runs a process as root or as a plain user."""
    if who == "root":
        if os.geteuid() != 0:
            pytest.skip("the suite does not run as root")
        return []
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot start the non-root default daemon")
    prefix = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    # A checkout under a folder only root may enter (root's home is 0700) cannot be imported by that user.
    if subprocess.run([*prefix, "test", "-r", str(REPO / "kvtier" / "__init__.py")]).returncode != 0:
        pytest.skip(f"user nobody cannot read this checkout ({REPO}: it or a folder above it is closed to others)")
    return prefix


@pytest.fixture
def work() -> Iterator[Path]:
    """A folder the plain user owns the run of (pytest's tmp_path is root-only): the daemon puts .kvtier/ here."""
    with tempfile.TemporaryDirectory(prefix="kvtier-readme-") as d:
        os.chmod(d, 0o777)
        yield Path(d)


@pytest.mark.parametrize("who", ["user", "root"])
def test_readme_client_snippet_runs_against_the_default_daemon(work: Path, who: str) -> None:
    (work / "snippet.py").write_text(snippet())
    env = {k: v for k, v in os.environ.items() if k not in ("KVTIER_CONFIG", "KVTIER_SOCKET", "NOTIFY_SOCKET")}
    env.update(PYTHONPATH=str(REPO), HOME=str(work))
    for k in ("RUNTIME_DIRECTORY", "STATE_DIRECTORY", "KVTIER_MODE"):  # these select the system mode
        env.pop(k, None)
    prefix = as_user(who)
    log = open(work / "daemon.log", "wb")  # noqa: SIM115 - closed below, after the daemon exits
    daemon = subprocess.Popen(
        [*prefix, sys.executable, "-m", "kvtier.cli", "serve"], cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        sock = work / ".kvtier" / "kvtier.sock"
        deadline = time.monotonic() + 120
        while not sock.exists():
            assert daemon.poll() is None, (work / "daemon.log").read_text()
            assert time.monotonic() < deadline, "the default daemon did not create its socket in 120 s"
            time.sleep(0.1)
        proc = subprocess.run(
            [*prefix, sys.executable, "snippet.py"], cwd=work, env=env, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[0].startswith("OffloadReport(written=18,") and "persisted=True" in lines[0], lines
        assert lines[1].startswith("96 {"), lines  # the hit the comment promises
        counts = ast.literal_eval(lines[1].split(" ", 1)[1])
        assert counts["compressed"] == {"REUSE": 6}  # c4 and c16, blocks 0-2: resident since the offload
        assert lines[2].startswith("torch.float32 ("), lines
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(60)
        log.close()
    assert daemon.returncode == 0, (work / "daemon.log").read_text()
